use super::*;

use crate::dns::ResolveError;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn dns_hosts_parse_table() {
    struct Case {
        text: &'static str,
        entries: Vec<(&'static str, Vec<&'static str>)>,
        problems: Vec<HostsProblem>,
    }
    let bad = |line: usize, value: &str| HostsProblem::BadAddress { line, value: value.into() };
    let cases = vec![
        Case { text: "", entries: vec![], problems: vec![] },
        Case {
            text: "# comment\n127.0.0.1\tlocalhost\n::1 localhost ip6-localhost ip6-loopback\n",
            entries: vec![
                ("localhost", vec!["127.0.0.1", "::1"]),
                ("ip6-localhost", vec!["::1"]),
                ("ip6-loopback", vec!["::1"]),
            ],
            problems: vec![],
        },
        Case {
            text: "  10.1.2.3   Mirror.Corp.Example.  alias # trailing comment\n",
            entries: vec![("mirror.corp.example", vec!["10.1.2.3"]), ("alias", vec!["10.1.2.3"])],
            problems: vec![],
        },
        // inet_aton spellings, a short form, a decimal, out-of-range octets: never taken.
        Case {
            text: "0x7f.0.0.1 a.test\n0177.0.0.1 b.test\n127.1 c.test\n2130706433 d.test\n\
                   127.0.0.256 e.test\n127.0.0.01 f.test\n1.2.3.4.5 g.test\n+1.2.3.4 h.test\n",
            entries: vec![],
            problems: vec![
                bad(1, "0x7f.0.0.1"),
                bad(2, "0177.0.0.1"),
                bad(3, "127.1"),
                bad(4, "2130706433"),
                bad(5, "127.0.0.256"),
                bad(6, "127.0.0.01"),
                bad(7, "1.2.3.4.5"),
                bad(8, "+1.2.3.4"),
            ],
        },
        Case {
            text: "fe80::1%eth0 scoped.test\n::ffff:127.0.0.1 mapped.test\n2001:db8::zz x.test\n",
            entries: vec![("mapped.test", vec!["::ffff:127.0.0.1"])],
            problems: vec![
                HostsProblem::Scoped { line: 1, value: "fe80::1%eth0".into() },
                bad(3, "2001:db8::zz"),
            ],
        },
        Case {
            text: "192.0.2.1\n192.0.2.2 ok.test bad..name -lead.test under_score.test\n",
            entries: vec![("ok.test", vec!["192.0.2.2"]), ("under_score.test", vec!["192.0.2.2"])],
            problems: vec![
                HostsProblem::NoName { line: 1 },
                HostsProblem::BadName { line: 2, value: "bad..name".into() },
                HostsProblem::BadName { line: 2, value: "-lead.test".into() },
            ],
        },
        // All lines for a name, in file order, without duplicates.
        Case {
            text: "192.0.2.1 multi.test\n2001:db8::1 multi.test\n192.0.2.1 multi.test\n",
            entries: vec![("multi.test", vec!["192.0.2.1", "2001:db8::1"])],
            problems: vec![],
        },
    ];
    for c in cases {
        let got = parse(c.text);
        let want: HashMap<String, Vec<IpAddr>> =
            c.entries.iter().map(|(n, ips)| (n.to_string(), ips.iter().map(|s| ip(s)).collect())).collect();
        assert_eq!(got.entries, want, "{:?}", c.text);
        assert_eq!(got.problems, c.problems, "{:?}", c.text);
    }
}

#[test]
fn dns_hosts_canonical_ipv4_agrees_with_std_on_canonical_spellings() {
    for s in ["0.0.0.0", "255.255.255.255", "10.0.0.1", "100.64.0.1"] {
        assert_eq!(canonical_ipv4(s), s.parse().ok(), "{s}");
    }
    for s in ["", "1.2.3", "1..2.3", "01.2.3.4", "1.2.3.4.", " 1.2.3.4", "1.2.3.1000"] {
        assert_eq!(canonical_ipv4(s), None, "{s}");
    }
}

#[test]
fn dns_hosts_lookup_ignores_case_and_a_trailing_dot() {
    let table = parse("192.0.2.7 Name.Test\n");
    assert_eq!(table.get("NAME.test."), Some(&[ip("192.0.2.7")][..]));
    assert_eq!(table.get("other.test"), None);
}

/// Answers every name with 192.0.2.53, counting the questions.
#[derive(Debug, Default)]
struct Dns(std::sync::atomic::AtomicUsize);

impl Resolve for Dns {
    fn lookup<'a>(&'a self, _name: &'a str) -> LookupFuture<'a> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async { Ok::<_, ResolveError>(vec![ip("192.0.2.53")]) })
    }
}

#[tokio::test]
async fn dns_hosts_entries_win_over_dns_and_changes_are_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hosts");
    std::fs::write(&path, "127.0.0.1 mirror.corp.test\n0x7f.1 sneaky.test\n").unwrap();
    let resolver = HostsResolver::new(path.clone(), Dns::default());
    assert_eq!(resolver.lookup("mirror.corp.test").await.unwrap(), [ip("127.0.0.1")]);
    // The malformed line's name is asked of DNS.
    assert_eq!(resolver.lookup("sneaky.test").await.unwrap(), [ip("192.0.2.53")]);
    assert_eq!(resolver.inner.0.load(std::sync::atomic::Ordering::SeqCst), 1);

    // Rewritten in place (same inode, another size): reread.
    std::fs::write(&path, "::1 mirror.corp.test\n").unwrap();
    assert_eq!(resolver.lookup("mirror.corp.test").await.unwrap(), [ip("::1")]);
    // Replaced by rename: reread.
    let next = dir.path().join("hosts.new");
    std::fs::write(&next, "192.0.2.9 mirror.corp.test\n").unwrap();
    std::fs::rename(&next, &path).unwrap();
    assert_eq!(resolver.lookup("mirror.corp.test").await.unwrap(), [ip("192.0.2.9")]);
    // Gone: DNS answers.
    std::fs::remove_file(&path).unwrap();
    assert_eq!(resolver.lookup("mirror.corp.test").await.unwrap(), [ip("192.0.2.53")]);
}
