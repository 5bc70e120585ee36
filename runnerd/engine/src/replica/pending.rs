//! The replicator's queue (issue #34): at most one entry per workspace — a newer head
//! replaces the one waiting, keeping the time the workspace first became unreplicated — so
//! memory is bounded by the number of workspaces, never by the number of commits. Pure: the
//! clock is passed in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::versioning::Ref;

/// One workspace whose head the bucket does not have yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub head: Ref,
    /// When the workspace became unreplicated (ms since the epoch): the oldest head waiting.
    pub since_ms: u64,
    /// Failed attempts at this head: a workspace that keeps failing (a damaged object) waits
    /// behind the others instead of holding them up.
    pub failures: u32,
}

/// The waiting workspaces, and the one being replicated.
#[derive(Debug, Default)]
pub struct Queue {
    waiting: HashMap<PathBuf, Pending>,
    /// Taken for replication: still unreplicated until it is done.
    in_flight: Option<(PathBuf, Pending)>,
}

impl Queue {
    /// A commit of `head` for the workspace `canonical` at `now_ms`.
    pub fn push(&mut self, canonical: &Path, head: Ref, now_ms: u64) {
        let since_ms = self
            .waiting
            .get(canonical)
            .map(|p| p.since_ms)
            .or_else(|| self.in_flight.as_ref().filter(|(c, _)| c == canonical).map(|(_, p)| p.since_ms))
            .unwrap_or(now_ms);
        self.waiting.insert(canonical.to_owned(), Pending { head, since_ms, failures: 0 });
    }

    /// A head found unreplicated by a scan (start-up's backfill): queued only when nothing
    /// for that workspace is waiting or in flight, since a commit queued meanwhile is newer
    /// than what the scan read. Answers whether it was queued.
    pub fn push_if_absent(&mut self, canonical: &Path, head: Ref, now_ms: u64) -> bool {
        let busy = self.waiting.contains_key(canonical)
            || self.in_flight.as_ref().is_some_and(|(c, _)| c == canonical);
        if !busy {
            self.waiting.insert(canonical.to_owned(), Pending { head, since_ms: now_ms, failures: 0 });
        }
        !busy
    }

    /// The workspace waiting longest among those that failed least, now in flight.
    pub fn take(&mut self) -> Option<(PathBuf, Pending)> {
        let oldest =
            self.waiting.iter().min_by_key(|(path, p)| (p.failures, p.since_ms, (*path).clone()))?.0.clone();
        let pending = self.waiting.remove(&oldest)?;
        self.in_flight = Some((oldest.clone(), pending.clone()));
        Some((oldest, pending))
    }

    /// The one in flight is done: replicated (`ok`), or it goes back to wait (unless a newer
    /// head is waiting already, which then keeps the older time).
    pub fn finish(&mut self, ok: bool) {
        let Some((canonical, pending)) = self.in_flight.take() else { return };
        match self.waiting.get_mut(&canonical) {
            Some(newer) => newer.since_ms = newer.since_ms.min(pending.since_ms),
            None if !ok => {
                let failures = pending.failures.saturating_add(1);
                self.waiting.insert(canonical, Pending { failures, ..pending });
            }
            None => {}
        }
    }

    /// A replication outside the queue (a requested backup) sent `head`: a waiting entry with
    /// that head is done.
    pub fn replicated(&mut self, canonical: &Path, head: &Ref) {
        if self.waiting.get(canonical).is_some_and(|p| &p.head == head) {
            self.waiting.remove(canonical);
        }
    }

