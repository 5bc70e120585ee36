//! The resolver against small fake nameservers on 127.0.0.1, built from the server half of
//! [`wire`], plus table tests of the pure parts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};
use tokio::task::JoinHandle;

use super::*;
use crate::dns::wire::{Question, RData, Record, TYPE_A, TYPE_AAAA};

/// Where a fake server sends a datagram from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    /// The nameserver's own socket.
    Server,
    /// Another socket on the same host: a spoofer who knows the query.
    Spoofer,
}

type Handler = Arc<dyn Fn(&Question, &[u8]) -> Vec<(From, Vec<u8>)> + Send + Sync>;
type TcpHandler = Arc<dyn Fn(&Question) -> Vec<u8> + Send + Sync>;
type Family = Result<Vec<IpAddr>, ResolveError>;

/// A UDP (and optionally TCP) nameserver on 127.0.0.1 that records what it receives.
struct FakeServer {
    addr: SocketAddr,
    /// Every datagram received, parsable or not.
    datagrams: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Every message received over TCP.
    tcp_queries: Arc<Mutex<Vec<Question>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl FakeServer {
    fn questions(&self) -> Vec<Question> {
        let datagrams = self.datagrams.lock().unwrap();
        datagrams.iter().filter_map(|d| wire::parse_query(d).ok()).collect()
    }

    fn datagram_count(&self) -> usize {
        self.datagrams.lock().unwrap().len()
    }
}

/// Starts a UDP server on 127.0.0.1 answering with `udp`, and a TCP server on the same port
/// with `tcp`.
async fn serve(
    udp: impl Fn(&Question, &[u8]) -> Vec<(From, Vec<u8>)> + Send + Sync + 'static,
    tcp: Option<TcpHandler>,
) -> FakeServer {
    serve_at("127.0.0.1:0".parse().unwrap(), Arc::new(udp), tcp).await
}

async fn serve_at(bind: SocketAddr, udp: Handler, tcp: Option<TcpHandler>) -> FakeServer {
    // The TCP listener must get the UDP socket's port; retry if that port is taken for TCP.
    let (socket, listener) = loop {
        let socket = UdpSocket::bind(bind).await.unwrap();
        if tcp.is_none() {
            break (socket, None);
        }
        if let Ok(l) = TcpListener::bind(socket.local_addr().unwrap()).await {
            break (socket, Some(l));
        }
    };
    let addr = socket.local_addr().unwrap();
    let spoofer = UdpSocket::bind(SocketAddr::new(bind.ip(), 0)).await.unwrap();
    let datagrams = Arc::new(Mutex::new(Vec::new()));
    let tcp_queries = Arc::new(Mutex::new(Vec::new()));

    let seen = Arc::clone(&datagrams);
    let mut tasks = vec![tokio::spawn(async move {
        let mut buf = vec![0u8; 65_535];
        loop {
            let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                return;
            };
            let raw = buf[..len].to_vec();
            seen.lock().unwrap().push(raw.clone());
            let Ok(q) = wire::parse_query(&raw) else {
                continue;
            };
            for (from, datagram) in udp(&q, &raw) {
                let sender = match from {
                    From::Server => &socket,
                    From::Spoofer => &spoofer,
                };
                let _ = sender.send_to(&datagram, peer).await;
            }
        }
    })];

    if let (Some(listener), Some(tcp)) = (listener, tcp) {
        let seen = Arc::clone(&tcp_queries);
        tasks.push(tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                let tcp = Arc::clone(&tcp);
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut len = [0u8; 2];
                    if stream.read_exact(&mut len).await.is_err() {
                        return;
                    }
                    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
                    if stream.read_exact(&mut msg).await.is_err() {
                        return;
                    }
                    let Ok(q) = wire::parse_query(&msg) else {
                        return;
                    };
                    seen.lock().unwrap().push(q.clone());
                    let reply = tcp(&q);
                    let mut framed = (reply.len() as u16).to_be_bytes().to_vec();
                    framed.extend_from_slice(&reply);
                    let _ = stream.write_all(&framed).await;
                });
            }
        }));
    }
    FakeServer { addr, datagrams, tcp_queries, tasks }
}

