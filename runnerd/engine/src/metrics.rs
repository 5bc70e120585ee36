//! `GET /metrics` (api.md improvement 6): one registry, held by the [`App`](crate::app::App),
//! fed by one-line hooks where things happen, encoded in the OpenMetrics text format (which
//! Prometheus scrapes natively) through the Prometheus project's own client crate.
//!
//! Every label value comes from a closed set (route names, error codes, profiles, steps,
//! verdicts): nothing a caller sends becomes a label, so a hostile client cannot grow the
//! registry.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use common::egress::protocol::Verdict;

use crate::exec::Outcome;

/// The exposition format's media type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// Launch latency: 1 ms … ~16 s.
fn launch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Durations of whole executions and commits: 5 ms … ~80 min.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 20))
}

/// Phases of one execution: 10 µs … ~10 s.
fn phase_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_01, 2.0, 20))
}

/// Where one synchronous execution spends its time (`runner_execution_phase_seconds`), so
/// that a regression shows which step it is in (issue #18): each phase is the time from the
/// previous mark to its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The request's checks, workspace resolution and egress (the JSON body is parsed
    /// before, by the HTTP layer).
    Parse,
    /// Waiting for the execution's place (queue, session and workspace slots).
    Admit,
    /// Admission and the writer lease of the workspace (shared with the API process).
    Lease,
    /// The quota walk, the sandbox's argv and cgroup, up to bubblewrap's exec.
    Launch,
    /// The sandbox running, from bubblewrap's exec to its end.
    Wait,
    /// The quota walk after the run and the version snapshot of the tree.
    Snapshot,
    /// Storing the version record and moving the head.
    Commit,
    /// Releasing the lease and the admission, and building the result.
    Answer,
}

impl Phase {
    pub const ALL: [Phase; 8] = [
        Phase::Parse,
        Phase::Admit,
        Phase::Lease,
        Phase::Launch,
        Phase::Wait,
        Phase::Snapshot,
        Phase::Commit,
        Phase::Answer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Parse => "parse",
            Phase::Admit => "admit",
            Phase::Lease => "lease",
            Phase::Launch => "launch",
            Phase::Wait => "wait",
            Phase::Snapshot => "snapshot",
            Phase::Commit => "commit",
            Phase::Answer => "answer",
        }
    }
}

/// The phase marks of one execution: [`PhaseClock::mark`] charges the time since the
/// previous mark (or the clock's start) to a phase. Shared by reference through the
/// execution's audit record, hence the (never contended) mutex.
#[derive(Debug)]
pub struct PhaseClock {
    state: Mutex<(std::time::Instant, [Duration; 8])>,
}

impl Default for PhaseClock {
    fn default() -> Self {
        PhaseClock::new()
    }
}

impl PhaseClock {
    /// A clock started now.
    pub fn new() -> PhaseClock {
        PhaseClock { state: Mutex::new((std::time::Instant::now(), [Duration::ZERO; 8])) }
    }

    /// Charges the time since the previous mark to `phase`.
    pub fn mark(&self, phase: Phase) {
        self.split(phase, Duration::MAX, phase);
    }

    /// Charges the time since the previous mark to `first`, up to `first_part`, and the rest
    /// to `then` (the launcher reports when bubblewrap exec'd: launch, then wait).
    pub fn split(&self, first: Phase, first_part: Duration, then: Phase) {
        let now = std::time::Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let took = now.duration_since(state.0);
        let head = took.min(first_part);
        state.1[first as usize] += head;
        state.1[then as usize] += took - head;
        state.0 = now;
    }

    /// What each phase took so far.
    pub fn phases(&self) -> [(Phase, Duration); 8] {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        Phase::ALL.map(|p| (p, state.1[p as usize]))
    }
}

/// What a scrape reads from elsewhere (egressd, the admission counts), set just before encoding.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub admitted: i64,
    pub running: i64,
    pub capacity: i64,
    /// `None` when egressd did not answer.
    pub egress: Option<Vec<(String, u64)>>,
    /// The change journal's counts (`crate::journal::Journal::counts`).
    pub journal: JournalCounts,
    /// The version collector's totals since start-up and the store's size at its last run.
    pub history: HistoryCounts,
    /// Replication to the object store: (lag in seconds, workspaces pending); `None` when off.
    pub replication: Option<(f64, u64)>,
    /// Sandboxes started ahead (issue #37); `None` when the backend keeps none.
    pub prestart: Option<crate::isolation::prestart::Report>,
    /// VMs booted ahead (issue #36); `None` when the microvm backend keeps none.
    pub microvm_pool: Option<crate::isolation::prestart::Report>,
}

