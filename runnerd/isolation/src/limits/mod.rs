//! Per-execution resource limits (issue #8): memory, processes, CPU and the size of the
//! sandbox's `/tmp`; their defaults and maxima from the configuration, per-request overrides
//! within those maxima, and what each enforcement mode makes of them.
//!
//! Everything here is pure (table-tested); the cgroup I/O lives in [`cgroup`], the pool of
//! execution cgroups made ahead in `spares`, the start-up choice of a mode in [`detect`].

pub mod cgroup;
pub mod detect;
mod spares;

use serde::Serialize;
use serde_json::{Value, json};

use common::plan::{Resource, Rlimit};
use common::settings::{MAX_SAFE_INTEGER, parse_non_negative};

pub use cgroup::{ExecCgroup, Usage};
pub use detect::{CgroupSource, Enforcement, Mode};

/// The limits one execution runs under. 0 means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u64,
    /// Thousandths of one core (1000 = one full core).
    pub cpu_millicores: u64,
    pub tmp_bytes: u64,
}

/// The configured defaults and the most a request may ask for (0 = no maximum).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitSettings {
    pub default: Limits,
    pub max: Limits,
    /// `SCIENCE_AGENT_CGROUP_MODE`.
    pub mode: ModeChoice,
    /// `SCIENCE_AGENT_CGROUP_ROOT`: where execution cgroups are made. Relative: below
    /// runnerd's own cgroup in each hierarchy; absolute: from each hierarchy's root.
    pub cgroup_root: Option<String>,
}

/// A limit setting that is not a value it may take; runnerd's configuration gives it as its
/// own error, word for word.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("{name} must be a non-negative integer, not {value:?}")]
    NonNegative { name: String, value: String },
    #[error("{name} must be one of {allowed}, not {value:?}")]
    Choice { name: String, value: String, allowed: &'static str },
}

/// Which enforcement start-up may pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeChoice {
    /// The best this host offers: cgroup v2 delegation, else cgroup v1, else rlimits.
    Auto,
    CgroupV2,
    CgroupV1,
    /// rlimits only, even where cgroups would work.
    RlimitsOnly,
}

impl ModeChoice {
    pub fn name(self) -> &'static str {
        match self {
            ModeChoice::Auto => "auto",
            ModeChoice::CgroupV2 => "cgroup-v2",
            ModeChoice::CgroupV1 => "cgroup-v1",
            ModeChoice::RlimitsOnly => "rlimits-only",
        }
    }
}

pub const MODE_VAR: &str = "SCIENCE_AGENT_CGROUP_MODE";
pub const ROOT_VAR: &str = "SCIENCE_AGENT_CGROUP_ROOT";

/// `(variable, default)` of each numeric setting, in [`Limits`]' order, defaults then maxima.
pub const NUMERIC_VARS: [(&str, u64); 8] = [
    ("SCIENCE_AGENT_LIMIT_MEMORY_BYTES", 2 << 30),
    ("SCIENCE_AGENT_LIMIT_PIDS", 256),
    ("SCIENCE_AGENT_LIMIT_CPU_MILLICORES", 1000),
    ("SCIENCE_AGENT_LIMIT_TMP_BYTES", 512 << 20),
    ("SCIENCE_AGENT_LIMIT_MAX_MEMORY_BYTES", 8 << 30),
    ("SCIENCE_AGENT_LIMIT_MAX_PIDS", 4096),
    ("SCIENCE_AGENT_LIMIT_MAX_CPU_MILLICORES", 0),
    ("SCIENCE_AGENT_LIMIT_MAX_TMP_BYTES", 4 << 30),
];

