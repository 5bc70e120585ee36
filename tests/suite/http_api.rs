//! The HTTP API of the real runnerd, driven like the original RunnerClient drives it
//! (contract §7 items 1–3, 5–12, 19–23).

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use runner_tests::server::{Server, ServerOptions, keyed_shell_request, shell_request};
use runner_tests::{processes_matching, sandbox_or_skip};
use serde_json::{Value, json};

fn marker(base: u32) -> String {
    format!("{}", base + std::process::id() % 90_000)
}

#[tokio::test]
async fn health_needs_no_token_and_has_every_original_key() {
    let server = Server::start_with(ServerOptions {
        // rlimits-only: the original's values (no cgroup limits); the cgroup modes are
        // checked in limits.rs.
        env: vec![
            ("SCIENCE_AGENT_EXEC_TIMEOUT_MS".into(), "60000".into()),
            ("SCIENCE_AGENT_CGROUP_MODE".into(), "rlimits-only".into()),
        ],
        ..Default::default()
    });
    let client = server.client_with_token("wrong");
    let reply = client.raw("GET", "/health", &[], Vec::new()).await.unwrap();
    assert_eq!(reply.status, 200);
    assert!(reply.body.ends_with(b"}\n"), "JSON + newline");
    assert_eq!(reply.header("content-type"), Some("application/json; charset=utf-8"));
    assert_eq!(reply.header("cache-control"), Some("no-store"));
    assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));
    let date = reply.header("date").expect("a Date header on every response");
    assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
    let h = reply.json();
    for key in [
        "cgroupDelegated",
        "cgroupMode",
        "cgroupRoot",
        "executionAuth",
        "executionUser",
        "executionTimeoutMs",
        "maxFileBytes",
        "maxOutputBytes",
        "maxWorkspaceBytes",
        "networkPolicy",
        "noNewPrivileges",
        "npuBroker",
        "platform",
        "runnerVersion",
        "sandbox",
        "sandboxNetwork",
        "scientificEnvs",
        "seccompBaseline",
        "status",
        "workerConcurrency",
    ] {
        assert!(h.get(key).is_some(), "missing {key}");
    }
    assert_eq!(h["status"], "ok");
    assert_eq!(h["sandbox"], "bubblewrap");
    assert_eq!(h["platform"], "linux");
    assert_eq!(h["cgroupMode"], "none");
    assert_eq!(h["cgroupDelegated"], false);
    assert_eq!(h["executionAuth"], "bearer+hmac-sha256");
    assert_eq!(h["executionTimeoutMs"], 60000);
    assert_eq!(h["maxFileBytes"], 0);
    assert_eq!(h["maxWorkspaceBytes"], 10_737_418_240u64);
    assert_eq!(h["maxOutputBytes"], 1_073_741_824u64);
    let version = h["runnerVersion"].as_str().unwrap();
    let hash = version.strip_suffix("-dirty").unwrap_or(version);
    assert!(
        version == "unknown" || (hash.len() == 8 && hash.chars().all(|c| c.is_ascii_hexdigit())),
        "{version}"
    );
    // Our additions: honest limits and the preflight's conclusions.
    assert_eq!(h["enforced"]["memory"], "partial");
    assert!(h["reasons"]["memory"].as_str().unwrap().contains("RLIMIT_AS"), "{h}");
    assert_eq!(h["enforced"]["pids"], false);
    assert!(h["sandboxProfile"]["procMode"].is_string());
    // No egressd in this test: network is unavailable, and health says why.
    assert_eq!(h["sandboxNetwork"]["available"], false);
    assert_eq!(h["sandboxNetwork"]["modes"], json!(["none"]));
    assert!(
        h["sandboxNetwork"]["unavailableReason"].as_str().unwrap().contains("egressd is not reachable at"),
        "{h}"
    );
    assert_eq!(h["egressd"]["reachable"], false);
    // Health is GET only: POST goes through auth, then 404.
    let post = server.client().post_json("/health", &json!({})).await.unwrap();
    assert_eq!((post.status, post.json()["error"].as_str()), (404, Some("Not found")));
}

#[tokio::test]
async fn status_and_resources_need_the_token() {
    let server = Server::start();
    let anonymous = server.client_with_token("nope");
    for path in ["/status", "/resources", "/kernels", "/no/such/route"] {
        let r = anonymous.get(path).await.unwrap();
        assert_eq!((r.status, r.json()["error"].as_str()), (401, Some("Unauthorized")), "{path}");
    }
    let client = server.client();
    let status = client.get("/status").await.unwrap().json();
    assert_eq!(status["activeExecutions"], json!([]));
    assert_eq!(status["kernels"], json!([]));
    assert_eq!(status["status"], "ok");
    let resources = client.get("/resources").await.unwrap().json();
    let expected = server.data_dir.canonicalize().unwrap().join("remote-workspaces");
    assert_eq!(resources["workspaceDisk"]["path"], json!(expected));
    assert!(resources["workspaceDisk"]["totalBytes"].as_u64().unwrap() > 0);
    assert!(resources["cpuCores"].as_u64().unwrap() >= 1);
    assert!(resources["memoryTotalBytes"].as_u64().unwrap() > 0);
    let unknown = client.get("/no/such/route").await.unwrap();
    assert_eq!((unknown.status, unknown.json()["error"].as_str()), (404, Some("Not found")));
    assert_eq!(client.get("/kernels").await.unwrap().json(), json!([]));
}

