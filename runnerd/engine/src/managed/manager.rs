//! The managed-execution lifecycle (contract §3, internals §6): start checks in the
//! original's order, then in the background: the workspace FIFO and a slot, admission and
//! the writer lease, a baseline, `running`, the sandbox with live logs, and — whenever the
//! command started — a committed `WorkspaceExecution` version before `finishedAt` is saved
//! and the workspace released. Cancel aborts; the record turns `cancelled` only after the
//! process namespace is gone and the version committed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;

use super::ManagedState as State;
use super::db::{DbError, ExecutionsDb, ManagedExecution, OpenReport, RESTARTED, RecordMeta, RowReader};
use super::logs::{LogRow, PAGE_ROWS, Retention};
use crate::app::App;
use crate::coordination::ABORTED;
use crate::exec::engine::{Execution, Flow, Queue};
use crate::exec::{self, request};
use crate::launch::{Held, OutputPool, OutputSink, Stream};
use crate::timefmt;
use crate::writer::{ContentSource, ExecutionFacts, Writer};

pub const SHUTTING_DOWN: &str = "Runner is shutting down";
pub const INVALID_ID: &str = "Invalid Execution ID";
pub const POISONED_HERE: &str =
    "Workspace version commit failed; repair storage before restarting the Runner";
pub const USED_ID: &str = "Execution ID has already been used; query it instead of replaying the command";
pub const NOT_FOUND: &str = "Execution not found for this Agent";
pub const INVALID_CURSOR: &str = "Invalid log cursor";
pub const CANCELLED_BEFORE_START: &str = "Execution cancelled before start";
/// The error of a run whose final record could not be written when it ended.
pub const RECORD_FAILED: &str = "Execution ended, but its record could not be written";
/// How often records that could not be written are tried again.
pub const RECORD_RETRY: Duration = Duration::from_millis(500);
/// How often live log rows are written (one transaction per flush).
pub const LOG_FLUSH: Duration = Duration::from_millis(100);
/// Unwritten log text past which the launcher waits for the flusher (see `LiveLogs`).
pub const LOG_BACKLOG: usize = 8 << 20;

/// Records larger than this are answered as a stream, their size held from the output pool.
pub const LARGE_RECORD: u64 = 1 << 20;
/// How long a status or cancel request waits for output memory before 503.
pub const RECORD_WAIT: Duration = Duration::from_secs(30);

/// A record's stored text and, for a large one, its memory held from the output pool.
#[derive(Debug)]
pub struct RecordText {
    pub text: String,
    pub held: Option<Held>,
}

/// The most output a managed run's `result.stdout`/`stderr` hold together, counted as JSON
/// (the logs keep everything the retention budget allows). Small, because the record holding
/// it is written whole into SQLite, which copies a bound text about twice, and read whole for
/// every status request.
pub const RESULT_OUTPUT_CAP: u64 = 4 << 20;

/// The output budget of a managed run's result: its `maxOutputBytes`, at most the cap
/// (`0`, unlimited, becomes the cap).
pub fn result_budget(max_output: u64) -> u64 {
    if max_output == 0 { RESULT_OUTPUT_CAP } else { max_output.min(RESULT_OUTPUT_CAP) }
}

/// `^[A-Za-z0-9_:.-]{1,160}$`
pub fn valid_id(id: &str) -> bool {
    (1..=160).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_:.-".contains(&b))
}

/// `Number(param ?? "0")` accepted only when a non-negative integer (contract §3 "Logs").
pub fn parse_cursor(param: Option<&str>) -> Option<u64> {
    let text = param.unwrap_or("0").trim_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
    if text.is_empty() {
        return Some(0);
    }
    for (prefix, radix) in [("0x", 16), ("0X", 16), ("0o", 8), ("0O", 8), ("0b", 2), ("0B", 2)] {
        if let Some(digits) = text.strip_prefix(prefix) {
            return u64::from_str_radix(digits, radix).ok().filter(|_| !digits.starts_with(['+', '-']));
        }
    }
    let lower = text.to_ascii_lowercase();
    if lower.contains("inf") || lower.contains("nan") {
        return None;
    }
    let n: f64 = text.parse().ok()?;
    (n >= 0.0 && n.fract() == 0.0 && n <= 9_007_199_254_740_991.0).then_some(n as u64)
}

/// A managed request as accepted: the engine's verdict on it (decided once, before the
/// 202) and what the run's record and version need whatever that verdict.
#[derive(Debug)]
struct Submitted {
    root: std::path::PathBuf,
    code: String,
    /// The log budget (`maxOutputBytes`); the result's copy is bounded further.
    max_output: u64,
    max_workspace: u64,
    prepared: Result<exec::Prepared, exec::EngineError>,
}

