//! Pre-started sandboxes (issue #37). An agent calls again and again in the same workspace
//! with the same policy, so when an execution ends, the sandbox for the next call of the
//! same *shape* is started at once and left waiting: bwrap run, namespaces and mounts made,
//! seccomp on, the cgroup joined, the interpreter blocked reading its script from stdin. A
//! call with that shape takes it and writes its script; any other call launches as before.
//!
//! The shape is what the sandbox is, compared in full ([`Shape`]): bwrap's argv (the
//! environment, the policy's gateway path, the environment prefix, the limits' tmpfs sizes,
//! the seccomp profile …), the rlimits, the cgroup's limits, and the identity (device and
//! inode) of every directory and socket mounted by descriptor and of the working directory.
//! A workspace swapped for another directory, a gateway socket egressd made anew, a skill
//! package published again: each is another object, hence another shape, and the waiting
//! sandbox is discarded, never used. A pre-started sandbox serves exactly one execution and
//! its whole PID namespace then ends, as every sandbox's does (R-RUN-1, R-RUN-4).
//!
//! What it holds while it waits: no writer lease, no queue slot, no files (its `/tmp` is its
//! own, empty tmpfs); the workspace is bound, live, so the script sees it as it is when the
//! call starts. It is invisible to quota, receipts and `/status`. It is discarded when its
//! workspace is cleared, repaired, moved or deleted ([`Pool::forget`]), when a call of its
//! workspace has another shape (the policy's or the environment's revision changed, other
//! limits …), after [`PrestartSettings::idle`], and when runnerd stops; the pool is bounded
//! per node and per tenant.
//!
//! This module is the pool and its pure decisions; the bubblewrap backend starts and hands
//! over the sandboxes ([`super::bubblewrap`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::plan::{Idmap, Rlimit};
use common::seccomp::Profile;

use crate::launch::Waiting;
use crate::limits::{CgroupSource, ExecCgroup, Limits};

/// How many sandboxes wait, for whom, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrestartSettings {
    /// At most this many wait on this node; 0 turns pre-starting off.
    pub per_node: usize,
    /// At most this many wait for one tenant (a session's agent).
    pub per_tenant: usize,
    /// A sandbox not taken within this is discarded.
    pub idle: Duration,
}

impl Default for PrestartSettings {
    fn default() -> Self {
        PrestartSettings { per_node: 16, per_tenant: 8, idle: Duration::from_secs(120) }
    }
}

/// An execution's part of a job: who it runs for, and how the next sandbox's cgroup is
/// made. Probes and provisioning steps have none: they are never pre-started.
#[derive(Debug, Clone)]
pub struct Prestart {
    pub tenant: String,
    pub cgroups: CgroupSource,
}

/// What decides whether a job's sandbox may be started ahead ([`ahead`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Parts {
    /// A caller's own command (a probe, a provisioning step) instead of the interpreter.
    pub own_command: bool,
    /// Accelerator chips: probed and claimed right before each launch.
    pub chips: bool,
    /// Extra binds or variables (provisioning steps).
    pub extra: bool,
    /// A domain-allowlist gateway: egressd gives each sandbox a socket of its own for the
    /// life of its lease, so one started ahead would hold a socket the next call's lease is
    /// not (it could never match, and would keep a gateway open while it waits).
    pub egress: bool,
    /// The workspace is bound by descriptor (else its identity cannot be checked).
    pub by_descriptor: bool,
}

/// Whether a job with these parts may be served by a sandbox started ahead.
pub fn ahead(p: &Parts) -> bool {
    !p.own_command && !p.chips && !p.extra && !p.egress && p.by_descriptor
}

/// Everything a pre-started sandbox must match to serve a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub options: Vec<String>,
    pub command: Vec<String>,
    pub profile: Profile,
    pub rlimits: Vec<Rlimit>,
    /// The cgroup's limits (`None`: rlimits only).
    pub limits: Option<Limits>,
    pub idmaps: Vec<Idmap>,
    /// (device, inode) of each descriptor the sandbox mounts, in slot order.
    pub objects: Vec<(u64, u64)>,
    /// (device, inode) of the working directory when it is not the workspace root.
    pub cwd: Option<(u64, u64)>,
}

