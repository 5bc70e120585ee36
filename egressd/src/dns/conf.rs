//! Reading `resolv.conf(5)`: the nameservers and the two timing options, nothing else.
//!
//! `search`, `domain`, `sortlist` and every other option are ignored on purpose: egressd sends
//! fully qualified names only and vets every address itself. Like glibc, a line egressd cannot
//! use is skipped rather than fatal (the file is usually written by a DHCP client or
//! systemd-resolved, not by the operator), but each skipped line is reported as a [`ConfError`]
//! so the caller can log it; nothing is skipped silently.

use std::net::{IpAddr, SocketAddr};

/// The DNS port; `resolv.conf` has no syntax for another.
pub const DNS_PORT: u16 = 53;
/// glibc's MAXNS: further `nameserver` lines are ignored, and egressd does the same so both
/// resolvers on a host ask the same servers.
pub const MAX_NAMESERVERS: usize = 3;

/// What `resolv.conf` says, before defaults and caps are applied
/// ([`ResolverConfig::from_conf`](super::ResolverConfig::from_conf) does that).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvConf {
    /// In file order, port 53, at most [`MAX_NAMESERVERS`].
    pub nameservers: Vec<SocketAddr>,
    /// `options timeout:N`, seconds per attempt; the last one in the file wins.
    pub timeout_secs: Option<u32>,
    /// `options attempts:N`, rounds over the nameservers; the last one in the file wins.
    pub attempts: Option<u32>,
    /// Lines that were skipped, for the log.
    pub problems: Vec<ConfError>,
}

/// A `resolv.conf` line egressd skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfError {
    #[error("line {line}: `nameserver` without an address; the line is ignored")]
    MissingAddress { line: usize },
    #[error("line {line}: nameserver {value:?} is not an IPv4 or IPv6 address; the line is ignored")]
    BadAddress { line: usize, value: String },
    #[error(
        "line {line}: nameserver {value:?} has a `%scope` zone, which egressd does not support; \
         the line is ignored (use a global or loopback address)"
    )]
    Scoped { line: usize, value: String },
    #[error("line {line}: more than 3 nameservers; {value} is ignored, as glibc ignores it")]
    TooManyNameservers { line: usize, value: String },
    #[error("line {line}: option {option:?} needs a whole number; the option is ignored")]
    BadOption { line: usize, option: String },
}

/// Parses the text of a `resolv.conf`. Pure: reading the file is the caller's business.
///
/// Comments start with `#` or `;` anywhere on a line. Keywords and options are the glibc ones;
/// unknown ones are ignored without a report, as glibc does, since files carry options for
/// other resolvers.
pub fn parse(text: &str) -> ResolvConf {
    let mut conf = ResolvConf::default();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let content = raw.split(['#', ';']).next().unwrap_or("");
        let mut words = content.split_whitespace();
        match words.next() {
            Some("nameserver") => nameserver(&mut conf, line, words.next()),
            Some("options") => {
                for option in words {
                    apply_option(&mut conf, line, option);
                }
            }
            _ => {}
        }
    }
    conf
}

fn nameserver(conf: &mut ResolvConf, line: usize, value: Option<&str>) {
    let Some(value) = value else {
        conf.problems.push(ConfError::MissingAddress { line });
        return;
    };
    if value.contains('%') {
        conf.problems.push(ConfError::Scoped { line, value: value.to_owned() });
        return;
    }
    let Ok(ip) = value.parse::<IpAddr>() else {
        conf.problems.push(ConfError::BadAddress { line, value: value.to_owned() });
        return;
    };
    if conf.nameservers.len() >= MAX_NAMESERVERS {
        conf.problems.push(ConfError::TooManyNameservers { line, value: value.to_owned() });
        return;
    }
    conf.nameservers.push(SocketAddr::new(ip, DNS_PORT));
}