impl LimitSettings {
    /// Reads the settings through `get` (unset or empty variables give the defaults).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LimitSettings, SettingsError> {
        let mut values = [0u64; 8];
        for (slot, (name, default)) in values.iter_mut().zip(NUMERIC_VARS) {
            *slot = match get(name) {
                None => default,
                Some(v) => parse_non_negative(&v)
                    .ok_or(SettingsError::NonNegative { name: name.to_owned(), value: v })?,
            };
        }
        let limits =
            |v: &[u64]| Limits { memory_bytes: v[0], pids: v[1], cpu_millicores: v[2], tmp_bytes: v[3] };
        let mode = match get(MODE_VAR).as_deref().map(str::trim) {
            None | Some("auto") => ModeChoice::Auto,
            Some("cgroup-v2") => ModeChoice::CgroupV2,
            Some("cgroup-v1") => ModeChoice::CgroupV1,
            Some("rlimits-only") => ModeChoice::RlimitsOnly,
            Some(other) => {
                return Err(SettingsError::Choice {
                    name: MODE_VAR.to_owned(),
                    value: other.to_owned(),
                    allowed: "auto, cgroup-v2, cgroup-v1 or rlimits-only",
                });
            }
        };
        Ok(LimitSettings {
            default: limits(&values[..4]),
            max: limits(&values[4..]),
            mode,
            cgroup_root: get(ROOT_VAR),
        })
    }

    /// The value of a configuration key for `--check-config`, if it is one of ours.
    pub fn show(&self, key: &str) -> Option<String> {
        let d = &self.default;
        let m = &self.max;
        Some(match key {
            "limit_memory_bytes" => d.memory_bytes.to_string(),
            "limit_pids" => d.pids.to_string(),
            "limit_cpu_millicores" => d.cpu_millicores.to_string(),
            "limit_tmp_bytes" => d.tmp_bytes.to_string(),
            "limit_max_memory_bytes" => m.memory_bytes.to_string(),
            "limit_max_pids" => m.pids.to_string(),
            "limit_max_cpu_millicores" => m.cpu_millicores.to_string(),
            "limit_max_tmp_bytes" => m.tmp_bytes.to_string(),
            "cgroup_mode" => self.mode.name().to_owned(),
            "cgroup_root" => {
                self.cgroup_root.clone().unwrap_or_else(|| "unset (runnerd's own cgroup)".into())
            }
            _ => return None,
        })
    }
}

/// The request field with per-execution overrides (additive, api.md).
pub const REQUEST_FIELD: &str = "resourceLimits";

/// The limits for one request: the defaults, each overridden by `resourceLimits.{memoryBytes,
/// pids, cpu, tmpBytes}` when given. `cpu` is a fraction of a core (0.5, 2). A value above
/// the configured maximum, or 0 (unlimited) where a maximum is configured, is refused.
pub fn requested(field: Option<&Value>, settings: &LimitSettings) -> Result<Limits, String> {
    let mut limits = settings.default;
    let Some(field) = field.filter(|v| !v.is_null()) else {
        return Ok(limits);
    };
    let Some(obj) = field.as_object() else {
        return Err(format!("{REQUEST_FIELD} must be an object with memoryBytes, pids, cpu or tmpBytes"));
    };
    for (key, value) in obj {
        let (slot, max, parsed) = match key.as_str() {
            "memoryBytes" => (&mut limits.memory_bytes, settings.max.memory_bytes, whole(value)),
            "pids" => (&mut limits.pids, settings.max.pids, whole(value)),
            "tmpBytes" => (&mut limits.tmp_bytes, settings.max.tmp_bytes, whole(value)),
            "cpu" => (&mut limits.cpu_millicores, settings.max.cpu_millicores, millicores(value)),
            other => {
                return Err(format!(
                    "{REQUEST_FIELD}.{other} is not a limit; use memoryBytes, pids, cpu or tmpBytes"
                ));
            }
        };
        let Some(v) = parsed else {
            return Err(format!("{REQUEST_FIELD}.{key} must be a non-negative number (0 = unlimited)"));
        };
        if max > 0 && (v == 0 || v > max) {
            let shown = if key == "cpu" { format!("{} cores", max as f64 / 1000.0) } else { max.to_string() };
            return Err(format!(
                "{REQUEST_FIELD}.{key} may be at most {shown} on this runner (0, unlimited, is not allowed)"
            ));
        }
        *slot = v;
    }
    Ok(limits)
}

fn whole(v: &Value) -> Option<u64> {
    v.as_u64().filter(|n| *n <= MAX_SAFE_INTEGER)
}

fn millicores(v: &Value) -> Option<u64> {
    let f = v.as_f64()?;
    (f.is_finite() && (0.0..=1e6).contains(&f)).then(|| (f * 1000.0).round() as u64)
}