/// A UDP server that answers every question with `encode_answer(q, answers, 0, rcode)`.
async fn answering(answers: &[&str], rcode: u8) -> FakeServer {
    let answers = ips(answers);
    serve(move |q, _| vec![(From::Server, wire::encode_answer(q, &answers, 0, rcode))], None).await
}

/// A UDP server that receives and never answers.
async fn silent() -> FakeServer {
    serve(|_, _| vec![], None).await
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn resolver(servers: &[&FakeServer], attempt_ms: u64, attempts: u32) -> StubResolver {
    StubResolver::new(ResolverConfig {
        nameservers: servers.iter().map(|s| s.addr).collect(),
        attempt_timeout: Duration::from_millis(attempt_ms),
        attempts,
        overall_timeout: Duration::from_secs(5),
    })
}

fn response_to(q: &Question, answers: Vec<Record>) -> Response {
    Response {
        id: q.id,
        truncated: false,
        rcode: wire::RCODE_NOERROR,
        qname: q.name.clone(),
        qtype: q.qtype,
        answers,
    }
}

fn record(name: &str, data: RData) -> Record {
    Record { name: name.to_owned(), ttl: 60, data }
}

#[tokio::test]
async fn dns_resolves_a_then_aaaa_deduplicated_in_answer_order() {
    let server =
        answering(&["192.0.2.2", "2001:db8::1", "192.0.2.1", "192.0.2.2"], wire::RCODE_NOERROR).await;
    let got = resolver(&[&server], 2000, 2).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.2", "192.0.2.1", "2001:db8::1"]));

    let mut asked: Vec<(String, u16)> = server.questions().into_iter().map(|q| (q.name, q.qtype)).collect();
    asked.sort();
    assert_eq!(
        asked,
        vec![("www.example.com".to_owned(), TYPE_A), ("www.example.com".to_owned(), TYPE_AAAA)]
    );
    // Recursion desired, sent from an ephemeral port as a plain query.
    for d in server.datagrams.lock().unwrap().iter() {
        assert_eq!(d[2] & 0x81, 0x01, "RD set, QR clear");
    }
}

#[tokio::test]
async fn dns_follows_the_cname_chain_and_ignores_records_off_it() {
    let server = serve(
        |q, _| {
            let mut answers = vec![
                record("www.example.com", RData::Cname("cdn.example.net".into())),
                record("bank.example", RData::A("10.0.0.1".parse().unwrap())),
                record("cdn.example.net", RData::Cname("edge.example.net".into())),
            ];
            answers.push(match q.qtype {
                TYPE_A => record("edge.example.net", RData::A("192.0.2.10".parse().unwrap())),
                _ => record("edge.example.net", RData::Aaaa("2001:db8::10".parse().unwrap())),
            });
            let msg = wire::encode_response(&response_to(q, answers)).unwrap();
            vec![(From::Server, msg)]
        },
        None,
    )
    .await;
    let got = resolver(&[&server], 2000, 2).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.10", "2001:db8::10"]));
}

#[tokio::test]
async fn dns_ignores_datagrams_that_are_not_the_reply() {
    let server = serve(
        |q, raw| {
            let evil = ips(&["10.6.6.6", "fd00::666"]);
            let good = ips(&["192.0.2.1", "2001:db8::1"]);
            let wrong_id = Question { id: q.id ^ 0x0101, ..q.clone() };
            let other_name = Question { name: "evil.example".into(), ..q.clone() };
            let other_type =
                Question { qtype: if q.qtype == TYPE_A { TYPE_AAAA } else { TYPE_A }, ..q.clone() };
            vec![
                (From::Server, wire::encode_answer(&wrong_id, &evil, 0, 0)),
                (From::Server, raw.to_vec()),
                (From::Server, wire::encode_answer(&other_name, &evil, 0, 0)),
                (From::Server, wire::encode_answer(&other_type, &evil, 0, 0)),
                (From::Server, b"\xff\xff garbage".to_vec()),
                (From::Server, vec![]),
                (From::Spoofer, wire::encode_answer(q, &evil, 0, 0)),
                (From::Server, wire::encode_answer(q, &good, 0, 0)),
            ]
        },
        None,
    )
    .await;
    let got = resolver(&[&server], 2000, 1).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1", "2001:db8::1"]));
    // Each family was asked once: the junk did not cost an attempt.
    assert_eq!(server.datagram_count(), 2);
}

#[tokio::test]
async fn dns_reply_echoing_the_name_in_another_case_is_accepted() {
    let server = serve(
        |q, _| {
            let shouted = Question { name: q.name.to_ascii_uppercase(), ..q.clone() };
            let answers = ips(&["192.0.2.5"]);
            vec![(From::Server, wire::encode_answer(&shouted, &answers, 0, 0))]
        },
        None,
    )
    .await;
    let got = resolver(&[&server], 2000, 1).lookup("mixed.example").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.5"]));
}

#[tokio::test]
async fn dns_truncated_reply_is_asked_again_over_tcp() {
    let server = serve(
        |q, _| {
            // The truncated reply's partial answer must not be used.
            let mut partial =
                response_to(q, vec![record("big.example", RData::A("10.9.9.9".parse().unwrap()))]);
            partial.truncated = true;
            vec![(From::Server, wire::encode_response(&partial).unwrap())]
        },
        Some(Arc::new(|q| {
            let answers = ips(&["192.0.2.1", "192.0.2.2", "2001:db8::1"]);
            wire::encode_answer(q, &answers, 0, 0)
        })),
    )
    .await;
    let got = resolver(&[&server], 2000, 1).lookup("big.example").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1", "192.0.2.2", "2001:db8::1"]));
    let mut tcp: Vec<u16> = server.tcp_queries.lock().unwrap().iter().map(|q| q.qtype).collect();
    tcp.sort();
    assert_eq!(tcp, vec![TYPE_A, TYPE_AAAA]);
}

#[tokio::test]
async fn dns_nxdomain_is_no_such_name_and_final() {
    let first = answering(&[], wire::RCODE_NXDOMAIN).await;
    let second = answering(&["192.0.2.1"], wire::RCODE_NOERROR).await;
    let err = resolver(&[&first, &second], 2000, 2).lookup("gone.example").await.unwrap_err();
    assert!(matches!(&err, ResolveError::NoSuchName(n) if n == "gone.example"), "{err:?}");
    assert_eq!(second.datagram_count(), 0, "NXDOMAIN is not retried elsewhere");
}

#[tokio::test]
async fn dns_noerror_without_addresses_is_no_addresses() {
    let server = answering(&[], wire::RCODE_NOERROR).await;
    let err = resolver(&[&server], 2000, 2).lookup("mail-only.example").await.unwrap_err();
    assert!(matches!(&err, ResolveError::NoAddresses(n) if n == "mail-only.example"));
}

#[tokio::test]
async fn dns_silent_nameserver_times_out_after_every_attempt() {
    let server = silent().await;
    let started = std::time::Instant::now();
    let err = resolver(&[&server], 100, 2).lookup("slow.example").await.unwrap_err();
    let elapsed = started.elapsed();
    let ResolveError::Timeout { name, after } = &err else {
        panic!("expected a timeout, got {err:?}");
    };
    assert_eq!(name, "slow.example");
    assert!(*after >= Duration::from_millis(200), "{after:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    // Two attempts for each family, each a fresh query.
    assert_eq!(server.datagram_count(), 4);
}

#[tokio::test]
async fn dns_overall_deadline_cuts_the_attempts_short() {
    let server = silent().await;
    let mut cfg = resolver(&[&server], 2000, 5).cfg;
    cfg.overall_timeout = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let err = StubResolver::new(cfg).lookup("slow.example").await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(matches!(err, ResolveError::Timeout { .. }), "{err:?}");
    assert!(elapsed >= Duration::from_millis(300), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
}

#[tokio::test]
async fn dns_servfail_moves_on_to_the_next_nameserver() {
    let failing = answering(&[], wire::RCODE_SERVFAIL).await;
    let working = answering(&["192.0.2.1"], wire::RCODE_NOERROR).await;
    let got = resolver(&[&failing, &working], 2000, 1).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1"]));
    assert_eq!(failing.datagram_count(), 2);
    assert_eq!(working.datagram_count(), 2);
}

#[tokio::test]
async fn dns_refused_everywhere_is_a_server_failure() {
    let first = answering(&[], wire::RCODE_REFUSED).await;
    let second = answering(&[], wire::RCODE_REFUSED).await;
    let err = resolver(&[&first, &second], 2000, 2).lookup("www.example.com").await.unwrap_err();
    match err {
        ResolveError::ServerFailure { name, server, rcode } => {
            assert_eq!(name, "www.example.com");
            assert_eq!(server, second.addr);
            assert_eq!(rcode, wire::RCODE_REFUSED);
        }
        other => panic!("expected ServerFailure, got {other:?}"),
    }
    // Two rounds over both servers, for each family.
    assert_eq!(first.datagram_count(), 4);
    assert_eq!(second.datagram_count(), 4);
}

#[tokio::test]
async fn dns_broken_reply_moves_on_and_is_reported_if_nothing_better_comes() {
    // Our ID and question, then an A record with five bytes of data.
    fn broken(q: &Question, _: &[u8]) -> Vec<(From, Vec<u8>)> {
        let answers = ips(&["192.0.2.1"]);
        let mut msg = wire::encode_answer(q, &answers, 0, 0);
        if q.qtype == TYPE_A {
            let n = msg.len();
            msg[n - 5] = 5; // rdlength 4 -> 5 (and the message one byte short)
            msg.push(0);
        }
        vec![(From::Server, msg)]
    }
    let bad = serve(broken, None).await;
    let good = answering(&["192.0.2.2"], wire::RCODE_NOERROR).await;
    let got = resolver(&[&bad, &good], 2000, 1).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.2"]));

    let err = resolver(&[&bad], 2000, 1).lookup("www.example.com").await.unwrap_err();
    assert!(matches!(&err, ResolveError::Malformed(s, _) if *s == bad.addr), "{err:?}");
}

#[tokio::test]
async fn dns_unreachable_nameserver_fails_over_without_waiting() {
    // A port nothing listens on: the kernel answers with ICMP port unreachable.
    let closed = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let working = answering(&["192.0.2.1"], wire::RCODE_NOERROR).await;
    let resolver = StubResolver::new(ResolverConfig {
        nameservers: vec![closed_addr, working.addr],
        attempt_timeout: Duration::from_secs(3),
        attempts: 1,
        overall_timeout: Duration::from_secs(5),
    });
    let started = std::time::Instant::now();
    let got = resolver.lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1"]));
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());

    let only_closed = StubResolver::new(ResolverConfig::with_nameservers(vec![closed_addr]));
    let err = only_closed.lookup("www.example.com").await.unwrap_err();
    assert!(matches!(&err, ResolveError::Nameserver { server, .. } if *server == closed_addr), "{err:?}");
}

#[tokio::test]
async fn dns_one_silent_family_does_not_hide_the_other() {
    let server = serve(
        |q, _| {
            if q.qtype == TYPE_A {
                let answers = ips(&["192.0.2.1"]);
                vec![(From::Server, wire::encode_answer(q, &answers, 0, 0))]
            } else {
                vec![]
            }
        },
        None,
    )
    .await;
    let got = resolver(&[&server], 100, 1).lookup("v4only.example").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1"]));
}

#[tokio::test]
async fn dns_name_dns_cannot_carry_sends_no_packet() {
    let server = answering(&["192.0.2.1"], wire::RCODE_NOERROR).await;
    let resolver = resolver(&[&server], 2000, 2);
    let long_label = format!("{}.example", "a".repeat(64));
    let long_name = vec!["a".repeat(50); 6].join(".");
    for name in [long_label.as_str(), long_name.as_str(), "a..b", ""] {
        let err = resolver.lookup(name).await.unwrap_err();
        assert!(matches!(&err, ResolveError::InvalidName { name: n, .. } if n == name), "{name:?}: {err:?}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.datagram_count(), 0);
}

#[tokio::test]
async fn dns_ipv6_nameserver() {
    let loopback: SocketAddr = "[::1]:0".parse().unwrap();
    if let Err(e) = std::net::UdpSocket::bind(loopback) {
        eprintln!("SKIPPED dns_ipv6_nameserver: this host cannot bind [::1] ({e})");
        return;
    }
    let answers = ips(&["192.0.2.1", "2001:db8::1"]);
    let udp: Handler = Arc::new(move |q, _| vec![(From::Server, wire::encode_answer(q, &answers, 0, 0))]);
    let server = serve_at(loopback, udp, None).await;
    let got = resolver(&[&server], 2000, 1).lookup("www.example.com").await.unwrap();
    assert_eq!(got, ips(&["192.0.2.1", "2001:db8::1"]));
}

#[test]
fn dns_stub_resolver_is_usable_as_a_trait_object() {
    let resolver: Arc<dyn Resolve> =
        Arc::new(StubResolver::new(ResolverConfig::with_nameservers(vec!["192.0.2.53:53".parse().unwrap()])));
    assert!(format!("{resolver:?}").contains("192.0.2.53"));
}

#[tokio::test]
async fn dns_no_nameservers_is_an_error() {
    let resolver = StubResolver::new(ResolverConfig::with_nameservers(vec![]));
    let err = resolver.lookup("www.example.com").await.unwrap_err();
    assert!(matches!(err, ResolveError::NoNameservers), "{err:?}");
}

#[test]
fn dns_combine_table() {
    fn nx() -> Family {
        Err(ResolveError::NoSuchName("n".into()))
    }
    fn timeout() -> Family {
        Err(ResolveError::Timeout { name: "n".into(), after: Duration::from_secs(1) })
    }
    fn servfail() -> Family {
        Err(ResolveError::ServerFailure {
            name: "n".into(),
            server: "127.0.0.1:53".parse().unwrap(),
            rcode: 2,
        })
    }
    fn ok(list: &[&str]) -> Family {
        Ok(ips(list))
    }
    let cases: Vec<(&str, Family, Family, &str)> = vec![
        ("both", ok(&["192.0.2.1"]), ok(&["2001:db8::1"]), "[192.0.2.1, 2001:db8::1]"),
        ("v4 duplicates dropped", ok(&["192.0.2.1", "192.0.2.1"]), ok(&[]), "[192.0.2.1]"),
        ("only v6", ok(&[]), ok(&["2001:db8::1"]), "[2001:db8::1]"),
        ("v6 timed out", ok(&["192.0.2.1"]), timeout(), "[192.0.2.1]"),
        ("v4 failed", servfail(), ok(&["2001:db8::1"]), "[2001:db8::1]"),
        ("neither has addresses", ok(&[]), ok(&[]), "NoAddresses"),
        ("nx on v4", nx(), ok(&[]), "NoSuchName"),
        ("nx on v6 beats a v4 timeout", timeout(), nx(), "NoSuchName"),
        ("v4 error first", timeout(), servfail(), "Timeout"),
        ("v6 error when v4 is empty", ok(&[]), servfail(), "ServerFailure"),
    ];
    for (what, v4, v6, want) in cases {
        let got = match combine("n", v4, v6) {
            Ok(list) => format!("{list:?}"),
            Err(e) => format!("{e:?}"),
        };
        assert!(got.starts_with(want), "{what}: {got}");
    }
}

#[test]
fn dns_interpret_table() {
    let base = Response {
        id: 1,
        truncated: false,
        rcode: 0,
        qname: "q.example".into(),
        qtype: TYPE_A,
        answers: vec![record("q.example", RData::A("192.0.2.1".parse().unwrap()))],
    };
    let with_rcode = |rcode| Response { rcode, ..base.clone() };
    let looping =
        Response { answers: vec![record("q.example", RData::Cname("q.example".into()))], ..base.clone() };
    let cases = vec![
        (base.clone(), Ok(Outcome::Addresses(ips(&["192.0.2.1"]), 60))),
        (with_rcode(wire::RCODE_NXDOMAIN), Ok(Outcome::NoSuchName)),
        (with_rcode(wire::RCODE_SERVFAIL), Ok(Outcome::Failure(2))),
        (with_rcode(wire::RCODE_REFUSED), Ok(Outcome::Failure(5))),
        (with_rcode(wire::RCODE_FORMERR), Ok(Outcome::Failure(1))),
        (looping, Err(wire::WireError::CnameLoop { name: "q.example".into(), at: "q.example".into() })),
    ];
    for (response, want) in cases {
        assert_eq!(interpret(&response), want, "{response:?}");
    }
}

#[test]
fn dns_config_from_conf_table() {
    let ns = |s: &str| SocketAddr::new(s.parse().unwrap(), 53);
    struct Case {
        text: &'static str,
        nameservers: Vec<SocketAddr>,
        attempt_timeout: Duration,
        attempts: u32,
    }
    let cases = [
        Case {
            text: "",
            nameservers: vec![ns("127.0.0.1")],
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            attempts: DEFAULT_ATTEMPTS,
        },
        Case {
            text: "nameserver 2001:db8::53\nnameserver 192.0.2.53\noptions timeout:1 attempts:3",
            nameservers: vec![ns("2001:db8::53"), ns("192.0.2.53")],
            attempt_timeout: Duration::from_secs(1),
            attempts: 3,
        },
        Case {
            text: "nameserver 192.0.2.53\noptions timeout:30 attempts:9",
            nameservers: vec![ns("192.0.2.53")],
            attempt_timeout: MAX_ATTEMPT_TIMEOUT,
            attempts: MAX_ATTEMPTS,
        },
        Case {
            text: "nameserver fe80::1%eth0\noptions timeout:0 attempts:0",
            nameservers: vec![ns("127.0.0.1")],
            attempt_timeout: Duration::from_secs(1),
            attempts: 1,
        },
    ];
    for c in cases {
        let cfg = ResolverConfig::from_conf(&conf::parse(c.text));
        assert_eq!(cfg.nameservers, c.nameservers, "{:?}", c.text);
        assert_eq!(cfg.attempt_timeout, c.attempt_timeout, "{:?}", c.text);
        assert_eq!(cfg.attempts, c.attempts, "{:?}", c.text);
        assert_eq!(cfg.overall_timeout, DEFAULT_OVERALL_TIMEOUT, "{:?}", c.text);
    }
}

#[test]
fn dns_config_from_resolv_conf_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resolv.conf");
    std::fs::write(&path, b"nameserver 192.0.2.53\noptions attempts:4\n").unwrap();
    let cfg = ResolverConfig::from_resolv_conf(&path).unwrap();
    assert_eq!(cfg.nameservers, vec!["192.0.2.53:53".parse().unwrap()]);
    assert_eq!(cfg.attempts, 4);

    let missing = dir.path().join("absent.conf");
    let err = ResolverConfig::from_resolv_conf(&missing).unwrap_err();
    assert!(matches!(&err, ResolveError::Config { path, .. } if *path == missing));
    assert!(err.to_string().contains("absent.conf"), "{err}");
}

#[test]
fn dns_with_nameservers_uses_the_defaults() {
    let ns: SocketAddr = "192.0.2.53:53".parse().unwrap();
    let cfg = ResolverConfig::with_nameservers(vec![ns]);
    assert_eq!(
        cfg,
        ResolverConfig {
            nameservers: vec![ns],
            attempt_timeout: Duration::from_secs(2),
            attempts: 2,
            overall_timeout: Duration::from_secs(5),
        }
    );
}

/// A server answering A with `ttl`.
async fn answering_with_ttl(answer: &str, ttl: u32) -> FakeServer {
    let answers = ips(&[answer]);
    serve(move |q, _| vec![(From::Server, wire::encode_answer(q, &answers, ttl, 0))], None).await
}

#[tokio::test]
async fn answers_are_cached_for_their_ttl_and_ttl_zero_is_asked_every_time() {
    let cached = answering_with_ttl("192.0.2.7", 60).await;
    let r = resolver(&[&cached], 500, 1);
    for _ in 0..3 {
        assert_eq!(r.lookup("cached.example").await.unwrap(), ips(&["192.0.2.7"]));
    }
    // One A and one AAAA query, then the cache.
    assert_eq!(cached.datagram_count(), 2);

    let rebinding = answering_with_ttl("192.0.2.8", 0).await;
    let r = resolver(&[&rebinding], 500, 1);
    for _ in 0..3 {
        r.lookup("rebinding.example").await.unwrap();
    }
    assert_eq!(rebinding.datagram_count(), 6, "TTL 0: asked on every lookup");
}

#[tokio::test]
async fn localhost_names_are_loopback_without_a_query() {
    let server = silent().await;
    let r = resolver(&[&server], 100, 1);
    for name in ["localhost", "selftest.localhost", "a.b.LOCALHOST"] {
        assert_eq!(r.lookup(name).await.unwrap(), ips(&["127.0.0.1", "::1"]), "{name}");
    }
    assert!(r.lookup("notlocalhost").await.is_err());
    assert_eq!(server.datagram_count(), 2, "only notlocalhost was asked (A and AAAA)");
}
