//! The audit trail (issue #6, part 4): the real runnerd and egressd, told to log to journald
//! (`SCIENCE_AGENT_LOG_TARGET=journald`), each under bwrap with a test socket as its
//! `/run/systemd/journal/socket` ([`runner_tests::journal`]); the records are read as
//! journald would read them. And the fallback: the same events, readable, on stderr.

use std::path::PathBuf;
use std::time::Duration;

use runner_tests::egress::{Egressd, FakeDns, Spawn, Upstream};
use runner_tests::journal::{Journal, Record, journal_wrapper};
use runner_tests::server::{Server, ServerOptions, shell_request};
use runner_tests::{sandbox_or_skip, scratch_dir};
use serde_json::json;

/// The runner token of these tests: distinctive, so that finding it anywhere in a log is
/// certainly a leak.
const SECRET: &str = "audit-secret-token-5c1f0e7a9b";
/// The token a client wrongly presents.
const WRONG: &str = "audit-wrong-token-d24b6e";
const WAIT: Duration = Duration::from_secs(20);

fn journald() -> Vec<(String, String)> {
    vec![("SCIENCE_AGENT_LOG_TARGET".into(), "journald".into())]
}

struct World {
    _dns: FakeDns,
    upstream: Upstream,
    egressd: Egressd,
    server: Server,
}

/// egressd started as `egress`, runnerd (using it) with `runner`'s wrapper and variables.
fn world(egress: Spawn, runner_wrapper: Vec<String>, runner_env: Vec<(String, String)>) -> World {
    let dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    let egressd = Egressd::start_with(dns.addr, &[], egress);
    let mut env = egressd.runner_env();
    env.push(("SCIENCE_AGENT_RUNNER_TOKEN".into(), SECRET.into()));
    env.extend(runner_env);
    let server =
        Server::start_with(ServerOptions { env, wrapper: runner_wrapper, ..ServerOptions::default() });
    assert!(
        !server.banner.contains("UNUSABLE"),
        "runnerd cannot run sandboxes here: {}\n{}",
        server.banner,
        server.stderr()
    );
    World { _dns: dns, upstream, egressd, server }
}

/// What the exercise did, to find in the logs.
struct Done {
    execution_id: String,
    workspace: PathBuf,
}

/// One request with a wrong token, then one shell execution through a domain-allowlist
/// gateway that fetches an allowed name and is refused a blocked one.
async fn exercise(w: &World) -> Done {
    let refused = w.server.client_with_token(WRONG).get("/status").await.unwrap();
    assert_eq!(refused.status, 401);

    let workspace = w.server.project_workspace("audit");
    let port = w.upstream.port;
    let code = format!(
        "echo \"allowed=$(curl -sS http://mirror.test:{port}/audited)\"\n\
         echo \"blocked=$(curl -s -o /dev/null -w '%{{http_code}}' http://blocked.test:{port}/)\"\n"
    );
    let mut body = shell_request("audit-agent", "audit-session", &workspace, &code);
    body["permissionEpoch"]["networkPolicy"] = json!("domain-allowlist");
    body["permissionEpoch"]["networkAccess"] = json!({
        "mode": "domain-allowlist",
        "allowedDomains": ["mirror.test"],
        "allowPrivateNetwork": true,
        "revision": "rev-audit",
    });
    let reply = w.server.client_with_token(SECRET).post_signed("/execute-shell", &body).await.unwrap();
    let result = reply.json();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let stdout = result["stdout"].as_str().unwrap_or_default();
    assert!(stdout.contains("allowed=ok /audited") && stdout.contains("blocked=403"), "{result}");
    Done {
        execution_id: body["executionId"].as_str().unwrap().to_owned(),
        workspace: workspace.canonicalize().unwrap(),
    }
}

#[track_caller]
fn field(r: &Record, name: &str) -> String {
    r.get(name).unwrap_or_else(|| panic!("{} has no {name}: {}", r.event(), r.text()))
}

/// Every record of a daemon: its own identifier, field names without a prefix, and never a
/// token, in any field of any payload.
#[track_caller]
fn common_to_all(journal: &Journal, identifier: &str) {
    assert!(journal.errors().is_empty(), "unparsable payloads: {:?}", journal.errors());
    let records = journal.records();
    assert!(!records.is_empty(), "{identifier} sent nothing");
    for r in &records {
        assert_eq!(r.get("SYSLOG_IDENTIFIER").as_deref(), Some(identifier), "{}", r.text());
        assert!(r.fields.iter().all(|(k, _)| !k.starts_with("F_")), "prefixed fields: {}", r.text());
        assert!(r.get("PRIORITY").is_some(), "{}", r.text());
    }
    for payload in journal.payloads() {
        for token in [SECRET, WRONG] {
            assert!(
                !payload.windows(token.len()).any(|w| w == token.as_bytes()),
                "a token was logged: {}",
                String::from_utf8_lossy(&payload)
            );
        }
    }
}

