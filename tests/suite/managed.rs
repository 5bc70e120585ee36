//! Managed shell executions (`/shell-executions`, contract §3 and §7 items 13, 30–37) and the
//! workspace versions every write commits (versioning reference §1–§6), driven through the
//! HTTP API of the real runnerd and checked on disk: the CAS blobs, `refs.sqlite`, the lease
//! files and the admission registry.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::server::{Server, ServerOptions, shell_request};
use runner_tests::{processes_matching, sandbox_or_skip};
use runnerctl::client::RunnerClient;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const AGENT: &str = "main";
const SESSION: &str = "session-test";
const RECORD_MEDIA_TYPE: &str = "application/vnd.sciencediscovery.record.v1+json";
const NOT_FOUND: &str = "Execution not found for this Agent";
const POISONED: &str = "Workspace version commit failed; repair storage before resuming writes";
const INTERRUPTED: &str = "Workspace has an interrupted operation; recover before resuming writes";
/// How long any wait in this file may take before the test fails (liveness guard only).
const DEADLINE: Duration = Duration::from_secs(60);

fn marker(base: u32) -> String {
    format!("{}", base + std::process::id() % 90_000)
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// RFC 4648 §5 base64url without padding (tree entry names and symlink targets).
fn b64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// A managed request body with a chosen id.
fn managed_body(ws: &Path, id: &str, code: &str) -> Value {
    let mut body = shell_request(AGENT, SESSION, ws, code);
    body["executionId"] = json!(id);
    body
}

fn owner_query(session: &str, agent: &str) -> String {
    format!("sessionId={session}&agentId={agent}")
}

async fn submit(client: &RunnerClient, body: &Value) -> (u16, Value) {
    let reply = client.post_signed("/shell-executions", body).await.unwrap();
    (reply.status, reply.json())
}

async fn record_as(client: &RunnerClient, id: &str, session: &str, agent: &str) -> (u16, Value) {
    let reply = client.get(&format!("/shell-executions/{id}?{}", owner_query(session, agent))).await.unwrap();
    (reply.status, reply.json())
}

async fn record(client: &RunnerClient, id: &str) -> Value {
    let (status, rec) = record_as(client, id, SESSION, AGENT).await;
    assert_eq!(status, 200, "{rec}");
    rec
}

/// Polls the record until `pred` holds.
async fn wait_state(client: &RunnerClient, id: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let rec = record(client, id).await;
        if pred(&rec) {
            return rec;
        }
        assert!(start.elapsed() < DEADLINE, "execution {id} never reached the expected state: {rec}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn is_terminal(rec: &Value) -> bool {
    matches!(rec["state"].as_str(), Some("completed" | "failed" | "cancelled" | "unknown"))
}

async fn wait_terminal(client: &RunnerClient, id: &str) -> Value {
    wait_state(client, id, is_terminal).await
}

async fn logs_page(client: &RunnerClient, id: &str, cursor: &str) -> (u16, Value) {
    let path = format!("/shell-executions/{id}/logs?{}&cursor={cursor}", owner_query(SESSION, AGENT));
    let reply = client.get(&path).await.unwrap();
    (reply.status, reply.json())
}

/// Every page from cursor 0 until `truncated:false`, checking the page invariants.
async fn all_log_pages(client: &RunnerClient, id: &str) -> Vec<Value> {
    let mut pages = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (status, page) = logs_page(client, id, &cursor.to_string()).await;
        assert_eq!(status, 200, "{page}");
        let chunks = page["chunks"].as_array().unwrap();
        assert!(chunks.len() <= 4, "at most 4 chunks a page: {}", chunks.len());
        for chunk in chunks {
            let c = chunk["cursor"].as_u64().unwrap();
            assert_eq!(c, cursor + 1, "cursors are 1, 2, 3, … in order");
            cursor = c;
            assert!(matches!(chunk["stream"].as_str(), Some("stdout" | "stderr")), "{chunk}");
            assert!(
                chunk["text"].as_str().unwrap().chars().count() <= 4096,
                "a chunk holds ≤ 4096 code points"
            );
        }
        assert_eq!(page["nextCursor"].as_u64(), Some(cursor), "nextCursor is the last cursor returned");
        let more = page["truncated"].as_bool().unwrap();
        pages.push(page);
        if !more {
            return pages;
        }
        assert!(pages.len() < 10_000, "the log pages never end");
    }
}

fn page_text(pages: &[Value]) -> String {
    pages
        .iter()
        .flat_map(|p| p["chunks"].as_array().unwrap().iter())
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect()
}

/// The text of all log pages as they are now (for polling a running execution).
async fn log_text(client: &RunnerClient, id: &str) -> String {
    page_text(&all_log_pages(client, id).await)
}

/// Waits until the logs contain `needle`; answers the record read then.
async fn wait_log(client: &RunnerClient, id: &str, needle: &str) -> Value {
    let start = Instant::now();
    loop {
        if log_text(client, id).await.contains(needle) {
            return record(client, id).await;
        }
        assert!(start.elapsed() < DEADLINE, "{needle:?} never appeared in the logs of {id}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---- the on-disk version store --------------------------------------------------------

fn canonical(ws: &Path) -> PathBuf {
    ws.canonicalize().unwrap()
}

fn path_hex(canonical: &Path) -> String {
    sha256_hex(canonical.to_str().unwrap().as_bytes())
}

fn head_name(canonical: &Path) -> String {
    format!("workspaces/{}/head", path_hex(canonical))
}

/// `<parent of root>/.workspace-coordination/<hex>` (add `.sqlite`, `.active`, `.failed`).
fn lease_base(canonical: &Path) -> PathBuf {
    canonical.parent().unwrap().join(".workspace-coordination").join(path_hex(canonical))
}

fn with_ext(base: &Path, ext: &str) -> PathBuf {
    PathBuf::from(format!("{}.{ext}", base.display()))
}

fn digest_hex(r: &Value) -> String {
    let digest = r["digest"].as_str().unwrap_or_else(|| panic!("not a ref: {r}"));
    let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("digest without sha256: {digest}"));
    assert!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "digest is not 64 lowercase hex: {digest}"
    );
    hex.to_owned()
}

/// The blob of a ref, its size and hash verified.
fn read_blob(data_dir: &Path, r: &Value) -> Vec<u8> {
    let pool = r["pool"].as_str().unwrap();
    assert!(pool == "data" || pool == "agent-state", "{r}");
    let hex = digest_hex(r);
    let path = data_dir.join("versioning").join(pool).join("blobs/sha256").join(&hex);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(Some(bytes.len() as u64), r["size"].as_u64(), "size of {}", path.display());
    assert_eq!(sha256_hex(&bytes), hex, "hash of {}", path.display());
    bytes
}

fn assert_keys_sorted(v: &Value) {
    match v {
        Value::Object(map) => {
            let keys: Vec<&String> = map.keys().collect();
            assert!(keys.windows(2).all(|w| w[0] < w[1]), "keys not in JCS order: {keys:?}");
            map.values().for_each(assert_keys_sorted);
        }
        Value::Array(items) => items.iter().for_each(assert_keys_sorted),
        _ => {}
    }
}

/// Reads a record ref: agent-state, the record mediaType, canonical bytes, the kind.
fn read_record(data_dir: &Path, r: &Value, kind: &str) -> Value {
    assert_eq!(r["pool"], "agent-state", "{r}");
    assert_eq!(r["mediaType"], RECORD_MEDIA_TYPE, "{r}");
    assert_eq!(r.as_object().unwrap().len(), 4, "a ref has exactly four keys: {r}");
    let bytes = read_blob(data_dir, r);
    let rec: Value = serde_json::from_slice(&bytes).unwrap();
    assert_keys_sorted(&rec);
    assert_eq!(serde_json::to_string(&rec).unwrap().as_bytes(), &bytes[..], "record bytes are canonical");
    assert_eq!(rec["schemaVersion"], 1);
    assert_eq!(rec["kind"], kind, "{rec}");
    assert!(rec["dependencies"].is_array());
    rec
}

/// `{"digest":…,"mediaType":…,"pool":…,"size":N}`.
fn jcs_ref(r: &Value) -> String {
    format!(
        r#"{{"digest":"{}","mediaType":"{}","pool":"{}","size":{}}}"#,
        r["digest"].as_str().unwrap(),
        r["mediaType"].as_str().unwrap(),
        r["pool"].as_str().unwrap(),
        r["size"].as_u64().unwrap()
    )
}

fn refs_db(data_dir: &Path) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(data_dir.join("versioning/refs.sqlite")).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn
}

/// The live target of the workspace's head, as stored (JCS text).
fn head_target(data_dir: &Path, canonical: &Path) -> Option<String> {
    use rusqlite::OptionalExtension;
    refs_db(data_dir)
        .query_row("SELECT target FROM live_refs WHERE name=?1", [head_name(canonical)], |row| row.get(0))
        .optional()
        .unwrap()
}

fn head_record(data_dir: &Path, canonical: &Path, kind: &str) -> Value {
    let text = head_target(data_dir, canonical).expect("the workspace has a head");
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(jcs_ref(&r), text, "the live target is JCS text");
    read_record(data_dir, &r, kind)
}

/// Every blob file in both pools is named by the sha256 of its bytes; answers the count.
fn verify_all_blobs(data_dir: &Path) -> usize {
    let mut n = 0;
    for pool in ["data", "agent-state"] {
        let dir = data_dir.join("versioning").join(pool).join("blobs/sha256");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            if name.ends_with(".tmp") {
                continue;
            }
            let bytes = std::fs::read(entry.path()).unwrap();
            assert_eq!(sha256_hex(&bytes), name, "{pool} blob {name}");
            n += 1;
        }
    }
    n
}

