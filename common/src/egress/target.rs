//! Parsing the proxy request target: the CONNECT authority or the absolute-form URL.
//!
//! The gateway decides on the target's authority and never on a `Host` header (a client can
//! send `GET http://evil.com/` with `Host: allowed.example.com`). Everything here is strict
//! on purpose: a spelling that two parsers could read differently is refused (400), so the
//! name we check is the name we resolve and the address we vet is the address we dial.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The longest DNS name in text form, without the trailing dot (RFC 1035 §2.3.4).
pub const MAX_NAME_BYTES: usize = 253;
/// The longest DNS label (RFC 1035 §2.3.4).
pub const MAX_LABEL_BYTES: usize = 63;

/// Default port of a CONNECT target without one (the original's rule).
pub const CONNECT_DEFAULT_PORT: u16 = 443;
/// Default port of an `http://` URL without one.
pub const HTTP_DEFAULT_PORT: u16 = 80;

/// The host of a request target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// A normalised domain name (see [`normalize_host`]).
    Name(String),
    /// An IP literal: a strict dotted quad, or an IPv6 address in brackets (kept as parsed;
    /// [`super::address::classify`] canonicalises).
    Ip(IpAddr),
    /// A spelling that some resolver would read as an IPv4 address (`127.1`, `0x7f.1`,
    /// `0177.0.0.1`, `2130706433`): the last label is a number (WHATWG "ends in a number").
    /// getaddrinfo accepts inet_aton spellings, so such a "name" is an IP literal in disguise:
    /// never resolve it and never match it against domain entries.
    NumericName(String),
}

/// Where a proxy request wants to go.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub host: Host,
    pub port: u16,
}

impl Target {
    /// The host for messages: the name, or the IP (IPv6 without brackets).
    pub fn host_text(&self) -> String {
        match &self.host {
            Host::Name(name) | Host::NumericName(name) => name.clone(),
            Host::Ip(ip) => ip.to_string(),
        }
    }
}

/// `host:port`, with IPv6 in brackets: the authority to send upstream and to log.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            _ => write!(f, "{}:{}", self.host_text(), self.port),
        }
    }
}

/// Why a request target was refused (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("Sandbox network access expects absolute-form proxy requests")]
    NotAbsolute,
    /// The URL scheme, lower-cased, without the colon.
    #[error("Sandbox network access cannot forward {0}: without CONNECT")]
    Scheme(String),
    #[error("the port {0:?} is not a decimal number from 1 to 65535")]
    BadPort(String),
    #[error(
        "the host {0:?} is not a valid host name: only letters, digits, '-', '_' and '.' are \
         allowed, and IPv6 addresses must be in brackets"
    )]
    BadHost(String),
    #[error("the request target names no host")]
    EmptyHost,
    #[error("the host {0:?} contains non-ASCII characters; send internationalised names in their xn-- form")]
    NonAscii(String),
    #[error("the host {0:?} contains '%': percent-encoded names and IPv6 zone ids are not accepted")]
    Percent(String),
    #[error("the host {0:?} has an empty label")]
    EmptyLabel(String),
    #[error("the host {0:?} has a label over {MAX_LABEL_BYTES} bytes")]
    LabelTooLong(String),
    #[error("the host {0:?} is over {MAX_NAME_BYTES} bytes")]
    NameTooLong(String),
    #[error("the bracketed host {0:?} is not an IPv6 address")]
    BadIpv6(String),
    #[error("the CONNECT target {0:?} carries user information ('@'); send host:port only")]
    Userinfo(String),
    #[error("the CONNECT target {0:?} is not host:port: it has a path, query, fragment or whitespace")]
    NotAuthority(String),
}

/// CONNECT authority `host:port` or `[v6]:port`; a missing port means 443.
///
/// An empty, 0, over-65535 or non-numeric port, userinfo (`@`), a path, query or fragment,
/// a zone id or any `%`, and whitespace are refused: the original answers 400 to the port
/// cases, and the rest are spellings that a resolver or an upstream proxy could read as
/// another host.
pub fn parse_connect_authority(authority: &str) -> Result<Target, TargetError> {
    if authority.contains('@') {
        return Err(TargetError::Userinfo(authority.to_owned()));
    }
    if authority.chars().any(|c| matches!(c, '/' | '?' | '#' | '\\') || c.is_whitespace() || c.is_control()) {
        return Err(TargetError::NotAuthority(authority.to_owned()));
    }
    parse_host_port(authority, CONNECT_DEFAULT_PORT, EmptyPort::Refuse)
}

