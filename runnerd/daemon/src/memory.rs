//! Memory that returns after load (issue #15 item 10). runnerd keeps glibc's malloc (no new
//! crate); two settings and one habit make it give memory back:
//!
//! 1. `M_ARENA_MAX = 2`: glibc gives each thread that contends for the heap an arena of its
//!    own (up to 8 per core). tokio's workers and blocking threads each ended up with one,
//!    and memory freed in an arena stays there. Two arenas serve runnerd's load (a few
//!    threads allocate at once, briefly).
//! 2. `M_TRIM_THRESHOLD = 128 KiB`, set explicitly: glibc otherwise raises the threshold
//!    (and the mmap threshold) after the first large free, so a burst's buffers stay.
//! 3. After activity, once no request is in flight, `malloc_trim(0)` hands free pages of
//!    every arena back to the kernel (not only the top of the main heap).
//!
//! `RUNNERD_UNTUNED_MALLOC=1` leaves glibc's defaults and never trims: only so that
//! `runnerd-bench memory` can show the before and after in one run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often the trimmer looks whether load has ended.
pub const TRIM_EVERY: Duration = Duration::from_secs(5);

const ARENA_MAX: i32 = 2;
const TRIM_THRESHOLD: i32 = 128 * 1024;
const UNTUNED: &str = "RUNNERD_UNTUNED_MALLOC";

fn untuned() -> bool {
    std::env::var_os(UNTUNED).is_some_and(|v| v == "1")
}

/// The allocator settings; call before any thread starts (arenas are made per thread).
pub fn configure() {
    if untuned() {
        return;
    }
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two integers and changes only the allocator's parameters; it is
    // called before the runtime starts any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

/// Requests begun and ended, counted by the HTTP layer.
#[derive(Debug, Default)]
pub struct Activity {
    started: AtomicU64,
    ended: AtomicU64,
}

impl Activity {
    pub fn begin(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
    }

    pub fn end(&self) {
        self.ended.fetch_add(1, Ordering::Relaxed);
    }

    fn read(&self) -> (u64, u64) {
        // `ended` first: a request that ends between the loads reads as still in flight.
        let ended = self.ended.load(Ordering::Relaxed);
        (self.started.load(Ordering::Relaxed), ended)
    }
}

/// Whether to trim now: something ended since the last trim, and nothing is in flight.
/// Pure, so the rule is table-tested.
pub fn should_trim(ended_at_last_trim: u64, started: u64, ended: u64) -> bool {
    ended > ended_at_last_trim && started == ended
}

/// Hands free heap pages back to the kernel.
pub fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Trims after each burst of requests, for as long as the server runs.
pub async fn trimmer(activity: std::sync::Arc<Activity>) {
    if untuned() {
        return;
    }
    let mut last = 0;
    let mut tick = tokio::time::interval(TRIM_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (started, ended) = activity.read();
        if should_trim(last, started, ended) {
            last = ended;
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_after_a_burst_when_nothing_is_in_flight() {
        for (last, started, ended, trim) in [
            (0, 0, 0, false), // idle since start: nothing to give back
            (0, 5, 5, true),  // a burst ended
            (5, 5, 5, false), // already trimmed after it
            (5, 9, 7, false), // two still in flight
            (5, 9, 9, true),  // the next burst ended
            (0, 1, 0, false), // the first request still running
        ] {
            assert_eq!(should_trim(last, started, ended), trim, "{last} {started} {ended}");
        }
        let a = Activity::default();
        a.begin();
        assert_eq!(a.read(), (1, 0));
        a.end();
        assert_eq!(a.read(), (1, 1));
    }
}