fn assert_record_ref(r: &Value) {
    assert_eq!(r["pool"], "agent-state", "{r}");
    assert_eq!(r["mediaType"], RECORD_MEDIA_TYPE, "{r}");
    digest_hex(r);
    assert!(r["size"].as_u64().unwrap() > 0, "{r}");
}

fn private_dir(dir: &Path) {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).unwrap();
}

// ---- tests ----------------------------------------------------------------------------

/// Contract §7 item 13, step by step.
#[tokio::test]
async fn managed_run_outlives_its_request_queues_the_next_writer_and_cancels() {
    if !sandbox_or_skip("managed_run_outlives_its_request_queues_the_next_writer_and_cancels") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-13");
    let mut first = managed_body(
        &ws,
        "managed-first",
        "echo training-started; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
    );
    first["executionTimeoutMs"] = json!(1);
    let (status, queued) = submit(&client, &first).await;
    assert_eq!(status, 202, "{queued}");
    assert_eq!(queued["state"], "queued");
    assert_eq!(queued["id"], "managed-first");
    assert_eq!(queued["agentId"], AGENT);
    assert_eq!(queued["sessionId"], SESSION);
    let queued_at = queued["queuedAt"].as_str().unwrap();
    assert!(queued_at.len() == 24 && queued_at.ends_with('Z'), "{queued_at}");

    // Neither the HTTP return nor the 1 ms budget stops it.
    let running = wait_log(&client, "managed-first", "training-started").await;
    assert_eq!(running["state"], "running", "{running}");
    assert!(running["startedAt"].is_string());
    assert!(running.get("finishedAt").is_none());

    let second = managed_body(&ws, "managed-second", "echo after-cancel > done.txt");
    let (status, queued2) = submit(&client, &second).await;
    assert_eq!((status, queued2["state"].as_str()), (202, Some("queued")), "{queued2}");

    let (status, other) = record_as(&client, "managed-first", "another", AGENT).await;
    assert_eq!((status, other["error"].as_str()), (400, Some(NOT_FOUND)), "{other}");

    let cancel = client
        .raw(
            "POST",
            &format!("/shell-executions/managed-first/cancel?{}", owner_query(SESSION, AGENT)),
            &[("authorization", format!("Bearer {}", client.token()))],
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(cancel.status, 202, "{}", String::from_utf8_lossy(&cancel.body));
    assert_eq!(cancel.json()["state"], "running", "cancel answers the record as it was");

    let first_done = wait_terminal(&client, "managed-first").await;
    assert_eq!(first_done["state"], "cancelled", "{first_done}");
    assert!(first_done["finishedAt"].is_string());
    assert_record_ref(&first_done["version"]);
    let version = read_record(&server.data_dir, &first_done["version"], "WorkspaceExecution");
    assert_eq!(version["value"]["state"], "cancelled");
    assert_eq!(version["value"]["executionId"], "managed-first");
    assert!(
        log_text(&client, "managed-first").await.contains("training-started"),
        "a cancelled run keeps its logs"
    );

    let second_done = wait_terminal(&client, "managed-second").await;
    assert_eq!(second_done["state"], "completed", "{second_done}");
    assert_eq!(std::fs::read_to_string(ws.join("done.txt")).unwrap(), "after-cancel\n");
    assert!(
        second_done["startedAt"].as_str().unwrap() >= first_done["finishedAt"].as_str().unwrap(),
        "the second writer started only after the first recorded its end"
    );
    assert_record_ref(&second_done["version"]);

    let again = managed_body(&ws, "managed-second", "echo replay > replay.txt");
    let (status, refused) = submit(&client, &again).await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("already been used"), "{refused}");
    assert!(!ws.join("replay.txt").exists());
}

