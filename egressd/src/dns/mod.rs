//! A stub DNS resolver with timeouts, used instead of `getaddrinfo`.
//!
//! egressd resolves a name only after the allowlist admitted it, exactly once per connection,
//! and dials only an address it vetted from that one answer. `getaddrinfo` is the wrong tool for
//! that: it turns `0x7f.1`, `0177.0.0.1` and `2130706433` into 127.0.0.1 (inet_aton spellings),
//! consults `/etc/hosts` and search domains, and gives no control over how long it blocks. This
//! module asks the configured nameservers directly:
//!
//! - A and AAAA queries run concurrently over UDP, each from its own socket on an ephemeral port
//!   with a random 16-bit ID and recursion desired; a truncated reply is asked again over TCP.
//! - Only a reply from the nameserver's address, with our ID, the QR bit and our question echoed
//!   back is accepted; anything else is ignored while the attempt's timer runs (a spoofer must
//!   guess port and ID, and cannot end the wait early with junk).
//! - Addresses are taken only for the asked name or names its CNAME chain in the same answer
//!   reaches (at most 8 links).
//! - Every attempt has a timeout, attempts go round-robin over the nameservers, and the whole
//!   lookup has a deadline; SERVFAIL and REFUSED move on to the next nameserver.
//! - Names are sent fully qualified: no search domains, no literal parsing.
//! - `/etc/hosts` (or `hosts_file`) is consulted first, by [`hosts::HostsResolver`], with a
//!   strict parser of its own (canonical addresses only); its answers are vetted like DNS's.
//!
//! [`hosts`] reads the hosts file; [`wire`] holds the pure message encoding (both client and server halves, so tests can run
//! fake nameservers), [`conf`] the `resolv.conf` reader, [`resolver`] the sockets.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

pub mod conf;
pub mod hosts;
pub mod resolver;
pub mod wire;

pub use hosts::HostsResolver;
pub use resolver::{ResolverConfig, StubResolver};
pub use wire::{RecordType, WireError};

/// What a lookup yields: the A answers then the AAAA answers, deduplicated, in answer order.
pub type LookupFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<IpAddr>, ResolveError>> + Send + 'a>>;

/// A name → addresses lookup. egressd calls it exactly once per connection, after the allowlist
/// admitted the name.
///
/// A trait so the proxy can be tested against scripted answers (rebinding, private addresses)
/// without a nameserver; [`StubResolver`] is the real one.
pub trait Resolve: Send + Sync + std::fmt::Debug + 'static {
    /// Resolves `name` (normalised: lower-case ASCII, no trailing dot) to its addresses.
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a>;
}

/// Why a name did not resolve. Each message says what the operator can check; causes are
/// chained with `#[source]`, never repeated in the message.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The nameserver answered NXDOMAIN: the name does not exist.
    #[error("{0}: no such domain (the nameserver answered NXDOMAIN)")]
    NoSuchName(String),
    /// The name exists but has neither A nor AAAA records.
    #[error("{0}: the name exists but has no A or AAAA records")]
    NoAddresses(String),
    /// No usable answer before the attempts ran out or the overall deadline passed.
    #[error(
        "{name}: no answer from the nameservers within {after:?}; check that they are \
         reachable from egressd and answering"
    )]
    Timeout { name: String, after: Duration },
    /// The last nameserver tried answered SERVFAIL, REFUSED or another failure code.
    #[error(
        "{name}: nameserver {server} answered {} (rcode {rcode}) and no other nameserver \
         answered; check its recursion and access settings", wire::rcode_name(*rcode)
    )]
    ServerFailure { name: String, server: SocketAddr, rcode: u8 },
    /// A local socket or the random source failed before anything reached a nameserver.
    #[error("cannot open a local DNS socket or draw a random query ID")]
    Io(#[source] std::io::Error),
    /// Sending to or receiving from a nameserver failed (ICMP unreachable, TCP refused, reset).
    #[error("exchanging DNS messages with nameserver {server} failed; check that it is reachable")]
    Nameserver {
        server: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// A reply that was ours (ID and question matched) but cannot be decoded or used.
    #[error("nameserver {0} sent a reply egressd cannot use")]
    Malformed(SocketAddr, #[source] WireError),
    /// The name cannot be carried by DNS (empty label, label over 63, name over 253, not
    /// printable ASCII); no query was sent.
    #[error("{name:?} cannot be looked up; no query was sent")]
    InvalidName {
        name: String,
        #[source]
        source: WireError,
    },
    /// The configuration lists no nameserver at all.
    #[error("no nameserver is configured; egressd cannot resolve names")]
    NoNameservers,
    /// The resolver configuration file could not be read.
    #[error("cannot read the resolver configuration {}", path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
