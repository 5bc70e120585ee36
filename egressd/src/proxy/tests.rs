//! The proxy against the research file's adversarial cases, over real sockets: a Unix
//! socket pair for the sandbox side, a real loopback TCP upstream, and a table resolver that
//! counts its lookups.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::egress::allowlist::Allowlist;
use common::egress::protocol::Verdict;
use common::egress::route::ProxySetting;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UnixStream};

use super::decide::Policy;
use super::{Record, Shared, serve};
use crate::dns::{LookupFuture, Resolve, ResolveError};
use crate::own::OwnAddresses;

/// Answers from a table; a name listed twice answers its entries in turn (rebinding).
#[derive(Debug, Default)]
struct Table {
    answers: Mutex<HashMap<String, Vec<Vec<IpAddr>>>>,
    lookups: AtomicUsize,
}

impl Resolve for Table {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        let mut answers = self.answers.lock().unwrap();
        let found = answers
            .get_mut(name)
            .map(|turns| if turns.len() > 1 { turns.remove(0) } else { turns[0].clone() });
        Box::pin(async move { found.ok_or_else(|| ResolveError::NoSuchName(name.to_owned())) })
    }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// A loopback upstream recording every connection's bytes; answers plain requests with
/// `ok <path>` (closing after), and echoes `tunnel:<bytes>` for anything else.
struct Upstream {
    port: u16,
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
    open: Arc<AtomicUsize>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let open: Arc<AtomicUsize> = Arc::default();
        let (record, open_count) = (seen.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (record, open_count) = (record.clone(), open_count.clone());
                open_count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        let n = tokio::time::timeout(Duration::from_millis(300), s.read(&mut buf)).await;
                        match n {
                            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => break,
                        }
                        if got.windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                    let text = String::from_utf8_lossy(&got).into_owned();
                    let reply = if let Some(path) =
                        text.split_whitespace().nth(1).filter(|_| text.contains(" HTTP/1.1\r\n"))
                    {
                        let body = format!("ok {path}");
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nKeep-Alive: timeout=5\r\n\r\n{body}",
                            body.len()
                        )
                    } else {
                        format!("tunnel:{text}")
                    };
                    let _ = s.write_all(reply.as_bytes()).await;
                    // Give late bytes (a smuggled request) a chance to arrive and be seen.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    while let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await
                    {
                        if n == 0 {
                            break;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    record.lock().unwrap().push(got);
                    open_count.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Upstream { port, seen, open }
    }

    /// What every connection so far carried, once they have all finished.
    async fn seen(&self) -> Vec<String> {
        for _ in 0..300 {
            if self.open.load(Ordering::SeqCst) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.seen.lock().unwrap().iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect()
    }
}

struct Harness {
    shared: Arc<Shared>,
    table: Arc<Table>,
    policy: Policy,
    setting: ProxySetting,
}

impl Harness {
    fn new(entries: &[&str], private: bool, answers: &[(&str, &[&str])]) -> Harness {
        let table = Arc::new(Table::default());
        for (name, list) in answers {
            table.answers.lock().unwrap().entry(name.to_string()).or_default().push(ips(list));
        }
        let shared = Arc::new(Shared {
            resolver: table.clone(),
            own: OwnAddresses::fixed(ips(&["203.0.113.9"])),
            header_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            dns_timeout: Duration::from_secs(2),
            tunnel_idle: Duration::from_secs(2),
        });
        let policy = Policy {
            allowlist: Allowlist::parse(entries).0,
            allow_private_network: private,
            pinned: Vec::new(),
        };
        Harness { shared, table, policy, setting: ProxySetting::Direct }
    }

    /// Sends `request` (then half-closes unless `keep_open`), returns the answer and record.
    async fn exchange(&self, request: &[u8]) -> (String, Record) {
        let (mut client, server) = UnixStream::pair().unwrap();
        let (shared, policy, setting) = (self.shared.clone(), self.policy.clone(), self.setting.clone());
        let task = tokio::spawn(async move { serve(server, &policy, &setting, &shared).await });
        client.write_all(request).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut out)).await;
        drop(client);
        let rec = tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
        (String::from_utf8_lossy(&out).into_owned(), rec)
    }
}