/// Items 31 and 42: split UTF-8 reassembles in the logs and in the version's stdout blob;
/// the version is the committed head, in JCS, and every blob is named by its hash.
#[tokio::test]
async fn split_utf8_logs_and_the_committed_execution_version() {
    if !sandbox_or_skip("split_utf8_logs_and_the_committed_execution_version") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-utf8");
    // 训练中\n = e8 ae ad e7 bb 83 e4 b8 ad 0a, cut inside the first character.
    let code = r"printf '\350\256'; sleep 0.3; printf '\255\347\273\203\344\270\255\n'";
    let (status, queued) = submit(&client, &managed_body(&ws, "utf8-run", code)).await;
    assert_eq!(status, 202, "{queued}");
    let done = wait_terminal(&client, "utf8-run").await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(log_text(&client, "utf8-run").await, "训练中\n");

    let data = &server.data_dir;
    let version = read_record(data, &done["version"], "WorkspaceExecution");
    let value = &version["value"];
    assert_eq!(read_blob(data, &value["stdout"]), "训练中\n".as_bytes());
    assert_eq!(read_blob(data, &value["stderr"]), b"");
    assert_eq!(read_blob(data, &value["code"]), code.as_bytes());
    for key in ["code", "stdout", "stderr"] {
        assert_eq!(value[key]["pool"], "agent-state", "{key}");
        assert_eq!(value[key]["mediaType"], "application/octet-stream", "{key}");
    }
    assert_eq!(value["executionId"], "utf8-run");
    assert_eq!(value["agentId"], AGENT);
    assert_eq!(value["sessionId"], SESSION);
    assert_eq!(value["state"], "completed");
    assert_eq!(value["environmentRevisionId"], "system-shell-bwrap-v1");
    // The result's snapshot is the version's tree.
    assert_eq!(value["workspace"], done["result"]["workspaceSnapshot"]);
    read_record(data, &value["workspace"], "WorkspaceTree");
    // Dependencies: exactly the embedded refs, de-duplicated and sorted by JCS text.
    let mut expected: Vec<String> =
        ["code", "stderr", "stdout", "workspace"].iter().map(|k| jcs_ref(&value[*k])).collect();
    expected.sort();
    expected.dedup();
    let deps: Vec<String> = version["dependencies"].as_array().unwrap().iter().map(jcs_ref).collect();
    assert_eq!(deps, expected);

    let ws_root = canonical(&ws);
    let target = head_target(data, &ws_root).expect("a head");
    assert_eq!(target, jcs_ref(&done["version"]), "the live head is the version, as JCS text");
    let history: i64 = refs_db(data)
        .query_row(
            "SELECT COUNT(*) FROM history_refs WHERE name=?1 AND target=?2",
            [head_name(&ws_root), target],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(history, 1, "the version is rooted in the history");
    assert!(verify_all_blobs(data) >= 5);
}

/// Items 35 and 47: the log budget keeps exactly 25 000 characters over paginated logs.
#[tokio::test]
async fn log_retention_keeps_exactly_the_output_budget() {
    if !sandbox_or_skip("log_retention_keeps_exactly_the_output_budget") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-budget");
    let mut body = managed_body(&ws, "budget-run", "head -c 30000 /dev/zero | tr '\\0' x");
    body["maxOutputBytes"] = json!(25_000);
    let (status, queued) = submit(&client, &body).await;
    assert_eq!(status, 202, "{queued}");
    let done = wait_terminal(&client, "budget-run").await;
    assert_eq!(done["state"], "completed", "the process keeps running past the budget: {done}");
    assert_eq!(done["logTruncated"], true, "{done}");

    let pages = all_log_pages(&client, "budget-run").await;
    assert!(pages.len() >= 2, "25 000 characters need more than one page of 4 × 4096");
    assert_eq!(pages[0]["truncated"], true, "page 1 says more pages exist");
    assert_eq!(pages.last().unwrap()["truncated"], false);
    for page in &pages {
        assert_eq!(page["retentionTruncated"], true, "{page}");
    }
    let text = page_text(&pages);
    assert_eq!(text.len(), 25_000);
    assert!(text.bytes().all(|b| b == b'x'));
    // Past the end: nothing, and the cursor stays where it was asked.
    let last = pages.last().unwrap()["nextCursor"].as_u64().unwrap();
    let (status, after) = logs_page(&client, "budget-run", &last.to_string()).await;
    assert_eq!(status, 200);
    assert_eq!(after["chunks"], json!([]));
    assert_eq!(after["nextCursor"].as_u64(), Some(last));
    assert_eq!(after["truncated"], false);
    // The version's stdout holds the retained text.
    let version = read_record(&server.data_dir, &done["version"], "WorkspaceExecution");
    assert_eq!(version["value"]["stdout"]["size"], 25_000);
}

/// Items 34 and 46: a completed execution survives a SIGTERM restart; one running when
/// runnerd is SIGKILLed reads `unknown`, its sandbox is gone, its id stays used, and
/// runnerd recovers its own interrupted lease at start.
#[tokio::test]
async fn records_survive_restarts_and_a_killed_run_becomes_unknown() {
    if !sandbox_or_skip("records_survive_restarts_and_a_killed_run_becomes_unknown") {
        return;
    }
    let mut first = Server::start();
    let data = first.data_dir.clone();
    let same_data = || ServerOptions {
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), data.to_str().unwrap().into())],
        ..Default::default()
    };
    let ws = first.project_workspace("managed-restart");
    let ws_root = canonical(&ws);
    let client = first.client();
    let (status, _) = submit(&client, &managed_body(&ws, "before-restart", "echo kept")).await;
    assert_eq!(status, 202);
    let done = wait_terminal(&client, "before-restart").await;
    assert_eq!(done["state"], "completed", "{done}");
    let (_, logs_before) = logs_page(&client, "before-restart", "0").await;
    assert!(first.stop().success(), "SIGTERM stops runnerd cleanly");

    let mut second = Server::start_with(same_data());
    let client = second.client();
    assert_eq!(record(&client, "before-restart").await, done, "the record survives as it was");
    assert_eq!(logs_page(&client, "before-restart", "0").await, (200, logs_before));
    let (status, refused) = submit(&client, &managed_body(&ws, "before-restart", "echo again")).await;
    assert_eq!(status, 400);
    assert!(refused["error"].as_str().unwrap().contains("already been used"), "{refused}");

    let m = marker(700_000);
    let code = format!("echo started > started.txt; echo started; while true; do sleep 7{m}; done");
    let (status, _) = submit(&client, &managed_body(&ws, "killed-run", &code)).await;
    assert_eq!(status, 202);
    let running = wait_log(&client, "killed-run", "started").await;
    assert_eq!(running["state"], "running");
    let start = Instant::now();
    while processes_matching(&format!("sleep 7{m}")).is_empty() {
        assert!(start.elapsed() < DEADLINE, "the sandboxed sleep never showed up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let active = with_ext(&lease_base(&ws_root), "active");
    assert!(active.exists(), "runnerd holds the lease while the run goes on");
    let head_before = head_target(&data, &ws_root).expect("the baseline was committed before the run");
    second.child.kill().unwrap();
    second.child.wait().unwrap();
    let start = Instant::now();
    while !processes_matching(&format!("sleep 7{m}")).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(15), "the sandbox outlived runnerd");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(active.exists(), "a killed runnerd leaves its marker behind");

    let third = Server::start_with(same_data());
    let client = third.client();
    let unknown = record(&client, "killed-run").await;
    assert_eq!(unknown["state"], "unknown", "{unknown}");
    assert!(unknown["error"].as_str().unwrap().contains("not replayed"), "{unknown}");
    assert!(unknown["finishedAt"].is_string(), "{unknown}");
    assert!(unknown.get("version").is_none(), "{unknown}");
    assert_eq!(record(&client, "before-restart").await, done);
    let (status, refused) = submit(&client, &managed_body(&ws, "killed-run", "echo replay")).await;
    assert_eq!(status, 400);
    assert!(refused["error"].as_str().unwrap().contains("already been used"), "{refused}");

    // runnerd recovered the lease its killed process held.
    assert!(!active.exists(), "the recovered marker is removed");
    assert!(third.stderr().contains("workspace_recovered"), "{}", third.stderr());
    let head_after = head_target(&data, &ws_root).unwrap();
    assert_ne!(head_after, head_before, "recovery commits a new head");
    let recovery = head_record(&data, &ws_root, "WorkspaceMutation");
    assert_eq!(recovery["value"]["kind"], "runner-recovery", "{recovery}");
    assert_eq!(recovery["value"]["status"], "completed");
    let tree = read_record(&data, &recovery["value"]["workspace"], "WorkspaceTree");
    assert!(
        tree["value"]["entries"].as_array().unwrap().iter().any(|e| e["name"] == b64url(b"started.txt")),
        "the recovery records the files as the killed run left them: {tree}"
    );
    let reply = client
        .post_signed("/execute-shell", &shell_request(AGENT, SESSION, &ws, "cat started.txt"))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.json()["stdout"], "started\n");
    assert!(processes_matching(&format!("sleep 7{m}")).is_empty());
}

