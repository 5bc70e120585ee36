//! Remote workspace routes through HTTP against the real binary (contract §5.1, §7 items
//! 12, 15 and 16): uploads (plain and verified), listing, reads, clears, snapshot exports,
//! symlink refusals, and the workspace versions they commit.

use serde_json::json;
use sha2::{Digest, Sha256};

use runner_tests::server::Server;

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn paths_and_sizes(listing: &serde_json::Value) -> Vec<(String, u64)> {
    listing
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap().to_owned(), f["size"].as_u64().unwrap()))
        .collect()
}

/// The head of a workspace in refs.sqlite, and the record it points at.
fn head_record(server: &Server, root: &std::path::Path) -> serde_json::Value {
    let canonical = root.canonicalize().unwrap();
    let name = format!("workspaces/{}/head", hex(canonical.to_string_lossy().as_bytes()));
    let db = rusqlite::Connection::open(server.path("versioning/refs.sqlite")).unwrap();
    let target: String =
        db.query_row("SELECT target FROM live_refs WHERE name=?1", [&name], |r| r.get(0)).unwrap();
    let target: serde_json::Value = serde_json::from_str(&target).unwrap();
    let digest = target["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap();
    let bytes = std::fs::read(server.path(&format!("versioning/agent-state/blobs/sha256/{digest}"))).unwrap();
    assert_eq!(hex(&bytes), digest, "the blob's name is its digest");
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn files_in_and_out_with_conflicts_snapshots_and_clear() {
    let server = Server::start();
    let client = server.client();
    let ws = "workspace=project-1/session-1";
    let put = client
        .send_bytes(
            "PUT",
            &format!("/remote-workspace/file?{ws}&path=inputs/data.txt"),
            &[],
            b"remote-data".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!((put.status, put.json()), (201, json!({"path": "inputs/data.txt", "size": 11})));
    let again = client
        .send_bytes(
            "PUT",
            &format!("/remote-workspace/file?{ws}&path=inputs/data.txt"),
            &[],
            b"other".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(
        (again.status, again.json()["error"].as_str()),
        (409, Some("Remote workspace file already exists"))
    );
    let root = server.path("remote-workspaces/project-1/session-1");
    assert_eq!(std::fs::read_to_string(root.join("inputs/data.txt")).unwrap(), "remote-data");
    let head = head_record(&server, &root);
    assert_eq!(head["kind"], "WorkspaceMutation");
    assert_eq!(head["value"]["kind"], "workspace-upload");
    // The refused second write still committed what the workspace holds, marked failed
    // (the original's withWorkspaceMutation); the first one's id is a UUID.
    assert_eq!(head["value"]["status"], "failed");
    assert_eq!(head["value"]["id"].as_str().unwrap().len(), 36);

    let listing = client.get(&format!("/remote-workspace/files?{ws}")).await.unwrap();
    assert_eq!(paths_and_sizes(&listing.json()), vec![("inputs/data.txt".to_owned(), 11)]);
    let got = client.get(&format!("/remote-workspace/file?{ws}&path=inputs/data.txt")).await.unwrap();
    assert_eq!((got.status, got.body.as_slice()), (200, &b"remote-data"[..]));
    assert_eq!(got.header("content-type"), Some("application/octet-stream"));
    assert_eq!(got.header("content-length"), Some("11"));
    assert_eq!(got.header("cache-control"), Some("no-store"));

    // Overwrite is explicit.
    let over = client
        .send_bytes(
            "PUT",
            &format!("/remote-workspace/file?{ws}&path=notes.md&conflict=overwrite"),
            &[],
            b"v1".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(over.status, 201);
    let bad_conflict = client
        .send_bytes("PUT", &format!("/remote-workspace/file?{ws}&path=x&conflict=maybe"), &[], b"v".to_vec())
        .await
        .unwrap();
    assert_eq!(bad_conflict.json()["error"], "Invalid workspace conflict policy");

    let snap = client
        .post_json(
            "/remote-workspace/snapshots",
            &json!({"workspace": "project-1/session-1", "paths": ["inputs"]}),
        )
        .await
        .unwrap();
    assert_eq!(snap.status, 201, "{}", snap.json());
    let snap = snap.json();
    assert_eq!(snap["files"].as_array().unwrap().len(), 1);
    assert_eq!(snap["files"][0]["path"], "inputs/data.txt");
    assert_eq!(snap["files"][0]["sha256"], hex(b"remote-data"));
    assert_eq!(snap["files"][0]["executable"], 0);
    assert_eq!(snap["workspace"], "project-1/session-1");
    let id = snap["id"].as_str().unwrap().to_owned();
    let too_many: Vec<String> = (0..51).map(|i| format!("p{i}")).collect();
    let refused = client
        .post_json(
            "/remote-workspace/snapshots",
            &json!({"workspace": "project-1/session-1", "paths": too_many}),
        )
        .await
        .unwrap();
    assert_eq!(
        (refused.status, refused.json()["error"].as_str()),
        (400, Some("Snapshot accepts at most 50 paths"))
    );

    let deleted =
        client.send_bytes("DELETE", &format!("/remote-workspace?{ws}"), &[], Vec::new()).await.unwrap();
    assert_eq!((deleted.status, deleted.json()), (200, json!({"deleted": true})));
    assert_eq!(client.get(&format!("/remote-workspace/files?{ws}")).await.unwrap().json(), json!([]));
    assert!(root.is_dir(), "the root is kept");
    assert_eq!(head_record(&server, &root)["value"]["kind"], "workspace-clear");

    // The export outlives the files.
    let url = format!("/remote-workspace/snapshots/{id}/file?{ws}&path=inputs/data.txt");
    let exported = client.get(&url).await.unwrap();
    assert_eq!((exported.status, exported.body.as_slice()), (200, &b"remote-data"[..]));
    assert_eq!(exported.header("content-type"), Some("application/octet-stream"));
    let unauth = server.client_with_token("wrong").get(&url).await.unwrap();
    assert_eq!(unauth.status, 401);
    let other = client
        .get(&format!("/remote-workspace/snapshots/{id}/file?workspace=project-1/other&path=inputs/data.txt"))
        .await
        .unwrap();
    assert_eq!(other.json()["error"], "Workspace snapshot belongs to another Workspace");
    let unselected =
        client.get(&format!("/remote-workspace/snapshots/{id}/file?{ws}&path=notes.md")).await.unwrap();
    assert_eq!(unselected.json()["error"], "File was not selected in this Workspace snapshot");
    let missing = client
        .get(&format!("/remote-workspace/snapshots/00000000-0000-4000-8000-000000000000/file?{ws}&path=x"))
        .await
        .unwrap();
    assert_eq!(missing.json()["error"], "Workspace snapshot not found");
    // Not an export id: not a route.
    assert_eq!(
        client.get(&format!("/remote-workspace/snapshots/NOTANID/file?{ws}&path=x")).await.unwrap().status,
        404
    );
}

#[tokio::test]
async fn verified_transfers_publish_only_matching_bytes() {
    let server = Server::start();
    let client = server.client();
    let ws = "workspace=project-1/session-1";
    let url = format!("/remote-workspace/transfer-file?{ws}&path=file");
    let meta = |size: usize, sha: &str, exec: &str| {
        vec![
            ("x-workspace-size", size.to_string()),
            ("x-workspace-sha256", sha.to_owned()),
            ("x-workspace-executable", exec.to_owned()),
        ]
    };
    let wrong =
        client.send_bytes("PUT", &url, &meta(7, &hex(b"content"), "0"), b"CONTENT".to_vec()).await.unwrap();
    assert_eq!(wrong.status, 400, "{}", wrong.json());
    assert_eq!(client.get(&format!("/remote-workspace/files?{ws}")).await.unwrap().json(), json!([]));
    for (headers, what) in [
        (meta(7, &hex(b"content").to_uppercase(), "0"), "uppercase sha"),
        (meta(7, "abc", "0"), "short sha"),
        (meta(7, &hex(b"content"), "2"), "non-exec bits"),
        (vec![("x-workspace-sha256", hex(b"content"))], "no size"),
    ] {
        let r = client.send_bytes("PUT", &url, &headers, b"content".to_vec()).await.unwrap();
        assert_eq!(r.json()["error"], "Invalid verified upload metadata", "{what}");
    }
    let ok =
        client.send_bytes("PUT", &url, &meta(7, &hex(b"content"), "73"), b"content".to_vec()).await.unwrap();
    assert_eq!((ok.status, ok.json()), (201, json!({"path": "file", "size": 7, "sha256": hex(b"content")})));
    let again =
        client.send_bytes("PUT", &url, &meta(7, &hex(b"content"), "0"), b"content".to_vec()).await.unwrap();
    assert_eq!(again.status, 400, "re-uploading with reject is 400 on this route");
    let snap = client
        .post_json("/remote-workspace/snapshots", &json!({"workspace": "project-1/session-1"}))
        .await
        .unwrap();
    let snap = snap.json();
    assert_eq!(snap["files"][0]["sha256"], hex(b"content"));
    assert_eq!(snap["files"][0]["executable"], 73);
    let root = server.path("remote-workspaces/project-1/session-1");
    assert_eq!(head_record(&server, &root)["value"]["kind"], "workspace-transfer");
}

#[tokio::test]
async fn symlinks_and_bad_paths_are_refused_and_nothing_is_written_outside() {
    let server = Server::start();
    let client = server.client();
    let outside = runner_tests::scratch_dir();
    let root = server.path("remote-workspaces/p/s");
    std::fs::create_dir_all(&root).unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("esc")).unwrap();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    let put = client
        .send_bytes("PUT", "/remote-workspace/file?workspace=p/s&path=esc/planted", &[], b"x".to_vec())
        .await
        .unwrap();
    assert_eq!(
        (put.status, put.json()["error"].as_str()),
        (400, Some("Workspace parent must be a real directory"))
    );
    let get = client.get("/remote-workspace/file?workspace=p/s&path=esc/secret").await.unwrap();
    assert_eq!(get.json()["error"], "Workspace path escapes through a symbolic link");
    let listing = client
        .post_json("/remote-workspace/files", &json!({"workspace": "p/s", "paths": ["esc/secret"]}))
        .await
        .unwrap();
    assert_eq!(listing.json()["error"], "Workspace path escapes through a symbolic link");
    std::os::unix::fs::symlink(outside.path().join("target"), root.join("link")).unwrap();
    let put = client
        .send_bytes(
            "PUT",
            "/remote-workspace/file?workspace=p/s&path=link&conflict=overwrite",
            &[],
            b"x".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(put.json()["error"], "Workspace target is a symbolic link");
    for (path, message) in [
        ("", "Workspace path must be a non-empty relative POSIX path"),
        ("/etc/passwd", "Workspace path must be a non-empty relative POSIX path"),
        ("a\\b", "Workspace path must be a non-empty relative POSIX path"),
        ("a/../b", "Workspace path contains an invalid segment"),
        ("a//b", "Workspace path contains an invalid segment"),
    ] {
        let r = client.get(&format!("/remote-workspace/file?workspace=p/s&path={path}")).await.unwrap();
        assert_eq!(r.json()["error"], message, "{path:?}");
    }
    let missing = client.get("/remote-workspace/file?workspace=p/s&path=nope.txt").await.unwrap();
    assert!(missing.json()["error"].as_str().unwrap().starts_with("ENOENT: no such file or directory"));
    let too_many: Vec<String> = (0..51).map(|i| format!("p{i}")).collect();
    let r = client
        .post_json("/remote-workspace/files", &json!({"workspace": "p/s", "paths": too_many}))
        .await
        .unwrap();
    assert_eq!(r.json()["error"], "Remote workspace paths must contain at most 50 entries");
    // A symlinked key segment (contract §7 item 12): 400 and nothing created outside.
    std::os::unix::fs::symlink(outside.path(), server.path("remote-workspaces/escape")).unwrap();
    let r = client.get("/remote-workspace/files?workspace=escape/child").await.unwrap();
    assert_eq!(r.status, 400);
    assert!(!outside.path().join("child").exists());
    for key in ["../escape", "/abs", "a//b"] {
        let r = client.get(&format!("/remote-workspace/files?workspace={key}")).await.unwrap();
        assert_eq!(r.json()["error"], "Invalid remote workspace key", "{key}");
    }
    let names: Vec<_> = std::fs::read_dir(outside.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("secret")], "nothing was written outside");
}

#[tokio::test]
async fn quota_is_enforced_on_uploads() {
    let server = runner_tests::server::Server::start_with(runner_tests::server::ServerOptions {
        env: vec![("SCIENCE_AGENT_MAX_WORKSPACE_BYTES".into(), "100000".into())],
        ..Default::default()
    });
    let client = server.client();
    let url = |p: &str| format!("/remote-workspace/file?workspace=q/s&path={p}");
    // (Sizes well above a block: a stored file is charged what it allocates, issue #14.)
    assert_eq!(client.send_bytes("PUT", &url("a"), &[], vec![b'a'; 60_000]).await.unwrap().status, 201);
    let over = client.send_bytes("PUT", &url("b"), &[], vec![b'b'; 60_000]).await.unwrap();
    assert_eq!(
        (over.status, over.json()["error"].as_str()),
        (400, Some("Remote workspace exceeds its execution quota"))
    );
    let huge = client.send_bytes("PUT", &url("c"), &[], vec![b'c'; 500_000]).await.unwrap();
    assert_eq!(
        huge.json()["error"],
        "Request body exceeds the 100000 byte limit",
        "the original's body limit"
    );
    // Replacing a file counts only the difference.
    let replace = client
        .send_bytes("PUT", &format!("{}&conflict=overwrite", url("a")), &[], vec![b'z'; 90_000])
        .await
        .unwrap();
    assert_eq!(replace.status, 201);
    let listing = client.get("/remote-workspace/files?workspace=q/s").await.unwrap();
    assert_eq!(paths_and_sizes(&listing.json()), vec![("a".to_owned(), 90_000)]);
    assert!(
        std::fs::read_dir(server.path(".runner-uploads")).unwrap().next().is_none(),
        "no staged leftovers"
    );
}

/// Uploads stream to disk: runnerd's peak memory grows far less than the upload.
#[tokio::test]
async fn a_large_upload_is_streamed_not_buffered() {
    let server = Server::start();
    let client = server.client();
    let hwm = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap().to_owned();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    let before = hwm();
    let size = 256 * 1024 * 1024;
    let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let sha = hex(&body);
    let headers = [("x-workspace-size", size.to_string()), ("x-workspace-sha256", sha.clone())];
    let r = client
        .send_bytes("PUT", "/remote-workspace/transfer-file?workspace=big/s&path=blob.bin", &headers, body)
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.json());
    assert_eq!(r.json()["sha256"], sha);
    let grown = hwm().saturating_sub(before);
    assert!(grown < 64 * 1024 * 1024, "runnerd's peak memory grew by {grown} bytes for a {size}-byte upload");
    let got = client.get("/remote-workspace/file?workspace=big/s&path=blob.bin").await.unwrap();
    assert_eq!(hex(&got.body), sha);
}

/// `runnerctl run --detach`, `logs -f`, `show`, `cancel`, and `put`/`ls`/`get`.
#[tokio::test]
async fn runnerctl_manages_detached_runs_and_workspace_files() {
    if !runner_tests::sandbox_or_skip("runnerctl_manages_detached_runs_and_workspace_files") {
        return;
    }
    let server = Server::start();
    let ctl = |args: &[&str]| {
        std::process::Command::new(runner_tests::bin("runnerctl"))
            .args(["--url", &format!("http://{}", server.address()), "--workspace", "ctl/files"])
            .args(args)
            .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
            .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
            .output()
            .unwrap()
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let local = runner_tests::scratch_dir();
    let input = local.path().join("in.sh");
    std::fs::write(&input, "#!/bin/sh\necho from-upload\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&input, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = ctl(&["put", input.to_str().unwrap(), "tools/in.sh"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("tools/in.sh (27 bytes, sha256 "), "{}", text(&out.stdout));
    let out = ctl(&["put", input.to_str().unwrap(), "tools/in.sh"]);
    assert_eq!(out.status.code(), Some(1), "a second put without --overwrite is refused");
    assert!(ctl(&["put", input.to_str().unwrap(), "tools/in.sh", "--overwrite"]).status.success());
    let out = ctl(&["ls"]);
    assert!(text(&out.stdout).contains("tools/in.sh"), "{}", text(&out.stdout));

    // A detached run that uses the uploaded (executable) file and prints over time.
    let out = ctl(&[
        "run",
        "--detach",
        "--",
        "./tools/in.sh; for i in 1 2 3; do echo line-$i; sleep 0.2; done; echo err >&2; exit 4",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_owned();
    assert!(!id.is_empty());
    let out = ctl(&["logs", "-f", &id]);
    assert_eq!(out.status.code(), Some(4), "logs -f exits with the run's code");
    assert_eq!(text(&out.stdout), "from-upload\nline-1\nline-2\nline-3\n");
    assert!(text(&out.stderr).contains("err\n"), "{}", text(&out.stderr));
    let out = ctl(&["show", &id]);
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((rec["state"].as_str(), rec["result"]["exitCode"].as_i64()), (Some("failed"), Some(4)));
    assert!(rec["version"]["digest"].as_str().unwrap().starts_with("sha256:"));

    let out = ctl(&["run", "--detach", "--", "echo started; sleep 30"]);
    let long = text(&out.stdout).trim().to_owned();
    let out = ctl(&["cancel", &long]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = ctl(&["logs", "-f", &long]);
    assert_eq!(out.status.code(), Some(1));
    let out = ctl(&["show", &long]);
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rec["state"], "cancelled");

    // Files back out.
    let fetched = local.path().join("out.sh");
    assert!(ctl(&["get", "tools/in.sh", fetched.to_str().unwrap()]).status.success());
    assert_eq!(std::fs::read(&fetched).unwrap(), std::fs::read(&input).unwrap());
    let out = ctl(&["get", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("ENOENT"), "{}", text(&out.stderr));
    let out = ctl(&["show", "no-such-id"]);
    assert!(text(&out.stderr).contains("Execution not found for this Agent"));
}

/// An upload is received before the writer lease is taken: while a client is still sending
/// one, an execution in the same workspace runs and answers; the upload then publishes.
#[tokio::test]
async fn a_slow_upload_does_not_hold_the_workspace() {
    if !runner_tests::sandbox_or_skip("a_slow_upload_does_not_hold_the_workspace") {
        return;
    }
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = Server::start();
    let client = server.client();
    let mut upload = tokio::net::TcpStream::connect(server.address()).await.unwrap();
    let head = format!(
        "PUT /remote-workspace/file?workspace=slow/s&path=late.txt HTTP/1.1\r\nhost: runnerd\r\nauthorization: Bearer {}\r\ncontent-length: 10\r\nconnection: close\r\n\r\nfirst",
        runner_tests::server::TEST_TOKEN
    );
    upload.write_all(head.as_bytes()).await.unwrap();
    // Half the body is in; the rest is withheld while an execution uses the workspace.
    let body =
        runner_tests::server::keyed_shell_request("main", "s", "slow/s", "echo ran > ran.txt; echo ok");
    let run =
        tokio::time::timeout(std::time::Duration::from_secs(30), client.post_signed("/execute-shell", &body))
            .await
            .expect("the execution was held up by the pending upload")
            .unwrap();
    assert_eq!((run.status, run.json()["stdout"].as_str()), (200, Some("ok\n")), "{}", run.json());
    upload.write_all(b"-half").await.unwrap();
    let mut answer = String::new();
    upload.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    let root = server.path("remote-workspaces/slow/s");
    assert_eq!(std::fs::read_to_string(root.join("late.txt")).unwrap(), "first-half");
    assert_eq!(std::fs::read_to_string(root.join("ran.txt")).unwrap(), "ran\n");
}

/// Uploads a previous runnerd left half-received are removed at start.
#[tokio::test]
async fn half_received_uploads_are_swept_at_start() {
    let mut first = Server::start();
    let data = first.data_dir.clone();
    first.stop();
    let staging = data.join(".runner-uploads");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::write(staging.join("0000.upload"), "partial").unwrap();
    std::fs::write(staging.join("keep.txt"), "not an upload").unwrap();
    let _second = runner_tests::server::Server::start_with(runner_tests::server::ServerOptions {
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), data.to_str().unwrap().into())],
        ..Default::default()
    });
    assert!(!staging.join("0000.upload").exists());
    assert!(staging.join("keep.txt").exists(), "only uploads are swept");
}

/// Issue #14: a root runnerd's sandboxes run as another user, who must be able to change
/// what runnerd made for them: the key's directories and an upload's file and parents are
/// that user's (and the sandbox can rewrite the upload).
#[tokio::test]
async fn what_runnerd_creates_for_a_workspace_belongs_to_the_sandbox_user() {
    if !runner_tests::sandbox_or_skip("what_runnerd_creates_for_a_workspace_belongs_to_the_sandbox_user") {
        return;
    }
    use std::os::unix::fs::MetadataExt;
    let server = Server::start();
    let client = server.client();
    let put = client
        .send_bytes(
            "PUT",
            "/remote-workspace/file?workspace=own/s1&path=in/deep/data.txt",
            &[],
            b"v1".to_vec(),
        )
        .await
        .unwrap();
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));
    let uid = runner_tests::sandbox_user().uid;
    let ws = server.path("remote-workspaces/own/s1");
    for p in [
        server.path("remote-workspaces/own"),
        ws.clone(),
        ws.join("in"),
        ws.join("in/deep"),
        ws.join("in/deep/data.txt"),
    ] {
        assert_eq!(std::fs::metadata(&p).unwrap().uid(), uid, "{}", p.display());
    }
    let body = runner_tests::server::keyed_shell_request(
        "main",
        "s",
        "own/s1",
        "echo v2 > in/deep/data.txt && mkdir in/deep/more",
    );
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!((r.status, r.json()["exitCode"].as_i64()), (200, Some(0)), "{}", r.json());
    assert_eq!(std::fs::read_to_string(ws.join("in/deep/data.txt")).unwrap(), "v2\n");
}
