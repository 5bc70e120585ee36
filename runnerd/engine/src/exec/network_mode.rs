//! The network policy a request's permission epoch names (`permissionEpoch.networkPolicy`,
//! when `networkAccess.mode` agrees; contract §2A "Network policy"): `none`,
//! `domain-allowlist`, or a text this runner does not support — kept as sent, because the
//! run is refused later (`network_unavailable`, when it is prepared) with a message that
//! quotes it, and a result echoes it as `networkPolicy`.

use serde::{Serialize, Serializer};

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum NetworkMode {
    /// No network: the sandbox has no interface but loopback.
    #[default]
    None,
    /// Egress through egressd's gateway for the policy's allowlist.
    DomainAllowlist,
    /// A policy this runner does not support, as the request spelled it.
    Other(String),
}

impl NetworkMode {
    /// The policies this runner supports.
    pub const SUPPORTED: [NetworkMode; 2] = [NetworkMode::None, NetworkMode::DomainAllowlist];

    /// The mode `text` names; any other text is [`NetworkMode::Other`].
    pub fn parse(text: &str) -> NetworkMode {
        match text {
            "none" => NetworkMode::None,
            "domain-allowlist" => NetworkMode::DomainAllowlist,
            other => NetworkMode::Other(other.to_owned()),
        }
    }

    /// The policy's text, as the request sent it.
    pub fn as_str(&self) -> &str {
        match self {
            NetworkMode::None => "none",
            NetworkMode::DomainAllowlist => "domain-allowlist",
            NetworkMode::Other(text) => text,
        }
    }
}

impl From<&str> for NetworkMode {
    fn from(text: &str) -> NetworkMode {
        NetworkMode::parse(text)
    }
}

impl std::fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// As its text (a result's `networkPolicy`).
impl Serialize for NetworkMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mode_is_the_text_it_was_read_from() {
        for mode in NetworkMode::SUPPORTED {
            assert_eq!(NetworkMode::parse(mode.as_str()), mode);
        }
        for text in ["None", "domain_allowlist", "", "open \"all\""] {
            let mode = NetworkMode::parse(text);
            assert_eq!(mode, NetworkMode::Other(text.to_owned()));
            assert_eq!(mode.as_str(), text);
            assert_eq!(serde_json::to_value(&mode).unwrap(), text);
        }
        assert_eq!(serde_json::to_value(NetworkMode::DomainAllowlist).unwrap(), "domain-allowlist");
    }
}
