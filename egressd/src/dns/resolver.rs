//! The stub resolver's sockets: UDP queries with a TCP retry, attempts, and deadlines.
//!
//! Everything that can be decided without a socket (what a reply means, how the two address
//! families combine, how `resolv.conf` values are capped) is a pure function here or in
//! [`wire`], tested by tables; the async code only moves bytes and keeps time.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::Instant;

use super::conf::{self, ResolvConf};
use super::wire::{self, RecordType, Response};
use super::{LookupFuture, Resolve, ResolveError};

/// How long one attempt (one query to one nameserver) may take, unless `resolv.conf` says.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// Rounds over the nameserver list, unless `resolv.conf` says.
pub const DEFAULT_ATTEMPTS: u32 = 2;
/// The whole lookup's deadline; smokescreen uses the same 5 s.
pub const DEFAULT_OVERALL_TIMEOUT: Duration = Duration::from_secs(5);
/// `options timeout:N` is capped here: glibc allows 30 s, which would let one silent
/// nameserver eat the whole lookup deadline before the next is tried.
pub const MAX_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// `options attempts:N` is capped at glibc's own limit.
pub const MAX_ATTEMPTS: u32 = 5;

/// A UDP reply can be at most this big; a smaller buffer would silently cut a datagram short.
const UDP_BUFFER: usize = 65_535;

/// Where and how patiently to ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverConfig {
    /// Tried in order, round-robin, once per attempt round.
    pub nameservers: Vec<SocketAddr>,
    /// Time allowed for one query to one nameserver, including a TCP retry after truncation.
    pub attempt_timeout: Duration,
    /// Rounds over the whole nameserver list (glibc's meaning of `attempts`); 0 counts as 1.
    pub attempts: u32,
    /// Deadline for the whole lookup, both address families together.
    pub overall_timeout: Duration,
}

impl ResolverConfig {
    /// The given nameservers with the default timing.
    pub fn with_nameservers(nameservers: Vec<SocketAddr>) -> ResolverConfig {
        ResolverConfig {
            nameservers,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            attempts: DEFAULT_ATTEMPTS,
            overall_timeout: DEFAULT_OVERALL_TIMEOUT,
        }
    }

    /// Reads a `resolv.conf` (normally `/etc/resolv.conf`). Lines that had to be skipped are
    /// logged as warnings; a file that cannot be read is an error rather than a silent fallback.
    pub fn from_resolv_conf(path: &Path) -> Result<ResolverConfig, ResolveError> {
        let bytes =
            std::fs::read(path).map_err(|source| ResolveError::Config { path: path.to_owned(), source })?;
        let parsed = conf::parse(&String::from_utf8_lossy(&bytes));
        for problem in &parsed.problems {
            tracing::warn!(path = %path.display(), "resolver configuration: {problem}");
        }
        Ok(ResolverConfig::from_conf(&parsed))
    }

    /// Applies defaults and caps to a parsed `resolv.conf`. With no usable nameserver line the
    /// resolver asks 127.0.0.1:53, as glibc does; `timeout:0` and `attempts:0` count as 1.
    pub fn from_conf(parsed: &ResolvConf) -> ResolverConfig {
        let nameservers = if parsed.nameservers.is_empty() {
            vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), conf::DNS_PORT)]
        } else {
            parsed.nameservers.clone()
        };
        let attempt_timeout = parsed.timeout_secs.map_or(DEFAULT_ATTEMPT_TIMEOUT, |s| {
            Duration::from_secs(u64::from(s.max(1))).min(MAX_ATTEMPT_TIMEOUT)
        });
        let attempts = parsed.attempts.map_or(DEFAULT_ATTEMPTS, |n| n.clamp(1, MAX_ATTEMPTS));
        ResolverConfig { nameservers, attempt_timeout, attempts, overall_timeout: DEFAULT_OVERALL_TIMEOUT }
    }
}

/// The resolver egressd uses: asks the configured nameservers directly, see the module docs
/// of [`super`] for what it accepts.
#[derive(Debug)]
pub struct StubResolver {
    cfg: ResolverConfig,
    cache: std::sync::Mutex<std::collections::HashMap<String, (Instant, Vec<IpAddr>)>>,
}

/// Positive answers are kept for their TTL (the smallest in the reply), at most this long.
/// A TTL of 0 is never cached, so a rebinding name is asked again on every connection;
/// every answer, cached or not, is classified again by the caller.
pub const MAX_CACHE_TTL: Duration = Duration::from_secs(300);
/// Names kept at most; beyond it expired entries go, then everything.
const MAX_CACHE_ENTRIES: usize = 4096;

impl StubResolver {
    pub fn new(cfg: ResolverConfig) -> StubResolver {
        StubResolver { cfg, cache: std::sync::Mutex::default() }
    }

