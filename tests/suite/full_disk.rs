//! Issue #15 (S) items 2 and 3: a data directory on a small tmpfs, filled to ENOSPC while
//! a managed run goes on, then freed. The run's commit and its final record write fail; the
//! record answers `failed` with the reason (never `queued`/`running`) and is stored once
//! space returns; the poisoned workspace is repaired through the signed route and writable
//! again; the last committed version is intact. Root only (it mounts a tmpfs): skipped
//! loudly otherwise, in CI too (CI also runs the suite unprivileged).

use std::path::Path;
use std::time::{Duration, Instant};

use runner_tests::server::{Server, ServerOptions, keyed_shell_request};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(60);

struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Writes `path` until the filesystem is full.
fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![7u8; 1 << 16];
    while f.write_all(&block).is_ok() {}
    let mut small = [7u8; 512];
    while f.write_all(&small).is_ok() {}
    small[0] = 0;
    while f.write_all(&small[..1]).is_ok() {}
}

async fn get_record(server: &Server, id: &str) -> Value {
    let reply =
        server.client().get(&format!("/shell-executions/{id}?sessionId=s&agentId=main")).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    reply.json()
}

#[tokio::test]
async fn a_full_disk_fails_the_run_visibly_and_a_repair_makes_the_workspace_writable() {
    let test = "a_full_disk_fails_the_run_visibly_and_a_repair_makes_the_workspace_writable";
    if !runner_tests::is_root() {
        eprintln!("\n!!! SKIPPING {test}: mounting the small tmpfs needs root !!!\n");
        return;
    }
    if !runner_tests::sandbox_or_skip(test) {
        return;
    }
    let dir = runner_tests::scratch_dir();
    let data = dir.path().join("small");
    std::fs::create_dir_all(&data).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=48m,mode=0755", "tmpfs"])
        .arg(&data)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount the tmpfs");
    let _mount = Tmpfs(data.clone());
    let options = || ServerOptions {
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), data.to_str().unwrap().into())],
        ..Default::default()
    };
    let mut server = Server::start_with(options());
    let client = server.client();
    let first = client
        .post_signed("/execute-shell", &keyed_shell_request("main", "s", "full", "echo v1 > kept.txt"))
        .await
        .unwrap();
    assert_eq!(first.status, 200, "{}", String::from_utf8_lossy(&first.body));

    let filler = data.join("filler");
    let mut body = keyed_shell_request(
        "main",
        "s",
        "full",
        "echo v2 > kept.txt; while [ ! -e go ]; do sleep 0.05; done; echo done",
    );
    body["executionId"] = json!("on-a-full-disk");
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", String::from_utf8_lossy(&reply.body));
    let start = Instant::now();
    while get_record(&server, "on-a-full-disk").await["state"] != "running" {
        assert!(start.elapsed() < DEADLINE);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ws = data.join("remote-workspaces/full");
    fill(&filler);
    // An empty file takes an inode, no block: it can still be made on the full tmpfs.
    std::fs::write(ws.join("go"), "").unwrap();
    let start = Instant::now();
    let failed = loop {
        let rec = get_record(&server, "on-a-full-disk").await;
        if rec["state"] != "running" && rec["state"] != "queued" {
            break rec;
        }
        assert!(start.elapsed() < DEADLINE, "still {rec} on a full disk");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(failed["state"], "failed", "{failed}");
    let why = failed["error"].as_str().unwrap();
    assert!(why.contains("could not be written") || why.contains("commit failed"), "{failed}");

    std::fs::remove_file(&filler).unwrap();
    let start = Instant::now();
    while health_unsaved(&server).await != 0 {
        assert!(start.elapsed() < DEADLINE, "the record was never stored after space returned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(server.stop().success());
    let server = Server::start_with(options());
    let stored = get_record(&server, "on-a-full-disk").await;
    assert_eq!(
        (stored["state"].clone(), stored["error"].clone()),
        (failed["state"].clone(), failed["error"].clone()),
        "stored as answered: {stored}"
    );

    let client = server.client();
    let refused = client
        .post_signed("/execute-shell", &keyed_shell_request("main", "s", "full", "true"))
        .await
        .unwrap();
    assert_eq!(refused.status, 400, "poisoned until repaired: {}", String::from_utf8_lossy(&refused.body));
    let repair = json!({"workspace": "full", "repairId": runnerctl::client::new_execution_id()});
    let _ = client.raw("GET", "/health", &[], Vec::new()).await;
    let repaired = client.post_signed("/remote-workspace/repair", &repair).await.unwrap();
    assert_eq!(repaired.status, 200, "{}", String::from_utf8_lossy(&repaired.body));
    let repaired = repaired.json();
    assert_eq!(
        repaired["previous"]["verified"]["ok"], true,
        "the last committed version is intact: {repaired}"
    );
    assert_eq!(repaired["markerCleared"], true, "{repaired}");
    let again = client
        .post_signed(
            "/execute-shell",
            &keyed_shell_request("main", "s", "full", "cat kept.txt; echo v3 > kept.txt"),
        )
        .await
        .unwrap();
    assert_eq!(again.status, 200, "writable again: {}", String::from_utf8_lossy(&again.body));
    assert_eq!(again.json()["exitCode"], 0, "{}", again.json());
    assert!(server.stderr().contains("workspace_repaired"), "audited: {}", server.stderr());
}

async fn health_unsaved(server: &Server) -> u64 {
    let h = server.client().raw("GET", "/health", &[], Vec::new()).await.unwrap().json();
    h["executionRecords"]["unsavedRecords"].as_u64().unwrap_or(u64::MAX)
}
