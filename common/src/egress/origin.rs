//! Pinned origins (issue #30): a package mirror the operator configured by IP literal
//! (`http://10.1.2.3/conda`, `http://127.0.0.1:8080/ch`) or by a single-label name
//! (`http://mirror:3128/`) cannot be an allowlist entry (entries are domain names of at least
//! two labels). A provisioning step's gateway admits exactly such an origin — its scheme,
//! host and port — and nothing else: a request for another port of the same host, for the
//! same host over another scheme, or for any host a package's install code names is decided
//! by the allowlist as before.

use std::fmt;
use std::net::IpAddr;

use super::target::{self, EmptyPort, Host, Target, TargetError};

/// How a request reaches the gateway: `CONNECT` (a tunnel, which clients use for `https`)
/// or an absolute-form `http` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

/// `scheme://host:port`, the host an IP literal or a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin {
    pub scheme: Scheme,
    pub host: OriginHost,
    pub port: u16,
}

/// The host of an [`Origin`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OriginHost {
    Ip(IpAddr),
    /// A normalised name (lower case, no trailing dot).
    Name(String),
}

/// Why a URL gives no origin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OriginError {
    #[error("{0:?} is not an http:// or https:// URL")]
    Scheme(String),
    #[error("{url:?} has no usable host")]
    Host {
        url: String,
        #[source]
        source: TargetError,
    },
    #[error("{0:?} names its host in a numeric spelling that resolvers read as an IPv4 address")]
    NumericName(String),
}

impl Origin {
    /// The origin of an `http://` or `https://` URL (path, query and user info dropped;
    /// default ports 80 and 443).
    pub fn of_url(url: &str) -> Result<Origin, OriginError> {
        let lower = url.to_ascii_lowercase();
        let (scheme, rest, default_port) = if let Some(rest) = lower.strip_prefix("https://") {
            (Scheme::Https, &url[url.len() - rest.len()..], target::CONNECT_DEFAULT_PORT)
        } else if let Some(rest) = lower.strip_prefix("http://") {
            (Scheme::Http, &url[url.len() - rest.len()..], target::HTTP_DEFAULT_PORT)
        } else {
            return Err(OriginError::Scheme(url.to_owned()));
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let authority = &rest[..end];
        let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let parsed = target::parse_host_port(host_port, default_port, EmptyPort::Default)
            .map_err(|source| OriginError::Host { url: url.to_owned(), source })?;
        let host = match parsed.host {
            Host::Ip(ip) => OriginHost::Ip(ip),
            Host::Name(name) => OriginHost::Name(name),
            Host::NumericName(_) => return Err(OriginError::NumericName(url.to_owned())),
        };
        Ok(Origin { scheme, host, port: parsed.port })
    }

    /// Whether a request of `scheme` for `target` is exactly this origin.
    pub fn admits(&self, scheme: Scheme, target: &Target) -> bool {
        if scheme != self.scheme || target.port != self.port {
            return false;
        }
        match (&self.host, &target.host) {
            (OriginHost::Ip(a), Host::Ip(b)) => a.to_canonical() == b.to_canonical(),
            (OriginHost::Name(a), Host::Name(b)) => a == b,
            _ => false,
        }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            OriginHost::Ip(IpAddr::V6(v6)) => write!(f, "{}://[{v6}]:{}", self.scheme.as_str(), self.port),
            OriginHost::Ip(ip) => write!(f, "{}://{ip}:{}", self.scheme.as_str(), self.port),
            OriginHost::Name(name) => write!(f, "{}://{name}:{}", self.scheme.as_str(), self.port),
        }
    }
}

/// Parses each text, skipping (and returning) what does not parse; the rest sorted and
/// deduplicated: the form a gateway enforces and its identity hashes.
pub fn parse_all<S: AsRef<str>>(texts: &[S]) -> (Vec<Origin>, Vec<OriginError>) {
    let mut origins = Vec::new();
    let mut rejected = Vec::new();
    for t in texts {
        match Origin::of_url(t.as_ref()) {
            Ok(o) => origins.push(o),
            Err(e) => rejected.push(e),
        }
    }
    origins.sort();
    origins.dedup();
    (origins, rejected)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::target::{parse_absolute_url, parse_connect_authority};

    #[test]
    fn origins_of_urls() {
        let cases: &[(&str, &str)] = &[
            ("http://10.1.2.3/conda", "http://10.1.2.3:80"),
            ("http://127.0.0.1:8080/ch", "http://127.0.0.1:8080"),
            ("HTTP://Mirror:3128/x?y", "http://mirror:3128"),
            ("https://mirror/", "https://mirror:443"),
            ("http://user:pw@10.0.0.1:81", "http://10.0.0.1:81"),
            ("http://[::1]:8080/ch", "http://[::1]:8080"),
            ("https://conda.example.org/c", "https://conda.example.org:443"),
        ];
        for (url, want) in cases {
            let o = Origin::of_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(o.to_string(), *want, "{url}");
            assert_eq!(Origin::of_url(&o.to_string()).unwrap(), o, "{url} round trip");
        }
        for bad in ["ftp://x/", "file:///srv/ch", "http://", "http://0x7f.1/", "http://a b/", "mirror:80"] {
            assert!(Origin::of_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_origin_admits_exactly_its_scheme_host_and_port() {
        let o = Origin::of_url("http://127.0.0.1:8080/ch").unwrap();
        let plain = |url: &str| parse_absolute_url(url).unwrap().0;
        assert!(o.admits(Scheme::Http, &plain("http://127.0.0.1:8080/ch/x.json")));
        assert!(!o.admits(Scheme::Http, &plain("http://127.0.0.1:8081/ch")), "another port");
        assert!(!o.admits(Scheme::Http, &plain("http://127.0.0.2:8080/")), "another host");
        assert!(!o.admits(Scheme::Http, &plain("http://localhost:8080/")), "a name for it");
        assert!(!o.admits(Scheme::Https, &parse_connect_authority("127.0.0.1:8080").unwrap()), "a tunnel");
        let named = Origin::of_url("https://mirror").unwrap();
        assert!(named.admits(Scheme::Https, &parse_connect_authority("mirror:443").unwrap()));
        assert!(named.admits(Scheme::Https, &parse_connect_authority("MIRROR.:443").unwrap()));
        assert!(!named.admits(Scheme::Https, &parse_connect_authority("mirror.evil:443").unwrap()));
    }

    #[test]
    fn parse_all_sorts_dedups_and_reports() {
        let (origins, rejected) = parse_all(&["http://b:1", "http://a:1", "http://b:1/x", "gopher://x"]);
        let texts: Vec<String> = origins.iter().map(Origin::to_string).collect();
        assert_eq!(texts, ["http://a:1", "http://b:1"]);
        assert_eq!(rejected.len(), 1);
    }
}
