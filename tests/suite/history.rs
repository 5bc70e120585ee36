//! Issue #32, workspace history: what runs leave in the shared version store is bounded —
//! a sparse file costs the store its data, not its length, and old versions are pruned by
//! the retention and their objects collected — while commits and a managed run go on, and
//! never an object a kept version reaches. From real sandboxes, through the HTTP API.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, finished_record, keyed_shell_request, shell_request};
use runnerctl::client::RunnerClient;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Bytes allocated on disk under `dir` (what the store costs the host).
fn allocated_under(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.path().symlink_metadata() else { continue };
        total += m.blocks() * 512;
        if m.is_dir() {
            total += allocated_under(&e.path());
        }
    }
    total
}

async fn run_ok(client: &RunnerClient, body: &Value) -> Value {
    let r = client.post_signed("/execute-shell", body).await.unwrap();
    let v = r.json();
    assert_eq!((r.status, v["exitCode"].as_i64()), (200, Some(0)), "{v}");
    v
}

/// The red team's case: two runs that each leave one distinct sparse file (64 MiB long, a
/// few KiB of data) grew the store by the files' whole length.
#[tokio::test]
async fn distinct_sparse_files_grow_the_store_by_their_data_only() {
    if !sandbox_or_skip("distinct_sparse_files_grow_the_store_by_their_data_only") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let store = server.path("versioning");
    run_ok(&client, &keyed_shell_request("main", "s", "t/sparse", "echo warm")).await;
    let before = allocated_under(&store);
    for i in 1..=2 {
        let code = format!("rm -f big; printf 'run {i}' > big; truncate -s 64M big; echo 'tail {i}' >> big");
        let mut body = keyed_shell_request("main", "s", "t/sparse", &code);
        body["maxWorkspaceBytes"] = json!(300_000_000u64);
        run_ok(&client, &body).await;
    }
    let grew = allocated_under(&store) - before;
    // Dense, the two objects alone were 128 MiB; sparse they are two data blocks each.
    assert!(grew < 4 << 20, "two sparse 64 MiB files grew the version store by {grew} bytes");
    // Their content reads back whole: a download of the file is the same bytes.
    let got = client.get("/remote-workspace/file?workspace=t/sparse&path=big").await.unwrap();
    assert_eq!(got.status, 200);
    let mut want = b"run 2".to_vec();
    want.resize(64 << 20, 0);
    want.extend_from_slice(b"tail 2\n");
    assert!(got.body == want, "the sparse file's bytes differ after the store");
}

/// The `n`th version's payload: 100 kB, distinct per version, known to the test.
fn payload(n: u32) -> Vec<u8> {
    format!("{n}\n").into_bytes().into_iter().cycle().take(100_000).collect()
}

fn digest(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Sets every stored object's times back `age` (the retention's days read when a version's
/// record was written; the collector's grace when an object was written or read).
fn age_objects(data_dir: &Path, age: Duration) {
    let when = SystemTime::now() - age;
    for pool in ["data", "agent-state"] {
        let dir = data_dir.join("versioning").join(pool).join("blobs/sha256");
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let f = std::fs::File::options().write(true).open(e.path()).unwrap();
            f.set_times(std::fs::FileTimes::new().set_modified(when).set_accessed(when)).unwrap();
        }
    }
}

fn blob(data_dir: &Path, hex: &str) -> std::path::PathBuf {
    data_dir.join("versioning/data/blobs/sha256").join(hex)
}

async fn collect(client: &RunnerClient, dry_run: bool) -> Value {
    let r = client.post_json("/versioning/gc", &json!({"dryRun": dry_run})).await.unwrap();
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    v
}

