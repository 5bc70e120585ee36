//! Issue #37: pre-started sandboxes, through the HTTP API of a real runnerd. After a call,
//! the sandbox for the workspace's next call of the same shape is started and waits; the
//! next call takes it. Nothing carries over between the two calls, the waiting sandbox sees
//! the workspace as it is when its call starts, a call of another shape never takes it, and
//! each discard trigger discards it. Counts come from `/health`'s `prestartedSandboxes`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, keyed_shell_request, shell_request};
use runnerctl::client::RunnerClient;
use serde_json::{Value, json};

fn server(env: &[(&str, &str)]) -> Server {
    Server::start_with(ServerOptions {
        env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        ..ServerOptions::default()
    })
}

async fn pool(client: &RunnerClient) -> Value {
    let health = client.get("/health").await.unwrap().json();
    health["sandboxProfile"]["prestartedSandboxes"].clone()
}

/// Waits until `ready` holds of the pool's state (a liveness bound only: 30 s).
async fn until(client: &RunnerClient, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = pool(client).await;
        if ready(&state) {
            return state;
        }
        assert!(Instant::now() < deadline, "{what}: {state}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The pool once one sandbox waits, set up by bwrap (a call gives one still being set up
/// only a bounded time, which a loaded host may exceed: then the call is not served ahead).
async fn waiting(client: &RunnerClient) -> Value {
    until(client, "a sandbox waits, set up", |p| p["waiting"].as_u64() == Some(1) && p["settled"] == 1).await
}

async fn shell(client: &RunnerClient, workspace: &Path, code: &str) -> Value {
    let reply =
        client.post_signed("/execute-shell", &shell_request("a", "s", workspace, code)).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    reply.json()
}

fn hits(p: &Value) -> u64 {
    p["hits"].as_u64().unwrap()
}

#[tokio::test]
async fn nothing_carries_over_between_two_calls_served_ahead() {
    if !sandbox_or_skip("nothing_carries_over_between_two_calls_served_ahead") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("carry");
    assert_eq!(pool(&client).await["enabled"], json!(true));
    let first = shell(
        &client,
        &ws,
        "echo left > /tmp/left; echo shm > /dev/shm/left; export LEFT=1; \
         (setsid sleep 1000 >/dev/null 2>&1 &); echo $$",
    )
    .await;
    assert_eq!(first["exitCode"], json!(0), "{first}");
    let before = hits(&waiting(&client).await);
    let second = shell(
        &client,
        &ws,
        "ls -A /tmp /dev/shm; echo \"LEFT=${LEFT:-unset}\"; \
         for p in /proc/[0-9]*; do cat $p/comm; done | sort | tr '\\n' ' '",
    )
    .await;
    assert_eq!(second["exitCode"], json!(0), "{second}");
    let out = second["stdout"].as_str().unwrap();
    assert!(!out.contains("left"), "a file of the last call is there: {out}");
    assert!(out.contains("LEFT=unset"), "{out}");
    assert!(!out.contains("sleep"), "the last call's background process is alive: {out}");
    let after = pool(&client).await;
    assert_eq!(hits(&after), before + 1, "the second call was not served ahead: {after}");
}

/// Python (`/execute`) is served ahead like the shell: the interpreter waits for its script,
/// nothing of the last call's interpreter or files is there, and its memory is stated.
#[tokio::test]
async fn python_is_served_ahead_and_nothing_carries_over() {
    if !sandbox_or_skip("python_is_served_ahead_and_nothing_carries_over") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("python");
    let python = |code: &str| {
        let client = &client;
        let body = shell_request("a", "s", &ws, code);
        async move {
            let reply = client.post_signed("/execute", &body).await.unwrap();
            assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
            reply.json()
        }
    };
    let first = python(
        "import os; carried = 1; open('/tmp/left', 'w').write('x'); os.environ['LEFT'] = '1'; print('one')",
    )
    .await;
    assert_eq!(first["stdout"], "one\n", "{first}");
    // Once bwrap has set it up and Python has loaded (bwrap and its init alone hold well
    // under 1 MiB), the waiting interpreter's memory is stated.
    let p = waiting(&client).await;
    let p = until(&client, "a waiting interpreter's memory is stated", |q| {
        q["memoryBytes"].as_u64().unwrap() > 1 << 20 && hits(q) == hits(&p) && q["waiting"] == 1
    })
    .await;
    let second = python(
        "import os, sys; print(os.path.exists('/tmp/left'), os.environ.get('LEFT'), 'carried' in globals(), sys.executable)",
    )
    .await;
    assert_eq!(second["exitCode"], json!(0), "{second}");
    assert_eq!(second["stdout"], "False None False /usr/bin/python3\n", "{second}");
    let q = pool(&client).await;
    assert_eq!(hits(&q), hits(&p) + 1, "the second call was not served ahead: {q}");
    eprintln!("a waiting python sandbox: {} bytes resident", p["memoryBytes"]);
}

#[tokio::test]
async fn a_sandbox_served_ahead_sees_the_workspace_as_it_is_when_its_call_starts() {
    if !sandbox_or_skip("a_sandbox_served_ahead_sees_the_workspace_as_it_is_when_its_call_starts") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("live");
    let first = shell(&client, &ws, "echo one > written-by-the-last-call; echo gone > to-delete").await;
    assert_eq!(first["exitCode"], json!(0), "{first}");
    let before = hits(&waiting(&client).await);
    // Between the calls, from the host: one file written, one deleted.
    std::fs::write(ws.join("written-by-the-host"), "host").unwrap();
    std::fs::remove_file(ws.join("to-delete")).unwrap();
    let second = shell(&client, &ws, "ls; cat written-by-the-host; echo; cat written-by-the-last-call").await;
    let out = second["stdout"].as_str().unwrap();
    assert_eq!(out, "written-by-the-host\nwritten-by-the-last-call\nhost\none\n", "{second}");
    assert_eq!(hits(&pool(&client).await), before + 1);
    // What the call served ahead wrote is the call's own, in its receipt.
    let third = shell(&client, &ws, "echo new > made-now").await;
    assert_eq!(third["createdFiles"], json!(["made-now"]), "{third}");
}

#[tokio::test]
async fn a_call_of_another_shape_never_takes_the_waiting_sandbox() {
    if !sandbox_or_skip("a_call_of_another_shape_never_takes_the_waiting_sandbox") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("shape");
    shell(&client, &ws, "mkdir sub").await;
    let p = waiting(&client).await;
    let (hits0, shape0) = (hits(&p), p["misses"]["shape_changed"].as_u64().unwrap());
    // Another working directory: another shape.
    let in_sub = || {
        let mut body = shell_request("a", "s", &ws, "pwd");
        body["cwd"] = json!("sub");
        body
    };
    let reply = client.post_signed("/execute-shell", &in_sub()).await.unwrap().json();
    assert!(reply["stdout"].as_str().unwrap().ends_with("/sub\n"), "{reply}");
    let p = waiting(&client).await;
    assert_eq!((hits(&p), p["misses"]["shape_changed"].as_u64().unwrap()), (hits0, shape0 + 1), "{p}");
    assert!(p["discards"]["shape_changed"].as_u64().unwrap() >= 1, "{p}");
    // The same cwd again takes the one started for it.
    let reply = client.post_signed("/execute-shell", &in_sub()).await.unwrap().json();
    assert!(reply["stdout"].as_str().is_some_and(|o| o.ends_with("/sub\n")), "{reply}");
    assert_eq!(hits(&pool(&client).await), hits0 + 1);
    // A workspace of another tenant or another key is another workspace: never this one.
    let other = s.project_workspace("shape-other");
    let reply = shell(&client, &other, "pwd; ls").await;
    assert_eq!(reply["exitCode"], json!(0));
    assert_eq!(hits(&pool(&client).await), hits0 + 1, "another workspace's call took a sandbox");
}

#[tokio::test]
async fn a_workspace_swapped_or_moved_is_never_followed() {
    if !sandbox_or_skip("a_workspace_swapped_or_moved_is_never_followed") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("swap");
    shell(&client, &ws, "echo old > marker").await;
    let before = waiting(&client).await;
    // The directory moves away and another takes its name.
    let moved = ws.with_file_name("workspace.moved");
    std::fs::rename(&ws, &moved).unwrap();
    let ws = s.project_workspace("swap");
    let reply = shell(&client, &ws, "ls -A; echo new > marker").await;
    assert_eq!(reply["stdout"], json!(""), "the call saw the moved directory: {reply}");
    assert_eq!(std::fs::read_to_string(moved.join("marker")).unwrap(), "old\n");
    let after = waiting(&client).await;
    assert_eq!(hits(&after), hits(&before), "{after}");
    assert_eq!(
        after["discards"]["shape_changed"].as_u64().unwrap(),
        before["discards"]["shape_changed"].as_u64().unwrap() + 1,
        "{after}"
    );
    // Swapped for a symlink: the call is refused as before, and nothing is run in the
    // directory the waiting sandbox holds.
    let aside = ws.with_file_name("workspace.aside");
    std::fs::rename(&ws, &aside).unwrap();
    std::os::unix::fs::symlink(&moved, &ws).unwrap();
    let reply = client
        .post_signed("/execute-shell", &shell_request("a", "s", &ws, "echo x > followed"))
        .await
        .unwrap();
    assert_ne!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert!(!moved.join("followed").exists() && !aside.join("followed").exists());
    // ... and the sandbox that waited for that path is ended.
    let gone = until(&client, "the swapped workspace's sandbox ended", |p| p["waiting"] == json!(0)).await;
    assert_eq!(hits(&gone), hits(&after));
    assert_eq!(
        gone["discards"]["workspace_changed"].as_u64().unwrap(),
        after["discards"]["workspace_changed"].as_u64().unwrap() + 1,
        "{gone}"
    );
}

#[tokio::test]
async fn each_discard_trigger_discards() {
    if !sandbox_or_skip("each_discard_trigger_discards") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let discarded = |p: &Value, why: &str| p["discards"][why].as_u64().unwrap();
    // Cleared, then repaired: each ends the sandbox waiting for that workspace.
    let key = "discards";
    let run = |code: &'static str| {
        let client = &client;
        async move {
            let reply = client.post_signed("/execute-shell", &keyed_shell_request("a", "s", key, code)).await;
            assert_eq!(reply.unwrap().status, 200);
        }
    };
    run("echo x > f").await;
    let p = waiting(&client).await;
    let n = discarded(&p, "workspace_changed");
    let cleared = client
        .send_bytes("DELETE", &format!("/remote-workspace?workspace={key}"), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(cleared.status, 200, "{}", String::from_utf8_lossy(&cleared.body));
    let p = until(&client, "cleared", |p| p["waiting"] == json!(0)).await;
    assert_eq!(discarded(&p, "workspace_changed"), n + 1, "{p}");
    run("true").await;
    waiting(&client).await;
    let repaired = client.post_signed("/remote-workspace/repair", &json!({"workspace": key})).await.unwrap();
    assert_eq!(repaired.status, 200, "{}", String::from_utf8_lossy(&repaired.body));
    let p = until(&client, "repaired", |p| p["waiting"] == json!(0)).await;
    assert_eq!(discarded(&p, "workspace_changed"), n + 2, "{p}");
    // Another shape (other limits) for the same workspace: the waiting one goes.
    run("true").await;
    let p = waiting(&client).await;
    let mut body = keyed_shell_request("a", "s", key, "true");
    body["executionTimeoutMs"] = json!(12_345);
    body["resourceLimits"] = json!({"pids": 77});
    assert_eq!(client.post_signed("/execute-shell", &body).await.unwrap().status, 200);
    let q = waiting(&client).await;
    assert_eq!(discarded(&q, "shape_changed"), discarded(&p, "shape_changed") + 1, "{q}");
    assert_eq!(hits(&q), hits(&p));
    // A refused environment deletion changed no prefix: nothing waiting is discarded (any
    // caller could otherwise flush every tenant's waiting sandbox).
    for id in ["no-such-environment", "starter-python"] {
        let refused =
            client.send_bytes("DELETE", &format!("/environments/{id}"), &[], Vec::new()).await.unwrap();
        assert_ne!(refused.status, 200, "{}", String::from_utf8_lossy(&refused.body));
    }
    let r = pool(&client).await;
    assert_eq!(
        (r["waiting"].clone(), discarded(&r, "environment_changed")),
        (json!(1), discarded(&q, "environment_changed")),
        "{r}"
    );
}

/// Whether some process's working directory is the directory (`dev`, `ino`).
fn process_in(dev: u64, ino: u64) -> bool {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .any(|e| std::fs::metadata(e.path().join("cwd")).is_ok_and(|m| m.dev() == dev && m.ino() == ino))
}

#[tokio::test]
async fn a_run_served_ahead_times_out_from_its_hand_over_and_ends_when_abandoned() {
    if !sandbox_or_skip("a_run_served_ahead_times_out_from_its_hand_over_and_ends_when_abandoned") {
        return;
    }
    let s = server(&[]);
    let client = std::sync::Arc::new(s.client());
    let ws = s.project_workspace("ends");
    let marker = format!("{}", 400_000 + std::process::id() % 100_000);
    let with_timeout = |code: &str| {
        let mut body = shell_request("a", "s", &ws, code);
        body["executionTimeoutMs"] = json!(1500);
        body
    };
    let r = client.post_signed("/execute-shell", &with_timeout("true")).await.unwrap().json();
    assert_eq!(r["exitCode"], json!(0), "{r}");
    // The sandbox waits longer than the deadline: the deadline runs from the hand-over.
    let p = waiting(&client).await;
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let r =
        client.post_signed("/execute-shell", &with_timeout("sleep 0.5; echo in-time")).await.unwrap().json();
    assert_eq!(r["stdout"], json!("in-time\n"), "{r}");
    let p2 = waiting(&client).await;
    assert_eq!(hits(&p2), hits(&p) + 1, "{p2}");
    let r = client
        .post_signed("/execute-shell", &with_timeout(&format!("sleep 9{marker}")))
        .await
        .unwrap()
        .json();
    assert_eq!(r["error"], json!("Shell execution timed out after 1500 ms"), "{r}");
    assert!(
        runner_tests::processes_matching(&format!("sleep 9{marker}")).is_empty(),
        "the timed out run left its sandbox"
    );
    let p3 = waiting(&client).await;
    assert_eq!(hits(&p3), hits(&p2) + 1, "{p3}");
    // Abandoned: the client goes while the run served ahead runs.
    let c = client.clone();
    let body = with_timeout(&format!("sleep 8{marker}"));
    let call = tokio::spawn(async move { c.post_signed("/execute-shell", &body).await });
    let start = Instant::now();
    while runner_tests::processes_matching(&format!("sleep 8{marker}")).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(15), "the run never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    call.abort();
    let start = Instant::now();
    while !runner_tests::processes_matching(&format!("sleep 8{marker}")).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(15), "the abandoned run left its sandbox");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(hits(&pool(&client).await), hits(&p3) + 1);
}

#[tokio::test]
async fn a_restore_or_a_move_discards_the_waiting_sandbox() {
    if !sandbox_or_skip("a_restore_or_a_move_discards_the_waiting_sandbox") {
        return;
    }
    let (a, b) = (server(&[]), server(&[]));
    let client = a.client();
    let key = "prestart/moves";
    let run = |code: &'static str| {
        let client = &client;
        async move {
            let reply = client.post_signed("/execute-shell", &keyed_shell_request("a", "s", key, code)).await;
            let reply = reply.unwrap();
            assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
            reply.json()
        }
    };
    run("echo one > f").await;
    let v1 = client.get(&format!("/workspace-transfer/where?workspace={key}")).await.unwrap().json();
    let v1 = v1["head"]["digest"].as_str().unwrap().to_owned();
    run("echo two > f").await;
    let p = waiting(&client).await;
    let n = p["discards"]["workspace_changed"].as_u64().unwrap();
    let body = json!({"workspace": key, "version": v1, "requestId": runnerctl::client::new_execution_id()});
    let restored = client.post_signed("/workspace-transfer/restore", &body).await.unwrap();
    assert_eq!(restored.status, 200, "{}", String::from_utf8_lossy(&restored.body));
    let p = until(&client, "restored", |p| p["waiting"] == json!(0)).await;
    assert_eq!(p["discards"]["workspace_changed"].as_u64().unwrap(), n + 1, "{p}");
    assert_eq!(run("cat f").await["stdout"], json!("one\n"));
    waiting(&client).await;
    let to = format!("http://{}", b.address().trim_start_matches("http://"));
    let body = json!({"workspace": key, "to": to, "requestId": runnerctl::client::new_execution_id()});
    let pushed = client.post_signed("/workspace-transfer/push", &body).await.unwrap();
    assert_eq!(pushed.status, 200, "{}", String::from_utf8_lossy(&pushed.body));
    let p = until(&client, "moved", |p| p["waiting"] == json!(0)).await;
    assert_eq!(p["discards"]["workspace_changed"].as_u64().unwrap(), n + 2, "{p}");
}

