//! Issue #15 "Fail well", the HTTP layer and the command lines: an announced oversized body
//! is refused before it is read, two `Authorization` headers are refused, every wrong-typed
//! field of an execution request answers 400 with the contract's text, bad percent-escapes in
//! remote-workspace queries are refused (never decoded lossily), and the CLIs end quietly
//! when their reader has gone.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, TEST_TOKEN, shell_request};
use runnerctl::client::Reply;
use serde_json::{Value, json};

const BODY_TOO_LARGE: &str = "Request body exceeds the 2000000 byte limit";
const OUTSIDE_ROOTS: &str =
    "Runner workspace must be inside the configured projects or remote-workspaces directory";
const NOT_RELATIVE: &str = "Workspace path must be a non-empty relative POSIX path";

#[track_caller]
fn expect_error(reply: &Reply, status: u16, error: &str, code: &str) {
    let v = reply.json();
    assert_eq!(
        (reply.status, v["error"].as_str(), v["code"].as_str()),
        (status, Some(error), Some(code)),
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
}

/// Sends `head` (a request head with no body after it) on a fresh TCP connection and reads
/// the answer. Before the fix runnerd waited 60 s for the announced body and then answered
/// `body_timeout`; the read gives up after 30 s, so that answer never counts as this one.
fn answer_to_head(server: &Server, head: &str) -> (u16, Value, String) {
    let mut stream = std::net::TcpStream::connect(server.address()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) => {
                assert!(!raw.is_empty(), "no answer before the body was sent: {e}");
                break;
            }
        }
        if let Some(at) = find(&raw, b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&raw[..at]).to_lowercase();
            let length = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            if length.is_some_and(|len| raw.len() >= at + 4 + len) {
                break;
            }
        }
    }
    let at = find(&raw, b"\r\n\r\n").expect("a complete head");
    let head_text = String::from_utf8_lossy(&raw[..at]).into_owned();
    let status = head_text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    let body = serde_json::from_slice(&raw[at + 4..]).unwrap_or(Value::Null);
    (status, body, head_text)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[tokio::test]