/// Absolute-form `http://host[:port]/path?q` (scheme case-insensitive): the target (default
/// port 80) and the origin-form request target to send when dialling directly (`/` when
/// empty; the fragment dropped).
///
/// Userinfo is parsed and dropped: the host is what follows the *last* `@` in the authority,
/// as in WHATWG, so `http://allowed.example.com@evil.com/` targets evil.com. Other schemes are
/// [`TargetError::Scheme`]; origin-form (`/x`) or an unparsable URL is
/// [`TargetError::NotAbsolute`].
///
/// Stricter than WHATWG where parsers disagree: a `\` in the authority, `http:/x`, and any
/// whitespace, control or non-ASCII byte are refused rather than repaired. An empty port
/// (`http://host:/`) means the default, as in RFC 3986 and the original.
pub fn parse_absolute_url(url: &str) -> Result<(Target, String), TargetError> {
    let (scheme, rest) = url.split_once(':').ok_or(TargetError::NotAbsolute)?;
    if !is_scheme(scheme) {
        return Err(TargetError::NotAbsolute);
    }
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" {
        return Err(TargetError::Scheme(scheme));
    }
    let rest = rest.strip_prefix("//").ok_or(TargetError::NotAbsolute)?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if authority.contains('\\') {
        return Err(TargetError::BadHost(authority.to_owned()));
    }
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let target = parse_host_port(host_port, HTTP_DEFAULT_PORT, EmptyPort::Default)?;

    let tail = tail.split_once('#').map_or(tail, |(t, _)| t);
    if !tail.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TargetError::NotAbsolute);
    }
    let origin_form = match tail.as_bytes().first() {
        None => "/".to_owned(),
        Some(b'?') => format!("/{tail}"),
        Some(_) => tail.to_owned(),
    };
    Ok((target, origin_form))
}

/// Lower-cases and strips one trailing dot; refuses non-ASCII (no IDNA: look-alike letters
/// and full-width dots never reach the resolver), `%`, empty labels, characters outside
/// `[a-z0-9-._]`, labels over 63 bytes and names over 253 bytes.
///
/// Underscores are allowed: real host names carry them (service records, some CDN and
/// cloud names), the original passed them, and refusing them would break such hosts with
/// no security gain. An exact allowlist entry never contains one; a `*.x` entry may match a
/// name with an underscore below `x`, which is still inside the subtree the entry grants.
/// Labels over 63 bytes are refused too: DNS cannot carry them.
pub fn normalize_host(host: &str) -> Result<String, TargetError> {
    if !host.is_ascii() {
        return Err(TargetError::NonAscii(host.to_owned()));
    }
    if host.contains('%') {
        return Err(TargetError::Percent(host.to_owned()));
    }
    let lower = host.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_'))
    {
        return Err(TargetError::BadHost(host.to_owned()));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(TargetError::NameTooLong(host.to_owned()));
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err(TargetError::EmptyLabel(host.to_owned()));
        }
        if label.len() > MAX_LABEL_BYTES {
            return Err(TargetError::LabelTooLong(host.to_owned()));
        }
    }
    Ok(name.to_owned())
}

/// WHATWG "ends in a number": the last label is all decimal digits or `0x`/`0X` hex, so a
/// URL parser (and getaddrinfo's inet_aton) reads the whole name as an IPv4 address.
pub fn ends_in_number(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    let last = name.rsplit('.').next().unwrap_or("");
    if !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    match last.strip_prefix("0x").or_else(|| last.strip_prefix("0X")) {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => false,
    }
}

/// Classifies a host text (no brackets, no port) as an IPv4 literal, a numeric spelling of
/// one, or a normalised name.
pub fn classify_host(text: &str) -> Result<Host, TargetError> {
    let name = normalize_host(text)?;
    if let Ok(v4) = name.parse::<Ipv4Addr>() {
        return Ok(Host::Ip(IpAddr::V4(v4)));
    }
    if ends_in_number(&name) {
        return Ok(Host::NumericName(name));
    }
    Ok(Host::Name(name))
}

/// What an empty port after `:` means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EmptyPort {
    /// CONNECT `host:` is malformed (the original answers 400).
    Refuse,
    /// `http://host:/` means the default port (RFC 3986, WHATWG).
    Default,
}

