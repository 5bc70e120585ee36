//! Hostile and malformed input against the real runnerd: every validation rule with its exact error.
//!
//! Each test starts its own runnerd (own data directory, own replay and executionId maps) and
//! asserts the status, the original's `error` text and our stable `code` (contract §1, §2A, §7;
//! spec/api.md improvements 1 and 2).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, TEST_TOKEN, keyed_shell_request, shell_request};
use runnerctl::client::{Reply, new_execution_id};
use runnerd::auth::sign;
use serde_json::{Value, json};

const SIGNATURE_ERROR: &str = "Invalid or expired execution signature";
const PERSISTENT_ERROR: &str = "Runner executions must be ephemeral; persistent runtimes are no longer supported. Use managed Shell Execution for background tasks";
const OUTSIDE_ROOTS: &str =
    "Runner workspace must be inside the configured projects or remote-workspaces directory";
const INVALID_KEY: &str = "Invalid remote workspace key";
const SYMLINKED_KEY: &str = "Remote workspace path must not contain symbolic links";
const TIMEOUT_ERROR: &str = "Execution timeout must be a non-negative integer number of milliseconds";
const BODY_TOO_LARGE: &str = "Request body exceeds the 2000000 byte limit";
const SHELL: &str = "/execute-shell";
const PYTHON: &str = "/execute";

/// A runnerd with one project workspace (`<data>/projects/project/sessions/session/workspace`).
fn server_with_workspace() -> (Server, PathBuf) {
    let server = Server::start();
    let ws = server.project_workspace("session");
    (server, ws)
}

fn now_ms() -> u64 {
    runnerd::timefmt::now_ms()
}

fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

fn bytes(body: &Value) -> Vec<u8> {
    body.to_string().into_bytes()
}

/// Asserts an error answer: status, exact `error`, exact `code`, and the trailing newline.
#[track_caller]
fn expect_error(reply: &Reply, status: u16, error: &str, code: &str) {
    let text = String::from_utf8_lossy(&reply.body);
    assert!(text.ends_with('\n'), "the body does not end with a newline: {text:?}");
    let v = reply.json();
    assert_eq!(
        (reply.status, v["error"].as_str(), v["code"].as_str()),
        (status, Some(error), Some(code)),
        "body: {text}"
    );
}