    /// Workspaces not replicated yet (waiting or in flight).
    pub fn len(&self) -> usize {
        self.waiting.len() + usize::from(self.in_flight.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The workspace unreplicated longest, and since when.
    pub fn oldest(&self) -> Option<(&Path, u64)> {
        self.waiting
            .iter()
            .chain(self.in_flight.as_ref().map(|(c, p)| (c, p)))
            .min_by_key(|(_, p)| p.since_ms)
            .map(|(c, p)| (c.as_path(), p.since_ms))
    }

    /// Seconds the oldest unreplicated head has waited at `now_ms` (0 when none).
    pub fn lag_seconds(&self, now_ms: u64) -> f64 {
        self.oldest().map_or(0.0, |(_, since)| now_ms.saturating_sub(since) as f64 / 1000.0)
    }
}

/// How long to wait after `failures` failures in a row: 0.5 s doubling, at most `max_ms`.
pub fn backoff_ms(failures: u32, max_ms: u64) -> u64 {
    if failures == 0 {
        return 0;
    }
    500u64.saturating_mul(1 << failures.saturating_sub(1).min(20)).min(max_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::versioning::Pool;

    fn r(n: u8) -> Ref {
        Ref::new(Pool::AgentState, &format!("{n:02x}").repeat(32), 1, crate::versioning::RECORD_MEDIA_TYPE)
    }

    #[test]
    fn a_scan_never_replaces_what_a_commit_queued() {
        let mut q = Queue::default();
        let (a, b) = (Path::new("/d/a"), Path::new("/d/b"));
        q.push(a, r(2), 100);
        assert!(!q.push_if_absent(a, r(1), 200), "waiting: the commit's head is newer");
        assert!(q.push_if_absent(b, r(3), 200));
        let (path, _) = q.take().unwrap();
        assert_eq!(path, a);
        assert!(!q.push_if_absent(a, r(1), 300), "in flight");
        q.finish(true);
        assert_eq!(q.take().unwrap(), (b.to_owned(), Pending { head: r(3), since_ms: 200, failures: 0 }));
        q.finish(true);
        assert!(q.push_if_absent(a, r(4), 400));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn one_entry_per_workspace_keeping_the_oldest_time() {
        let mut q = Queue::default();
        let (a, b) = (Path::new("/d/a"), Path::new("/d/b"));
        q.push(a, r(1), 100);
        q.push(a, r(2), 200);
        q.push(b, r(3), 150);
        assert_eq!(q.len(), 2);
        assert_eq!(q.oldest(), Some((a, 100)));
        assert_eq!(q.lag_seconds(1100), 1.0);
        let (path, p) = q.take().unwrap();
        assert_eq!((path.as_path(), p), (a, Pending { head: r(2), since_ms: 100, failures: 0 }));
        // Still unreplicated while in flight.
        assert_eq!((q.len(), q.oldest()), (2, Some((a, 100))));
        // A commit during the flight waits again, with the older time.
        q.push(a, r(4), 300);
        q.finish(true);
        assert_eq!(q.len(), 2);
        assert_eq!(q.take().unwrap(), (a.to_owned(), Pending { head: r(4), since_ms: 100, failures: 0 }));
        q.finish(true);
        assert_eq!(q.take().unwrap().0, b);
        q.finish(true);
        assert!(q.is_empty());
        assert_eq!(q.lag_seconds(5000), 0.0);
    }

    #[test]
    fn a_failure_waits_again_and_a_backup_clears_its_head() {
        let mut q = Queue::default();
        let a = Path::new("/d/a");
        q.push(a, r(1), 10);
        q.take().unwrap();
        q.finish(false);
        // A younger workspace goes before the one that failed.
        let b = Path::new("/d/b");
        q.push(b, r(2), 20);
        assert_eq!(q.take().unwrap().0, b);
        q.finish(true);
        assert_eq!(q.take().unwrap().1, Pending { head: r(1), since_ms: 10, failures: 1 });
        q.finish(false);
        assert_eq!(q.oldest(), Some((a, 10)));
        q.replicated(a, &r(9));
        assert_eq!(q.len(), 1);
        q.replicated(a, &r(1));
        assert!(q.is_empty());
    }

    #[test]
    fn backoff_doubles_to_a_ceiling() {
        let got: Vec<u64> = (0..7).map(|n| backoff_ms(n, 10_000)).collect();
        assert_eq!(got, [0, 500, 1000, 2000, 4000, 8000, 10_000]);
        assert_eq!(backoff_ms(u32::MAX, 10_000), 10_000);
    }
}
