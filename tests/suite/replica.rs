//! Issue #34, replication to an object store: a runnerd configured with a real S3-compatible
//! store (SeaweedFS on loopback, `runner_tests::seaweed`) sends every committed head and the
//! objects it reaches, sends only what is new the next time, says in `/health` when the store
//! is unreachable and catches up when it is back, and fences its copy instead of overwriting a
//! newer one (a higher epoch) in the bucket. Waits are bounded polls of `/health` and the
//! bucket, never a timing assertion.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::sandbox_or_skip;
use runner_tests::seaweed::Seaweed;
use runner_tests::server::{Server, ServerOptions, keyed_shell_request};
use runnerctl::client::RunnerClient;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const PREFIX: &str = "fleet-a/";
const NODE: &str = "http://node-a.test:4311";
/// How long a replication may take before a test gives up (a bound, not a target).
const WITHIN: Duration = Duration::from_secs(90);

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn start_runnerd(weed: &Seaweed) -> Server {
    let mut env = weed.runnerd_env(PREFIX);
    env.push(("SCIENCE_AGENT_NODE_URL".into(), NODE.into()));
    Server::start_with(ServerOptions { env, ..Default::default() })
}

/// The workspace `key`'s canonical path and its head ref (from refs.sqlite).
fn local_head(server: &Server, key: &str) -> (PathBuf, Value) {
    let canonical = server.path(&format!("remote-workspaces/{key}")).canonicalize().unwrap();
    let name = format!("workspaces/{}/head", hex(canonical.to_string_lossy().as_bytes()));
    let db = rusqlite::Connection::open(server.path("versioning/refs.sqlite")).unwrap();
    let target: String =
        db.query_row("SELECT target FROM live_refs WHERE name=?1", [&name], |r| r.get(0)).unwrap();
    (canonical, serde_json::from_str(&target).unwrap())
}

