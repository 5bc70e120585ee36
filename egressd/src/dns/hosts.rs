//! `/etc/hosts` (or the file `hosts_file` names), read strictly and consulted before DNS, as
//! the system resolver's `files` source comes before `dns`.
//!
//! Only canonical spellings count: an IPv4 address must be a dotted quad of four decimal
//! numbers without leading zeros (`127.0.0.1`, never `0x7f.1`, `0177.0.0.1`, `127.1` or
//! `2130706433`, which `inet_aton` would accept), an IPv6 address a literal without a `%zone`.
//! A line with anything else, and a name that DNS could not carry, is skipped and reported
//! once per version of the file (the caller logs it). Every address found here is handed
//! to the proxy like a DNS answer and classified the same way: a loopback entry is still
//! refused unless the policy allows private network access.
//!
//! The table is parsed by the pure [`parse`]; [`HostsResolver`] wraps another resolver, checks
//! the file's identity (inode, size, mtime) on every lookup and rereads it when it changed.

use std::collections::HashMap;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{LookupFuture, Resolve};

/// A hosts file larger than this is not read (the last good table stays).
pub const MAX_HOSTS_BYTES: u64 = 1 << 20;

/// Name → addresses, in file order, deduplicated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostsTable {
    pub entries: HashMap<String, Vec<IpAddr>>,
    /// What was skipped, for the log.
    pub problems: Vec<HostsProblem>,
}

impl HostsTable {
    /// The addresses for `name` (any case, an optional trailing dot).
    pub fn get(&self, name: &str) -> Option<&[IpAddr]> {
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        self.entries.get(&name).map(Vec::as_slice)
    }
}

/// A line or a name of the hosts file that egressd skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostsProblem {
    #[error(
        "line {line}: {value:?} is not a canonical IPv4 dotted quad or an IPv6 literal; the line is ignored"
    )]
    BadAddress { line: usize, value: String },
    #[error("line {line}: the address {value} has a `%scope` zone; the line is ignored")]
    Scoped { line: usize, value: String },
    #[error("line {line}: an address without a name; the line is ignored")]
    NoName { line: usize },
    #[error("line {line}: {value:?} is not a host name; the name is ignored")]
    BadName { line: usize, value: String },
}

/// Parses the text of a hosts file. Pure: reading the file is the caller's business.
///
/// `#` starts a comment anywhere on a line; fields are separated by blanks; the first field is
/// the address, the rest are the canonical name and its aliases, all looked up alike. A name
/// on several lines gets the addresses of all of them, in file order (glibc's getaddrinfo).
pub fn parse(text: &str) -> HostsTable {
    let mut table = HostsTable::default();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let content = raw.split('#').next().unwrap_or("");
        let mut fields = content.split_ascii_whitespace();
        let Some(address) = fields.next() else { continue };
        let ip = match address_of(address) {
            Ok(ip) => ip,
            Err(problem) => {
                table.problems.push(problem(line));
                continue;
            }
        };
        let names: Vec<&str> = fields.collect();
        if names.is_empty() {
            table.problems.push(HostsProblem::NoName { line });
            continue;
        }
        for name in names {
            let Some(name) = host_name(name) else {
                table.problems.push(HostsProblem::BadName { line, value: name.to_owned() });
                continue;
            };
            let ips = table.entries.entry(name).or_default();
            if !ips.contains(&ip) {
                ips.push(ip);
            }
        }
    }
    table
}

type Problem = Box<dyn FnOnce(usize) -> HostsProblem>;

/// A canonical IPv4 dotted quad or an IPv6 literal without a zone.
fn address_of(value: &str) -> Result<IpAddr, Problem> {
    let owned = value.to_owned();
    if value.contains('%') {
        return Err(Box::new(move |line| HostsProblem::Scoped { line, value: owned }));
    }
    if value.contains(':') {
        return value
            .parse::<Ipv6Addr>()
            .map(IpAddr::V6)
            .map_err(|_| Box::new(move |line| HostsProblem::BadAddress { line, value: owned }) as Problem);
    }
    match canonical_ipv4(value) {
        Some(ip) => Ok(IpAddr::V4(ip)),
        None => Err(Box::new(move |line| HostsProblem::BadAddress { line, value: owned })),
    }
}

