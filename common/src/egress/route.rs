//! Upstream proxy chaining: whether allowed traffic leaves directly or through the
//! deployment's own outbound proxy (the original's `egress-proxy.ts`, internals §3.7).
//!
//! Only `http:` proxies are supported. The original also accepts `https:` proxies, which
//! needs a TLS client for the hop to the proxy; we have none yet, so such a URL is refused
//! with [`RouteError::Unsupported`] rather than silently sent in clear text.
//!
//! Nothing here lets the proxy address or credentials reach the sandbox:
//! [`RouteError::sandbox_reason`] is fixed text, [`ProxyEndpoint::label`] has no userinfo,
//! and the `Debug` output of [`ProxySetting`] and [`ProxyEndpoint`] redacts credentials.

use std::fmt;

use super::target::{Host, classify_host, parse_port};

/// The runner variables that [`ProxySetting::capture_environment`] keeps.
pub const PROXY_VARIABLES: [&str; 8] = [
    "http_proxy",
    "HTTP_PROXY",
    "https_proxy",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "no_proxy",
    "NO_PROXY",
];

/// Default port of an `http:` proxy URL without one.
pub const PROXY_DEFAULT_PORT: u16 = 80;

/// How allowed traffic leaves the host.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProxySetting {
    Direct,
    /// The runner's proxy variables captured as (name, value), only the 8 names of
    /// [`PROXY_VARIABLES`], so the route follows the runner's own environment (§3.7).
    Environment(Vec<(String, String)>),
    /// Exactly this proxy URL, whatever the environment says.
    Url(String),
}

impl ProxySetting {
    /// Keeps present variables, even empty ones: an empty lowercase variable still wins.
    pub fn capture_environment(var: impl Fn(&str) -> Option<String>) -> ProxySetting {
        ProxySetting::Environment(
            PROXY_VARIABLES
                .iter()
                .filter_map(|name| var(name).map(|value| ((*name).to_owned(), value)))
                .collect(),
        )
    }
}

/// Redacts userinfo so that a logged setting never carries a proxy password.
impl fmt::Debug for ProxySetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProxySetting::Direct => f.write_str("Direct"),
            ProxySetting::Environment(vars) => f
                .debug_tuple("Environment")
                .field(&vars.iter().map(|(n, v)| (n.as_str(), redact_userinfo(v))).collect::<Vec<_>>())
                .finish(),
            ProxySetting::Url(url) => f.debug_tuple("Url").field(&redact_userinfo(url)).finish(),
        }
    }
}

/// An upstream `http:` proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyEndpoint {
    /// A name or IP (IPv6 without brackets), ready for `connect((host, port))`.
    pub host: String,
    pub port: u16,
    /// `Basic <b64>` when the URL has userinfo: the `Proxy-Authorization` value.
    pub authorization: Option<String>,
}

impl ProxyEndpoint {
    /// `http://host:port` for logs and errors: never the credentials.
    pub fn label(&self) -> String {
        if self.host.contains(':') {
            format!("http://[{}]:{}", self.host, self.port)
        } else {
            format!("http://{}:{}", self.host, self.port)
        }
    }
}

/// Shows the label and whether credentials are present, never the credentials.
impl fmt::Debug for ProxyEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyEndpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("authorization", &self.authorization.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Where one allowed request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Direct,
    Proxy(ProxyEndpoint),
}

/// A misconfigured outbound route. Messages are for operators: they name the scheme or the
/// endpoint, never credentials. The sandbox gets [`RouteError::sandbox_reason`] only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("{}", unsupported_message(.scheme))]
    Unsupported { scheme: String },
    #[error("invalid egress proxy URL: expected http://[user:password@]host[:port]")]
    InvalidUrl,
    #[error("the credentials in the egress proxy URL for {endpoint} are not valid percent-encoding")]
    Credentials { endpoint: String },
}

impl RouteError {
    /// What the sandbox may see (the 502 reason): never the proxy address or credentials.
    pub fn sandbox_reason(&self) -> &'static str {
        "Sandbox network access cannot use this deployment's configured outbound route; ask an administrator to check it"
    }
}

fn unsupported_message(scheme: &str) -> String {
    if scheme == "https" {
        "Sandbox network access cannot send allowed traffic through an https proxy yet: this gateway \
         has no TLS client for the hop to the proxy; configure an http proxy server for the sandbox \
         network egress policy"
            .to_owned()
    } else {
        format!(
            "Sandbox network access cannot send allowed traffic through a {scheme} proxy; configure an \
             http or https proxy server for the sandbox network egress policy"
        )
    }
}