fn blob_path(server: &Server, r: &Value) -> PathBuf {
    let digest = r["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap();
    server.path(&format!("versioning/{}/blobs/sha256/{digest}", r["pool"].as_str().unwrap()))
}

/// Every object `head` reaches, as bucket keys (`<prefix>objects/<pool>/<hex>`).
fn closure_keys(server: &Server, head: &Value) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut stack = vec![head.clone()];
    while let Some(r) = stack.pop() {
        let digest = r["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap().to_owned();
        if !keys.insert(format!("{PREFIX}objects/{}/{digest}", r["pool"].as_str().unwrap())) {
            continue;
        }
        if r["mediaType"] == "application/vnd.sciencediscovery.record.v1+json" {
            let record: Value =
                serde_json::from_slice(&std::fs::read(blob_path(server, &r)).unwrap()).unwrap();
            stack.extend(record["dependencies"].as_array().unwrap().iter().cloned());
        }
    }
    keys
}

fn head_key(key: &str) -> String {
    format!("{PREFIX}heads/remote/{key}.json")
}

async fn health(client: &RunnerClient) -> Value {
    let r = client.get("/health").await.unwrap();
    assert_eq!(r.status, 200);
    r.json()["replication"].clone()
}

/// Polls until the bucket's head document for `key` names `head` and nothing is pending.
async fn replicated(client: &RunnerClient, weed: &Seaweed, key: &str, head: &Value) -> Value {
    let deadline = Instant::now() + WITHIN;
    loop {
        let doc = weed.get(&head_key(key)).map(|b| serde_json::from_slice::<Value>(&b).unwrap());
        let h = health(client).await;
        if let Some(doc) = doc
            && doc["head"] == *head
            && h["pending"] == 0
        {
            return doc;
        }
        assert!(Instant::now() < deadline, "{key} was not replicated within {WITHIN:?}: /health {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn upload(client: &RunnerClient, key: &str, path: &str, body: &[u8]) {
    let r = client
        .send_bytes("PUT", &format!("/remote-workspace/file?workspace={key}&path={path}"), &[], body.to_vec())
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
}

fn missing(weed: &Seaweed, want: &BTreeSet<String>) -> Vec<String> {
    let have: BTreeSet<String> = weed.list(&format!("{PREFIX}objects/")).into_iter().collect();
    want.difference(&have).cloned().collect()
}

#[tokio::test]
async fn commits_reach_the_bucket_and_the_next_sends_only_what_is_new() {
    let test = "commits_reach_the_bucket_and_the_next_sends_only_what_is_new";
    if !sandbox_or_skip(test) {
        return;
    }
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let server = start_runnerd(&weed);
    let client = server.client();
    let h = health(&client).await;
    assert_eq!(
        (&h["enabled"], &h["endpoint"], &h["bucket"], &h["prefix"], &h["node"]),
        (&json!(true), &json!(weed.endpoint()), &json!(weed.bucket), &json!(PREFIX), &json!(NODE)),
        "{h}"
    );
    let key = "team/ws1";
    let code = "mkdir -p d e/f && for i in 1 2 3 4 5 6; do echo file $i > d/f$i; done; \
                head -c 300000 /dev/urandom > big; ln -s d/f1 link";
    let r =
        client.post_signed("/execute-shell", &keyed_shell_request("main", "s1", key, code)).await.unwrap();
    assert_eq!((r.status, r.json()["exitCode"].as_i64()), (200, Some(0)), "{}", r.json());
    let (_, head) = local_head(&server, key);
    let doc = replicated(&client, &weed, key, &head).await;
    assert_eq!(doc["ident"], json!({"workspace": key}));
    assert_eq!((&doc["epoch"], &doc["node"]), (&json!(0), &json!(NODE)));
    assert!(doc["committedAtMs"].as_u64().unwrap() > 0, "{doc}");
    let first = closure_keys(&server, &head);
    assert!(first.len() > 8, "a tree of 8 files and 3 directories: {first:?}");
    assert_eq!(
        missing(&weed, &first),
        Vec::<String>::new(),
        "every object of the head's closure is in the bucket"
    );
    // The bucket's copy of the big file is the workspace's bytes.
    let big = std::fs::read(server.path(&format!("remote-workspaces/{key}/big"))).unwrap();
    assert_eq!(weed.get(&format!("{PREFIX}objects/data/{}", hex(&big))).as_deref(), Some(big.as_slice()));
    let sent_before = health(&client).await["objectsSent"].as_u64().unwrap();

    let r = client
        .post_signed("/execute-shell", &keyed_shell_request("main", "s1", key, "echo changed > d/f1"))
        .await
        .unwrap();
    assert_eq!((r.status, r.json()["exitCode"].as_i64()), (200, Some(0)), "{}", r.json());
    let (_, second_head) = local_head(&server, key);
    assert_ne!(second_head, head);
    replicated(&client, &weed, key, &second_head).await;
    let second = closure_keys(&server, &second_head);
    assert_eq!(missing(&weed, &second), Vec::<String>::new());
    let h = health(&client).await;
    let sent = h["objectsSent"].as_u64().unwrap() - sent_before;
    // The changed file, its directory, the root and the run's records: never an object the
    // first head's closure holds, so never the unchanged rest.
    let new = second.difference(&first).count();
    assert!(
        sent > 0 && sent as usize <= new,
        "sent {sent}; {new} of the closure's {} are new: {h}",
        second.len()
    );
    assert!((sent as usize) < second.len(), "sent {sent} of a closure of {}", second.len());
    assert_eq!(
        (&h["lagSeconds"], &h["oldestUnreplicated"], &h["lastError"]),
        (&json!(0.0), &Value::Null, &Value::Null)
    );
    let metrics = String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap();
    let line = format!("runner_replication_objects_total {}", h["objectsSent"]);
    assert!(metrics.lines().any(|l| l == line), "{line:?} missing from\n{metrics}");
    assert!(metrics.lines().any(|l| l == "runner_replication_pending 0"), "{metrics}");
}

#[tokio::test]
async fn an_unreachable_store_shows_in_health_and_replication_catches_up() {
    let test = "an_unreachable_store_shows_in_health_and_replication_catches_up";
    let Some(mut weed) = Seaweed::start_or_skip(test) else { return };
    let server = start_runnerd(&weed);
    let client = server.client();
    let key = "team/outage";
    upload(&client, key, "a.txt", b"before the outage").await;
    let (_, head) = local_head(&server, key);
    replicated(&client, &weed, key, &head).await;

    weed.kill();
    upload(&client, key, "b.txt", b"during the outage").await;
    let (_, during) = local_head(&server, key);
    let deadline = Instant::now() + WITHIN;
    let h = loop {
        let h = health(&client).await;
        if h["lastError"].is_string() && h["pending"].as_u64() > Some(0) {
            break h;
        }
        assert!(Instant::now() < deadline, "no error in /health while the store is down: {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let error = h["lastError"].as_str().unwrap();
    assert!(error.contains(&weed.endpoint()), "the error names the store: {error}");
    assert_eq!(h["oldestUnreplicated"]["workspace"], json!({"workspace": key}), "{h}");
    assert!(h["oldestUnreplicated"]["pendingSince"].is_string(), "{h}");
    assert!(h["lagSeconds"].as_f64().is_some(), "{h}");
    assert!(h["errors"].as_u64() > Some(0), "{h}");
    let metrics = String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap();
    assert!(metrics.lines().any(|l| l == "runner_replication_pending 1"), "{metrics}");
    assert!(!metrics.lines().any(|l| l == "runner_replication_errors_total 0"), "{metrics}");

    weed.restart();
    replicated(&client, &weed, key, &during).await;
    let h = health(&client).await;
    assert_eq!((&h["lastError"], &h["oldestUnreplicated"]), (&Value::Null, &Value::Null), "{h}");
    assert_eq!(missing(&weed, &closure_keys(&server, &during)), Vec::<String>::new());
}

/// This node's placement row for `canonical`: (epoch, movedTo).
fn placement(server: &Server, canonical: &Path) -> Option<(u64, Option<String>)> {
    let db = rusqlite::Connection::open(server.path("runner-placement/placement.sqlite")).ok()?;
    db.query_row("SELECT epoch, moved_to FROM placement WHERE path=?1", [canonical.to_str().unwrap()], |r| {
        Ok((r.get::<_, i64>(0)? as u64, r.get(1)?))
    })
    .ok()
}

#[tokio::test]
async fn a_newer_epoch_in_the_bucket_fences_the_copy_instead_of_being_overwritten() {
    let test = "a_newer_epoch_in_the_bucket_fences_the_copy_instead_of_being_overwritten";
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let server = start_runnerd(&weed);
    let client = server.client();
    let key = "team/moved";
    upload(&client, key, "a.txt", b"here first").await;
    let (canonical, head) = local_head(&server, key);
    let mut doc = replicated(&client, &weed, key, &head).await;
    // Another node restored the workspace from the bucket and moved it on: epoch 7.
    doc["epoch"] = json!(7);
    doc["node"] = json!("http://node-b.test:4311");
    let theirs = serde_json::to_vec_pretty(&doc).unwrap();
    weed.put(&head_key(key), &theirs);

    upload(&client, key, "b.txt", b"a stale copy's write").await;
    let deadline = Instant::now() + WITHIN;
    loop {
        if placement(&server, &canonical).is_some_and(|(_, moved)| moved.is_some()) {
            break;
        }
        assert!(Instant::now() < deadline, "the copy was not fenced: /health {}", health(&client).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(placement(&server, &canonical), Some((7, Some("http://node-b.test:4311".into()))));
    assert_eq!(
        weed.get(&head_key(key)).as_deref(),
        Some(theirs.as_slice()),
        "the newer document stays as it was"
    );
    assert_eq!(health(&client).await["lastError"], Value::Null);
    // The fenced copy takes no more writes.
    let r = client
        .send_bytes("PUT", &format!("/remote-workspace/file?workspace={key}&path=c.txt"), &[], b"x".to_vec())
        .await
        .unwrap();
    assert!(r.status >= 400, "a write to a fenced copy: {} {}", r.status, String::from_utf8_lossy(&r.body));
    assert_eq!(weed.get(&head_key(key)).as_deref(), Some(theirs.as_slice()));
}

/// The bucket as another node sees it: `fetch_closure` brings a replicated head's whole
/// closure into an empty version store, big objects included (multipart up, streamed down),
/// each verified; an object missing from the bucket is an error that names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_node_fetches_the_whole_closure_from_the_bucket() {
    let test = "another_node_fetches_the_whole_closure_from_the_bucket";
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let server = start_runnerd(&weed);
    let client = server.client();
    let key = "team/fetched";
    // Bigger than one multipart part (8 MiB), and not all one byte.
    let big: Vec<u8> = (0..9u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    upload(&client, key, "big.bin", &big).await;
    upload(&client, key, "small.txt", b"small").await;
    let (_, head) = local_head(&server, key);
    replicated(&client, &weed, key, &head).await;
    assert_eq!(weed.get(&format!("{PREFIX}objects/data/{}", hex(&big))).map(|b| b.len()), Some(big.len()));

    let other = runner_tests::scratch_dir();
    let versions = std::sync::Arc::new(runnerd::writer::Versions::open(other.path()).unwrap());
    let settings = runnerd::replica::settings::from_vars(|k| {
        weed.runnerd_env(PREFIX)
            .into_iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v)
            .filter(|v| !v.is_empty())
    })
    .unwrap()
    .unwrap();
    let bucket = runnerd::replica::Bucket::connect(&settings, None).unwrap();
    let ident = runnerd::transfer::Ident::remote(key).unwrap();
    let doc = bucket.read_head(&ident).await.unwrap().expect("the head document");
    assert_eq!(doc.head.to_value(), head);
    let fetched = bucket.fetch_closure(&versions, &doc.head).await.unwrap();
    let keys = closure_keys(&server, &head);
    assert_eq!((fetched.objects as usize, fetched.present), (keys.len(), 0), "{fetched:?}");
    assert!(fetched.bytes >= big.len() as u64, "{fetched:?}");
    assert_eq!(versions.store().validate_closure(&doc.head).unwrap(), keys.len());
    // Again: everything is here already.
    let again = bucket.fetch_closure(&versions, &doc.head).await.unwrap();
    assert_eq!((again.objects, again.present as usize), (0, keys.len()));

    // A bucket that lost an object: the fetch names it.
    let small_key = format!("{PREFIX}objects/data/{}", hex(b"small"));
    weed.delete(&small_key);
    let empty = runner_tests::scratch_dir();
    let fresh = std::sync::Arc::new(runnerd::writer::Versions::open(empty.path()).unwrap());
    let err = bucket.fetch_closure(&fresh, &doc.head).await.unwrap_err();
    let text = runnerd::error_chain(&err);
    assert!(text.contains(&small_key), "{text}");
}

/// Heads committed while replication was off (or before a restart) are sent when a runnerd
/// with the store configured starts on that data directory.
#[tokio::test]
async fn heads_committed_before_start_are_sent_after_it() {
    let test = "heads_committed_before_start_are_sent_after_it";
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let mut plain = Server::start();
    let key = "team/earlier";
    upload(&plain.client(), key, "a.txt", b"committed with replication off").await;
    let (_, head) = local_head(&plain, key);
    plain.stop();
    let mut env = weed.runnerd_env(PREFIX);
    env.push(("SCIENCE_AGENT_DATA_DIR".into(), plain.data_dir.display().to_string()));
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    replicated(&server.client(), &weed, key, &head).await;
    assert_eq!(missing(&weed, &closure_keys(&plain, &head)), Vec::<String>::new());
}

/// A node of its own on the same store (its node URL is the address it got).
fn other_node(weed: &Seaweed) -> Server {
    Server::start_with(ServerOptions { env: weed.runnerd_env(PREFIX), ..Default::default() })
}

async fn run(server: &Server, key: &str, code: &str) -> Value {
    let r = server
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("main", "s1", key, code))
        .await
        .unwrap();
    if r.status == 200 { r.json() } else { json!({"status": r.status, "answer": r.json()}) }
}

async fn restore_from_store(server: &Server, key: &str) -> (u16, Value) {
    let client = server.client();
    let _ = client.get("/health").await;
    let body =
        json!({"workspace": key, "fromStore": true, "requestId": runnerctl::client::new_execution_id()});
    let r = client.post_signed("/workspace-transfer/restore", &body).await.unwrap();
    (r.status, r.json())
}

async fn where_is(server: &Server, key: &str) -> Value {
    server.client().get(&format!("/workspace-transfer/where?workspace={key}")).await.unwrap().json()
}

#[tokio::test]
async fn a_workspace_restores_from_the_store_after_its_node_is_lost_and_the_older_copy_is_fenced() {
    let test = "a_workspace_restores_from_the_store_after_its_node_is_lost_and_the_older_copy_is_fenced";
    if !sandbox_or_skip(test) {
        return;
    }
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let key = "team/restored";
    // A makes the workspace and replicates it; B restores it from the store (epoch 1) and
    // later goes away for a while; A is lost with its data directory.
    let mut a = start_runnerd(&weed);
    let made = run(&a, key, "mkdir -p d/empty && echo one > d/f && ln -s d/f link && chmod 755 d/f").await;
    let tree = made["workspaceSnapshot"].clone();
    let (_, head) = local_head(&a, key);
    replicated(&a.client(), &weed, key, &head).await;
    let b = other_node(&weed);
    let (status, on_b) = restore_from_store(&b, key).await;
    assert_eq!(
        (status, on_b["epoch"].clone(), on_b["tree"].clone()),
        (200, json!(1), tree.clone()),
        "{on_b}"
    );
    assert_eq!(on_b["fromNode"], json!(NODE));
    a.stop();
    std::fs::remove_dir_all(&a.data_dir).unwrap();

    // C restores the store's latest (B's, epoch 1) at epoch 2: the same files, same tree.
    let c = other_node(&weed);
    let (status, on_c) = restore_from_store(&c, key).await;
    assert_eq!((status, on_c["epoch"].clone()), (200, json!(2)), "{on_c}");
    let seen = run(&c, key, "cat d/f; readlink link; stat -c %a d/f; ls -d d/empty").await;
    assert_eq!(seen["workspaceSnapshot"], tree, "{seen}");
    assert_eq!(seen["stdout"], json!("one\nd/f\n755\nd/empty\n"));
    let doc: Value = serde_json::from_slice(&weed.get(&head_key(key)).unwrap()).unwrap();
    assert_eq!(doc["epoch"], 2, "{doc}");

    // B, the older copy, writes again: its replication finds epoch 2 in the bucket and fences
    // it instead of overwriting; its next write answers where the workspace is now.
    let wrote = run(&b, key, "echo stale > d/f").await;
    assert!(wrote["workspaceSnapshot"].is_object(), "{wrote}");
    let deadline = Instant::now() + WITHIN;
    while where_is(&b, key).await["fenced"] != json!(true) {
        assert!(Instant::now() < deadline, "B was not fenced: {}", where_is(&b, key).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = run(&b, key, "true").await;
    assert_eq!(refused["status"], 409, "{refused}");
    let doc: Value = serde_json::from_slice(&weed.get(&head_key(key)).unwrap()).unwrap();
    assert_eq!(doc["epoch"], 2, "the newer copy's document stays: {doc}");
    assert_eq!(run(&c, key, "cat d/f").await["stdout"], json!("one\n"), "C's copy is untouched");

    // A backup on demand, and a restore of a workspace the store never saw.
    let (status, backup) = {
        let client = c.client();
        let body = json!({"workspace": key, "requestId": runnerctl::client::new_execution_id()});
        let r = client.post_signed("/workspace-transfer/backup", &body).await.unwrap();
        (r.status, r.json())
    };
    assert_eq!((status, backup["outcome"].clone()), (200, json!("replicated")), "{backup}");
    let (status, none) = restore_from_store(&c, "team/never").await;
    assert_eq!((status, none["code"].clone()), (404, json!("not_in_store")), "{none}");
}
