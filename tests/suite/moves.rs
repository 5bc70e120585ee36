//! Workspaces that leave their node (issue #34), between real runnerd processes on loopback
//! with their own data directories: a push by object hash, the same tree on the target, the
//! fence on the source (409 `movedTo` for executions, uploads and managed runs), a second move
//! that sends only what changed, epochs that refuse a stale copy, a managed run that holds its
//! workspace, projects as well as keys, the fenced copy removed after its grace, and hostile
//! input on the target's routes (a digest that lies, a cut stream, a tree naming a missing
//! blob or a name that escapes, a record that does not re-canonicalise) that leaves both
//! copies as they were.

use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use runner_tests::server::{Server, ServerOptions, keyed_shell_request};

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn url(server: &Server) -> String {
    format!("http://{}", server.address().trim_start_matches("http://"))
}

fn node(grace_secs: u64) -> Server {
    Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_MOVED_WORKSPACE_GRACE_SECS".into(), grace_secs.to_string())],
        ..ServerOptions::default()
    })
}

async fn shell(server: &Server, key: &str, code: &str) -> Value {
    let reply = server
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", key, code))
        .await
        .unwrap();
    let body = reply.json();
    assert_eq!(reply.status, 200, "{body}");
    body
}

async fn push(from: &Server, mut body: Value) -> (u16, Value) {
    let client = from.client();
    let _ = client.get("/health").await;
    // Two identical pushes signed at one timestamp carry one signature, which the replay
    // check refuses (as it should a captured request): each push says something of its own.
    body["requestId"] = json!(runnerctl::client::new_execution_id());
    let reply = client.post_signed("/workspace-transfer/push", &body).await.unwrap();
    (reply.status, reply.json())
}

async fn where_is(server: &Server, query: &str) -> Value {
    let reply = server.client().get(&format!("/workspace-transfer/where?{query}")).await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.json());
    reply.json()
}

const TREE: &str = "mkdir -p d/empty d/sub && printf 'hello' > d/sub/a.txt && printf '#!/bin/sh\\necho hi\\n' > run.sh \
    && chmod 755 run.sh && ln -s d/sub/a.txt link && ln -s /nowhere dangling \
    && head -c 300000 /dev/urandom > big.bin && printf 'x' > \"$(printf 'caf\\351')\"";

