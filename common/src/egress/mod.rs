//! Egress policy: pure functions shared by egressd and runnerd (R-NET-*).
//!
//! The gateway's decision for one proxy request, in order, each step a function here:
//! 1. parse the request target ([`target`]): the CONNECT authority or the absolute-form URL,
//!    never the `Host` header; malformed → 400;
//! 2. refuse IP literals and numeric spellings of them ([`Host::Ip`], [`Host::NumericName`]);
//! 3. match the normalised name and port against the [`Allowlist`] — before any DNS query,
//!    so a denied name causes no lookup;
//! 4. resolve once, [`classify`] every answer, dial exactly one vetted address;
//! 5. pick the upstream [`Route`]: direct, or through the deployment's own proxy.
//!
//! A gateway is identified by its normalised policy ([`identity`]), never by the caller's
//! revision.
//!
//! I/O (sockets, DNS, interface addresses) stays in egressd; everything here is table-tested.

pub mod address;
pub mod allowlist;
pub mod identity;
pub mod origin;
pub mod protocol;
pub mod route;
pub mod target;

pub use address::{Class, classify, permitted};
pub use allowlist::{Allowlist, AllowlistError, Entry, Pattern};
pub use identity::PolicyIdentity;
pub use route::{ProxyEndpoint, ProxySetting, Route, RouteError, route_for};
pub use target::{Host, Target, TargetError, normalize_host, parse_absolute_url, parse_connect_authority};
