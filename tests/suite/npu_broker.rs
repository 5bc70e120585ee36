//! npu-brokerd through runnerd's HTTP API (R-NPU-5; contract §2, §4, §5.2, §7 items 3, 17,
//! 18): the real broker daemon over its real socket, running python3 workloads from a
//! whitelist (no Ascend hardware exists here; the spawn path is the one a real workload
//! takes). Checked: whitelist listing, signatures, sessions, template escapes, AF3 refusal,
//! the filtered environment, queued and running cancel (with the SIGKILL escalation and the
//! process group gone), restart → interrupted, a corrupt state file, the broker off, down,
//! or refusing runnerd's uid.
//!
//! Signed bodies are the original's, with nothing unique in them: runnerd's replay cache
//! leaves the NPU routes alone (`api::replay_checked`).

use std::path::Path;
use std::time::{Duration, Instant};

use runner_tests::journal::Journal;
use runner_tests::npu::{Broker, fake_managed_env};
use runner_tests::server::{Server, ServerOptions};
use runner_tests::{processes_matching, sandbox_or_skip};
use runnerctl::client::RunnerClient;
use serde_json::{Value, json};

const SESSION: &str = "session-npu";
const REVISION: &str = "rev-0a1b2c";
/// Liveness guard for waits, not a speed assertion.
const DEADLINE: Duration = Duration::from_secs(60);

const SMOKE: &str = r#"import json, sys
print(json.dumps({"device_target": "Ascend", "ok": True, "result": [4.0, 4.0, 4.0]}, sort_keys=True))
"#;

const ECHO: &str = r#"import json, os, pathlib, sys
ws = pathlib.Path(sys.argv[-1])
(ws / "out").mkdir(exist_ok=True)
(ws / "out" / "result.txt").write_text("done")
(ws / "artifact_manifest.txt").write_text("out/result.txt\n../escape.txt\n")
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}))
"#;

const SLEEP: &str = r#"import signal, subprocess, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
marker = sys.argv[-1]
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)", marker])
print("started", flush=True)
time.sleep(300)
"#;

fn whitelist() -> String {
    let entry = |id: &str, program: &str, args: Value, extra: Value| {
        let mut w = json!({"id": id, "label": id, "description": format!("{id} (test)"), "phase": "project",
                           "command": {"program": program, "args": args}});
        if let (Some(w), Some(extra)) = (w.as_object_mut(), extra.as_object()) {
            w.extend(extra.clone());
        }
        w
    };
    json!({"workloads": [
        entry("project.custom.v1", "${python}", json!(["${repo:jobs/echo.py}", "--config", "${input:configPath}", "${workspaceRoot}"]), json!({})),
        entry("test.sleep", "${python}", json!(["${repo:jobs/sleep.py}", "${env:TEST_MARKER}"]), json!({})),
        entry("test.stubborn", "${python}", json!(["${repo:jobs/sleep.py}", "--ignore-term", "${env:TEST_MARKER}"]), json!({})),
        entry("test.escape", "${python}", json!(["${repo:../outside.py}"]), json!({})),
        entry("antibody.protenix.v1", "${managedPython}", json!(["${repo:jobs/echo.py}", "${input:configPath}", "${workspaceRoot}"]), json!({"rejectAf3Intent": true})),
    ]})
    .to_string()
}

fn repo_files() -> Vec<(&'static str, &'static str)> {
    vec![("jobs/echo.py", ECHO), ("jobs/sleep.py", SLEEP), ("workloads/npu-smoke-test.py", SMOKE)]
}