#[tokio::test]
async fn both_daemons_audit_to_journald_under_their_own_identifier_with_plain_field_names() {
    if !sandbox_or_skip("both_daemons_audit_to_journald_under_their_own_identifier_with_plain_field_names") {
        return;
    }
    let egress_journal = Journal::start();
    let runner_journal = Journal::start();
    let mut w = world(
        Spawn { wrapper: egress_journal.wrapper(), env: journald() },
        runner_journal.wrapper(),
        journald(),
    );
    let done = exercise(&w).await;
    let rj = &runner_journal;

    // runnerd: start-up.
    let config = rj.wait_for("config_loaded", |_| true, WAIT);
    assert_eq!(field(&config, "LOG_SINK"), "Journald");
    assert_eq!(field(&config, "TOKEN_SOURCE"), "SCIENCE_AGENT_RUNNER_TOKEN");
    assert_eq!(field(&config, "DATA_DIR"), w.server.data_dir.display().to_string());
    let confinement = rj.wait_for("confinement", |_| true, WAIT);
    assert!(field(&confinement, "LANDLOCK").starts_with("not applied"), "{}", confinement.text());
    for name in ["NO_NEW_PRIVS", "SECCOMP", "PROTECTED_BY"] {
        field(&confinement, name);
    }
    let listening = rj.wait_for("listening", |_| true, WAIT);
    assert!(field(&listening, "ADDRESS").ends_with(&w.server.address()), "{}", listening.text());

    // runnerd: the refused request, with its peer.
    let auth = rj.wait_for("auth_failed", |_| true, WAIT);
    assert_eq!(field(&auth, "REASON"), "wrong token");
    assert_eq!(field(&auth, "PATH"), "/status");
    assert!(field(&auth, "PEER").starts_with("127.0.0.1:"), "{}", auth.text());
    assert_eq!(field(&auth, "PRIORITY"), "4", "a warning");

    // runnerd: the execution, admitted, started and finished, each with who and where.
    let id = done.execution_id.as_str();
    let this = |r: &Record| r.get("EXECUTION_ID").as_deref() == Some(id);
    for event in ["execution_admitted", "execution_started", "execution_finished"] {
        let r = rj.wait_for(event, this, WAIT);
        assert_eq!(field(&r, "SESSION_ID"), "audit-session", "{event}");
        assert_eq!(field(&r, "AGENT_ID"), "audit-agent", "{event}");
        assert_eq!(PathBuf::from(field(&r, "WORKSPACE")), done.workspace, "{event}");
        assert_eq!(
            field(&r, "PROFILE"),
            "network",
            "{event}: domain-allowlist runs under the network profile"
        );
    }
    let finished = rj.wait_for("execution_finished", this, WAIT);
    assert_eq!(field(&finished, "OUTCOME"), "completed");
    assert_eq!(field(&finished, "EXIT_CODE"), "0");
    let duration: u64 = field(&finished, "DURATION_MS").parse().unwrap();
    let run: u64 = field(&finished, "RUN_MS").parse().unwrap();
    assert!(duration >= run, "{}", finished.text());
    let finishes = rj.records().iter().filter(|r| r.event() == "execution_finished" && this(r)).count();
    assert_eq!(finishes, 1, "exactly one execution_finished per execution:\n{}", rj.dump());

    // A run that times out (no network: the baseline profile) ends with its outcome and no
    // exit code.
    let mut body = shell_request("audit-agent", "audit-session", &done.workspace, "sleep 30");
    body["executionTimeoutMs"] = json!(300);
    let reply = w.server.client_with_token(SECRET).post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.json()["code"], "execution_timeout", "{}", String::from_utf8_lossy(&reply.body));
    let slow = body["executionId"].as_str().unwrap();
    let r = rj.wait_for("execution_finished", |r| r.get("EXECUTION_ID").as_deref() == Some(slow), WAIT);
    assert_eq!((field(&r, "OUTCOME"), field(&r, "PROFILE")), ("timed_out".into(), "baseline".into()));
    assert_eq!(r.get("EXIT_CODE"), None, "{}", r.text());
    assert!(field(&r, "RUN_MS").parse::<u64>().unwrap() >= 300, "{}", r.text());

    // egressd: start-up, its confinement, and one decision each way.
    let ej = &egress_journal;
    let config = ej.wait_for("config_loaded", |_| true, WAIT);
    assert_eq!(field(&config, "LOG_SINK"), "Journald");
    assert_eq!(field(&config, "CONTROL_SOCKET"), w.egressd.control_socket.display().to_string());
    assert_eq!(field(&config, "CONFINE"), "true");
    field(&config, "NAMESERVERS");
    let confined = ej.wait_for("confinement_applied", |_| true, WAIT);
    assert_eq!(
        (field(&confined, "SECCOMP"), field(&confined, "NO_NEW_PRIVS")),
        ("true".into(), "true".into())
    );
    field(&confined, "LANDLOCK");
    ej.wait_for("egressd_started", |_| true, WAIT);
    let port = w.upstream.port.to_string();
    for (host, decision) in [("mirror.test", "allowed"), ("blocked.test", "denied")] {
        let r = ej.wait_for("egress_decision", |r| r.get("HOST").as_deref() == Some(host), WAIT);
        assert_eq!(field(&r, "DECISION"), decision, "{}", r.text());
        assert_eq!(field(&r, "PORT"), port);
        assert_eq!(field(&r, "REVISION"), "rev-audit");
    }

    // Both stop cleanly and say so.
    assert!(w.server.stop().success());
    rj.wait_for("stopped", |_| true, WAIT);
    w.egressd.stop();
    ej.wait_for("egressd_stopped", |_| true, WAIT);

    common_to_all(rj, "runnerd");
    common_to_all(ej, "egressd");
}