/// The version collector at a scrape (`crate::history::History::metrics`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HistoryCounts {
    pub collections: u64,
    pub failures: u64,
    pub objects_deleted: u64,
    pub disk_bytes_deleted: u64,
    pub versions_pruned: u64,
    /// `None` before the first collection.
    pub disk_bytes_stored: Option<u64>,
}

/// The change journal at a scrape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JournalCounts {
    pub workspaces: usize,
    pub watches: usize,
    /// Runs measured from the journal, without a walk before or after.
    pub journaled: u64,
    /// Runs walked instead, by reason.
    pub walked: Vec<(&'static str, u64)>,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    executions: Family<Labels, Counter>,
    admission: Family<Labels, Counter>,
    queued: Gauge,
    running: Gauge,
    capacity: Gauge,
    launch_seconds: Histograms,
    duration_seconds: Histograms,
    init_failures: Family<Labels, Counter>,
    limits_hit: Family<Labels, Counter>,
    commit_seconds: Histograms,
    phase_seconds: Histograms,
    /// Set from other parts' state at each scrape.
    state: StateGauges,
    /// Counted by the replicator as it sends (`crate::replica::Replica`).
    replication: crate::replica::Counters,
    /// One scrape at a time: the gauges set for it are the ones it encodes.
    scrape: Mutex<()>,
}

/// The gauges each scrape sets from another part's state: egressd's decisions, the change
/// journal, the version history.
#[derive(Debug)]
struct StateGauges {
    egress_decisions: Family<Labels, Gauge>,
    egress_up: Gauge,
    journal_workspaces: Gauge,
    journal_watches: Gauge,
    journal_runs: Family<Labels, Gauge>,
    history_collections: Family<Labels, Gauge>,
    history_deleted_objects: Gauge,
    history_deleted_bytes: Gauge,
    history_pruned_versions: Gauge,
    history_stored_bytes: Gauge,
    replication_lag: Gauge<f64, std::sync::atomic::AtomicU64>,
    replication_pending: Gauge,
    prestart: PrestartGauges,
    microvm_pool: PrestartGauges,
}

/// A pool's state at a scrape: bwrap's pre-started sandboxes (issue #37) or the VMs booted
/// ahead (issue #36).
#[derive(Debug)]
struct PrestartGauges {
    hits: Gauge,
    misses: Family<Labels, Gauge>,
    discards: Family<Labels, Gauge>,
    started: Gauge,
    failed: Gauge,
    waiting: Gauge,
    memory: Gauge,
}

impl PrestartGauges {
    /// The gauges of one pool: `prefix` names its series (`prestart` for bwrap's sandboxes,
    /// `microvm_pool` for VMs), `what` says in their help what waits.
    fn register(registry: &mut Registry, prefix: &str, what: &str) -> PrestartGauges {
        let mut gauge = |name: &str, help: String| {
            registered(registry, &format!("{prefix}_{name}"), &help, Gauge::default())
        };
        let (hits, started, failed, waiting, memory) = (
            gauge("hits", format!("Executions handed to {what} started ahead, since start-up")),
            gauge(
                "started",
                format!("How many {what} were started ahead for a workspace's next call, since start-up"),
            ),
            gauge("start_failures", format!("How many {what} could not be started ahead, since start-up")),
            gauge("waiting", format!("How many {what} started ahead wait now")),
            gauge(
                "memory_bytes",
                format!("Resident memory of the waiting {what}' processes (RSS summed per process)"),
            ),
        );
        let misses = registered(
            registry,
            &format!("{prefix}_misses"),
            &format!(
                "Executions that found none of the {what} waiting for their shape, by reason ({})",
                crate::isolation::prestart::Miss::ALL.map(|m| m.name()).join(", ")
            ),
            Family::<Labels, Gauge>::default(),
        );
        let discards = registered(
            registry,
            &format!("{prefix}_discards"),
            &format!(
                "How many {what} started ahead were ended unused, by reason ({})",
                crate::isolation::prestart::Discard::ALL.map(|d| d.name()).join(", ")
            ),
            Family::<Labels, Gauge>::default(),
        );
        PrestartGauges { hits, misses, discards, started, failed, waiting, memory }
    }

