//! Who may use or change an environment when (internals §5.5 "Locking"):
//!
//! * per environment, a FIFO readers/writer gate (the original's `EnvironmentAccess`):
//!   executions take the read side for as long as they run from the prefix; install,
//!   uninstall and delete take the write side for the whole update. Readers share, a writer
//!   is alone, and a queued writer blocks the readers that come after it, so an install
//!   waits for the executions already running and is never starved by later ones;
//! * one global mutation lock (the original's `mutationTail`): every read-modify-write of
//!   the catalog is serialised, since two updates of different environments both rewrite
//!   the one `catalog.json`.
//!
//! Order: a gate first, then the mutation lock, held only around a catalog save; never wait
//! for a gate while holding the mutation lock (a writer of another environment would wait
//! for its own save behind us). tokio's `RwLock` and `Mutex` are FIFO; waiting futures that
//! are dropped leave their queue and take nothing with them. A gate exists only while
//! someone holds or waits for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

type GateMap = Arc<Mutex<HashMap<String, Arc<RwLock<()>>>>>;

/// All the environments' gates; one per store. (Catalog writes are serialised by the
/// store's own lock on the in-memory catalog, held only between awaits.)
#[derive(Debug, Default)]
pub struct Gates {
    gates: GateMap,
}

/// Keeps an environment's gate registered while it is held or waited for.
#[derive(Debug)]
struct Registration {
    gates: GateMap,
    env: String,
    /// `Some` until dropped.
    gate: Option<Arc<RwLock<()>>>,
}

impl Registration {
    fn gate(&self) -> Arc<RwLock<()>> {
        self.gate.clone().expect("present until drop")
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        // Our reference goes first, under the map's lock: if only the map's is left, no one
        // holds or waits for the gate.
        drop(self.gate.take());
        if gates.get(&self.env).is_some_and(|g| Arc::strong_count(g) == 1) {
            gates.remove(&self.env);
        }
    }
}

/// The read side of an environment: its prefix does not change while this lives.
#[derive(Debug)]
pub struct ReadGuard {
    // Declared first, so released before the registration is looked at.
    _guard: OwnedRwLockReadGuard<()>,
    _registration: Registration,
}

/// The write side of an environment: nobody runs from its prefix while this lives.
#[derive(Debug)]
pub struct WriteGuard {
    _guard: OwnedRwLockWriteGuard<()>,
    _registration: Registration,
}

impl Gates {
    fn register(&self, env: &str) -> Registration {
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        let gate = gates.entry(env.to_owned()).or_default().clone();
        Registration { gates: self.gates.clone(), env: env.to_owned(), gate: Some(gate) }
    }

    /// Waits for the read side of `env` (behind any writer queued before).
    pub async fn read(&self, env: &str) -> ReadGuard {
        let registration = self.register(env);
        ReadGuard { _guard: registration.gate().read_owned().await, _registration: registration }
    }

    /// Waits for the write side of `env` (behind everyone queued before).
    pub async fn write(&self, env: &str) -> WriteGuard {
        let registration = self.register(env);
        WriteGuard { _guard: registration.gate().write_owned().await, _registration: registration }
    }

    /// Gates currently held or waited for.
    #[cfg(test)]
    pub fn tracked(&self) -> usize {
        self.gates.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// A future polled by hand, so each test states exactly who is queued in which order
    /// (a poll that answers `Pending` has joined the queue); no runtime, no timing.
    struct Waiting<'a, T>(Pin<Box<dyn Future<Output = T> + 'a>>);

    impl<'a, T> Waiting<'a, T> {
        fn new(f: impl Future<Output = T> + 'a) -> Self {
            Waiting(Box::pin(f))
        }

        /// One poll: `Some` once through (never polled again after that).
        fn poll(&mut self) -> Option<T> {
            match self.0.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(t) => Some(t),
                Poll::Pending => None,
            }
        }

