//! The runnerd ↔ egressd control protocol: framed like every internal channel
//! ([`crate::channel`]), over egressd's control socket, after egressd checked the peer's uid.
//!
//! A connection carries one request and one answer. After a [`ControlResponse::Gateway`]
//! the connection stays open for as long as the sandbox runs: it is the *lease* that keeps
//! the gateway alive (egressd reaps a gateway only when no lease and no connection remain),
//! and it is released by closing it, which also happens when runnerd dies.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::route::ProxySetting;

/// The policy a gateway enforces (the permission epoch's `networkAccess`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatewayPolicy {
    /// The caller's content-derived revision: the gateway's identity and socket name.
    pub revision: String,
    pub allowed_domains: Vec<String>,
    pub allow_private_network: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlRequest {
    /// Liveness and self-description, for runnerd's `/health`.
    Status,
    /// The gateway of a policy revision, created on first use; the route is re-applied on
    /// every acquire, as the original does.
    Acquire { policy: GatewayPolicy, route: ProxySetting },
}

/// How far egressd confined itself after start-up (R-OPS-3).
pub use crate::confine::Confinement;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressStatus {
    pub version: String,
    pub gateways: u32,
    pub open_connections: u32,
    pub confinement: Confinement,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControlResponse {
    Status(EgressStatus),
    /// The gateway socket to bind into the sandbox at [`SANDBOX_SOCKET`].
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
    fn messages_round_trip_through_the_channel_framing() {
        let msgs = vec![
            ControlRequest::Status,
            ControlRequest::Acquire {
                policy: GatewayPolicy {
                    revision: "r1".into(),
                    allowed_domains: vec!["pypi.org".into(), "*.example.com:8443".into()],
                    allow_private_network: true,
                },
                route: ProxySetting::Url("http://proxy:3128".into()),
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