    fn set(&self, report: &crate::isolation::prestart::Report) {
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.hits.set(count(report.hits));
        self.started.set(count(report.started));
        self.failed.set(count(report.failed));
        self.waiting.set(count(report.waiting as u64));
        self.memory.set(count(report.memory_bytes));
        for (reason, n) in &report.misses {
            self.misses.get_or_create(&vec![("reason", (*reason).into())]).set(count(*n));
        }
        for (reason, n) in &report.discards {
            self.discards.get_or_create(&vec![("reason", (*reason).into())]).set(count(*n));
        }
    }
}

impl StateGauges {
    fn register(registry: &mut Registry) -> StateGauges {
        let egress_decisions = registered(
            registry,
            "egress_decisions",
            "egressd's proxy decisions since it started, by verdict (read from egressd at scrape)",
            Family::<Labels, Gauge>::default(),
        );
        let egress_up = registered(
            registry,
            "egress_up",
            "Whether egressd answered this scrape's status request",
            Gauge::default(),
        );
        let journal_workspaces = registered(
            registry,
            "journal_workspaces",
            "Workspaces the change journal keeps watched (SCIENCE_AGENT_JOURNAL_WORKSPACES bounds it)",
            Gauge::default(),
        );
        let journal_watches = registered(
            registry,
            "journal_watches",
            "Directory watches the change journal holds (SCIENCE_AGENT_JOURNAL_WATCHES bounds it)",
            Gauge::default(),
        );
        let journal_runs = registered(
            registry,
            "journal_runs",
            "Runs since start-up measured from the change journal (measured=\"journal\") or by walking the \
             workspace, by why (first_use, events_lost, unrepresentable, no_slot)",
            Family::<Labels, Gauge>::default(),
        );
        let history_collections = registered(
            registry,
            "history_collections",
            "Version collections since start-up, by outcome (ok, failed)",
            Family::<Labels, Gauge>::default(),
        );
        let history_deleted_objects = registered(
            registry,
            "history_deleted_objects",
            "Unreachable version-store objects the collector deleted since start-up",
            Gauge::default(),
        );
        let history_deleted_bytes = registered(
            registry,
            "history_deleted_bytes",
            "Disk bytes the collector freed since start-up",
            Gauge::default(),
        );
        let history_pruned_versions = registered(
            registry,
            "history_pruned_versions",
            "History versions the retention removed since start-up",
            Gauge::default(),
        );
        let history_stored_bytes = registered(
            registry,
            "history_stored_bytes",
            "Disk bytes the version store held at the last collection (-1 before the first)",
            Gauge::default(),
        );
        let replication_lag = registered(
            registry,
            "replication_lag_seconds",
            "How long the oldest head not yet in the object store has waited (0 when none, or replication off)",
            Gauge::<f64, std::sync::atomic::AtomicU64>::default(),
        );
        let replication_pending = registered(
            registry,
            "replication_pending",
            "Workspaces whose newest head is not in the object store yet",
            Gauge::default(),
        );
        let prestart = PrestartGauges::register(registry, "prestart", "sandboxes");
        let microvm_pool = PrestartGauges::register(registry, "microvm_pool", "VMs");
        StateGauges {
            prestart,
            microvm_pool,
            replication_lag,
            replication_pending,
            egress_decisions,
            egress_up,
            journal_workspaces,
            journal_watches,
            journal_runs,
            history_collections,
            history_deleted_objects,
            history_deleted_bytes,
            history_pruned_versions,
            history_stored_bytes,
        }
    }
}