fn marker() -> String {
    format!(
        "npu-test-marker-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    )
}

fn query(id: &str, session: &str, tail: &str) -> String {
    format!("/npu/jobs/{id}{tail}?session_id={session}")
}

async fn get(client: &RunnerClient, path: &str) -> (u16, Value) {
    let r = client.get(path).await.unwrap();
    (r.status, r.json())
}

async fn submit(client: &RunnerClient, body: Value) -> (u16, Value) {
    let r = client.post_signed("/npu/jobs", &body).await.unwrap();
    (r.status, r.json())
}

fn job_body(workload: &str, ws: &Path, extra: Value) -> Value {
    let mut body = json!({"sessionId": SESSION, "workloadId": workload, "workspaceRoot": ws});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

/// Polls the job until `done` holds; fails with the job and the broker's log otherwise.
async fn wait_job(client: &RunnerClient, id: &str, broker: &Broker, done: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let (status, job) = get(client, &query(id, SESSION, "")).await;
        assert_eq!(status, 200, "{job}");
        if done(&job) {
            return job;
        }
        assert!(start.elapsed() < DEADLINE, "job {id} never got there: {job}\n{}", broker.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn state(job: &Value) -> &str {
    job["state"].as_str().unwrap_or_default()
}

/// runnerd and a broker for it; the third value holds the socket's directory.
fn start_pair(
    whitelist: Option<&str>,
    env: &[(&str, &str)],
    args: &[&str],
) -> (Server, Broker, tempfile::TempDir) {
    // runnerd first (it asks the broker nothing at start), then the broker on its data dir.
    let data = runner_tests::scratch_dir();
    let socket = data.path().join("npu.sock");
    let server = Server::start_with(ServerOptions {
        env: vec![
            ("SCIENCE_AGENT_NPU_BROKER".into(), "1".into()),
            ("SCIENCE_AGENT_NPU_BROKER_SOCKET".into(), socket.display().to_string()),
        ],
        ..Default::default()
    });
    let broker = Broker::start(&server.data_dir, Some(&socket), whitelist, &repo_files(), args, env);
    (server, broker, data)
}

#[tokio::test]
async fn contract_items_3_and_17_default_workloads_signed_submit_sessions_and_cancel() {
    let (server, broker, _sockets) = start_pair(None, &[], &[]);
    fake_managed_env(&server.data_dir, REVISION);
    let client = server.client();

    // Item 3: health lists exactly the original's defaults, and says how the broker is confined.
    let (status, health) = get(&client, "/health").await;
    assert_eq!(status, 200);
    assert_eq!(health["npuBroker"]["enabled"], true);
    assert_eq!(health["npuBroker"]["queueConcurrency"], 1);
    let ids: Vec<&str> = health["npuBroker"]["workloads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["npu.smoke_test", "antibody.protenix.v1"], "{health}");
    assert_eq!(health["npuBroker"]["workloads"][1]["requiredInputs"], json!(["configPath"]));
    assert_eq!(health["npuBrokerd"]["reachable"], true, "{health}");
    assert_eq!(health["npuBrokerd"]["confinement"]["noNewPrivileges"], true);
    assert_eq!(health["npuBrokerd"]["confinement"]["seccomp"], true);
    let (_, workloads) = get(&client, "/npu/workloads").await;
    assert_eq!(workloads, health["npuBroker"]["workloads"]);

    let ws = server.project_workspace("npu");
    // Unsigned submit: 401 with the original's NPU wording.
    let unsigned = client.post_json("/npu/jobs", &job_body("npu.smoke_test", &ws, json!({}))).await.unwrap();
    assert_eq!(
        (unsigned.status, unsigned.json()["error"].clone()),
        (401, json!("Invalid or expired NPU job signature"))
    );
    // No environment revision for a ${managedPython} workload.
    let (status, body) = submit(&client, job_body("npu.smoke_test", &ws, json!({}))).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("environmentRevisionId is required"), "{body}");

    let (status, job) =
        submit(&client, job_body("npu.smoke_test", &ws, json!({"environmentRevisionId": REVISION}))).await;
    assert_eq!(status, 201, "{job}");
    assert_eq!(state(&job), "queued");
    let id = job["id"].as_str().unwrap().to_owned();
    let done = wait_job(&client, &id, &broker, |j| state(j) != "queued" && state(j) != "running").await;
    assert_eq!(state(&done), "succeeded", "{done}\n{}", broker.log());
    assert_eq!(done["exitCode"], 0);
    assert_eq!(done["logs"]["truncated"], false);
    assert!(done["logs"]["stdout"].as_str().unwrap().contains("\"ok\": true"), "{done}");

    // Sessions: required, and a wrong one is refused.
    assert_eq!(get(&client, &format!("/npu/jobs/{id}")).await.0, 400);
    let (status, body) = get(&client, &query(&id, "another", "")).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(
        get(&client, &query("npu-unknown", SESSION, "")).await,
        (404, json!({"error": "NPU job not found", "code": "npu_job_not_found"}))
    );
    let (status, logs) = get(&client, &query(&id, SESSION, "/logs")).await;
    assert_eq!(status, 200);
    assert!(logs["stdout"].as_str().unwrap().contains("Ascend"), "{logs}");
    let (status, result) = get(&client, &query(&id, SESSION, "/result")).await;
    assert_eq!((status, result["job"]["id"].as_str()), (200, Some(id.as_str())));

    // Lists: scoped summaries.
    let (status, list) = get(&client, &format!("/npu/jobs?session_id={SESSION}")).await;
    assert_eq!(status, 200);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!((list[0]["workspaceRoot"].clone(), list[0]["logs"]["stdout"].clone()), (json!(""), json!("")));
    assert_eq!(get(&client, "/npu/jobs?sessionId=another").await, (200, json!([])));
    let (status, body) = get(&client, "/npu/jobs").await;
    assert_eq!((status, body["error"].clone()), (400, json!("session_id is required for NPU job access")));

    // Cancel: unsigned 401, signed 200 (a finished job stays as it is).
    let cancel = format!("/npu/jobs/{id}/cancel");
    let r = client.post_json(&cancel, &cancel_body(SESSION)).await.unwrap();
    assert_eq!(
        (r.status, r.json()["error"].clone()),
        (401, json!("Invalid or expired NPU job cancel signature"))
    );
    let r = client.post_signed(&cancel, &cancel_body(SESSION)).await.unwrap();
    assert_eq!((r.status, state(&r.json()).to_owned()), (200, "succeeded".to_owned()), "{}", r.json());
    let (_, status_body) = get(&client, "/status").await;
    assert_eq!(status_body["npuJobs"], json!([]));

    // Audited: every job's start (with its argv) and end.
    let log = broker.log();
    assert!(
        log.contains("npu_job_started") && log.contains(&id) && log.contains("npu-smoke-test.py"),
        "{log}"
    );
    assert!(log.contains("npu_job_finished"), "{log}");
}

#[tokio::test]
async fn contract_item_18_configured_workloads_escapes_af3_and_a_filtered_environment() {
    let wl = whitelist();
    let env = [
        ("SCIENCE_AGENT_RUNNER_TOKEN", "leak-runner-token"),
        ("ASCEND_ACCESS_KEY", "leak-ascend-key"),
        ("MY_API_KEY", "leak-api-key"),
        ("ASCEND_VISIBLE_HINT", "visible"),
        ("TEST_MARKER", "unused"),
    ];
    let (server, broker, _sockets) = start_pair(Some(&wl), &env, &[]);
    fake_managed_env(&server.data_dir, REVISION);
    let client = server.client();
    let (_, workloads) = get(&client, "/npu/workloads").await;
    assert_eq!(
        workloads[0],
        json!({"id": "project.custom.v1", "label": "project.custom.v1", "description": "project.custom.v1 (test)", "phase": "project", "requiredInputs": ["configPath"]})
    );

    let ws = server.project_workspace("custom");
    std::fs::create_dir_all(ws.join("cfg")).unwrap();
    std::fs::write(ws.join("cfg/run.json"), r#"{"seeds": [1]}"#).unwrap();
    // configPath is required, and must stay in the workspace.
    let (status, body) = submit(&client, job_body("project.custom.v1", &ws, json!({}))).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("configPath is required"), "{body}");
    let (status, body) =
        submit(&client, job_body("project.custom.v1", &ws, json!({"configPath": "../../x.json"}))).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("must resolve inside the workspace"), "{body}");
    let (status, body) = submit(&client, job_body("no.such.workload", &ws, json!({}))).await;
    assert_eq!((status, body["error"].clone()), (400, json!("Unknown NPU workload: no.such.workload")));

    let (status, job) =
        submit(&client, job_body("project.custom.v1", &ws, json!({"configPath": "cfg/run.json"}))).await;
    assert_eq!(status, 201, "{job}");
    let id = job["id"].as_str().unwrap().to_owned();
    let done = wait_job(&client, &id, &broker, |j| state(j) != "queued" && state(j) != "running").await;
    assert_eq!(state(&done), "succeeded", "{done}\n{}", broker.log());
    let out: Value = serde_json::from_str(done["logs"]["stdout"].as_str().unwrap().trim()).unwrap();
    let real_ws = std::fs::canonicalize(&ws).unwrap();
    assert_eq!(out["argv"], json!(["--config", real_ws.join("cfg/run.json"), real_ws]));
    assert_eq!(out["cwd"], json!(real_ws));
    let job_env = out["env"].as_object().unwrap();
    for leaked in ["SCIENCE_AGENT_RUNNER_TOKEN", "ASCEND_ACCESS_KEY", "MY_API_KEY"] {
        assert!(!job_env.contains_key(leaked), "{leaked} reached the job: {job_env:?}");
    }
    assert!(!done["logs"]["stdout"].as_str().unwrap().contains("leak-"), "a secret value reached the job");
    assert_eq!(job_env["ASCEND_VISIBLE_HINT"], "visible");
    assert_eq!(job_env["HOME"], json!(real_ws.join(".npu-home")));
    assert_eq!(job_env["SCIENCE_AGENT_NPU_WORKSPACE"], json!(real_ws));
    assert_eq!(job_env["SCIENCE_AGENT_NPU_BROKER_MODE"], "1");
    assert_eq!(done["createdFiles"], json!(["out/result.txt"]), "the manifest's escape is dropped");

    // AF3 intent is refused before anything runs.
    std::fs::write(ws.join("cfg/af3.json"), r#"{"af3_dir": "/models/af3"}"#).unwrap();
    let (status, body) = submit(
        &client,
        job_body(
            "antibody.protenix.v1",
            &ws,
            json!({"configPath": "cfg/af3.json", "environmentRevisionId": REVISION}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("only exposes antibody.protenix.v1"), "{body}");
    // …while a Protenix configuration runs through ${managedPython}.
    let (status, job) = submit(
        &client,
        job_body(
            "antibody.protenix.v1",
            &ws,
            json!({"configPath": "cfg/run.json", "environmentRevisionId": REVISION}),
        ),
    )
    .await;
    assert_eq!(status, 201, "{job}");
    let done = wait_job(&client, job["id"].as_str().unwrap(), &broker, |j| {
        state(j) == "succeeded" || state(j) == "failed"
    })
    .await;
    assert_eq!(state(&done), "succeeded", "{done}");

    // A ${repo:..} escape: accepted, then the job fails naming the rule, and nothing ran.
    std::fs::write(broker.repo.parent().unwrap().join("outside.py"), "print('escaped')").unwrap();
    let (status, job) = submit(&client, job_body("test.escape", &ws, json!({}))).await;
    assert_eq!(status, 201, "{job}");
    let failed = wait_job(&client, job["id"].as_str().unwrap(), &broker, |j| {
        state(j) == "failed" || state(j) == "succeeded"
    })
    .await;
    assert_eq!(state(&failed), "failed");
    assert!(
        failed["error"].as_str().unwrap().contains("repo: path must resolve inside the repository"),
        "{failed}"
    );
    assert_eq!(failed["logs"]["stdout"], "");
}

#[tokio::test]
async fn queued_and_running_cancel_end_the_whole_process_group() {
    let wl = whitelist();
    let mark = marker();
    let (server, broker, _sockets) = start_pair(Some(&wl), &[("TEST_MARKER", &mark)], &[]);
    let client = server.client();
    let ws = server.project_workspace("cancel");

    let (_, first) = submit(&client, job_body("test.sleep", &ws, json!({}))).await;
    let first_id = first["id"].as_str().unwrap().to_owned();
    wait_job(&client, &first_id, &broker, |j| j["logs"]["stdout"].as_str().unwrap_or("").contains("started"))
        .await;
    // One at a time: the second waits in the queue.
    let (_, second) = submit(&client, job_body("test.stubborn", &ws, json!({}))).await;
    let second_id = second["id"].as_str().unwrap().to_owned();
    let (_, third) = submit(&client, job_body("test.sleep", &ws, json!({}))).await;
    let third_id = third["id"].as_str().unwrap().to_owned();
    let (_, second_now) = get(&client, &query(&second_id, SESSION, "")).await;
    assert_eq!(state(&second_now), "queued");
    let (_, status_body) = get(&client, "/status").await;
    assert_eq!(status_body["npuJobs"].as_array().unwrap().len(), 3, "{status_body}");
    let (status, body) = get(&client, &query(&second_id, SESSION, "/result")).await;
    assert_eq!((status, body["error"].clone()), (409, json!("NPU job is not terminal")));

    // Queued: cancelled at once, and it never starts.
    let r = client.post_signed(&format!("/npu/jobs/{third_id}/cancel"), &cancel_body(SESSION)).await.unwrap();
    assert_eq!((r.status, state(&r.json()).to_owned()), (200, "cancelled".to_owned()));
    // Wrong session on cancel.
    let r =
        client.post_signed(&format!("/npu/jobs/{first_id}/cancel"), &cancel_body("another")).await.unwrap();
    assert_eq!(r.status, 400);
    // Running: SIGTERM to the group; the answer comes once it ended.
    let r = client.post_signed(&format!("/npu/jobs/{first_id}/cancel"), &cancel_body(SESSION)).await.unwrap();
    let cancelled = r.json();
    assert_eq!((r.status, state(&cancelled)), (200, "cancelled"), "{cancelled}");
    // The stubborn one ignores SIGTERM: SIGKILL follows the grace period.
    wait_job(&client, &second_id, &broker, |j| {
        j["logs"]["stdout"].as_str().unwrap_or("").contains("started")
    })
    .await;
    let r =
        client.post_signed(&format!("/npu/jobs/{second_id}/cancel"), &cancel_body(SESSION)).await.unwrap();
    let killed = r.json();
    assert_eq!((r.status, state(&killed)), (200, "cancelled"), "{killed}\n{}", broker.log());
    assert_eq!(killed["signal"], "SIGKILL", "{killed}");
    // Every process the jobs started (the grandchildren ignore SIGTERM too) is gone.
    let start = Instant::now();
    while !processes_matching(&mark).is_empty() {
        assert!(start.elapsed() < DEADLINE, "left behind: {:?}", processes_matching(&mark));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, third_now) = get(&client, &query(&third_id, SESSION, "")).await;
    assert_eq!((state(&third_now), third_now.get("startedAt")), ("cancelled", None));
}

#[tokio::test]
async fn a_restart_interrupts_the_running_job_and_a_corrupt_state_file_is_set_aside() {
    let wl = whitelist();
    let mark = marker();
    let (server, mut broker, _sockets) = start_pair(Some(&wl), &[("TEST_MARKER", &mark)], &[]);
    let client = server.client();
    let ws = server.project_workspace("restart");
    let (_, job) = submit(&client, job_body("test.sleep", &ws, json!({}))).await;
    let id = job["id"].as_str().unwrap().to_owned();
    wait_job(&client, &id, &broker, |j| state(j) == "running").await;
    broker.restart();
    let (_, after) = get(&client, &query(&id, SESSION, "")).await;
    assert_eq!(state(&after), "interrupted", "{after}");
    assert!(after["error"].as_str().unwrap().contains("Runner restarted"), "{after}");
    assert!(processes_matching(&mark).is_empty(), "the stopped broker left its job running");

    let state_file = server.data_dir.join("npu-jobs/jobs.json");
    broker.stop();
    std::fs::write(&state_file, b"{\"version\":1,\"jobs\":[{\"id\":").unwrap();
    broker.restart();
    let (status, health) = get(&client, "/health").await;
    assert_eq!(
        (status, health["status"].clone(), health["npuBrokerd"]["reachable"].clone()),
        (200, json!("ok"), json!(true))
    );
    assert_eq!(get(&client, &format!("/npu/jobs?session_id={SESSION}")).await, (200, json!([])));
    let aside: Vec<_> = std::fs::read_dir(server.data_dir.join("npu-jobs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(aside.iter().any(|n| n.starts_with("jobs.json.corrupt-")), "{aside:?}");
}

#[tokio::test]
async fn broker_off_down_or_refusing_runnerd_answers_clearly() {
    // Off: the original's answers, and the broker is never asked.
    let server = Server::start();
    let client = server.client();
    assert_eq!(get(&client, "/npu/workloads").await, (200, json!([])));
    let ws = server.project_workspace("off");
    let (status, body) = submit(&client, job_body("npu.smoke_test", &ws, json!({}))).await;
    assert_eq!((status, body["error"].clone()), (400, json!("NPU Broker is disabled")));
    assert_eq!(get(&client, &format!("/npu/jobs?session_id={SESSION}")).await, (200, json!([])));
    let (_, health) = get(&client, "/health").await;
    assert_eq!(health["npuBroker"], json!({"enabled": false, "queueConcurrency": 1, "workloads": []}));
    assert_eq!(health["npuBrokerd"]["enabled"], false);

    // Refusing: a broker that serves another uid (SO_PEERCRED).
    let other_uid = (nix_uid() + 1).to_string();
    let (server, mut broker, _sockets) = start_pair(None, &[], &["--runner-uid", &other_uid]);
    let client = server.client();
    let (status, body) = get(&client, "/npu/workloads").await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(message.contains(&format!("npu-brokerd serves only uid {other_uid}")), "{message}");
    let (_, health) = get(&client, "/health").await;
    assert_eq!(
        (health["npuBrokerd"]["reachable"].clone(), health["npuBroker"]["workloads"].clone()),
        (json!(true), json!([]))
    );
    assert!(broker.log().contains("control_peer_refused"), "{}", broker.log());

    // Down: every route says so, health too.
    broker.stop();
    let (status, body) =
        submit(&client, job_body("npu.smoke_test", &server.project_workspace("down"), json!({}))).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"].as_str().unwrap().contains("npu-brokerd is not reachable at"), "{body}");
    let (_, health) = get(&client, "/health").await;
    assert_eq!(
        (health["status"].clone(), health["npuBrokerd"]["reachable"].clone()),
        (json!("ok"), json!(false))
    );
}

#[tokio::test]
async fn every_job_is_audited_to_journald_under_its_own_identifier() {
    // The journal wrapper is a bwrap (no root needed), as in tests/suite/audit.rs.
    if !sandbox_or_skip("every_job_is_audited_to_journald_under_its_own_identifier") {
        return;
    }
    let wl = whitelist();
    let (server, mut broker, _sockets) =
        start_pair(Some(&wl), &[("NPU_SECRET_TOKEN", "leak-npu-token")], &[]);
    let journal = Journal::start();
    broker.rewrap(journal.wrapper(), &[("SCIENCE_AGENT_LOG_TARGET", "journald")]);
    let client = server.client();
    let ws = server.project_workspace("audit");
    std::fs::create_dir_all(ws.join("cfg")).unwrap();
    std::fs::write(ws.join("cfg/run.json"), "{}").unwrap();
    let (status, job) =
        submit(&client, job_body("project.custom.v1", &ws, json!({"configPath": "cfg/run.json"}))).await;
    assert_eq!(status, 201, "{job}");
    let id = job["id"].as_str().unwrap().to_owned();
    let wait = Duration::from_secs(30);
    let this = |r: &runner_tests::journal::Record| r.get("JOB_ID").as_deref() == Some(id.as_str());
    let submitted = journal.wait_for("npu_job_submitted", this, wait);
    assert_eq!(submitted.get("SESSION_ID").as_deref(), Some(SESSION));
    assert_eq!(submitted.get("WORKLOAD_ID").as_deref(), Some("project.custom.v1"));
    let started = journal.wait_for("npu_job_started", this, wait);
    assert!(started.get("ARGS").unwrap_or_default().contains("echo.py"), "{}", started.text());
    let finished = journal.wait_for("npu_job_finished", this, wait);
    assert_eq!(finished.get("STATE").as_deref(), Some("Succeeded"), "{}", finished.text());
    assert_eq!(finished.get("EXIT_CODE").as_deref(), Some("0"));
    for r in journal.records() {
        assert_eq!(r.get("SYSLOG_IDENTIFIER").as_deref(), Some("npu-brokerd"), "{}", r.text());
    }
    let confined = journal.wait_for("confinement_applied", |_| true, wait);
    assert_eq!(confined.get("NO_NEW_PRIVS").as_deref(), Some("true"));
    for payload in journal.payloads() {
        assert!(!String::from_utf8_lossy(&payload).contains("leak-npu-token"), "a secret was logged");
    }
}

fn cancel_body(session: &str) -> Value {
    json!({"sessionId": session})
}

fn nix_uid() -> u32 {
    // SAFETY: getuid(2) cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

/// The broker runs jobs in the workspace without the writer lease, so the lease's fence never
/// sees them: a workspace that moved to another node (issue #34) refuses a job at submit.
#[tokio::test]
async fn a_job_is_refused_in_a_workspace_that_moved_away() {
    let (server, _broker, _sockets) = start_pair(None, &[], &[]);
    let other = Server::start();
    let ws = server.project_workspace("npu-moved");
    let project = ws.strip_prefix(server.data_dir.join("projects")).unwrap().to_str().unwrap().to_owned();
    let client = server.client();
    let to = format!("http://{}", other.address().trim_start_matches("http://"));
    let push = json!({"project": project, "to": to, "requestId": marker()});
    let moved = client.post_signed("/workspace-transfer/push", &push).await.unwrap();
    assert_eq!(moved.status, 200, "{}", moved.json());
    let (status, refused) = submit(&client, job_body("npu.smoke_test", &ws, json!({}))).await;
    assert_eq!(
        (status, refused["code"].clone(), refused["movedTo"].clone()),
        (409, json!("workspace_moved"), json!(to))
    );
}