const CHILD: &str = "RUNNER_TEST_AUDIT_LARGE_EVENT";
const LARGE: usize = 1 << 20;

/// An event larger than a datagram may be goes through a sealed memfd; the test journal
/// reads it like journald. The event is sent by this test binary run again under the
/// journal's wrapper, through the daemons' own sink (`common::audit`).
#[test]
fn a_large_event_reaches_the_journal_through_a_sealed_memfd() {
    if std::env::var_os(CHILD).is_some() {
        assert_eq!(common::audit::init("audit-probe"), common::audit::Sink::Journald);
        tracing::info!(event = "large", detail = %"x".repeat(LARGE), "two\nlines");
        tracing::info!(event = "small_after");
        println!("SENT");
        return;
    }
    if !sandbox_or_skip("a_large_event_reaches_the_journal_through_a_sealed_memfd") {
        return;
    }
    let journal = Journal::start();
    let wrapper = journal.wrapper();
    let out = std::process::Command::new(&wrapper[0])
        .args(&wrapper[1..])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "suite::audit::a_large_event_reaches_the_journal_through_a_sealed_memfd"])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("SCIENCE_AGENT_LOG_TARGET", "journald")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("SENT"), "{text}");

    let large = journal.wait_for("large", |_| true, WAIT);
    assert!(large.via_memfd && large.sealed, "not a sealed memfd: {}", large.text());
    assert_eq!(field(&large, "DETAIL").len(), LARGE);
    assert_eq!(field(&large, "MESSAGE"), "two\nlines", "the binary-safe form");
    assert_eq!(field(&large, "SYSLOG_IDENTIFIER"), "audit-probe");
    let small = journal.wait_for("small_after", |_| true, WAIT);
    assert!(!small.via_memfd);
    assert!(journal.errors().is_empty(), "{:?}", journal.errors());
}

