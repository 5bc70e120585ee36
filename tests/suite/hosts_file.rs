//! egressd's hosts file (issue #17): a name the hosts file maps to loopback is refused
//! without private network access and reached with it, from inside a real sandbox through
//! the real bridge and egressd; malformed lines give nothing; an in-place edit is picked up.
//! The test's DNS server knows none of these names (NXDOMAIN), so only the hosts file can
//! make them resolve.

use std::io::Write;
use std::path::PathBuf;

use runner_tests::egress::{Egressd, FakeDns, Upstream, with_network};
use runner_tests::server::{Server, ServerOptions, shell_request};
use runner_tests::{sandbox_or_skip, scratch_dir};
use serde_json::Value;

struct World {
    _dns: FakeDns,
    _hosts_dir: tempfile::TempDir,
    hosts: PathBuf,
    upstream: Upstream,
    egressd: Egressd,
    server: Server,
    ws: PathBuf,
}

const DOMAINS: &[&str] = &["mirror.corp.test", "sneaky.corp.test", "short.corp.test", "later.corp.test"];

fn world(hosts_text: &str) -> World {
    let dns = FakeDns::start(&[]);
    let upstream = Upstream::start();
    let hosts_dir = scratch_dir();
    let hosts = hosts_dir.path().join("hosts");
    std::fs::write(&hosts, hosts_text).unwrap();
    let egressd = Egressd::start(dns.addr, &["--hosts-file", &hosts.display().to_string()]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let ws = server.project_workspace("session");
    World { _dns: dns, _hosts_dir: hosts_dir, hosts, upstream, egressd, server, ws }
}

/// `status|headline` of a GET of `http://<name>:<port>/<name>` from inside the sandbox.
async fn get(w: &World, name: &str, private: bool) -> (String, String) {
    let port = w.upstream.port;
    let code = format!(
        "curl -s -D /tmp/h -o /tmp/b -w '%{{http_code}}' http://{name}:{port}/{name}; echo; \
         tr -d '\\r' < /tmp/h | grep -i '^x-sandbox-network' || true; cat /tmp/b"
    );
    let body = with_network(shell_request("main", "session", &w.ws, &code), DOMAINS, private, "rev-hosts");
    let reply = w.server.client().post_signed("/execute-shell", &body).await.expect("runnerd answers");
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let v: Value = reply.json();
    let out = v["stdout"].as_str().unwrap_or_default().to_owned();
    let (status, rest) = out.split_once('\n').unwrap_or((&out, ""));
    (status.to_owned(), rest.to_owned())
}

#[tokio::test]
async fn a_hosts_file_loopback_entry_needs_private_network_malformed_lines_give_nothing() {
    if !sandbox_or_skip("a_hosts_file_loopback_entry_needs_private_network_malformed_lines_give_nothing") {
        return;
    }
    let w = world(
        "# test hosts\n127.0.0.1 mirror.corp.test\n0x7f.0.0.1 sneaky.corp.test\n127.1 short.corp.test\n",
    );

    // Without private network access the loopback answer is refused, as from DNS.
    let (status, rest) = get(&w, "mirror.corp.test", false).await;
    assert_eq!(status, "403", "{rest}");
    assert!(
        rest.contains("mirror.corp.test resolves only to private or loopback addresses"),
        "{rest}\n{}",
        w.egressd.log()
    );
    assert!(w.upstream.requests.lock().unwrap().is_empty(), "nothing was dialled");

    // With it, the sandbox reaches the upstream on 127.0.0.1 by that name.
    let (status, rest) = get(&w, "mirror.corp.test", true).await;
    assert_eq!((status.as_str(), rest.trim()), ("200", "ok /mirror.corp.test"), "{}", w.egressd.log());

    // The inet_aton spellings are ignored: the names go to DNS, which does not know them.
    for name in ["sneaky.corp.test", "short.corp.test"] {
        let (status, rest) = get(&w, name, true).await;
        assert_ne!(status, "200", "{name}: {rest}");
        assert!(rest.contains(&format!("{name} could not be resolved")), "{name}: {rest}");
    }
    assert_eq!(w.upstream.requests.lock().unwrap().len(), 1, "only the allowed request was dialled");
    // Each skipped line is logged once, however many lookups followed.
    let log = w.egressd.log();
    for value in ["0x7f.0.0.1", "127.1"] {
        let needle = format!("{value:?} is not a canonical IPv4 dotted quad");
        let count = log.lines().filter(|l| l.contains(&needle)).count();
        assert_eq!(count, 1, "{value} logged {count} times:\n{log}");
    }

    // Edited in place (as a bind-mounted /etc/hosts is): the next lookup sees the new name.
    let (status, _) = get(&w, "later.corp.test", true).await;
    assert_ne!(status, "200");
    let mut file = std::fs::OpenOptions::new().append(true).open(&w.hosts).unwrap();
    file.write_all(b"127.0.0.1 later.corp.test\n").unwrap();
    drop(file);
    let (status, rest) = get(&w, "later.corp.test", true).await;
    assert_eq!((status.as_str(), rest.trim()), ("200", "ok /later.corp.test"), "{}", w.egressd.log());
}