/// `host[:port]` or `[v6][:port]`.
pub(super) fn parse_host_port(
    text: &str,
    default_port: u16,
    empty: EmptyPort,
) -> Result<Target, TargetError> {
    if text.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    if text.contains('%') {
        return Err(TargetError::Percent(text.to_owned()));
    }
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or_else(|| TargetError::BadIpv6(text.to_owned()))?;
        let ip: Ipv6Addr = inside.parse().map_err(|_| TargetError::BadIpv6(text.to_owned()))?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| TargetError::BadHost(text.to_owned()))?),
        };
        (Host::Ip(IpAddr::V6(ip)), port)
    } else {
        let (host, port) = match text.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        };
        if host.contains([':', '[', ']']) {
            return Err(TargetError::BadHost(host.to_owned()));
        }
        if host.is_empty() {
            return Err(TargetError::EmptyHost);
        }
        (classify_host(host)?, port)
    };
    let port = match port {
        None => default_port,
        Some("") if empty == EmptyPort::Default => default_port,
        Some(p) => parse_port(p)?,
    };
    Ok(Target { host, port })
}

/// Decimal digits only (no sign, no service names), 1–65535.
pub fn parse_port(text: &str) -> Result<u16, TargetError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TargetError::BadPort(text.to_owned()));
    }
    match text.parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(TargetError::BadPort(text.to_owned())),
    }
}

