//! Issue #15 (S): damaged state never stops runnerd and loses nothing — an unreadable row
//! in `executions.sqlite` answers `unknown` with the reason; a garbage database is set
//! aside with its WAL and a new one started (/health says so); a kill -9 in the middle of a
//! commit leaves no temporary object after the restart. Each test starts the real runnerd
//! on a data directory seeded by hand; none needs a sandbox.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::server::{Server, ServerOptions};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(60);

fn seeded_data() -> (tempfile::TempDir, PathBuf) {
    let dir = runner_tests::scratch_dir();
    let data = dir.path().join("seeded");
    std::fs::create_dir_all(data.join("runner-executions")).unwrap();
    (dir, data)
}

fn on(data: &Path) -> ServerOptions {
    ServerOptions {
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), data.to_str().unwrap().into())],
        ..Default::default()
    }
}

async fn health(server: &Server) -> Value {
    server.client().raw("GET", "/health", &[], Vec::new()).await.unwrap().json()
}

async fn record(server: &Server, id: &str) -> (u16, Value) {
    let reply =
        server.client().get(&format!("/shell-executions/{id}?sessionId=s&agentId=main")).await.unwrap();
    (reply.status, reply.json())
}

#[tokio::test]
async fn an_unreadable_row_answers_unknown_and_the_rest_is_served() {
    let (_dir, data) = seeded_data();
    let good = json!({"agentId":"main","sessionId":"s","id":"good","state":"completed",
        "queuedAt":"2026-01-01T00:00:00.000Z","finishedAt":"2026-01-01T00:00:01.000Z"});
    {
        let conn = rusqlite::Connection::open(data.join("runner-executions/executions.sqlite")).unwrap();
        conn.execute_batch(
            "CREATE TABLE executions(id TEXT PRIMARY KEY, session TEXT NOT NULL, agent TEXT NOT NULL, record TEXT NOT NULL);
             CREATE TABLE logs(execution TEXT NOT NULL, cursor INTEGER NOT NULL, stream TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY(execution, cursor));",
        )
        .unwrap();
        conn.execute("INSERT INTO executions VALUES('good','s','main',?1)", [good.to_string()]).unwrap();
        // Not UTF-8: the original runnerd stopped with "invalid utf-8 sequence".
        conn.execute("INSERT INTO executions VALUES('bad','s','main',CAST(x'7b22ff' AS TEXT))", []).unwrap();
    }
    let server = Server::start_with(on(&data));
    assert_eq!(record(&server, "good").await, (200, good));
    let (status, bad) = record(&server, "bad").await;
    assert_eq!((status, bad["state"].as_str()), (200, Some("unknown")), "{bad}");
    assert!(bad["error"].as_str().unwrap().contains("unreadable"), "{bad}");
    assert_eq!(health(&server).await["executionRecords"]["unreadableRecords"], json!(["bad"]));
    assert!(server.stderr().contains("execution_record_unreadable"), "{}", server.stderr());
}