#[tokio::test]
async fn shell_and_python_results_carry_the_original_fields() {
    if !sandbox_or_skip("shell_and_python_results_carry_the_original_fields") {
        return;
    }
    let server = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_CGROUP_MODE".into(), "rlimits-only".into())],
        ..Default::default()
    });
    let client = server.client();
    let ws = server.project_workspace("s1");
    std::fs::write(ws.join("existing.txt"), "old").unwrap();
    runner_tests::hand_tree_to_sandbox(&ws);
    let body = shell_request(
        "main",
        "session-test",
        &ws,
        "echo out; echo err >&2; echo r > result.txt; echo new >> existing.txt; exit 7",
    );
    let reply = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let r = reply.json();
    assert_eq!(r["exitCode"], 7, "a non-zero exit is still 200");
    assert_eq!((r["stdout"].as_str(), r["stderr"].as_str()), (Some("out\n"), Some("err\n")));
    assert_eq!(r["createdFiles"], json!(["result.txt"]));
    assert_eq!(r["modifiedFiles"], json!(["existing.txt"]));
    assert_eq!(r["cgroupMode"], "none");
    assert_eq!(r["kernelMode"], "ephemeral");
    assert_eq!(r["kernelId"], format!("ephemeral:{}", body["executionId"].as_str().unwrap()));
    assert_eq!(r["executionId"], body["executionId"]);
    assert_eq!(r["language"], "shell");
    assert_eq!(r["sandbox"], "bubblewrap");
    assert_eq!(r["networkPolicy"], "none");
    assert_eq!(r["networkAccessRevision"], "none");
    assert_eq!(r["environmentRevisionId"], "system-shell-bwrap-v1");
    assert_eq!(r["workingDirectory"], "/workspace");
    assert_eq!(r["environmentVariables"]["HOME"], "/tmp");
    assert_eq!(r["environmentVariables"]["PATH"], "/usr/bin:/bin");
    for key in ["startedAt", "finishedAt"] {
        let t = r[key].as_str().unwrap();
        assert!(t.len() == 24 && t.ends_with('Z') && t.as_bytes()[10] == b'T', "{key}: {t}");
    }
    assert!(r.get("runnerVersion").is_some());

    let mut py = shell_request("main", "session-test", &ws, "import os\nprint('ok', os.getcwd())");
    py.as_object_mut().unwrap().remove("cwd");
    let reply = client.post_signed("/execute", &py).await.unwrap();
    let r = reply.json();
    assert_eq!(reply.status, 200, "{r}");
    assert_eq!((r["exitCode"].as_i64(), r["stdout"].as_str()), (Some(0), Some("ok /workspace\n")));
    assert_eq!(r["language"], "python");
    assert_eq!(r["environmentVariables"]["PYTHONNOUSERSITE"], "1");
}

#[tokio::test]
async fn nothing_carries_over_between_calls() {
    if !sandbox_or_skip("nothing_carries_over_between_calls") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("s2");
    std::fs::create_dir_all(ws.join("old")).unwrap();
    runner_tests::hand_tree_to_sandbox(&ws);
    let first = client
        .post_signed("/execute-shell", &shell_request("main", "s", &ws, "export FOO=current; cd old"))
        .await
        .unwrap();
    assert_eq!(first.status, 200);
    let second = client
        .post_signed("/execute-shell", &shell_request("main", "s", &ws, "echo \"$(pwd)|${FOO:-unset}\""))
        .await
        .unwrap();
    assert_eq!(second.json()["stdout"], "/workspace|unset\n");
    let py = client
        .post_signed(
            "/execute",
            &shell_request(
                "main",
                "s",
                &ws,
                "import os\nprint(os.getcwd() + '|' + os.environ.get('FOO', 'unset'))",
            ),
        )
        .await
        .unwrap();
    assert_eq!(py.json()["stdout"], "/workspace|unset\n");
}

