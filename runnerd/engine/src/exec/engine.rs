//! One execution path for every route. [`Execution::run`] takes the same steps for
//! `/execute`, `/execute-shell` and `/shell-executions`: a place in the queue → the
//! workspace opened beneath the data directory → the cross-process writer lease → the
//! sandbox ([`super::run::run_sandbox`]) → a sandbox that did not die keeps the workspace
//! locked → the files as the run left them become a version → the locks go. What differs
//! is an option ([`Queue`], the log sink, the quota of the version) or one of the two
//! [`Route`] hooks: what happens right before the sandbox starts, and which kind of version
//! the commit makes.

use std::path::Path;

use super::audit::FinishAudit;
use super::prepare::{Prepared, attach_egress, resolve_cwd};
use super::run::run_sandbox;
use super::{EngineError, ExecutionResult, StopToken, admission};
use crate::app::App;
use crate::coordination::CoordError;
use crate::launch::OutputSink;
use crate::metrics::Phase;
use crate::timefmt;
use crate::workspace;
use crate::writer::{WriteError, Writer};

/// Which queue a run waits in.
#[derive(Debug)]
pub enum Queue<'a> {
    /// The synchronous routes': the session (shared), the agent, the workspace, a slot.
    Agent { session_id: &'a str, agent_key: String },
    /// The managed route's: the workspace (FIFO with every other writer of it), a slot.
    Workspace,
}

/// A place held in a [`Queue`].
enum Held {
    Agent { _place: admission::Running },
    Workspace { _place: admission::WorkspaceRun },
}

/// What a route does where the routes differ.
pub(crate) trait Route {
    /// What the route's commit answers.
    type Committed;

    /// The writer lease is held and the sandbox is about to start at `started_at`. `false`
    /// ends the run unstarted.
    async fn starting(&mut self, started_at: &str) -> bool;

    /// The sandbox has ended (`ran`) and the lease is still held: the version of the files
    /// as the run left them.
    async fn commit(
        &mut self,
        writer: &Writer,
        ran: &mut Result<ExecutionResult, EngineError>,
    ) -> Self::Committed;
}

/// How a run ended, for its route to answer.
#[derive(Debug)]
pub(crate) enum Flow<C> {
    /// Stopped while it waited for its queue or the writer lease.
    Abandoned,
    /// The workspace could not be opened or leased.
    Unheld(EngineError),
    /// [`Route::starting`] refused.
    NotStarted,
    /// The sandbox did not die: the workspace stays locked until a restart (fail closed).
    Unresponsive(EngineError),
    /// The run (or why it did not start) and its version.
    Finished { ran: Box<Result<ExecutionResult, EngineError>>, committed: C },
}

/// One admitted execution, ready to queue.
pub(crate) struct Execution<'a> {
    pub app: &'a App,
    /// The workspace (known even when the request was refused).
    pub root: &'a Path,
    /// The request as prepared, or why it cannot run (a managed request refused after its
    /// 202 fails here, where the original's run fails it).
    pub prepared: Result<Prepared, EngineError>,
    pub queue: Queue<'a>,
    pub stop: &'a StopToken,
    pub audit: &'a FinishAudit,
    /// Where the output also goes (a managed run's logs).
    pub logs: Option<&'a mut dyn OutputSink>,
    /// The most a version of this run's files stores (its quota).
    pub max_workspace: u64,
}

impl Execution<'_> {
    /// Takes the steps every route takes; `route` fills in the rest.
    pub async fn run<R: Route>(self, route: &mut R) -> Flow<R::Committed> {
        let Execution { app, root, prepared, queue, stop, audit, logs, max_workspace } = self;
        let held = tokio::select! {
            held = hold(app, &queue, root) => held,
            _ = stop.stopped() => return Flow::Abandoned,
        };
        audit.mark(Phase::Admit);
        // The cross-process writer lease (shared with the API process), inside our own
        // queues; running only once both are held.
        let pinned = match workspace::open_beneath(&app.data_dir, root) {
            Ok(fd) => fd,
            Err(e) => return Flow::Unheld(e),
        };
        let mut writer = match app.versions.begin(root, pinned, Some(&stop.watch())).await {
            Ok(w) => w,
            Err(WriteError::Coordination(CoordError::Aborted)) => return Flow::Abandoned,
            Err(e) => return Flow::Unheld(EngineError::Workspace(e)),
        };
        audit.mark(Phase::Lease);
        let started_at = timefmt::now_iso();
        if !route.starting(&started_at).await {
            return Flow::NotStarted;
        }
        let ran = match prepared {
            Ok(mut p) => {
                async {
                    resolve_cwd(app, &mut p)?;
                    attach_egress(app, &mut p).await?;
                    run_sandbox(app, &p, audit, started_at, logs, stop, &mut writer).await
                }
                .await
            }
            Err(e) => Err(e),
        };
        audit.mark(Phase::Snapshot);
        let mut ran = match ran {
            Err(e) if e.is_unresponsive() => {
                // The sandbox may still be writing: keep its workspace locked rather than let
                // the next writer in. An operator restart clears it.
                drop(writer.take_journal());
                std::mem::forget(writer);
                std::mem::forget(held);
                return Flow::Unresponsive(e);
            }
            ran => ran,
        };
        // Whatever happened, the files as the run left them become a version before the lease
        // is released — but never more than the quota is stored.
        writer.limit_snapshot_bytes(max_workspace);
        let committed = route.commit(&writer, &mut ran).await;
        drop(writer);
        drop(held);
        app.sandbox.call_ended(root);
        Flow::Finished { ran: Box::new(ran), committed }
    }
}

async fn hold(app: &App, queue: &Queue<'_>, root: &Path) -> Held {
    let root = root.to_path_buf();
    match queue {
        Queue::Agent { session_id, agent_key } => {
            Held::Agent { _place: app.admission.acquire(session_id, agent_key, &root).await }
        }
        Queue::Workspace => Held::Workspace { _place: app.admission.acquire_workspace(&root).await },
    }
}