/// The route for one allowed request; `tls` = the request is a CONNECT (the `https_proxy`
/// family) rather than plain http.
///
/// In `Environment` mode the first *present* variable of `https_proxy`, `HTTPS_PROXY`,
/// `all_proxy`, `ALL_PROXY` (or the `http_proxy` family) decides, even when empty (empty →
/// direct), as curl and the original's `??` chain do; `no_proxy` before `NO_PROXY` likewise.
/// `host` is the normalised name or the IP text without brackets.
pub fn route_for(setting: &ProxySetting, host: &str, port: u16, tls: bool) -> Result<Route, RouteError> {
    let vars = match setting {
        ProxySetting::Direct => return Ok(Route::Direct),
        ProxySetting::Url(url) => return parse_proxy_url(url).map(Route::Proxy),
        ProxySetting::Environment(vars) => vars,
    };
    let first_present = |names: &[&str]| {
        names.iter().find_map(|name| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str()))
    };
    if first_present(&["no_proxy", "NO_PROXY"]).is_some_and(|list| no_proxy_matches(list, host, port)) {
        return Ok(Route::Direct);
    }
    let names: &[&str] = if tls {
        &["https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"]
    } else {
        &["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"]
    };
    match first_present(names).map(str::trim) {
        None | Some("") => Ok(Route::Direct),
        Some(url) => parse_proxy_url(url).map(Route::Proxy),
    }
}

/// `NO_PROXY`: `*` is everything; entries split on `,` and whitespace are `host`,
/// `.suffix`, `*.suffix` or `host:port`; an entry matches the host itself or any name
/// ending in `.entry`, and a port-qualified entry only that port.
pub fn no_proxy_matches(list: &str, host: &str, port: u16) -> bool {
    let host = host.to_ascii_lowercase();
    let host = host.strip_suffix('.').unwrap_or(&host);
    list.split(|c: char| c == ',' || c.is_whitespace()).filter(|e| !e.is_empty()).any(|entry| {
        if entry == "*" {
            return true;
        }
        let entry = entry.to_ascii_lowercase();
        let (name, entry_port) = split_no_proxy_entry(&entry);
        if entry_port.is_some_and(|p| p != port) {
            return false;
        }
        let name = name.strip_prefix("*.").or_else(|| name.strip_prefix('.')).unwrap_or(name);
        let name = name.strip_suffix('.').unwrap_or(name);
        !name.is_empty() && (host == name || host.strip_suffix(name).is_some_and(|head| head.ends_with('.')))
    })
}

/// `host`, `host:port`, `[v6]`, `[v6]:port`, or a bare IPv6 address (no port).
fn split_no_proxy_entry(entry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = entry.strip_prefix('[') {
        if let Some((inside, after)) = rest.split_once(']') {
            return (inside, after.strip_prefix(':').and_then(|p| parse_port(p).ok()));
        }
    }
    match entry.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => match parse_port(port) {
            Ok(port) => (name, Some(port)),
            // Not a port: an entry that matches nothing rather than a wider one.
            Err(_) => (entry, None),
        },
        _ => (entry, None),
    }
}

/// Parses `http://[user[:password]@]host[:port][/...]`; a path is ignored, as curl does.
pub fn parse_proxy_url(url: &str) -> Result<ProxyEndpoint, RouteError> {
    let url = url.trim();
    let (scheme, rest) = url.split_once("://").ok_or(RouteError::InvalidUrl)?;
    let mut chars = scheme.chars();
    let scheme_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return Err(RouteError::InvalidUrl);
    }
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" {
        return Err(RouteError::Unsupported { scheme });
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(RouteError::InvalidUrl);
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    if authority.contains('\\') {
        return Err(RouteError::InvalidUrl);
    }
    let (userinfo, host_port) = match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (Some(userinfo), host_port),
        None => (None, authority),
    };
    let (host, port) = split_proxy_host(host_port)?;
    let mut endpoint = ProxyEndpoint { host, port, authorization: None };
    if let Some(userinfo) = userinfo {
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        let credentials = || RouteError::Credentials { endpoint: endpoint.label() };
        let mut pair = percent_decode(user).ok_or_else(credentials)?;
        pair.push(b':');
        pair.extend(percent_decode(password).ok_or_else(credentials)?);
        if pair.len() > 1 {
            endpoint.authorization = Some(format!("Basic {}", base64(&pair)));
        }
    }
    Ok(endpoint)
}