/// Items 30 and 40: a deletion fence fails the run with /deleted/ without poisoning; once
/// the fence is gone the workspace works again.
#[tokio::test]
async fn a_retirement_fence_fails_the_run_without_poisoning() {
    if !sandbox_or_skip("a_retirement_fence_fails_the_run_without_poisoning") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-fence");
    let ws_root = canonical(&ws);
    let registry = server.data_dir.canonicalize().unwrap().join(".workspace-lifecycle/registry.sqlite");
    let conn = rusqlite::Connection::open(&registry).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.execute("INSERT INTO fences(scope, owner) VALUES(?1, 'api')", [ws_root.to_str().unwrap()]).unwrap();

    let (status, _) = submit(&client, &managed_body(&ws, "fenced", "echo no > fenced.txt")).await;
    assert_eq!(status, 202);
    let failed = wait_terminal(&client, "fenced").await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed["error"].as_str().unwrap().contains("deleted"), "{failed}");
    assert!(failed.get("version").is_none(), "{failed}");
    assert!(!ws.join("fenced.txt").exists(), "the command never ran");
    assert!(!with_ext(&lease_base(&ws_root), "failed").exists(), "a fence does not poison");

    conn.execute("DELETE FROM fences WHERE scope=?1", [ws_root.to_str().unwrap()]).unwrap();
    drop(conn);
    let (status, _) = submit(&client, &managed_body(&ws, "reopened", "echo yes > reopened.txt")).await;
    assert_eq!(status, 202);
    let done = wait_terminal(&client, "reopened").await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(std::fs::read_to_string(ws.join("reopened.txt")).unwrap(), "yes\n");
    assert_record_ref(&done["version"]);
}