#[derive(Debug)]
pub struct Manager {
    db: Arc<ExecutionsDb>,
    /// Records whose last write failed (disk full, say): the truth until a retry stores them.
    unsaved: Arc<Unsaved>,
    /// What opening the database found (for the start-up line and `/health`).
    opened: OpenReport,
    controllers: Mutex<HashMap<String, exec::StopToken>>,
    /// The workspaces accepted runs are in, counted until each run ends: a move waits for
    /// none of them and refuses instead (issue #34).
    held: Mutex<HashMap<std::path::PathBuf, usize>>,
    closing: AtomicBool,
    active: AtomicUsize,
    idle: Notify,
}

/// Why a managed-execution request was refused; `runnerd::api::managed` maps each to its
/// answer (the contract's 400 texts; 503 while output memory is busy; 500 for our storage).
#[derive(Debug, thiserror::Error)]
pub enum ManagedError {
    #[error("{SHUTTING_DOWN}")]
    ShuttingDown,
    #[error("{INVALID_ID}")]
    InvalidId,
    #[error("{POISONED_HERE}")]
    Poisoned,
    #[error("{USED_ID}")]
    IdUsed,
    #[error("{NOT_FOUND}")]
    NotFound,
    #[error("{INVALID_CURSOR}")]
    InvalidCursor,
    #[error("The runner's output memory is in use; retry the status request")]
    OutputBusy,
    /// The records' database (or a record's text) failed.
    #[error("{0}")]
    Store(String),
    /// The workspace moved to another node (issue #34): runs go there.
    #[error("Workspace moved to {moved_to} (epoch {epoch}); send it there")]
    Moved { moved_to: String, epoch: u64 },
}

impl ManagedError {
    /// The stable machine-readable name (the answer's `code`).
    pub fn code(&self) -> &'static str {
        match self {
            ManagedError::ShuttingDown => "shutting_down",
            ManagedError::InvalidId => "invalid_execution_id",
            ManagedError::Poisoned => "workspace_poisoned",
            ManagedError::IdUsed => "execution_id_used",
            ManagedError::NotFound => "execution_not_found",
            ManagedError::InvalidCursor => "invalid_cursor",
            ManagedError::OutputBusy => "output_memory_busy",
            ManagedError::Store(_) => "internal",
            ManagedError::Moved { .. } => "workspace_moved",
        }
    }
}

fn internal(e: impl std::fmt::Display) -> ManagedError {
    ManagedError::Store(e.to_string())
}

async fn db_do<T: Send + 'static>(
    db: &Arc<ExecutionsDb>,
    f: impl FnOnce(&ExecutionsDb) -> Result<T, DbError> + Send + 'static,
) -> Result<T, ManagedError> {
    let db = db.clone();
    match tokio::task::spawn_blocking(move || f(&db)).await {
        Ok(r) => r.map_err(|e| internal(crate::error_chain(&e))),
        Err(e) => Err(internal(e)),
    }
}

impl Manager {
    /// Opens the records; unfinished ones from a previous process become `unknown`.
    /// A damaged database is set aside and a new one started; unreadable rows answer
    /// `unknown` (see [`ExecutionsDb::open`]). Must run inside a tokio runtime: a task
    /// retries the records whose writes failed.
    pub fn open(data_dir: &std::path::Path) -> Result<Manager, DbError> {
        let (db, opened) = ExecutionsDb::open(data_dir, &timefmt::now_iso())?;
        for id in &opened.turned {
            tracing::warn!(event = "execution_unknown", execution_id = %id, reason = RESTARTED);
        }
        for (id, why) in &opened.unreadable {
            tracing::error!(event = "execution_record_unreadable", execution_id = %id, reason = %why);
        }
        if let Some(aside) = &opened.set_aside {
            let moved: Vec<String> = aside.moved.iter().map(|p| p.display().to_string()).collect();
            tracing::error!(event = "execution_database_set_aside", moved = %moved.join(", "), reason = %aside.reason,
                remedy = "a new database serves; records from before the damage may be recovered from the moved file with `sqlite3 <moved> .recover`");
        }
        let db = Arc::new(db);
        let unsaved: Arc<Unsaved> = Arc::default();
        tokio::spawn(retry_unsaved(Arc::downgrade(&db), Arc::downgrade(&unsaved)));
        Ok(Manager {
            db,
            unsaved,
            opened,
            controllers: Mutex::default(),
            held: Mutex::default(),
            closing: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            idle: Notify::new(),
        })
    }