/// The rlimits that carry `limits` in a mode: cgroup modes leave memory, processes and CPU to
/// the cgroup; rlimits-only uses `RLIMIT_AS` for memory (address space, not resident memory)
/// and `RLIMIT_CPU` derived from the wall-clock timeout and the CPU share (CPU seconds per
/// process, so it only stops a spinner that outlives its share of the timeout).
/// `RLIMIT_NPROC` is never set: it counts every process of the runner's uid — all sandboxes
/// and runnerd itself — so one fork bomb would stop every other launch.
pub fn rlimits_for(mode: Mode, limits: &Limits, timeout_ms: u64) -> Vec<Rlimit> {
    let mut out = Vec::new();
    if mode == Mode::RlimitsOnly {
        if limits.memory_bytes > 0 {
            out.push(Rlimit::fixed(Resource::As, limits.memory_bytes));
        }
        if let Some(seconds) = cpu_seconds(limits.cpu_millicores, timeout_ms) {
            // The soft limit sends SIGXCPU, the hard one (a second later) SIGKILL.
            out.push(Rlimit { resource: Resource::Cpu, soft: Some(seconds), hard: Some(seconds + 1) });
        }
    }
    out
}

/// CPU seconds a process may use within the timeout at its CPU share, rounded up.
fn cpu_seconds(millicores: u64, timeout_ms: u64) -> Option<u64> {
    (millicores > 0 && timeout_ms > 0).then(|| (timeout_ms * millicores).div_ceil(1_000_000).max(1))
}

/// The name of signal `n` as results show it.
pub fn signal_name(n: i32) -> String {
    let name = match n {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("SIG{n}"),
    };
    name.to_owned()
}

/// What a result says about limits (R-PEER-3): the signal, whether the memory limit killed
/// it (from the cgroup's counters, never guessed), whether the process limit refused a fork,
/// and a sentence explaining a signal death.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub signal: Option<String>,
    pub oom_killed: Option<bool>,
    pub pids_limit_reached: Option<bool>,
    pub explanation: Option<String>,
}

/// Judges a finished run: `signal` is the signal the command died of (bwrap's 128+N, or
/// bwrap's own), `usage` the cgroup counters (`None` without cgroups).
pub fn verdict(
    signal: Option<i32>,
    stderr_empty: bool,
    usage: Option<&Usage>,
    limits: &Limits,
    rlimits: &[Rlimit],
) -> Verdict {
    let oom = usage.map(|u| u.oom_kills > 0);
    let pids = usage.map(|u| u.pids_max_hits > 0);
    let has = |r: Resource| rlimits.iter().any(|l| l.resource == r);
    let explanation = match signal {
        Some(_) if oom == Some(true) => Some(format!(
            "The execution was killed by the kernel's OOM killer: it reached its memory limit of {} bytes \
             (resourceLimits.memoryBytes).",
            limits.memory_bytes
        )),
        Some(libc::SIGXCPU) | Some(libc::SIGKILL) if has(Resource::Cpu) && usage.is_none() => Some(
            "The process was stopped by its CPU-time limit (RLIMIT_CPU, derived from the timeout and \
             resourceLimits.cpu); in this runner's rlimits-only mode it may also have been killed for other reasons."
                .to_owned(),
        ),
        Some(libc::SIGXFSZ) => Some(
            "The process tried to write a file larger than the largest file allowed (RLIMIT_FSIZE, the workspace quota)."
                .to_owned(),
        ),
        Some(n) if pids == Some(true) => Some(format!(
            "The process died of {} after the execution reached its process limit of {} (resourceLimits.pids): \
             further forks failed.",
            signal_name(n),
            limits.pids
        )),
        Some(n) if stderr_empty => Some(format!(
            "The process was killed by {} and wrote nothing to stderr; no resource limit of this execution recorded a hit.",
            signal_name(n)
        )),
        _ if pids == Some(true) => Some(format!(
            "The execution reached its process limit of {} (resourceLimits.pids): some forks failed with EAGAIN.",
            limits.pids
        )),
        _ => None,
    };
    Verdict { signal: signal.map(signal_name), oom_killed: oom, pids_limit_reached: pids, explanation }
}