/// Items 37 and 48: a failed ref publication fails the run without a version, poisons the
/// workspace on disk and in runnerd, and refuses later managed and sync writers.
#[tokio::test]
async fn a_failed_ref_publication_poisons_the_workspace() {
    if !sandbox_or_skip("a_failed_ref_publication_poisons_the_workspace") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-poison");
    let ws_root = canonical(&ws);
    let (status, _) = submit(&client, &managed_body(&ws, "before-fault", "echo one > one.txt")).await;
    assert_eq!(status, 202);
    let ok = wait_terminal(&client, "before-fault").await;
    assert_eq!(ok["state"], "completed", "{ok}");

    refs_db(&server.data_dir)
        .execute_batch(
            "CREATE TRIGGER t BEFORE INSERT ON history_refs \
             BEGIN SELECT RAISE(ABORT, 'ref publication failure'); END;",
        )
        .unwrap();
    let (status, _) = submit(&client, &managed_body(&ws, "faulted", "echo two > two.txt")).await;
    assert_eq!(status, 202);
    let failed = wait_terminal(&client, "faulted").await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert!(failed.get("version").is_none(), "{failed}");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains("version commit failed"), "{error}");
    assert!(error.contains("ref publication failure"), "{error}");
    assert_eq!(
        head_target(&server.data_dir, &ws_root),
        Some(jcs_ref(&ok["version"])),
        "the failed commit left the previous head"
    );
    let failed_marker = with_ext(&lease_base(&ws_root), "failed");
    assert_eq!(std::fs::read_to_string(&failed_marker).unwrap(), POISONED);
    assert!(!with_ext(&lease_base(&ws_root), "active").exists(), "the lease was released");

    let (status, refused) =
        submit(&client, &managed_body(&ws, "after-fault", "echo three > three.txt")).await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("repair storage"), "{refused}");
    let reply = client
        .post_signed("/execute-shell", &shell_request(AGENT, SESSION, &ws, "echo sync > sync.txt"))
        .await
        .unwrap();
    assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(&reply.body));
    assert!(reply.json()["error"].as_str().unwrap().contains("repair storage"), "{}", reply.json());
    assert!(!ws.join("three.txt").exists() && !ws.join("sync.txt").exists());
}