impl Shape {
    /// Whether the sandbox binds a scientific environment's prefix (by path: a change to
    /// any environment discards it).
    pub fn binds_environment(&self) -> bool {
        use super::microvm::argv::ENV_SHARE;
        self.options.iter().any(|o| o == crate::sandbox::argv::SCIENCE_ENV_MOUNT || o == ENV_SHARE)
    }
}

/// (device, inode) of an open file.
pub fn identity(fd: &impl std::os::fd::AsRawFd) -> std::io::Result<(u64, u64)> {
    runner_store::fsat::Stat::of_fd(fd).map(|st| (st.dev, st.ino))
}

/// Which waiting sandboxes a [`Pool::forget`] reaches.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    All,
    /// This workspace and every workspace beneath it.
    Beneath(&'a Path),
    /// This workspace root only.
    Exactly(&'a Path),
}

impl Scope<'_> {
    pub fn holds(&self, root: &Path) -> bool {
        match self {
            Scope::All => true,
            Scope::Beneath(r) => root.starts_with(r),
            Scope::Exactly(r) => root == *r,
        }
    }

    /// The keys of `map` in this scope: one lookup for one workspace (every execution that
    /// cannot be served ahead forgets its own), a walk otherwise.
    fn keys<V>(&self, map: &HashMap<PathBuf, V>) -> Vec<PathBuf> {
        match self {
            Scope::Exactly(r) => map.contains_key(*r).then(|| r.to_path_buf()).into_iter().collect(),
            _ => map.keys().filter(|k| self.holds(k)).cloned().collect(),
        }
    }
}

/// Why a call found no sandbox waiting for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// None waited for this workspace (its first call, or the last one was discarded).
    Cold,
    /// One waited, for another shape; it is discarded.
    Shape,
    /// One waited, but its bwrap had exited.
    Died,
    /// One waited, but bwrap had not finished setting it up within the time a call gives it.
    Unsettled,
}

impl Miss {
    pub const ALL: [Miss; 4] = [Miss::Cold, Miss::Shape, Miss::Died, Miss::Unsettled];

    pub fn name(self) -> &'static str {
        match self {
            Miss::Cold => "cold",
            Miss::Shape => "shape_changed",
            Miss::Died => "died",
            Miss::Unsettled => "unsettled",
        }
    }
}

/// Why a waiting sandbox was ended unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discard {
    /// Its workspace's call had another shape.
    Shape,
    /// Its bwrap had exited.
    Died,
    /// Its call found bwrap still setting it up.
    Unsettled,
    /// Not taken within [`PrestartSettings::idle`].
    Expired,
    /// Its workspace was cleared, repaired, moved or deleted.
    Workspace,
    /// A scientific environment changed (its prefix is bound by path).
    Environment,
    /// The node's or its tenant's bound made room for a newer one.
    Evicted,
    /// runnerd stops.
    Stopping,
}

impl Discard {
    /// Why a sandbox a call took but refused (for `miss`) is discarded.
    pub fn refused(miss: Miss) -> Discard {
        match miss {
            Miss::Died => Discard::Died,
            Miss::Unsettled => Discard::Unsettled,
            // A taken sandbox is never cold: it waited, for another shape.
            Miss::Cold | Miss::Shape => Discard::Shape,
        }
    }

    pub const ALL: [Discard; 8] = [
        Discard::Shape,
        Discard::Died,
        Discard::Unsettled,
        Discard::Expired,
        Discard::Workspace,
        Discard::Environment,
        Discard::Evicted,
        Discard::Stopping,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Discard::Shape => "shape_changed",
            Discard::Died => "died",
            Discard::Unsettled => "unsettled",
            Discard::Expired => "expired",
            Discard::Workspace => "workspace_changed",
            Discard::Environment => "environment_changed",
            Discard::Evicted => "evicted",
            Discard::Stopping => "stopping",
        }
    }
}

/// What a call finds: the sandbox waiting for its shape, or why none.
pub fn classify(waiting: Option<(&Shape, bool)>, wanted: &Shape) -> Result<(), Miss> {
    match waiting {
        None => Err(Miss::Cold),
        Some((shape, _)) if shape != wanted => Err(Miss::Shape),
        Some((_, false)) => Err(Miss::Died),
        Some((_, true)) => Ok(()),
    }
}

