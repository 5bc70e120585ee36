//! The synchronous routes, `POST /execute-shell` and `POST /execute`: locate, admit and
//! prepare before anything queues (each refusal answers at once), then [`Execution::run`]
//! in the agent's queue, a `legacy-execution` version, and the answer.

use std::sync::Arc;
use std::time::Instant;

use super::audit::FinishAudit;
use super::engine::{Execution, Flow, Queue, Route};
use super::prepare::{RunOptions, admit, attach_egress, prepare};
use super::registry::{ActiveExecution, Registration};
use super::{EngineError, ExecutionResult, RunOutcome, StopToken, admission, language_name, request};
use crate::app::App;
use crate::metrics::Phase;
use crate::versioning::Ref;
use crate::workspace::locate;
use crate::writer::{WriteError, Writer};

/// Runs one synchronous execution. `stop` ends it early: a queued call leaves the queue, a
/// running sandbox is killed. `clock` started when the request arrived (its parse phase).
pub async fn execute(
    app: Arc<App>,
    req: request::ExecRequest,
    stop: StopToken,
    clock: crate::metrics::PhaseClock,
) -> Result<ExecutionResult, EngineError> {
    let located = locate(&app, &req.workspace)?;
    let _ticket = admit(&app, &req)?;
    let route = req.route;
    let mut prepared = prepare(&app, req, located, RunOptions::SYNC)?;
    attach_egress(&app, &mut prepared).await?;
    clock.mark(Phase::Parse);

    let language = prepared.language;
    let registration = app.registry.register(ActiveExecution {
        agent_id: prepared.agent_id.clone(),
        execution_id: prepared.execution_id.clone(),
        kernel_mode: "ephemeral",
        language: language_name(language),
        queued_at: crate::timefmt::now_iso(),
        session_id: prepared.session_id.clone(),
        started_at: None,
        status: super::registry::Status::Queued,
    });
    let audit = FinishAudit::new(
        &prepared.execution_id,
        &prepared.session_id,
        &prepared.agent_id,
        &prepared.root,
        prepared.profile,
    )
    .counted(&app.metrics, route.name())
    .clocked(clock);
    audit.admitted(language_name(language), false);
    let (root, session_id) = (prepared.root.clone(), prepared.session_id.clone());
    let agent_key = admission::agent_key(&session_id, &prepared.agent_id);
    let mut sync =
        Sync { app: &app, audit: &audit, registration: &registration, id: prepared.execution_id.clone() };
    let flow = Execution {
        app: &app,
        root: &root,
        max_workspace: prepared.max_workspace,
        prepared: Ok(prepared),
        queue: Queue::Agent { session_id: &session_id, agent_key },
        stop: &stop,
        audit: &audit,
        logs: None,
    }
    .run(&mut sync)
    .await;
    drop(registration);
    match flow {
        Flow::Abandoned | Flow::NotStarted => {
            audit.finished(RunOutcome::AbandonedInQueue, None, None, None);
            Err(EngineError::Aborted { label: language.label() })
        }
        Flow::Unheld(e) => {
            audit.failed(&e);
            Err(e)
        }
        Flow::Unresponsive(e) => Err(e),
        Flow::Finished { ran, committed } => answer(&app, &audit, *ran, committed),
    }
}

/// The answer: the run's result with its version, or its error. The run's own failure
/// (its quota, say) answers when the commit only refused what that run left behind (the
/// workspace is not poisoned then).
fn answer(
    app: &App,
    audit: &FinishAudit,
    ran: Result<ExecutionResult, EngineError>,
    committed: Result<Ref, WriteError>,
) -> Result<ExecutionResult, EngineError> {
    let tree = match committed {
        Ok(tree) => tree,
        Err(e) => {
            if e.is_content() {
                ran?;
            }
            return Err(EngineError::CommitFailed(e.to_string()));
        }
    };
    let mut result = ran?;
    result.workspace_snapshot = Some(tree.to_value());
    if let Some(c) = &audit.clock {
        c.mark(Phase::Answer);
        app.metrics.phases(c);
    }
    Ok(result)
}

/// The synchronous routes' hooks: the registry shows the run as running; the version is a
/// `legacy-execution` mutation (failed when the run failed).
struct Sync<'a> {
    app: &'a Arc<App>,
    audit: &'a FinishAudit,
    registration: &'a Registration,
    id: String,
}

impl Route for Sync<'_> {
    type Committed = Result<Ref, WriteError>;

    async fn starting(&mut self, started_at: &str) -> bool {
        self.registration.running(started_at.to_owned());
        true
    }

    async fn commit(
        &mut self,
        writer: &Writer,
        ran: &mut Result<ExecutionResult, EngineError>,
    ) -> Self::Committed {
        let commit_started = Instant::now();
        let (committed, snapshot_took) = self
            .app
            .versions
            .commit_mutation_timed(writer, "legacy-execution", Some(self.id.clone()), ran.is_ok())
            .await;
        self.app.metrics.committed(committed.is_ok(), commit_started.elapsed());
        if let Some(c) = &self.audit.clock {
            c.split(Phase::Snapshot, snapshot_took, Phase::Commit);
        }
        committed
    }
}
