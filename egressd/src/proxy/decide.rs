//! The verdict on one request target (internals §3.4, research "Allowlist semantics"):
//! a pinned origin (issue #30: an operator's mirror by IP literal or single-label name, for
//! provisioning steps) is admitted exactly — its scheme, host and port; then IP literals are
//! refused, then the allowlist decides — before any DNS query, so a denied
//! name causes no lookup — then the name is resolved once, every answer is classified, and
//! the first permitted address is the one dialled (never re-resolved: no rebinding window).

use std::net::IpAddr;
use std::time::Duration;

use common::egress::address::{self, Class};
use common::egress::allowlist::Allowlist;
use common::egress::origin::{Origin, Scheme};
use common::egress::target::{Host, Target};

use crate::dns::Resolve;

/// What a gateway enforces (its identity is the hash of exactly this, normalised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub allowlist: Allowlist,
    pub allow_private_network: bool,
    /// Admitted exactly, whatever the allowlist and the private switch say; never an
    /// address no sandbox may reach (cloud metadata, unspecified, …).
    pub pinned: Vec<Origin>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Dial exactly this address.
    Allow { address: IpAddr },
    /// 403 with this reason.
    Deny { reason: String },
}

/// Decides. `own` is this host's interface addresses; `timeout` bounds the lookup.
pub async fn decide(
    policy: &Policy,
    scheme: Scheme,
    target: &Target,
    resolver: &dyn Resolve,
    own: &[IpAddr],
    timeout: Duration,
) -> Verdict {
    let deny = |reason: String| Verdict::Deny { reason };
    if policy.pinned.iter().any(|o| o.admits(scheme, target)) {
        return pinned(target, resolver, own, timeout).await;
    }
    let name = match &target.host {
        Host::Name(name) => name,
        Host::Ip(_) | Host::NumericName(_) => {
            return deny(format!(
                "{} is an IP address; sandbox network access allows domain names only",
                target.host_text()
            ));
        }
    };
    if !policy.allowlist.allows(name, target.port) {
        return deny(format!("{name}:{} is not in the sandbox network allowed domains", target.port));
    }
    let answers = match lookup(resolver, name, timeout).await {
        Ok(answers) => answers,
        Err(reason) => return deny(reason),
    };
    let mut never: Option<&'static str> = None;
    for ip in &answers {
        match address::classify(*ip, own) {
            Class::Public => return Verdict::Allow { address: *ip },
            Class::Private(_) if policy.allow_private_network => return Verdict::Allow { address: *ip },
            Class::Private(_) => {}
            Class::Never(label) => never = never.or(Some(label)),
        }
    }
    match never {
        Some(label) if answers.iter().all(|ip| matches!(address::classify(*ip, own), Class::Never(_))) => {
            deny(format!("{name} resolves only to addresses a sandbox may never reach ({label})"))
        }
        _ => deny(format!(
            "{name} resolves only to private or loopback addresses; enable private network access to allow it"
        )),
    }
}

/// One lookup of `name`, bounded by `timeout`; the error is the 403 reason.
async fn lookup(resolver: &dyn Resolve, name: &str, timeout: Duration) -> Result<Vec<IpAddr>, String> {
    match tokio::time::timeout(timeout, resolver.lookup(name)).await {
        Ok(Ok(answers)) => Ok(answers),
        Ok(Err(e)) => Err(format!("{name} could not be resolved: {e}")),
        Err(_) => Err(format!("{name} could not be resolved: no answer within {} ms", timeout.as_millis())),
    }
}