/// Whether one more sandbox may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Yes,
    /// After the one at this index of the list is evicted.
    Evicting(usize),
    /// Pre-starting is off.
    No,
}

/// Whether one more may wait for `tenant`, given who waits since when. A tenant at its own
/// bound gives up its own oldest. On a full node, a tenant already holding its fair share
/// (the node's bound over the tenants waiting, itself included) also gives up its own
/// oldest; one below it takes the oldest of the tenant holding the most, so that no caller
/// can fill the node and push every other one out.
pub fn admit(settings: &PrestartSettings, waiting: &[(&str, Instant)], tenant: &str) -> Admission {
    if settings.per_node == 0 || settings.per_tenant == 0 {
        return Admission::No;
    }
    let oldest_of = |who: &str| {
        waiting
            .iter()
            .enumerate()
            .filter(|(_, (t, _))| *t == who)
            .min_by_key(|(_, (_, at))| *at)
            .map(|(i, _)| i)
    };
    let held = |who: &str| waiting.iter().filter(|(t, _)| *t == who).count();
    let mine = held(tenant);
    if mine >= settings.per_tenant {
        return oldest_of(tenant).map_or(Admission::No, Admission::Evicting);
    }
    if waiting.len() < settings.per_node {
        return Admission::Yes;
    }
    let mut tenants: Vec<&str> = waiting.iter().map(|(t, _)| *t).collect();
    tenants.push(tenant);
    tenants.sort_unstable();
    tenants.dedup();
    let fair = settings.per_node.div_ceil(tenants.len());
    let victim = if mine >= fair {
        tenant
    } else {
        // The tenant holding the most (the older of two equal holders' oldest goes).
        let most = tenants.iter().filter(|t| **t != tenant).map(|t| held(t)).max().unwrap_or(0);
        let candidates = waiting.iter().enumerate().filter(|(_, (t, _))| *t != tenant && held(t) == most);
        match candidates.min_by_key(|(_, (_, at))| *at) {
            Some((i, _)) => return Admission::Evicting(i),
            None => tenant,
        }
    };
    oldest_of(victim).map_or(Admission::No, Admission::Evicting)
}

/// One sandbox waiting for its workspace's next call; `G` is what else the backend keeps
/// for it (a microVM's channel to its booted guest).
#[derive(Debug)]
pub struct Entry<G = ()> {
    pub shape: Shape,
    pub tenant: String,
    pub waiting: Waiting,
    /// The cgroup it joined; the run's, when it is taken.
    pub cgroup: Option<ExecCgroup>,
    pub since: Instant,
    pub guest: G,
}

/// The counters `/metrics` and `/health` show.
#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: [AtomicU64; Miss::ALL.len()],
    discards: [AtomicU64; Discard::ALL.len()],
    started: AtomicU64,
    failed: AtomicU64,
}