#[tokio::test]
async fn a_sandbox_not_taken_within_the_idle_limit_is_ended() {
    if !sandbox_or_skip("a_sandbox_not_taken_within_the_idle_limit_is_ended") {
        return;
    }
    let s = server(&[("SCIENCE_AGENT_PRESTART_IDLE_SECS", "1")]);
    let client = s.client();
    let ws = s.project_workspace("idle");
    shell(&client, &ws, "true").await;
    let p = until(&client, "expired", |p| p["discards"]["expired"] == json!(1)).await;
    assert_eq!(p["waiting"], json!(0), "{p}");
    // The next call launches as usual (a miss), and leaves another waiting.
    assert_eq!(shell(&client, &ws, "echo back").await["stdout"], json!("back\n"));
    let p = until(&client, "waits again", |p| p["waiting"] == json!(1)).await;
    assert_eq!(hits(&p), 0, "{p}");
}

#[tokio::test]
async fn the_bounds_evict_the_oldest_of_whoever_holds_the_most() {
    if !sandbox_or_skip("the_bounds_evict_the_oldest_of_whoever_holds_the_most") {
        return;
    }
    let s = server(&[("SCIENCE_AGENT_PRESTART_SANDBOXES", "2"), ("SCIENCE_AGENT_PRESTART_PER_TENANT", "1")]);
    let client = s.client();
    let evicted = |p: &Value| p["discards"]["evicted"].as_u64().unwrap();
    let call = |agent: &'static str, name: &'static str| {
        let (client, ws) = (&client, s.project_workspace(name));
        async move {
            let reply = client.post_signed("/execute-shell", &shell_request(agent, "s", &ws, "true")).await;
            assert_eq!(reply.unwrap().status, 200);
        }
    };
    call("a", "b1").await;
    waiting(&client).await;
    // a at its own bound: its own older sandbox goes.
    call("a", "b2").await;
    until(&client, "a's second", |p| evicted(p) == 1 && p["waiting"] == json!(1)).await;
    call("b", "b3").await;
    until(&client, "b's", |p| p["waiting"] == json!(2)).await;
    // The node full, c holding nothing: the oldest of those holding the most (a's) goes.
    call("c", "b4").await;
    let p = until(&client, "c's", |p| evicted(p) == 2 && p["waiting"] == json!(2)).await;
    assert_eq!(p["started"], json!(4), "{p}");
    // b's workspace still has its sandbox.
    call("b", "b3").await;
    assert_eq!(hits(&pool(&client).await), 1);
}