/// Registers `metric` under `name` and returns it (the registry keeps a clone: each metric
/// is a handle on shared counts).
fn registered<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// The queue's depth, its running executions and its capacity.
fn queue_gauges(registry: &mut Registry) -> (Gauge, Gauge, Gauge) {
    let queue_depth =
        "Synchronous executions in the bounded queue (waiting or running), as admission counts them";
    (
        registered(registry, "queue_depth", queue_depth, Gauge::default()),
        registered(registry, "running", "Admitted executions holding a sandbox slot", Gauge::default()),
        registered(registry, "queue_capacity", "Executions the queue admits at once", Gauge::default()),
    )
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut owned = Registry::with_prefix("runner");
        let registry = &mut owned;
        let requests = registered(
            registry,
            "execution_requests",
            "Answers of the execution routes, by route and error code (ok when it ran to an answer)",
            Family::<Labels, Counter>::default(),
        );
        let executions = registered(
            registry,
            "executions",
            "Admitted executions that ended, by route, outcome and seccomp profile",
            Family::<Labels, Counter>::default(),
        );
        let admission = registered(
            registry,
            "admission",
            "Places asked of the bounded queue: admitted, or refused (503 queue_full)",
            Family::<Labels, Counter>::default(),
        );
        let (queued, running, capacity) = queue_gauges(registry);
        let launch_seconds: Histograms = registered(
            registry,
            "launch_seconds",
            "From the launch to bubblewrap executing (sandbox-init's hand-over), by profile",
            Family::new_with_constructor(launch_histogram),
        );
        let duration_seconds: Histograms = registered(
            registry,
            "execution_duration_seconds",
            "From admission (queue included) to the end of an execution, by route",
            Family::new_with_constructor(duration_histogram),
        );
        let init_failures = registered(
            registry,
            "sandbox_init_failures",
            "Launches sandbox-init reported failed, by the step that failed",
            Family::<Labels, Counter>::default(),
        );
        let limits_hit = registered(
            registry,
            "limits_hit",
            "Executions that ran into a limit: oom, pids, fsize, quota, timeout",
            Family::<Labels, Counter>::default(),
        );
        let commit_seconds: Histograms = registered(
            registry,
            "workspace_commit_seconds",
            "Snapshot and commit of a workspace's new version after a run, by result",
            Family::new_with_constructor(duration_histogram),
        );
        let phase_seconds: Histograms = registered(
            registry,
            "execution_phase_seconds",
            "Where a synchronous execution that ran to its answer spent its time, by phase",
            Family::new_with_constructor(phase_histogram),
        );
        let state = StateGauges::register(registry);
        let replication = crate::replica::Counters {
            objects: registered(
                registry,
                "replication_objects",
                "Objects sent to the object store since start-up",
                Counter::default(),
            ),
            bytes: registered(
                registry,
                "replication_bytes",
                "Bytes sent to the object store since start-up",
                Counter::default(),
            ),
            errors: registered(
                registry,
                "replication_errors",
                "Replications that failed since start-up (each is retried)",
                Counter::default(),
            ),
        };
        Metrics {
            replication,
            registry: owned,
            requests,
            executions,
            admission,
            queued,
            running,
            capacity,
            launch_seconds,
            duration_seconds,
            init_failures,
            limits_hit,
            commit_seconds,
            phase_seconds,
            state,
            scrape: Mutex::new(()),
        }
    }

    /// One answer of an execution route: `None` when it ran to its answer, else the error code.
    pub fn request(&self, route: &'static str, error_code: Option<&'static str>) {
        let code = error_code.unwrap_or("ok");
        self.requests.get_or_create(&vec![("route", route.into()), ("code", code.into())]).inc();
    }

    /// One admitted execution's end (written once, with its audit record).
    pub fn finished(&self, route: &'static str, outcome: Outcome, profile: &str, duration: Duration) {
        let labels =
            vec![("route", route.into()), ("outcome", outcome.as_str().into()), ("profile", profile.into())];
        self.executions.get_or_create(&labels).inc();
        self.duration_seconds.get_or_create(&vec![("route", route.into())]).observe(duration.as_secs_f64());
        if let Some(limit) = limit_of_outcome(outcome) {
            self.limit_hit(limit);
        }
    }

    /// A place asked of the queue.
    pub fn admission(&self, admitted: bool) {
        let result = if admitted { "admitted" } else { "refused" };
        self.admission.get_or_create(&vec![("result", result.into())]).inc();
    }

    pub fn launched(&self, profile: &str, latency: Duration) {
        self.launch_seconds.get_or_create(&vec![("profile", profile.into())]).observe(latency.as_secs_f64());
    }

    /// sandbox-init reported `step` failed (`vanished`: it died before it could say).
    pub fn init_failed(&self, step: &'static str) {
        self.init_failures.get_or_create(&vec![("step", step.into())]).inc();
    }

    pub fn limit_hit(&self, limit: &'static str) {
        self.limits_hit.get_or_create(&vec![("limit", limit.into())]).inc();
    }

    /// The limits a completed run's result fields name (`oomKilled`, `pidsLimitReached`,
    /// SIGXFSZ).
    pub fn limits_in_result(&self, fields: &crate::limits::ResultFields) {
        for limit in limits_of_result(fields) {
            self.limit_hit(limit);
        }
    }

    pub fn committed(&self, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "failed" };
        self.commit_seconds.get_or_create(&vec![("result", result.into())]).observe(took.as_secs_f64());
    }

    /// One execution's phases, as its clock recorded them.
    pub fn phases(&self, clock: &PhaseClock) {
        for (phase, took) in clock.phases() {
            self.phase_seconds
                .get_or_create(&vec![("phase", phase.name().into())])
                .observe(took.as_secs_f64());
        }
    }

    /// The counters the replicator increments.
    pub fn replication(&self) -> crate::replica::Counters {
        self.replication.clone()
    }

    /// The text a scrape answers.
    pub fn render(&self, snapshot: &Snapshot) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.queued.set(snapshot.admitted);
        self.running.set(snapshot.running);
        self.capacity.set(snapshot.capacity);
        self.state.egress_up.set(i64::from(snapshot.egress.is_some()));
        let j = &snapshot.journal;
        self.state.journal_workspaces.set(j.workspaces as i64);
        self.state.journal_watches.set(j.watches as i64);
        let runs = |measured: &'static str, n: u64| {
            self.state
                .journal_runs
                .get_or_create(&vec![("measured", measured.into())])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        runs("journal", j.journaled);
        let h = &snapshot.history;
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.state
            .history_collections
            .get_or_create(&vec![("outcome", "ok".into())])
            .set(count(h.collections));
        self.state
            .history_collections
            .get_or_create(&vec![("outcome", "failed".into())])
            .set(count(h.failures));
        self.state.history_deleted_objects.set(count(h.objects_deleted));
        self.state.history_deleted_bytes.set(count(h.disk_bytes_deleted));
        self.state.history_pruned_versions.set(count(h.versions_pruned));
        self.state.history_stored_bytes.set(h.disk_bytes_stored.map_or(-1, count));
        let (lag, pending) = snapshot.replication.unwrap_or_default();
        self.state.replication_lag.set(lag);
        self.state.replication_pending.set(count(pending));
        for (why, n) in &j.walked {
            runs(why, *n);
        }
        if let Some(report) = &snapshot.prestart {
            self.state.prestart.set(report);
        }
        if let Some(report) = &snapshot.microvm_pool {
            self.state.microvm_pool.set(report);
        }
        for (verdict, n) in snapshot.egress.iter().flatten() {
            let verdict = bounded_verdict(verdict);
            self.state
                .egress_decisions
                .get_or_create(&vec![("verdict", verdict.into())])
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// egressd's verdicts (its `egress_decision` records), as egressd's status answer names
/// them; a text this runnerd does not know (a newer egressd's) counts as `other`.
fn bounded_verdict(verdict: &str) -> &'static str {
    Verdict::parse(verdict).map_or(OTHER, Verdict::as_str)
}