/// RFC 3986 `scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )`.
fn is_scheme(text: &str) -> bool {
    let mut bytes = text.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Host {
        Host::Name(s.to_owned())
    }
    fn ip(s: &str) -> Host {
        Host::Ip(s.parse().unwrap())
    }
    fn numeric(s: &str) -> Host {
        Host::NumericName(s.to_owned())
    }

    #[test]
    fn connect_authorities_that_parse() {
        let cases: &[(&str, Host, u16)] = &[
            ("example.com:443", name("example.com"), 443),
            ("example.com", name("example.com"), 443),
            ("ALLOWED.Example.COM.", name("allowed.example.com"), 443),
            ("ALLOWED.Example.COM.:8443", name("allowed.example.com"), 8443),
            ("mirror.test:22", name("mirror.test"), 22),
            ("localhost:80", name("localhost"), 80),
            ("a_b.example.com:443", name("a_b.example.com"), 443),
            ("example.com:0443", name("example.com"), 443),
            ("example.com:65535", name("example.com"), 65535),
            ("example.com:1", name("example.com"), 1),
            ("1.1.1.1:443", ip("1.1.1.1"), 443),
            ("1.1.1.1.:443", ip("1.1.1.1"), 443),
            ("[::1]:443", ip("::1"), 443),
            ("[::1]", ip("::1"), 443),
            ("[::127.0.0.1]:80", ip("::127.0.0.1"), 80),
            ("[::ffff:1.2.3.4]:443", ip("::ffff:1.2.3.4"), 443),
            ("[64:ff9b::a9fe:a9fe]:443", ip("64:ff9b::a9fe:a9fe"), 443),
            ("[2002:a9fe:a9fe::]:443", ip("2002:a9fe:a9fe::"), 443),
            ("2130706433:80", numeric("2130706433"), 80),
            ("127.1:80", numeric("127.1"), 80),
            ("0x7f.1:80", numeric("0x7f.1"), 80),
            ("0X7F.1:80", numeric("0x7f.1"), 80),
            ("0177.0.0.1:80", numeric("0177.0.0.1"), 80),
            ("127.0.0.0x1:80", numeric("127.0.0.0x1"), 80),
            ("1.2.3.04:80", numeric("1.2.3.04"), 80),
            ("example.0x:80", numeric("example.0x"), 80),
            ("example.0xg:80", name("example.0xg"), 80),
            ("example.1a:80", name("example.1a"), 80),
        ];
        for (text, host, port) in cases {
            let target = parse_connect_authority(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(target, Target { host: host.clone(), port: *port }, "{text}");
        }
    }

    #[test]
    fn connect_authorities_that_are_refused() {
        use TargetError as E;
        let cyrillic = "\u{0430}llowed.example.com:443"; // Cyrillic а
        let fullwidth = "allowed\u{ff0e}example.com:443";
        let long_label = format!("{}.com:443", "a".repeat(64));
        let long_name = format!("{}.com:443", vec!["a".repeat(60); 5].join("."));
        let cases: &[(&str, E)] = &[
            ("", E::EmptyHost),
            (":443", E::EmptyHost),
            ("[]:443", E::BadIpv6("[]:443".into())),
            ("a..example.com:443", E::EmptyLabel("a..example.com".into())),
            (".example.com:443", E::EmptyLabel(".example.com".into())),
            ("example.com..:443", E::EmptyLabel("example.com..".into())),
            (".:443", E::EmptyHost),
            (cyrillic, E::NonAscii("\u{0430}llowed.example.com".into())),
            (fullwidth, E::NonAscii("allowed\u{ff0e}example.com".into())),
            ("allowed%2eexample.com:443", E::Percent("allowed%2eexample.com:443".into())),
            ("[fe80::1%25eth0]:443", E::Percent("[fe80::1%25eth0]:443".into())),
            ("::ffff:1.2.3.4%x.allowed.com", E::Percent("::ffff:1.2.3.4%x.allowed.com".into())),
            ("evil.com:443@allowed.example.com", E::Userinfo("evil.com:443@allowed.example.com".into())),
            ("user@example.com:443", E::Userinfo("user@example.com:443".into())),
            ("example.org:https", E::BadPort("https".into())),
            ("example.org:0", E::BadPort("0".into())),
            ("example.org:65536", E::BadPort("65536".into())),
            ("example.org:", E::BadPort("".into())),
            ("example.org:+443", E::BadPort("+443".into())),
            ("example.org:-1", E::BadPort("-1".into())),
            ("example.org:99999999999999999999", E::BadPort("99999999999999999999".into())),
            (":", E::EmptyHost),
            ("[::1]:", E::BadPort("".into())),
            ("[::1]:0", E::BadPort("0".into())),
            ("[::1]443", E::BadHost("[::1]443".into())),
            ("[::1", E::BadIpv6("[::1".into())),
            ("[example.com]:443", E::BadIpv6("[example.com]:443".into())),
            ("::1:443", E::BadHost("::1".into())),
            ("::1", E::BadHost(":".into())),
            ("2001:db8::1", E::BadHost("2001:db8:".into())),
            ("example.com/:443", E::NotAuthority("example.com/:443".into())),
            ("example.com:443/x", E::NotAuthority("example.com:443/x".into())),
            ("example.com:443?x", E::NotAuthority("example.com:443?x".into())),
            ("example.com:443#x", E::NotAuthority("example.com:443#x".into())),
            ("example.com\\:443", E::NotAuthority("example.com\\:443".into())),
            ("example .com:443", E::NotAuthority("example .com:443".into())),
            (" example.com:443", E::NotAuthority(" example.com:443".into())),
            ("example.com:443\t", E::NotAuthority("example.com:443\t".into())),
            ("example.com\0:443", E::NotAuthority("example.com\0:443".into())),
            ("exa*mple.com:443", E::BadHost("exa*mple.com".into())),
            ("example.com]:443", E::BadHost("example.com]".into())),
            (&long_label, E::LabelTooLong(long_label.trim_end_matches(":443").into())),
            (&long_name, E::NameTooLong(long_name.trim_end_matches(":443").into())),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_connect_authority(text).as_ref(), Err(expected), "{text:?}");
        }
    }

    #[test]
    fn absolute_urls_that_parse() {
        let cases: &[(&str, Host, u16, &str)] = &[
            ("http://example.com/hello", name("example.com"), 80, "/hello"),
            ("http://example.com", name("example.com"), 80, "/"),
            ("HTTP://Example.COM./", name("example.com"), 80, "/"),
            ("http://example.com:8080/a/b?c=d&e", name("example.com"), 8080, "/a/b?c=d&e"),
            ("http://example.com?q", name("example.com"), 80, "/?q"),
            ("http://example.com#frag", name("example.com"), 80, "/"),
            ("http://example.com/p?q#frag", name("example.com"), 80, "/p?q"),
            ("http://example.com:/x", name("example.com"), 80, "/x"),
            ("http://allowed.example.com@evil.com/", name("evil.com"), 80, "/"),
            ("http://user:pass@example.com:81/", name("example.com"), 81, "/"),
            ("http://a@b@evil.com/", name("evil.com"), 80, "/"),
            ("http://allowed.example.com:80@evil.com:81/", name("evil.com"), 81, "/"),
            ("http://1.1.1.1/", ip("1.1.1.1"), 80, "/"),
            ("http://[::1]:8080/x", ip("::1"), 8080, "/x"),
            ("http://[::ffff:127.0.0.1]/", ip("::ffff:127.0.0.1"), 80, "/"),
            ("http://2130706433/", numeric("2130706433"), 80, "/"),
            ("http://0x7f.1/", numeric("0x7f.1"), 80, "/"),
            ("http://example.com/%2e%2e/x", name("example.com"), 80, "/%2e%2e/x"),
            ("http://example.com/a@b", name("example.com"), 80, "/a@b"),
        ];
        for (url, host, port, origin) in cases {
            let (target, path) = parse_absolute_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(target, Target { host: host.clone(), port: *port }, "{url}");
            assert_eq!(path, *origin, "{url}");
        }
    }

    #[test]
    fn absolute_urls_that_are_refused() {
        use TargetError as E;
        let cases: &[(&str, E)] = &[
            ("/", E::NotAbsolute),
            ("/hello", E::NotAbsolute),
            ("*", E::NotAbsolute),
            ("", E::NotAbsolute),
            ("example.com", E::NotAbsolute),
            ("1http://example.com/", E::NotAbsolute),
            ("http:/example.com/", E::NotAbsolute),
            ("http:example.com/", E::NotAbsolute),
            ("http://example.com/a b", E::NotAbsolute),
            ("http://example.com/\u{e9}", E::NotAbsolute),
            ("http://example.com/\r\n", E::NotAbsolute),
            ("https://example.com/", E::Scheme("https".into())),
            ("HTTPS://example.com/", E::Scheme("https".into())),
            ("ftp://example.com/", E::Scheme("ftp".into())),
            ("ws://example.com/", E::Scheme("ws".into())),
            ("example.com:443", E::Scheme("example.com".into())),
            ("http://", E::EmptyHost),
            ("http:///x", E::EmptyHost),
            ("http://user@/", E::EmptyHost),
            ("http://example.com:0/", E::BadPort("0".into())),
            ("http://example.com:65536/", E::BadPort("65536".into())),
            ("http://example.com:http/", E::BadPort("http".into())),
            ("http://evil.com\\@allowed.example.com/", E::BadHost("evil.com\\@allowed.example.com".into())),
            ("http://a..example.com/", E::EmptyLabel("a..example.com".into())),
            ("http://allowed%2eexample.com/", E::Percent("allowed%2eexample.com".into())),
            ("http://[fe80::1%25eth0]/", E::Percent("[fe80::1%25eth0]".into())),
            ("http://::1/", E::BadHost(":".into())),
            ("http://ex ample.com/", E::BadHost("ex ample.com".into())),
        ];
        for (url, expected) in cases {
            assert_eq!(parse_absolute_url(url).as_ref(), Err(expected), "{url:?}");
        }
    }

    #[test]
    fn messages_match_the_original() {
        assert_eq!(
            TargetError::NotAbsolute.to_string(),
            "Sandbox network access expects absolute-form proxy requests"
        );
        assert_eq!(
            TargetError::Scheme("https".into()).to_string(),
            "Sandbox network access cannot forward https: without CONNECT"
        );
    }

    #[test]
    fn normalize_host_table() {
        let cases: &[(&str, Result<&str, TargetError>)] = &[
            ("Example.COM", Ok("example.com")),
            ("example.com.", Ok("example.com")),
            ("_dmarc.example.com", Ok("_dmarc.example.com")),
            ("localhost", Ok("localhost")),
            ("example.com..", Err(TargetError::EmptyLabel("example.com..".into()))),
            ("", Err(TargetError::EmptyHost)),
            (".", Err(TargetError::EmptyHost)),
            ("exa mple.com", Err(TargetError::BadHost("exa mple.com".into()))),
            ("example.com:443", Err(TargetError::BadHost("example.com:443".into()))),
            ("ex\u{e4}mple.com", Err(TargetError::NonAscii("ex\u{e4}mple.com".into()))),
            ("%65xample.com", Err(TargetError::Percent("%65xample.com".into()))),
        ];
        for (text, expected) in cases {
            assert_eq!(normalize_host(text), expected.clone().map(str::to_owned), "{text:?}");
        }
        let longest = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61)].join(".");
        assert_eq!(longest.len(), 253);
        assert_eq!(normalize_host(&format!("{longest}.")), Ok(longest.clone()));
        assert!(matches!(normalize_host(&format!("{longest}e")), Err(TargetError::NameTooLong(_))));
    }

    #[test]
    fn ends_in_number_table() {
        let cases: &[(&str, bool)] = &[
            ("1", true),
            ("127.1", true),
            ("example.123", true),
            ("example.0x", true),
            ("example.0x7f", true),
            ("example.0XAb", true),
            ("example.com", false),
            ("example.0xg", false),
            ("example.1a", false),
            ("example.com.", false),
            ("127.0.0.1.", true),
            ("", false),
        ];
        for (text, expected) in cases {
            assert_eq!(ends_in_number(text), *expected, "{text:?}");
        }
    }

    #[test]
    fn display_and_host_text() {
        let v6 = parse_connect_authority("[::1]:443").unwrap();
        assert_eq!(v6.host_text(), "::1");
        assert_eq!(v6.to_string(), "[::1]:443");
        let named = parse_connect_authority("Example.com").unwrap();
        assert_eq!(named.host_text(), "example.com");
        assert_eq!(named.to_string(), "example.com:443");
    }
}
