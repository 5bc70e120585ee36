//! Issue #14 hole 4: output cannot cost runnerd more memory than it promised. A sandbox
//! floods stdout with 64 MiB of `\x01` (6 bytes each once JSON-escaped, `\u0001`) through the
//! real HTTP API; runnerd's peak RSS (`VmHWM`, after a small warm-up run) may grow by at most
//! the stated bound (README "Output memory": the answer's output counted as JSON per
//! execution, the server-wide ceiling across all) plus a fixed allowance for the run itself
//! (threads, pipe and task buffers). Memory figures only, never a clock.

use std::time::{Duration, Instant};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, keyed_shell_request};
use runnerctl::client::RunnerClient;
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// 64 MiB of `\x01` on stdout.
const FLOOD: &str = "head -c 67108864 /dev/zero | tr '\\0' '\\1'";
const FLOOD_BYTES: u64 = 64 * MIB;
/// What a run may cost runnerd besides the output it holds (task and pipe buffers, the
/// executor, allocator slack); generous against the amplification it guards (12x).
const ALLOWANCE: u64 = 40 * MIB;
/// A managed run's result holds at most this much output, counted as JSON.
const RESULT_CAP: u64 = 4 * MIB;
/// What a managed run's output may cost besides the allowance: the result's text, its copy
/// in the record, the record's JSON and SQLite's two copies of it while it is written.
const MANAGED_BOUND: u64 = 5 * RESULT_CAP;

fn hwm(server: &Server) -> u64 {
    let pid = server.pid().expect("runnerd's pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap().to_owned();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// The JSON-escaped length of a string's content (serde_json's escaping).
fn json_len(s: &str) -> u64 {
    serde_json::to_string(s).unwrap().len() as u64 - 2
}

fn server(ceiling: Option<u64>) -> Server {
    let mut env = Vec::new();
    if let Some(c) = ceiling {
        env.push(("SCIENCE_AGENT_MAX_BUFFERED_OUTPUT_BYTES".to_owned(), c.to_string()));
    }
    Server::start_with(ServerOptions { env, ..Default::default() })
}

async fn shell(client: &RunnerClient, key: &str, code: &str) -> Value {
    let reply =
        client.post_signed("/execute-shell", &keyed_shell_request("a", "s", key, code)).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body[..reply.body.len().min(2000)]));
    reply.json()
}

/// Warms runnerd up with a small run; its peak after that is the baseline.
async fn baseline(server: &Server, client: &RunnerClient) -> u64 {
    let small = shell(client, "out/warm", "head -c 100000 /dev/zero | tr '\\0' '\\1'").await;
    assert_eq!(small["stdout"].as_str().unwrap().len(), 100_000);
    hwm(server)
}

#[tokio::test]
async fn a_control_byte_flood_costs_runnerd_at_most_its_json_size() {
    if !sandbox_or_skip("a_control_byte_flood_costs_runnerd_at_most_its_json_size") {
        return;
    }
    let server = server(None);
    let client = server.client();
    let before = baseline(&server, &client).await;
    let answer = shell(&client, "out/flood", FLOOD).await;
    let grown = hwm(&server).saturating_sub(before);
    let stdout = answer["stdout"].as_str().unwrap();
    // Within the default 1 GiB budget (counted as JSON: 384 MiB): nothing is cut.
    assert_eq!(stdout.len() as u64, FLOOD_BYTES);
    assert!(stdout.bytes().all(|b| b == 1));
    let held = json_len(stdout);
    assert_eq!(held, 6 * FLOOD_BYTES);
    assert!(
        grown <= held + ALLOWANCE,
        "runnerd's peak memory grew by {} MiB for an answer holding {} MiB of output (bound {} MiB)",
        grown / MIB,
        held / MIB,
        (held + ALLOWANCE) / MIB
    );
    // And what README promises beyond the bound: the answer streams, so the flood costs the
    // text runnerd keeps, not its 6x escaped form.
    assert!(
        grown <= FLOOD_BYTES + ALLOWANCE,
        "runnerd's peak memory grew by {} MiB for {} MiB of kept output",
        grown / MIB,
        FLOOD_BYTES / MIB
    );
}

