//! The status view's inventory cache (internals §4.5): a value lives for its TTL, counted
//! from when its load began (the original checks the TTL against the inventory's
//! `capturedAt`, taken before the probes), callers arriving during a load wait for that one
//! load, a failed load is not kept, and `refresh` (or [`Cache::invalidate`]) forces a new
//! one — unless a load was already running when the refresh was asked for: like the
//! original (`invalidate()` then a `get` that joins the load in flight), it takes that
//! load's answer rather than probing every chip a second time. Executions never read it.

use std::future::Future;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Cache<T> {
    slot: tokio::sync::Mutex<Option<Entry<T>>>,
}

#[derive(Debug)]
struct Entry<T> {
    started: Instant,
    finished: Instant,
    value: T,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Cache { slot: tokio::sync::Mutex::new(None) }
    }
}

impl<T: Clone> Cache<T> {
    /// The cached value if younger than `ttl` (and not `refresh`), else `load`'s, kept only
    /// when `keep` says the load succeeded.
    pub async fn get<Fut: Future<Output = T>>(
        &self,
        refresh: bool,
        ttl: Duration,
        load: impl FnOnce() -> Fut,
        keep: impl Fn(&T) -> bool,
    ) -> T {
        let asked = Instant::now();
        // Held across the load: concurrent callers share it.
        let mut slot = self.slot.lock().await;
        if let Some(e) = slot.as_ref() {
            let in_flight_when_asked = e.finished > asked;
            if in_flight_when_asked || (!refresh && e.started.elapsed() < ttl) {
                return e.value.clone();
            }
        }
        let started = Instant::now();
        let value = load().await;
        *slot = keep(&value).then(|| Entry { started, finished: Instant::now(), value: value.clone() });
        value
    }

    pub async fn invalidate(&self) {
        *self.slot.lock().await = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    async fn get(
        cache: &Cache<Result<u32, u32>>,
        loads: &AtomicU32,
        refresh: bool,
        ttl: Duration,
        fail: bool,
    ) -> Result<u32, u32> {
        cache
            .get(
                refresh,
                ttl,
                || async {
                    let n = loads.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if fail { Err(n) } else { Ok(n) }
                },
                |v| v.is_ok(),
            )
            .await
    }

    #[tokio::test]
    async fn ttl_refresh_invalidate_and_failures() {
        let cache = Cache::default();
        let loads = AtomicU32::new(0);
        let long = Duration::from_secs(60);
        assert_eq!(get(&cache, &loads, false, long, false).await, Ok(1));
        assert_eq!(get(&cache, &loads, false, long, false).await, Ok(1), "within the TTL");
        assert_eq!(get(&cache, &loads, true, long, false).await, Ok(2), "refresh drops it");
        cache.invalidate().await;
        assert_eq!(get(&cache, &loads, false, long, false).await, Ok(3));
        assert_eq!(get(&cache, &loads, false, Duration::ZERO, false).await, Ok(4), "expired");
        assert_eq!(get(&cache, &loads, true, long, true).await, Err(5));
        assert_eq!(get(&cache, &loads, false, long, false).await, Ok(6), "a failure is not cached");
    }

    #[tokio::test]
    async fn the_ttl_counts_from_the_start_of_the_load() {
        let cache = Cache::default();
        let loads = AtomicU32::new(0);
        // The load takes 20 ms; a 15 ms TTL counted from its start has run out when it ends.
        assert_eq!(get(&cache, &loads, false, Duration::from_millis(15), false).await, Ok(1));
        assert_eq!(get(&cache, &loads, false, Duration::from_millis(15), false).await, Ok(2));
    }

    #[tokio::test]
    async fn a_refresh_asked_while_a_load_runs_takes_that_load_and_probes_nothing_more() {
        let cache = Cache::default();
        let loads = AtomicU32::new(0);
        let long = Duration::from_secs(60);
        let late_refresh = async {
            tokio::time::sleep(Duration::from_millis(5)).await; // the first load is running
            get(&cache, &loads, true, long, false).await
        };
        let (a, b) = tokio::join!(get(&cache, &loads, false, long, false), late_refresh);
        assert_eq!((a, b), (Ok(1), Ok(1)));
        assert_eq!(get(&cache, &loads, true, long, false).await, Ok(2), "a refresh with none running loads");
    }

    #[tokio::test]
    async fn concurrent_callers_share_one_load() {
        let cache = Arc::new(Cache::default());
        let loads = Arc::new(AtomicU32::new(0));
        let long = Duration::from_secs(60);
        let (a, b, c) = tokio::join!(
            get(&cache, &loads, false, long, false),
            get(&cache, &loads, false, long, false),
            get(&cache, &loads, false, long, false)
        );
        assert_eq!((a, b, c), (Ok(1), Ok(1), Ok(1)));
        assert_eq!(loads.load(Ordering::SeqCst), 1);
    }
}
