//! Which packages executions mount (issue #32). A package is mounted only by an execution
//! (bwrap binds it for the life of the sandbox; no workspace records it), so "in use" is
//! in memory: an execution that names a package holds it from the moment its request is
//! accepted (queued included) until it has ended, and `DELETE /skill-packages/:id` withdraws
//! a package only while nothing holds it. Both happen under one lock, so a package is
//! either held before it is withdrawn (the delete is refused) or withdrawn before it is
//! held (the execution finds it unpublished when it verifies it right before the launch).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The packages held, with how many executions hold each.
#[derive(Debug, Default)]
pub struct InUse {
    held: Mutex<HashMap<String, usize>>,
}

/// One execution's hold on a package; let go when dropped.
#[derive(Debug)]
pub struct Hold {
    registry: Arc<InUse>,
    id: String,
}

impl InUse {
    pub fn new() -> Arc<InUse> {
        Arc::new(InUse::default())
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        // The map stays consistent whatever panicked while it was locked (one insert or
        // one decrement at a time).
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `id` for one execution.
    pub fn hold(self: &Arc<Self>, id: &str) -> Hold {
        *self.held().entry(id.to_owned()).or_default() += 1;
        Hold { registry: Arc::clone(self), id: id.to_owned() }
    }

    /// How many executions hold `id` now.
    #[cfg(test)]
    pub fn count(&self, id: &str) -> usize {
        self.held().get(id).copied().unwrap_or(0)
    }

    /// Runs `withdraw` while no execution holds `id`, with the lock held so none can begin
    /// to; `Err(n)` (and nothing run) while `n` executions hold it.
    pub fn unless_held<T>(&self, id: &str, withdraw: impl FnOnce() -> T) -> Result<T, usize> {
        let held = self.held();
        match held.get(id).copied().unwrap_or(0) {
            0 => Ok(withdraw()),
            n => Err(n),
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut held = self.registry.held();
        if let Some(n) = held.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_count_and_refuse_a_withdrawal_until_all_are_let_go() {
        let r = InUse::new();
        let a = r.hold("p");
        let b = r.hold("p");
        let other = r.hold("q");
        assert_eq!((r.count("p"), r.count("q"), r.count("x")), (2, 1, 0));
        assert_eq!(r.unless_held("p", || "withdrawn"), Err(2));
        drop(a);
        assert_eq!(r.unless_held("p", || "withdrawn"), Err(1));
        drop(b);
        assert_eq!(r.unless_held("p", || "withdrawn"), Ok("withdrawn"));
        assert_eq!(r.count("q"), 1, "another package's hold is its own");
        drop(other);
        assert!(r.held().is_empty(), "nothing is left behind");
    }
}