    fn controllers(&self) -> std::sync::MutexGuard<'_, HashMap<String, exec::StopToken>> {
        self.controllers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether an accepted managed run (queued or running) is in the workspace `root`.
    pub fn holds(&self, root: &std::path::Path) -> bool {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).contains_key(root)
    }

    fn hold(&self, root: &std::path::Path, delta: isize) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let count = held.entry(root.to_owned()).or_default();
        *count = count.saturating_add_signed(delta);
        if *count == 0 {
            held.remove(root);
        }
    }

    /// `ExecutionManager.start`: checks, the queued record, and the background run. The run's
    /// own checks (the engine's `prepare`) are made here once, before the 202, but a request
    /// they refuse is still accepted and fails when it starts, as the original's does (contract
    /// §3 lists only these four refusals, and its API records a refused submit as
    /// `unconfirmed`, where a failed record shows the agent why).
    pub async fn start(
        self: &Arc<Self>,
        app: Arc<App>,
        req: request::ExecRequest,
        located: exec::Located,
    ) -> Result<ManagedExecution, ManagedError> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(ManagedError::ShuttingDown);
        }
        let id = req.execution_id.clone();
        if !valid_id(&id) {
            return Err(ManagedError::InvalidId);
        }
        if app.versions.lifecycle().is_poisoned(&located.root) {
            return Err(ManagedError::Poisoned);
        }
        // Fail closed: a placement that cannot be read may be a fence.
        match app.versions.fenced(&located.root) {
            Ok(()) => {}
            Err(crate::writer::WriteError::Fenced { moved_to, epoch }) => {
                return Err(ManagedError::Moved { moved_to, epoch });
            }
            Err(e) => return Err(internal(crate::error_chain(&e))),
        }
        let rec = ManagedExecution::queued(
            req.agent_id.clone(),
            req.session_id.clone(),
            id.clone(),
            timefmt::now_iso(),
        );
        let stored = rec.clone();
        if !db_do(&self.db, move |db| db.insert_new(&stored)).await? {
            return Err(ManagedError::IdUsed);
        }
        let (max_output, max_workspace) = exec::budgets(&app, &req);
        let submitted = Submitted {
            root: located.root.clone(),
            code: req.code.clone(),
            max_output,
            max_workspace,
            prepared: exec::check_mounts(&req)
                .and_then(|()| exec::prepare(&app, req, located, exec::RunOptions::MANAGED)),
        };
        let stop = exec::StopToken::new();
        self.controllers().insert(id.clone(), stop.clone());
        self.active.fetch_add(1, Ordering::SeqCst);
        // A run refused by its checks never launches: its audit names the baseline profile.
        let profile = submitted.prepared.as_ref().map_or(common::seccomp::Profile::Baseline, |p| p.profile);
        let audit = exec::FinishAudit::new(&id, &rec.session_id, &rec.agent_id, &submitted.root, profile)
            .counted(&app.metrics, request::Route::ShellExecutions.name());
        audit.admitted("shell", true);
        let me = self.clone();
        let queued = rec.clone();
        let held = submitted.root.clone();
        self.hold(&held, 1);
        tokio::spawn(async move {
            me.run(app, queued, submitted, stop, &audit).await;
            me.hold(&held, -1);
            me.controllers().remove(&id);
            if me.active.fetch_sub(1, Ordering::SeqCst) == 1 {
                me.idle.notify_waiters();
            }
        });
        Ok(rec)
    }

    /// What opening the records found: a database set aside, unreadable rows.
    pub fn opened(&self) -> &OpenReport {
        &self.opened
    }

    /// `/health`'s `executionRecords`: whether the database was set aside at start-up,
    /// which rows are unreadable, and how many records wait for the store to accept writes.
    pub fn health_block(&self) -> Value {
        let aside = self.opened.set_aside.as_ref().map(|a| {
            json!({
                "movedTo": a.moved.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
                "reason": a.reason,
            })
        });
        let unreadable: Vec<&str> = self.opened.unreadable.iter().map(|(id, _)| id.as_str()).collect();
        json!({
            "setAside": aside,
            "unreadableRecords": unreadable,
            "unsavedRecords": lock(&self.unsaved.records).len(),
        })
    }

    /// What the records name, for the version collector ([`ExecutionsDb::named_versions`]).
    pub fn named_versions(&self) -> Result<Vec<crate::versioning::Ref>, DbError> {
        self.db.named_versions()
    }

    /// The start-up line about damaged records, if any was found.
    pub fn startup_note(&self) -> Option<String> {
        let mut notes = Vec::new();
        if let Some(a) = &self.opened.set_aside {
            let moved: Vec<String> = a.moved.iter().map(|p| p.display().to_string()).collect();
            notes.push(format!(
                "the damaged execution database was moved aside to {} and a new one started ({})",
                moved.join(", "),
                a.reason
            ));
        }
        if !self.opened.unreadable.is_empty() {
            let ids: Vec<&str> = self.opened.unreadable.iter().map(|(id, _)| id.as_str()).collect();
            notes.push(format!("unreadable execution records answer `unknown`: {}", ids.join(", ")));
        }
        (!notes.is_empty()).then(|| format!("execution records: {}", notes.join("; ")))
    }

    /// Stores a state change; see [`Manager::store`].
    async fn save(&self, rec: &ManagedExecution) {
        let _ = self.store(rec, ManagedExecution::clone).await;
    }

    /// Stores the record, serialized once (a clone of a record with a large result would copy
    /// it). When that fails, `kept(rec)` becomes the truth: reads answer it, and a retry
    /// stores it once the database accepts writes again. Returns that truth when it is not
    /// `rec` as given.
    async fn store(
        &self,
        rec: &ManagedExecution,
        kept: fn(&ManagedExecution) -> ManagedExecution,
    ) -> Option<ManagedExecution> {
        let failed = |e: String| {
            let truth = kept(rec);
            lock(&self.unsaved.records).insert(truth.id.clone(), truth.clone());
            tracing::error!(event = "execution_record_failed", execution_id = %rec.id, error = %e, state = %truth.state, detail = "kept; stored once the database accepts writes");
            Some(truth)
        };
        let json = match serde_json::to_string(rec) {
            Ok(json) => json,
            Err(e) => return failed(e.to_string()),
        };
        let (id, session, agent) = (rec.id.clone(), rec.session_id.clone(), rec.agent_id.clone());
        let unsaved = self.unsaved.clone();
        let written = db_do(&self.db, move |db| {
            // Under the writes lock, so that a retry cannot store an older truth after this one.
            let _writing = lock(&unsaved.writes);
            let saved = db.save_json(&id, &session, &agent, &json);
            if saved.is_ok() {
                lock(&unsaved.records).remove(&id);
            }
            saved
        })
        .await;
        match written {
            Ok(()) => None,
            Err(e) => failed(e.to_string()),
        }
    }

    /// Records the end; `audit`'s `execution_finished` is written here when the run ended
    /// before its sandbox could write it (the state is its outcome).
    async fn finish(
        &self,
        rec: &mut ManagedExecution,
        audit: &exec::FinishAudit,
        state: State,
        error: Option<String>,
    ) {
        audit.finished(state, None, None, error.as_deref());
        rec.state = state;
        if error.is_some() {
            rec.error = error;
        }
        rec.finished_at = Some(timefmt::now_iso());
        // An end that cannot be recorded is stored (and answered until then) as a failure
        // that says so — never as the `queued`/`running` on disk.
        if let Some(truth) = self.store(rec, record_failed).await {
            *rec = truth;
        }
        tracing::info!(
            event = "managed_execution_finished",
            execution_id = %rec.id,
            session_id = %rec.session_id,
            agent_id = %rec.agent_id,
            state = %rec.state,
            error = rec.error.as_deref().unwrap_or(""),
            version = rec.version.as_ref().and_then(|v| v.get("digest")).and_then(serde_json::Value::as_str).unwrap_or(""),
        );
    }

    /// The run in the background, through the engine's one execution path
    /// ([`exec::engine::Execution`]), in the workspace's FIFO; the record says how it ended.
    async fn run(
        self: &Arc<Self>,
        app: Arc<App>,
        rec: ManagedExecution,
        submitted: Submitted,
        stop: exec::StopToken,
        audit: &exec::FinishAudit,
    ) {
        let Submitted { root, code, max_output, max_workspace, prepared } = submitted;
        // The logs keep the whole budget; the copy in `result` is bounded so that a huge or
        // unlimited budget cannot exhaust memory.
        let live = LiveLogs::new(max_output);
        let mut sink = live.clone();
        let mut route = ManagedRun {
            manager: self,
            app: &app,
            rec,
            audit,
            stop: &stop,
            code,
            root: &root,
            live,
            flusher: None,
        };
        let flow = Execution {
            app: &app,
            root: &root,
            prepared: prepared.map(|mut p| {
                p.max_output = result_budget(p.max_output);
                p
            }),
            queue: Queue::Workspace,
            stop: &stop,
            audit,
            logs: Some(&mut sink),
            max_workspace,
        }
        .run(&mut route)
        .await;
        let (state, error) = match flow {
            // The commit recorded the end before the workspace was released.
            Flow::Finished { .. } => return,
            Flow::Abandoned => (State::Cancelled, ABORTED.to_owned()),
            Flow::NotStarted => (State::Cancelled, CANCELLED_BEFORE_START.to_owned()),
            Flow::Unheld(e) => (State::Failed, e.to_string()),
            Flow::Unresponsive(e) => {
                route.close_logs().await;
                (State::Failed, e.to_string())
            }
        };
        let ManagedRun { mut rec, .. } = route;
        self.finish(&mut rec, audit, state, Some(error)).await;
    }

    /// The record's owner, state and size, if it belongs to this owner (its text unread).
    async fn meta(&self, id: &str, session_id: &str, agent_id: &str) -> Result<RecordMeta, ManagedError> {
        let key = id.to_owned();
        let meta = db_do(&self.db, move |db| db.meta(&key)).await?;
        meta.filter(|m| m.session_id == session_id && m.agent_id == agent_id).ok_or(ManagedError::NotFound)
    }

    /// The record as stored, if it belongs to this owner. A large one (its result holds up
    /// to [`RESULT_OUTPUT_CAP`] of output) first holds its size from the output pool, waiting up to
    /// [`RECORD_WAIT`] for room, so that concurrent status requests cannot multiply it.
    pub async fn record(
        &self,
        pool: &Arc<OutputPool>,
        id: &str,
        session_id: &str,
        agent_id: &str,
    ) -> Result<RecordText, ManagedError> {
        let meta = self.meta(id, session_id, agent_id).await?;
        // A record the database could not take yet is answered as kept (the truth): its
        // text is what will be sent, so its size is what the pool must hold.
        let pending = lock(&self.unsaved.records)
            .get(id)
            .filter(|r| r.session_id == session_id && r.agent_id == agent_id)
            .map(serde_json::to_string)
            .transpose()
            .map_err(internal)?;
        let size = pending.as_ref().map_or(meta.size, |text| text.len() as u64);
        let held = if size > LARGE_RECORD {
            let held = pool.acquire(size, RECORD_WAIT).await.ok_or(ManagedError::OutputBusy)?;
            Some(held)
        } else {
            None
        };
        if let Some(text) = pending {
            return Ok(RecordText { text, held });
        }
        let key = id.to_owned();
        let stored = match meta.readable {
            true => {
                let key = key.clone();
                db_do(&self.db, move |db| db.record_text(&key)).await.ok()
            }
            false => None,
        };
        let text = match stored {
            Some(row) => {
                let (_, _, text) =
                    row.filter(|(s, a, _)| s == session_id && a == agent_id).ok_or(ManagedError::NotFound)?;
                text
            }
            // A damaged row (not JSON, not UTF-8) answers the `unknown` record that says why.
            None => {
                let rec = db_do(&self.db, move |db| db.get(&key)).await?;
                let rec = rec.ok_or(ManagedError::NotFound)?;
                serde_json::to_string(&rec).map_err(internal)?
            }
        };
        Ok(RecordText { text, held })
    }

    /// One `ExecutionLogPage`.
    pub async fn logs(
        &self,
        id: &str,
        session_id: &str,
        agent_id: &str,
        cursor: Option<&str>,
    ) -> Result<Value, ManagedError> {
        let after = parse_cursor(cursor).ok_or(ManagedError::InvalidCursor)?;
        let rec = self.meta(id, session_id, agent_id).await?;
        let key = id.to_owned();
        let page = db_do(&self.db, move |db| db.page(&key, after, PAGE_ROWS)).await?;
        let next = page.rows.last().map_or(after, |r| r.0);
        let chunks: Vec<Value> = page
            .rows
            .into_iter()
            .map(|(cursor, stream, text)| json!({"cursor": cursor, "stream": stream, "text": text}))
            .collect();
        Ok(json!({
            "chunks": chunks,
            "nextCursor": next,
            "retentionTruncated": rec.log_truncated,
            "truncated": page.more,
        }))
    }

    /// Aborts a non-terminal execution; answers the record as it is now.
    pub async fn cancel(
        &self,
        pool: &Arc<OutputPool>,
        id: &str,
        session_id: &str,
        agent_id: &str,
    ) -> Result<RecordText, ManagedError> {
        let rec = self.meta(id, session_id, agent_id).await?;
        if !super::db::is_terminal(&rec.state)
            && let Some(stop) = self.controllers().get(id)
        {
            stop.stop(exec::StopReason::Caller);
            tracing::info!(event = "execution_cancel_requested", execution_id = %id, state = %rec.state);
        }
        self.record(pool, id, session_id, agent_id).await
    }

    /// Refuses new starts, aborts every execution and waits (bounded) for them to record
    /// their end.
    pub async fn close(&self, grace: Duration) {
        self.closing.store(true, Ordering::SeqCst);
        for stop in self.controllers().values() {
            stop.stop(exec::StopReason::Caller);
        }
        let wait = async {
            loop {
                let notified = self.idle.notified();
                if self.active.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(grace, wait).await.is_err() {
            tracing::warn!(
                event = "shutdown",
                detail = "managed executions did not record their end in time"
            );
        }
    }
}

/// The managed route's hooks on the engine's path: the record turns `running` (unless the run
/// was cancelled meanwhile) and its logs start flowing; the version is a `WorkspaceExecution`
/// with the retained logs, and the record is finished before the workspace is released.
struct ManagedRun<'a> {
    manager: &'a Arc<Manager>,
    app: &'a App,
    rec: ManagedExecution,
    audit: &'a exec::FinishAudit,
    stop: &'a exec::StopToken,
    code: String,
    root: &'a std::path::Path,
    live: LiveLogs,
    flusher: Option<tokio::task::JoinHandle<()>>,
}