/// `enforced` and `reasons` entries for memory, pids and cpu (health, R-PEER-1).
pub fn health_entries(e: &Enforcement, timeout_ms: u64) -> [(&'static str, Value, String); 3] {
    match e.mode {
        Mode::CgroupV2 | Mode::CgroupV1 => {
            let (mem, pids, cpu) = if e.mode == Mode::CgroupV2 {
                ("memory.max, memory.swap.max=0, memory.oom.group=1", "pids.max", "cpu.max")
            } else {
                ("memory.limit_in_bytes", "pids.max", "cpu.cfs_quota_us")
            };
            let at = e.root.display();
            [
                ("memory", json!(true), format!("{mem} per execution, verified at start-up under {at}")),
                ("pids", json!(true), format!("{pids} per execution, verified at start-up under {at}")),
                ("cpu", json!(true), format!("{cpu} per execution, verified at start-up under {at}")),
            ]
        }
        Mode::RlimitsOnly => {
            let why = e.reasons.join("; ");
            [
                (
                    "memory",
                    json!("partial"),
                    format!(
                        "rlimits only ({why}): RLIMIT_AS bounds address space, not resident memory; tmpfs use is not counted"
                    ),
                ),
                (
                    "pids",
                    json!(false),
                    format!(
                        "rlimits only ({why}): RLIMIT_NPROC counts every process of the runner's uid, so it is not used"
                    ),
                ),
                (
                    "cpu",
                    if timeout_ms > 0 { json!("partial") } else { json!(false) },
                    if timeout_ms > 0 {
                        format!(
                            "rlimits only ({why}): RLIMIT_CPU per process, from the timeout and the CPU share; no throttling"
                        )
                    } else {
                        format!(
                            "rlimits only ({why}): no throttling, and without a timeout no RLIMIT_CPU either"
                        )
                    },
                ),
            ]
        }
    }
}

#[cfg(test)]
mod tests;

/// After a run: ends whatever is left in the execution's cgroup and reads its counters; the
/// result waits for those. Removing the directories (which may wait for the kernel to reap)
/// happens afterwards in the blocking pool, off the answer's path; what a runnerd that dies
/// meanwhile leaves is removed at its next start (`remove_stale`).
pub async fn finish(cgroup: Option<ExecCgroup>) -> Option<Usage> {
    cgroup.as_ref()?;
    end(cgroup, || (), || ()).await.and_then(|(usage, ())| usage)
}

/// [`finish`], then `then` (work that must see the sandbox ended: the workspace's
/// measurement), as blocking work of the awaiting task ([`runner_store::blocking::run`]: no hop,
/// this is the answer's path). The removal, which may wait for the kernel to reap, then
/// runs on the blocking pool, and `afterwards` after it; `None` if the work panicked.
async fn end<T: Send + 'static>(
    cgroup: Option<ExecCgroup>,
    then: impl FnOnce() -> T + Send + 'static,
    afterwards: impl FnOnce() + Send + 'static,
) -> Option<(Option<Usage>, T)> {
    let (cgroup, usage, done) = runner_store::blocking::run(move || {
        let usage = cgroup.as_ref().map(|c| {
            c.kill();
            c.usage()
        });
        (cgroup, usage, then())
    })
    .await
    .ok()?;
    tokio::task::spawn_blocking(move || {
        if let Some(c) = cgroup
            && let Err(e) = c.remove_blocking()
        {
            tracing::warn!(event = "cgroup_left", error = %common::error_chain(&e));
        }
        afterwards();
    });
    Some((usage, done))
}

/// The additive result fields of issue #8, flattened into the execution result.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResultFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oom_killed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids_limit_reached: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explanation: Option<String>,
    pub resource_limits: ResourceLimitsField,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_usage: Option<UsageField>,
}

/// `resourceLimits` in a result: what this run was given (0 = unlimited), and for each
/// limit whether this host's mode applied it (issue #14: a limit that is not enforced is
/// never reported as if it were; the values mean what `/health.enforced` means).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceLimitsField {
    pub memory_bytes: u64,
    pub pids: u64,
    pub cpu: f64,
    /// The size `/tmp` had (a 0 setting takes the fallback size: no tmpfs is unsized).
    pub tmp_bytes: u64,
    pub enforced: EnforcedField,
}