/// Reference §6.1: another process holding the writer lease keeps a managed run queued and
/// a sync call waiting until it lets go.
#[tokio::test]
async fn a_lease_held_by_another_process_holds_writers_back() {
    if !sandbox_or_skip("a_lease_held_by_another_process_holds_writers_back") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-lease");
    let ws_root = canonical(&ws);
    let base = lease_base(&ws_root);
    private_dir(base.parent().unwrap());
    let take_lease = || {
        let conn = rusqlite::Connection::open(with_ext(&base, "sqlite")).unwrap();
        conn.execute_batch("BEGIN IMMEDIATE").unwrap();
        conn
    };
    let release = |conn: rusqlite::Connection| {
        conn.execute_batch("ROLLBACK").unwrap();
        conn.close().unwrap();
    };

    let held = take_lease();
    let (status, _) = submit(&client, &managed_body(&ws, "behind-lease", "echo ran > ran.txt")).await;
    assert_eq!(status, 202);
    for _ in 0..30 {
        assert_eq!(record(&client, "behind-lease").await["state"], "queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!ws.join("ran.txt").exists());
    release(held);
    let done = wait_terminal(&client, "behind-lease").await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(std::fs::read_to_string(ws.join("ran.txt")).unwrap(), "ran\n");

    let held = take_lease();
    let sync_client = server.client();
    let body = shell_request(AGENT, SESSION, &ws, "echo sync > sync.txt");
    let id = body["executionId"].as_str().unwrap().to_owned();
    let call = tokio::spawn(async move { sync_client.post_signed("/execute-shell", &body).await.unwrap() });
    let start = Instant::now();
    loop {
        let status = client.get("/status").await.unwrap().json();
        let active = status["activeExecutions"].as_array().cloned().unwrap_or_default();
        if active.iter().any(|e| e["executionId"] == id.as_str()) {
            let entry = active.iter().find(|e| e["executionId"] == id.as_str()).unwrap();
            assert_eq!(entry["status"], "queued", "not running while the lease is held elsewhere: {entry}");
            break;
        }
        assert!(start.elapsed() < DEADLINE, "the sync call never showed up in /status");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!call.is_finished(), "the sync call waits for the lease");
    assert!(!ws.join("sync.txt").exists());
    release(held);
    let reply = tokio::time::timeout(DEADLINE, call).await.expect("the sync call ends").unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(std::fs::read_to_string(ws.join("sync.txt")).unwrap(), "sync\n");
}

/// Reference §6.1 and contract §3: an `.active` marker runnerd did not write (someone
/// else's crashed writer) refuses managed and sync writers and is left in place.
#[tokio::test]
async fn a_foreign_interrupted_marker_refuses_writers() {
    if !sandbox_or_skip("a_foreign_interrupted_marker_refuses_writers") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-foreign");
    let ws_root = canonical(&ws);
    let base = lease_base(&ws_root);
    private_dir(base.parent().unwrap());
    let active = with_ext(&base, "active");
    let planted = "Unfinished Workspace operation; verify processes and recover before resuming";
    std::fs::write(&active, planted).unwrap();

    let (status, _) = submit(&client, &managed_body(&ws, "interrupted", "echo no > no.txt")).await;
    assert_eq!(status, 202);
    let failed = wait_terminal(&client, "interrupted").await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["error"], INTERRUPTED, "{failed}");
    assert!(failed.get("version").is_none());

    let reply = client
        .post_signed("/execute-shell", &shell_request(AGENT, SESSION, &ws, "echo no > sync.txt"))
        .await
        .unwrap();
    assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(reply.json()["error"], INTERRUPTED);
    assert_eq!(std::fs::read_to_string(&active).unwrap(), planted, "someone else's marker is left alone");
    assert!(!ws.join("no.txt").exists() && !ws.join("sync.txt").exists());
}

/// Sync `/execute-shell` commits a `legacy-execution` mutation and reports its tree
/// (reference §3.1, §3.2): stable digests, symlinks, exec bits and empty directories.
#[tokio::test]
async fn sync_results_carry_the_committed_workspace_snapshot() {
    if !sandbox_or_skip("sync_results_carry_the_committed_workspace_snapshot") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let data = &server.data_dir;
    let ws = server.project_workspace("sync-tree");
    let ws_root = canonical(&ws);
    std::fs::write(ws.join("input.txt"), "input").unwrap();
    let sync = |code: &str| shell_request(AGENT, SESSION, &ws, code);

    let body = sync("echo hi");
    let reply = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let r1 = reply.json();
    let snap1 = &r1["workspaceSnapshot"];
    assert_record_ref(snap1);
    read_record(data, snap1, "WorkspaceTree");
    let head = head_record(data, &ws_root, "WorkspaceMutation");
    assert_eq!(head["value"]["kind"], "legacy-execution", "{head}");
    assert_eq!(head["value"]["id"], body["executionId"]);
    assert_eq!(head["value"]["status"], "completed");
    assert_eq!(&head["value"]["workspace"], snap1);
    assert_eq!(head["dependencies"], json!([snap1]));

    let body2 = sync("echo hi");
    let r2 = client.post_signed("/execute-shell", &body2).await.unwrap().json();
    assert_eq!(r2["workspaceSnapshot"], *snap1, "no file change, the same tree: {r2}");
    assert_eq!(head_record(data, &ws_root, "WorkspaceMutation")["value"]["id"], body2["executionId"]);

    let r3 = client
        .post_signed(
            "/execute-shell",
            &sync(
                "mkdir emptydir; ln -s ../outside link; printf '#!/bin/sh\\n' > tool.sh; chmod 755 tool.sh; \
                 printf x > plain.txt; chmod 644 plain.txt",
            ),
        )
        .await
        .unwrap()
        .json();
    let snap3 = &r3["workspaceSnapshot"];
    assert_ne!(snap3["digest"], snap1["digest"], "{r3}");
    let tree = read_record(data, snap3, "WorkspaceTree");
    let entries = tree["value"]["entries"].as_array().unwrap();
    let names: Vec<&str> = entries.iter().map(|e| e["name"].as_str().unwrap()).collect();
    let mut raw: Vec<&[u8]> =
        vec![b"emptydir", b"input.txt", b"link", b"plain.txt", b"tool.sh", b".sciencediscovery"];
    raw.sort();
    let expected: Vec<String> = raw.iter().map(|n| b64url(n)).collect();
    let unexpected: Vec<&&str> = names.iter().filter(|n| !expected.iter().any(|e| e == **n)).collect();
    assert!(unexpected.is_empty(), "unexpected entries {unexpected:?} in {tree}");
    let sorted: Vec<&str> = expected.iter().map(String::as_str).filter(|e| names.contains(e)).collect();
    assert_eq!(names, sorted, "entries in bytewise name order");
    let entry = |name: &[u8]| {
        entries.iter().find(|e| e["name"] == b64url(name)).unwrap_or_else(|| panic!("no {name:?} in {tree}"))
    };
    let empty = entry(b"emptydir");
    assert_eq!(empty["type"], "directory");
    assert_eq!(read_record(data, &empty["tree"], "WorkspaceTree")["value"], json!({"entries": []}));
    let link = entry(b"link");
    assert_eq!(link["type"], "symlink");
    assert_eq!(link["target"], b64url(b"../outside"));
    let tool = entry(b"tool.sh");
    assert_eq!((tool["type"].as_str(), tool["executable"].as_u64()), (Some("file"), Some(73)));
    assert_eq!(read_blob(data, &tool["content"]), b"#!/bin/sh\n");
    let plain = entry(b"plain.txt");
    assert_eq!((plain["type"].as_str(), plain["executable"].as_u64()), (Some("file"), Some(0)));
    assert_eq!(plain["content"]["pool"], "data");
    assert_eq!(plain["content"]["mediaType"], "application/octet-stream");
    assert_eq!(read_blob(data, &plain["content"]), b"x");
    assert_eq!(read_blob(data, &entry(b"input.txt")["content"]), b"input");
    assert!(verify_all_blobs(data) > 0);
}

/// Contract §3: owner checks and bad input answer 400 with the original's texts.
#[tokio::test]
async fn managed_routes_refuse_strangers_and_bad_input() {
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-input");
    let q = owner_query(SESSION, AGENT);
    for (method, path) in [
        ("GET", format!("/shell-executions/nope?{q}")),
        ("GET", format!("/shell-executions/nope/logs?{q}")),
        ("POST", format!("/shell-executions/nope/cancel?{q}")),
    ] {
        let bearer = [("authorization", format!("Bearer {}", client.token()))];
        let r = client.raw(method, &path, &bearer, Vec::new()).await.unwrap();
        assert_eq!((r.status, r.json()["error"].as_str()), (400, Some(NOT_FOUND)), "{method} {path}");
        assert!(r.json()["code"].is_string());
    }
    let (status, bad) = submit(&client, &managed_body(&ws, "has space", "echo x")).await;
    assert_eq!((status, bad["error"].as_str()), (400, Some("Invalid Execution ID")), "{bad}");
    let unsigned =
        client.post_json("/shell-executions", &managed_body(&ws, "unsigned", "echo x")).await.unwrap();
    assert_eq!(unsigned.status, 401);
    assert_eq!(unsigned.json()["error"], "Invalid or expired execution signature");
    let mut persistent = managed_body(&ws, "persistent", "echo x");
    persistent["kernelMode"] = json!("persistent");
    let (status, refused) = submit(&client, &persistent).await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("persistent runtimes are no longer supported"));
    let delete = client
        .raw(
            "DELETE",
            "/shell-executions/x",
            &[("authorization", format!("Bearer {}", client.token()))],
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(delete.status, 404);
    // None of the refused requests used an id.
    for id in ["unsigned", "persistent"] {
        let (status, _) = record_as(&client, id, SESSION, AGENT).await;
        assert_eq!(status, 400, "{id} was never stored");
    }

    if !sandbox_or_skip("managed_routes_refuse_strangers_and_bad_input") {
        return;
    }
    let (status, _) = submit(&client, &managed_body(&ws, "real", "echo real")).await;
    assert_eq!(status, 202);
    let done = wait_terminal(&client, "real").await;
    assert_eq!(done["state"], "completed", "{done}");
    for cursor in ["-1", "abc", "1.5"] {
        let (status, page) = logs_page(&client, "real", cursor).await;
        assert_eq!((status, page["error"].as_str()), (400, Some("Invalid log cursor")), "cursor={cursor}");
    }
    let (status, page) = logs_page(&client, "real", "0").await;
    assert_eq!(status, 200);
    assert_eq!(page["chunks"], json!([{"cursor": 1, "stream": "stdout", "text": "real\n"}]));
    // Another agent of the same session, and missing owner parameters, see nothing.
    let (status, other) = record_as(&client, "real", SESSION, "other-agent").await;
    assert_eq!((status, other["error"].as_str()), (400, Some(NOT_FOUND)));
    let r = client.get("/shell-executions/real").await.unwrap();
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some(NOT_FOUND)));
    let r = client.get("/shell-executions/real/logs?sessionId=another&agentId=main").await.unwrap();
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some(NOT_FOUND)));
    let stranger_cancel = client
        .raw(
            "POST",
            "/shell-executions/real/cancel?sessionId=another&agentId=main",
            &[("authorization", format!("Bearer {}", client.token()))],
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(stranger_cancel.status, 400);
    // Cancelling a terminal execution answers it unchanged.
    let bearer = [("authorization", format!("Bearer {}", client.token()))];
    let cancel =
        client.raw("POST", &format!("/shell-executions/real/cancel?{q}"), &bearer, Vec::new()).await.unwrap();
    assert_eq!(cancel.status, 202);
    assert_eq!(cancel.json(), done);
}

