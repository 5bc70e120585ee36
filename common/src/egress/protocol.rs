//! The runnerd ↔ egressd control protocol: framed like every internal channel
//! ([`crate::channel`]), over egressd's control socket, after egressd checked the peer's uid.
//!
//! A connection carries one request and one answer. After a [`ControlResponse::Gateway`]
//! the connection stays open for as long as the sandbox runs: it is the *lease* that keeps
//! the gateway alive (egressd reaps a gateway only when no lease and no connection remain),
//! and it is released by closing it, which also happens when runnerd dies.
//!
//! Each acquire gets a socket of its own (one per sandbox): every connection on it is that
//! sandbox's, whatever process inside opened it, so connection caps count per sandbox; the
//! gateway behind it (the policy, its shared connection pool) is shared by every lease of
//! the same [`PolicyIdentity`].
//!
//! Layout changes bump [`crate::plan::PROTOCOL_VERSION`] (the framing's version): 4 added
//! `identity` and `sandbox_uid` to [`ControlRequest::Acquire`]; 5 added `decisions` to
//! [`EgressStatus`]; 6 added `pinned_origins` to [`GatewayPolicy`] (and the launch plan's
//! `idmaps`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::identity::PolicyIdentity;
use super::route::ProxySetting;

/// The policy a gateway enforces (the permission epoch's `networkAccess`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayPolicy {
    /// The caller's `networkAccess.revision`: recorded in egressd's audit events, selects
    /// nothing (the gateway is chosen by [`PolicyIdentity`]).
    pub revision: String,
    pub allowed_domains: Vec<String>,
    pub allow_private_network: bool,
    /// Origins admitted exactly, whatever the allowlist says ([`super::origin`]): the
    /// operator's mirrors named by IP literal or single-label name, for provisioning steps.
    /// Executions never send any.
    pub pinned_origins: Vec<String>,
}

impl GatewayPolicy {
    /// The gateway identity of this policy.
    pub fn identity(&self) -> PolicyIdentity {
        PolicyIdentity::of_pinned(&self.allowed_domains, &self.pinned_origins, self.allow_private_network)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Liveness and self-description, for runnerd's `/health`.
    Status,
    /// A lease on the gateway of `identity`, created on first use. egressd derives the
    /// identity itself and refuses a request whose `identity` differs. The route is this
    /// lease's own (a tenant's upstream proxy never carries another tenant's traffic), and
    /// only `sandbox_uid` (the host uid the sandbox runs as) may connect to the lease's socket.
    Acquire { policy: GatewayPolicy, route: ProxySetting, identity: PolicyIdentity, sandbox_uid: u32 },
}

/// How far egressd confined itself after start-up (R-OPS-3).
pub use crate::confinement::Confinement;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressStatus {
    pub version: String,
    pub gateways: u32,
    pub open_connections: u32,
    pub confinement: Confinement,
    /// Proxy decisions since egressd started, by verdict ([`Verdict::as_str`]), for
    /// runnerd's `GET /metrics`. Text on the wire, so that a verdict this runnerd does not
    /// know (a newer egressd's) still parses; runnerd counts it as `other`.
    pub decisions: Vec<(String, u64)>,
}

crate::named_enum! {
    /// egressd's verdict on one gateway connection: its `egress_decision` audit record's
    /// `decision`, and the key of [`EgressStatus::decisions`].
    #[derive(Default)]
    pub enum Verdict {
        /// Forwarded (a tunnel opened, or the request was sent upstream).
        Allowed => "allowed",
        /// The policy refused the target.
        Denied => "denied",
        /// The request head or its target could not be read as a proxy request.
        Malformed => "malformed",
        /// Allowed, but the upstream could not be reached or answered nothing.
        Failed => "failed",
        /// The client closed or timed out before a complete request head.
        #[default]
        NoRequest => "no_request",
        /// A peer other than the lease's sandbox user connected.
        Refused => "refused",
        /// The lease's or the pool's connection cap was reached.
        Limited => "limited",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlResponse {
    Status(EgressStatus),
    /// The lease's socket, to bind into the sandbox at [`SANDBOX_SOCKET`]:
    /// `<runtime dir>/eg/<16 lowercase hex>`.
    Gateway {
        socket_path: PathBuf,
    },
    /// Refused, with a sentence an operator (and the API caller) can act on.
    Refused {
        reason: String,
    },
}

/// Where the gateway socket appears inside a sandbox (internals §3.8).
pub const SANDBOX_SOCKET: &str = "/run/sciencediscovery/egress.sock";
/// Where the bridge binary appears inside a sandbox.
pub const SANDBOX_BRIDGE: &str = "/opt/sciencediscovery-net/egress-bridge";
/// The bridge's port on the sandbox's own loopback.
pub const BRIDGE_PORT: u16 = 18118;
/// The value of the four proxy variables a sandbox gets.
pub const PROXY_URL: &str = "http://127.0.0.1:18118";
/// Exactly these are injected (no `NO_PROXY`, no `ALL_PROXY`), in this order.
pub const PROXY_VARIABLES: [&str; 4] = ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{read_message, write_message};

    #[test]
    fn every_verdict_has_its_own_text() {
        let texts: Vec<&str> = Verdict::ALL.iter().map(|v| v.as_str()).collect();
        assert_eq!(texts, ["allowed", "denied", "malformed", "failed", "no_request", "refused", "limited"]);
        for v in Verdict::ALL {
            assert_eq!(Verdict::parse(v.as_str()), Some(*v));
        }
    }

    #[test]
    fn messages_round_trip_through_the_channel_framing() {
        let msgs = vec![
            ControlRequest::Status,
            ControlRequest::Acquire {
                identity: PolicyIdentity::of(&["pypi.org", "*.example.com:8443"], true),
                policy: GatewayPolicy {
                    revision: "r1".into(),
                    allowed_domains: vec!["pypi.org".into(), "*.example.com:8443".into()],
                    allow_private_network: true,
                    pinned_origins: vec!["http://127.0.0.1:8080".into()],
                },
                route: ProxySetting::Url("http://proxy:3128".into()),
                sandbox_uid: 1234,
            },
        ];
        for msg in msgs {
            let mut buf = Vec::new();
            write_message(&mut buf, &msg).unwrap();
            let back: ControlRequest = read_message(&mut buf.as_slice()).unwrap();
            assert_eq!(back, msg);
        }
    }
}
