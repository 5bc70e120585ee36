//! The audit trail of one admitted execution: `execution_admitted`, `execution_started`, and
//! exactly one `execution_finished`, counted in `/metrics` and timed by phase.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::seccomp::Profile;

use super::{EngineError, Outcome, RunOutcome};

/// The `execution_finished` audit record of one admitted execution: written once, by
/// whichever path ends it (the sandbox's own outcome, or the error that stopped it before
/// or instead of the sandbox), always with the same fields, so `journalctl
/// EVENT=execution_finished` sees every admitted execution end.
#[derive(Debug)]
pub struct FinishAudit {
    execution_id: String,
    session_id: String,
    agent_id: String,
    workspace: PathBuf,
    profile: Profile,
    admitted: Instant,
    written: AtomicBool,
    /// Where the end is also counted (`GET /metrics`), under this route.
    metrics: Option<(Arc<crate::metrics::Metrics>, &'static str)>,
    /// The execution's phase marks (`runner_execution_phase_seconds`), when it keeps them.
    pub(super) clock: Option<crate::metrics::PhaseClock>,
}

impl FinishAudit {
    pub fn new(
        execution_id: &str,
        session_id: &str,
        agent_id: &str,
        workspace: &Path,
        profile: Profile,
    ) -> Self {
        FinishAudit {
            execution_id: execution_id.to_owned(),
            session_id: session_id.to_owned(),
            agent_id: agent_id.to_owned(),
            workspace: workspace.to_owned(),
            profile,
            admitted: Instant::now(),
            written: AtomicBool::new(false),
            metrics: None,
            clock: None,
        }
    }

    /// Keeps the execution's phase marks on `clock` (see [`FinishAudit::mark`]).
    pub fn clocked(mut self, clock: crate::metrics::PhaseClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Charges the time since the previous mark to `phase` (nothing without a clock).
    pub fn mark(&self, phase: crate::metrics::Phase) {
        if let Some(c) = &self.clock {
            c.mark(phase);
        }
    }

    /// Counts the end in `metrics` too, under `route`.
    pub fn counted(mut self, metrics: &Arc<crate::metrics::Metrics>, route: &'static str) -> Self {
        self.metrics = Some((metrics.clone(), route));
        self
    }

    /// `execution_admitted`: the ids, the language, and whether it is a managed run.
    pub fn admitted(&self, language: &str, managed: bool) {
        tracing::info!(
            event = "execution_admitted",
            managed,
            execution_id = %self.execution_id,
            session_id = %self.session_id,
            agent_id = %self.agent_id,
            workspace = %self.workspace.display(),
            profile = %self.profile,
            language,
        );
    }

    /// `execution_started`, with the same ids.
    pub fn started(&self) {
        tracing::info!(
            event = "execution_started",
            execution_id = %self.execution_id,
            session_id = %self.session_id,
            agent_id = %self.agent_id,
            workspace = %self.workspace.display(),
            profile = %self.profile,
        );
    }

    /// Writes the record unless one was written. `duration_ms` counts from admission (queue
    /// included); `run_ms` is the sandbox's own time when one ran; `exit_code` is present
    /// only when the sandboxed command exited by itself.
    pub fn finished(
        &self,
        outcome: impl Into<Outcome>,
        exit_code: Option<i32>,
        run: Option<Duration>,
        error: Option<&str>,
    ) {
        if self.written.swap(true, Ordering::SeqCst) {
            return;
        }
        let outcome: Outcome = outcome.into();
        if let Some((m, route)) = &self.metrics {
            m.finished(route, outcome, self.profile.name(), self.admitted.elapsed());
        }
        let duration_ms = self.admitted.elapsed().as_millis() as u64;
        let run_ms = run.map(|d| d.as_millis() as u64);
        macro_rules! record {
            ($level:ident) => {
                tracing::$level!(
                    event = "execution_finished",
                    execution_id = %self.execution_id,
                    session_id = %self.session_id,
                    agent_id = %self.agent_id,
                    workspace = %self.workspace.display(),
                    profile = %self.profile,
                    outcome = outcome.as_str(),
                    exit_code,
                    duration_ms,
                    run_ms,
                    error,
                )
            };
        }
        if outcome.is_sandbox_failure() {
            record!(error);
        } else {
            record!(info);
        }
    }

    /// The record for an execution that an error ended: the error's code is the outcome.
    pub fn failed(&self, e: &EngineError) {
        self.finished(e.code(), None, None, Some(&e.to_string()));
    }
}

impl Drop for FinishAudit {
    /// The last resort: a task dropped before any path recorded the end still leaves one.
    fn drop(&mut self) {
        self.finished(
            RunOutcome::Dropped,
            None,
            None,
            Some("the task running the execution ended before it recorded an outcome"),
        );
    }
}
