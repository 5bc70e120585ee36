//! Domain-allowlisted network, end to end (R-NET-1..4): real runnerd, real egressd, real
//! bwrap + seccomp, the real bridge, a DNS server of the test's own and a loopback HTTP
//! upstream. Every claim is checked from inside the sandbox with curl and Python.

use std::path::PathBuf;
use std::time::Duration;

use runner_tests::egress::{Egressd, FakeDns, Upstream, gateways_created, with_network};
use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};
use runnerctl::client::Reply;
use serde_json::{Value, json};

const SHELL: &str = "/execute-shell";
const PYTHON: &str = "/execute";

struct World {
    _dns: FakeDns,
    upstream: Upstream,
    egressd: Egressd,
    server: Server,
    ws: PathBuf,
}

/// `mirror.test` and `blocked.test` both resolve to 127.0.0.1, where the upstream listens;
/// only `mirror.test` is allowlisted (with private network on, as a loopback upstream needs).
fn world() -> World {
    let dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    let egressd = Egressd::start(dns.addr, &[]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let ws = server.project_workspace("session");
    World { _dns: dns, upstream, egressd, server, ws }
}

async fn post(server: &Server, path: &str, body: &Value) -> Reply {
    server.client().post_signed(path, body).await.expect("runnerd answers")
}

#[track_caller]
fn ok(reply: &Reply) -> Value {
    let v = reply.json();
    assert_eq!(reply.status, 200, "body: {}", String::from_utf8_lossy(&reply.body));
    v
}

async fn run_shell(w: &World, code: &str, domains: &[&str], private: bool, revision: &str) -> Value {
    let body = with_network(shell_request("main", "session", &w.ws, code), domains, private, revision);
    ok(&post(&w.server, SHELL, &body).await)
}

#[tokio::test]
async fn allowlisted_names_pass_and_everything_else_is_refused_from_inside_the_sandbox() {
    if !sandbox_or_skip("allowlisted_names_pass_and_everything_else_is_refused_from_inside_the_sandbox") {
        return;
    }
    let w = world();
    let port = w.upstream.port;
    let code = format!(
        r#"
echo "env=$HTTP_PROXY|$HTTPS_PROXY|$http_proxy|$https_proxy|${{NO_PROXY:-}}|${{ALL_PROXY:-}}"
echo "plain=$(curl -sS http://mirror.test:{port}/hello)"
echo "tunnel=$(curl -sS --proxytunnel http://mirror.test:{port}/through)"
echo "blocked=$(curl -s -o /dev/null -w '%{{http_code}}' http://blocked.test:{port}/)"
curl -s -D - -o /dev/null http://blocked.test:{port}/ | tr -d '\r' | grep -i '^x-sandbox-network' | sed 's/^/blockedheader=/' || true
echo "literal=$(curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/)"
curl -s -D - -o /dev/null --proxytunnel http://127.0.0.1:{port}/ 2>/dev/null | tr -d '\r' | grep -i '^x-sandbox-network' | sed 's/^/literalheader=/' || true
echo "direct=$(curl -s --noproxy '*' -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:{port}/ ; echo " rc=$?")"
"#
    );
    let result = run_shell(&w, &code, &["mirror.test"], true, "rev-allow").await;
    let out = result["stdout"].as_str().unwrap();
    let line = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {result}"))
            .to_owned()
    };
    assert_eq!(
        line("env"),
        "http://127.0.0.1:18118|http://127.0.0.1:18118|http://127.0.0.1:18118|http://127.0.0.1:18118||"
    );
    assert_eq!(line("plain"), "ok /hello");
    assert_eq!(line("tunnel"), "ok /through");
    assert_eq!(line("blocked"), "403");
    assert!(
        line("blockedheader").contains("blocked.test:")
            && line("blockedheader").contains("is not in the sandbox network allowed domains"),
        "{out}"
    );
    assert_eq!(line("literal"), "403");
    assert!(
        line("literalheader")
            .contains("127.0.0.1 is an IP address; sandbox network access allows domain names only"),
        "{out}"
    );
    // Without the proxy: nothing listens on the sandbox's own loopback at that port.
    assert_eq!(line("direct"), "000 rc=7", "{out}");
    assert_eq!(
        (&result["networkPolicy"], &result["networkAccessRevision"]),
        (&json!("domain-allowlist"), &json!("rev-allow"))
    );
    assert_eq!(result["exitCode"], 0, "{result}");

    // The upstream saw origin-form requests with Host rewritten from the target and no
    // proxy headers; the blocked name never reached it.
    let seen = w.upstream.requests.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|h| h.starts_with("GET /hello HTTP/1.1\r\n")
                && h.contains(&format!("Host: mirror.test:{port}"))),
        "{seen:?}"
    );
    assert!(seen.iter().all(|h| !h.to_ascii_lowercase().contains("proxy-")), "{seen:?}");
    assert_eq!(seen.len(), 2, "only the two allowed requests reached the upstream: {seen:?}");

    // egressd audited each decision with its fields.
    let log = w.egressd.log();
    for needle in [
        "egress_decision",
        "decision=\"allowed\"",
        "decision=\"denied\"",
        "revision=rev-allow",
        "bytes_down=",
    ] {
        assert!(log.contains(needle), "{needle} missing from egressd's log:\n{log}");
    }
}