/// Contract §7 item 36: the workspace deleted under a running execution. The snapshot would
/// see an empty directory through runnerd's descriptor; it is refused instead: `failed`, no
/// `version`, `version commit failed`, and later starts refused with `repair storage`.
#[tokio::test]
async fn a_workspace_deleted_under_a_run_fails_its_version_and_poisons() {
    if !sandbox_or_skip("a_workspace_deleted_under_a_run_fails_its_version_and_poisons") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("deleted");
    std::fs::write(ws.join("data.txt"), "x").unwrap();
    let (status, _) = submit(&client, &managed_body(&ws, "doomed", "echo started; sleep 2")).await;
    assert_eq!(status, 202);
    wait_log(&client, "doomed", "started").await;
    std::fs::remove_dir_all(&ws).unwrap();
    let rec = wait_terminal(&client, "doomed").await;
    assert_eq!(rec["state"], "failed", "{rec}");
    assert!(rec.get("version").is_none(), "{rec}");
    let error = rec["error"].as_str().unwrap();
    assert!(error.contains("version commit failed") && error.contains("deleted"), "{error}");
    std::fs::create_dir_all(&ws).unwrap();
    let (status, refused) = submit(&client, &managed_body(&ws, "after", "true")).await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"].as_str().unwrap().contains("repair storage"), "{refused}");
}