/// The pool's state for `/metrics` and `/health`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub settings: PrestartSettings,
    pub waiting: usize,
    /// Of those, the ones bwrap has finished setting up (their command runs, waiting).
    pub settled: usize,
    /// Resident memory of the waiting sandboxes' processes (RSS summed, so shared pages
    /// count once per process).
    pub memory_bytes: u64,
    pub hits: u64,
    pub misses: Vec<(&'static str, u64)>,
    pub discards: Vec<(&'static str, u64)>,
    pub started: u64,
    pub failed: u64,
}

#[derive(Debug)]
struct State<G> {
    /// The expiry sweep runs (started with the first sandbox).
    sweeping: bool,
    /// At most one per workspace root (executions of one workspace never overlap).
    entries: HashMap<PathBuf, Entry<G>>,
    /// Workspaces whose next sandbox is being started (counted against the bounds): its
    /// tenant and its shape.
    starting: HashMap<PathBuf, (String, Shape)>,
    /// Starts in flight that a [`Pool::forget`] reached: discarded when they arrive.
    voided: std::collections::HashSet<PathBuf>,
    /// runnerd stops: nothing more is started or kept.
    closed: bool,
}

impl<G> Default for State<G> {
    fn default() -> Self {
        State {
            sweeping: false,
            entries: HashMap::new(),
            starting: HashMap::new(),
            voided: Default::default(),
            closed: false,
        }
    }
}

/// The pre-started sandboxes of one backend (`G`: what it keeps beside each, [`Entry`]).
#[derive(Debug)]
pub struct Pool<G = ()> {
    settings: PrestartSettings,
    state: Mutex<State<G>>,
    counters: Counters,
    /// Wakes calls waiting for a start in flight for their workspace ([`Pool::take_started`]).
    filed: tokio::sync::Notify,
}

/// A place in the pool held for a sandbox being started.
#[derive(Debug)]
pub struct Reservation {
    pub root: PathBuf,
    pub tenant: String,
}

impl<G: Send + 'static> Pool<G> {
    pub fn new(settings: PrestartSettings) -> Arc<Pool<G>> {
        let filed = tokio::sync::Notify::new();
        Arc::new(Pool { settings, state: Mutex::default(), counters: Counters::default(), filed })
    }

    pub fn settings(&self) -> &PrestartSettings {
        &self.settings
    }

    fn lock(&self) -> MutexGuard<'_, State<G>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sandbox waiting for `root` if it has exactly `shape` and bwrap still runs; else
    /// why not (a waiting sandbox of another shape, or a dead one, is discarded). The
    /// caller then checks where it is ([`Pool::take`] is followed by [`Pool::served`] or
    /// [`Pool::refuse`]).
    pub fn take(&self, root: &Path, shape: &Shape) -> Result<Entry<G>, Miss> {
        let mut entry = self.lock().entries.remove(root);
        let alive = entry.as_mut().map(|e| e.waiting.alive());
        match (classify(entry.as_ref().map(|e| &e.shape).zip(alive), shape), entry) {
            (Ok(()), Some(entry)) => Ok(entry),
            (Err(miss), entry) => {
                if let Some(entry) = entry {
                    self.refuse(entry, miss);
                } else {
                    self.missed(miss);
                }
                Err(miss)
            }
            (Ok(()), None) => unreachable!("classify answers Ok only for a waiting sandbox"),
        }
    }

    /// [`Pool::take`], once the start in flight for `root`, if any, is filed (at most
    /// `limit`): a call right after the last one would otherwise launch afresh while that
    /// start, then unused, is spent.
    pub async fn take_started(&self, root: &Path, shape: &Shape, limit: Duration) -> Result<Entry<G>, Miss> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let filed = self.filed.notified();
            tokio::pin!(filed);
            filed.as_mut().enable();
            if !self.in_flight_for(root, shape) || tokio::time::timeout_at(deadline, filed).await.is_err() {
                return self.take(root, shape);
            }
        }
    }

    /// Whether a start in flight for `root` can serve a call of `shape` (what a call waits
    /// for): nothing filed yet, of that shape, and not voided by a forget since.
    fn in_flight_for(&self, root: &Path, shape: &Shape) -> bool {
        let state = self.lock();
        !state.entries.contains_key(root)
            && !state.voided.contains(root)
            && state.starting.get(root).is_some_and(|(_, s)| s == shape)
    }

    /// Completes once the start in flight for `root` is voided by a forget, or the pool
    /// closes (a start that takes long, such as a VM's boot, then ends early).
    pub async fn until_voided(&self, root: &Path) {
        loop {
            let filed = self.filed.notified();
            tokio::pin!(filed);
            filed.as_mut().enable();
            {
                let state = self.lock();
                if state.closed || state.voided.contains(root) {
                    return;
                }
            }
            filed.await;
        }
    }

    /// A taken sandbox serves its call.
    pub fn served(&self) {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
    }

    /// A taken sandbox does not serve its call (`miss` says why): it is discarded.
    pub fn refuse(&self, entry: Entry<G>, miss: Miss) {
        self.missed(miss);
        self.discard(entry, Discard::refused(miss));
    }

    /// A call that could be served ahead found nothing for its shape (`take` counts its
    /// own).
    pub fn missed(&self, miss: Miss) {
        self.counters.misses[Miss::ALL.iter().position(|m| *m == miss).unwrap_or(0)]
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Holds a place for `root`'s next sandbox, of `shape`, evicting what the bounds require;
    /// `None` when pre-starting is off or closed, or one is already being started for `root`.
    /// One still waiting for `root` is replaced: its call's `take` came first, so it was filed
    /// after it, for the call before (whose shape the newest call's replaces).
    pub fn reserve(&self, root: &Path, tenant: &str, shape: &Shape) -> Option<Reservation> {
        let mut state = self.lock();
        if state.closed || state.starting.contains_key(root) {
            return None;
        }
        if let Some(older) = state.entries.remove(root) {
            self.discard(older, Discard::Shape);
        }
        loop {
            let now = Instant::now();
            let ages: Vec<(PathBuf, String, Instant)> = state
                .entries
                .iter()
                .map(|(p, e)| (p.clone(), e.tenant.clone(), e.since))
                .chain(state.starting.iter().map(|(p, (t, _))| (p.clone(), t.clone(), now)))
                .collect();
            let view: Vec<(&str, Instant)> = ages.iter().map(|(_, t, at)| (t.as_str(), *at)).collect();
            match admit(&self.settings, &view, tenant) {
                Admission::No => return None,
                Admission::Yes => break,
                Admission::Evicting(i) => {
                    // A start in flight is never evicted (it counts as the newest); when the
                    // bound is all starts, this one is not made.
                    let entry = state.entries.remove(&ages[i].0)?;
                    self.discard(entry, Discard::Evicted);
                }
            }
        }
        state.starting.insert(root.to_owned(), (tenant.to_owned(), shape.clone()));
        Some(Reservation { root: root.to_owned(), tenant: tenant.to_owned() })
    }

    /// Puts a started sandbox in its reserved place, unless its workspace was forgotten
    /// since the reservation, or runnerd stops (then it is discarded).
    pub fn insert(
        &self,
        reservation: Reservation,
        shape: Shape,
        waiting: Waiting,
        cgroup: Option<ExecCgroup>,
        guest: G,
    ) {
        self.counters.started.fetch_add(1, Ordering::Relaxed);
        let tenant = reservation.tenant.clone();
        let entry = Entry { shape, tenant, waiting, cgroup, since: Instant::now(), guest };
        let mut state = self.lock();
        state.starting.remove(&reservation.root);
        let voided = state.voided.remove(&reservation.root);
        if voided || state.closed {
            let why = if state.closed { Discard::Stopping } else { Discard::Workspace };
            drop(state);
            self.discard(entry, why);
            // A call may still wait for this start (it checks `voided` when woken).
            self.filed.notify_waiters();
            return;
        }
        state.entries.insert(reservation.root, entry);
        drop(state);
        self.filed.notify_waiters();
    }

    /// A reserved start that failed: the place is given back.
    pub fn failed(&self, reservation: Reservation, error: &dyn std::error::Error) {
        let mut state = self.lock();
        state.starting.remove(&reservation.root);
        // A start that ended early because a forget voided it was discarded, not failed.
        if state.voided.remove(&reservation.root) {
            let workspace = Discard::ALL.iter().position(|d| *d == Discard::Workspace).unwrap_or(0);
            self.counters.discards[workspace].fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.failed.fetch_add(1, Ordering::Relaxed);
        }
        drop(state);
        self.filed.notify_waiters();
        tracing::debug!(event = "prestart_failed", workspace = %reservation.root.display(), error = %common::error_chain(error));
    }

    /// Discards what waits (or is being started) for the workspaces in `scope`: cleared,
    /// repaired, moved or no longer a workspace. For [`Discard::Environment`], only what
    /// binds a scientific environment; for [`Discard::Stopping`], the pool closes too.
    pub fn forget(&self, scope: Scope<'_>, why: Discard) {
        let reaches = |shape: &Shape| why != Discard::Environment || shape.binds_environment();
        let (gone, voided_any) = {
            let mut state = self.lock();
            state.closed |= why == Discard::Stopping;
            let in_flight: Vec<PathBuf> = scope
                .keys(&state.starting)
                .into_iter()
                .filter(|p| state.starting.get(p).is_some_and(|(_, shape)| reaches(shape)))
                .collect();
            let voided_any = !in_flight.is_empty();
            state.voided.extend(in_flight);
            let keys: Vec<PathBuf> = scope
                .keys(&state.entries)
                .into_iter()
                .filter(|p| state.entries.get(p).is_some_and(|e| reaches(&e.shape)))
                .collect();
            let gone: Vec<Entry<G>> = keys.iter().filter_map(|k| state.entries.remove(k)).collect();
            (gone, voided_any)
        };
        for entry in gone {
            self.discard(entry, why);
        }
        // Calls waiting for a start this voided stop waiting.
        if voided_any {
            self.filed.notify_waiters();
        }
    }

    /// Starts the task that discards what waited longer than the idle limit, once; it ends
    /// with the pool.
    pub fn ensure_sweeper(self: &Arc<Self>) {
        {
            let mut state = self.lock();
            if std::mem::replace(&mut state.sweeping, true) {
                return;
            }
        }
        let pool = Arc::downgrade(self);
        let every = (self.settings.idle / 4).max(Duration::from_secs(1));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match pool.upgrade() {
                    Some(pool) => pool.expire(Instant::now()),
                    None => return,
                }
            }
        });
    }

    /// Discards every sandbox that waited longer than the idle limit.
    pub fn expire(&self, now: Instant) {
        let idle = self.settings.idle;
        let gone: Vec<Entry<G>> = {
            let mut state = self.lock();
            let keys: Vec<PathBuf> = state
                .entries
                .iter()
                .filter(|(_, e)| now.saturating_duration_since(e.since) >= idle)
                .map(|(p, _)| p.clone())
                .collect();
            keys.iter().filter_map(|k| state.entries.remove(k)).collect()
        };
        for entry in gone {
            self.discard(entry, Discard::Expired);
        }
    }

    /// Ends an unused sandbox off the caller's path (in the caller's, when runnerd stops):
    /// its namespace gone first, then its cgroup removed.
    fn discard(&self, entry: Entry<G>, why: Discard) {
        self.counters.discards[Discard::ALL.iter().position(|d| *d == why).unwrap_or(0)]
            .fetch_add(1, Ordering::Relaxed);
        tracing::debug!(event = "prestart_discarded", reason = why.name());
        let Entry { waiting, cgroup, guest, .. } = entry;
        match tokio::runtime::Handle::try_current() {
            // runnerd stops: ended now, while the caller waits (the drops kill the sandbox,
            // then everything left in its cgroup, and remove the cgroup).
            _ if why == Discard::Stopping => drop((waiting, cgroup, guest)),
            Ok(rt) => {
                rt.spawn(async move {
                    waiting.end().await;
                    drop(guest);
                    if let Some(cgroup) = cgroup {
                        let _ = tokio::task::spawn_blocking(move || drop(cgroup)).await;
                    }
                });
            }
            // No runtime (a test's or runnerd's last moments): the drops end it.
            Err(_) => drop((waiting, cgroup, guest)),
        }
    }

    /// The counters, and the waiting sandboxes' number and memory.
    pub fn report(&self) -> Report {
        // Which sandboxes wait, under the lock; their processes and memory read from /proc
        // after it (the lock is the calls' too).
        let (inits, waiting) = {
            let state = self.lock();
            let inits: Vec<(Option<i32>, Option<i32>)> =
                state.entries.values().map(|e| e.waiting.roots()).collect();
            (inits, state.entries.len())
        };
        let settled = inits.iter().filter(|(_, init)| crate::launch::set_up(*init)).count();
        let pids: Vec<i32> =
            inits.into_iter().flat_map(|(bwrap, init)| crate::launch::sandbox_pids(bwrap, init)).collect();
        let c = &self.counters;
        Report {
            settings: self.settings,
            waiting,
            settled,
            memory_bytes: pids.iter().map(|p| resident_bytes(*p)).sum(),
            hits: c.hits.load(Ordering::Relaxed),
            misses: Miss::ALL
                .iter()
                .zip(&c.misses)
                .map(|(m, n)| (m.name(), n.load(Ordering::Relaxed)))
                .collect(),
            discards: Discard::ALL
                .iter()
                .zip(&c.discards)
                .map(|(d, n)| (d.name(), n.load(Ordering::Relaxed)))
                .collect(),
            started: c.started.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }
}