    fn cached(&self, name: &str) -> Option<Vec<IpAddr>> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.get(name).filter(|(expires, _)| Instant::now() < *expires).map(|(_, ips)| ips.clone())
    }

    fn remember(&self, name: &str, ips: &[IpAddr], ttl: u32) {
        if ttl == 0 {
            return;
        }
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= MAX_CACHE_ENTRIES {
            cache.retain(|_, (expires, _)| now < *expires);
            if cache.len() >= MAX_CACHE_ENTRIES {
                cache.clear();
            }
        }
        let keep = Duration::from_secs(u64::from(ttl)).min(MAX_CACHE_TTL);
        cache.insert(name.to_owned(), (now + keep, ips.to_vec()));
    }

    pub fn config(&self) -> &ResolverConfig {
        &self.cfg
    }

    async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        // Refuse a name DNS cannot carry before any socket exists: no query is sent for it.
        wire::encode_query(0, name, RecordType::A)
            .map_err(|source| ResolveError::InvalidName { name: name.to_owned(), source })?;
        if self.cfg.nameservers.is_empty() {
            return Err(ResolveError::NoNameservers);
        }
        if let Some(ips) = localhost(name) {
            return Ok(ips);
        }
        if let Some(ips) = self.cached(name) {
            return Ok(ips);
        }
        let started = Instant::now();
        let deadline = started + self.cfg.overall_timeout;
        let (v4, v6) = tokio::join!(
            self.query(name, RecordType::A, started, deadline),
            self.query(name, RecordType::Aaaa, started, deadline),
        );
        // Cached only when both families answered: a family that failed is asked again.
        let ttl = match (&v4, &v6) {
            (Ok((_, a)), Ok((_, b))) => (*a).min(*b),
            _ => 0,
        };
        let result = combine(name, v4.map(|(ips, _)| ips), v6.map(|(ips, _)| ips));
        if let Ok(ips) = &result {
            self.remember(name, ips, ttl);
        }
        result
    }

    /// One address family: attempts round-robin over the nameservers until one gives a
    /// definite answer. `Ok` with no addresses means the name exists without this type; the
    /// number is the answer's smallest TTL (`u32::MAX` when there are no addresses).
    async fn query(
        &self,
        name: &str,
        qtype: RecordType,
        started: Instant,
        deadline: Instant,
    ) -> Result<(Vec<IpAddr>, u32), ResolveError> {
        let timeout = || ResolveError::Timeout { name: name.to_owned(), after: started.elapsed() };
        let mut last = None;
        for _round in 0..self.cfg.attempts.max(1) {
            for &server in &self.cfg.nameservers {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(timeout());
                }
                let budget = self.cfg.attempt_timeout.min(left);
                let outcome = tokio::time::timeout(budget, exchange(server, name, qtype)).await;
                let error = match outcome {
                    Ok(Ok(Outcome::Addresses(addresses, ttl))) => return Ok((addresses, ttl)),
                    Ok(Ok(Outcome::NoSuchName)) => return Err(ResolveError::NoSuchName(name.to_owned())),
                    Ok(Ok(Outcome::Failure(rcode))) => {
                        ResolveError::ServerFailure { name: name.to_owned(), server, rcode }
                    }
                    Ok(Err(error)) => error,
                    Err(_elapsed) => timeout(),
                };
                tracing::debug!(%server, %qtype, name, %error, "DNS attempt failed; trying on");
                last = Some(error);
            }
        }
        Err(last.unwrap_or_else(timeout))
    }
}

impl Resolve for StubResolver {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        Box::pin(self.resolve(name))
    }
}

/// RFC 6761 §6.3: `localhost` and names under it are loopback, answered without asking any
/// server (which might say otherwise). They are classified loopback like any other answer,
/// so only a policy with private network access reaches them (runnerd's selftest does).
pub fn localhost(name: &str) -> Option<Vec<IpAddr>> {
    let name = name.strip_suffix('.').unwrap_or(name);
    let is_local = name.eq_ignore_ascii_case("localhost")
        || name.len() > ".localhost".len()
            && name[name.len() - ".localhost".len()..].eq_ignore_ascii_case(".localhost");
    is_local.then(|| vec![IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)])
}

/// What one nameserver said about one question.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// NOERROR: the addresses (possibly none) for the name and its CNAME chain, and the
    /// smallest TTL among the answer's records.
    Addresses(Vec<IpAddr>, u32),
    /// NXDOMAIN: definite, no other nameserver is asked.
    NoSuchName,
    /// Any other code (SERVFAIL, REFUSED, FORMERR, ...): ask the next nameserver.
    Failure(u8),
}

/// Reads a reply that was already matched to our question.
fn interpret(response: &Response) -> Result<Outcome, wire::WireError> {
    match response.rcode {
        wire::RCODE_NOERROR => {
            let addresses = response.addresses()?;
            // No address of this type says nothing about how long the other type's last.
            let ttl = if addresses.is_empty() {
                u32::MAX
            } else {
                response.answers.iter().map(|r| r.ttl).min().unwrap_or(0)
            };
            Ok(Outcome::Addresses(addresses, ttl))
        }
        wire::RCODE_NXDOMAIN => Ok(Outcome::NoSuchName),
        other => Ok(Outcome::Failure(other)),
    }
}

