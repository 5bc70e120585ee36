//! The domain allowlist: which names (and ports) a sandbox may reach.
//!
//! Entries are `host`, `*.host` (strict subdomains at any depth, never the apex), each with
//! an optional `:port`. Parsing is stricter than the original's on names that some resolver
//! would read as an IPv4 address: such an entry could never be matched safely.

use std::fmt;
use std::net::Ipv4Addr;

use super::target::{MAX_LABEL_BYTES, MAX_NAME_BYTES, ends_in_number};

/// The host part of an entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Exactly this name.
    Exact(String),
    /// `Subdomains("example.com")` is `*.example.com`: names ending in `.example.com`.
    Subdomains(String),
}

/// One parsed allowlist entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Entry {
    pub pattern: Pattern,
    /// `None` matches any port: the default ports 443/80 come from the request side.
    pub port: Option<u16>,
}

/// Why an allowlist entry was refused. Each message names the entry as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowlistError {
    #[error("allowlist entry {0:?} is empty")]
    Empty(String),
    #[error("allowlist entry {0:?} is an IP address; entries must be domain names")]
    IpAddress(String),
    #[error(
        "allowlist entry {0:?} ends in a number, which resolvers read as an IPv4 address; \
         entries must be domain names"
    )]
    NumericName(String),
    #[error("allowlist entry {entry:?} contains {found}; entries are host, *.host or host:port")]
    Character { entry: String, found: &'static str },
    #[error(
        "allowlist entry {0:?} misuses '*': a wildcard may only be a whole leading '*.' label \
         over a name of at least two labels, as in *.example.com"
    )]
    Wildcard(String),
    #[error("allowlist entry {0:?} has fewer than two labels; name a domain such as example.com")]
    TooFewLabels(String),
    #[error("allowlist entry {0:?} has an empty label")]
    EmptyLabel(String),
    #[error(
        "allowlist entry {entry:?} has the label {label:?}; labels are letters a-z, digits and \
         inner hyphens"
    )]
    BadLabel { entry: String, label: String },
    #[error("allowlist entry {0:?} has a label over {MAX_LABEL_BYTES} bytes")]
    LabelTooLong(String),
    #[error("allowlist entry {0:?} is over {MAX_NAME_BYTES} bytes")]
    NameTooLong(String),
    #[error("allowlist entry {0:?} has a port that is not a decimal number from 1 to 65535")]
    BadPort(String),
}

impl Entry {
    /// Parses `host`, `*.host`, optionally with `:port`; trims and lower-cases first and
    /// strips one trailing dot from the host.
    pub fn parse(text: &str) -> Result<Entry, AllowlistError> {
        let original = text.trim();
        let entry = || original.to_owned();
        if original.is_empty() {
            return Err(AllowlistError::Empty(entry()));
        }
        if let Some(found) = forbidden_character(original) {
            return Err(AllowlistError::Character { entry: entry(), found });
        }
        let lower = original.to_ascii_lowercase();
        if lower.starts_with('[') {
            return Err(AllowlistError::IpAddress(entry()));
        }
        let (host, port) = match lower.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (lower.as_str(), None),
        };
        if host.contains(':') {
            return Err(AllowlistError::IpAddress(entry()));
        }
        let port = match port {
            None => None,
            Some(p) => Some(parse_port(p).ok_or_else(|| AllowlistError::BadPort(entry()))?),
        };
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.parse::<Ipv4Addr>().is_ok() {
            return Err(AllowlistError::IpAddress(entry()));
        }
        let pattern = match host.strip_prefix("*.") {
            Some(rest) => Pattern::Subdomains(rest.to_owned()),
            None => Pattern::Exact(host.to_owned()),
        };
        let name = match &pattern {
            Pattern::Exact(n) | Pattern::Subdomains(n) => n.as_str(),
        };
        if name.contains('*') {
            return Err(AllowlistError::Wildcard(entry()));
        }
        // `*.x` can only match names at least two bytes longer than `x`.
        if host.len() > MAX_NAME_BYTES {
            return Err(AllowlistError::NameTooLong(entry()));
        }
        let labels: Vec<&str> = name.split('.').collect();
        for label in &labels {
            if label.is_empty() {
                return Err(AllowlistError::EmptyLabel(entry()));
            }
            if label.len() > MAX_LABEL_BYTES {
                return Err(AllowlistError::LabelTooLong(entry()));
            }
            if !is_ldh_label(label) {
                return Err(AllowlistError::BadLabel { entry: entry(), label: (*label).to_owned() });
            }
        }
        if ends_in_number(name) {
            return Err(AllowlistError::NumericName(entry()));
        }
        if labels.len() < 2 {
            return Err(match pattern {
                Pattern::Subdomains(_) => AllowlistError::Wildcard(entry()),
                Pattern::Exact(_) => AllowlistError::TooFewLabels(entry()),
            });
        }
        Ok(Entry { pattern, port })
    }

    /// `host` must already be normalised by [`super::target::normalize_host`].
    pub fn matches(&self, host: &str, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match &self.pattern {
            Pattern::Exact(name) => host == name,
            // `len() > 1`: at least one byte of label before the dot, so never the apex.
            Pattern::Subdomains(suffix) => {
                host.strip_suffix(suffix.as_str()).is_some_and(|head| head.len() > 1 && head.ends_with('.'))
            }
        }
    }
}

