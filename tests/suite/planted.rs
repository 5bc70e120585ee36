//! Nothing a sandbox planted is followed (issue #14 holes 2, 3 and 11; issue #15 item 1).
//!
//! The lease files of workspace `t/a/b` live in `t/a/.workspace-coordination/`, inside the
//! tree that workspace `t/a`'s sandbox writes. Each test plants something there (or in its
//! own workspace) *from inside a real sandbox of `t/a`*, through the HTTP API, then drives
//! runnerd at it and checks that nothing outside the data directory was created, truncated
//! or read, and that the run failed closed with a clear error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, keyed_shell_request, shell_request};
use runnerctl::client::{Reply, RunnerClient};
use serde_json::{Value, json};

const SHELL: &str = "/execute-shell";

async fn run_keyed(client: &RunnerClient, agent: &str, key: &str, code: &str) -> Reply {
    let body = keyed_shell_request(agent, &format!("session-{agent}"), key, code);
    client.post_signed(SHELL, &body).await.expect("runnerd answers")
}

async fn post(server: &Server, body: &Value) -> Reply {
    server.client().post_signed(SHELL, body).await.expect("runnerd answers")
}

#[track_caller]
fn expect_ok(reply: &Reply) -> Value {
    let v = reply.json();
    assert_eq!((reply.status, v["exitCode"].as_i64()), (200, Some(0)), "{v}");
    v
}

#[track_caller]
fn expect_refused(reply: &Reply, code: &str) -> String {
    let v = reply.json();
    assert_eq!((reply.status, v["code"].as_str()), (400, Some(code)), "{v}");
    v["error"].as_str().unwrap_or_default().to_owned()
}

/// `t/a` (the planting tenant) and its nested workspace `t/a/b`, both used once so that
/// `t/a/.workspace-coordination/<H>.*` exist; returns `H` (b's lease file stem).
async fn nested_pair(server: &Server) -> String {
    let client = server.client();
    expect_ok(&run_keyed(&client, "agent-a", "t/a", "true").await);
    expect_ok(&run_keyed(&client, "agent-b", "t/a/b", "true").await);
    let b = server.path("remote-workspaces/t/a/b").canonicalize().unwrap();
    let hex = runnerd::coordination::path_hex(&b);
    let lock = server.path(&format!("remote-workspaces/t/a/.workspace-coordination/{hex}.sqlite"));
    assert!(lock.is_file(), "the nested lease database lives in the parent's tree");
    hex
}

/// A shell line for a's sandbox: set the coordination directory aside and put a fresh one
/// holding only what `then` plants. (A sandbox that cannot write into runnerd's 0700
/// directory can still do this: it owns the directory that holds it.)
fn replant(then: &str) -> String {
    format!("mv .workspace-coordination .coordination-aside && mkdir .workspace-coordination && {then}")
}

/// Undoes [`replant`].
const RESTORE: &str = "rm -rf .workspace-coordination && mv .coordination-aside .workspace-coordination";

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

/// A directory outside the data directory that runnerd's user can write, with one
/// existing file that must never be rewritten.
fn outside() -> (tempfile::TempDir, PathBuf) {
    let dir = runner_tests::scratch_dir();
    let precious = dir.path().join("precious");
    std::fs::write(&precious, "precious").unwrap();
    // Writable by whoever runnerd runs as, so that following a link would succeed.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(&precious, std::fs::Permissions::from_mode(0o666)).unwrap();
    (dir, precious)
}

#[track_caller]
fn untouched(dir: &Path, precious: &Path) {
    assert_eq!(entries(dir), vec![precious.to_owned()], "something was created outside the data directory");
    assert_eq!(std::fs::read_to_string(precious).unwrap(), "precious", "a host file was rewritten");
}

