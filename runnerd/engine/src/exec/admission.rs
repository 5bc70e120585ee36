//! Who may run when (contract §2A "Concurrency", api.md improvement 3):
//! * a bounded admission count (queued + running); beyond it, 503 `queue_full`;
//! * one execution at a time per session-agent (`[sessionId, agentId]`);
//! * one writer at a time per workspace; different workspaces run in parallel;
//! * at most `max_concurrent` sandboxes at once;
//! * a session-wide exclusive section for `POST /kernels/teardown`, which waits for the
//!   session's active executions and holds back later ones.
//!
//! Locks are taken in that fixed order (session, agent, workspace, slot), so they cannot
//! deadlock; tokio's locks are FIFO, so queues are fair. Per-key locks disappear when the
//! last holder or waiter is gone.

use std::collections::HashMap;
use std::hash::Hash;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{
    OwnedMutexGuard, OwnedRwLockReadGuard, OwnedRwLockWriteGuard, OwnedSemaphorePermit, RwLock, Semaphore,
};

use super::error::EngineError;

/// A lock per key, created on demand and removed when unused.
#[derive(Debug)]
struct Keyed<K: Eq + Hash + Clone, L: Default> {
    map: Arc<Mutex<HashMap<K, Arc<L>>>>,
}

impl<K: Eq + Hash + Clone, L: Default> Default for Keyed<K, L> {
    fn default() -> Self {
        Keyed { map: Arc::new(Mutex::new(HashMap::new())) }
    }
}

/// Keeps a key's lock registered while it is held or waited for.
#[derive(Debug)]
struct Entry<K: Eq + Hash + Clone, L> {
    map: Arc<Mutex<HashMap<K, Arc<L>>>>,
    key: K,
    /// Always `Some` until dropped.
    lock: Option<Arc<L>>,
}

impl<K: Eq + Hash + Clone, L> Entry<K, L> {
    fn lock(&self) -> Arc<L> {
        self.lock.clone().expect("present until drop")
    }
}

impl<K: Eq + Hash + Clone, L: Default> Keyed<K, L> {
    fn entry(&self, key: &K) -> Entry<K, L> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let lock = map.entry(key.clone()).or_default().clone();
        Entry { map: self.map.clone(), key: key.clone(), lock: Some(lock) }
    }

    fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl<K: Eq + Hash + Clone, L> Drop for Entry<K, L> {
    fn drop(&mut self) {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        // Drop our reference under the map lock; if only the map's is left, nobody holds
        // or waits for this key. (Checking before dropping ours would let two last holders
        // each see the other and both keep the entry.)
        drop(self.lock.take());
        if map.get(&self.key).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(&self.key);
        }
    }
}

/// A held lock and its registration; the guard is declared first so it drops first.
#[derive(Debug)]
struct Held<G, K: Eq + Hash + Clone, L> {
    _guard: G,
    _entry: Entry<K, L>,
}

/// Everything an admitted execution holds while it runs.
#[derive(Debug)]
pub struct Running {
    _slot: OwnedSemaphorePermit,
    _workspace: Held<OwnedMutexGuard<()>, PathBuf, tokio::sync::Mutex<()>>,
    _agent: Held<OwnedMutexGuard<()>, String, tokio::sync::Mutex<()>>,
    _session: Held<OwnedRwLockReadGuard<()>, String, RwLock<()>>,
}

/// What a managed execution holds while it runs: its workspace's FIFO and a slot.
#[derive(Debug)]
pub struct WorkspaceRun {
    _slot: OwnedSemaphorePermit,
    _workspace: Held<OwnedMutexGuard<()>, PathBuf, tokio::sync::Mutex<()>>,
}

/// A place in the admission count; released on drop.
#[derive(Debug)]
pub struct Ticket {
    admitted: Arc<AtomicUsize>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The session-wide exclusive section of a teardown.
#[derive(Debug)]
pub struct SessionExclusive {
    _held: Held<OwnedRwLockWriteGuard<()>, String, RwLock<()>>,
}

#[derive(Debug)]
pub struct Admission {
    capacity: usize,
    max_concurrent: usize,
    admitted: Arc<AtomicUsize>,
    slots: Arc<Semaphore>,
    sessions: Keyed<String, RwLock<()>>,
    agents: Keyed<String, tokio::sync::Mutex<()>>,
    workspaces: Keyed<PathBuf, tokio::sync::Mutex<()>>,
}

/// The original's queue key: `JSON.stringify([sessionId, agentId])`.
pub fn agent_key(session_id: &str, agent_id: &str) -> String {
    serde_json::to_string(&[session_id, agent_id]).unwrap_or_default()
}

impl Admission {
    pub fn new(capacity: usize, max_concurrent: usize) -> Admission {
        Admission {
            capacity,
            max_concurrent,
            admitted: Arc::new(AtomicUsize::new(0)),
            slots: Arc::new(Semaphore::new(max_concurrent)),
            sessions: Keyed::default(),
            agents: Keyed::default(),
            workspaces: Keyed::default(),
        }
    }