/// `host`, `*.host`, `host:8443`: the form that [`Entry::parse`] reads back.
impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.pattern {
            Pattern::Exact(name) => f.write_str(name)?,
            Pattern::Subdomains(name) => write!(f, "*.{name}")?,
        }
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

/// A parsed allowlist, deduplicated and sorted by entry text, so equal policies compare equal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    /// Sorted by `Display` text, no duplicates.
    entries: Vec<Entry>,
}

impl Allowlist {
    /// Parses every entry; entries that fail are skipped (as the original does) and returned
    /// with their error so the caller can log them.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> (Allowlist, Vec<AllowlistError>) {
        let mut parsed = Vec::new();
        let mut errors = Vec::new();
        for text in entries {
            match Entry::parse(text.as_ref()) {
                Ok(entry) => parsed.push((entry.to_string(), entry)),
                Err(e) => errors.push(e),
            }
        }
        parsed.sort_by(|a, b| a.0.cmp(&b.0));
        parsed.dedup_by(|a, b| a.0 == b.0);
        (Allowlist { entries: parsed.into_iter().map(|(_, e)| e).collect() }, errors)
    }

    /// Formatted, deduplicated, sorted: stable, so equal policies compare equal.
    pub fn normalized(&self) -> Vec<String> {
        self.entries.iter().map(Entry::to_string).collect()
    }

    /// `host` must already be normalised by `target::normalize_host`.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        self.entries.iter().any(|e| e.matches(host, port))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, in normalised order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }
}

/// The first character an entry may never contain, described for the message.
fn forbidden_character(text: &str) -> Option<&'static str> {
    text.chars().find_map(|c| match c {
        '/' => Some("'/' (a path or URL)"),
        '@' => Some("'@' (user information)"),
        '%' => Some("'%' (percent-encoding)"),
        c if c.is_whitespace() => Some("whitespace"),
        c if c.is_control() => Some("a control character"),
        c if !c.is_ascii() => {
            Some("a non-ASCII character (write internationalised names in their xn-- form)")
        }
        _ => None,
    })
}

/// `^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`
fn is_ldh_label(label: &str) -> bool {
    let bytes = label.as_bytes();
    let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            alnum(first) && alnum(last) && bytes.iter().all(|b| alnum(b) || *b == b'-')
        }
        _ => false,
    }
}