async fn an_announced_oversized_body_is_refused_before_any_of_it_is_sent() {
    let server = Server::start();
    for (method, path) in
        [("POST", "/execute-shell"), ("POST", "/shell-executions"), ("POST", "/kernels/teardown")]
    {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: runnerd\r\nAuthorization: Bearer {TEST_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 3000000\r\n\r\n"
        );
        let (status, body, head_text) = answer_to_head(&server, &head);
        assert_eq!(
            (status, body["error"].as_str(), body["code"].as_str()),
            (400, Some(BODY_TOO_LARGE), Some("body_too_large")),
            "{method} {path}: {head_text} {body}"
        );
        assert!(head_text.to_lowercase().contains("connection: close"), "{head_text}");
    }
    // Exactly the limit is still read (and then waited for): only "more than" is refused.
    let ok_head = format!(
        "POST /kernels/teardown HTTP/1.1\r\nHost: runnerd\r\nAuthorization: Bearer {TEST_TOKEN}\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    let (status, body, _) = answer_to_head(&server, &ok_head);
    assert_eq!((status, body["code"].as_str()), (400, Some("session_id_required")), "{body}");
    // The bearer check still comes first.
    let head = "POST /execute-shell HTTP/1.1\r\nHost: runnerd\r\nContent-Length: 3000000\r\n\r\n";
    let (status, body, _) = answer_to_head(&server, head);
    assert_eq!((status, body["error"].as_str()), (401, Some("Unauthorized")), "{body}");
}

#[tokio::test]
async fn two_authorization_headers_are_refused_whichever_comes_first() {
    let server = Server::start();
    let client = server.client();
    let good = format!("Bearer {TEST_TOKEN}");
    let one = client.raw("GET", "/status", &[("authorization", good.clone())], Vec::new()).await.unwrap();
    assert_eq!(one.status, 200, "control: one good header");
    for pair in [
        [good.clone(), "Bearer x".to_owned()],
        ["Bearer x".to_owned(), good.clone()],
        [good.clone(), good.clone()],
    ] {
        let headers = [("authorization", pair[0].clone()), ("authorization", pair[1].clone())];
        let reply = client.raw("GET", "/status", &headers, Vec::new()).await.unwrap();
        expect_error(
            &reply,
            401,
            "Unauthorized: send exactly one Authorization header",
            "duplicate_authorization",
        );
    }
}

fn nothing_ran(ws: &Path) -> bool {
    !ws.join("ran.txt").exists()
}

/// The typed-field table over the three execution routes: each wrong type answers 400 with
/// the field's contract text, and nothing runs (before the fix a number `cwd` ran the code in
/// `/workspace`, and a wrong-typed field of `/shell-executions` was queued and failed later).
#[tokio::test]
async fn wrong_typed_fields_answer_400_with_the_contract_text_on_every_execution_route() {
    if !sandbox_or_skip("wrong_typed_fields_answer_400_with_the_contract_text_on_every_execution_route") {
        return;
    }
    let server = Server::start();
    let ws = server.project_workspace("session");
    let client = server.client();
    let shell_routes = ["/execute-shell", "/shell-executions"];
    let shell_cases: Vec<(&str, Value, &str, &str)> = vec![
        ("cwd", json!(7), "cwd must be workspace-relative", "invalid_cwd"),
        ("cwd", json!(true), "cwd must be workspace-relative", "invalid_cwd"),
        ("cwd", json!(["sub"]), "cwd must be workspace-relative", "invalid_cwd"),
        ("cwd", json!({"path": "sub"}), "cwd must be workspace-relative", "invalid_cwd"),
        ("environmentId", json!(1), "Scientific environments are unavailable", "capability_unavailable"),
        ("code", json!(["touch ran.txt"]), "Shell code is required", "code_required"),
        ("agentId", json!(1), "Agent ID is required", "agent_id_required"),
        ("readOnlyWorkspaceRoot", json!(1), OUTSIDE_ROOTS, "workspace_outside_roots"),
        ("skillPackagesRoot", json!(false), OUTSIDE_ROOTS, "workspace_outside_roots"),
        (
            "maxOutputBytes",
            json!("10"),
            "maxOutputBytes must be a non-negative integer number of bytes",
            "invalid_limit",
        ),
        (
            "maxWorkspaceBytes",
            json!(-5),
            "maxWorkspaceBytes must be a non-negative integer number of bytes",
            "invalid_limit",
        ),
        (
            "sandboxEgressProxy",
            json!("direct"),
            "sandboxEgressProxy.mode must be \"direct\", \"environment\" or \"url\"",
            "invalid_egress_proxy",
        ),
        (
            "npuDevices",
            json!("0"),
            "npuDevices must be an array of non-negative integer device indices",
            "invalid_accelerators",
        ),
    ];
    for path in shell_routes {
        for (field, value, error, code) in &shell_cases {
            let mut body = shell_request("main", "session", &ws, "touch ran.txt");
            body[*field] = value.clone();
            let reply = client.post_signed(path, &body).await.unwrap();
            expect_error(&reply, 400, error, code);
        }
        let mut body = shell_request("main", "session", &ws, "touch ran.txt");
        body["permissionEpoch"]["sessionId"] = json!(42);
        let reply = client.post_signed(path, &body).await.unwrap();
        expect_error(&reply, 400, "permissionEpoch.sessionId must be a string", "invalid_field_type");
    }
    // The synchronous route only: `/shell-executions` forces executionTimeoutMs to 0.
    let mut body = shell_request("main", "session", &ws, "touch ran.txt");
    body["executionTimeoutMs"] = json!("1000");
    let reply = client.post_signed("/execute-shell", &body).await.unwrap();
    expect_error(
        &reply,
        400,
        "Execution timeout must be a non-negative integer number of milliseconds",
        "invalid_limit",
    );
    // The ids differ per route.
    let mut body = shell_request("main", "session", &ws, "touch ran.txt");
    body["executionId"] = json!(12);
    expect_error(
        &client.post_signed("/execute-shell", &body).await.unwrap(),
        400,
        "Execution ID is required",
        "execution_id_required",
    );
    // Another body: the same signed bytes again would be a replay.
    body["code"] = json!("touch ran.txt; true");
    expect_error(
        &client.post_signed("/shell-executions", &body).await.unwrap(),
        400,
        "Invalid Execution ID",
        "invalid_execution_id",
    );
    // `/execute` (Python): its own fields and texts.
    let python: Vec<(&str, Value, &str, &str)> = vec![
        ("code", json!(5), "Python code is required", "code_required"),
        (
            "environmentRevisionId",
            json!(3),
            "Unknown environment revision; select a current environment",
            "unknown_environment_revision",
        ),
        (
            "permissionEpoch",
            json!("epoch"),
            "M1 runner accepts exactly one read-write workspace mount",
            "invalid_mounts",
        ),
        ("runnerWorkspaceKey", json!(["a"]), "Invalid remote workspace key", "invalid_workspace_key"),
    ];
    for (field, value, error, code) in python {
        let mut body = shell_request("main", "session", &ws, "open('ran.txt', 'w').close()");
        body[field] = value;
        expect_error(&client.post_signed("/execute", &body).await.unwrap(), 400, error, code);
    }
    // `/execute` has no `cwd`: it is not read there (as the original).
    let mut body = shell_request("main", "session", &ws, "print(1)");
    body["cwd"] = json!(7);
    let reply = client.post_signed("/execute", &body).await.unwrap();
    assert_ne!(reply.json()["code"], "invalid_cwd", "{}", String::from_utf8_lossy(&reply.body));
    assert!(nothing_ran(&ws), "a refused request ran its code");
    // Nothing was queued on the managed route either.
    let status = client.get("/status").await.unwrap().json();
    assert_eq!(status["activeExecutions"], json!([]), "{status}");
    // A string cwd still works (control).
    std::fs::create_dir(ws.join("sub")).unwrap();
    runner_tests::hand_tree_to_sandbox(&ws);
    let mut body = shell_request("main", "session", &ws, "pwd");
    body["cwd"] = json!("sub");
    let reply = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!((reply.status, reply.json()["stdout"].as_str()), (200, Some("/workspace/sub\n")));
}

#[tokio::test]
async fn bad_percent_escapes_in_remote_workspace_queries_are_refused_not_repaired() {
    let server = Server::start();
    let client = server.client();
    let ws = "workspace=pct/one";
    // Before the fix `%ff` and `%fe` both decoded to U+FFFD: two names, one file.
    for path in ["%ff", "%fe", "%FF%FE", "a%c0%af", "%e0%80%af", "%ed%a0%80", "%zz", "a%2", "a%"] {
        let reply = client
            .send_bytes("PUT", &format!("/remote-workspace/file?{ws}&path={path}"), &[], b"x".to_vec())
            .await
            .unwrap();
        expect_error(&reply, 400, NOT_RELATIVE, "invalid_percent_escape");
        let reply = client.get(&format!("/remote-workspace/file?{ws}&path={path}")).await.unwrap();
        expect_error(&reply, 400, NOT_RELATIVE, "invalid_percent_escape");
    }
    let listing = client.get(&format!("/remote-workspace/files?{ws}")).await.unwrap();
    assert_eq!((listing.status, listing.json()), (200, json!([])), "nothing was written");
    for route in
        ["/remote-workspace/files?workspace=pct%ff", "/remote-workspace/file?workspace=pct/%fe&path=a"]
    {
        expect_error(
            &client.get(route).await.unwrap(),
            400,
            "Invalid remote workspace key",
            "invalid_percent_escape",
        );
    }
    let reply =
        client.send_bytes("DELETE", "/remote-workspace?workspace=pct%2F%zz", &[], Vec::new()).await.unwrap();
    expect_error(&reply, 400, "Invalid remote workspace key", "invalid_percent_escape");
    assert!(!server.path("remote-workspaces").join("pct/\u{fffd}").exists());
    // Valid escapes (what encodeURIComponent sends) still work.
    let reply = client
        .send_bytes("PUT", &format!("/remote-workspace/file?{ws}&path=%E8%AE%AD%20a.txt"), &[], b"x".to_vec())
        .await
        .unwrap();
    assert_eq!((reply.status, reply.json()["path"].as_str()), (201, Some("训 a.txt")));
}

/// A stdout whose reader is closed before the process starts: every write is `EPIPE`,
/// with no race against the reader.
fn closed_stdout() -> Stdio {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: pipe2 succeeded: both descriptors are open and owned by nothing else.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(reader);
    Stdio::from(writer)
}

#[test]
fn the_command_lines_exit_quietly_when_their_reader_has_gone() {
    let server = Server::start();
    let url = format!("http://{}", server.address());
    let runs: Vec<(&str, Vec<&str>)> = vec![
        ("runnerctl", vec!["--url", &url, "health"]),
        ("runnerctl", vec!["--url", &url, "status"]),
        ("runnerctl", vec!["--help"]),
        ("runnerd", vec!["--help"]),
        ("runnerd", vec!["--version"]),
        ("egressd", vec!["--help"]),
        ("npu-brokerd", vec!["--help"]),
    ];
    for (bin, args) in runs {
        let out = Command::new(runner_tests::bin(bin))
            .args(&args)
            .env("SCIENCE_AGENT_RUNNER_TOKEN", TEST_TOKEN)
            .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
            .stdin(Stdio::null())
            .stdout(closed_stdout())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{bin} {args:?}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{bin} {args:?}: {stderr}");
    }
}