    /// Takes a place in the bounded queue, or answers 503 `queue_full` with `Retry-After`.
    pub fn admit(&self) -> Result<Ticket, EngineError> {
        let taken = self
            .admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < self.capacity).then_some(n + 1));
        match taken {
            Ok(_) => Ok(Ticket { admitted: self.admitted.clone() }),
            Err(_) => Err(EngineError::QueueFull { capacity: self.capacity, retry_after_s: 1 }),
        }
    }

    /// Executions holding a sandbox slot (synchronous and managed).
    pub fn running(&self) -> usize {
        self.max_concurrent.saturating_sub(self.slots.available_permits())
    }

    /// The most executions holding a sandbox slot at once.
    pub fn max_concurrent(&self) -> usize {
        self.max_concurrent
    }

    /// The most executions queued and running together (beyond: `queue_full`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queued + running executions.
    pub fn admitted(&self) -> usize {
        self.admitted.load(Ordering::SeqCst)
    }

    /// Waits for the session (shared), the agent, the workspace and a sandbox slot.
    pub async fn acquire(&self, session_id: &str, agent_key: &str, workspace: &PathBuf) -> Running {
        let session = self.sessions.entry(&session_id.to_owned());
        let session = Held { _guard: session.lock().read_owned().await, _entry: session };
        let agent = self.agents.entry(&agent_key.to_owned());
        let agent = Held { _guard: agent.lock().lock_owned().await, _entry: agent };
        let ws = self.workspaces.entry(workspace);
        let ws = Held { _guard: ws.lock().lock_owned().await, _entry: ws };
        let slot = self.slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        Running { _slot: slot, _workspace: ws, _agent: agent, _session: session }
    }

    /// Waits for the workspace (FIFO with every other writer of it in this process) and a
    /// sandbox slot: what a managed execution needs (it has no agent queue).
    pub async fn acquire_workspace(&self, workspace: &PathBuf) -> WorkspaceRun {
        let ws = self.workspaces.entry(workspace);
        let ws = Held { _guard: ws.lock().lock_owned().await, _entry: ws };
        let slot = self.slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        WorkspaceRun { _slot: slot, _workspace: ws }
    }

    /// Waits until no execution of the session runs, and holds later ones back.
    pub async fn session_exclusive(&self, session_id: &str) -> SessionExclusive {
        let entry = self.sessions.entry(&session_id.to_owned());
        SessionExclusive { _held: Held { _guard: entry.lock().write_owned().await, _entry: entry } }
    }

    /// Registered per-key locks (for tests: they must not leak).
    pub fn lock_count(&self) -> usize {
        self.sessions.len() + self.agents.len() + self.workspaces.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn keys_are_unambiguous() {
        assert_ne!(agent_key("a:b", "c"), agent_key("a", "b:c"));
        assert_eq!(agent_key("s", "main"), r#"["s","main"]"#);
    }

    #[test]
    fn capacity_is_bounded_and_released() {
        let a = Admission::new(2, 1);
        let t1 = a.admit().unwrap();
        let _t2 = a.admit().unwrap();
        let err = a.admit().unwrap_err();
        assert_eq!(err.code().as_str(), "queue_full");
        assert!(matches!(err, EngineError::QueueFull { retry_after_s: 1, .. }), "{err:?}");
        drop(t1);
        assert!(a.admit().is_ok());
    }

    #[tokio::test]
    async fn same_workspace_serialises_other_workspaces_run_together() {
        let a = Arc::new(Admission::new(10, 10));
        let w1 = PathBuf::from("/w1");
        let w2 = PathBuf::from("/w2");
        let first = a.acquire("s", &agent_key("s", "one"), &w1).await;
        // Another agent, another workspace: immediately.
        let other =
            tokio::time::timeout(Duration::from_millis(200), a.acquire("s", &agent_key("s", "two"), &w2))
                .await;
        assert!(other.is_ok());
        drop(other);
        // Another agent, same workspace: waits for the first.
        let a2 = a.clone();
        let w = w1.clone();
        let waiting = tokio::spawn(async move { a2.acquire("s", &agent_key("s", "two"), &w).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), waiting).await.unwrap().unwrap();
        assert_eq!(a.lock_count(), 0, "per-key locks must not leak");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_releases_never_leak_a_lock() {
        let a = Arc::new(Admission::new(100_000, 100_000));
        for round in 0..200 {
            let tasks: Vec<_> = (0..4)
                .map(|_| {
                    let a = a.clone();
                    tokio::spawn(async move {
                        let w = PathBuf::from(format!("/w{round}"));
                        drop(a.acquire("s", &agent_key("s", &format!("x{round}")), &w).await);
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        }
        assert_eq!(a.lock_count(), 0);
    }

    #[tokio::test]
    async fn teardown_waits_for_the_session_and_blocks_later_ones() {
        let a = Arc::new(Admission::new(10, 10));
        let active = a.acquire("s", &agent_key("s", "main"), &PathBuf::from("/w")).await;
        let a2 = a.clone();
        let teardown = tokio::spawn(async move { a2.session_exclusive("s").await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!teardown.is_finished());
        let a3 = a.clone();
        let later =
            tokio::spawn(async move { a3.acquire("s", &agent_key("s", "late"), &PathBuf::from("/x")).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!later.is_finished(), "a later execution must wait behind the teardown");
        // Another session is not affected.
        let other = tokio::time::timeout(
            Duration::from_millis(200),
            a.acquire("t", &agent_key("t", "x"), &PathBuf::from("/y")),
        )
        .await;
        assert!(other.is_ok());
        drop(other);
        drop(active);
        let exclusive = teardown.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!later.is_finished());
        drop(exclusive);
        drop(later.await.unwrap());
        assert_eq!(a.lock_count(), 0);
    }
}
