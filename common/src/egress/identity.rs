//! A gateway's identity (R-NET-4 "content-derived"): the sha256 of the *normalised* policy,
//! computed by runnerd and checked by egressd, never taken from the caller.
//!
//! The caller's `networkAccess.revision` is only echoed (`networkAccessRevision`) and logged:
//! if it selected the gateway, a tenant could send another tenant's revision with an
//! allowlist of its own first and have that tenant's correct policy refused (issue #14,
//! hole 8), or, worse, served by the squatter's gateway. Two requests share a gateway
//! exactly when their normalised policies are equal, whatever revision they name.
//!
//! The hashed text is `sciencediscovery-egress-policy-v1\n`, `allowPrivateNetwork=<bool>\n`,
//! then each normalised allowlist entry (formatted, deduplicated, sorted) followed by `\n`,
//! then, only when there are any, each pinned origin ([`super::origin`]) as
//! `origin=<scheme>://<host>:<port>\n` (sorted, deduplicated): a policy without pinned
//! origins keeps the identity it always had.
//! Entries never contain a newline (whitespace is refused by the parser), so the text is
//! unambiguous. Entries that do not parse are skipped, as the gateway skips them: they
//! change nothing that is enforced, so they change nothing in the identity.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::allowlist::Allowlist;

const DOMAIN: &str = "sciencediscovery-egress-policy-v1";

/// 64 lowercase hex digits of the sha256 of the normalised policy.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PolicyIdentity(String);

impl PolicyIdentity {
    /// The identity of an allowlist as a request states it (unparsable entries skipped).
    pub fn of<S: AsRef<str>>(allowed_domains: &[S], allow_private_network: bool) -> PolicyIdentity {
        PolicyIdentity::of_pinned::<S, &str>(allowed_domains, &[], allow_private_network)
    }

    /// The identity of a policy with pinned origins (unparsable entries and origins
    /// skipped, as the gateway skips them).
    pub fn of_pinned<S: AsRef<str>, O: AsRef<str>>(
        allowed_domains: &[S],
        pinned_origins: &[O],
        allow_private_network: bool,
    ) -> PolicyIdentity {
        let (allowlist, _rejected) = Allowlist::parse(allowed_domains);
        let (origins, _rejected) = super::origin::parse_all(pinned_origins);
        PolicyIdentity::of_parts(&allowlist, &origins, allow_private_network)
    }

    /// The identity of a parsed allowlist and parsed, sorted, deduplicated origins.
    pub fn of_parts(
        allowlist: &Allowlist,
        origins: &[super::origin::Origin],
        allow_private_network: bool,
    ) -> PolicyIdentity {
        PolicyIdentity::of_normalized(&allowlist.normalized(), origins, allow_private_network)
    }

    fn of_normalized(
        entries: &[String],
        origins: &[super::origin::Origin],
        allow_private_network: bool,
    ) -> PolicyIdentity {
        PolicyIdentity(hex(&Sha256::digest(canonical(entries, origins, allow_private_network).as_bytes())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 16 hex digits, for log lines.
    pub fn short(&self) -> &str {
        &self.0[..16.min(self.0.len())]
    }
}

impl fmt::Display for PolicyIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The hashed text (see the module documentation).
fn canonical(entries: &[String], origins: &[super::origin::Origin], allow_private_network: bool) -> String {
    let mut text = format!("{DOMAIN}\nallowPrivateNetwork={allow_private_network}\n");
    for entry in entries {
        text.push_str(entry);
        text.push('\n');
    }
    for origin in origins {
        text.push_str(&format!("origin={origin}\n"));
    }
    text
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn pinned_origins_change_the_identity_only_when_present() {
        let none: &[&str] = &[];
        assert_eq!(
            PolicyIdentity::of_pinned(&["a.example"], none, false),
            PolicyIdentity::of(&["a.example"], false)
        );
        let one = PolicyIdentity::of_pinned(&["a.example"], &["http://127.0.0.1:8080/ch"], false);
        assert_ne!(one, PolicyIdentity::of(&["a.example"], false));
        let again = PolicyIdentity::of_pinned(
            &["a.example"],
            &["HTTP://127.0.0.1:8080", "http://127.0.0.1:8080/x"],
            false,
        );
        assert_eq!(one, again, "normalised, deduplicated");
        let other_port = PolicyIdentity::of_pinned(&["a.example"], &["http://127.0.0.1:8081/ch"], false);
        assert_ne!(one, other_port);
    }

    use super::*;

    fn id(domains: &[&str], private: bool) -> PolicyIdentity {
        PolicyIdentity::of(domains, private)
    }

    #[test]
    fn the_identity_follows_the_enforced_policy_and_nothing_else() {
        let base = id(&["pypi.org", "*.example.com:8443"], false);
        assert_eq!(base.as_str().len(), 64);
        assert!(base.as_str().bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(base.short(), &base.as_str()[..16]);
        // Equal after normalisation: order, case, whitespace, a trailing dot, duplicates,
        // and entries the gateway would skip anyway.
        for same in [
            &["*.example.com:8443", "pypi.org"][..],
            &[" PyPI.org. ", "*.EXAMPLE.com:8443", "pypi.org"],
            &["pypi.org", "*.example.com:8443", "10.0.0.1", "not a domain", ""],
        ] {
            assert_eq!(id(same, false), base, "{same:?}");
        }
        // Different as soon as what is enforced differs.
        for (other, private) in [
            (&["pypi.org", "*.example.com:8443"][..], true),
            (&["pypi.org"], false),
            (&["pypi.org", "*.example.com"], false),
            (&["pypi.org", "example.com:8443"], false),
            (&["pypi.org", "*.example.com:8443", "files.pythonhosted.org"], false),
        ] {
            assert_ne!(id(other, private), base, "{other:?} private={private}");
        }
        assert_ne!(id(&[], false), id(&[], true));
    }

    #[test]
    fn the_hashed_text_is_stated_and_unambiguous() {
        assert_eq!(
            canonical(&["a.example".into(), "*.b.example:8443".into()], &[], true),
            "sciencediscovery-egress-policy-v1\nallowPrivateNetwork=true\na.example\n*.b.example:8443\n"
        );
        // A known answer (`printf '…' | sha256sum`), so a change of the derivation is a
        // visible, deliberate one.
        assert_eq!(
            PolicyIdentity::of_normalized(&[], &[], false).as_str(),
            "e0a644b5f7ba6b9224b6372a89a280d04a48aac9be85363419f065c8b8245ce0"
        );
    }
}