#[tokio::test]
async fn remote_workspaces_by_key() {
    if !sandbox_or_skip("remote_workspaces_by_key") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let main = keyed_shell_request("main", "s", "project/session", "echo shared > shell.txt");
    let r = client.post_signed("/execute-shell", &main).await.unwrap();
    assert_eq!(
        (r.status, r.json()["exitCode"].as_i64()),
        (200, Some(0)),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(
        std::fs::read_to_string(server.path("remote-workspaces/project/session/shell.txt")).unwrap(),
        "shared\n"
    );
    let mut py =
        keyed_shell_request("main", "s", "project/session", "print(open('shell.txt').read().strip())");
    py["agentId"] = json!("main");
    let r = client.post_signed("/execute", &py).await.unwrap();
    assert_eq!(r.json()["stdout"], "shared\n");
    // A child agent's workspace sits physically inside the main one.
    let child =
        keyed_shell_request("subagent:child", "s", "project/session/agents/child", "pwd; echo child > c.txt");
    let r = client.post_signed("/execute-shell", &child).await.unwrap();
    assert_eq!(r.json()["stdout"], "/workspace\n");
    assert!(server.path("remote-workspaces/project/session/agents/child/c.txt").exists());
    assert!(!server.path("projects").exists(), "projects/ must never be created");
    let teardown =
        client.post_json("/kernels/teardown", &json!({"sessionId": "s", "reason": "done"})).await.unwrap();
    assert_eq!((teardown.status, teardown.json()), (200, json!({"count": 0, "reason": "done"})));
}

#[tokio::test]
async fn a_timeout_answers_400_and_leaves_no_process() {
    if !sandbox_or_skip("a_timeout_answers_400_and_leaves_no_process") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("s3");
    let m = marker(300_000);
    let mut body = shell_request("main", "s", &ws, &format!("sleep 1{m} &\nsleep 2{m}"));
    body["executionTimeoutMs"] = json!(700);
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"], "Shell execution timed out after 700 ms");
    assert!(processes_matching(&format!("sleep 1{m}")).is_empty());
    assert!(processes_matching(&format!("sleep 2{m}")).is_empty());
    let mut py = shell_request("main", "s", &ws, "import time\ntime.sleep(30)");
    py["executionTimeoutMs"] = json!(25);
    let r = client.post_signed("/execute", &py).await.unwrap();
    assert_eq!(r.json()["error"], "Python execution timed out after 25 ms");
}

#[tokio::test]
async fn output_and_workspace_quotas() {
    if !sandbox_or_skip("output_and_workspace_quotas") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("s4");
    let mut flood = shell_request("main", "s", &ws, "seq 1 100000");
    flood["maxOutputBytes"] = json!(2000);
    let r = client.post_signed("/execute-shell", &flood).await.unwrap().json();
    let stdout = r["stdout"].as_str().unwrap();
    assert!(stdout.contains("output truncated"), "{stdout}");
    assert!(stdout.len() + r["stderr"].as_str().unwrap().len() <= 2000);
    assert_eq!(r["exitCode"], 0, "truncation never fails the execution");

    // A 17 MB file is fine under the default quota.
    let big = client
        .post_signed(
            "/execute-shell",
            &shell_request("main", "s", &ws, "head -c 17000000 /dev/zero > big.bin"),
        )
        .await
        .unwrap();
    assert_eq!(big.json()["exitCode"], 0);
    std::fs::remove_file(ws.join("big.bin")).unwrap();

    // Before the run: the workspace already exceeds the quota.
    std::fs::write(ws.join("blob"), vec![0u8; 2000]).unwrap();
    let mut pre = shell_request("main", "s", &ws, "echo never");
    pre["maxWorkspaceBytes"] = json!(1000);
    let r = client.post_signed("/execute-shell", &pre).await.unwrap();
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"].as_str().unwrap().starts_with("Workspace exceeds the 1000 byte execution quota")
    );
    std::fs::remove_file(ws.join("blob")).unwrap();

    // During the run: the poll kills a writer that keeps growing the workspace (in many
    // files, each below RLIMIT_FSIZE, which caps any single file at the quota).
    let m = marker(400_000);
    let mut during = shell_request(
        "main",
        "s",
        &ws,
        &format!(
            "for i in $(seq 1 200); do head -c 100000 /dev/zero > grow-$i.bin; sleep 0.05; done; sleep 4{m}"
        ),
    );
    during["maxWorkspaceBytes"] = json!(1_000_000);
    let r = client.post_signed("/execute-shell", &during).await.unwrap();
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]
            .as_str()
            .unwrap()
            .starts_with("Workspace exceeded the 1000000 byte execution quota"),
        "{}",
        r.json()
    );
    assert!(processes_matching(&format!("sleep 4{m}")).is_empty());

    // One file can never outgrow the quota by more than a byte: RLIMIT_FSIZE (quota + 1)
    // stops the write, and the file it leaves is over the quota, so the run answers the
    // quota error (never a silently truncated file).
    for f in std::fs::read_dir(&ws).unwrap() {
        std::fs::remove_file(f.unwrap().path()).unwrap();
    }
    let mut one = shell_request("main", "s", &ws, "head -c 2000000 /dev/zero > one.bin; echo unreachable");
    one["maxWorkspaceBytes"] = json!(1_000_000);
    let r = client.post_signed("/execute-shell", &one).await.unwrap();
    assert_eq!(r.status, 400, "{}", r.json());
    assert!(r.json()["error"].as_str().unwrap().contains("the 1000000 byte execution quota"), "{}", r.json());
    assert_eq!(std::fs::metadata(ws.join("one.bin")).unwrap().len(), 1_000_001);
}