/// `host[:port]` or `[v6][:port]`; an empty port means the default, as in URLs.
fn split_proxy_host(text: &str) -> Result<(String, u16), RouteError> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or(RouteError::InvalidUrl)?;
        let ip: std::net::Ipv6Addr = inside.parse().map_err(|_| RouteError::InvalidUrl)?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or(RouteError::InvalidUrl)?),
        };
        (ip.to_string(), port)
    } else {
        let (host, port) = match text.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        };
        let host = match classify_host(host).map_err(|_| RouteError::InvalidUrl)? {
            Host::Name(name) => name,
            Host::Ip(ip) => ip.to_string(),
            // An operator's `http://127.1:3128` would reach a different host than intended
            // through a strict resolver; make them spell it out.
            Host::NumericName(_) => return Err(RouteError::InvalidUrl),
        };
        (host, port)
    };
    let port = match port {
        None | Some("") => PROXY_DEFAULT_PORT,
        Some(p) => parse_port(p).map_err(|_| RouteError::InvalidUrl)?,
    };
    Ok((host, port))
}

/// `%XX` escapes to bytes; `None` for a malformed escape. Other bytes pass through.
fn percent_decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Standard base64 with padding (RFC 4648 §4): twenty lines instead of a dependency.
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 0x3f) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Replaces the userinfo of a URL-like value with `***`.
fn redact_userinfo(value: &str) -> String {
    let start = value.find("://").map_or(0, |i| i + 3);
    let end = value[start..].find(['/', '?', '#']).map_or(value.len(), |i| start + i);
    match value[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &value[..start], &value[start + at..]),
        None => value.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> ProxySetting {
        ProxySetting::Environment(vars.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect())
    }

    fn proxy(host: &str, port: u16) -> Route {
        Route::Proxy(ProxyEndpoint { host: host.to_owned(), port, authorization: None })
    }

    #[test]
    fn base64_rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
            ("re@search:p@ss", "cmVAc2VhcmNoOnBAc3M="),
            ("Aladdin:open sesame", "QWxhZGRpbjpvcGVuIHNlc2FtZQ=="),
        ];
        for (input, expected) in cases {
            assert_eq!(base64(input.as_bytes()), expected, "{input:?}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0xfd, 0xfc]), "//79/A==");
    }

    #[test]
    fn direct_and_url_take_precedence_over_the_environment() {
        assert_eq!(route_for(&ProxySetting::Direct, "example.org", 443, true), Ok(Route::Direct));
        let url = ProxySetting::Url("http://proxy.internal:3128".into());
        for (host, tls) in [("example.org", true), ("example.org", false), ("localhost", true)] {
            assert_eq!(route_for(&url, host, 443, tls), Ok(proxy("proxy.internal", 3128)));
        }
    }

    #[test]
    fn environment_variable_rules() {
        let p = |h: &str| proxy(h, 80);
        type Vars<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(Vars, bool, Route)] = &[
            (&[], true, Route::Direct),
            (&[], false, Route::Direct),
            (&[("HTTPS_PROXY", "http://s")], true, p("s")),
            (&[("https_proxy", "http://s")], true, p("s")),
            (&[("HTTPS_PROXY", "http://s")], false, Route::Direct),
            (&[("HTTP_PROXY", "http://h")], false, p("h")),
            (&[("http_proxy", "http://h")], false, p("h")),
            // HTTP_PROXY is not a fallback for HTTPS.
            (&[("HTTP_PROXY", "http://h"), ("http_proxy", "http://h")], true, Route::Direct),
            (&[("ALL_PROXY", "http://a")], true, p("a")),
            (&[("ALL_PROXY", "http://a")], false, p("a")),
            (&[("all_proxy", "http://a")], true, p("a")),
            (&[("all_proxy", "http://a"), ("ALL_PROXY", "http://upper")], false, p("a")),
            (&[("HTTPS_PROXY", "http://s"), ("ALL_PROXY", "http://a")], true, p("s")),
            (&[("HTTP_PROXY", "http://h"), ("ALL_PROXY", "http://a")], true, p("a")),
            (&[("http_proxy", "http://lower"), ("HTTP_PROXY", "http://upper")], false, p("lower")),
            (&[("HTTPS_PROXY", "http://upper"), ("https_proxy", "http://lower")], true, p("lower")),
            // A present lowercase variable wins even if empty, and empty means direct.
            (&[("https_proxy", ""), ("HTTPS_PROXY", "http://upper")], true, Route::Direct),
            (&[("http_proxy", ""), ("HTTP_PROXY", "http://upper")], false, Route::Direct),
            (&[("https_proxy", "  "), ("ALL_PROXY", "http://a")], true, Route::Direct),
            (&[("all_proxy", ""), ("ALL_PROXY", "http://a")], true, Route::Direct),
            (&[("HTTPS_PROXY", "http://s:3128/")], true, proxy("s", 3128)),
        ];
        for (vars, tls, expected) in cases {
            assert_eq!(
                route_for(&env(vars), "example.org", 443, *tls).as_ref(),
                Ok(expected),
                "{vars:?} tls={tls}"
            );
        }
    }

    #[test]
    fn no_proxy_forms() {
        let cases: &[(&str, &str, u16, bool)] = &[
            ("*", "anything.example", 443, true),
            ("a.com, *", "example.org", 443, true),
            ("example.org", "example.org", 443, true),
            ("example.org", "www.example.org", 443, true),
            ("example.org", "badexample.org", 443, false),
            ("example.org", "example.org.evil.net", 443, false),
            (".example.org", "www.example.org", 443, true),
            (".example.org", "example.org", 443, true),
            ("*.example.org", "a.b.example.org", 443, true),
            ("*.example.org", "badexample.org", 443, false),
            ("example.org:8443", "example.org", 8443, true),
            ("example.org:8443", "example.org", 443, false),
            (".example.org:443", "www.example.org", 443, true),
            ("a.com,example.org", "example.org", 443, true),
            ("a.com example.org", "example.org", 443, true),
            ("a.com,\texample.org\n", "example.org", 443, true),
            (" , ,", "example.org", 443, false),
            ("", "example.org", 443, false),
            ("EXAMPLE.ORG.", "example.org", 443, true),
            ("example.org", "EXAMPLE.org.", 443, true),
            ("example.org:https", "example.org", 443, false),
            ("10.0.0.1", "10.0.0.1", 80, true),
            ("10.0.0.1:80", "10.0.0.1", 443, false),
            ("[::1]:443", "::1", 443, true),
            ("[::1]", "::1", 80, true),
            ("::1", "::1", 80, true),
            (".", "example.org", 443, false),
            ("*.", "example.org", 443, false),
        ];
        for (list, host, port, expected) in cases {
            assert_eq!(no_proxy_matches(list, host, *port), *expected, "{list:?} vs {host}:{port}");
        }
    }

    #[test]
    fn no_proxy_is_checked_first() {
        let vars = [("HTTPS_PROXY", "http://s"), ("NO_PROXY", "internal.example,.corp")];
        assert_eq!(route_for(&env(&vars), "internal.example", 443, true), Ok(Route::Direct));
        assert_eq!(route_for(&env(&vars), "git.corp", 443, true), Ok(Route::Direct));
        assert_eq!(route_for(&env(&vars), "example.org", 443, true), Ok(proxy("s", 80)));
        let lower_wins = [("HTTPS_PROXY", "http://s"), ("no_proxy", ""), ("NO_PROXY", "*")];
        assert_eq!(route_for(&env(&lower_wins), "example.org", 443, true), Ok(proxy("s", 80)));
        // A NO_PROXY match needs no valid proxy URL.
        let broken = [("HTTPS_PROXY", "socks5://127.0.0.1:1080"), ("no_proxy", "*")];
        assert_eq!(route_for(&env(&broken), "example.org", 443, true), Ok(Route::Direct));
    }

    #[test]
    fn proxy_urls() {
        let basic = |s: &str| Some(format!("Basic {}", base64(s.as_bytes())));
        let ep =
            |host: &str, port, authorization| ProxyEndpoint { host: host.to_owned(), port, authorization };
        let cases: &[(&str, ProxyEndpoint)] = &[
            ("http://proxy.internal:3128", ep("proxy.internal", 3128, None)),
            ("http://proxy.internal", ep("proxy.internal", 80, None)),
            ("http://proxy.internal:", ep("proxy.internal", 80, None)),
            ("http://proxy.internal/", ep("proxy.internal", 80, None)),
            ("HTTP://Proxy.Internal.:8080/ignored?x", ep("proxy.internal", 8080, None)),
            ("  http://proxy.internal:3128  ", ep("proxy.internal", 3128, None)),
            ("http://127.0.0.1:1080", ep("127.0.0.1", 1080, None)),
            ("http://[::1]:3128", ep("::1", 3128, None)),
            ("http://[::1]", ep("::1", 80, None)),
            ("http://re%40search:p%40ss@proxy.test:3128", ep("proxy.test", 3128, basic("re@search:p@ss"))),
            ("http://user:pass@proxy.test", ep("proxy.test", 80, basic("user:pass"))),
            ("http://user@proxy.test", ep("proxy.test", 80, basic("user:"))),
            ("http://:pass@proxy.test", ep("proxy.test", 80, basic(":pass"))),
            ("http://@proxy.test", ep("proxy.test", 80, None)),
            ("http://:@proxy.test", ep("proxy.test", 80, None)),
            ("http://u:p:q@proxy.test", ep("proxy.test", 80, basic("u:p:q"))),
            ("http://a@b:c@proxy.test", ep("proxy.test", 80, basic("a@b:c"))),
            ("http://%C3%A9:x@proxy.test", ep("proxy.test", 80, basic("\u{e9}:x"))),
        ];
        for (url, expected) in cases {
            assert_eq!(parse_proxy_url(url).as_ref(), Ok(expected), "{url}");
        }
    }

    #[test]
    fn proxy_urls_that_are_refused() {
        use RouteError as E;
        let unsupported = |s: &str| E::Unsupported { scheme: s.to_owned() };
        let cases: &[(&str, E)] = &[
            ("socks5://127.0.0.1:1080", unsupported("socks5")),
            ("SOCKS5H://user:secret@127.0.0.1:1080", unsupported("socks5h")),
            ("https://proxy.test:443", unsupported("https")),
            ("ftp://proxy.test", unsupported("ftp")),
            ("", E::InvalidUrl),
            ("proxy.test:3128", E::InvalidUrl),
            ("//proxy.test", E::InvalidUrl),
            ("1http://proxy.test", E::InvalidUrl),
            ("http://", E::InvalidUrl),
            ("http://user:pass@", E::InvalidUrl),
            ("http://:3128", E::InvalidUrl),
            ("http://proxy.test:0", E::InvalidUrl),
            ("http://proxy.test:65536", E::InvalidUrl),
            ("http://proxy.test:http", E::InvalidUrl),
            ("http://pro xy.test", E::InvalidUrl),
            ("http://proxy.test\\@other", E::InvalidUrl),
            ("http://::1:3128", E::InvalidUrl),
            ("http://[::1", E::InvalidUrl),
            ("http://[::1]x", E::InvalidUrl),
            ("http://[fe80::1%25eth0]:3128", E::InvalidUrl),
            ("http://127.1:3128", E::InvalidUrl),
            ("http://pr\u{f6}xy.test", E::InvalidUrl),
            ("http://a..b:3128", E::InvalidUrl),
            (
                "http://%zz:secret@proxy.test:3128",
                E::Credentials { endpoint: "http://proxy.test:3128".into() },
            ),
            ("http://user:%zz@proxy.test:3128", E::Credentials { endpoint: "http://proxy.test:3128".into() }),
            ("http://user:secret%2@proxy.test", E::Credentials { endpoint: "http://proxy.test:80".into() }),
            ("http://user:secret%@[::1]:3128", E::Credentials { endpoint: "http://[::1]:3128".into() }),
        ];
        for (url, expected) in cases {
            assert_eq!(parse_proxy_url(url).as_ref(), Err(expected), "{url:?}");
        }
        let env_socks = env(&[("HTTPS_PROXY", "socks5://127.0.0.1:1080")]);
        assert_eq!(route_for(&env_socks, "example.org", 443, true), Err(unsupported("socks5")));
        let url_bad = ProxySetting::Url("not a url".into());
        assert_eq!(route_for(&url_bad, "example.org", 80, false), Err(E::InvalidUrl));
    }

    #[test]
    fn messages() {
        let socks = RouteError::Unsupported { scheme: "socks5".into() };
        assert_eq!(
            socks.to_string(),
            "Sandbox network access cannot send allowed traffic through a socks5 proxy; configure an http \
             or https proxy server for the sandbox network egress policy"
        );
        let https = RouteError::Unsupported { scheme: "https".into() }.to_string();
        assert!(https.contains("https proxy yet") && https.contains("configure an http proxy"), "{https}");
        let credentials = parse_proxy_url("http://re%zzsearch:p%40ss@proxy.test:3128").unwrap_err();
        assert_eq!(
            credentials.to_string(),
            "the credentials in the egress proxy URL for http://proxy.test:3128 are not valid percent-encoding"
        );
        for e in [socks, credentials, RouteError::InvalidUrl] {
            assert_eq!(
                e.sandbox_reason(),
                "Sandbox network access cannot use this deployment's configured outbound route; ask an \
                 administrator to check it"
            );
        }
    }

    /// No message, label or `Debug` output carries the proxy password, and the sandbox
    /// reason carries neither the address nor the scheme.
    #[test]
    fn nothing_leaks_the_credentials() {
        let secret = "s3cr%zzet";
        let urls = [
            format!("http://researcher:{secret}@proxy.test:3128"),
            format!("socks5://researcher:{secret}@127.0.0.1:1080"),
            format!("https://researcher:{secret}@proxy.test"),
            "http://re%40search:p%40ss@proxy.test:3128".to_owned(),
        ];
        for url in &urls {
            let setting = ProxySetting::Url(url.clone());
            let env_setting = env(&[("HTTPS_PROXY", url), ("HTTP_PROXY", url)]);
            for text in [format!("{setting:?}"), format!("{env_setting:?}")] {
                assert!(!text.contains("s3cr") && !text.contains("p%40ss"), "{text}");
                assert!(!text.contains("researcher") && !text.contains("re%40search"), "{text}");
            }
            match route_for(&setting, "example.org", 443, true) {
                Ok(Route::Proxy(endpoint)) => {
                    let shown = format!("{} {endpoint:?}", endpoint.label());
                    assert!(!shown.contains("p@ss") && !shown.contains("cmVAc2VhcmNo"), "{shown}");
                    assert_eq!(endpoint.label(), "http://proxy.test:3128");
                }
                Ok(Route::Direct) => panic!("{url}: direct"),
                Err(e) => {
                    let shown = format!("{e} {e:?}");
                    assert!(!shown.contains("s3cr") && !shown.contains("researcher"), "{shown}");
                    for leak in ["socks5", "127.0.0.1", "1080", "proxy.test", "s3cr"] {
                        assert!(!e.sandbox_reason().contains(leak), "{leak}");
                    }
                }
            }
        }
    }

    #[test]
    fn capture_keeps_present_variables_only() {
        let fake = |name: &str| match name {
            "https_proxy" => Some(String::new()),
            "HTTPS_PROXY" => Some("http://s:3128".to_owned()),
            "NO_PROXY" => Some("localhost".to_owned()),
            "PATH" => Some("/usr/bin".to_owned()),
            _ => None,
        };
        assert_eq!(
            ProxySetting::capture_environment(fake),
            env(&[("https_proxy", ""), ("HTTPS_PROXY", "http://s:3128"), ("NO_PROXY", "localhost")])
        );
        assert_eq!(ProxySetting::capture_environment(|_| None), ProxySetting::Environment(Vec::new()));
    }

    #[test]
    fn setting_round_trips_through_the_channel_encoding() {
        for setting in [
            ProxySetting::Direct,
            ProxySetting::Url("http://proxy.test:3128".into()),
            env(&[("https_proxy", ""), ("NO_PROXY", "*")]),
        ] {
            let bytes = postcard::to_stdvec(&setting).unwrap();
            assert_eq!(postcard::from_bytes::<ProxySetting>(&bytes).unwrap(), setting);
        }
    }

    #[test]
    fn redaction_table() {
        let cases = [
            ("http://user:pass@proxy:3128", "http://***@proxy:3128"),
            ("http://proxy:3128", "http://proxy:3128"),
            ("user:pass@proxy:3128", "***@proxy:3128"),
            ("http://proxy:3128/a@b", "http://proxy:3128/a@b"),
            ("http://a@b@proxy/", "http://***@proxy/"),
            ("localhost,.corp", "localhost,.corp"),
        ];
        for (input, expected) in cases {
            assert_eq!(redact_userinfo(input), expected, "{input}");
        }
    }
}