impl ManagedRun<'_> {
    /// Ends the logs: the last rows are written, and whether any were dropped is recorded.
    async fn close_logs(&mut self) {
        self.live.close();
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.await;
        }
        if self.live.truncated() {
            self.rec.log_truncated = Some(true);
        }
    }

    /// The version's output streams: the retained rows (streamed from the database), or,
    /// for a stream with nothing retained, the result's text, then (stderr) the error, as
    /// the original.
    async fn outputs(
        &self,
        result: Option<&exec::ExecutionResult>,
        error: Option<&String>,
    ) -> (ContentSource, ContentSource) {
        let (id, db) = (self.rec.id.clone(), self.manager.db.clone());
        let retained =
            db_do(&db, move |db| Ok((db.has_rows(&id, Stream::Stdout)?, db.has_rows(&id, Stream::Stderr)?)))
                .await
                .unwrap_or((false, false));
        // Copied only when needed (the result's text can be large).
        let fallback_out =
            if retained.0 { String::new() } else { result.map(|r| r.stdout.to_string()).unwrap_or_default() };
        let fallback_err = if retained.1 {
            String::new()
        } else {
            result.map(|r| r.stderr.to_string()).or_else(|| error.cloned()).unwrap_or_default()
        };
        (
            content_source(&db, &self.rec.id, Stream::Stdout, retained.0, fallback_out),
            content_source(&db, &self.rec.id, Stream::Stderr, retained.1, fallback_err),
        )
    }
}