/// Merges the two families: any address wins (A first, then AAAA, no duplicates); else
/// NXDOMAIN from either; else NoAddresses if both said NOERROR; else the A query's error, or
/// the AAAA query's. A failed family next to a successful one is only logged: a nameserver
/// that drops AAAA queries must not make an IPv4-only name unreachable.
fn combine(
    name: &str,
    v4: Result<Vec<IpAddr>, ResolveError>,
    v6: Result<Vec<IpAddr>, ResolveError>,
) -> Result<Vec<IpAddr>, ResolveError> {
    let mut out: Vec<IpAddr> = Vec::new();
    for ip in v4.iter().flatten().chain(v6.iter().flatten()) {
        if !out.contains(ip) {
            out.push(*ip);
        }
    }
    if !out.is_empty() {
        for error in [&v4, &v6].into_iter().filter_map(|r| r.as_ref().err()) {
            tracing::debug!(name, %error, "one address family failed; using the other");
        }
        return Ok(out);
    }
    match (v4, v6) {
        (Ok(_), Ok(_)) => Err(ResolveError::NoAddresses(name.to_owned())),
        (Err(e @ ResolveError::NoSuchName(_)), _) | (_, Err(e @ ResolveError::NoSuchName(_))) => Err(e),
        (Err(e), _) | (_, Err(e)) => Err(e),
    }
}

/// One attempt against one nameserver: UDP, then TCP if the UDP reply was truncated.
async fn exchange(server: SocketAddr, name: &str, qtype: RecordType) -> Result<Outcome, ResolveError> {
    let mut response = udp_exchange(server, name, qtype).await?;
    if response.truncated {
        tracing::debug!(%server, %qtype, name, "truncated UDP reply; asking again over TCP");
        response = tcp_exchange(server, name, qtype).await?;
    }
    interpret(&response).map_err(|e| ResolveError::Malformed(server, e))
}

fn query_id() -> Result<u16, ResolveError> {
    let mut id = [0u8; 2];
    getrandom::fill(&mut id).map_err(|e| ResolveError::Io(std::io::Error::other(e)))?;
    Ok(u16::from_be_bytes(id))
}

fn encode(id: u16, name: &str, qtype: RecordType) -> Result<Vec<u8>, ResolveError> {
    wire::encode_query(id, name, qtype)
        .map_err(|source| ResolveError::InvalidName { name: name.to_owned(), source })
}

/// Sends the query from a fresh socket on an ephemeral port and waits for the reply.
///
/// The socket is bound unconnected and then connected to the nameserver, so the kernel drops
/// datagrams from anyone else and reports ICMP unreachable as an error. Datagrams that arrived
/// between bind and connect are still queued, hence the source check on each one as well.
/// Anything that is not the reply is ignored and the wait goes on; the caller's timer ends it.
async fn udp_exchange(server: SocketAddr, name: &str, qtype: RecordType) -> Result<Response, ResolveError> {
    let id = query_id()?;
    let query = encode(id, name, qtype)?;
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await.map_err(ResolveError::Io)?;
    let net = |source| ResolveError::Nameserver { server, source };
    socket.connect(server).await.map_err(net)?;
    socket.send(&query).await.map_err(net)?;

    let mut buf = vec![0u8; UDP_BUFFER];
    loop {
        let (len, from) = socket.recv_from(&mut buf).await.map_err(net)?;
        if from.ip() != server.ip() || from.port() != server.port() {
            tracing::debug!(%server, %from, "ignoring a datagram from another address");
            continue;
        }
        let datagram = &buf[..len];
        if let Err(error) = wire::check_reply(datagram, id, name, qtype) {
            tracing::debug!(%server, %qtype, name, %error, "ignoring a datagram that is not the reply");
            continue;
        }
        return wire::parse_response(datagram).map_err(|e| ResolveError::Malformed(server, e));
    }
}

/// Asks again over TCP (RFC 1035 §4.2.2: a two-byte length before each message).
///
/// A TCP reply that is not ours is an error, not something to wait past: the connection
/// is to the nameserver, so a mismatch means it is broken, not that someone is spoofing.
async fn tcp_exchange(server: SocketAddr, name: &str, qtype: RecordType) -> Result<Response, ResolveError> {
    let id = query_id()?;
    let query = encode(id, name, qtype)?;
    let net = |source| ResolveError::Nameserver { server, source };
    let mut stream = TcpStream::connect(server).await.map_err(net)?;
    let mut framed = Vec::with_capacity(query.len() + 2);
    // A query is at most 12 + 255 + 4 bytes, far below the frame limit.
    framed.extend_from_slice(&(query.len() as u16).to_be_bytes());
    framed.extend_from_slice(&query);
    stream.write_all(&framed).await.map_err(net)?;

    let mut length = [0u8; 2];
    stream.read_exact(&mut length).await.map_err(net)?;
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(length))];
    stream.read_exact(&mut reply).await.map_err(net)?;
    let malformed = |e| ResolveError::Malformed(server, e);
    wire::check_reply(&reply, id, name, qtype).map_err(malformed)?;
    wire::parse_response(&reply).map_err(malformed)
}

#[cfg(test)]
mod tests;