#[tokio::test]
async fn python_reaches_an_allowed_name_and_raw_sockets_go_nowhere() {
    if !sandbox_or_skip("python_reaches_an_allowed_name_and_raw_sockets_go_nowhere") {
        return;
    }
    let w = world();
    let port = w.upstream.port;
    let code = format!(
        r#"
import errno, socket, urllib.request, urllib.error
print("urllib", urllib.request.urlopen("http://mirror.test:{port}/py", timeout=10).read().decode())
try:
    urllib.request.urlopen("http://blocked.test:{port}/", timeout=10)
except urllib.error.HTTPError as e:
    print("blocked", e.code)
for family, addr in ((socket.AF_INET, ("93.184.216.34", 80)), (socket.AF_INET6, ("2606:2800:220:1:248:1893:25c8:1946", 80))):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(addr)
        print("direct connected")
    except OSError as e:
        print("direct", errno.errorcode.get(e.errno, e.errno))
for name, family in (("netlink", socket.AF_NETLINK), ("packet", socket.AF_PACKET)):
    try:
        socket.socket(family, socket.SOCK_RAW, 0)
        print(name, "opened")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
"#
    );
    let body = with_network(shell_request("main", "session", &w.ws, &code), &["mirror.test"], true, "rev-py");
    let result = ok(&post(&w.server, PYTHON, &body).await);
    let out = result["stdout"].as_str().unwrap();
    assert!(out.contains("urllib ok /py"), "{result}");
    assert!(out.contains("blocked 403"), "{result}");
    // No interface but loopback: the kernel has no route anywhere.
    assert_eq!(out.matches("direct ENETUNREACH").count(), 2, "{result}");
    // The network profile still refuses every family but Unix and IP.
    assert!(out.contains("netlink EPERM") && out.contains("packet EPERM"), "{result}");
}

#[tokio::test]
async fn policy_none_gets_no_proxy_no_socket_and_no_sockets_at_all() {
    if !sandbox_or_skip("policy_none_gets_no_proxy_no_socket_and_no_sockets_at_all") {
        return;
    }
    let w = world();
    let code = r#"
echo "env=${HTTP_PROXY:-unset}|${https_proxy:-unset}"
test -e /run/sciencediscovery/egress.sock && echo socket=present || echo socket=absent
test -e /opt/sciencediscovery-net && echo bridge=present || echo bridge=absent
python3 -c '
import errno, socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    print("inet opened")
except OSError as e:
    print("inet", errno.errorcode[e.errno])
'
"#;
    let result = ok(&post(&w.server, SHELL, &shell_request("main", "session", &w.ws, code)).await);
    assert_eq!(result["stdout"], "env=unset|unset\nsocket=absent\nbridge=absent\ninet EPERM\n", "{result}");
    assert_eq!(
        (&result["networkPolicy"], &result["networkAccessRevision"]),
        (&json!("none"), &json!("none"))
    );
}