#[tokio::test]
async fn a_push_moves_the_tree_fences_the_source_and_a_second_push_sends_only_the_change() {
    let (a, b) = (node(3600), node(3600));
    let key = "moves/one";
    let made = shell(&a, key, TREE).await;
    let tree_a = made["workspaceSnapshot"].clone();

    let (status, moved) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");
    assert_eq!(moved["epoch"], 1);
    assert_eq!(moved["tree"], tree_a, "the tree sent is the one the last run left");
    assert!(moved["objects"]["sent"].as_u64().unwrap() >= 8, "{moved}");

    // The target's next run sees exactly the source's files.
    let seen = shell(&b, key, "true").await;
    assert_eq!(seen["workspaceSnapshot"], tree_a, "same WorkspaceTree digest on the target");
    let listing =
        shell(&b, key, "stat -c '%a %F %n' run.sh d/empty link && readlink link dangling && cat d/sub/a.txt")
            .await;
    let out = listing["stdout"].as_str().unwrap();
    for want in [
        "755 regular file run.sh",
        "directory d/empty",
        "symbolic link link",
        "d/sub/a.txt",
        "/nowhere",
        "hello",
    ] {
        assert!(out.contains(want), "{want:?} missing from {out}");
    }

    // The source is fenced: executions, uploads and managed runs answer where it went.
    let target = url(&b);
    let refused = a
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", key, "echo no > x"))
        .await
        .unwrap();
    assert_eq!(refused.status, 409, "{}", refused.json());
    assert_eq!(
        (refused.json()["code"].clone(), refused.json()["movedTo"].clone()),
        (json!("workspace_moved"), json!(target))
    );
    let upload = a
        .client()
        .send_bytes("PUT", &format!("/remote-workspace/file?workspace={key}&path=u.txt"), &[], b"u".to_vec())
        .await
        .unwrap();
    assert_eq!((upload.status, upload.json()["movedTo"].clone()), (409, json!(target)));
    let mut managed = keyed_shell_request("a", "s", key, "true");
    managed["executionId"] = json!(runnerctl::client::new_execution_id());
    let run = a.client().post_signed("/shell-executions", &managed).await.unwrap();
    assert_eq!((run.status, run.json()["movedTo"].clone()), (409, json!(target)));
    let w = where_is(&a, &format!("workspace={key}")).await;
    assert_eq!(
        (w["fenced"].clone(), w["movedTo"].clone(), w["epoch"].clone()),
        (json!(true), json!(target), json!(1))
    );
    assert_eq!(where_is(&b, &format!("workspace={key}")).await["epoch"], 1);

    // Back again after one small change: only that change travels.
    shell(&b, key, "printf 'changed' > d/sub/a.txt").await;
    let (status, back) = push(&b, json!({"workspace": key, "to": url(&a)})).await;
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["epoch"], 2);
    let (sent, total) = (back["bytes"]["sent"].as_u64().unwrap(), back["bytes"]["total"].as_u64().unwrap());
    assert!(sent * 20 < total, "only the change is sent: {sent} of {total} bytes");
    let again = shell(&a, key, "cat d/sub/a.txt").await;
    assert_eq!(again["stdout"], "changed");
    assert_eq!(
        where_is(&a, &format!("workspace={key}")).await["fenced"],
        false,
        "a copy that came back is live again"
    );

    // A copy that is fenced cannot push; a stale epoch is refused by the target.
    let (status, stale) = push(&b, json!({"workspace": key, "to": url(&a)})).await;
    assert_eq!((status, stale["code"].clone()), (409, json!("workspace_moved")), "{stale}");
    let head = where_is(&a, &format!("workspace={key}")).await["head"].clone();
    let old = a
        .client()
        .post_signed("/workspace-transfer/commit", &json!({"workspace": key, "head": head, "epoch": 1}))
        .await
        .unwrap();
    assert_eq!((old.status, old.json()["code"].clone()), (409, json!("stale_epoch")), "{}", old.json());
}