#[tokio::test]
async fn a_garbage_database_is_set_aside_with_its_wal_and_a_new_one_serves() {
    let (_dir, data) = seeded_data();
    let execs = data.join("runner-executions");
    let garbage: Vec<u8> = (0..20_000u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(execs.join("executions.sqlite"), &garbage).unwrap();
    std::fs::write(execs.join("executions.sqlite-wal"), b"a wal that goes with it").unwrap();
    std::fs::write(execs.join("neighbour.txt"), b"untouched").unwrap();
    let server = Server::start_with(on(&data));
    let aside = health(&server).await["executionRecords"]["setAside"].clone();
    let moved: Vec<PathBuf> = aside["movedTo"]
        .as_array()
        .expect("health says it")
        .iter()
        .map(|p| p.as_str().unwrap().into())
        .collect();
    assert_eq!(moved.len(), 2, "{aside}");
    assert!(moved[0].file_name().unwrap().to_str().unwrap().starts_with("executions.sqlite.corrupt-"));
    assert!(moved[1].file_name().unwrap().to_str().unwrap().starts_with("executions.sqlite-wal.corrupt-"));
    assert_eq!(std::fs::read(&moved[0]).unwrap(), garbage, "nothing is lost");
    assert_eq!(std::fs::read(&moved[1]).unwrap(), b"a wal that goes with it");
    assert_eq!(std::fs::read(execs.join("neighbour.txt")).unwrap(), b"untouched");
    assert!(aside["reason"].as_str().unwrap().contains("not a database"), "{aside}");
    // A new database serves: an unknown id is simply not found.
    assert_eq!(record(&server, "nothing").await.0, 400);
    assert_eq!(server.client().get("/status").await.unwrap().status, 200);
}

/// The `.tmp` entries in the data pool's blob directory.
fn temporaries(data: &Path) -> Vec<String> {
    let blobs = data.join("versioning/data/blobs/sha256");
    std::fs::read_dir(blobs)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".tmp"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_during_a_commit_leaves_no_temporary_after_restart() {
    let (_dir, data) = seeded_data();
    let ws = data.join("remote-workspaces/crash");
    std::fs::create_dir_all(&ws).unwrap();
    runner_tests::hand_tree_to_sandbox(&data.join("remote-workspaces"));
    let mut caught = Vec::new();
    for attempt in 0..20u32 {
        // Big files, new content each attempt: each one streams through a temporary object.
        for i in 0..40 {
            let chunk = format!("attempt {attempt} file {i} ");
            std::fs::write(ws.join(format!("f{i}.bin")), chunk.repeat((4 << 20) / chunk.len())).unwrap();
        }
        let mut server = Server::start_with(on(&data));
        let client = server.client();
        let commit = tokio::spawn(async move {
            client.post_json("/remote-workspace/snapshots", &json!({"workspace": "crash"})).await
        });
        let start = Instant::now();
        while temporaries(&data).is_empty() && !commit.is_finished() {
            assert!(start.elapsed() < DEADLINE);
            std::thread::sleep(Duration::from_micros(200));
        }
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        commit.abort();
        caught = temporaries(&data);
        if !caught.is_empty() {
            break;
        }
    }
    assert!(!caught.is_empty(), "no kill landed inside a commit in 20 attempts");
    let server = Server::start_with(on(&data));
    assert_eq!(temporaries(&data), Vec::<String>::new(), "left after the restart (before: {caught:?})");
    assert!(server.stderr().contains("temporaries_swept"), "{}", server.stderr());
}

/// Issue #32: a database whose late pages are corrupt (its header and first pages whole)
/// was opened as if whole and the damage surfaced later as "not found"; now the start-up
/// integrity check sets it aside, with a journal line naming it and the remedy.
#[tokio::test]
async fn a_database_with_corrupt_late_pages_is_set_aside_at_start() {
    let (_dir, data) = seeded_data();
    let path = data.join("runner-executions/executions.sqlite");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE executions(id TEXT PRIMARY KEY, session TEXT NOT NULL, agent TEXT NOT NULL, record TEXT NOT NULL);
             CREATE TABLE logs(execution TEXT NOT NULL, cursor INTEGER NOT NULL, stream TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY(execution, cursor));",
        )
        .unwrap();
        for i in 0..300 {
            let id = format!("e{i}");
            let rec = json!({"agentId": "main", "sessionId": "s", "id": id, "state": "completed",
                "queuedAt": "2026-01-01T00:00:00.000Z", "finishedAt": "2026-01-01T00:00:01.000Z"});
            conn.execute("INSERT INTO executions VALUES(?1, 's', 'main', ?2)", [&id, &rec.to_string()])
                .unwrap();
            conn.execute("INSERT INTO logs VALUES(?1, 1, 'stdout', ?2)", [&id, &"x".repeat(2000)]).unwrap();
        }
    }
    let mut bytes = std::fs::read(&path).unwrap();
    let at = (bytes.len() / 4096 - 3) * 4096;
    for (i, b) in bytes[at..at + 4096].iter_mut().enumerate() {
        *b = (i * 37 % 251) as u8;
    }
    std::fs::write(&path, &bytes).unwrap();
    let server = Server::start_with(on(&data));
    let aside = health(&server).await["executionRecords"]["setAside"].clone();
    assert!(aside["reason"].as_str().unwrap_or_default().contains("integrity check failed"), "{aside}");
    let moved = aside["movedTo"][0].as_str().expect("moved").to_owned();
    assert_eq!(std::fs::read(&moved).unwrap(), bytes, "the damaged file is kept as it was");
    let log = server.stderr();
    assert!(log.contains("execution_database_set_aside") && log.contains(".recover"), "{log}");
    // A new database serves.
    assert_eq!(record(&server, "e1").await.0, 400);
    assert_eq!(server.client().get("/status").await.unwrap().status, 200);
}