/// Where journald is absent the same events go to stderr, as `key=value` text: runnerd told
/// `stderr`, egressd told `journald` where no journal listens (it falls back and says so).
#[tokio::test]
async fn without_journald_the_same_events_are_readable_on_stderr() {
    if !sandbox_or_skip("without_journald_the_same_events_are_readable_on_stderr") {
        return;
    }
    let no_journal = scratch_dir();
    let mut w = world(
        Spawn { wrapper: journal_wrapper(no_journal.path()), env: journald() },
        Vec::new(),
        vec![("SCIENCE_AGENT_LOG_TARGET".into(), "stderr".into())],
    );
    let done = exercise(&w).await;
    w.server.stop();
    w.egressd.stop();

    let runner = w.server.stderr();
    let line = |log: &str, event: &str, also: &str| -> String {
        log.lines()
            .find(|l| l.contains(&format!("event=\"{event}\"")) && l.contains(also))
            .unwrap_or_else(|| panic!("no {event} line with {also:?} in:\n{log}"))
            .to_owned()
    };
    assert!(line(&runner, "config_loaded", "").contains("log_sink=Stderr"));
    assert!(line(&runner, "confinement", "").contains("landlock=\"not applied"));
    line(&runner, "listening", "address=");
    let auth = line(&runner, "auth_failed", "");
    assert!(
        auth.contains("WARN")
            && auth.contains("reason=\"wrong token\"")
            && auth.contains("peer=\"127.0.0.1:"),
        "{auth}"
    );
    let id = format!("execution_id={}", done.execution_id);
    for event in ["execution_admitted", "execution_started", "execution_finished"] {
        let l = line(&runner, event, &id);
        for needle in ["session_id=audit-session", "agent_id=audit-agent", "profile=network"] {
            assert!(l.contains(needle), "{needle} missing: {l}");
        }
        assert!(l.contains(&format!("workspace={}", done.workspace.display())), "{l}");
    }
    let finished = line(&runner, "execution_finished", &id);
    for needle in ["outcome=\"completed\"", "exit_code=0", "duration_ms=", "run_ms="] {
        assert!(finished.contains(needle), "{needle} missing: {finished}");
    }
    line(&runner, "stopped", "");

    let egress = w.egressd.log();
    assert!(line(&egress, "config_loaded", "").contains("log_sink=Stderr"), "{egress}");
    line(&egress, "confinement_applied", "no_new_privs=true");
    line(&egress, "egressd_started", "");
    assert!(line(&egress, "egress_decision", "host=mirror.test").contains("decision=\"allowed\""));
    assert!(line(&egress, "egress_decision", "host=blocked.test").contains("decision=\"denied\""));
    line(&egress, "egressd_stopped", "");

    for log in [&runner, &egress] {
        assert!(!log.contains(SECRET) && !log.contains(WRONG), "a token was logged:\n{log}");
    }
}

/// Issue #14 hole 10: an id holding a newline wrote a raw `WARN event="auth_failed"` line into
/// the stderr sink. Ids with control characters are refused, on the synchronous and the
/// managed routes, and nothing the caller sent starts a line of the log.
#[tokio::test]
async fn a_newline_in_an_id_forges_no_audit_line() {
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("forge");
    let forged = "x\nWARN event=\"auth_failed\" reason=\"forged-by-a-tenant\"";
    let mut cases = Vec::new();
    let mut by_id = shell_request("main", "s", &ws, "echo hi");
    by_id["executionId"] = json!(forged);
    cases.push(("/execute-shell", by_id));
    cases.push(("/execute-shell", shell_request(forged, "s", &ws, "echo hi")));
    let mut by_session = shell_request("main", "s", &ws, "echo hi");
    by_session["permissionEpoch"]["sessionId"] = json!(forged);
    cases.push(("/execute-shell", by_session));
    let mut managed = shell_request("main", "s", &ws, "echo hi");
    managed["permissionEpoch"]["sessionId"] = json!("s\r\u{1b}[2Kforged");
    cases.push(("/shell-executions", managed));
    for (route, body) in &cases {
        let reply = client.post_signed(route, body).await.unwrap();
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert_eq!(reply.status, 400, "{route}: {text}");
        assert_eq!(reply.json()["code"], "invalid_identifier", "{route}: {text}");
        assert!(reply.json()["error"].as_str().unwrap_or_default().contains("control characters"), "{text}");
    }
    // And a run with honest ids still works.
    let ok = client.post_signed("/execute-shell", &shell_request("main", "s", &ws, "echo hi")).await.unwrap();
    assert_eq!(ok.status, 200);
    let log = server.stderr();
    assert!(!log.contains("forged-by-a-tenant"), "a refused id reached the log:\n{log}");
    assert!(log.lines().all(|l| !l.starts_with("WARN event=")), "{log}");
}

/// What a caller chooses also reaches the log where it is not an id: an uploaded file's name
/// (any byte but NUL and `/`). The stderr sink escapes it, so a newline in it starts no line
/// of its own (the sink, not a per-route refusal, is what holds here).
#[tokio::test]
async fn a_newline_in_an_uploaded_file_name_forges_no_audit_line() {
    let server = Server::start();
    let client = server.client();
    let path = "/remote-workspace/file?workspace=forge/s&path=a%0AWARN%20event%3D%22auth_failed%22%20x%3Dforged-by-a-file";
    let put = client.send_bytes("PUT", path, &[], b"x".to_vec()).await.unwrap();
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.body));
    let log = server.stderr();
    let written = log.lines().find(|l| l.contains("workspace_file_written")).expect("the upload was audited");
    assert!(written.contains("\\nWARN event="), "the newline is written escaped: {written}");
    assert!(log.lines().all(|l| !l.starts_with("WARN event=")), "a forged line:\n{log}");
}