/// The most calls whose next sandbox waits for their end (a call that never ends — its
/// sandbox did not die — keeps its entry; the oldest go first beyond this).
pub const PENDING_MAX: usize = 256;

/// The next sandbox of each workspace whose call has not ended yet: a backend starts it at
/// [`super::Isolation::call_ended`], after the call's commit, so that its start does not
/// compete with the call's own answer for the CPU. Bounded by [`PENDING_MAX`].
#[derive(Debug)]
pub struct Pending<N> {
    held: Mutex<HashMap<PathBuf, (Instant, N)>>,
}

impl<N> Default for Pending<N> {
    fn default() -> Self {
        Pending { held: Mutex::new(HashMap::new()) }
    }
}

impl<N> Pending<N> {
    fn lock(&self) -> MutexGuard<'_, HashMap<PathBuf, (Instant, N)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `next` until `root`'s call ends; what it replaces, or the oldest beyond the
    /// bound, comes back to be released.
    pub fn hold(&self, root: PathBuf, next: N) -> Vec<N> {
        let mut held = self.lock();
        let mut dropped = Vec::new();
        if held.len() >= PENDING_MAX && !held.contains_key(&root) {
            let oldest = held.iter().min_by_key(|(_, (at, _))| *at).map(|(k, _)| k.clone());
            dropped.extend(oldest.and_then(|k| held.remove(&k)).map(|(_, n)| n));
        }
        dropped.extend(held.insert(root, (Instant::now(), next)).map(|(_, n)| n));
        dropped
    }