fn status(answer: &str) -> u16 {
    answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

#[tokio::test]
async fn allowed_names_resolving_inside_are_denied_and_nothing_is_dialled() {
    let up = Upstream::start().await;
    for inside in ["127.0.0.1", "10.0.0.1", "169.254.169.254", "::ffff:127.0.0.1", "203.0.113.9"] {
        let h = Harness::new(&["allowed.example.com"], false, &[("allowed.example.com", &[inside])]);
        let (answer, rec) =
            h.exchange(format!("CONNECT allowed.example.com:{} HTTP/1.1\r\n\r\n", up.port).as_bytes()).await;
        assert_eq!(status(&answer), 403, "{inside}: {answer}");
        assert!(answer.contains("X-Sandbox-Network: allowed.example.com resolves only to"), "{answer}");
        assert_eq!(rec.decision, Verdict::Denied);
    }
    assert!(up.seen().await.is_empty(), "{:?}", up.seen().await);
}

#[tokio::test]
async fn a_denied_name_is_never_looked_up_and_ip_literals_never_match() {
    // A port-qualified entry admits that port only; a plain one any port (the original's rule).
    let h = Harness::new(
        &["allowed.example.com", "pinned.example.com:8443"],
        true,
        &[("evil.com", &["93.184.216.34"])],
    );
    let cases = [
        "CONNECT evil.com:443 HTTP/1.1\r\n\r\n",
        "CONNECT 1.1.1.1:443 HTTP/1.1\r\n\r\n",
        "CONNECT [::1]:443 HTTP/1.1\r\n\r\n",
        "CONNECT [::127.0.0.1]:443 HTTP/1.1\r\n\r\n",
        "CONNECT [64:ff9b::a9fe:a9fe]:443 HTTP/1.1\r\n\r\n",
        "CONNECT [2002:a9fe:a9fe::]:443 HTTP/1.1\r\n\r\n",
        "CONNECT 2130706433:80 HTTP/1.1\r\n\r\n",
        "CONNECT 127.1:80 HTTP/1.1\r\n\r\n",
        "CONNECT 0x7f.1:80 HTTP/1.1\r\n\r\n",
        "CONNECT 0177.0.0.1:80 HTTP/1.1\r\n\r\n",
        "CONNECT allowed.example.com.evil.net:443 HTTP/1.1\r\n\r\n",
        "GET http://allowed.example.com@evil.com/ HTTP/1.1\r\nHost: allowed.example.com\r\n\r\n",
        "GET http://evil.com/ HTTP/1.1\r\nHost: allowed.example.com\r\n\r\n",
        "CONNECT pinned.example.com:22 HTTP/1.1\r\n\r\n",
        "CONNECT pinned.example.com HTTP/1.1\r\n\r\n",
        "GET http://pinned.example.com/ HTTP/1.1\r\n\r\n",
    ];
    for request in cases {
        let (answer, rec) = h.exchange(request.as_bytes()).await;
        assert_eq!(status(&answer), 403, "{request:?} → {answer}");
        assert_eq!(rec.decision, Verdict::Denied, "{request:?}");
    }
    assert_eq!(h.table.lookups.load(Ordering::SeqCst), 0, "a denied request caused a DNS query");
}

#[tokio::test]
async fn malformed_targets_get_400() {
    let h = Harness::new(&["allowed.example.com", "*.example.com"], true, &[]);
    let cases = [
        "CONNECT allowed.example.com:0 HTTP/1.1\r\n\r\n",
        "CONNECT allowed.example.com:65536 HTTP/1.1\r\n\r\n",
        "CONNECT allowed.example.com:https HTTP/1.1\r\n\r\n",
        "CONNECT evil.com:443@allowed.example.com HTTP/1.1\r\n\r\n",
        "CONNECT [fe80::1%25eth0]:443 HTTP/1.1\r\n\r\n",
        "CONNECT a..example.com:443 HTTP/1.1\r\n\r\n",
        "CONNECT %2e.example.com:443 HTTP/1.1\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: allowed.example.com\r\n\r\n",
        "GET https://allowed.example.com/ HTTP/1.1\r\n\r\n",
        "GET http://allowed.example.com/ HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        "NOT HTTP AT ALL\r\n\r\n",
    ];
    for request in cases {
        let (answer, rec) = h.exchange(request.as_bytes()).await;
        assert_eq!(status(&answer), 400, "{request:?} → {answer}");
        assert_eq!(rec.decision, Verdict::Malformed, "{request:?}");
    }
    let (answer, _) = h.exchange("CONNECT \u{430}llowed.example.com:443 HTTP/1.1\r\n\r\n".as_bytes()).await;
    assert!(matches!(status(&answer), 400 | 403), "{answer}");
    let (answer, _) = h.exchange("CONNECT a\u{ff0e}example.com:443 HTTP/1.1\r\n\r\n".as_bytes()).await;
    assert!(matches!(status(&answer), 400 | 403), "{answer}");
    let (answer, _) = h.exchange(b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(answer.ends_with("Sandbox network access expects absolute-form proxy requests\n"), "{answer}");
    let (answer, _) = h.exchange(b"GET ftp://allowed.example.com/ HTTP/1.1\r\n\r\n").await;
    assert!(answer.ends_with("Sandbox network access cannot forward ftp: without CONNECT\n"), "{answer}");
    assert_eq!(h.table.lookups.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_tunnel_opens_only_after_the_verdict_and_carries_pipelined_bytes() {
    let up = Upstream::start().await;
    let h = Harness::new(&["ALLOWED.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    let request = format!(
        "CONNECT ALLOWED.Example.COM.:{} HTTP/1.1\r\nProxy-Authorization: x\r\n\r\nPIPELINED",
        up.port
    );
    let (answer, rec) = h.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200 Connection Established\r\n\r\n"), "{answer}");
    assert!(answer.ends_with("tunnel:PIPELINED"), "{answer}");
    assert_eq!((rec.decision, rec.address), (Verdict::Allowed, Some("127.0.0.1".parse().unwrap())));
    assert_eq!((rec.up, rec.down), (9, "tunnel:PIPELINED".len() as u64));
    assert_eq!(
        up.seen().await,
        vec!["PIPELINED".to_owned()],
        "the CONNECT head itself never reaches the upstream"
    );

    // Denied: the pipelined bytes go nowhere.
    let (answer, _) = h.exchange(b"CONNECT other.example.com:443 HTTP/1.1\r\n\r\nPIPELINED").await;
    assert_eq!(status(&answer), 403);
    assert_eq!(up.seen().await.len(), 1);
}

#[tokio::test]
async fn rebinding_gets_one_lookup_per_connection_and_the_vetted_address_is_dialled() {
    let up = Upstream::start().await;
    // First answer public-looking-but-loopback is allowed (private on); the second would be
    // a different address: a second lookup inside one connection would show.
    let h = Harness::new(
        &["allowed.example.com"],
        true,
        &[("allowed.example.com", &["127.0.0.1"]), ("allowed.example.com", &["192.0.2.1"])],
    );
    let (answer, rec) =
        h.exchange(format!("CONNECT allowed.example.com:{} HTTP/1.1\r\n\r\nx", up.port).as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(rec.address, Some("127.0.0.1".parse().unwrap()));
    assert_eq!(h.table.lookups.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn plain_requests_go_origin_form_with_host_rewritten_and_no_proxy_headers() {
    let up = Upstream::start().await;
    let h = Harness::new(&["allowed.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    let request = format!(
        "GET http://allowed.example.com:{}/hello?q=1 HTTP/1.1\r\nHost: evil.com\r\nProxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive, X-Drop\r\nX-Drop: 1\r\nAccept: */*\r\n\r\n",
        up.port
    );
    let (answer, rec) = h.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("ok /hello?q=1"), "{answer}");
    assert!(answer.contains("Connection: close\r\n") && !answer.contains("Keep-Alive"), "{answer}");
    assert_eq!((rec.decision, rec.status), (Verdict::Allowed, 200));
    let seen = up.seen().await;
    assert_eq!(seen.len(), 1);
    let head = &seen[0];
    assert!(head.starts_with("GET /hello?q=1 HTTP/1.1\r\n"), "{head}");
    assert!(head.contains(&format!("Host: allowed.example.com:{}\r\n", up.port)), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(!lower.contains("proxy-") && !lower.contains("x-drop") && !lower.contains("evil.com"), "{head}");
    assert!(lower.contains("accept: */*"), "{head}");
}

#[tokio::test]
async fn a_request_smuggled_behind_a_body_never_reaches_the_upstream() {
    let up = Upstream::start().await;
    let h = Harness::new(&["allowed.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    let request = format!(
        "POST http://allowed.example.com:{}/p HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET http://evil.com/ HTTP/1.1\r\nHost: evil.com\r\n\r\n",
        up.port
    );
    let (answer, rec) = h.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(rec.up, 5);
    let seen = up.seen().await;
    assert_eq!(seen.len(), 1);
    assert!(seen[0].ends_with("\r\n\r\nhello"), "{:?}", seen[0]);
    assert!(!seen[0].contains("evil.com"), "{:?}", seen[0]);
}

#[tokio::test]
async fn a_dial_failure_is_502_never_200() {
    // A port nothing listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let h = Harness::new(&["allowed.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    let (answer, rec) =
        h.exchange(format!("CONNECT allowed.example.com:{closed} HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert_eq!(status(&answer), 502, "{answer}");
    assert!(
        answer.contains("X-Sandbox-Network: Sandbox network access could not reach allowed.example.com"),
        "{answer}"
    );
    assert_eq!(rec.decision, Verdict::Failed);
    let (answer, _) =
        h.exchange(format!("GET http://allowed.example.com:{closed}/ HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert_eq!(status(&answer), 502, "{answer}");
}

#[tokio::test]
async fn a_slow_client_is_cut_off_after_the_header_timeout() {
    let mut h = Harness::new(&["allowed.example.com"], true, &[]);
    Arc::get_mut(&mut h.shared).unwrap().header_timeout = Duration::from_millis(100);
    let (mut client, server) = UnixStream::pair().unwrap();
    let (shared, policy, setting) = (h.shared.clone(), h.policy.clone(), h.setting.clone());
    let task = tokio::spawn(async move { serve(server, &policy, &setting, &shared).await });
    client.write_all(b"CONNECT allowed.exa").await.unwrap();
    let rec = tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
    assert_eq!((rec.decision, rec.status), (Verdict::NoRequest, 400));
}

/// An outbound proxy that records what it was asked and answers like a forward proxy.
async fn recording_proxy() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let head = String::from_utf8_lossy(&got).into_owned();
                record.lock().unwrap().push(head.clone());
                if head.starts_with("CONNECT ") {
                    let _ = s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\nFROM-PROXY").await;
                } else {
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nproxied").await;
                }
            });
        }
    });
    (port, seen)
}

#[tokio::test]
async fn allowed_traffic_goes_through_the_configured_proxy_with_its_credentials() {
    let (port, seen) = recording_proxy().await;
    let mut h = Harness::new(&["mirror.test"], false, &[("mirror.test", &["93.184.216.34"])]);
    h.setting = ProxySetting::Url(format!("http://re%40search:p%40ss@127.0.0.1:{port}"));
    let (answer, rec) = h.exchange(b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 200 Connection Established\r\n\r\nFROM-PROXY"), "{answer}");
    assert_eq!(rec.proxy.as_deref(), Some(format!("http://127.0.0.1:{port}").as_str()));
    let (answer, _) = h.exchange(b"GET http://mirror.test/x HTTP/1.1\r\n\r\n").await;
    assert!(answer.ends_with("proxied"), "{answer}");
    // A refused name is never offered to the proxy.
    let (answer, _) = h.exchange(b"CONNECT refused.test:443 HTTP/1.1\r\n\r\n").await;
    assert_eq!(status(&answer), 403);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let basic = "Proxy-Authorization: Basic cmVAc2VhcmNoOnBAc3M=\r\n"; // re@search:p@ss
    assert!(
        seen[0].starts_with("CONNECT mirror.test:443 HTTP/1.1\r\n") && seen[0].contains(basic),
        "{}",
        seen[0]
    );
    assert!(
        seen[1].starts_with("GET http://mirror.test/x HTTP/1.1\r\n") && seen[1].contains(basic),
        "{}",
        seen[1]
    );
}

#[tokio::test]
async fn an_unusable_proxy_is_502_without_revealing_it() {
    let mut h = Harness::new(&["mirror.test"], false, &[("mirror.test", &["93.184.216.34"])]);
    for url in ["socks5://127.0.0.1:1080", "http://us%zzer:secret@127.0.0.1:1080"] {
        h.setting = ProxySetting::Url(url.into());
        for request in
            [&b"CONNECT mirror.test:443 HTTP/1.1\r\n\r\n"[..], b"GET http://mirror.test/ HTTP/1.1\r\n\r\n"]
        {
            let (answer, rec) = h.exchange(request).await;
            assert_eq!(status(&answer), 502, "{answer}");
            assert!(answer.contains("configured outbound route"), "{answer}");
            for secret in ["socks5", "127.0.0.1", "1080", "secret", "us%zzer"] {
                assert!(!answer.contains(secret), "{secret} leaked: {answer}");
                assert!(!rec.reason.contains("secret"), "credential in the log: {}", rec.reason);
            }
        }
    }
}

#[tokio::test]
async fn connection_cannot_strip_the_length_that_framed_a_body() {
    let up = Upstream::start().await;
    let h = Harness::new(&["allowed.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    let inner = "GET http://internal.corp/admin HTTP/1.1\r\nHost: internal.corp\r\n\r\n";
    let request = format!(
        "POST http://allowed.example.com:{}/x HTTP/1.1\r\nConnection: Content-Length\r\nContent-Length: {}\r\n\r\n{inner}",
        up.port,
        inner.len()
    );
    let (answer, _) = h.exchange(request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = up.seen().await;
    assert_eq!(seen.len(), 1);
    // The upstream learns the body's length, so the inner bytes stay a body.
    assert!(seen[0].contains(&format!("Content-Length: {}\r\n", inner.len())), "{}", seen[0]);
}

/// An upstream that answers a head at once and then trickles `n` bytes, one per `gap`
/// (or, with `head` false, never answers at all).
async fn trickling(head: bool, n: usize, gap: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                if !head {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    return;
                }
                let _ =
                    s.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n").as_bytes()).await;
                for _ in 0..n {
                    tokio::time::sleep(gap).await;
                    if s.write_all(b"x").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_plain_download_that_keeps_moving_is_never_cut_and_a_silent_one_gets_504() {
    let mut h = Harness::new(&["allowed.example.com"], true, &[("allowed.example.com", &["127.0.0.1"])]);
    Arc::get_mut(&mut h.shared).unwrap().tunnel_idle = Duration::from_millis(300);
    // 12 bytes, one every 100 ms: 1.2 s in all, four times the idle timeout.
    let port = trickling(true, 12, Duration::from_millis(100)).await;
    let (answer, rec) =
        h.exchange(format!("GET http://allowed.example.com:{port}/slow HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert!(answer.ends_with("xxxxxxxxxxxx"), "{answer}");
    assert_eq!((rec.decision, rec.status), (Verdict::Allowed, 200));

    let port = trickling(false, 0, Duration::ZERO).await;
    let (answer, rec) =
        h.exchange(format!("GET http://allowed.example.com:{port}/silent HTTP/1.1\r\n\r\n").as_bytes()).await;
    assert_eq!(status(&answer), 504, "{answer}");
    assert!(answer.contains("did not answer within 300 ms"), "{answer}");
    assert_eq!(rec.decision, Verdict::Failed);
}

#[tokio::test]
async fn a_head_trickled_byte_by_byte_is_parsed_once_it_ends() {
    let h = Harness::new(&["allowed.example.com"], true, &[]);
    let (mut client, server) = UnixStream::pair().unwrap();
    let (shared, policy, setting) = (h.shared.clone(), h.policy.clone(), h.setting.clone());
    let task = tokio::spawn(async move { serve(server, &policy, &setting, &shared).await });
    for b in b"CONNECT evil.example:443 HTTP/1.1\r\nX-Pad: aaaaaaaaaaaaaaaa\r\n\r\n" {
        client.write_all(&[*b]).await.unwrap();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut out)).await;
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 403"));
    assert_eq!(task.await.unwrap().decision, Verdict::Denied);
}