/// `true`: applied; `"partial"`: applied by a weaker mechanism (see `/health.reasons`);
/// `false`: not applied at all in this mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnforcedField {
    pub memory_bytes: Value,
    pub pids: Value,
    pub cpu: Value,
    pub tmp_bytes: Value,
}

/// Whether each of `limits` is applied, given the mode and the rlimits the run got. An
/// unlimited (0) setting promises nothing, so it is `true`.
pub fn enforced(mode: Mode, limits: &Limits, rlimits: &[Rlimit]) -> EnforcedField {
    let has = |r: Resource| rlimits.iter().any(|l| l.resource == r);
    let cgroup = mode != Mode::RlimitsOnly;
    let verdict = |limit: u64, full: bool, weaker: bool| match (limit, full, weaker) {
        (0, _, _) | (_, true, _) => json!(true),
        (_, false, true) => json!("partial"),
        _ => json!(false),
    };
    EnforcedField {
        memory_bytes: verdict(limits.memory_bytes, cgroup, has(Resource::As)),
        pids: verdict(limits.pids, cgroup, false),
        cpu: verdict(limits.cpu_millicores, cgroup, has(Resource::Cpu)),
        tmp_bytes: json!(true),
    }
}

/// `resourceUsage`: what the cgroup measured (absent in rlimits-only mode).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageField {
    pub peak_memory_bytes: Option<u64>,
    pub cpu_time_ms: Option<u64>,
    pub pids_peak: Option<u64>,
    pub cpu_throttled_periods: Option<u64>,
}

/// The signal a termination carries: bwrap's own, or the command's as bwrap reports it
/// (exit status 128+N).
pub fn termination_signal(t: crate::launch::Termination) -> Option<i32> {
    match t {
        crate::launch::Termination::Signaled(n) => Some(n),
        crate::launch::Termination::Exited(code) if (129..=128 + 64).contains(&code) => Some(code - 128),
        _ => None,
    }
}

/// The result fields for a finished run.
pub fn outcome_fields(
    termination: crate::launch::Termination,
    stderr_empty: bool,
    usage: Option<&Usage>,
    limits: &Limits,
    rlimits: &[Rlimit],
    mode: Mode,
) -> ResultFields {
    let v = verdict(termination_signal(termination), stderr_empty, usage, limits, rlimits);
    ResultFields {
        signal: v.signal,
        oom_killed: v.oom_killed,
        pids_limit_reached: v.pids_limit_reached,
        explanation: v.explanation,
        resource_limits: ResourceLimitsField {
            memory_bytes: limits.memory_bytes,
            pids: limits.pids,
            cpu: limits.cpu_millicores as f64 / 1000.0,
            tmp_bytes: crate::sandbox::argv::tmpfs_sizes(limits.tmp_bytes).0,
            enforced: enforced(mode, limits, rlimits),
        },
        resource_usage: usage.map(|u| UsageField {
            peak_memory_bytes: u.peak_memory_bytes,
            cpu_time_ms: u.cpu_time_ms,
            pids_peak: u.pids_peak,
            cpu_throttled_periods: u.cpu_throttled_periods,
        }),
    }
}

/// `resourceLimits` in `/health`: the defaults, the maxima a request may ask for, and the
/// reasons a better enforcement mode was not taken.
pub fn health_block(e: &Enforcement, settings: &LimitSettings) -> Value {
    let show = |l: &Limits| {
        json!({
            "memoryBytes": l.memory_bytes,
            "pids": l.pids,
            "cpu": l.cpu_millicores as f64 / 1000.0,
            "tmpBytes": l.tmp_bytes,
        })
    };
    json!({
        "defaults": show(&settings.default),
        "maxima": show(&settings.max),
        "enforcement": e.mode.label(),
        "fallbackReasons": e.reasons,
        "tmpSize": "bwrap --size on the sandbox's /tmp tmpfs (in cgroup modes its pages also count as the execution's memory)",
    })
}