/// A managed request its run refuses is accepted (202) and fails with the synchronous
/// route's text, as the original's (contract §3: only four refusals before the 202); the
/// checks are the engine's, made once when it is accepted. The mounts check the original's
/// run makes is made too.
#[tokio::test]
async fn a_request_its_run_refuses_is_accepted_and_fails_with_the_reason() {
    if !sandbox_or_skip("a_request_its_run_refuses_is_accepted_and_fails_with_the_reason") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-refused");
    for (n, (patch, text)) in [
        (json!({"code": "   "}), "Shell code is required"),
        (json!({"environmentId": "env-1"}), "Scientific environments are unavailable"),
        (json!({"cwd": "/etc"}), "cwd must be workspace-relative"),
        (json!({"cwd": "../.."}), "cwd must remain inside the writable workspace"),
        (json!({"cwd": "absent/dir"}), ""),
        (json!({"resourceLimits": {"memoryBytes": -1}}), ""),
        (
            json!({"permissionEpoch": {"sessionId": SESSION, "mounts": []}}),
            "Shell execution accepts exactly one read-write workspace mount",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("refused-{n}-{}", marker(0));
        let mut body = managed_body(&ws, &id, "echo never > never.txt");
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, rec) = submit(&client, &body).await;
        assert_eq!((status, rec["state"].as_str()), (202, Some("queued")), "{patch}: {rec}");
        let done = wait_terminal(&client, &id).await;
        assert_eq!(done["state"], "failed", "{patch}: {done}");
        let error = done["error"].as_str().unwrap_or_default();
        if text.is_empty() {
            assert!(!error.is_empty(), "{patch}: {done}");
        } else {
            assert_eq!(error, text, "{patch}");
        }
    }
    assert!(!ws.join("never.txt").exists(), "no refused request ran");
}

/// A `cwd` is found when the managed run starts: a run queued behind the one that creates
/// the directory can use it.
#[tokio::test]
async fn a_queued_run_may_use_a_cwd_an_earlier_run_creates() {
    if !sandbox_or_skip("a_queued_run_may_use_a_cwd_an_earlier_run_creates") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("managed-cwd-later");
    let first = format!("mk-{}", marker(0));
    let second = format!("in-{}", marker(0));
    let (status, _) = submit(&client, &managed_body(&ws, &first, "sleep 0.3; mkdir -p made/here")).await;
    assert_eq!(status, 202);
    let mut body = managed_body(&ws, &second, "pwd");
    body["cwd"] = json!("made/here");
    let (status, rec) = submit(&client, &body).await;
    assert_eq!(status, 202, "{rec}");
    let done = wait_terminal(&client, &second).await;
    assert_eq!(done["state"], "completed", "{done}");
    assert!(log_text(&client, &second).await.contains("/made/here"), "{done}");
}
