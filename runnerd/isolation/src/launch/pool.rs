//! The server-wide ceiling on output held in memory (issue #14 hole 4,
//! `max_buffered_output_bytes`): every chunk of kept output text ([`super::output`]) and every
//! large managed record being answered holds its bytes from one [`OutputPool`] through a
//! [`Held`], which gives them back when dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The server-wide ceiling on output held in memory: every execution's kept text, until
/// its answer has been sent (or dropped).
#[derive(Debug)]
pub struct OutputPool {
    ceiling: u64,
    used: AtomicU64,
    freed: tokio::sync::Notify,
}

impl OutputPool {
    pub fn new(ceiling: u64) -> Arc<OutputPool> {
        Arc::new(OutputPool { ceiling, used: AtomicU64::new(0), freed: tokio::sync::Notify::new() })
    }

    /// Holds `n` bytes (at most the whole ceiling) for output kept outside a budget (a
    /// stored record being answered), waiting for them to be free; `None` after `wait`.
    pub async fn acquire(self: &Arc<Self>, n: u64, wait: std::time::Duration) -> Option<Held> {
        let n = n.min(self.ceiling);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.take(n) {
                return Some(Held { pool: self.clone(), bytes: n, floor: false });
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    pub fn ceiling(&self) -> u64 {
        self.ceiling
    }

    /// Bytes held now, across all executions.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `want` bytes if they are free.
    fn take(&self, want: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(want).filter(|total| *total <= self.ceiling)
            })
            .is_ok()
    }

    /// Takes `n` bytes past the ceiling ([`FLOOR`]).
    fn force(&self, n: u64) -> bool {
        self.used.fetch_add(n, Ordering::AcqRel);
        true
    }

    fn give(&self, n: u64) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
            self.freed.notify_waiters();
        }
    }
}

/// What every execution may keep whatever the pool holds (its first chunks, 256 bytes
/// doubling: the marker always fits), so that a ceiling filled by others never empties a
/// run's output. Beyond the ceiling by at most this much per execution in flight.
pub const FLOOR: usize = 8 * 1024;

/// Bytes held from a pool, given back when dropped.
#[derive(Debug)]
pub struct Held {
    pool: Arc<OutputPool>,
    bytes: u64,
    /// Whether the first [`FLOOR`] bytes may be taken past the ceiling.
    floor: bool,
}

impl Held {
    /// An execution's output: its first [`FLOOR`] bytes are granted past the ceiling.
    pub(super) fn new(pool: &Arc<OutputPool>) -> Held {
        Held { pool: pool.clone(), bytes: 0, floor: true }
    }

    /// Takes `n` more bytes if the pool has them, or (an execution's first
    /// [`FLOOR`] bytes) even if it has not.
    pub(super) fn take(&mut self, n: usize) -> bool {
        let n = n as u64;
        let ok = self.pool.take(n) || (self.floor && self.bytes + n <= FLOOR as u64 && self.pool.force(n));
        if ok {
            self.bytes += n;
        }
        ok
    }

    pub(super) fn give(&mut self, n: usize) {
        let n = (n as u64).min(self.bytes);
        self.bytes -= n;
        self.pool.give(n);
    }

    /// Moves `n` of these bytes into a holder of their own.
    pub(super) fn split(&mut self, n: usize) -> Held {
        let n = (n as u64).min(self.bytes);
        self.bytes -= n;
        Held { pool: self.pool.clone(), bytes: n, floor: false }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.pool.give(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn acquire_waits_for_room_and_gives_up_after_its_wait() {
        let pool = OutputPool::new(1000);
        let first = pool.acquire(800, std::time::Duration::from_secs(5)).await.unwrap();
        assert!(pool.acquire(300, std::time::Duration::ZERO).await.is_none());
        let waiter = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire(5000, std::time::Duration::from_secs(60)).await.map(|h| h.bytes()) }
        });
        tokio::task::yield_now().await;
        drop(first);
        // More than the ceiling holds the whole ceiling.
        assert_eq!(waiter.await.unwrap(), Some(1000));
        assert_eq!(pool.used(), 0);
    }
}