/// Decimal digits only, 1–65535.
fn parse_port(text: &str) -> Option<u16> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse::<u16>().ok().filter(|p| *p != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(name: &str, port: Option<u16>) -> Entry {
        Entry { pattern: Pattern::Exact(name.to_owned()), port }
    }
    fn subs(name: &str, port: Option<u16>) -> Entry {
        Entry { pattern: Pattern::Subdomains(name.to_owned()), port }
    }

    #[test]
    fn entries_that_parse() {
        let cases: &[(&str, Entry, &str)] = &[
            ("example.com", exact("example.com", None), "example.com"),
            ("  Example.COM  ", exact("example.com", None), "example.com"),
            ("example.com.", exact("example.com", None), "example.com"),
            ("*.example.com", subs("example.com", None), "*.example.com"),
            ("*.Example.com.", subs("example.com", None), "*.example.com"),
            ("*.co.uk", subs("co.uk", None), "*.co.uk"),
            ("example.com:8443", exact("example.com", Some(8443)), "example.com:8443"),
            ("example.com.:8443", exact("example.com", Some(8443)), "example.com:8443"),
            ("*.example.com:443", subs("example.com", Some(443)), "*.example.com:443"),
            ("example.com:1", exact("example.com", Some(1)), "example.com:1"),
            ("example.com:65535", exact("example.com", Some(65535)), "example.com:65535"),
            ("example.com:0443", exact("example.com", Some(443)), "example.com:443"),
            ("a-b.x-1.example", exact("a-b.x-1.example", None), "a-b.x-1.example"),
            ("xn--80ak6aa92e.com", exact("xn--80ak6aa92e.com", None), "xn--80ak6aa92e.com"),
            ("1.2.3.example", exact("1.2.3.example", None), "1.2.3.example"),
            ("123.com", exact("123.com", None), "123.com"),
            ("example.0xg", exact("example.0xg", None), "example.0xg"),
            ("mirror.test", exact("mirror.test", None), "mirror.test"),
        ];
        for (text, entry, shown) in cases {
            let parsed = Entry::parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(&parsed, entry, "{text:?}");
            assert_eq!(parsed.to_string(), *shown, "{text:?}");
            assert_eq!(Entry::parse(shown).as_ref(), Ok(entry), "round trip of {shown:?}");
        }
    }

    #[test]
    fn entries_that_are_refused() {
        use AllowlistError as E;
        let s = |t: &str| t.to_owned();
        let long_label = format!("{}.com", "a".repeat(64));
        let max_label = format!("{}.com", "a".repeat(63));
        let long_name = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(62)].join(".");
        let long_wild =
            format!("*.{}", ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(60)].join("."));
        let character = |entry: &str, found: &'static str| E::Character { entry: s(entry), found };
        let label = |entry: &str, l: &str| E::BadLabel { entry: s(entry), label: s(l) };
        let cases: &[(&str, E)] = &[
            ("", E::Empty(s(""))),
            ("   ", E::Empty(s(""))),
            ("example.com/path", character("example.com/path", "'/' (a path or URL)")),
            ("https://example.com", character("https://example.com", "'/' (a path or URL)")),
            ("user@example.com", character("user@example.com", "'@' (user information)")),
            ("exa mple.com", character("exa mple.com", "whitespace")),
            ("example.com\t:443", character("example.com\t:443", "whitespace")),
            ("example%2ecom", character("example%2ecom", "'%' (percent-encoding)")),
            (
                "\u{0430}pple.com",
                character(
                    "\u{0430}pple.com",
                    "a non-ASCII character (write internationalised names in their xn-- form)",
                ),
            ),
            (
                "example\u{ff0e}com",
                character(
                    "example\u{ff0e}com",
                    "a non-ASCII character (write internationalised names in their xn-- form)",
                ),
            ),
            ("1.2.3.4", E::IpAddress(s("1.2.3.4"))),
            ("1.2.3.4:443", E::IpAddress(s("1.2.3.4:443"))),
            ("1.2.3.4.", E::IpAddress(s("1.2.3.4."))),
            ("::1", E::IpAddress(s("::1"))),
            ("2001:db8::1", E::IpAddress(s("2001:db8::1"))),
            ("[::1]", E::IpAddress(s("[::1]"))),
            ("[::1]:443", E::IpAddress(s("[::1]:443"))),
            ("[example.com]", E::IpAddress(s("[example.com]"))),
            ("127.1", E::NumericName(s("127.1"))),
            ("0x7f.1", E::NumericName(s("0x7f.1"))),
            ("0177.0.0.1", E::NumericName(s("0177.0.0.1"))),
            ("example.0x7f", E::NumericName(s("example.0x7f"))),
            ("example.0X7F", E::NumericName(s("example.0X7F"))),
            ("example.0x", E::NumericName(s("example.0x"))),
            ("example.123", E::NumericName(s("example.123"))),
            ("*.1.2.3", E::NumericName(s("*.1.2.3"))),
            ("2130706433", E::NumericName(s("2130706433"))),
            ("*.1", E::NumericName(s("*.1"))),
            ("localhost", E::TooFewLabels(s("localhost"))),
            ("com", E::TooFewLabels(s("com"))),
            ("com.", E::TooFewLabels(s("com."))),
            ("*", E::Wildcard(s("*"))),
            ("*.", E::Wildcard(s("*."))),
            ("*.com", E::Wildcard(s("*.com"))),
            ("*.com.", E::Wildcard(s("*.com."))),
            ("*.*.example.com", E::Wildcard(s("*.*.example.com"))),
            ("a.*.example.com", E::Wildcard(s("a.*.example.com"))),
            ("*example.com", E::Wildcard(s("*example.com"))),
            ("foo*.example.com", E::Wildcard(s("foo*.example.com"))),
            ("*.example.*", E::Wildcard(s("*.example.*"))),
            ("**.example.com", E::Wildcard(s("**.example.com"))),
            ("example.com:", E::BadPort(s("example.com:"))),
            ("example.com:0", E::BadPort(s("example.com:0"))),
            ("example.com:65536", E::BadPort(s("example.com:65536"))),
            ("example.com:https", E::BadPort(s("example.com:https"))),
            ("example.com:+443", E::BadPort(s("example.com:+443"))),
            ("a..example.com", E::EmptyLabel(s("a..example.com"))),
            (".example.com", E::EmptyLabel(s(".example.com"))),
            ("example.com..", E::EmptyLabel(s("example.com.."))),
            ("*..example.com", E::EmptyLabel(s("*..example.com"))),
            ("-a.example.com", label("-a.example.com", "-a")),
            ("a-.example.com", label("a-.example.com", "a-")),
            ("a_b.example.com", label("a_b.example.com", "a_b")),
            ("example.com-", label("example.com-", "com-")),
            ("exa!mple.com", label("exa!mple.com", "exa!mple")),
            (&long_label, E::LabelTooLong(long_label.clone())),
            (&long_name, E::NameTooLong(long_name.clone())),
            (&long_wild, E::NameTooLong(long_wild.clone())),
        ];
        for (text, expected) in cases {
            assert_eq!(Entry::parse(text).as_ref(), Err(expected), "{text:?}");
        }
        assert!(Entry::parse(&max_label).is_ok());
        assert!(Entry::parse(&long_name[1..]).is_ok(), "253 bytes is the limit");
        assert!(Entry::parse(&long_wild[..long_wild.len() - 1]).is_ok(), "*.x of 253 bytes is the limit");
    }

    #[test]
    fn messages_name_the_entry() {
        assert_eq!(
            Entry::parse("1.2.3.4").unwrap_err().to_string(),
            r#"allowlist entry "1.2.3.4" is an IP address; entries must be domain names"#
        );
        assert_eq!(
            Entry::parse("*.com").unwrap_err().to_string(),
            "allowlist entry \"*.com\" misuses '*': a wildcard may only be a whole leading '*.' label \
             over a name of at least two labels, as in *.example.com"
        );
    }

    #[test]
    fn matching() {
        let (list, errors) = Allowlist::parse(&[
            "allowed.example.com",
            "*.example.org",
            "port.example.net:8443",
            "*.wild.example.net:443",
        ]);
        assert!(errors.is_empty());
        let cases: &[(&str, u16, bool)] = &[
            ("allowed.example.com", 443, true),
            ("allowed.example.com", 80, true),
            ("allowed.example.com", 22, true),
            ("example.com", 443, false),
            ("sub.allowed.example.com", 443, false),
            ("allowed.example.com.evil.net", 443, false),
            ("evilallowed.example.com", 443, false),
            ("a.example.org", 443, true),
            ("a.b.c.example.org", 80, true),
            ("example.org", 443, false),
            ("evilexample.org", 443, false),
            ("xexample.org", 443, false),
            (".example.org", 443, false),
            ("example.org.evil.net", 443, false),
            ("port.example.net", 8443, true),
            ("port.example.net", 443, false),
            ("port.example.net", 80, false),
            ("a.wild.example.net", 443, true),
            ("a.wild.example.net", 80, false),
            ("wild.example.net", 443, false),
            ("1.2.3.4", 443, false),
            ("", 443, false),
        ];
        for (host, port, expected) in cases {
            assert_eq!(list.allows(host, *port), *expected, "{host}:{port}");
        }
    }

    #[test]
    fn single_entry_matching_table() {
        let cases: &[(&str, &str, u16, bool)] = &[
            ("example.com", "example.com", 443, true),
            ("example.com", "www.example.com", 443, false),
            ("*.example.com", "www.example.com", 443, true),
            ("*.example.com", "a.b.example.com", 443, true),
            ("*.example.com", "example.com", 443, false),
            ("*.example.com", "evilexample.com", 443, false),
            ("*.example.com", "example.com.evil.net", 443, false),
            ("example.com:80", "example.com", 80, true),
            ("example.com:80", "example.com", 443, false),
            ("*.example.com:80", "a.example.com", 8080, false),
        ];
        for (entry, host, port, expected) in cases {
            let entry = Entry::parse(entry).unwrap();
            assert_eq!(entry.matches(host, *port), *expected, "{entry} vs {host}:{port}");
        }
    }

    #[test]
    fn parse_skips_bad_entries_and_normalises() {
        let (list, errors) = Allowlist::parse(&[
            "B.example.com",
            "a.example.com",
            "1.2.3.4",
            "b.example.com.",
            "*.example.com",
            "a.example.com:443",
            "*",
            " A.Example.com ",
        ]);
        assert_eq!(
            list.normalized(),
            ["*.example.com", "a.example.com", "a.example.com:443", "b.example.com"]
        );
        assert_eq!(
            errors,
            [AllowlistError::IpAddress("1.2.3.4".into()), AllowlistError::Wildcard("*".into())]
        );
        let (same, _) =
            Allowlist::parse(&["a.example.com:443", "*.EXAMPLE.com", "b.example.com", "a.example.com"]);
        assert_eq!(same, list, "equal policies compare equal whatever the order");
        assert!(!list.is_empty());
        let (empty, errors) = Allowlist::parse::<&str>(&[]);
        assert!(empty.is_empty() && errors.is_empty());
        assert_eq!(empty, Allowlist::default());
        assert!(!empty.allows("example.com", 443));
    }
}