/// The `error` text of a 400 with `code`, for the errors whose text ends in a path.
#[track_caller]
fn error_400(reply: &Reply, code: &str) -> String {
    let v = reply.json();
    assert_eq!(
        (reply.status, v["code"].as_str()),
        (400, Some(code)),
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
    v["error"].as_str().expect("a string error").to_owned()
}

/// Asserts a 200 with `exitCode` 0.
#[track_caller]
fn expect_ok(reply: &Reply) -> Value {
    let v = reply.json();
    assert_eq!(
        (reply.status, v["exitCode"].as_i64()),
        (200, Some(0)),
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
    v
}

async fn post(server: &Server, path: &str, body: &Value) -> Reply {
    server.client().post_signed(path, body).await.expect("runnerd answers")
}

/// Posts exactly `body` with a Bearer token and the given signature headers.
async fn post_with(
    server: &Server,
    path: &str,
    token: &str,
    signature: Option<(String, String)>,
    body: Vec<u8>,
) -> Reply {
    let mut headers = vec![bearer(token), ("content-type", "application/json".to_owned())];
    if let Some((ts, sig)) = signature {
        headers.push(("x-science-execution-timestamp", ts));
        headers.push(("x-science-execution-signature", sig));
    }
    server.client().raw("POST", path, &headers, body).await.expect("runnerd answers")
}

/// Posts `body` signed with the test token at the timestamp `ts` (as written).
async fn post_at(server: &Server, path: &str, ts: &str, body: &Value) -> Reply {
    let raw = bytes(body);
    let sig = sign(TEST_TOKEN, ts, &raw);
    post_with(server, path, TEST_TOKEN, Some((ts.to_owned(), sig)), raw).await
}

/// A shell request whose code would leave `ran.txt` in the workspace.
fn touching_request(ws: &Path) -> Value {
    shell_request("main", "session", ws, "touch ran.txt")
}

/// The same for `path`: Python code on `/execute`.
fn touching_request_on(path: &str, ws: &Path) -> Value {
    let code = if path == PYTHON { "open('ran.txt', 'w').close()" } else { "touch ran.txt" };
    shell_request("main", "session", ws, code)
}

#[track_caller]
fn assert_nothing_ran(ws: &Path) {
    assert!(!ws.join("ran.txt").exists(), "the code ran although the request was refused");
}

/// A request body padded (with an extra `padding` field) to exactly `size` bytes.
fn padded_to(mut body: Value, size: usize) -> Vec<u8> {
    body["padding"] = json!("");
    let base = bytes(&body).len();
    body["padding"] = json!("p".repeat(size - base));
    let raw = bytes(&body);
    assert_eq!(raw.len(), size);
    raw
}

// ---------------------------------------------------------------------------------------
// 1. Bearer auth (contract §1.3)

#[tokio::test]
async fn a_missing_token_is_unauthorized_everywhere_but_get_health_even_on_unknown_paths() {
    let server = Server::start();
    let client = server.client();
    for (method, path, body) in [
        ("GET", "/status", Vec::new()),
        ("GET", "/no-such-route", Vec::new()),
        ("DELETE", "/status", Vec::new()),
        ("POST", "/health", b"{}".to_vec()),
        ("POST", "/execute", b"{}".to_vec()),
        ("POST", "/execute-shell", b"{}".to_vec()),
    ] {
        let reply = client.raw(method, path, &[], body).await.unwrap();
        expect_error(&reply, 401, "Unauthorized", "unauthorized");
    }
}

/// GET /status with `authorization: <value>` (sent byte for byte).
async fn status_with(server: &Server, value: &str) -> Reply {
    server.client().raw("GET", "/status", &[("authorization", value.to_owned())], Vec::new()).await.unwrap()
}

#[track_caller]
fn expect_unauthorized(reply: &Reply, value: &str) {
    assert_eq!(reply.status, 401, "{value:?} was accepted");
    expect_error(reply, 401, "Unauthorized", "unauthorized");
}

#[tokio::test]
async fn a_wrong_token_is_unauthorized() {
    let server = Server::start();
    for value in [
        "Bearer wrong-token".to_owned(),
        format!("Bearer {}", &TEST_TOKEN[..TEST_TOKEN.len() - 1]),
        format!("Bearer {}", TEST_TOKEN.to_uppercase()),
        format!("Bearer x{TEST_TOKEN}"),
        "Bearer ".to_owned(),
        String::new(),
        format!("Basic {TEST_TOKEN}"),
        TEST_TOKEN.to_owned(),
    ] {
        expect_unauthorized(&status_with(&server, &value).await, &value);
    }
    // The exact form is accepted: the refusals above were about the header alone.
    let reply = status_with(&server, &format!("Bearer {TEST_TOKEN}")).await;
    assert_eq!((reply.status, reply.json()["status"].as_str()), (200, Some("ok")));
}

#[tokio::test]
async fn the_bearer_prefix_is_case_sensitive_with_exactly_one_space() {
    let server = Server::start();
    for value in [
        format!("bearer {TEST_TOKEN}"),
        format!("BEARER {TEST_TOKEN}"),
        format!("Bearer  {TEST_TOKEN}"),
        format!("Bearer\t{TEST_TOKEN}"),
        format!("Bearer{TEST_TOKEN}"),
        format!("Bearer: {TEST_TOKEN}"),
    ] {
        expect_unauthorized(&status_with(&server, &value).await, &value);
    }
}

#[tokio::test]
async fn a_token_with_trailing_characters_is_unauthorized() {
    let server = Server::start();
    for value in [
        format!("Bearer {TEST_TOKEN} x"),
        format!("Bearer {TEST_TOKEN}x"),
        format!("Bearer {TEST_TOKEN}\u{a0}"),
        format!("Bearer {TEST_TOKEN} {TEST_TOKEN}"),
        format!("Bearer {TEST_TOKEN},Bearer {TEST_TOKEN}"),
    ] {
        expect_unauthorized(&status_with(&server, &value).await, &value);
    }
    // Trailing spaces and tabs on the wire are optional whitespace around the field value
    // (RFC 9110 §5.5): HTTP/1.1 parsers, Node's llhttp as well as hyper's, strip them before
    // any handler sees the header, so the original cannot tell them apart either.
    for value in [format!("Bearer {TEST_TOKEN} "), format!("Bearer {TEST_TOKEN}\t")] {
        assert_eq!(status_with(&server, &value).await.status, 200, "{value:?}");
    }
}

#[tokio::test]
async fn get_health_needs_no_token_but_post_health_is_not_a_route() {
    let server = Server::start();
    let client = server.client();
    let reply = client.raw("GET", "/health", &[], Vec::new()).await.unwrap();
    assert_eq!((reply.status, reply.json()["status"].as_str()), (200, Some("ok")));
    // With a wrong token too: health is answered before auth.
    let reply = client.raw("GET", "/health", &[bearer("wrong")], Vec::new()).await.unwrap();
    assert_eq!(reply.status, 200);
    let reply = client.raw("POST", "/health", &[bearer(TEST_TOKEN)], b"{}".to_vec()).await.unwrap();
    expect_error(&reply, 404, "Not found", "not_found");
}

#[tokio::test]
async fn an_unknown_route_with_a_token_is_not_found() {
    let server = Server::start();
    let client = server.client();
    for (method, path) in [
        ("GET", "/no-such-route"),
        ("GET", "/status/"),
        ("GET", "/STATUS"),
        ("DELETE", "/status"),
        ("GET", "/execute"),
        ("GET", "/execute-shell"),
        ("PUT", "/kernels"),
    ] {
        let reply = client.raw(method, path, &[bearer(TEST_TOKEN)], Vec::new()).await.unwrap();
        expect_error(&reply, 404, "Not found", "not_found");
    }
}

// ---------------------------------------------------------------------------------------
// 2. Execution signatures (contract §1.4; replay refusal: api.md improvement 2)

#[tokio::test]
async fn missing_signature_headers_are_refused() {
    if !sandbox_or_skip("missing_signature_headers_are_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let raw = bytes(&touching_request(&ws));
    let ts = now_ms().to_string();
    let sig = sign(TEST_TOKEN, &ts, &raw);
    let client = server.client();
    let base = [bearer(TEST_TOKEN), ("content-type", "application/json".to_owned())];
    let variants: [Vec<(&str, String)>; 4] = [
        vec![],
        vec![("x-science-execution-timestamp", ts.clone())],
        vec![("x-science-execution-signature", sig.clone())],
        vec![("x-science-execution-timestamp", ts.clone()), ("x-science-execution-signature", String::new())],
    ];
    for extra in variants {
        let headers: Vec<(&str, String)> = base.iter().cloned().chain(extra).collect();
        let reply = client.raw("POST", SHELL, &headers, raw.clone()).await.unwrap();
        expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_signature_31_seconds_old_is_refused() {
    if !sandbox_or_skip("a_signature_31_seconds_old_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let reply = post_at(&server, SHELL, &(now_ms() - 31_000).to_string(), &touching_request(&ws)).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_signature_31_seconds_in_the_future_is_refused() {
    if !sandbox_or_skip("a_signature_31_seconds_in_the_future_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let reply = post_at(&server, SHELL, &(now_ms() + 31_000).to_string(), &touching_request(&ws)).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_signature_29_seconds_old_or_ahead_is_accepted() {
    if !sandbox_or_skip("a_signature_29_seconds_old_or_ahead_is_accepted") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let old = shell_request("main", "session", &ws, "true");
    expect_ok(&post_at(&server, SHELL, &(now_ms() - 29_000).to_string(), &old).await);
    let ahead = shell_request("main", "session", &ws, "true");
    expect_ok(&post_at(&server, SHELL, &(now_ms() + 29_000).to_string(), &ahead).await);
}

#[tokio::test]
async fn an_uppercase_hex_signature_is_refused() {
    if !sandbox_or_skip("an_uppercase_hex_signature_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let raw = bytes(&touching_request(&ws));
    let ts = now_ms().to_string();
    let sig = sign(TEST_TOKEN, &ts, &raw).to_uppercase();
    let reply = post_with(&server, SHELL, TEST_TOKEN, Some((ts, sig)), raw).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_signature_over_another_body_is_refused() {
    if !sandbox_or_skip("a_signature_over_another_body_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let signed = bytes(&shell_request("main", "session", &ws, "true"));
    let sent = bytes(&touching_request(&ws));
    let ts = now_ms().to_string();
    let sig = sign(TEST_TOKEN, &ts, &signed);
    let reply = post_with(&server, SHELL, TEST_TOKEN, Some((ts.clone(), sig.clone())), sent).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    // One byte appended to the signed body is another body too.
    let mut longer = signed.clone();
    longer.push(b' ');
    let reply = post_with(&server, SHELL, TEST_TOKEN, Some((ts, sig)), longer).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_signature_made_with_another_token_is_refused() {
    if !sandbox_or_skip("a_signature_made_with_another_token_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let raw = bytes(&touching_request(&ws));
    let ts = now_ms().to_string();
    let sig = sign("another-token", &ts, &raw);
    let reply = post_with(&server, SHELL, TEST_TOKEN, Some((ts, sig)), raw).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_non_numeric_timestamp_is_refused() {
    if !sandbox_or_skip("a_non_numeric_timestamp_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let now = now_ms();
    for ts in [
        "abc".to_owned(),
        format!("{now}a"),
        format!("-{now}"),
        format!("+{now}"),
        format!(" {now}"),
        format!("{now}.0"),
        format!("{}e3", now / 1000),
        String::new(),
        "99999999999999999999".to_owned(),
    ] {
        // Signed correctly over the timestamp as written: only its form is wrong.
        let reply = post_at(&server, SHELL, &ts, &touching_request(&ws)).await;
        assert_eq!(reply.status, 401, "timestamp {ts:?}");
        expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_timestamp_in_seconds_is_refused() {
    if !sandbox_or_skip("a_timestamp_in_seconds_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let reply = post_at(&server, SHELL, &(now_ms() / 1000).to_string(), &touching_request(&ws)).await;
    expect_error(&reply, 401, SIGNATURE_ERROR, "invalid_signature");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn an_exact_replay_of_an_accepted_request_is_refused() {
    if !sandbox_or_skip("an_exact_replay_of_an_accepted_request_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let raw = bytes(&shell_request("main", "session", &ws, "echo run >> runs.txt"));
    let ts = now_ms().to_string();
    let sig = sign(TEST_TOKEN, &ts, &raw);
    let first = post_with(&server, SHELL, TEST_TOKEN, Some((ts.clone(), sig.clone())), raw.clone()).await;
    expect_ok(&first);
    let second = post_with(&server, SHELL, TEST_TOKEN, Some((ts, sig)), raw).await;
    expect_error(&second, 401, SIGNATURE_ERROR, "replayed_request");
    assert_eq!(std::fs::read_to_string(ws.join("runs.txt")).unwrap(), "run\n", "the replay ran");
}

/// The NPU job routes' bodies carry nothing unique (every cancel is `{sessionId}`) and the
/// original client's timestamps cluster on second boundaries, so two distinct requests can
/// share a signature there: runnerd must not call the second one a replay (drop-in).
#[tokio::test]
async fn identical_signed_npu_bodies_are_not_refused_as_replays() {
    let server = Server::start();
    let ts = now_ms().to_string();
    let cancel = json!({"sessionId": "session"});
    let submit = json!({"sessionId": "session", "workloadId": "npu.smoke-test.v1"});
    for (path, body) in [
        ("/npu/jobs/job-a/cancel", &cancel),
        ("/npu/jobs/job-b/cancel", &cancel),
        ("/npu/jobs/job-b/cancel", &cancel),
        ("/npu/jobs", &submit),
        ("/npu/jobs", &submit),
    ] {
        let r = post_at(&server, path, &ts, body).await;
        let text = String::from_utf8_lossy(&r.body);
        assert_ne!(r.status, 401, "{path}: {text}");
        assert!(!text.contains("replayed_request"), "{path}: {text}");
    }
}

#[tokio::test]
async fn the_bearer_check_comes_before_the_signature_check() {
    if !sandbox_or_skip("the_bearer_check_comes_before_the_signature_check") {
        return;
    }
    let (server, ws) = server_with_workspace();
    // Wrong token, bad signature.
    let raw = bytes(&touching_request(&ws));
    let bad = Some(("abc".to_owned(), "0".repeat(64)));
    let reply = post_with(&server, SHELL, "wrong-token", bad.clone(), raw.clone()).await;
    expect_error(&reply, 401, "Unauthorized", "unauthorized");
    // No signature at all, wrong token.
    let reply = post_with(&server, PYTHON, "wrong-token", None, raw.clone()).await;
    expect_error(&reply, 401, "Unauthorized", "unauthorized");
    // A valid signature does not make up for a wrong token.
    let ts = now_ms().to_string();
    let sig = sign(TEST_TOKEN, &ts, &raw);
    let reply = post_with(&server, SHELL, "wrong-token", Some((ts, sig)), raw).await;
    expect_error(&reply, 401, "Unauthorized", "unauthorized");
    assert_nothing_ran(&ws);
}

// ---------------------------------------------------------------------------------------
// 3. Bodies (contract §1.2, §2A step 2)

#[tokio::test]
async fn malformed_json_is_refused_as_invalid_json() {
    let server = Server::start();
    let now = now_ms();
    let bodies = ["{", "{\"agentId\":}", "", "nul", "{\"a\":1}x", "{'a':1}"];
    for (i, body) in bodies.into_iter().enumerate() {
        for (j, path) in [SHELL, PYTHON].into_iter().enumerate() {
            // Signed correctly; a distinct timestamp for each POST, so none is a replay.
            let ts = (now - (2 * i + j) as u64).to_string();
            let raw = body.as_bytes().to_vec();
            let sig = sign(TEST_TOKEN, &ts, &raw);
            let reply = post_with(&server, path, TEST_TOKEN, Some((ts, sig)), raw).await;
            let v = reply.json();
            assert_eq!(
                (reply.status, v["code"].as_str()),
                (400, Some("invalid_json")),
                "{body:?} on {path}: {v}"
            );
            assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
            assert!(reply.body.ends_with(b"\n"));
        }
    }
}

#[tokio::test]
async fn a_json_value_that_is_not_an_object_is_refused() {
    let server = Server::start();
    let ws = server.project_workspace("session");
    let now = now_ms();
    let bodies = [
        json!([]),
        json!([shell_request("main", "session", &ws, "true")]),
        json!(null),
        json!("x"),
        json!(1),
    ];
    for (i, body) in bodies.iter().enumerate() {
        for (j, path) in [SHELL, PYTHON].into_iter().enumerate() {
            let reply = post_at(&server, path, &(now - (2 * i + j) as u64).to_string(), body).await;
            expect_error(&reply, 400, "Request body must be a JSON object", "invalid_json");
        }
    }
}

#[tokio::test]
async fn a_body_over_2000000_bytes_is_refused_for_its_size() {
    if !sandbox_or_skip("a_body_over_2000000_bytes_is_refused_for_its_size") {
        return;
    }
    let (server, ws) = server_with_workspace();
    // Signed correctly: the size alone is wrong.
    let body = shell_request("main", "session", &ws, &format!("touch ran.txt; : {}", "a".repeat(2_000_001)));
    let reply = post(&server, SHELL, &body).await;
    expect_error(&reply, 400, BODY_TOO_LARGE, "body_too_large");
    // The body is read (with its limit) before the signature is checked.
    let reply = post_with(&server, SHELL, TEST_TOKEN, None, bytes(&body)).await;
    expect_error(&reply, 400, BODY_TOO_LARGE, "body_too_large");
    // One byte over the limit.
    let raw = padded_to(touching_request(&ws), 2_000_001);
    let sig = server.client().signature_headers(&raw);
    let reply = post_with(&server, SHELL, TEST_TOKEN, Some((sig[0].1.clone(), sig[1].1.clone())), raw).await;
    expect_error(&reply, 400, BODY_TOO_LARGE, "body_too_large");
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn bodies_up_to_2000000_bytes_are_read_and_verified_whole() {
    let (server, ws) = server_with_workspace();
    // Blank code: runnerd must read, verify and parse the whole body to reach that check.
    for size in [1_999_000, 2_000_000] {
        let raw = padded_to(shell_request("main", "session", &ws, " "), size);
        let sig = server.client().signature_headers(&raw);
        let reply =
            post_with(&server, SHELL, TEST_TOKEN, Some((sig[0].1.clone(), sig[1].1.clone())), raw).await;
        expect_error(&reply, 400, "Shell code is required", "code_required");
    }
}

// ---------------------------------------------------------------------------------------
// 4. kernelMode (contract §2A step 3, §7 items 6 and 10)

#[tokio::test]
async fn non_ephemeral_kernel_modes_are_refused_before_anything_touches_the_disk() {
    if !sandbox_or_skip("non_ephemeral_kernel_modes_are_refused_before_anything_touches_the_disk") {
        return;
    }
    let server = Server::start();
    for path in [SHELL, PYTHON] {
        for mode in [json!("persistent"), Value::Null, json!("x"), json!(""), json!(false), json!({})] {
            for variant in 0..4 {
                let mut body =
                    keyed_shell_request("main", "session", "must-not-create/workspace", "touch ran.txt");
                body["kernelMode"] = mode.clone();
                match variant {
                    1 => {
                        body.as_object_mut().unwrap().remove("agentId");
                    }
                    2 => body["permissionEpoch"]["executeGrantScope"] = json!("once"),
                    3 if path == PYTHON => body["language"] = json!("r"),
                    _ => {}
                }
                let reply = post(&server, path, &body).await;
                expect_error(&reply, 400, PERSISTENT_ERROR, "persistent_kernel_refused");
            }
        }
    }
    assert!(!server.path("remote-workspaces").exists(), "a refused request created the remote workspaces");
    let status = server.client().get("/status").await.unwrap();
    assert_eq!(status.status, 200);
    let status = status.json();
    assert_eq!((&status["activeExecutions"], &status["kernels"]), (&json!([]), &json!([])), "{status}");
    let kernels = server.client().get("/kernels").await.unwrap();
    assert_eq!((kernels.status, kernels.json()), (200, json!([])));
}

// ---------------------------------------------------------------------------------------
// 5. Workspaces (contract §2A step 4, §7 items 12, 14, 22, 23)

#[tokio::test]
async fn hostile_remote_workspace_keys_are_invalid() {
    if !sandbox_or_skip("hostile_remote_workspace_keys_are_invalid") {
        return;
    }
    let server = Server::start();
    let long = "a".repeat(501);
    for key in [
        "../x",
        "/abs",
        "a//b",
        "a\\b",
        "a/./b",
        "a/../b",
        "a/",
        "./a",
        "..",
        long.as_str(),
        "a b",
        "ü",
        "a/b\0c",
    ] {
        for path in [SHELL, PYTHON] {
            let body = keyed_shell_request("main", "session", key, "touch ran.txt");
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "key {key:?} on {path}");
            expect_error(&reply, 400, INVALID_KEY, "invalid_workspace_key");
        }
    }
    assert!(!server.path("x").exists(), "../x escaped the remote workspaces");
    assert!(!server.dir.path().join("x").exists());
}

#[tokio::test]
async fn a_symlinked_key_segment_is_refused_and_nothing_is_created_outside() {
    if !sandbox_or_skip("a_symlinked_key_segment_is_refused_and_nothing_is_created_outside") {
        return;
    }
    let server = Server::start();
    let outside = runner_tests::scratch_dir();
    std::fs::create_dir_all(server.path("remote-workspaces")).unwrap();
    symlink(outside.path(), server.path("remote-workspaces/escape")).unwrap();
    for key in ["escape/child", "escape", "escape/a/b"] {
        for path in [SHELL, PYTHON] {
            let body = keyed_shell_request("main", "session", key, "touch ran.txt");
            let reply = post(&server, path, &body).await;
            expect_error(&reply, 400, SYMLINKED_KEY, "workspace_symlink");
        }
    }
    let created: Vec<_> = std::fs::read_dir(outside.path()).unwrap().collect();
    assert!(created.is_empty(), "created outside the data directory: {created:?}");
}

#[tokio::test]
async fn a_symlinked_remote_workspaces_root_is_refused_and_nothing_is_created_outside() {
    if !sandbox_or_skip("a_symlinked_remote_workspaces_root_is_refused_and_nothing_is_created_outside") {
        return;
    }
    let server = Server::start();
    let outside = runner_tests::scratch_dir();
    symlink(outside.path(), server.path("remote-workspaces")).unwrap();
    for path in [SHELL, PYTHON] {
        let body = keyed_shell_request("main", "session", "project/session", "touch ran.txt");
        let reply = post(&server, path, &body).await;
        let v = reply.json();
        assert_eq!(reply.status, 400, "{v}");
        let error = v["error"].as_str().unwrap_or_default();
        assert!(
            [SYMLINKED_KEY, "Remote workspace escapes the runner data directory"].contains(&error),
            "{v}"
        );
    }
    let created: Vec<_> = std::fs::read_dir(outside.path()).unwrap().collect();
    assert!(created.is_empty(), "created outside the data directory: {created:?}");
}

#[tokio::test]
async fn workspace_roots_outside_projects_and_remote_workspaces_are_refused() {
    if !sandbox_or_skip("workspace_roots_outside_projects_and_remote_workspaces_are_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let outside = runner_tests::scratch_dir();
    std::fs::create_dir_all(server.path("logs")).unwrap();
    symlink(outside.path(), server.path("projects/escape-link")).unwrap();
    symlink(outside.path(), ws.join("link-out")).unwrap();
    let roots = [
        server.path("logs"),
        PathBuf::from("/tmp"),
        PathBuf::from("/"),
        server.data_dir.clone(),
        outside.path().to_owned(),
        server.path("projects/../logs"),
        ws.join("../../../../../logs"),
    ];
    for root in &roots {
        for path in [SHELL, PYTHON] {
            let reply = post(&server, path, &touching_request_on(path, root)).await;
            assert_eq!(reply.status, 400, "{} on {path}", root.display());
            expect_error(&reply, 400, OUTSIDE_ROOTS, "workspace_outside_roots");
        }
    }
    // Symlinks below the data directory are never followed (issue #14 hole 3); one leading
    // outside the roots answers the original's text (issue #30).
    for root in [server.path("projects/escape-link"), ws.join("link-out")] {
        for path in [SHELL, PYTHON] {
            let reply = post(&server, path, &touching_request_on(path, &root)).await;
            expect_error(&reply, 400, OUTSIDE_ROOTS, "workspace_outside_roots");
        }
    }
    // readOnlyWorkspaceRoot passes the same check.
    for read_only in [PathBuf::from("/tmp"), server.path("logs"), outside.path().to_owned()] {
        let mut body = touching_request(&ws);
        body["readOnlyWorkspaceRoot"] = json!(read_only);
        let reply = post(&server, SHELL, &body).await;
        expect_error(&reply, 400, OUTSIDE_ROOTS, "workspace_outside_roots");
    }
    assert_nothing_ran(&ws);
    assert!(!outside.path().join("ran.txt").exists());
    assert!(!server.path("logs/ran.txt").exists());
}

#[tokio::test]
async fn a_missing_workspace_root_is_the_realpath_enoent_error() {
    if !sandbox_or_skip("a_missing_workspace_root_is_the_realpath_enoent_error") {
        return;
    }
    let (server, _ws) = server_with_workspace();
    let missing = server.path("projects/project/sessions/nope/workspace");
    for path in [SHELL, PYTHON] {
        let reply = post(&server, path, &touching_request_on(path, &missing)).await;
        let error = error_400(&reply, "path_not_found");
        assert!(error.starts_with("ENOENT: no such file or directory, realpath '"), "{error}");
        assert_eq!(error, format!("ENOENT: no such file or directory, realpath '{}'", missing.display()));
    }
    assert!(!missing.exists());
}

// ---------------------------------------------------------------------------------------
// 6. Mounts (contract §2A PermissionEpoch)

#[tokio::test]
async fn the_permission_epoch_must_grant_exactly_one_read_write_workspace_mount() {
    if !sandbox_or_skip("the_permission_epoch_must_grant_exactly_one_read_write_workspace_mount") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let rw = json!({"source": "workspace", "mode": "read-write"});
    let mounts = [
        None,
        Some(json!([])),
        Some(json!([{"source": "workspace", "mode": "read-only"}])),
        Some(json!([rw.clone(), rw.clone()])),
        Some(json!([rw.clone(), {"source": "workspace", "mode": "read-only"}])),
        Some(json!([{"source": "home", "mode": "read-write"}])),
    ];
    for (path, message) in [
        (SHELL, "Shell execution accepts exactly one read-write workspace mount"),
        (PYTHON, "M1 runner accepts exactly one read-write workspace mount"),
    ] {
        for mount in &mounts {
            let mut body = touching_request_on(path, &ws);
            match mount {
                None => {
                    body["permissionEpoch"].as_object_mut().unwrap().remove("mounts");
                }
                Some(m) => body["permissionEpoch"]["mounts"] = m.clone(),
            }
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "mounts {mount:?} on {path}");
            expect_error(&reply, 400, message, "invalid_mounts");
        }
    }
    assert_nothing_ran(&ws);
}

// ---------------------------------------------------------------------------------------
// 7. Ids and required fields (contract §2A fields and step 5)

#[tokio::test]
async fn a_blank_execution_id_is_refused() {
    if !sandbox_or_skip("a_blank_execution_id_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for (path, id) in [(SHELL, ""), (PYTHON, "   "), (SHELL, "\t\n")] {
        let mut body = touching_request_on(path, &ws);
        body["executionId"] = json!(id);
        expect_error(
            &post(&server, path, &body).await,
            400,
            "Execution ID is required",
            "execution_id_required",
        );
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn a_missing_or_blank_agent_id_is_refused() {
    if !sandbox_or_skip("a_missing_or_blank_agent_id_is_refused") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for path in [SHELL, PYTHON] {
        for agent in [None, Some(json!("")), Some(json!("   "))] {
            let mut body = touching_request_on(path, &ws);
            match &agent {
                None => {
                    body.as_object_mut().unwrap().remove("agentId");
                }
                Some(a) => body["agentId"] = a.clone(),
            }
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "agentId {agent:?} on {path}");
            expect_error(&reply, 400, "Agent ID is required", "agent_id_required");
        }
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn blank_code_is_refused_with_the_language_s_message() {
    if !sandbox_or_skip("blank_code_is_refused_with_the_language_s_message") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for code in ["", "  \n\t"] {
        for (path, message) in [(SHELL, "Shell code is required"), (PYTHON, "Python code is required")] {
            let body = shell_request("main", "session", &ws, code);
            expect_error(&post(&server, path, &body).await, 400, message, "code_required");
        }
    }
}

#[tokio::test]
async fn r_needs_the_scientific_environment_capability() {
    if !sandbox_or_skip("r_needs_the_scientific_environment_capability") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let mut body = shell_request("main", "session", &ws, "writeLines('ran', 'ran.txt')");
    body["language"] = json!("r");
    let reply = post(&server, PYTHON, &body).await;
    expect_error(
        &reply,
        400,
        "R execution requires the scientific environment capability",
        "capability_unavailable",
    );
    assert!(!ws.join("ran.txt").exists());
}

#[tokio::test]
async fn a_reused_execution_id_is_a_conflict_on_both_routes() {
    if !sandbox_or_skip("a_reused_execution_id_is_a_conflict_on_both_routes") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let id = new_execution_id();
    let mut first = shell_request("main", "session", &ws, "echo run >> runs.txt");
    first["executionId"] = json!(id);
    expect_ok(&post(&server, SHELL, &first).await);
    // Same route, another agent and session; then the other route.
    let mut again = shell_request("other", "another-session", &ws, "echo run >> runs.txt");
    again["executionId"] = json!(id);
    expect_error(
        &post(&server, SHELL, &again).await,
        409,
        "Execution ID has already been used",
        "duplicate_execution",
    );
    let mut python = shell_request("main", "session", &ws, "open('runs.txt', 'a').write('run\\n')");
    python["executionId"] = json!(id);
    expect_error(
        &post(&server, PYTHON, &python).await,
        409,
        "Execution ID has already been used",
        "duplicate_execution",
    );
    assert_eq!(std::fs::read_to_string(ws.join("runs.txt")).unwrap(), "run\n");
}

#[tokio::test]
async fn an_id_is_consumed_even_when_its_execution_then_fails() {
    if !sandbox_or_skip("an_id_is_consumed_even_when_its_execution_then_fails") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let id = new_execution_id();
    // Refused after the dedupe step (blank code): the id is recorded anyway.
    let mut first = shell_request("main", "session", &ws, " ");
    first["executionId"] = json!(id);
    expect_error(&post(&server, PYTHON, &first).await, 400, "Python code is required", "code_required");
    let mut retry = touching_request(&ws);
    retry["executionId"] = json!(id);
    expect_error(
        &post(&server, SHELL, &retry).await,
        409,
        "Execution ID has already been used",
        "duplicate_execution",
    );
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn requests_refused_at_the_kernel_mode_or_workspace_step_do_not_consume_the_id() {
    if !sandbox_or_skip("requests_refused_at_the_kernel_mode_or_workspace_step_do_not_consume_the_id") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let id = new_execution_id();
    let with_id = |mut body: Value| {
        body["executionId"] = json!(id);
        body
    };
    let mut persistent = with_id(shell_request("main", "session", &ws, "true"));
    persistent["kernelMode"] = json!("persistent");
    expect_error(
        &post(&server, SHELL, &persistent).await,
        400,
        PERSISTENT_ERROR,
        "persistent_kernel_refused",
    );
    let bad_key = with_id(keyed_shell_request("main", "session", "../x", "true"));
    expect_error(&post(&server, PYTHON, &bad_key).await, 400, INVALID_KEY, "invalid_workspace_key");
    let outside = with_id(shell_request("main", "session", Path::new("/tmp"), "true"));
    expect_error(&post(&server, SHELL, &outside).await, 400, OUTSIDE_ROOTS, "workspace_outside_roots");
    let missing = with_id(shell_request("main", "session", &server.path("projects/nope"), "true"));
    let error = error_400(&post(&server, SHELL, &missing).await, "path_not_found");
    assert!(error.starts_with("ENOENT: no such file or directory, realpath '"), "{error}");

    let valid = with_id(shell_request("main", "session", &ws, "echo ok"));
    let result = expect_ok(&post(&server, SHELL, &valid).await);
    assert_eq!(
        (result["stdout"].as_str(), result["executionId"].as_str()),
        (Some("ok\n"), Some(id.as_str()))
    );
}

// ---------------------------------------------------------------------------------------
// 8. Limits (contract §2A "Timeout fields", "Output truncation fields", "Workspace quota")

#[tokio::test]
async fn execution_timeout_must_be_a_non_negative_integer_of_milliseconds() {
    if !sandbox_or_skip("execution_timeout_must_be_a_non_negative_integer_of_milliseconds") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for value in
        [json!(-1), json!(1.5), json!("10"), json!(true), json!([10]), json!(9_007_199_254_740_992u64)]
    {
        for path in [SHELL, PYTHON] {
            let mut body = touching_request_on(path, &ws);
            body["executionTimeoutMs"] = value.clone();
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "executionTimeoutMs {value} on {path}");
            expect_error(&reply, 400, TIMEOUT_ERROR, "invalid_limit");
        }
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn max_output_bytes_must_be_a_non_negative_integer() {
    if !sandbox_or_skip("max_output_bytes_must_be_a_non_negative_integer") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for value in [json!(-1), json!(0.5), json!("1000"), json!(false)] {
        for path in [SHELL, PYTHON] {
            let mut body = touching_request_on(path, &ws);
            body["maxOutputBytes"] = value.clone();
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "maxOutputBytes {value} on {path}");
            expect_error(
                &reply,
                400,
                "maxOutputBytes must be a non-negative integer number of bytes",
                "invalid_limit",
            );
        }
    }
    assert_nothing_ran(&ws);
}

#[tokio::test]
async fn max_workspace_bytes_must_be_a_non_negative_integer() {
    if !sandbox_or_skip("max_workspace_bytes_must_be_a_non_negative_integer") {
        return;
    }
    let (server, ws) = server_with_workspace();
    for value in [json!("x"), json!(-1), json!(2.25), json!({})] {
        for path in [SHELL, PYTHON] {
            let mut body = touching_request_on(path, &ws);
            body["maxWorkspaceBytes"] = value.clone();
            let reply = post(&server, path, &body).await;
            assert_eq!(reply.status, 400, "maxWorkspaceBytes {value} on {path}");
            expect_error(
                &reply,
                400,
                "maxWorkspaceBytes must be a non-negative integer number of bytes",
                "invalid_limit",
            );
        }
    }
    assert_nothing_ran(&ws);
}

// ---------------------------------------------------------------------------------------
// 9. cwd (contract §2A "cwd", §7 item 24)

#[tokio::test]
async fn cwd_must_be_an_existing_directory_inside_the_writable_workspace() {
    if !sandbox_or_skip("cwd_must_be_an_existing_directory_inside_the_writable_workspace") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let outside = runner_tests::scratch_dir();
    std::fs::write(ws.join("file.txt"), "not a directory").unwrap();
    symlink(outside.path(), ws.join("link-out")).unwrap();
    std::fs::create_dir(ws.join("sub")).unwrap();
    let cases = [
        ("/etc", "cwd must be workspace-relative"),
        ("/workspace", "cwd must be workspace-relative"),
        ("../../..", "cwd must remain inside the writable workspace"),
        ("..", "cwd must remain inside the writable workspace"),
        ("sub/../..", "cwd must remain inside the writable workspace"),
        ("link-out", "cwd must remain inside the writable workspace"),
        ("file.txt", "cwd must be a directory"),
    ];
    for (cwd, message) in cases {
        let mut body = touching_request(&ws);
        body["cwd"] = json!(cwd);
        let reply = post(&server, SHELL, &body).await;
        assert_eq!(reply.status, 400, "cwd {cwd:?}");
        expect_error(&reply, 400, message, "invalid_cwd");
    }
    let mut body = touching_request(&ws);
    body["cwd"] = json!("missing");
    let error = error_400(&post(&server, SHELL, &body).await, "path_not_found");
    assert!(error.starts_with("ENOENT: no such file or directory, realpath '"), "{error}");
    assert!(error.ends_with(" 'missing'"), "{error}");
    assert_nothing_ran(&ws);
    assert!(!outside.path().join("ran.txt").exists());
}

#[tokio::test]
async fn a_valid_cwd_is_where_the_shell_starts() {
    if !sandbox_or_skip("a_valid_cwd_is_where_the_shell_starts") {
        return;
    }
    let (server, ws) = server_with_workspace();
    std::fs::create_dir(ws.join("analysis")).unwrap();
    runner_tests::hand_tree_to_sandbox(&ws);
    let mut body = shell_request("main", "session", &ws, "pwd; touch here.txt");
    body["cwd"] = json!("analysis");
    let result = expect_ok(&post(&server, SHELL, &body).await);
    assert_eq!(result["stdout"], "/workspace/analysis\n", "{result}");
    assert_eq!(result["workingDirectory"], "/workspace/analysis", "{result}");
    assert!(ws.join("analysis/here.txt").exists());
    // The next call without cwd starts at the mount again.
    let result = expect_ok(&post(&server, SHELL, &shell_request("main", "session", &ws, "pwd")).await);
    assert_eq!(result["stdout"], "/workspace\n", "{result}");
}

// ---------------------------------------------------------------------------------------
// 10. Network and NPU fail closed (contract §2A "Network policy", "NPU fields")

#[tokio::test]
async fn a_network_allowlist_fails_closed_without_the_egress_gateway() {
    if !sandbox_or_skip("a_network_allowlist_fails_closed_without_the_egress_gateway") {
        return;
    }
    let (server, ws) = server_with_workspace();
    let access = json!({
        "mode": "domain-allowlist",
        "allowedDomains": ["example.com"],
        "allowPrivateNetwork": false,
        "revision": "r1",
    });
    for (path, code) in [(SHELL, "touch ran.txt"), (PYTHON, "open('ran.txt', 'w').write('ran')")] {
        let mut body = shell_request("main", "session", &ws, code);
        body["permissionEpoch"]["networkPolicy"] = json!("domain-allowlist");
        body["permissionEpoch"]["networkAccess"] = access.clone();
        let reply = post(&server, path, &body).await;
        assert_eq!(
            (reply.status, reply.json()["code"].as_str()),
            (400, Some("network_unavailable")),
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        let error = reply.json()["error"].as_str().unwrap().to_owned();
        assert!(
            error.starts_with(
                "Sandbox network access (domain-allowlist) is unavailable: egressd is not reachable at "
            ) && error.contains("no-egressd/control.sock")
                && error.ends_with("nothing was run"),
            "{error}"
        );
        assert_nothing_ran(&ws);
    }
    // networkAccess counts only when its mode equals networkPolicy: otherwise there is no
    // network, and the run (which may then go ahead) reports "none".
    let mut body = shell_request("main", "session", &ws, "echo isolated");
    body["permissionEpoch"]["networkAccess"] = access.clone();
    let result = expect_ok(&post(&server, SHELL, &body).await);
    assert_eq!(
        (&result["networkPolicy"], &result["networkAccessRevision"], &result["stdout"]),
        (&json!("none"), &json!("none"), &json!("isolated\n")),
        "{result}"
    );
}

#[tokio::test]
async fn npu_devices_fail_closed_without_npu_support() {
    if !sandbox_or_skip("npu_devices_fail_closed_without_npu_support") {
        return;
    }
    // No npu-smi: this host has no NPU support (the fakes are in tests/suite/accel.rs).
    let server = Server::start_with(runner_tests::server::ServerOptions {
        env: vec![("SCIENCE_AGENT_NPU_SMI_PATH".into(), "/nonexistent/npu-smi".into())],
        ..Default::default()
    });
    let ws = server.project_workspace("session");
    let none = |h: u32| format!("This machine reports no Ascend NPU cards, so NPU {h} cannot be selected.");
    for (path, code) in [(SHELL, "touch ran.txt"), (PYTHON, "open('ran.txt', 'w').write('ran')")] {
        for (devices, reasons) in [(json!([0]), none(0)), (json!([1, 0]), format!("{} {}", none(0), none(1)))]
        {
            let mut body = shell_request("main", "session", &ws, code);
            body["npuDevices"] = devices;
            let reply = post(&server, path, &body).await;
            expect_error(
                &reply,
                400,
                &format!("Requested NPU cards are not usable on this machine: {reasons}"),
                "npu_unavailable",
            );
            assert_nothing_ran(&ws);
        }
    }
}

#[tokio::test]
async fn paths_are_matched_exactly_so_no_spelling_skips_the_signature() {
    if !sandbox_or_skip("paths_are_matched_exactly_so_no_spelling_skips_the_signature") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("paths");
    let body = shell_request("main", "s", &ws, "touch ran.txt").to_string().into_bytes();
    let bearer = ("authorization", format!("Bearer {TEST_TOKEN}"));
    for path in
        ["//execute-shell", "///execute-shell", "/execute-shell/", "//execute", "/status/", "//status"]
    {
        let method = if path.contains("status") { "GET" } else { "POST" };
        let r = client.raw(method, path, std::slice::from_ref(&bearer), body.clone()).await.unwrap();
        assert_eq!((r.status, r.json()["error"].as_str()), (404, Some("Not found")), "{method} {path}");
    }
    let r = client.raw("POST", "/kernels//teardown", &[bearer], b"{}".to_vec()).await.unwrap();
    assert_eq!(r.status, 404);
    assert!(!ws.join("ran.txt").exists(), "an unsigned request ran code");
}