/// Polls /status until `pred` holds for the active executions (liveness guard only).
async fn wait_for_status(
    client: &runnerctl::client::RunnerClient,
    pred: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    for _ in 0..600 {
        let status = client.get("/status").await.unwrap().json();
        let active = status["activeExecutions"].as_array().cloned().unwrap_or_default();
        if pred(&active) {
            return active;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("status never reached the expected state");
}

#[tokio::test]
async fn status_lists_running_and_queued_calls_and_disconnects_clean_up() {
    if !sandbox_or_skip("status_lists_running_and_queued_calls_and_disconnects_clean_up") {
        return;
    }
    let server = Server::start();
    let client = std::sync::Arc::new(server.client());
    let ws = server.project_workspace("s5");
    let m = marker(500_000);
    let running_body = shell_request("main", "session-test", &ws, &format!("sleep 5{m}"));
    let queued_body = shell_request("main", "session-test", &ws, "echo queued");
    let (c1, b1) = (client.clone(), running_body.clone());
    let running = tokio::spawn(async move { c1.post_signed("/execute-shell", &b1).await });
    let active = wait_for_status(&client, |a| a.iter().any(|e| e["status"] == "running")).await;
    let e = &active[0];
    assert_eq!((e["agentId"].as_str(), e["sessionId"].as_str()), (Some("main"), Some("session-test")));
    assert_eq!(e["executionId"], running_body["executionId"]);
    assert_eq!(e["kernelMode"], "ephemeral");
    assert!(e["startedAt"].is_string() && e["queuedAt"].is_string());
    let (c2, b2) = (client.clone(), queued_body.clone());
    let queued = tokio::spawn(async move { c2.post_signed("/execute-shell", &b2).await });
    wait_for_status(&client, |a| a.len() == 2 && a.iter().any(|e| e["status"] == "queued")).await;

    // The queued client goes away: its entry disappears, the running one stays.
    queued.abort();
    let left = wait_for_status(&client, |a| a.len() == 1).await;
    assert_eq!(left[0]["executionId"], running_body["executionId"]);
    // The running client goes away: the sandbox is killed, the list empties.
    running.abort();
    wait_for_status(&client, |a| a.is_empty()).await;
    for _ in 0..200 {
        if processes_matching(&format!("sleep 5{m}")).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the disconnected client's sandbox is still running");
}

/// Each call records when it started and ended inside the sandbox.
async fn run_pair(server: &Server, same_workspace: bool) -> Vec<(u128, u128)> {
    let client = std::sync::Arc::new(server.client());
    let ws1 = server.project_workspace("pair-a");
    let ws2 = if same_workspace { ws1.clone() } else { server.project_workspace("pair-b") };
    let script = "s=$(date +%s%N); sleep 1.5; e=$(date +%s%N); echo \"$s $e\"";
    let calls: Vec<_> = [("subagent:one", ws1), ("subagent:two", ws2)]
        .into_iter()
        .map(|(agent, ws)| {
            let c = client.clone();
            let body = shell_request(agent, "s", &ws, script);
            tokio::spawn(async move { c.post_signed("/execute-shell", &body).await.unwrap() })
        })
        .collect();
    let mut spans = Vec::new();
    for call in calls {
        let r = call.await.unwrap();
        assert_eq!(r.status, 200);
        let out = r.json()["stdout"].as_str().unwrap().to_owned();
        let mut it = out.split_whitespace().map(|t| t.parse::<u128>().unwrap());
        spans.push((it.next().unwrap(), it.next().unwrap()));
    }
    spans
}

#[tokio::test]
async fn one_workspace_serialises_two_workspaces_run_together() {
    if !sandbox_or_skip("one_workspace_serialises_two_workspaces_run_together") {
        return;
    }
    let server = Server::start();
    let same = run_pair(&server, true).await;
    let overlap = |a: (u128, u128), b: (u128, u128)| a.0 < b.1 && b.0 < a.1;
    assert!(!overlap(same[0], same[1]), "two agents in one workspace ran at the same time: {same:?}");
    let apart = run_pair(&server, false).await;
    assert!(overlap(apart[0], apart[1]), "two workspaces did not run concurrently: {apart:?}");
}

#[tokio::test]
async fn a_full_queue_answers_503_with_retry_after() {
    if !sandbox_or_skip("a_full_queue_answers_503_with_retry_after") {
        return;
    }
    let server = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_QUEUE_CAPACITY".into(), "1".into())],
        ..Default::default()
    });
    let client = std::sync::Arc::new(server.client());
    let ws = server.project_workspace("s6");
    let c = client.clone();
    let body = shell_request("main", "s", &ws, "sleep 2");
    let first = tokio::spawn(async move { c.post_signed("/execute-shell", &body).await.unwrap() });
    wait_for_status(&client, |a| a.len() == 1).await;
    let refused_body = shell_request("other", "s", &ws, "true");
    let r = client.post_signed("/execute-shell", &refused_body).await.unwrap();
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["code"], "queue_full");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(first.await.unwrap().status, 200);
    // The refused call did not use up its id: the retry runs.
    let retry = client.post_signed("/execute-shell", &refused_body).await.unwrap();
    assert_eq!(retry.status, 200, "{}", retry.json());
}