#[tokio::test]
async fn a_managed_run_holds_its_workspace_and_projects_move_too() {
    let (a, b) = (node(3600), node(3600));
    let key = "moves/busy";
    shell(&a, key, "echo x > f").await;
    let mut managed = keyed_shell_request("a", "s", key, "sleep 3");
    managed["executionId"] = json!(runnerctl::client::new_execution_id());
    let id = managed["executionId"].as_str().unwrap().to_owned();
    assert_eq!(a.client().post_signed("/shell-executions", &managed).await.unwrap().status, 202);
    let (status, busy) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!((status, busy["code"].clone()), (409, json!("workspace_busy")), "{busy}");
    runner_tests::server::finished_record(&a.client(), &id, "s", "a").await;
    let (status, moved) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");

    // A workspace with another nested in it (whose leases live inside it) does not move.
    shell(&a, "moves/nest", "echo p > p").await;
    shell(&a, "moves/nest/inner", "echo i > i").await;
    let (status, nested) = push(&a, json!({"workspace": "moves/nest", "to": url(&b)})).await;
    assert_eq!((status, nested["code"].clone()), (409, json!("nested_workspaces")), "{nested}");
    let (status, inner) = push(&a, json!({"workspace": "moves/nest/inner", "to": url(&b)})).await;
    assert_eq!(status, 200, "the nested one itself moves: {inner}");

    // A project workspace (a directory under projects/) moves by its path.
    let root = a.project_workspace("p1");
    std::fs::write(root.join("notes.md"), "n").unwrap();
    let project = "project/sessions/p1/workspace";
    let (status, moved) = push(&a, json!({"project": project, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");
    let there = b.path(&format!("projects/{project}/notes.md"));
    assert_eq!(std::fs::read_to_string(there).unwrap(), "n");
}

#[tokio::test]
async fn the_fenced_copy_is_removed_after_its_grace() {
    let (a, b) = (node(0), node(3600));
    let key = "moves/grace";
    shell(&a, key, "echo x > f && mkdir -p g/h").await;
    let (status, moved) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");
    let dir = a.path(&format!("remote-workspaces/{key}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::fs::read_dir(&dir).unwrap().next().is_some() {
        assert!(std::time::Instant::now() < deadline, "the fenced copy was not removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let w = where_is(&a, &format!("workspace={key}")).await;
    assert!(w["removedAt"].is_string(), "{w}");
    assert_eq!(w["movedTo"], json!(url(&b)), "the fence stays after the files go");
}

/// Sends raw frames to the target's object stream (signed over its query, as runnerd does).
async fn stream_objects(server: &Server, frames: Vec<u8>) -> (u16, Value) {
    let client = server.client();
    let query = format!("/workspace-transfer/objects?stream={}", runnerctl::client::new_execution_id());
    let [ts, sig] = client.signature_headers(query.as_bytes());
    let headers = [client.bearer(), ts, sig];
    let reply = client.raw("POST", &query, &headers, frames).await.unwrap();
    (reply.status, reply.json())
}

fn frame(pool: &str, bytes: &[u8], claimed: Option<&str>) -> Vec<u8> {
    let digest = claimed.map_or_else(|| hex(bytes), str::to_owned);
    let mut out = format!("{pool} {digest} {}\n", bytes.len()).into_bytes();
    out.extend_from_slice(bytes);
    out
}

fn record_ref(bytes: &[u8]) -> Value {
    // Keys in canonical order: serde_json keeps insertion order here (preserve_order).
    json!({"digest": format!("sha256:{}", hex(bytes)), "mediaType": "application/vnd.sciencediscovery.record.v1+json",
           "pool": "agent-state", "size": bytes.len()})
}

fn file_ref(bytes: &[u8]) -> Value {
    json!({"digest": format!("sha256:{}", hex(bytes)), "mediaType": "application/octet-stream", "pool": "data",
           "size": bytes.len()})
}

/// A record's canonical bytes (keys sorted, no spaces: what serde_json writes for these).
fn record(kind: &str, value: Value, deps: Vec<Value>) -> Vec<u8> {
    json!({"dependencies": deps, "kind": kind, "schemaVersion": 1, "value": value}).to_string().into_bytes()
}

fn head_over(tree: &[u8]) -> Vec<u8> {
    let t = record_ref(tree);
    record(
        "WorkspaceMutation",
        json!({"id": "x", "kind": "test", "status": "completed", "workspace": t}),
        vec![t],
    )
}

#[tokio::test]
async fn hostile_objects_and_heads_change_nothing_on_the_target() {
    let (a, b) = (node(3600), node(3600));
    let key = "moves/hostile";
    // b's copy moved away to a (fenced, files kept for the grace): a copy an arriving head
    // may replace, so every refusal below is the head's own.
    shell(&b, key, "echo keep > kept").await;
    let (status, moved) = push(&b, json!({"workspace": key, "to": url(&a)})).await;
    assert_eq!(status, 200, "{moved}");
    let kept = b.path(&format!("remote-workspaces/{key}/kept"));
    let before = where_is(&b, &format!("workspace={key}")).await;

    // A digest that does not match its bytes: refused, nothing published under it.
    let liar = hex(b"the real bytes");
    let (status, body) = stream_objects(&b, frame("data", b"other bytes!!!", Some(&liar))).await;
    assert_eq!(status, 400, "{body}");
    let asked = json!({"objects": [file_ref(b"the real bytes")]});
    let missing = b.client().post_signed("/workspace-transfer/missing", &asked).await.unwrap().json();
    assert_eq!(missing["missing"].as_array().unwrap().len(), 1, "{missing}");

    // An object larger than the disk has free is refused before a byte of it is read.
    let huge = format!("data {} {}\n", hex(b"x"), 1u64 << 45);
    let (status, body) = stream_objects(&b, huge.into_bytes()).await;
    assert_eq!((status, body["code"].clone()), (507, json!("insufficient_space")), "{body}");

    // A stream cut inside a frame: the complete object before it stays, the cut one does not.
    let mut cut = frame("data", b"complete", None);
    let partial = frame("data", b"never finished", None);
    cut.extend_from_slice(&partial[..partial.len() - 4]);
    let (status, _) = stream_objects(&b, cut).await;
    assert_eq!(status, 400);
    let asked = json!({"objects": [file_ref(b"complete"), file_ref(b"never finished")]});
    let missing = b.client().post_signed("/workspace-transfer/missing", &asked).await.unwrap().json();
    assert_eq!(
        missing["missing"],
        json!([file_ref(b"never finished")]),
        "resumable: only the cut object is missing"
    );

    // Heads the target must refuse, each with its closure sent: a tree naming a blob that is
    // not there, names that escape, a record that does not re-canonicalise, entries out of
    // order (its files would snapshot to another tree).
    let name = |n: &[u8]| base64url(n);
    let file = |n: &[u8], content: &Value| json!({"content": content, "executable": 0, "name": name(n), "type": "file"});
    let absent = file_ref(b"not sent");
    let present = b"present".to_vec();
    let p = file_ref(&present);
    let tree =
        |entries: Vec<Value>, deps: Vec<Value>| record("WorkspaceTree", json!({"entries": entries}), deps);
    let spaced = b"{\"dependencies\": [], \"kind\": \"WorkspaceTree\", \"schemaVersion\": 1, \"value\": {\"entries\": []}}".to_vec();
    let cases = [
        ("missing blob", tree(vec![file(b"f", &absent)], vec![absent.clone()]), "missing"),
        ("..", tree(vec![file(b"..", &p)], vec![p.clone()]), "name"),
        ("a/b", tree(vec![file(b"a/b", &p)], vec![p.clone()]), "name"),
        ("coordination", tree(vec![file(b".workspace-coordination", &p)], vec![p.clone()]), "name"),
        ("not canonical", spaced, "schema"),
        ("out of order", tree(vec![file(b"b", &p), file(b"a", &p)], vec![p.clone()]), "tree"),
    ];
    for (what, tree, _why) in cases {
        let head = head_over(&tree);
        let mut frames = frame("data", &present, None);
        frames.extend(frame("agent-state", &tree, None));
        frames.extend(frame("agent-state", &head, None));
        let (status, body) = stream_objects(&b, frames).await;
        assert_eq!(status, 200, "{what}: the objects themselves are well-formed: {body}");
        let offer = json!({"workspace": key, "head": record_ref(&head), "epoch": 5});
        let refused = b.client().post_signed("/workspace-transfer/commit", &offer).await.unwrap();
        assert_eq!(
            (refused.status, refused.json()["code"].clone()),
            (400, json!("transfer_refused")),
            "{what}: {}",
            refused.json()
        );
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "keep\n", "{what}: the files stay");
        assert_eq!(
            where_is(&b, &format!("workspace={key}")).await,
            before,
            "{what}: head, epoch and fence stay"
        );
    }

    // A live copy with files of its own is not replaced by a peer's head.
    shell(&a, "moves/other", "echo mine > m").await;
    let head = where_is(&b, &format!("workspace={key}")).await["head"].clone();
    let offer = json!({"workspace": "moves/other", "head": head, "epoch": 9});
    let refused = a.client().post_signed("/workspace-transfer/commit", &offer).await.unwrap();
    assert_eq!(
        (refused.status, refused.json()["code"].clone()),
        (409, json!("workspace_exists")),
        "{}",
        refused.json()
    );

    // Unsigned or wrongly named requests never reach the store.
    let unsigned =
        b.client().post_json("/workspace-transfer/commit", &json!({"workspace": key})).await.unwrap();
    assert_eq!(unsigned.status, 401);
    let (status, body) = push(&a, json!({"workspace": key, "to": "file:///etc/passwd"})).await;
    assert_eq!((status, body["code"].clone()), (400, json!("invalid_transfer_request")));
}

/// Something on `to` that answers 200 to everything (not a runnerd): the move fails and the
/// source stays live.
#[tokio::test]
async fn a_target_that_is_not_a_runnerd_never_fences_the_source() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten().take(8) {
            let mut stream = stream;
            let mut buf = [0u8; 65536];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(300)));
            while stream.read(&mut buf).is_ok_and(|n| n > 0) {}
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}");
        }
    });
    let a = node(3600);
    let key = "moves/fake";
    shell(&a, key, "echo x > f").await;
    let (status, body) = push(&a, json!({"workspace": key, "to": fake})).await;
    assert_eq!(status, 502, "{body}");
    let w = where_is(&a, &format!("workspace={key}")).await;
    assert_eq!((w["fenced"].clone(), w["epoch"].clone()), (json!(false), json!(0)), "{w}");
    shell(&a, key, "cat f").await;

    // The other write routes refuse a fenced copy too, and a restore into it.
    let b = node(3600);
    let (status, moved) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");
    let clear = a
        .client()
        .send_bytes("DELETE", &format!("/remote-workspace?workspace={key}"), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!((clear.status, clear.json()["code"].clone()), (409, json!("workspace_moved")));
    let mut python = keyed_shell_request("a", "s", key, "print(1)");
    python["executionId"] = json!(runnerctl::client::new_execution_id());
    let exec = a.client().post_signed("/execute", &python).await.unwrap();
    assert_eq!((exec.status, exec.json()["movedTo"].clone()), (409, json!(url(&b))), "{}", exec.json());
    let version = w["head"]["digest"].as_str().unwrap().to_owned();
    let (code, out, err) = runnerctl(&a, &["workspace", "restore", key, "--version", &version]);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("409") && err.contains(&url(&b)), "{err}");
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