impl exec::engine::Route for ManagedRun<'_> {
    type Committed = ();

    async fn starting(&mut self, started_at: &str) -> bool {
        if self.stop.is_stopped() {
            return false;
        }
        self.rec.state = State::Running;
        self.rec.started_at = Some(started_at.to_owned());
        self.manager.save(&self.rec).await;
        let (db, id) = (self.manager.db.clone(), self.rec.id.clone());
        self.flusher = Some(tokio::spawn(flush_logs(db, id, self.live.clone())));
        true
    }

    async fn commit(&mut self, writer: &Writer, ran: &mut Result<exec::ExecutionResult, exec::EngineError>) {
        self.close_logs().await;
        let (state, error) = match &*ran {
            Ok(r) => (if r.exit_code == 0 { State::Completed } else { State::Failed }, None),
            Err(e) if self.stop.stopped_by_caller() => (State::Cancelled, Some(e.to_string())),
            Err(e) => (State::Failed, Some(e.to_string())),
        };
        let mut result = ran.as_mut().ok();
        let (stdout, stderr) = self.outputs(result.as_deref(), error.as_ref()).await;
        let facts = ExecutionFacts {
            agent_id: self.rec.agent_id.clone(),
            session_id: self.rec.session_id.clone(),
            execution_id: self.rec.id.clone(),
            environment_revision_id: result.as_ref().map(|r| r.environment_revision_id.clone()),
            state,
            code: std::mem::take(&mut self.code),
            stdout,
            stderr,
        };
        let app = self.app;
        let commit_started = std::time::Instant::now();
        let committed = app.versions.commit_execution(writer, facts).await;
        app.metrics.committed(committed.is_ok(), commit_started.elapsed());
        let (state, error) = match committed {
            Ok((version, tree)) => {
                self.rec.version = Some(version.to_value());
                if let Some(r) = result.as_mut() {
                    r.workspace_snapshot = Some(tree.to_value());
                }
                (state, error)
            }
            Err(e) => {
                app.versions.fail_commit(self.root, &e);
                (State::Failed, Some(format!("Execution ended, but workspace version commit failed: {e}")))
            }
        };
        // The output stays counted in the pool while the record holds its copy.
        let held: Vec<Held> = result
            .as_mut()
            .map(|r| [r.stdout.take_held(), r.stderr.take_held()].into_iter().flatten().collect())
            .unwrap_or_default();
        self.rec.result = result.and_then(|r| serde_json::to_value(&*r).ok());
        self.manager.finish(&mut self.rec, self.audit, state, error).await;
        drop(held);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The record a run's end becomes when it could not be written: `failed`, the error saying
/// so and how the run ended (result and version are kept).
fn record_failed(rec: &ManagedExecution) -> ManagedExecution {
    let mut failed = rec.clone();
    failed.error = Some(failed_error(rec.state, rec.error.as_deref()));
    failed.state = State::Failed;
    failed
}

/// `RECORD_FAILED`, then how the run ended and its own error, if any.
pub fn failed_error(state: State, error: Option<&str>) -> String {
    match error {
        Some(e) => format!("{RECORD_FAILED} when it ended {state}: {e}"),
        None => format!("{RECORD_FAILED} when it ended {state}"),
    }
}

/// Records whose last write failed, and the lock every record write holds. Writers hold
/// `writes` (on blocking threads) across the SQLite write; readers on the runtime take only
/// `records`, briefly, so a slow disk never blocks a runtime worker.
#[derive(Debug, Default)]
struct Unsaved {
    records: Mutex<HashMap<String, ManagedExecution>>,
    writes: Mutex<()>,
}

/// Stores the records whose writes failed, every [`RECORD_RETRY`], until the manager is gone.
async fn retry_unsaved(db: std::sync::Weak<ExecutionsDb>, unsaved: std::sync::Weak<Unsaved>) {
    loop {
        tokio::time::sleep(RECORD_RETRY).await;
        let (Some(db), Some(unsaved)) = (db.upgrade(), unsaved.upgrade()) else { return };
        if lock(&unsaved.records).is_empty() {
            continue;
        }
        let _ = tokio::task::spawn_blocking(move || {
            // The records' map is locked only to copy and to remove (the async side reads it);
            // the writes lock orders this against every other record write.
            let _writing = lock(&unsaved.writes);
            let pending: Vec<ManagedExecution> = lock(&unsaved.records).values().cloned().collect();
            for rec in pending {
                if db.save(&rec).is_ok() {
                    let mut records = lock(&unsaved.records);
                    if records.get(&rec.id) == Some(&rec) {
                        records.remove(&rec.id);
                        tracing::warn!(event = "execution_record_stored", execution_id = %rec.id, state = %rec.state, detail = "after earlier writes failed");
                    }
                }
            }
        })
        .await;
    }
}

/// The content of one stream for the version: the retained rows, or the fallback text.
fn content_source(
    db: &Arc<ExecutionsDb>,
    id: &str,
    stream: Stream,
    retained: bool,
    fallback: String,
) -> ContentSource {
    if retained {
        let (db, id) = (db.clone(), id.to_owned());
        Arc::new(move || Box::new(RowReader::new(db.clone(), &id, stream)) as Box<dyn std::io::Read + Send>)
    } else {
        let text = Arc::new(fallback);
        Arc::new(move || {
            Box::new(std::io::Cursor::new(text.as_bytes().to_vec())) as Box<dyn std::io::Read + Send>
        })
    }
}

#[derive(Debug)]
struct LogState {
    retention: Retention,
    pending: Vec<LogRow>,
    /// Bytes of text in `pending`.
    pending_bytes: usize,
    newly_truncated: bool,
    closed: bool,
}

/// The live log of one run: the sink side (called by the launcher) and the state the
/// flusher drains.
#[derive(Debug, Clone)]
struct LiveLogs {
    state: Arc<(Mutex<LogState>, Notify)>,
    /// Wakes the flusher before its next tick (a backlog).
    wake: Arc<Notify>,
    /// Notified when the flusher takes the pending rows.
    drained: Arc<Notify>,
}

impl LiveLogs {
    fn new(budget: u64) -> LiveLogs {
        let state = LogState {
            retention: Retention::new(budget),
            pending: Vec::new(),
            pending_bytes: 0,
            newly_truncated: false,
            closed: false,
        };
        LiveLogs {
            state: Arc::new((Mutex::new(state), Notify::new())),
            wake: Arc::default(),
            drained: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn close(&self) {
        self.lock().closed = true;
        self.state.1.notify_one();
    }

    fn truncated(&self) -> bool {
        self.lock().retention.truncated()
    }
}

impl OutputSink for LiveLogs {
    fn write(&mut self, stream: Stream, bytes: &[u8]) {
        let mut s = self.lock();
        let (rows, first) = s.retention.push(stream, bytes);
        s.pending_bytes += rows.iter().map(|r| r.text.len()).sum::<usize>();
        s.pending.extend(rows);
        s.newly_truncated |= first;
    }

    /// Past [`LOG_BACKLOG`] unwritten bytes the launcher stops reading until the flusher
    /// takes them (the sandbox waits on its full pipe): rows never pile up in memory faster
    /// than SQLite writes them.
    fn backlog(&self) -> Option<Arc<Notify>> {
        if self.lock().pending_bytes <= LOG_BACKLOG {
            return None;
        }
        self.wake.notify_one();
        Some(self.drained.clone())
    }
}

/// Writes pending rows every [`LOG_FLUSH`] (one transaction each) until closed and drained;
/// the first overflow is recorded on the execution at once.
async fn flush_logs(db: Arc<ExecutionsDb>, id: String, live: LiveLogs) {
    let state = live.state.clone();
    let mut next_cursor = 1u64;
    loop {
        let closed = tokio::select! {
            _ = tokio::time::sleep(LOG_FLUSH) => false,
            _ = live.wake.notified() => false,
            _ = state.1.notified() => true,
        };
        let (rows, truncated_now, done) = {
            let mut s = state.0.lock().unwrap_or_else(|p| p.into_inner());
            let rows = std::mem::take(&mut s.pending);
            s.pending_bytes = 0;
            let t = std::mem::take(&mut s.newly_truncated);
            (rows, t, closed || s.closed)
        };
        live.drained.notify_waiters();
        let (first, key, db2) = (next_cursor, id.clone(), db.clone());
        let written = tokio::task::spawn_blocking(move || {
            let result = db2.append_logs(&key, first, &rows).and_then(|()| match db2.get(&key)? {
                Some(mut rec) if truncated_now => {
                    rec.log_truncated = Some(true);
                    db2.save(&rec)
                }
                _ => Ok(()),
            });
            (rows, result)
        })
        .await;
        match written {
            Ok((rows, Ok(()))) => next_cursor += rows.len() as u64,
            Ok((rows, Err(e))) => {
                // Kept for the next flush, in order: cursors stay gapless.
                tracing::error!(event = "execution_log_failed", execution_id = %id, error = %crate::error_chain(&e), rows = rows.len());
                let mut s = state.0.lock().unwrap_or_else(|p| p.into_inner());
                s.pending_bytes += rows.iter().map(|r| r.text.len()).sum::<usize>();
                s.pending.splice(0..0, rows);
                s.newly_truncated |= truncated_now;
            }
            Err(e) => tracing::error!(event = "execution_log_failed", execution_id = %id, error = %e),
        }
        if done {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past the backlog the launcher is held (`backlog` is `Some`) until the real flusher
    /// takes the rows; then it reads on, and every row reaches the database.
    #[tokio::test]
    async fn a_log_backlog_holds_the_reader_until_the_flusher_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(ExecutionsDb::open(dir.path(), "t").unwrap().0);
        let live = LiveLogs::new(0);
        let mut sink = live.clone();
        let chunk = vec![b'x'; 64 * 1024];
        let mut written = 0;
        let drained = loop {
            if let Some(n) = sink.backlog() {
                break n;
            }
            sink.write(Stream::Stdout, &chunk);
            written += chunk.len();
        };
        assert!(written > LOG_BACKLOG);
        let notified = drained.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let flusher = tokio::spawn(flush_logs(db.clone(), "e".into(), live.clone()));
        tokio::time::timeout(Duration::from_secs(60), notified).await.expect("the flusher drains");
        assert!(sink.backlog().is_none());
        live.close();
        flusher.await.unwrap();
        let rows = db.page("e", 0, usize::MAX >> 1).unwrap().rows;
        assert_eq!(rows.iter().map(|r| r.2.len()).sum::<usize>(), written);
    }

    #[test]
    fn execution_ids_follow_the_original_pattern() {
        for (id, ok) in [
            ("managed-first", true),
            ("a:b.c_d-1", true),
            ("", false),
            ("has space", false),
            ("slash/no", false),
            ("é", false),
        ] {
            assert_eq!(valid_id(id), ok, "{id:?}");
        }
        assert!(valid_id(&"x".repeat(160)) && !valid_id(&"x".repeat(161)));
    }

    #[test]
    fn an_end_that_cannot_be_recorded_becomes_a_failure_that_says_how_it_ended() {
        let mut rec = ManagedExecution::queued("a".into(), "s".into(), "id".into(), "t".into());
        rec.state = State::Completed;
        let failed = record_failed(&rec);
        assert_eq!(
            (failed.state.as_str(), failed.error.as_deref()),
            ("failed", Some(format!("{RECORD_FAILED} when it ended completed").as_str()))
        );
        assert_eq!(
            failed_error(State::Cancelled, Some("why")),
            format!("{RECORD_FAILED} when it ended cancelled: why")
        );
    }

    #[test]
    fn a_results_output_is_bounded_whatever_the_budget() {
        for (budget, want) in [(0, RESULT_OUTPUT_CAP), (1000, 1000), (u64::MAX, RESULT_OUTPUT_CAP)] {
            assert_eq!(result_budget(budget), want, "{budget}");
        }
    }

    #[test]
    fn cursors_parse_like_javascript_number() {
        for (text, want) in [
            (None, Some(0)),
            (Some(""), Some(0)),
            (Some("  7 "), Some(7)),
            (Some("1e2"), Some(100)),
            (Some("0x10"), Some(16)),
            (Some("-1"), None),
            (Some("1.5"), None),
            (Some("abc"), None),
            (Some("Infinity"), None),
            (Some("NaN"), None),
            (Some("3.0"), Some(3)),
        ] {
            assert_eq!(parse_cursor(text), want, "{text:?}");
        }
    }
}