        /// Polls once and insists that it is queued.
        fn queued(mut self) -> Self {
            assert!(self.poll().is_none(), "expected to wait");
            self
        }
    }

    /// Through at once, or the test fails.
    fn now<T>(f: impl Future<Output = T>) -> T {
        Waiting::new(f).poll().expect("expected no wait")
    }

    #[test]
    fn readers_share_and_a_writer_is_alone() {
        let gates = Gates::default();
        let r1 = now(gates.read("e"));
        let r2 = now(gates.read("e"));
        let mut w = Waiting::new(gates.write("e")).queued();
        drop(r1);
        assert!(w.poll().is_none(), "one reader is still in");
        drop(r2);
        let held = w.poll().expect("the last reader left");
        let mut r3 = Waiting::new(gates.read("e")).queued();
        let mut w2 = Waiting::new(gates.write("e")).queued();
        drop(held);
        let r3 = r3.poll().expect("the writer left");
        assert!(w2.poll().is_none());
        drop(r3);
        assert!(w2.poll().is_some());
    }

    #[test]
    fn a_queued_writer_blocks_later_readers() {
        let gates = Gates::default();
        let running = now(gates.read("e"));
        let mut install = Waiting::new(gates.write("e")).queued();
        // Only a reader holds the gate, yet a later reader waits behind the install.
        let mut later = Waiting::new(gates.read("e")).queued();
        drop(running);
        assert!(later.poll().is_none(), "the install goes first");
        let install = install.poll().expect("the reader left");
        assert!(later.poll().is_none());
        drop(install);
        assert!(later.poll().is_some(), "the later reader sees the new revision");
    }

    #[test]
    fn waiters_go_in_arrival_order() {
        let gates = Gates::default();
        let w1 = now(gates.write("e"));
        let mut w2 = Waiting::new(gates.write("e")).queued();
        let mut r = Waiting::new(gates.read("e")).queued();
        let mut w3 = Waiting::new(gates.write("e")).queued();
        drop(w1);
        let w2 = w2.poll().expect("second in line");
        assert!(r.poll().is_none() && w3.poll().is_none());
        drop(w2);
        let r = r.poll().expect("third in line");
        assert!(w3.poll().is_none());
        drop(r);
        assert!(w3.poll().is_some());
    }

    #[test]
    fn environments_do_not_wait_for_each_other() {
        let gates = Gates::default();
        let _a = now(gates.write("a"));
        let _b = now(gates.write("b"));
        let _c = now(gates.read("c"));
        assert_eq!(gates.tracked(), 3);
    }

    #[test]
    fn a_cancelled_waiter_releases_nothing_it_does_not_hold() {
        let gates = Gates::default();
        // A cancelled writer queued between readers: the later reader is let in, the first
        // still holds its side.
        let running = now(gates.read("e"));
        let install = Waiting::new(gates.write("e")).queued();
        let mut later = Waiting::new(gates.read("e")).queued();
        drop(install);
        let later = later.poll().expect("the cancelled writer no longer queues anyone");
        let mut writer = Waiting::new(gates.write("e")).queued();
        drop(later);
        assert!(writer.poll().is_none(), "the first reader still holds the gate");
        drop(running);
        let writer = writer.poll().expect("both readers gone");
        // A cancelled waiter behind a writer does not release the writer's hold.
        let cancelled = Waiting::new(gates.write("e")).queued();
        drop(cancelled);
        let mut reader = Waiting::new(gates.read("e")).queued();
        assert!(reader.poll().is_none(), "the writer still holds the gate");
        drop(writer);
        drop(reader.poll().expect("the writer left"));
        assert_eq!(gates.tracked(), 0);
    }

    #[test]
    fn idle_gates_are_dropped() {
        let gates = Gates::default();
        for i in 0..100 {
            drop(now(gates.read(&format!("task-{i}"))));
            drop(now(gates.write(&format!("task-{i}"))));
        }
        assert_eq!(gates.tracked(), 0);
        let held = now(gates.read("e"));
        let waiting = Waiting::new(gates.write("e")).queued();
        drop(held);
        assert_eq!(gates.tracked(), 1, "a waiter keeps the gate");
        drop(waiting);
        assert_eq!(gates.tracked(), 0, "a cancelled waiter leaves nothing behind");
    }

    /// The hand-polled tests above use a waker that does nothing; this one checks that a
    /// real release wakes a writer waiting in another task.
    #[tokio::test]
    async fn a_release_wakes_the_waiting_writer() {
        let gates = Arc::new(Gates::default());
        let running = gates.read("starter-python").await;
        let update = tokio::spawn({
            let gates = gates.clone();
            async move { drop(gates.write("starter-python").await) }
        });
        // Until the writer has queued, a new reader still gets straight in.
        while Waiting::new(gates.read("starter-python")).poll().is_some() {
            tokio::task::yield_now().await;
        }
        assert!(!update.is_finished(), "the update waits for the execution");
        drop(running);
        update.await.unwrap();
        assert_eq!(gates.tracked(), 0);
    }
}