fn apply_option(conf: &mut ResolvConf, line: usize, option: &str) {
    let (slot, value) = if let Some(v) = option.strip_prefix("timeout:") {
        (&mut conf.timeout_secs, v)
    } else if let Some(v) = option.strip_prefix("attempts:") {
        (&mut conf.attempts, v)
    } else {
        return;
    };
    match value.parse::<u32>() {
        Ok(n) => *slot = Some(n),
        Err(_) => conf.problems.push(ConfError::BadOption { line, option: option.to_owned() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(s: &str) -> SocketAddr {
        SocketAddr::new(s.parse().unwrap(), 53)
    }

    #[test]
    fn dns_conf_parse_table() {
        struct Case {
            text: &'static str,
            nameservers: Vec<SocketAddr>,
            timeout: Option<u32>,
            attempts: Option<u32>,
            problems: Vec<ConfError>,
        }
        let case = |text, nameservers, timeout, attempts, problems| Case {
            text,
            nameservers,
            timeout,
            attempts,
            problems,
        };
        let cases = vec![
            case("", vec![], None, None, vec![]),
            case(
                "# generated\nnameserver 10.0.0.2\nnameserver 2001:db8::53\n",
                vec![ns("10.0.0.2"), ns("2001:db8::53")],
                None,
                None,
                vec![],
            ),
            case(
                "  nameserver\t192.0.2.1   # trailing comment\n; nameserver 192.0.2.9\n",
                vec![ns("192.0.2.1")],
                None,
                None,
                vec![],
            ),
            case(
                "nameserver 192.0.2.1;comment\nnameserver ::1\n",
                vec![ns("192.0.2.1"), ns("::1")],
                None,
                None,
                vec![],
            ),
            case(
                "search corp.example\ndomain corp.example\nsortlist 10.0.0.0\n\
                 options ndots:5 rotate edns0 timeout:3 attempts:4\n",
                vec![],
                Some(3),
                Some(4),
                vec![],
            ),
            case("options timeout:1\noptions timeout:7\n", vec![], Some(7), None, vec![]),
            case(
                "options timeout:x attempts:-1\n",
                vec![],
                None,
                None,
                vec![
                    ConfError::BadOption { line: 1, option: "timeout:x".into() },
                    ConfError::BadOption { line: 1, option: "attempts:-1".into() },
                ],
            ),
            case(
                "nameserver\nnameserver dns.example\nnameserver 0x7f.1\nnameserver 127.1\n",
                vec![],
                None,
                None,
                vec![
                    ConfError::MissingAddress { line: 1 },
                    ConfError::BadAddress { line: 2, value: "dns.example".into() },
                    ConfError::BadAddress { line: 3, value: "0x7f.1".into() },
                    ConfError::BadAddress { line: 4, value: "127.1".into() },
                ],
            ),
            case(
                "nameserver fe80::1%eth0\nnameserver 192.0.2.1\n",
                vec![ns("192.0.2.1")],
                None,
                None,
                vec![ConfError::Scoped { line: 1, value: "fe80::1%eth0".into() }],
            ),
            case(
                "nameserver 192.0.2.1\nnameserver 192.0.2.2\nnameserver 192.0.2.3\n\
                 nameserver 192.0.2.4\n",
                vec![ns("192.0.2.1"), ns("192.0.2.2"), ns("192.0.2.3")],
                None,
                None,
                vec![ConfError::TooManyNameservers { line: 4, value: "192.0.2.4".into() }],
            ),
            case("nameservers 192.0.2.1\nNAMESERVER 192.0.2.2\n", vec![], None, None, vec![]),
        ];
        for c in cases {
            let got = parse(c.text);
            assert_eq!(got.nameservers, c.nameservers, "{:?}", c.text);
            assert_eq!(got.timeout_secs, c.timeout, "{:?}", c.text);
            assert_eq!(got.attempts, c.attempts, "{:?}", c.text);
            assert_eq!(got.problems, c.problems, "{:?}", c.text);
        }
    }
}