#[tokio::test]
async fn the_server_wide_ceiling_bounds_a_flood_and_cuts_it_with_the_marker() {
    if !sandbox_or_skip("the_server_wide_ceiling_bounds_a_flood_and_cuts_it_with_the_marker") {
        return;
    }
    let ceiling = 8 * MIB;
    let server = server(Some(ceiling));
    let client = server.client();
    let before = baseline(&server, &client).await;
    let answer = shell(&client, "out/flood", FLOOD).await;
    let grown = hwm(&server).saturating_sub(before);
    let stdout = answer["stdout"].as_str().unwrap();
    assert_eq!(answer["exitCode"], 0, "output never fails a run");
    assert!(stdout.contains("...[output truncated: exceeded "), "cut with the original's marker");
    // The ceiling bounds the memory the kept text takes (decoded UTF-8; the answer escapes
    // it as it streams, 6 bytes for each of these).
    let held = (stdout.len() + answer["stderr"].as_str().unwrap().len()) as u64;
    assert!(held <= ceiling, "runnerd kept {held} bytes of output, over the {ceiling}-byte ceiling");
    assert!(held >= ceiling / 2, "the ceiling is used, not refused: {held} bytes");
    assert!(
        grown <= ceiling + ALLOWANCE,
        "runnerd's peak memory grew by {} MiB under an {} MiB output ceiling",
        grown / MIB,
        ceiling / MIB
    );
}