#[tokio::test]
async fn one_gateway_per_policy_whatever_the_revision_and_a_socket_per_run() {
    if !sandbox_or_skip("one_gateway_per_policy_whatever_the_revision_and_a_socket_per_run") {
        return;
    }
    let w = world();
    let port = w.upstream.port;
    let code = format!("curl -sS http://mirror.test:{port}/a");
    // The same policy (after normalisation) under three revisions: one gateway.
    for (domains, revision) in [
        (&["mirror.test"][..], "rev-same"),
        (&["mirror.test"], "rev-same"),
        (&["MIRROR.test.", "mirror.test"], "rev-other"),
    ] {
        let r = run_shell(&w, &code, domains, true, revision).await;
        assert_eq!(r["stdout"], "ok /a", "{r}");
        assert_eq!(r["networkAccessRevision"], revision, "the caller's revision is echoed: {r}");
    }
    assert_eq!(gateways_created(&w.egressd), 1, "{}", w.egressd.log());
    // Each run had a socket of its own, gone with the run.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !w.egressd.gateway_sockets().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(w.egressd.gateway_sockets(), Vec::<PathBuf>::new());
    assert_eq!(w.egressd.log().matches("lease_opened").count(), 3, "{}", w.egressd.log());
    // Another allowlist under a revision already used is another policy, served as such.
    let r = run_shell(&w, &code, &["blocked.test"], true, "rev-same").await;
    assert!(r["stdout"].as_str().unwrap().contains("is not in the sandbox network allowed domains"), "{r}");
    assert_eq!(gateways_created(&w.egressd), 2, "{}", w.egressd.log());
}

#[tokio::test]
async fn private_answers_are_refused_unless_the_policy_allows_private_network() {
    if !sandbox_or_skip("private_answers_are_refused_unless_the_policy_allows_private_network") {
        return;
    }
    let w = world();
    let port = w.upstream.port;
    let code = format!(
        "curl -s -D - -o /dev/null http://mirror.test:{port}/ | tr -d '\\r' | grep -i '^HTTP/\\|^x-sandbox-network'"
    );
    let r = run_shell(&w, &code, &["mirror.test"], false, "rev-public-only").await;
    let out = r["stdout"].as_str().unwrap();
    assert!(out.contains("403"), "{r}");
    assert!(
        out.contains("mirror.test resolves only to private or loopback addresses; enable private network access to allow it"),
        "{r}"
    );
    assert!(w.upstream.requests.lock().unwrap().is_empty(), "nothing was dialled");
}

