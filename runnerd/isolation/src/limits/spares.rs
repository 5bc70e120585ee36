//! The spare pool of execution cgroups (issue #18): made, limited and verified ahead of the
//! run that takes them, next to the cgroup I/O of [`super::cgroup`]; [`super::detect`]'s
//! [`Enforcement`](super::Enforcement) holds one in a cgroup mode.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::Limits;
use super::cgroup::{CgroupError, ExecCgroup, Flavor, Hierarchy};

/// How many execution cgroups are kept made ahead
/// ([`Enforcement::finish_execution`](super::Enforcement::finish_execution)): one for the
/// next sequential run, one more for a second client.
pub const SPARES: usize = 2;

/// Names and makes execution cgroups, and keeps up to [`SPARES`] of them made ahead: the
/// `mkdir` in every hierarchy and the verified limit writes cost a launch about half a
/// millisecond on a v1 host (issue #18), so the end of each run makes the next run's while
/// its answer goes out. A spare is made, limited and verified exactly as on the launch path,
/// and no process has ever been in it: its counters start at zero like a new one's.
#[derive(Debug)]
pub(super) struct Maker {
    flavor: Flavor,
    hierarchies: Vec<Hierarchy>,
    counter: AtomicU64,
    spares: Mutex<Vec<ExecCgroup>>,
    /// Set at a graceful stop: a run ending after it makes no spare.
    closed: AtomicBool,
}

impl Maker {
    pub(super) fn new(flavor: Flavor, hierarchies: &[Hierarchy]) -> Option<Arc<Maker>> {
        Some(Arc::new(Maker {
            flavor,
            hierarchies: hierarchies.to_vec(),
            counter: AtomicU64::new(0),
            spares: Mutex::default(),
            closed: AtomicBool::new(false),
        }))
    }

    fn spares(&self) -> MutexGuard<'_, Vec<ExecCgroup>> {
        self.spares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh name: this runnerd's pid (so that a later runnerd can tell a crashed one's
    /// leftovers from a live one's) and a counter.
    fn next_name(&self) -> String {
        format!("exec-{}-{}", std::process::id(), self.counter.fetch_add(1, Ordering::Relaxed))
    }

    fn make(&self, limits: &Limits) -> Result<ExecCgroup, CgroupError> {
        ExecCgroup::create(self.flavor, &self.hierarchies, &self.next_name(), limits)
    }

    /// A spare with exactly these limits, else a new cgroup.
    pub(super) fn take(&self, limits: &Limits) -> Result<ExecCgroup, CgroupError> {
        let spare = {
            let mut spares = self.spares();
            spares.iter().position(|c| c.limits() == limits).map(|i| spares.swap_remove(i))
        };
        spare.map_or_else(|| self.make(limits), Ok)
    }

    /// Makes a spare with `limits` unless one is waiting; the oldest spare beyond
    /// [`SPARES`] is removed (its limits are the ones least recently asked for).
    pub(super) fn refill(&self, limits: &Limits) {
        if self.closed.load(Ordering::Acquire) || self.spares().iter().any(|c| c.limits() == limits) {
            return;
        }
        match self.make(limits) {
            Ok(made) => {
                let evicted = {
                    let mut spares = self.spares();
                    if self.closed.load(Ordering::Acquire) {
                        Some(made)
                    } else {
                        spares.push(made);
                        (spares.len() > SPARES).then(|| spares.remove(0))
                    }
                };
                if let Some(old) = evicted {
                    remove_or_warn(old);
                }
            }
            // Not an error of any run: the next launch makes its own and reports a failure.
            Err(e) => tracing::debug!(event = "cgroup_spare_failed", error = %common::error_chain(&e)),
        }
    }

    /// Closes the pool (at a graceful stop): a run ending after it makes no spare, and the
    /// spares made are removed.
    pub(super) fn close(&self) {
        let spares = {
            let mut held = self.spares();
            self.closed.store(true, Ordering::Release);
            std::mem::take(&mut *held)
        };
        spares.into_iter().for_each(remove_or_warn);
    }
}

fn remove_or_warn(cgroup: ExecCgroup) {
    if let Err(e) = cgroup.remove_blocking() {
        tracing::warn!(event = "cgroup_left", error = %common::error_chain(&e));
    }
}