fn runnerctl(server: &Server, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(runner_tests::bin("runnerctl"))
        .args(["--url", &url(server)])
        .args(args)
        .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
        .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
        .output()
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

#[tokio::test]
async fn runnerctl_pushes_locates_and_restores_a_version_from_history() {
    let (a, b) = (node(3600), node(3600));
    let key = "moves/ctl";
    let first = shell(&a, key, "echo one > f").await["workspaceSnapshot"].clone();
    let v1 = where_is(&a, &format!("workspace={key}")).await["head"]["digest"].as_str().unwrap().to_owned();
    shell(&a, key, "echo two > f && echo extra > g").await;

    // A version from this node's history becomes the files again, as a new version.
    let (code, out, err) = runnerctl(&a, &["workspace", "restore", key, "--version", &v1]);
    assert_eq!(code, 0, "{out}{err}");
    let restored: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(restored["tree"], first, "{restored}");
    assert_ne!(
        restored["head"]["digest"],
        json!(v1),
        "a restore is a new version, the history stays in order"
    );
    let now = shell(&a, key, "cat f; ls").await;
    assert_eq!((now["stdout"].clone(), now["workspaceSnapshot"].clone()), (json!("one\nf\n"), first));
    let (code, _, err) =
        runnerctl(&a, &["workspace", "restore", key, "--version", &format!("sha256:{}", "0".repeat(64))]);
    assert_eq!(code, 1);
    assert!(err.contains("has no version"), "{err}");

    // Push, then where on both sides; a push to the node itself is refused, not deadlocked.
    let (code, out, err) = runnerctl(&a, &["workspace", "push", key, "--to", &url(&a)]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("409"), "{err}");
    let (code, out, err) = runnerctl(&a, &["workspace", "push", key, "--to", &url(&b)]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, _) = runnerctl(&a, &["workspace", "where", key]);
    assert_eq!(code, 0);
    let w: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((w["fenced"].clone(), w["movedTo"].clone()), (json!(true), json!(url(&b))));
    let (_, out, _) = runnerctl(&b, &["workspace", "where", key]);
    let w: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((w["fenced"].clone(), w["epoch"].clone()), (json!(false), json!(1)));
    let (code, _, err) = runnerctl(&a, &["workspace", "where"]);
    assert_eq!(code, 1, "{err}");
}

#[tokio::test]
async fn a_push_goes_only_to_the_configured_peers() {
    let b = node(3600);
    let a = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_TRANSFER_PEERS".into(), format!("http://127.0.0.1:1, {}", url(&b)))],
        ..ServerOptions::default()
    });
    let key = "moves/peers";
    shell(&a, key, "echo x > f").await;
    let (status, refused) = push(&a, json!({"workspace": key, "to": "http://127.0.0.2:4311"})).await;
    assert_eq!((status, refused["code"].clone()), (403, json!("peer_not_allowed")), "{refused}");
    assert_eq!(where_is(&a, &format!("workspace={key}")).await["fenced"], false);
    let (status, moved) = push(&a, json!({"workspace": key, "to": url(&b)})).await;
    assert_eq!(status, 200, "{moved}");
}