#[tokio::test]
async fn killing_egressd_fails_requests_cleanly_health_says_so_and_both_recover() {
    if !sandbox_or_skip("killing_egressd_fails_requests_cleanly_health_says_so_and_both_recover") {
        return;
    }
    let mut w = world();
    let port = w.upstream.port;
    let health = |h: Value| (h["sandboxNetwork"]["available"].clone(), h["egressd"]["reachable"].clone());
    let h = w.server.client().get("/health").await.unwrap().json();
    assert_eq!(health(h.clone()), (json!(true), json!(true)), "{h}");
    assert_eq!(h["sandboxNetwork"]["modes"], json!(["none", "domain-allowlist"]));
    assert!(h["egressd"]["confinement"]["seccomp"].as_bool().unwrap(), "{h}");

    // A run that makes one request, waits for the test to kill egressd, then tries again.
    let code = format!(
        r#"echo "first=$(curl -sS http://mirror.test:{port}/one)"
touch first-done
for i in $(seq 1 300); do test -e go && break; sleep 0.05; done
echo "second=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 10 http://mirror.test:{port}/two)"
"#
    );
    let body =
        with_network(shell_request("main", "session", &w.ws, &code), &["mirror.test"], true, "rev-kill");
    let client = w.server.client();
    let run = tokio::spawn(async move { client.post_signed(SHELL, &body).await.unwrap() });
    let marker = w.ws.join("first-done");
    for _ in 0..400 {
        if marker.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(marker.exists(), "the first request never finished");
    w.egressd.kill();
    std::fs::write(w.ws.join("go"), b"").unwrap();
    let result = ok(&run.await.unwrap());
    let out = result["stdout"].as_str().unwrap();
    assert!(out.contains("first=ok /one"), "{result}");
    // The bridge answers 502 itself: a clean HTTP failure, not a hang.
    assert!(out.contains("second=502"), "{result}");

    let h = w.server.client().get("/health").await.unwrap().json();
    assert_eq!(health(h.clone()), (json!(false), json!(false)), "{h}");
    assert!(
        h["sandboxNetwork"]["unavailableReason"].as_str().unwrap().contains("egressd is not reachable"),
        "{h}"
    );
    let body = with_network(
        shell_request("main", "session", &w.ws, "touch ran-without-egressd"),
        &["mirror.test"],
        true,
        "rev-kill",
    );
    let reply = post(&w.server, SHELL, &body).await;
    assert_eq!((reply.status, reply.json()["code"].as_str()), (400, Some("network_unavailable")));
    assert!(!w.ws.join("ran-without-egressd").exists(), "fails closed: nothing ran");

    w.egressd.restart();
    let h = w.server.client().get("/health").await.unwrap().json();
    assert_eq!(health(h.clone()), (json!(true), json!(true)), "{h}");
    let r = run_shell(
        &w,
        &format!("curl -sS http://mirror.test:{port}/three"),
        &["mirror.test"],
        true,
        "rev-kill",
    )
    .await;
    assert_eq!(r["stdout"], "ok /three", "{r}");
}

#[tokio::test]
async fn egressd_serves_only_the_configured_uid_on_its_control_socket() {
    let dns = FakeDns::start(&[]);
    let other_uid = own_uid().wrapping_add(4242).to_string();
    let egressd = Egressd::start(dns.addr, &["--runner-uid", &other_uid]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let h = server.client().get("/health").await.unwrap().json();
    assert_eq!(h["sandboxNetwork"]["available"], false, "{h}");
    let reason = h["sandboxNetwork"]["unavailableReason"].as_str().unwrap();
    assert!(reason.contains(&format!("egressd serves only uid {other_uid}")), "{reason}");
    assert!(egressd.log().contains("control_peer_refused"), "{}", egressd.log());
}

/// This process's uid (a different one is then certainly not ours).
fn own_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap_or(0)
}

#[test]
fn egressd_command_line_help_version_check_and_errors() {
    let run = |args: &[&str]| {
        let out =
            std::process::Command::new(runner_tests::bin("egressd")).args(args).env_clear().output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, _) = run(&["--help"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("--control-socket") && out.contains("SCIENCE_AGENT_EGRESS_SOCKET"), "{out}");
    let (code, out, _) = run(&["--version"]);
    assert_eq!((code, out.starts_with("egressd ")), (Some(0), true), "{out}");
    let (code, out, _) = run(&["--check-config", "--nameserver", "127.0.0.1:53", "--runtime-dir", "/run/x"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("egressd configuration is valid") && out.contains("/run/x/eg/<16 hex>"), "{out}");
    let (code, _, err) = run(&["--max-tunnels", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--max-tunnels must be a positive integer"), "{err}");
    let long = format!("/{}", "d".repeat(100));
    let (code, _, err) = run(&["--check-config", "--nameserver", "127.0.0.1", "--runtime-dir", &long]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("107-byte Unix socket path limit") && err.contains("shorten that directory"),
        "{err}"
    );
}

#[test]
fn runnerd_selftest_checks_a_sandbox_and_a_request_through_egressd() {
    if !sandbox_or_skip("runnerd_selftest_checks_a_sandbox_and_a_request_through_egressd") {
        return;
    }
    let dns = FakeDns::start(&[]);
    let mut egressd = Egressd::start(dns.addr, &[]);
    let data = runner_tests::scratch_dir();
    let selftest = |egress_socket: &std::path::Path| {
        let out = std::process::Command::new(runner_tests::bin("runnerd"))
            .arg("selftest")
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("SCIENCE_AGENT_DATA_DIR", data.path())
            .env("SCIENCE_AGENT_EGRESS_SOCKET", egress_socket)
            .env(runner_tests::sandbox_user_env().0, runner_tests::sandbox_user_env().1)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let (code, text) = selftest(&egressd.control_socket);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("selftest: sandbox: ok") && text.contains("selftest: network: ok"), "{text}");
    assert!(text.contains("an unlisted name got 403"), "{text}");
    // The request really went through egressd: it audited both decisions.
    let log = egressd.log();
    assert!(log.contains("host=selftest.localhost") && log.contains("decision=\"allowed\""), "{log}");
    assert!(log.contains("host=refused.localhost") && log.contains("decision=\"denied\""), "{log}");
    // No DNS server was asked: localhost names are loopback by definition (RFC 6761).
    assert!(dns.queries.lock().unwrap().is_empty());

    egressd.kill();
    let (code, text) = selftest(&egressd.control_socket);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("selftest: network: FAILED: egressd is not reachable at"), "{text}");
}