#[tokio::test]
async fn sigterm_aborts_running_executions_and_exits_cleanly() {
    if !sandbox_or_skip("sigterm_aborts_running_executions_and_exits_cleanly") {
        return;
    }
    let mut server = Server::start();
    let client = std::sync::Arc::new(server.client());
    let ws = server.project_workspace("s8");
    let m = marker(200_000);
    let body = shell_request("main", "s", &ws, &format!("sleep 8{m}"));
    let c = client.clone();
    let call = tokio::spawn(async move { c.post_signed("/execute-shell", &body).await });
    wait_for_status(&client, |a| a.iter().any(|e| e["status"] == "running")).await;
    let status = tokio::task::spawn_blocking(move || {
        let status = server.stop();
        (status, server.stderr())
    })
    .await
    .unwrap();
    assert!(status.0.success(), "{:?}\n{}", status.0, status.1);
    // Either the abort answer arrives, or the connection closed with the server.
    if let Ok(reply) = call.await.unwrap() {
        assert_eq!(reply.json()["error"], "Shell execution aborted");
    }
    assert!(processes_matching(&format!("sleep 8{m}")).is_empty(), "a sandbox outlived runnerd's shutdown");
}

/// The one sandbox-init runnerd keeps started ahead of the next launch (issue #18): a child
/// of runnerd still running the sandbox-init image (it has not exec'd bwrap), waiting for a
/// plan. Waits until there is exactly one.
async fn sandbox_init_waiting_ahead(runnerd: u32, not: Option<u32>) -> u32 {
    let init = runner_tests::bin("sandbox-init").canonicalize().unwrap();
    let start = std::time::Instant::now();
    loop {
        let idle: Vec<u32> = runner_tests::children_of(runnerd)
            .into_iter()
            .filter(|c| Some(*c) != not)
            .filter(|c| std::fs::read_link(format!("/proc/{c}/exe")).is_ok_and(|exe| exe == init))
            .collect();
        match idle.as_slice() {
            [one] => return *one,
            [] => assert!(start.elapsed() < IDLE_DEADLINE, "no sandbox-init waits ahead of the next launch"),
            more => panic!("more than one idle sandbox-init: {more:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const IDLE_DEADLINE: Duration = Duration::from_secs(15);

/// The sandbox-init waiting ahead dies with runnerd, on a clean SIGTERM and on kill -9 alike
/// (its death signal is armed before it waits); one killed while idle is replaced, and the
/// launch that finds it dead still runs.
#[tokio::test]
async fn the_sandbox_init_waiting_ahead_is_replaced_and_dies_with_runnerd() {
    if !sandbox_or_skip("the_sandbox_init_waiting_ahead_is_replaced_and_dies_with_runnerd") {
        return;
    }
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        let mut server = Server::start();
        let client = server.client();
        let ws = server.project_workspace("idle-init");
        let request = shell_request("main", "s", &ws, "echo ran");
        let reply = client.post_signed("/execute-shell", &request).await.unwrap();
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        let runnerd = server.pid().expect("runnerd's pid");
        let mut waiting = sandbox_init_waiting_ahead(runnerd, None).await;
        if signal == libc::SIGTERM {
            let pidfd = common::sys::pidfd_open(waiting as i32).expect("the idle sandbox-init is alive");
            // SAFETY: kill(2) on the idle child of the runnerd this test started.
            unsafe { libc::kill(waiting as i32, libc::SIGKILL) };
            assert!(exits_within(&pidfd, IDLE_DEADLINE).await, "a SIGKILLed sandbox-init lived on");
            let again = shell_request("main", "s", &ws, "echo ran");
            let reply = client.post_signed("/execute-shell", &again).await.unwrap();
            assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
            assert_eq!(reply.json()["stdout"], "ran\n", "{}", reply.json());
            waiting = sandbox_init_waiting_ahead(runnerd, Some(waiting)).await;
        }
        // A pidfd: the pid cannot be mistaken for a reused one.
        let pidfd = common::sys::pidfd_open(waiting as i32).expect("the idle sandbox-init is alive");
        // SAFETY: kill(2) on the runnerd this test started.
        unsafe { libc::kill(runnerd as i32, signal) };
        server.child.wait().unwrap();
        assert!(
            exits_within(&pidfd, IDLE_DEADLINE).await,
            "the idle sandbox-init {waiting} outlived runnerd (signal {signal})"
        );
    }
}

/// A run that timed out and one whose caller went away (the stop token's cancel) each still
/// start the next sandbox-init (issue #18; the test above covers a run that ended by itself):
/// the one waiting before the run took its plan, and a fresh one waits after it.
#[tokio::test]
async fn a_timed_out_or_abandoned_run_still_starts_the_next_sandbox_init() {
    if !sandbox_or_skip("a_timed_out_or_abandoned_run_still_starts_the_next_sandbox_init") {
        return;
    }
    // Issue #18's sandbox-init alone: a sandbox started ahead (issue #37) would serve these
    // runs and take the waiting sandbox-init itself (suite::prestart ends such runs too).
    let server = Server::start_with(runner_tests::server::ServerOptions {
        env: vec![("SCIENCE_AGENT_PRESTART_SANDBOXES".into(), "0".into())],
        ..Default::default()
    });
    let client = std::sync::Arc::new(server.client());
    let ws = server.project_workspace("next-init");
    let reply = client.post_signed("/execute-shell", &shell_request("main", "s", &ws, "true")).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let runnerd = server.pid().expect("runnerd's pid");
    let m = marker(700_000);
    let mut waiting = sandbox_init_waiting_ahead(runnerd, None).await;
    for how in ["timed out", "abandoned"] {
        let used = common::sys::pidfd_open(waiting as i32).expect("the idle sandbox-init is alive");
        let mut body = shell_request("main", "s", &ws, &format!("echo started; sleep 4{m}"));
        if how == "timed out" {
            body["executionTimeoutMs"] = json!(500);
            let r = client.post_signed("/execute-shell", &body).await.unwrap();
            assert_eq!(r.json()["error"], "Shell execution timed out after 500 ms", "{}", r.json());
        } else {
            let c = client.clone();
            let call = tokio::spawn(async move { c.post_signed("/execute-shell", &body).await });
            // The sandbox runs (it took the plan) before its caller goes.
            let start = std::time::Instant::now();
            while processes_matching(&format!("sleep 4{m}")).is_empty() {
                assert!(start.elapsed() < IDLE_DEADLINE, "the sandbox never started");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            call.abort();
            wait_for_status(&client, |a| a.is_empty()).await;
        }
        assert!(
            exits_within(&used, IDLE_DEADLINE).await,
            "the {how} run did not end the sandbox-init it took"
        );
        assert!(processes_matching(&format!("sleep 4{m}")).is_empty(), "the {how} run left its sandbox");
        waiting = sandbox_init_waiting_ahead(runnerd, None).await;
    }
}

/// Whether the process behind `pidfd` exits (its pidfd turns readable) within `limit`.
async fn exits_within(pidfd: &std::os::fd::OwnedFd, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        let mut poll = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll reads and writes one pollfd we own, with a zero timeout.
        if common::sys::cvt(unsafe { libc::poll(&mut poll, 1, 0) }).is_ok_and(|ready| ready > 0) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn kernel_routes() {
    let server = Server::start();
    let client = server.client();
    let r = client.post_json("/kernels/teardown", &json!({"sessionId": "  "})).await.unwrap();
    assert_eq!((r.status, r.json()["error"].as_str()), (400, Some("sessionId is required")));
    let r = client.post_json("/kernels/teardown", &json!({"sessionId": "s"})).await.unwrap();
    assert_eq!(r.json(), json!({"count": 0, "reason": "Persistent kernel memory was cleared"}));
    let empty = client
        .raw(
            "POST",
            "/kernels/k1/teardown",
            &[("authorization", "Bearer runner-test-token".into())],
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(empty.status, 400, "the body must be JSON");
    let r = client.post_json("/kernels/k%201/teardown", &json!({"reason": "bye"})).await.unwrap();
    assert_eq!(r.json(), json!({"count": 0, "kernelId": "k 1", "reason": "bye"}));
}

#[tokio::test]
async fn unix_socket_mode() {
    let mut server = Server::start_with(ServerOptions { unix_socket: true, ..Default::default() });
    let runnerctl::client::Endpoint::Unix(path) = server.endpoint.clone() else {
        panic!("expected a unix endpoint")
    };
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let parent_mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777;
    assert_eq!(parent_mode, 0o700);
    let h = server.client().get("/health").await.unwrap().json();
    assert_eq!((h["status"].as_str(), h["platform"].as_str()), (Some("ok"), Some("linux")));
    let status = server.stop();
    assert!(status.success(), "graceful SIGTERM: {status:?}");
    assert!(!path.exists(), "the socket is removed on exit");
}

#[tokio::test]
async fn start_up_failures_and_warnings() {
    // A missing bwrap stops the start with the original's ENOENT text.
    let out = std::process::Command::new(runner_tests::bin("runnerd"))
        .env("SCIENCE_AGENT_BWRAP_PATH", "/nonexistent/bwrap")
        .env("SCIENCE_AGENT_RUNNER_TOKEN", "t")
        .env("SCIENCE_AGENT_DATA_DIR", runner_tests::scratch_dir().path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ENOENT"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // No token configured: a clear refusal that names the ways out.
    let dir = runner_tests::scratch_dir();
    let out = std::process::Command::new(runner_tests::bin("runnerd"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        .env("SCIENCE_AGENT_DATA_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no runner token is configured") && err.contains("--dev"), "{err}");

    // A bad variable is a start-up error naming it.
    let out = std::process::Command::new(runner_tests::bin("runnerd"))
        .env("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "-1")
        .env("SCIENCE_AGENT_RUNNER_TOKEN", "t")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("SCIENCE_AGENT_MAX_WORKSPACE_BYTES must be a non-negative integer")
    );

    // A bwrap that has the options but cannot build a sandbox: the runner starts, warns,
    // and executions refuse clearly.
    let stub_dir = runner_tests::scratch_dir();
    let stub = stub_dir.path().join("bwrap");
    std::fs::write(
        &stub,
        "#!/bin/sh\nif [ \"$1\" = --help ]; then echo '--cap-drop --die-with-parent --new-session --seccomp --unshare-all --unshare-user'; exit 0; fi\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let server = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_BWRAP_PATH".into(), stub.to_string_lossy().into_owned())],
        ..Default::default()
    });
    let stderr = server.stderr();
    assert!(
        stderr.contains("could not build a sandbox") && stderr.contains("run_python and run_shell will fail"),
        "{stderr}"
    );
    assert!(server.banner.contains("UNUSABLE"));
    let h = server.client().get("/health").await.unwrap().json();
    assert_eq!(h["sandboxProfile"]["sandboxUsable"], false);
    let ws = server.project_workspace("s7");
    let r = server
        .client()
        .post_signed("/execute-shell", &shell_request("main", "s", &ws, "true"))
        .await
        .unwrap();
    assert_eq!((r.status, r.json()["code"].as_str()), (400, Some("sandbox_unavailable")));
}

#[tokio::test]
async fn development_start_generates_a_private_token() {
    let dir = runner_tests::scratch_dir();
    let data = dir.path().join("data");
    let server = Server::start_with(ServerOptions {
        no_token: true,
        args: vec!["--dev".into()],
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), data.to_string_lossy().into_owned())],
        ..Default::default()
    });
    let token_path = data.join("runner-token");
    let token = std::fs::read_to_string(&token_path).unwrap().trim().to_owned();
    assert_eq!(token.len(), 64);
    assert_eq!(std::fs::metadata(&token_path).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(server.stderr().contains(&token_path.display().to_string()), "says where the token is");
    assert!(!server.stderr().contains(&token), "never prints the token");
    assert_eq!(server.client_with_token(&token).get("/status").await.unwrap().status, 200);
    assert_eq!(
        server.client_with_token("sciencediscovery-runner-local").get("/status").await.unwrap().status,
        401
    );
}

#[tokio::test]
async fn runnerctl_runs_a_script_and_exits_with_its_code() {
    if !sandbox_or_skip("runnerctl_runs_a_script_and_exits_with_its_code") {
        return;
    }
    let server = Server::start();
    let run = |args: &[&str]| {
        std::process::Command::new(runner_tests::bin("runnerctl"))
            .args(["--url", &format!("http://{}", server.address())])
            .args(args)
            .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
            .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
            .output()
            .unwrap()
    };
    let out = run(&["exec", "--workspace", "ctl/one", "--", "echo hello; echo oops >&2; exit 3"]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    let out = run(&["exec", "--python", "--workspace", "ctl/one", "--", "print(6 * 7)"]);
    assert_eq!((out.status.code(), String::from_utf8_lossy(&out.stdout).as_ref()), (Some(0), "42\n"));
    let out = run(&["health"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"status\": \"ok\""));
    // A refused request is an error exit with runnerd's text.
    let out = run(&["exec", "--workspace", "../escape", "--", "true"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Invalid remote workspace key"));
}

/// A sandbox of the parent workspace swaps a queued child workspace for a symlink to a host
/// directory while the child's next call waits for its lock. The queued call must not run
/// in (or write to) the symlink's target.
#[tokio::test]
async fn a_workspace_swapped_for_a_symlink_while_queued_is_refused() {
    if !sandbox_or_skip("a_workspace_swapped_for_a_symlink_while_queued_is_refused") {
        return;
    }
    let server = Server::start();
    let client = std::sync::Arc::new(server.client());
    let outside = runner_tests::scratch_dir();
    let outside_path = outside.path().to_owned();
    std::fs::set_permissions(&outside_path, std::fs::Permissions::from_mode(0o777)).unwrap();
    let child_key = "t/s/agents/c";
    let (c, hold) = (client.clone(), keyed_shell_request("subagent:c", "s", child_key, "sleep 2"));
    let holder = tokio::spawn(async move { c.post_signed("/execute-shell", &hold).await.unwrap() });
    wait_for_status(&client, |a| a.iter().any(|e| e["status"] == "running")).await;
    let (c, victim) =
        (client.clone(), keyed_shell_request("subagent:c", "s", child_key, "echo pwned > escaped.txt"));
    let queued = tokio::spawn(async move { c.post_signed("/execute-shell", &victim).await.unwrap() });
    wait_for_status(&client, |a| a.iter().any(|e| e["status"] == "queued")).await;
    let swap =
        format!("mv agents/c agents/c.old && ln -s {} agents/c && echo swapped", outside_path.display());
    let r =
        client.post_signed("/execute-shell", &keyed_shell_request("main", "s", "t/s", &swap)).await.unwrap();
    assert_eq!(r.json()["stdout"], "swapped\n", "{}", r.json());
    assert_eq!(holder.await.unwrap().status, 200);
    let refused = queued.await.unwrap();
    assert_eq!(refused.status, 400, "{}", refused.json());
    assert_eq!(refused.json()["code"], "workspace_symlink");
    assert!(
        !outside_path.join("escaped.txt").exists(),
        "the sandbox escaped into {}",
        outside_path.display()
    );
}

/// systemd's socket activation and `Type=notify`, emulated by systemd's own
/// `systemd-socket-activate`: runnerd serves the listener it was passed (not the configured
/// port) and reports READY=1 once it listens.
#[tokio::test]
async fn socket_activation_and_readiness_notification() {
    let Some(activate) = ["/usr/bin/systemd-socket-activate", "/bin/systemd-socket-activate"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
    else {
        assert!(!runner_tests::in_ci(), "systemd-socket-activate is missing (package systemd)");
        eprintln!(
            "SKIPPED socket_activation_and_readiness_notification: systemd-socket-activate is not installed"
        );
        return;
    };
    let dir = runner_tests::scratch_dir();
    let notify_path = dir.path().join("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let data = dir.path().join("data");
    let mut child = std::process::Command::new(activate)
        .arg(format!("--listen=127.0.0.1:{port}"))
        .args(["-E", &format!("NOTIFY_SOCKET={}", notify_path.display())])
        .args(["-E", &format!("SCIENCE_AGENT_DATA_DIR={}", data.display())])
        .args(["-E", "SCIENCE_AGENT_RUNNER_TOKEN=activation-test-token"])
        .args(["-E", "SCIENCE_AGENT_RUNNER_PORT=1"]) // would fail to bind: the passed socket must win
        .args(["-E", &format!("SCIENCE_AGENT_EGRESS_SOCKET={}", dir.path().join("none.sock").display())])
        .args(["-E", "SCIENCE_AGENT_LOG_TARGET=stderr"])
        .args([
            "-E",
            &format!("{}={}", runner_tests::sandbox_user_env().0, runner_tests::sandbox_user_env().1),
        ])
        .arg(runner_tests::bin("runnerd"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The first connection starts runnerd, which then answers it on the passed socket.
    let client = runnerctl::client::RunnerClient::new(
        runnerctl::client::Endpoint::Tcp(format!("127.0.0.1:{port}")),
        "activation-test-token",
    );
    let mut health = None;
    for _ in 0..100 {
        if let Ok(r) = client.get("/health").await {
            health = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health = health.expect("runnerd answered on the activated socket");
    assert_eq!((health.status, health.json()["status"].as_str()), (200, Some("ok")));
    let mut buf = [0u8; 256];
    let n = notify.recv(&mut buf).expect("a readiness notification");
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        text.starts_with("READY=1\n")
            && text.contains(&format!("STATUS=listening on http://127.0.0.1:{port}")),
        "{text}"
    );
    let _ = child.kill();
    let _ = child.wait();
    // systemd-socket-activate exec()s runnerd in place: killing it killed runnerd.
}
