//! This host's own interface addresses: a name that resolves to one of them would reach
//! egressd's host itself (research table, last row), so they are classified private.
//! Interfaces change rarely; the list is refreshed at most every few seconds.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REFRESH: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub struct OwnAddresses {
    cache: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>>,
    fixed: Option<Arc<Vec<IpAddr>>>,
}

impl OwnAddresses {
    /// A fixed list instead of the kernel's (tests).
    pub fn fixed(list: Vec<IpAddr>) -> OwnAddresses {
        OwnAddresses { cache: Mutex::default(), fixed: Some(Arc::new(list)) }
    }

    /// The current list (canonical forms), read from the kernel when the cache is stale.
    pub fn get(&self) -> Arc<Vec<IpAddr>> {
        if let Some(list) = &self.fixed {
            return list.clone();
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, list)) = cache.as_ref()
            && at.elapsed() < REFRESH
        {
            return list.clone();
        }
        let list = Arc::new(read());
        *cache = Some((Instant::now(), list.clone()));
        list
    }
}

/// Every address of every interface; an unreadable list is empty (the classification
/// table still denies loopback and the private ranges).
fn read() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!(event = "own_addresses_unreadable", "could not list this host's interface addresses");
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|ifa| ifa.address)
        .filter_map(|a| {
            if let Some(v4) = a.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()).to_canonical())
            }
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_among_our_own_addresses() {
        let own = OwnAddresses::default();
        let list = own.get();
        assert!(list.contains(&IpAddr::from([127, 0, 0, 1])), "{list:?}");
        assert!(Arc::ptr_eq(&list, &own.get()), "a second read within the refresh interval is cached");
    }
}