/// Four decimal octets 0..=255, each `0` or without a leading zero: the only IPv4 spelling
/// taken. std's parser is exactly that strict (no octal, hex, short or integer forms; the
/// table test pins it), unlike getaddrinfo's.
pub fn canonical_ipv4(value: &str) -> Option<Ipv4Addr> {
    value.parse().ok()
}

/// The name as the proxy keys its lookups ([`common::egress::target::normalize_host`]), if
/// DNS could carry it; labels must not start or end with `-` either.
fn host_name(value: &str) -> Option<String> {
    common::egress::target::normalize_host(value)
        .ok()
        .filter(|name| name.split('.').all(|label| !label.starts_with('-') && !label.ends_with('-')))
}

/// Which version of the file a table came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// Device, inode, size, mtime (seconds, nanoseconds).
    File(u64, u64, u64, i64, i64),
    Missing,
    /// Could not be inspected or read (the error was logged once).
    Unreadable(i32),
}

#[derive(Debug)]
struct State {
    version: Option<Version>,
    table: Arc<HostsTable>,
}

/// Answers from the hosts file first, then asks `inner`.
#[derive(Debug)]
pub struct HostsResolver<R> {
    path: PathBuf,
    inner: R,
    state: Mutex<State>,
}

impl<R: Resolve> HostsResolver<R> {
    pub fn new(path: PathBuf, inner: R) -> HostsResolver<R> {
        let resolver =
            HostsResolver { path, inner, state: Mutex::new(State { version: None, table: Arc::default() }) };
        resolver.current();
        resolver
    }

    /// The table for the file as it is now: reread when its inode, size or mtime changed.
    /// A file that vanished empties the table; one that cannot be read keeps the last one.
    pub fn current(&self) -> Arc<HostsTable> {
        let path = &self.path;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let version = match std::fs::metadata(path) {
            Ok(m) => Version::File(m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Version::Missing,
            Err(e) => Version::Unreadable(e.raw_os_error().unwrap_or(0)),
        };
        if state.version == Some(version) {
            return state.table.clone();
        }
        match version {
            Version::Missing => {
                tracing::info!(path = %path.display(), "hosts file: absent; every name is asked of DNS");
                state.table = Arc::default();
                state.version = Some(version);
            }
            Version::Unreadable(_) => {
                tracing::warn!(path = %path.display(), "hosts file: cannot be inspected; the last table read stays");
                state.version = Some(version);
            }
            Version::File(..) => match read(path) {
                Ok(text) => {
                    let table = parse(&text);
                    for problem in &table.problems {
                        tracing::warn!(path = %path.display(), "hosts file: {problem}");
                    }
                    tracing::info!(path = %path.display(), names = table.entries.len(), "hosts file: read");
                    state.table = Arc::new(table);
                    state.version = Some(version);
                }
                Err(error) => {
                    tracing::warn!(
                        path = %path.display(),
                        error = %common::error_chain(&error),
                        "hosts file: cannot be read; the last table read stays (a file replaced by \
                         rename cannot be read once egressd confined itself: restart egressd)"
                    );
                    state.version = Some(version);
                }
            },
        }
        state.table.clone()
    }
}

#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("cannot open or read it")]
    Io(#[source] std::io::Error),
    #[error("it is not a regular file")]
    NotAFile,
    #[error("it is larger than {MAX_HOSTS_BYTES} bytes")]
    TooLarge,
}

fn read(path: &Path) -> Result<String, ReadError> {
    let file = std::fs::File::open(path).map_err(ReadError::Io)?;
    let meta = file.metadata().map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::NotAFile);
    }
    let mut bytes = Vec::new();
    file.take(MAX_HOSTS_BYTES + 1).read_to_end(&mut bytes).map_err(ReadError::Io)?;
    if bytes.len() as u64 > MAX_HOSTS_BYTES {
        return Err(ReadError::TooLarge);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

impl<R: Resolve> Resolve for HostsResolver<R> {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        let table = self.current();
        if let Some(ips) = table.get(name) {
            let ips = ips.to_vec();
            tracing::debug!(name, "answered from the hosts file");
            return Box::pin(async move { Ok(ips) });
        }
        self.inner.lookup(name)
    }
}

#[cfg(test)]
mod tests;