/// The label of a text from outside the process that names no known value.
const OTHER: &str = "other";

/// The limit an outcome means, if it means one.
fn limit_of_outcome(outcome: Outcome) -> Option<&'static str> {
    use crate::exec::{ErrorCode, RunOutcome};
    match outcome {
        Outcome::Run(RunOutcome::TimedOut) => Some("timeout"),
        Outcome::Error(ErrorCode::WorkspaceQuotaExceeded)
        | Outcome::Run(RunOutcome::WorkspaceQuotaExceededBeforeRun) => Some("quota"),
        _ => None,
    }
}

fn limits_of_result(fields: &crate::limits::ResultFields) -> Vec<&'static str> {
    let mut hit = Vec::new();
    if fields.oom_killed == Some(true) {
        hit.push("oom");
    }
    if fields.pids_limit_reached == Some(true) {
        hit.push("pids");
    }
    if fields.signal.as_deref() == Some("SIGXFSZ") {
        hit.push("fsize");
    }
    hit
}

/// The metric's name for a sandbox-init step.
pub fn step_name(step: common::plan::InitStep) -> &'static str {
    use common::plan::InitStep::*;
    match step {
        ReadPlan => "read_plan",
        ValidatePlan => "validate_plan",
        ReceiveFds => "receive_fds",
        ArrangeFds => "arrange_fds",
        CloseFds => "close_fds",
        JoinCgroups => "join_cgroups",
        Idmap => "idmap",
        Rlimits => "rlimits",
        Signals => "signals",
        SwitchUser => "switch_user",
        Exec => "exec",
    }
}