/// A pinned origin's address: the literal itself, or the name's first answer, unless it is
/// one no sandbox may ever reach.
async fn pinned(target: &Target, resolver: &dyn Resolve, own: &[IpAddr], timeout: Duration) -> Verdict {
    let deny = |reason: String| Verdict::Deny { reason };
    let answers = match &target.host {
        Host::Ip(ip) => vec![*ip],
        Host::Name(name) => match lookup(resolver, name, timeout).await {
            Ok(answers) => answers,
            Err(reason) => return deny(reason),
        },
        Host::NumericName(n) => return deny(format!("{n} is an IP address in a numeric spelling")),
    };
    for ip in &answers {
        match address::classify(*ip, own) {
            Class::Never(_) => {}
            Class::Public | Class::Private(_) => return Verdict::Allow { address: *ip },
        }
    }
    deny(format!("{} resolves only to addresses a sandbox may never reach", target.host_text()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dns::{LookupFuture, ResolveError};
    use common::egress::target::parse_connect_authority;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Answers from a table and records every query.
    #[derive(Debug, Default)]
    struct Table {
        answers: HashMap<String, Vec<IpAddr>>,
        queries: Mutex<Vec<String>>,
    }

    impl Resolve for Table {
        fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
            self.queries.lock().unwrap().push(name.to_owned());
            let found = self.answers.get(name).cloned();
            Box::pin(async move { found.ok_or_else(|| ResolveError::NoSuchName(name.to_owned())) })
        }
    }

    fn table(entries: &[(&str, &[&str])]) -> Table {
        Table {
            answers: entries
                .iter()
                .map(|(n, ips)| (n.to_string(), ips.iter().map(|s| s.parse().unwrap()).collect()))
                .collect(),
            queries: Mutex::default(),
        }
    }

    fn policy(entries: &[&str], private: bool) -> Policy {
        Policy { allowlist: Allowlist::parse(entries).0, allow_private_network: private, pinned: Vec::new() }
    }

    async fn verdict(p: &Policy, t: &Table, authority: &str) -> Verdict {
        let target = parse_connect_authority(authority).unwrap();
        decide(p, Scheme::Https, &target, t, &[], Duration::from_secs(1)).await
    }

    #[tokio::test]
    async fn pinned_origins_are_admitted_exactly() {
        let t = table(&[("mirror", &["10.0.0.7"]), ("meta", &["169.254.169.254"])]);
        let mut p = policy(&["allowed.example"], false);
        p.pinned = common::egress::origin::parse_all(&[
            "http://127.0.0.1:8080/ch",
            "http://10.1.2.3/conda",
            "https://mirror:3128",
            "http://meta:80",
        ])
        .0;
        let plain = |url: &str| common::egress::target::parse_absolute_url(url).unwrap().0;
        let decide_plain = |url: &'static str| {
            let (p, t) = (&p, &t);
            async move { decide(p, Scheme::Http, &plain(url), t, &[], Duration::from_secs(1)).await }
        };
        let allowed = |v: &Verdict, ip: &str| matches!(v, Verdict::Allow { address } if *address == ip.parse::<IpAddr>().unwrap());
        assert!(allowed(&decide_plain("http://127.0.0.1:8080/ch/repodata.json").await, "127.0.0.1"));
        assert!(allowed(&decide_plain("http://10.1.2.3/conda/x").await, "10.1.2.3"));
        assert!(allowed(&verdict(&p, &t, "mirror:3128").await, "10.0.0.7"));
        // Another port, another scheme, another host: the allowlist decides, and refuses.
        assert!(denied_with(&decide_plain("http://127.0.0.1:8081/ch").await, "IP address"));
        assert!(denied_with(&verdict(&p, &t, "127.0.0.1:8080").await, "IP address"));
        assert!(denied_with(&decide_plain("http://10.1.2.4/").await, "IP address"));
        assert!(denied_with(
            &decide_plain("http://mirror:3128/").await,
            "not in the sandbox network allowed domains"
        ));
        // Never a cloud metadata address, even pinned.
        assert!(denied_with(&decide_plain("http://meta/").await, "never reach"));
    }

    fn denied_with(v: &Verdict, needle: &str) -> bool {
        matches!(v, Verdict::Deny { reason } if reason.contains(needle))
    }

    #[tokio::test]
    async fn a_denied_name_causes_no_lookup() {
        let t = table(&[("evil.example", &["93.184.216.34"])]);
        let v = verdict(&policy(&["allowed.example"], false), &t, "evil.example:443").await;
        assert!(denied_with(&v, "evil.example:443 is not in the sandbox network allowed domains"), "{v:?}");
        assert!(t.queries.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn ip_literals_are_refused_without_lookup() {
        let t = table(&[]);
        let p = policy(&["allowed.example"], true);
        for authority in [
            "1.1.1.1:443",
            "[::1]:443",
            "[::127.0.0.1]:80",
            "[64:ff9b::a9fe:a9fe]:443",
            "127.1:80",
            "2130706433:80",
        ] {
            let v = verdict(&p, &t, authority).await;
            assert!(
                denied_with(&v, "is an IP address; sandbox network access allows domain names only"),
                "{authority}: {v:?}"
            );
        }
        assert!(t.queries.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn allowed_names_resolving_inside_are_denied_unless_private_is_on() {
        for inside in ["127.0.0.1", "10.0.0.1", "::ffff:127.0.0.1", "fd00::1"] {
            let t = table(&[("allowed.example", &[inside])]);
            let v = verdict(&policy(&["allowed.example"], false), &t, "allowed.example:443").await;
            assert!(denied_with(&v, "resolves only to private or loopback addresses"), "{inside}: {v:?}");
            let v = verdict(&policy(&["allowed.example"], true), &t, "allowed.example:443").await;
            assert!(matches!(v, Verdict::Allow { .. }), "{inside} with private on: {v:?}");
        }
    }

    #[tokio::test]
    async fn metadata_stays_denied_even_with_private_on() {
        let t = table(&[("allowed.example", &["169.254.169.254"])]);
        let v = verdict(&policy(&["allowed.example"], true), &t, "allowed.example:80").await;
        assert!(denied_with(&v, "may never reach"), "{v:?}");
    }

    #[tokio::test]
    async fn mixed_answers_pick_the_public_one() {
        let t = table(&[("allowed.example", &["10.0.0.7", "93.184.216.34"])]);
        let v = verdict(&policy(&["allowed.example"], false), &t, "allowed.example:443").await;
        assert_eq!(v, Verdict::Allow { address: "93.184.216.34".parse().unwrap() });
        assert_eq!(t.queries.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn resolution_failures_deny_with_the_reason() {
        let t = table(&[]);
        let v = verdict(&policy(&["allowed.example"], false), &t, "allowed.example:443").await;
        assert!(denied_with(&v, "allowed.example could not be resolved"), "{v:?}");
    }

    #[tokio::test]
    async fn ports_and_suffixes() {
        let t = table(&[
            ("a.example.com", &["93.184.216.34"]),
            ("example.com", &["93.184.216.34"]),
            ("allowed.example.com.evil.net", &["93.184.216.34"]),
            ("evilexample.com", &["93.184.216.34"]),
        ]);
        let p = policy(&["*.example.com", "pinned.example:8443"], false);
        assert!(matches!(verdict(&p, &t, "a.example.com:443").await, Verdict::Allow { .. }));
        for denied in [
            "example.com:443",
            "allowed.example.com.evil.net:443",
            "evilexample.com:443",
            "pinned.example:443",
        ] {
            assert!(
                denied_with(&verdict(&p, &t, denied).await, "not in the sandbox network allowed domains"),
                "{denied}"
            );
        }
    }
}