/// Managed runs keep output in their `result` (at most 4 MiB, counted as JSON) and in
/// their logs (on disk): the flood, its record and its log pages stay within the bound.
#[tokio::test]
async fn a_managed_flood_stays_within_the_bound() {
    if !sandbox_or_skip("a_managed_flood_stays_within_the_bound") {
        return;
    }
    let server = server(None);
    let client = server.client();
    let before = baseline(&server, &client).await;
    let mut body = keyed_shell_request("a", "s", "out/managed", FLOOD);
    let id = body["executionId"].as_str().unwrap().to_owned();
    body["maxOutputBytes"] = 0.into();
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let start = Instant::now();
    let rec = loop {
        let r = client.get(&format!("/shell-executions/{id}?sessionId=s&agentId=a")).await.unwrap();
        let rec = r.json();
        if matches!(rec["state"].as_str(), Some("completed" | "failed" | "cancelled")) {
            break rec;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the managed flood never ended: {}",
            rec["state"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(rec["state"], "completed", "{}", rec["error"]);
    let stdout = rec["result"]["stdout"].as_str().unwrap();
    let held = json_len(stdout);
    // But for the marker's two newlines, which count one byte each as the original's text
    // does and take two in JSON.
    assert!(held <= RESULT_CAP + 2, "a managed result holds at most 4 MiB of output as JSON: {held}");
    assert!(stdout.contains("output truncated"), "the result is cut with the marker");
    // The first log page is served from disk.
    let page =
        client.get(&format!("/shell-executions/{id}/logs?sessionId=s&agentId=a&cursor=0")).await.unwrap();
    assert_eq!(page.json()["chunks"][0]["text"].as_str().unwrap().len(), 4096);
    let grown = hwm(&server).saturating_sub(before);
    assert!(
        grown <= MANAGED_BOUND + ALLOWANCE,
        "runnerd's peak memory grew by {} MiB for a managed result holding {} MiB of output",
        grown / MIB,
        held / MIB
    );
}

/// A ceiling filled by another tenant's output never empties a run's answer: two managed
/// runs of tenant A hold their 4 MiB results (their floods done, the commands asleep) under
/// an 8 MiB ceiling; tenant B's small output comes back whole, its flood cut with the marker.
#[tokio::test]
async fn a_full_ceiling_never_empties_another_runs_output() {
    if !sandbox_or_skip("a_full_ceiling_never_empties_another_runs_output") {
        return;
    }
    let server = server(Some(8 * MIB));
    let client = server.client();
    let mut ids = Vec::new();
    for n in 0..2 {
        let code = "head -c 16777216 /dev/zero | tr '\\0' 'x'; sleep 600";
        let mut body = keyed_shell_request("a", "s", &format!("out/hold{n}"), code);
        body["maxOutputBytes"] = 0.into();
        let reply = client.post_signed("/shell-executions", &body).await.unwrap();
        assert_eq!(reply.status, 202, "{}", reply.json());
        ids.push(body["executionId"].as_str().unwrap().to_owned());
    }
    // Each flood is past its 4 MiB result once its log has more than 1024 rows of 4096
    // characters.
    let start = Instant::now();
    for id in &ids {
        loop {
            let page = client
                .get(&format!("/shell-executions/{id}/logs?sessionId=s&agentId=a&cursor=1024"))
                .await
                .unwrap()
                .json();
            if !page["chunks"].as_array().unwrap().is_empty() {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(300), "the floods never got through");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let small = shell(&client, "out/b", "echo hello").await;
    assert_eq!(small["stdout"], "hello\n");
    let flood = shell(&client, "out/b", "head -c 1048576 /dev/zero | tr '\\0' 'y'; echo LAST").await;
    let stdout = flood["stdout"].as_str().unwrap();
    assert_eq!(flood["exitCode"], 0);
    assert!(
        stdout.contains("...[output truncated: exceeded "),
        "cut with the marker: {} bytes",
        stdout.len()
    );
    assert!(stdout.ends_with("LAST\n"), "the tail is the newest output");
    for id in &ids {
        let reply = client
            .send_bytes(
                "POST",
                &format!("/shell-executions/{id}/cancel?sessionId=s&agentId=a"),
                &[],
                Vec::new(),
            )
            .await
            .unwrap();
        assert_eq!(reply.status, 202);
    }
}

/// Issue #32: what the answer holds is what the budget bounds. 64 MiB of control bytes, and
/// 64 MiB of random bytes, under a 1 MiB `maxOutputBytes`: the HTTP answer's `stdout` +
/// `stderr` (as JSON, the bytes the caller receives and parses) stays within the budget but
/// for the marker's two newlines; random bytes, whose newlines, tabs, quotes and backslashes
/// count one byte as the original's text does, within a few percent of it. Ordinary text is
/// cut at exactly the budget, as the original cuts it.
#[tokio::test]
async fn a_binary_flood_answers_within_the_output_budget() {
    if !sandbox_or_skip("a_binary_flood_answers_within_the_output_budget") {
        return;
    }
    let server = server(None);
    let client = server.client();
    let budget = MIB;
    let floods = [
        ("control bytes", FLOOD.to_owned(), 4),
        ("random bytes", "head -c 67108864 /dev/urandom".to_owned(), budget / 32),
        ("control bytes on both streams", format!("{FLOOD}; {FLOOD} >&2"), 4),
    ];
    for (what, code, slack) in floods {
        let mut body = keyed_shell_request("a", "s", "out/budget", &code);
        body["maxOutputBytes"] = budget.into();
        let reply = client.post_signed("/execute-shell", &body).await.unwrap();
        assert_eq!(reply.status, 200, "{what}");
        let mut answer = reply.json();
        assert_eq!(answer["exitCode"], 0, "{what}: output never fails a run");
        let (out, err) = (answer["stdout"].as_str().unwrap(), answer["stderr"].as_str().unwrap());
        assert!(
            out.contains("...[output truncated: exceeded 1048576 bytes; "),
            "{what}: the original's marker"
        );
        let held = json_len(out) + json_len(err);
        eprintln!("{what}: the answer is {} bytes, {held} of them stdout and stderr", reply.body.len());
        assert!(held <= budget + slack, "{what}: {held} bytes of output answered for a {budget}-byte budget");
        assert!(held >= budget / 2, "{what}: the budget is used: {held}");
        // The whole answer: the output and the result's other fields, nothing more.
        answer["stdout"] = "".into();
        answer["stderr"] = "".into();
        let rest = answer.to_string().len() as u64 + 1;
        assert_eq!(reply.body.len() as u64, held + rest, "{what}");
    }
    // Ordinary text: exactly the budget, newlines counted as the original counts them.
    let mut body = keyed_shell_request("a", "s", "out/budget", "seq 1 1000000");
    body["maxOutputBytes"] = 2000.into();
    let text = client.post_signed("/execute-shell", &body).await.unwrap().json();
    let stdout = text["stdout"].as_str().unwrap();
    assert_eq!(stdout.len(), 2000, "{stdout}");
    assert!(stdout.starts_with("1\n2\n3\n") && stdout.ends_with("999999\n1000000\n"), "{stdout}");
}