/// The step label of a failed launch, when sandbox-init (not the spawn or the channel) failed.
pub fn init_step_of(e: &crate::launch::LaunchError) -> Option<&'static str> {
    match e {
        crate::launch::LaunchError::Init(f) => Some(step_name(f.step)),
        crate::launch::LaunchError::BwrapMissing { .. } => Some("exec"),
        crate::launch::LaunchError::InitVanished => Some("vanished"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_from_egressd_are_a_closed_set() {
        for (given, label) in
            [("allowed", "allowed"), ("denied", "denied"), ("malformed", "malformed"), ("x\ny", "other")]
        {
            assert_eq!(bounded_verdict(given), label, "{given:?}");
        }
    }

    /// Every value of a closed set has a label of its own, and none is `other` (kept for
    /// the texts from outside the process that name none).
    fn labels_are_unique(set: &str, labels: impl IntoIterator<Item = &'static str>) {
        let mut seen = std::collections::HashSet::new();
        for label in labels {
            assert!(!label.is_empty() && label != OTHER, "{set}: {label:?}");
            assert!(
                label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{set}: {label:?}"
            );
            assert!(seen.insert(label), "{set}: {label:?} twice");
        }
    }

    #[test]
    fn every_verdict_has_its_label() {
        labels_are_unique("verdict", Verdict::ALL.iter().map(|v| v.as_str()));
        for v in Verdict::ALL {
            assert_eq!(bounded_verdict(v.as_str()), v.as_str());
        }
    }

    #[test]
    fn every_outcome_has_its_label() {
        labels_are_unique("outcome", Outcome::ALL.iter().map(|o| o.as_str()));
        let m = Metrics::new();
        for o in Outcome::ALL {
            m.finished("execute", o, "baseline", Duration::ZERO);
        }
        let text = m.render(&Snapshot::default());
        for o in Outcome::ALL {
            let line = format!(
                "runner_executions_total{{route=\"execute\",outcome=\"{o}\",profile=\"baseline\"}} 1"
            );
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
        assert!(!text.contains("outcome=\"other\""), "{text}");
    }

    #[test]
    fn outcomes_name_their_limits() {
        use crate::exec::{ErrorCode, RunOutcome};
        for (outcome, limit) in [
            (RunOutcome::TimedOut.into(), Some("timeout")),
            (ErrorCode::WorkspaceQuotaExceeded.into(), Some("quota")),
            (RunOutcome::WorkspaceQuotaExceededBeforeRun.into(), Some("quota")),
            (RunOutcome::Completed.into(), None),
            (RunOutcome::Aborted.into(), None),
            (ErrorCode::ExecutionTimeout.into(), None),
        ] {
            assert_eq!(limit_of_outcome(outcome), limit, "{outcome}");
        }
    }

    #[test]
    fn result_fields_name_their_limits() {
        use crate::launch::Termination::Exited;
        use crate::limits::{Limits, Mode, outcome_fields};
        let l = Limits { memory_bytes: 0, pids: 0, cpu_millicores: 0, tmp_bytes: 0 };
        let fields = |t| outcome_fields(t, false, None, &l, &[], Mode::RlimitsOnly);
        assert_eq!(limits_of_result(&fields(Exited(128 + libc::SIGXFSZ))), ["fsize"]);
        assert!(limits_of_result(&fields(Exited(0))).is_empty());
        assert!(limits_of_result(&fields(Exited(128 + libc::SIGKILL))).is_empty());
        let mut oom = fields(Exited(128 + libc::SIGKILL));
        (oom.oom_killed, oom.pids_limit_reached) = (Some(true), Some(true));
        assert_eq!(limits_of_result(&oom), ["oom", "pids"]);
    }

    #[test]
    fn a_phase_clock_charges_each_interval_to_one_phase() {
        let clock = PhaseClock::new();
        clock.mark(Phase::Parse);
        std::thread::sleep(Duration::from_millis(2));
        clock.split(Phase::Launch, Duration::from_millis(1), Phase::Wait);
        let p = clock.phases();
        assert_eq!(p.map(|(phase, _)| phase), Phase::ALL);
        assert_eq!(p[Phase::Launch as usize].1, Duration::from_millis(1));
        assert!(p[Phase::Wait as usize].1 >= Duration::from_millis(1));
        assert_eq!(p[Phase::Commit as usize].1, Duration::ZERO);
        let m = Metrics::new();
        m.phases(&clock);
        let text = m.render(&Snapshot::default());
        for phase in Phase::ALL {
            let line = format!("runner_execution_phase_seconds_count{{phase=\"{}\"}} 1", phase.name());
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
    }

    #[test]
    fn render_counts_what_was_recorded() {
        let m = Metrics::new();
        m.request("execute", None);
        m.request("execute", Some("workspace_required"));
        m.finished(
            "execute",
            crate::exec::RunOutcome::TimedOut.into(),
            "baseline",
            Duration::from_millis(30),
        );
        m.admission(false);
        m.replication().objects.inc_by(3);
        let text = m.render(&Snapshot {
            admitted: 3,
            running: 1,
            capacity: 8,
            egress: Some(vec![("denied".into(), 4)]),
            journal: JournalCounts {
                workspaces: 2,
                watches: 7,
                journaled: 5,
                walked: vec![("events_lost", 1)],
            },
            history: HistoryCounts {
                collections: 2,
                failures: 1,
                objects_deleted: 9,
                disk_bytes_deleted: 4096,
                versions_pruned: 3,
                disk_bytes_stored: None,
            },
            replication: Some((1.5, 2)),
            prestart: Some(crate::isolation::prestart::Report {
                settings: crate::isolation::PrestartSettings::default(),
                waiting: 2,
                settled: 2,
                memory_bytes: 8 << 20,
                hits: 40,
                misses: vec![("cold", 3), ("shape_changed", 1)],
                discards: vec![("expired", 5)],
                started: 44,
                failed: 0,
            }),
            microvm_pool: Some(crate::isolation::prestart::Report {
                settings: crate::isolation::PrestartSettings::default(),
                waiting: 1,
                settled: 1,
                memory_bytes: 280 << 20,
                hits: 20,
                misses: vec![("cold", 1)],
                discards: vec![("shape_changed", 2)],
                started: 23,
                failed: 1,
            }),
        });
        for line in [
            "runner_execution_requests_total{route=\"execute\",code=\"ok\"} 1",
            "runner_execution_requests_total{route=\"execute\",code=\"workspace_required\"} 1",
            "runner_executions_total{route=\"execute\",outcome=\"timed_out\",profile=\"baseline\"} 1",
            "runner_limits_hit_total{limit=\"timeout\"} 1",
            "runner_admission_total{result=\"refused\"} 1",
            "runner_queue_depth 3",
            "runner_journal_workspaces 2",
            "runner_history_collections{outcome=\"ok\"} 2",
            "runner_history_collections{outcome=\"failed\"} 1",
            "runner_history_deleted_objects 9",
            "runner_history_deleted_bytes 4096",
            "runner_history_pruned_versions 3",
            "runner_history_stored_bytes -1",
            "runner_replication_lag_seconds 1.5",
            "runner_replication_pending 2",
            "runner_replication_objects_total 3",
            "runner_journal_watches 7",
            "runner_journal_runs{measured=\"journal\"} 5",
            "runner_journal_runs{measured=\"events_lost\"} 1",
            "runner_running 1",
            "runner_prestart_hits 40",
            "runner_prestart_waiting 2",
            "runner_prestart_memory_bytes 8388608",
            "runner_prestart_misses{reason=\"cold\"} 3",
            "runner_prestart_misses{reason=\"shape_changed\"} 1",
            "runner_prestart_discards{reason=\"expired\"} 5",
            "runner_prestart_started 44",
            "runner_microvm_pool_hits 20",
            "runner_microvm_pool_waiting 1",
            "runner_microvm_pool_memory_bytes 293601280",
            "runner_microvm_pool_misses{reason=\"cold\"} 1",
            "runner_microvm_pool_discards{reason=\"shape_changed\"} 2",
            "runner_microvm_pool_started 23",
            "runner_microvm_pool_start_failures 1",
            "runner_egress_decisions{verdict=\"denied\"} 4",
            "runner_egress_up 1",
            "runner_execution_duration_seconds_count{route=\"execute\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