/// Keep the newest 2 versions (and a day): of five versions made "40 days ago", the oldest
/// three and the objects only they reached go — while other workspaces commit and a
/// managed run writes, with no grace at all — and a final check finds every object a kept
/// version reaches still stored.
#[tokio::test]
async fn retention_and_the_collector_remove_old_versions_and_never_a_reachable_object() {
    if !sandbox_or_skip("retention_and_the_collector_remove_old_versions_and_never_a_reachable_object") {
        return;
    }
    let server = Server::start_with(ServerOptions {
        env: [
            ("SCIENCE_AGENT_HISTORY_KEEP_VERSIONS", "2"),
            ("SCIENCE_AGENT_HISTORY_KEEP_DAYS", "1"),
            ("SCIENCE_AGENT_HISTORY_GC_GRACE_SECS", "0"),
            ("SCIENCE_AGENT_HISTORY_GC_INTERVAL_SECS", "0"),
            ("SCIENCE_AGENT_HISTORY_GC_FREE_PERCENT", "0"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .to_vec(),
        ..Default::default()
    });
    let client = server.client();
    let data = server.data_dir.clone();
    let ws = server.project_workspace("history");
    for n in 1..=5 {
        let code = format!("rm -f v*; python3 -c 'import sys; sys.stdout.write(\"{n}\\n\" * 50000)' > v{n}");
        run_ok(&client, &shell_request("main", "s", &ws, &code)).await;
        assert!(blob(&data, &digest(&payload(n))).exists(), "version {n}'s file is stored");
    }
    age_objects(&data, Duration::from_secs(40 * 86_400));

    // A managed run and commits in another workspace go on while the collector runs.
    let busy = server.project_workspace("busy");
    let mut managed =
        shell_request("main", "s", &busy, "for i in 1 2 3 4 5 6; do echo $i > m$i; sleep 0.2; done");
    managed["executionId"] = json!("history-managed-1");
    let started = client.post_signed("/shell-executions", &managed).await.unwrap();
    assert!((200..=202).contains(&started.status), "{}", started.json());
    let writes = {
        let client = server.client();
        let busy = busy.clone();
        tokio::spawn(async move {
            let mut failed = Vec::new();
            for i in 0..12 {
                // Each run also stores version 2's file again (`p2`): content the collector
                // finds unreachable and old, reused by commits racing its deletions.
                let code = format!(
                    "python3 -c 'print(\"c{i}\" * 20000)' > c; echo {i} >> log; \
                     rm -f p2; python3 -c 'import sys; sys.stdout.write(\"2\\n\" * 50000)' > p2"
                );
                let r = client
                    .post_signed("/execute-shell", &shell_request("main", "s2", &busy, &code))
                    .await
                    .unwrap();
                if r.status != 200 || r.json()["exitCode"] != 0 {
                    failed.push(r.json());
                }
            }
            failed
        })
    };
    let mut reports = Vec::new();
    while !writes.is_finished() {
        reports.push(collect(&client, false).await);
    }
    let failed = writes.await.unwrap();
    assert!(failed.is_empty(), "commits failed while the collector ran: {failed:?}\n{}", server.stderr());
    // The managed run ends and commits.
    let r = finished_record(&client, "history-managed-1", "s", "main").await;
    assert!(r["state"] == "completed" && r["version"].is_object(), "the managed run did not commit: {r}");

    let pruned: u64 = reports.iter().map(|r| r["versionsPruned"].as_u64().unwrap()).sum();
    let deleted: u64 = reports.iter().map(|r| r["objectsDeleted"].as_u64().unwrap()).sum();
    assert!(pruned >= 3, "{reports:?}");
    assert!(deleted >= 3, "{reports:?}");
    for n in [1, 3] {
        assert!(!blob(&data, &digest(&payload(n))).exists(), "pruned version {n}'s file is gone");
    }
    // Version 2's file, pruned from `history` but reused by `busy`'s commits, stays.
    assert!(blob(&data, &digest(&payload(2))).exists(), "a reused object is kept");
    for n in 4..=5 {
        assert!(blob(&data, &digest(&payload(n))).exists(), "kept version {n}'s file stays");
    }
    // Everything a kept version, a head or the managed record reaches is still there.
    let check = collect(&client, true).await;
    assert_eq!(
        (check["objectsMissing"].as_u64(), check["unreadableCount"].as_u64()),
        (Some(0), Some(0)),
        "{check}"
    );
    let history = check["workspaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["workspace"].as_str() == Some(ws.canonicalize().unwrap().to_str().unwrap()))
        .cloned()
        .unwrap_or_else(|| panic!("no account for {}: {check}", ws.display()));
    assert_eq!(history["versions"], 2, "{history}");
    // The workspaces still work: a run in each, and the managed run's files read back.
    run_ok(&client, &shell_request("main", "s", &ws, "test -s v5")).await;
    run_ok(&client, &shell_request("main", "s", &busy, "test -s m6 && test -s c")).await;
    // /health and /metrics say what the collector did.
    let health = client.get("/health").await.unwrap().json();
    assert_eq!(health["versionHistory"]["keepVersions"], 2, "{}", health["versionHistory"]);
    assert!(health["versionHistory"]["lastCollection"]["dryRun"] == true, "{}", health["versionHistory"]);
    let metrics = String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap();
    let line = metrics.lines().find(|l| l.starts_with("runner_history_deleted_objects ")).unwrap();
    assert_eq!(line, format!("runner_history_deleted_objects {deleted}"));
}
