//! How an admitted execution ended: the `outcome` of its `execution_finished` audit record
//! and the `outcome` label of `runner_executions_total`. Either the run's own end (or the
//! managed record's state) or, when an error ended it, that error's [`ErrorCode`]; the two
//! sets share no text, so each outcome is one label.

use super::code::ErrorCode;
use runner_store::execution_state::ManagedState;

common::named_enum! {
    /// An end that is no error's code: the sandbox's own, the queue's, and a managed
    /// record's state (so a managed run's outcome is always the state it recorded).
    pub enum RunOutcome {
        /// The command ran to its exit (any exit code).
        Completed => "completed",
        /// It passed its `executionTimeoutMs`.
        TimedOut => "timed_out",
        /// The caller went away while it ran.
        Aborted => "aborted",
        /// The caller went away while it queued.
        AbandonedInQueue => "abandoned_in_queue",
        /// Its task ended without recording an outcome (`FinishAudit`'s last resort).
        Dropped => "dropped",
        /// The workspace was over its quota before the run.
        WorkspaceQuotaExceededBeforeRun => "workspace_quota_exceeded_before_run",
        /// A managed run that failed (a non-zero exit, or it could not run or be recorded).
        Failed => "failed",
        /// A managed run its caller cancelled.
        Cancelled => "cancelled",
        /// Managed states that end nothing; here so that every state is an outcome.
        Queued => "queued",
        Running => "running",
        Unknown => "unknown",
    }
}

/// An execution's outcome: its own end, or the code of the error that ended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Run(RunOutcome),
    Error(ErrorCode),
}

impl Outcome {
    /// Every outcome: the run's ends, then every error code.
    pub const ALL: [Outcome; RunOutcome::ALL.len() + ErrorCode::ALL.len()] = {
        let mut all = [Outcome::Run(RunOutcome::Completed); RunOutcome::ALL.len() + ErrorCode::ALL.len()];
        let mut i = 0;
        while i < RunOutcome::ALL.len() {
            all[i] = Outcome::Run(RunOutcome::ALL[i]);
            i += 1;
        }
        let mut j = 0;
        while j < ErrorCode::ALL.len() {
            all[i + j] = Outcome::Error(ErrorCode::ALL[j]);
            j += 1;
        }
        all
    };

    /// The outcome's text: the audit record's `outcome`, the metric's label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Run(r) => r.as_str(),
            Outcome::Error(c) => c.as_str(),
        }
    }

    /// Whether the outcome means the sandbox could not be started or stopped: recorded as an
    /// error, not as information.
    pub fn is_sandbox_failure(self) -> bool {
        matches!(self, Outcome::Error(ErrorCode::SandboxLaunchFailed | ErrorCode::SandboxUnresponsive))
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<RunOutcome> for Outcome {
    fn from(r: RunOutcome) -> Outcome {
        Outcome::Run(r)
    }
}

impl From<ErrorCode> for Outcome {
    fn from(c: ErrorCode) -> Outcome {
        Outcome::Error(c)
    }
}

/// A managed run's outcome is the state its record ended in.
impl From<ManagedState> for Outcome {
    fn from(s: ManagedState) -> Outcome {
        Outcome::Run(match s {
            ManagedState::Queued => RunOutcome::Queued,
            ManagedState::Running => RunOutcome::Running,
            ManagedState::Completed => RunOutcome::Completed,
            ManagedState::Failed => RunOutcome::Failed,
            ManagedState::Cancelled => RunOutcome::Cancelled,
            ManagedState::Unknown => RunOutcome::Unknown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_is_listed_once_with_a_text_of_its_own() {
        let mut seen = std::collections::HashSet::new();
        for o in Outcome::ALL {
            assert!(seen.insert(o.as_str()), "{o} twice: a run outcome shares an error code's text");
        }
        assert_eq!(seen.len(), RunOutcome::ALL.len() + ErrorCode::ALL.len());
        for r in RunOutcome::ALL {
            assert!(Outcome::ALL.contains(&Outcome::Run(*r)), "{r}");
        }
        for c in ErrorCode::ALL {
            assert!(Outcome::ALL.contains(&Outcome::Error(*c)), "{c}");
        }
    }

    #[test]
    fn a_managed_state_is_its_own_outcome() {
        for s in ManagedState::ALL {
            assert_eq!(Outcome::from(*s).as_str(), s.as_str());
        }
    }
}
