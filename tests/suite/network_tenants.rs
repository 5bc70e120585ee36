//! Egress between tenants (issue #14, holes 7 and 8): two tenants' sandboxes, real runnerd,
//! real egressd, real bwrap + seccomp and bridge, a DNS server of the test's own and a
//! loopback HTTP upstream. Tenant A attacks from inside its sandbox or through the API;
//! tenant B's egress must keep working.

use std::path::Path;
use std::time::{Duration, Instant};

use runner_tests::egress::{Egressd, FakeDns, Upstream, gateways_created, with_network};
use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};
use serde_json::{Value, json};

const SHELL: &str = "/execute-shell";

async fn run(server: &Server, body: &Value) -> Value {
    let reply = server.client().post_signed(SHELL, body).await.expect("runnerd answers");
    assert_eq!(reply.status, 200, "body: {}", String::from_utf8_lossy(&reply.body));
    reply.json()
}

/// Waits (for liveness only: nothing is asserted about time) until `path` exists.
async fn wait_for(path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(Instant::now() < deadline, "{what} never happened");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Each of three processes in A's sandbox opens 4 connections straight to the gateway
/// socket (no bridge: sandbox code may connect to it itself) and tunnels to the upstream
/// through those admitted, then holds them until told to stop. Prints per process
/// `accepted=N` and every refusal's status and reason.
const HOG: &str = r#"
import os, socket, sys, time
me, port = sys.argv[1], int(sys.argv[2])
held, refusals = [], []
for _ in range(4):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/run/sciencediscovery/egress.sock")
    try:
        s.sendall(("CONNECT mirror.test:%d HTTP/1.1\r\nHost: mirror.test:%d\r\n\r\n" % (port, port)).encode())
    except BrokenPipeError:
        pass  # refused before the request was read
    head = b""
    try:
        while b"\r\n\r\n" not in head:
            chunk = s.recv(1024)
            if not chunk:
                break
            head += chunk
    except ConnectionResetError:
        pass
    lines = head.decode(errors="replace").split("\r\n")
    if lines[0].startswith("HTTP/1.1 200"):
        held.append(s)
    else:
        reason = [l for l in lines if l.lower().startswith("x-sandbox-network:")]
        refusals.append(lines[0] + " | " + (reason[0] if reason else ""))
        s.close()
open("held-" + me, "w").close()
while not os.path.exists("go"):
    time.sleep(0.05)
print("proc%s accepted=%d" % (me, len(held)))
for r in refusals:
    print("proc%s refused %s" % (me, r))
"#;

#[tokio::test]
async fn another_tenant_gets_out_while_one_sandbox_holds_its_whole_cap_from_several_processes() {
    const TEST: &str = "another_tenant_gets_out_while_one_sandbox_holds_its_whole_cap_from_several_processes";
    if !sandbox_or_skip(TEST) {
        return;
    }
    let _dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    // A pool of 8 per gateway, so 4 per sandbox: three processes of A asking 4 each would
    // have filled it if the cap counted per process id.
    let egressd = Egressd::start(_dns.addr, &["--max-tunnels", "8"]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let (ws_a, ws_b) = (server.project_workspace("tenant-a"), server.project_workspace("tenant-b"));
    let port = upstream.port;
    std::fs::write(ws_a.join("hog.py"), HOG).unwrap();

    // Both tenants have the same policy (and even the same revision): one gateway.
    let domains = ["mirror.test"];
    let code_a = format!("for i in 1 2 3; do python3 hog.py $i {port} & done; wait");
    let body_a = with_network(shell_request("a", "tenant-a", &ws_a, &code_a), &domains, true, "rev-shared");
    let client = server.client();
    let a = tokio::spawn(async move { client.post_signed(SHELL, &body_a).await.expect("runnerd answers") });
    for i in 1..=3 {
        wait_for(&ws_a.join(format!("held-{i}")), &format!("A's process {i} holding its connections")).await;
    }

    // While A holds everything it can: B's request through its own bridge gets out.
    let code_b = format!("curl -s -w ' %{{http_code}}' http://mirror.test:{port}/b");
    let result_b = run(
        &server,
        &with_network(shell_request("b", "tenant-b", &ws_b, &code_b), &domains, true, "rev-shared"),
    )
    .await;
    assert_eq!(result_b["stdout"], "ok /b 200", "{result_b}\n{}", egressd.log());

    std::fs::write(ws_a.join("go"), b"").unwrap();
    let reply_a = a.await.unwrap();
    assert_eq!(reply_a.status, 200, "{}", String::from_utf8_lossy(&reply_a.body));
    let result_a = reply_a.json();
    let out = result_a["stdout"].as_str().unwrap();
    let accepted: usize = out
        .lines()
        .filter_map(|l| l.split_once(" accepted=").map(|(_, n)| n.parse::<usize>().unwrap()))
        .sum();
    let refused: Vec<&str> = out.lines().filter(|l| l.contains(" refused ")).collect();
    assert_eq!(accepted, 4, "A's sandbox, all its processes together, holds its cap of 4: {out}");
    assert_eq!(refused.len(), 8, "{out}");
    assert!(
        refused.iter().all(|l| l.contains("HTTP/1.1 429") && l.contains("limit 4 per sandbox")),
        "every refusal names the per-sandbox cap: {out}"
    );
    assert_eq!(gateways_created(&egressd), 1, "A and B shared the gateway: {}", egressd.log());
}

#[tokio::test]
async fn a_squatted_revision_does_not_block_the_tenant_whose_policy_it_names() {
    if !sandbox_or_skip("a_squatted_revision_does_not_block_the_tenant_whose_policy_it_names") {
        return;
    }
    let dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    let egressd = Egressd::start(dns.addr, &[]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let (ws_a, ws_b) = (server.project_workspace("tenant-a"), server.project_workspace("tenant-b"));
    let port = upstream.port;
    let probe = format!(
        "for h in mirror.test blocked.test; do echo \"$h=$(curl -s -o /dev/null -w '%{{http_code}}' http://$h:{port}/)\"; done"
    );

    // A goes first, naming B's revision with an allowlist of its own.
    let a = run(
        &server,
        &with_network(shell_request("a", "tenant-a", &ws_a, &probe), &["blocked.test"], true, "rev-of-b"),
    )
    .await;
    assert_eq!(a["stdout"], "mirror.test=403\nblocked.test=200\n", "A gets its own policy: {a}");

    // B's correct policy under its revision is served, and as B's: A's list does not leak in.
    let b = run(
        &server,
        &with_network(shell_request("b", "tenant-b", &ws_b, &probe), &["mirror.test"], true, "rev-of-b"),
    )
    .await;
    assert_eq!(b["stdout"], "mirror.test=200\nblocked.test=403\n", "{b}\n{}", egressd.log());
    assert_eq!(
        (&a["networkAccessRevision"], &b["networkAccessRevision"]),
        (&json!("rev-of-b"), &json!("rev-of-b")),
        "the caller's revision is still echoed"
    );
    assert_eq!(gateways_created(&egressd), 2, "two policies, two gateways: {}", egressd.log());
}