    /// What waits for `root`'s call to end.
    pub fn take(&self, root: &Path) -> Option<N> {
        self.lock().remove(root).map(|(_, n)| n)
    }

    /// Removes (and gives back) what waits in `scope` and `reached` selects.
    pub fn forget(&self, scope: Scope<'_>, reached: impl Fn(&N) -> bool) -> Vec<N> {
        let mut held = self.lock();
        let keys: Vec<PathBuf> =
            scope.keys(&held).into_iter().filter(|k| held.get(k).is_some_and(|(_, n)| reached(n))).collect();
        keys.iter().filter_map(|k| held.remove(k)).map(|(_, n)| n).collect()
    }
}

/// Removes an unused execution cgroup off the async threads (its removal may wait on the
/// kernel in every hierarchy); in place where there is no runtime.
pub fn release(cgroup: Option<ExecCgroup>) {
    let Some(cgroup) = cgroup else { return };
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(move || drop(cgroup))),
        Err(_) => drop(cgroup),
    }
}

/// A process's resident memory (`/proc/PID/statm`, which any user may read), 0 if gone.
fn resident_bytes(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/statm")).unwrap_or_default();
    let pages: u64 = text.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_sandbox_is_discarded_for_its_miss_and_every_reason_has_its_own_name() {
        for (miss, discard) in [
            (Miss::Shape, Discard::Shape),
            (Miss::Died, Discard::Died),
            (Miss::Unsettled, Discard::Unsettled),
        ] {
            assert_eq!(Discard::refused(miss), discard);
            assert_eq!(miss.name(), discard.name());
        }
        let names = |n: Vec<&str>| n.iter().collect::<std::collections::BTreeSet<_>>().len() == n.len();
        assert!(names(Miss::ALL.map(|m| m.name()).to_vec()));
        assert!(names(Discard::ALL.map(|d| d.name()).to_vec()));
    }

    fn shape(option: &str) -> Shape {
        Shape {
            options: vec![option.to_owned()],
            command: vec!["/usr/bin/bash".into(), "-s".into()],
            profile: Profile::Baseline,
            rlimits: Vec::new(),
            limits: None,
            idmaps: Vec::new(),
            objects: vec![(1, 2)],
            cwd: None,
        }
    }

    #[test]
    fn a_call_takes_only_a_live_sandbox_of_exactly_its_shape() {
        let wanted = shape("--bind-fd");
        let mut other_object = wanted.clone();
        other_object.objects = vec![(1, 3)];
        let mut other_cwd = wanted.clone();
        other_cwd.cwd = Some((1, 9));
        let mut other_limits = wanted.clone();
        other_limits.limits = Some(Limits { memory_bytes: 1, pids: 0, cpu_millicores: 0, tmp_bytes: 0 });
        type Case<'a> = (Option<(&'a Shape, bool)>, Result<(), Miss>);
        let cases: [Case; 7] = [
            (None, Err(Miss::Cold)),
            (Some((&wanted, true)), Ok(())),
            (Some((&wanted, false)), Err(Miss::Died)),
            (Some((&shape("--bind"), true)), Err(Miss::Shape)),
            (Some((&other_object, true)), Err(Miss::Shape)),
            (Some((&other_cwd, true)), Err(Miss::Shape)),
            (Some((&other_limits, true)), Err(Miss::Shape)),
        ];
        for (i, (waiting, expected)) in cases.into_iter().enumerate() {
            assert_eq!(classify(waiting, &wanted), expected, "case {i}");
        }
    }

    #[test]
    fn a_call_waits_only_for_a_start_that_can_serve_it() {
        let pool: Arc<Pool> = Pool::new(PrestartSettings::default());
        let (root, other_root) = (Path::new("/ws/a"), Path::new("/ws/b"));
        let (a, b) = (shape("--bind-fd"), shape("--bind"));
        assert!(!pool.in_flight_for(root, &a), "nothing started");
        let reservation = pool.reserve(root, "t", &a).unwrap();
        assert!(pool.in_flight_for(root, &a));
        assert!(!pool.in_flight_for(root, &b), "another shape: it could not serve the call");
        assert!(!pool.in_flight_for(other_root, &a), "another workspace");
        // A forget voids it: the call stops waiting for a start that will be discarded.
        pool.forget(Scope::Exactly(root), Discard::Workspace);
        assert!(!pool.in_flight_for(root, &a));
        pool.failed(reservation, &std::io::Error::other("test"));
        assert!(pool.reserve(root, "t", &a).is_some(), "the place is given back");
    }

    #[test]
    fn only_an_executions_plain_sandbox_is_started_ahead() {
        let plain = Parts { by_descriptor: true, ..Parts::default() };
        assert!(ahead(&plain));
        for (i, p) in [
            Parts { own_command: true, ..plain },
            Parts { chips: true, ..plain },
            Parts { extra: true, ..plain },
            Parts { egress: true, ..plain },
            Parts { by_descriptor: false, ..plain },
        ]
        .iter()
        .enumerate()
        {
            assert!(!ahead(p), "case {i}");
        }
    }

    #[test]
    fn the_bounds_evict_the_tenants_oldest_then_the_nodes_oldest() {
        let s = PrestartSettings { per_node: 3, per_tenant: 2, idle: Duration::from_secs(60) };
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        type Case<'a> = (&'a [(&'a str, Instant)], &'a str, Admission);
        let cases: [Case; 6] = [
            (&[], "a", Admission::Yes),
            (&[("a", at(5))], "a", Admission::Yes),
            // a at its bound: a's oldest (index 1) goes, not b's older one.
            (&[("b", at(0)), ("a", at(5)), ("a", at(9))], "a", Admission::Evicting(1)),
            // the node at its bound, c below its fair share (1 of 3): the oldest of the
            // tenant holding the most (a) goes, not the node's oldest (b's).
            (&[("a", at(7)), ("b", at(3)), ("a", at(9))], "c", Admission::Evicting(0)),
            (&[("a", at(7)), ("b", at(3))], "c", Admission::Yes),
            (&[("a", at(7))], "b", Admission::Yes),
        ];
        for (i, (waiting, tenant, expected)) in cases.into_iter().enumerate() {
            assert_eq!(admit(&s, waiting, tenant), expected, "case {i}");
        }
        let off = PrestartSettings { per_node: 0, ..s };
        assert_eq!(admit(&off, &[], "a"), Admission::No);
        // One caller cannot fill the node and push the others out: holding its fair share
        // (2 of 3 between a and c), c gives up its own oldest; b, holding none, takes a's.
        let wide = PrestartSettings { per_node: 3, per_tenant: 3, ..s };
        assert_eq!(admit(&wide, &[("a", at(1)), ("c", at(5)), ("c", at(6))], "c"), Admission::Evicting(1));
        assert_eq!(admit(&wide, &[("a", at(1)), ("a", at(2)), ("a", at(3))], "b"), Admission::Evicting(0));
        assert_eq!(admit(&wide, &[("a", at(1)), ("a", at(2)), ("a", at(3))], "a"), Admission::Evicting(0));
    }
}