#[tokio::test]
async fn a_working_directory_swapped_in_between_is_never_run_in() {
    if !sandbox_or_skip("a_working_directory_swapped_in_between_is_never_run_in") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("cwd-swap");
    shell(&client, &ws, "mkdir sub && echo A > sub/marker").await;
    let in_sub = |code: &str| {
        let mut body = shell_request("a", "s", &ws, code);
        body["cwd"] = json!("sub");
        body
    };
    // The call swaps its own working directory for another: the next sandbox starts in
    // the new one (C), while this call's shape names A.
    let r = client
        .post_signed(
            "/execute-shell",
            &in_sub("cat marker; mv ../sub ../sub.a && mkdir ../sub && echo C > ../sub/marker"),
        )
        .await
        .unwrap()
        .json();
    assert_eq!(r["stdout"], json!("A\n"), "{r}");
    let p = waiting(&client).await;
    // Once the waiting sandbox has entered C (bwrap changes into it after its start is
    // filed), A goes back under the name from the host: a call in `sub` must run in A.
    let c = std::fs::metadata(ws.join("sub")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !process_in(c.dev(), c.ino()) {
        assert!(Instant::now() < deadline, "no sandbox entered the new directory");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::rename(ws.join("sub"), ws.join("sub.c")).unwrap();
    std::fs::rename(ws.join("sub.a"), ws.join("sub")).unwrap();
    let r = client.post_signed("/execute-shell", &in_sub("cat marker")).await.unwrap().json();
    assert_eq!(r["stdout"], json!("A\n"), "the call ran in the directory the sandbox started in: {r}");
    let q = pool(&client).await;
    assert_eq!(hits(&q), hits(&p), "{q}");
}

/// runnerd's open descriptors once they settle (discards end off the callers' path), at
/// most `bound`; the count when it did not settle within 20 s.
async fn descriptors_settle(pid: u32, bound: usize) -> usize {
    let count = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = count();
        if n <= bound || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn descriptors_stay_bounded_over_a_hundred_workspaces() {
    if !sandbox_or_skip("descriptors_stay_bounded_over_a_hundred_workspaces") {
        return;
    }
    let s = server(&[("SCIENCE_AGENT_PRESTART_SANDBOXES", "4"), ("SCIENCE_AGENT_JOURNAL_WORKSPACES", "0")]);
    let client = std::sync::Arc::new(s.client());
    let pid = s.pid().unwrap();
    let batch = |from: usize, to: usize| {
        let client = client.clone();
        async move {
            for chunk in (from..to).collect::<Vec<_>>().chunks(4) {
                let mut tasks = tokio::task::JoinSet::new();
                for &i in chunk {
                    let client = client.clone();
                    tasks.spawn(async move {
                        let body =
                            keyed_shell_request(&format!("agent{}", i % 3), "s", &format!("fd/w{i}"), "true");
                        client.post_signed("/execute-shell", &body).await.unwrap().status
                    });
                }
                while let Some(status) = tasks.join_next().await {
                    assert_eq!(status.unwrap(), 200);
                }
            }
        }
    };
    // Past the workspaces whose coordination databases runnerd keeps open (16), so that
    // only what waits can grow.
    batch(0, 24).await;
    until(&client, "the pool is full", |p| p["waiting"] == json!(4)).await;
    // Once in-flight discards and starts are done: the fewest over a second.
    let mut early = usize::MAX;
    for _ in 0..20 {
        early = early.min(std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    batch(24, 124).await;
    let p = until(&client, "the pool is full again", |p| p["waiting"] == json!(4)).await;
    assert!(p["discards"]["evicted"].as_u64().unwrap() >= 90, "{p}");
    let late = descriptors_settle(pid, early + 4).await;
    assert!(late <= early + 4, "descriptors grew from {early} to {late} with 4 sandboxes waiting");
}

#[tokio::test]
async fn a_waiting_sandbox_dies_with_runnerd_even_killed() {
    if !sandbox_or_skip("a_waiting_sandbox_dies_with_runnerd_even_killed") {
        return;
    }
    let s = server(&[]);
    let client = s.client();
    let ws = s.project_workspace("dies");
    shell(&client, &ws, "true").await;
    waiting(&client).await;
    // The waiting interpreter is found by its working directory: the workspace.
    let here = std::fs::metadata(&ws).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !process_in(here.dev(), here.ino()) {
        assert!(Instant::now() < deadline, "no waiting sandbox is in the workspace");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // SAFETY: kill(2) on the pid of the runnerd this test started.
    unsafe { libc::kill(s.pid().unwrap() as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(15);
    while process_in(here.dev(), here.ino()) {
        assert!(Instant::now() < deadline, "a sandbox started ahead outlived a killed runnerd");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn with_prestarting_off_every_call_launches() {
    if !sandbox_or_skip("with_prestarting_off_every_call_launches") {
        return;
    }
    let s = server(&[("SCIENCE_AGENT_PRESTART_SANDBOXES", "0")]);
    let client = s.client();
    let p = pool(&client).await;
    assert_eq!(p["enabled"], json!(false), "{p}");
    let ws = s.project_workspace("off");
    for _ in 0..2 {
        assert_eq!(shell(&client, &ws, "true").await["exitCode"], json!(0));
    }
    let metrics = String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap();
    for line in [
        "runner_prestart_started 0",
        "runner_prestart_hits 0",
        "runner_launch_seconds_count{profile=\"baseline\"} 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing from\n{metrics}");
    }
}