#[tokio::test]
async fn a_planted_failed_marker_is_never_followed_when_a_commit_fails() {
    if !sandbox_or_skip("a_planted_failed_marker_is_never_followed_when_a_commit_fails") {
        return;
    }
    let server = Server::start();
    let hex = nested_pair(&server).await;
    let (out, precious) = outside();
    let b = server.path("remote-workspaces/t/a/b");
    // b's run waits (under its lease, marker checked) for the plant, then makes its own
    // commit fail with a FIFO, so runnerd poisons b by writing `<H>.failed`.
    let client = server.client();
    let waiting = tokio::spawn(async move {
        let code = "touch started; i=0; while [ ! -e go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; mkfifo fifo";
        run_keyed(&client, "agent-b", "t/a/b", code).await
    });
    while !b.join("started").exists() {
        assert!(!waiting.is_finished(), "b's run ended early: {:?}", waiting.await.unwrap().json());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The attack, from a's sandbox: `.failed` -> an existing host file.
    let plant = replant(&format!("ln -s {} .workspace-coordination/{hex}.failed", precious.display()));
    expect_ok(&run_keyed(&server.client(), "agent-a", "t/a", &plant).await);
    std::fs::write(b.join("go"), "").unwrap();
    let reply = waiting.await.unwrap();
    assert_eq!(reply.status, 400, "b's commit must fail: {}", reply.json());
    untouched(out.path(), &precious);
    // And b stays refused, closed, with the poison text (the planted entry counts).
    let reply = run_keyed(&server.client(), "agent-b", "t/a/b", "touch later").await;
    let error = expect_refused(&reply, "workspace_poisoned");
    assert!(error.contains("repair storage"), "{error}");
    assert!(!b.join("later").exists());
    untouched(out.path(), &precious);
}

#[tokio::test]
async fn planted_failed_active_and_lock_database_links_are_never_followed() {
    if !sandbox_or_skip("planted_failed_active_and_lock_database_links_are_never_followed") {
        return;
    }
    let server = Server::start();
    let hex = nested_pair(&server).await;
    let (out, precious) = outside();
    let b = server.path("remote-workspaces/t/a/b");
    let o = out.path().display();
    let data = server.data_dir.canonicalize().unwrap();
    for (what, plant, code) in [
        // A dangling `.failed` (the original checks it through realpath: absent).
        (
            "failed",
            format!("ln -s {o}/created-failed .workspace-coordination/{hex}.failed"),
            "workspace_poisoned",
        ),
        (
            "active",
            format!("ln -s {o}/created-active .workspace-coordination/{hex}.active"),
            "workspace_interrupted",
        ),
        (
            "sqlite",
            format!("ln -s {o}/created.sqlite .workspace-coordination/{hex}.sqlite"),
            "workspace_version_failed",
        ),
        (
            "sqlite to a host file",
            format!("ln -s {} .workspace-coordination/{hex}.sqlite", precious.display()),
            "workspace_version_failed",
        ),
    ] {
        expect_ok(&run_keyed(&server.client(), "agent-a", "t/a", &replant(&plant)).await);
        let reply =
            run_keyed(&server.client(), "agent-b", "t/a/b", &format!("touch ran-{}", what.len())).await;
        let error = expect_refused(&reply, code);
        assert!(!error.contains(data.to_str().unwrap()), "{what}: a host path in {error:?}");
        if code == "workspace_version_failed" {
            assert!(
                error.contains("not followed") || error.contains("nothing was followed"),
                "{what}: {error}"
            );
        }
        assert!(!b.join(format!("ran-{}", what.len())).exists(), "{what}: b ran anyway");
        untouched(out.path(), &precious);
        expect_ok(&run_keyed(&server.client(), "agent-a", "t/a", RESTORE).await);
    }
    // Cleaned up, b works again (nothing was poisoned in this process).
    expect_ok(&run_keyed(&server.client(), "agent-b", "t/a/b", "touch fine").await);
    assert!(b.join("fine").exists());
}

#[tokio::test]
async fn a_planted_coordination_directory_link_is_never_followed() {
    if !sandbox_or_skip("a_planted_coordination_directory_link_is_never_followed") {
        return;
    }
    let server = Server::start();
    nested_pair(&server).await;
    let (out, precious) = outside();
    let b = server.path("remote-workspaces/t/a/b");
    let plant = format!(
        "mv .workspace-coordination moved-away && ln -s {} .workspace-coordination",
        out.path().display()
    );
    expect_ok(&run_keyed(&server.client(), "agent-a", "t/a", &plant).await);
    let reply = run_keyed(&server.client(), "agent-b", "t/a/b", "touch ran").await;
    let error = expect_refused(&reply, "workspace_version_failed");
    assert!(error.contains(".workspace-coordination"), "{error}");
    assert!(!b.join("ran").exists());
    untouched(out.path(), &precious);
}

/// Tenant A plants `proj -> <B's workspace>` and names `<A>/proj`; cwd links likewise; the
/// roots themselves are refused. B's files are neither read nor written.
#[tokio::test]
async fn planted_workspace_root_and_cwd_links_and_the_roots_themselves_are_refused() {
    if !sandbox_or_skip("planted_workspace_root_and_cwd_links_and_the_roots_themselves_are_refused") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    expect_ok(&run_keyed(&client, "agent-b", "tenant-b/s", "echo b-secret > secret").await);
    let b = server.path("remote-workspaces/tenant-b/s").canonicalize().unwrap();
    let a = server.path("remote-workspaces/tenant-a/s");
    let plant = format!(
        "ln -s {b} proj && ln -s /etc etc-link && ln -s /nonexistent-{} gone && ln -s .. up && mkdir -p real/inner && ln -s real/inner inner-link",
        std::process::id(),
        b = b.display()
    );
    expect_ok(&run_keyed(&client, "agent-a", "tenant-a/s", &plant).await);
    let steal = "cat secret 2>/dev/null || cat tenant-b/s/secret; touch pwned";
    for root in [a.join("proj"), a.join("proj/."), a.join("real/../proj")] {
        let reply = post(&server, &shell_request("agent-a", "session-a", &root, steal)).await;
        let error = expect_refused(&reply, "workspace_symlink");
        assert_eq!(error, "Runner workspace path must not contain symbolic links");
        assert!(!reply.json().to_string().contains("b-secret"));
    }
    for root in [
        server.path("remote-workspaces"),
        server.path("projects"),
        server.path("remote-workspaces/tenant-a/.."),
    ] {
        std::fs::create_dir_all(server.path("projects")).unwrap();
        let reply = post(&server, &shell_request("agent-a", "session-a", &root, steal)).await;
        expect_refused(&reply, "workspace_is_root");
        assert!(!reply.json().to_string().contains("b-secret"));
    }
    // readOnlyWorkspaceRoot through the planted link is refused the same way.
    let mut body = shell_request("agent-a", "session-a", &a, "cat /parent_workspace/secret; touch pwned");
    body["readOnlyWorkspaceRoot"] = json!(a.join("proj"));
    expect_refused(&post(&server, &body).await, "workspace_symlink");
    // A lease directory is no workspace either.
    let coordination = server.path("remote-workspaces/tenant-a/.workspace-coordination");
    assert!(coordination.is_dir());
    expect_refused(
        &post(&server, &shell_request("agent-a", "session-a", &coordination, "ls")).await,
        "reserved_workspace_name",
    );

    // cwd: the same answer whether the link's host target exists or not (no oracle), and
    // no host path of the workspace in it.
    let mut answers = Vec::new();
    for cwd in ["etc-link", "gone", "up", "inner-link", "up/tenant-b/s"] {
        let mut body = keyed_shell_request("agent-a", "session-a", "tenant-a/s", "pwd; touch pwned");
        body["cwd"] = json!(cwd);
        let reply = post(&server, &body).await;
        let error = expect_refused(&reply, "invalid_cwd");
        assert!(!error.contains(server.dir.path().to_str().unwrap()), "{cwd}: {error}");
        answers.push(error);
    }
    // Links leading out of the workspace get the original's text, decided on the link's own
    // text, so an existing and a missing host target answer alike (issue #30); a link that
    // stays inside keeps our refusal.
    let out = "cwd must remain inside the writable workspace";
    let ours = "cwd must not contain symbolic links";
    assert_eq!(answers, [out, out, out, ours, out], "{answers:?}");
    let mut body = keyed_shell_request("agent-a", "session-a", "tenant-a/s", "pwd");
    body["cwd"] = json!("missing/dir");
    let error = expect_refused(&post(&server, &body).await, "path_not_found");
    assert_eq!(error, "ENOENT: no such file or directory, realpath 'missing/dir'");
    // A real directory still works.
    let mut body = keyed_shell_request("agent-a", "session-a", "tenant-a/s", "pwd");
    body["cwd"] = json!("real/inner");
    assert_eq!(expect_ok(&post(&server, &body).await)["stdout"], "/workspace/real/inner\n");

    assert!(!a.join("pwned").exists() && !b.join("pwned").exists(), "a refused run ran");
    assert_eq!(std::fs::read_to_string(b.join("secret")).unwrap(), "b-secret\n");
}

/// SQLite's unix VFS refuses paths over 512 bytes; a valid 500-character key puts the lease
/// database deeper than that.
#[tokio::test]
async fn a_500_character_workspace_key_works() {
    if !sandbox_or_skip("a_500_character_workspace_key_works") {
        return;
    }
    let server = Server::start();
    let mut segments: Vec<String> = (0..9).map(|i| format!("{i}{}", "k".repeat(48))).collect();
    segments.push("s".repeat(50));
    let key = segments.join("/");
    assert_eq!(key.len(), 500);
    for round in 0..2 {
        let reply = run_keyed(&server.client(), "agent", &key, &format!("echo {round} > round")).await;
        expect_ok(&reply);
    }
    let ws = server.path(&format!("remote-workspaces/{key}"));
    assert_eq!(std::fs::read_to_string(ws.join("round")).unwrap(), "1\n");
    let lock_dir = ws.parent().unwrap().join(".workspace-coordination");
    let lock =
        lock_dir.join(format!("{}.sqlite", runnerd::coordination::path_hex(&ws.canonicalize().unwrap())));
    assert!(lock.as_os_str().len() > 512 && lock.is_file(), "{}", lock.display());
}

/// `.workspace-coordination` as a key or a key segment: run, upload, list and DELETE are
/// refused with 400, and no sibling's lease files are listed or wiped.
#[tokio::test]
async fn reserved_key_segments_are_refused_everywhere() {
    if !sandbox_or_skip("reserved_key_segments_are_refused_everywhere") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    expect_ok(&run_keyed(&client, "agent", "sibling", "true").await);
    let coordination = server.path("remote-workspaces/.workspace-coordination");
    let before = entries(&coordination);
    assert!(!before.is_empty(), "the sibling's lease files");
    for key in [".workspace-coordination", "p/.workspace-coordination", ".workspace-coordination/x"] {
        let reply = run_keyed(&client, "agent", key, "ls -la; touch planted").await;
        let error = expect_refused(&reply, "reserved_workspace_name");
        assert!(error.contains(".workspace-coordination") && error.contains("reserved"), "{error}");
        let q = format!("workspace={}", key.replace('/', "%2F"));
        for (method, route, body) in [
            ("PUT", format!("/remote-workspace/file?{q}&path=x.txt"), b"x".to_vec()),
            ("GET", format!("/remote-workspace/files?{q}"), Vec::new()),
            ("DELETE", format!("/remote-workspace?{q}"), Vec::new()),
        ] {
            let reply = client.send_bytes(method, &route, &[], body).await.unwrap();
            let v = reply.json();
            assert_eq!(
                (reply.status, v["code"].as_str()),
                (400, Some("reserved_workspace_name")),
                "{method} {route}: {v}"
            );
        }
    }
    assert_eq!(entries(&coordination), before, "the lease files were touched");
    assert!(!coordination.join("planted").exists() && !server.path("remote-workspaces/p").exists());
    expect_ok(&run_keyed(&client, "agent", "sibling", "true").await);
}
