//! The broker proper: validates submissions, keeps one FIFO queue with one job running at a
//! time (`queueConcurrency: 1`), runs each job in the host namespace with no shell, a fixed
//! argv expanded from the whitelist and a filtered environment, in its own process group,
//! and cancels by SIGTERM to the group and SIGKILL two seconds later. Every change of a
//! job's state is persisted ([`crate::jobs::Store`]) and audited (`npu_job_*` events).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::layout;
use common::npu::{BrokerStatus, Confinement, Failure, Submission};
use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::sync::{Notify, watch};

use crate::jobs::{Job, Logs, State, Store};
use crate::template::{self, Context};
use crate::workloads::{self, Workload};
use crate::{af3, environ, timefmt};

/// Each stream keeps this much of its end (a job's result is usually printed last); what
/// falls off sets `truncated`. Two streams escaped as JSON stay under the channel's 1 MiB frame.
pub const LOG_LIMIT: usize = 64 * 1024;
/// SIGTERM, then SIGKILL this much later (internals §4.7).
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// A configuration file larger than this is not read for the AF3 check.
const CONFIG_LIMIT: u64 = 4 << 20;
/// Artifacts declared per job.
const CREATED_FILES_LIMIT: usize = 50;
/// Terminal jobs kept in the state file (oldest dropped first).
const KEEP_TERMINAL: usize = 500;

/// A refusal: the failure class and a sentence.
pub type Refusal = (Failure, String);

fn invalid(message: impl Into<String>) -> Refusal {
    (Failure::Invalid, message.into())
}

/// A variable lookup.
pub type EnvLookup = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// What the broker was configured with.
pub struct Settings {
    pub workloads: Vec<Workload>,
    pub workload_config: String,
    /// runnerd's data directory: workspaces live under `projects/` and `remote-workspaces/`,
    /// managed environments under `scientific-envs/revisions/`.
    pub data_dir: PathBuf,
    /// Canonical, for `${repo:…}`.
    pub repo_root: PathBuf,
    pub python: Option<String>,
    /// `${env:…}` (the broker's environment over its configuration file).
    pub template_env: EnvLookup,
    /// The host environment jobs inherit from (before filtering).
    pub host_env: Vec<(String, String)>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("workload_config", &self.workload_config)
            .field("data_dir", &self.data_dir)
            .field("repo_root", &self.repo_root)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Running {
    id: String,
    pgid: i32,
    cancel_requested: bool,
}

#[derive(Debug)]
struct Inner {
    jobs: Vec<Job>,
    queue: VecDeque<String>,
    running: Option<Running>,
}

#[derive(Debug)]
pub struct Broker {
    inner: Mutex<Inner>,
    wake: Notify,
    /// Bumped whenever a job ends, for cancel to wait on.
    finished: watch::Sender<u64>,
    store: Store,
    settings: Settings,
    pub confinement: Mutex<Confinement>,
}

impl Broker {
    pub fn new(settings: Settings, store: Store, jobs: Vec<Job>, confinement: Confinement) -> Arc<Broker> {
        Arc::new(Broker {
            inner: Mutex::new(Inner { jobs, queue: VecDeque::new(), running: None }),
            wake: Notify::new(),
            finished: watch::channel(0).0,
            store,
            settings,
            confinement: Mutex::new(confinement),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn persist(&self, inner: &mut Inner) {
        let terminal = inner.jobs.iter().filter(|j| j.state.terminal()).count();
        if terminal > KEEP_TERMINAL {
            let mut drop = terminal - KEEP_TERMINAL;
            inner.jobs.retain(|j| {
                if drop > 0 && j.state.terminal() {
                    drop -= 1;
                    false
                } else {
                    true
                }
            });
        }
        if let Err(e) = self.store.save(&inner.jobs) {
            tracing::error!(event = "npu_state_write_failed", error = %common::error_chain(&e));
        }
    }

    pub fn status(&self) -> BrokerStatus {
        let inner = self.lock();
        BrokerStatus {
            version: crate::version(),
            workloads: workloads::descriptors(&self.settings.workloads).to_string(),
            workload_config: self.settings.workload_config.clone(),
            queued: inner.queue.len() as u32,
            running: u32::from(inner.running.is_some()),
            confinement: self.confinement.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    fn workload(&self, id: &str) -> Option<&Workload> {
        self.settings.workloads.iter().find(|w| w.id == id)
    }

    /// The workspace, canonical, if it lies in runnerd's projects or remote workspaces.
    fn workspace(&self, root: &Path) -> Result<PathBuf, Refusal> {
        let real = std::fs::canonicalize(root)
            .map_err(|e| invalid(format!("workspaceRoot {} cannot be resolved: {e}", root.display())))?;
        let inside = layout::workspace_roots(&self.settings.data_dir)
            .iter()
            .any(|d| std::fs::canonicalize(d).is_ok_and(|base| real.starts_with(&base) && real != base));
        if !inside || !real.is_dir() {
            return Err(invalid(format!(
                "workspaceRoot {} is not a workspace of this runner (it must be a directory under {}/{} or {}/{})",
                root.display(),
                self.settings.data_dir.display(),
                layout::PROJECTS,
                self.settings.data_dir.display(),
                layout::REMOTE_WORKSPACES,
            )));
        }
        Ok(real)
    }

    /// Submits a job: every check that can be made now is made now (400), the rest (the
    /// argv's templates) when it starts (the job fails, naming the expression).
    pub fn submit(&self, s: Submission) -> Result<String, Refusal> {
        let blank =
            |v: &Option<String>| v.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned);
        let session = blank(&s.session_id).ok_or_else(|| invalid("sessionId is required"))?;
        let workload_id = blank(&s.workload_id).ok_or_else(|| invalid("workloadId is required"))?;
        let workload = self
            .workload(&workload_id)
            .ok_or_else(|| invalid(format!("Unknown NPU workload: {workload_id}")))?;
        let ws = self.workspace(&s.workspace_root)?;
        let revision = blank(&s.environment_revision_id);
        if workload.requires_environment_revision {
            let rev = revision.as_deref().ok_or_else(|| {
                invalid(format!("environmentRevisionId is required for NPU workload {workload_id}"))
            })?;
            managed_python(&self.settings.data_dir, rev).map_err(invalid)?;
        }
        let config = blank(&s.config_path);
        if workload.required_inputs.iter().any(|i| i == "configPath") && config.is_none() {
            return Err(invalid(format!("configPath is required for NPU workload {workload_id}")));
        }
        if let Some(cfg) = &config {
            let real = template::inside(&ws, cfg, "configPath", "the workspace").map_err(invalid)?;
            if workload.reject_af3_intent {
                let value = read_config(Path::new(&real)).map_err(invalid)?;
                if let Some(at) = af3::intent(&value) {
                    return Err(invalid(af3::refusal(&workload_id, &at)));
                }
            }
        }
        if nix::unistd::access(&ws, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK).is_err()
        {
            return Err(invalid(format!(
                "npu-brokerd (uid {}) cannot write to the workspace {}; give its user access to the runner's workspaces",
                nix::unistd::getuid(),
                ws.display()
            )));
        }
        let job = Job {
            id: new_job_id(),
            session_id: session,
            workload_id,
            state: State::Queued,
            created_at: timefmt::now_iso(),
            started_at: None,
            finished_at: None,
            exit_code: None,
            signal: None,
            error: None,
            workspace_root: ws.display().to_string(),
            config_path: config,
            environment_revision_id: revision,
            logs: Logs::default(),
            created_files: Vec::new(),
        };
        let body = serde_json::to_string(&job).unwrap_or_default();
        tracing::info!(
            event = "npu_job_submitted",
            job_id = %job.id,
            session_id = %job.session_id,
            workload_id = %job.workload_id,
            workspace = %job.workspace_root,
            config_path = job.config_path.as_deref().unwrap_or(""),
            environment_revision_id = job.environment_revision_id.as_deref().unwrap_or(""),
        );
        let mut inner = self.lock();
        inner.queue.push_back(job.id.clone());
        inner.jobs.push(job);
        self.persist(&mut inner);
        drop(inner);
        self.wake.notify_one();
        Ok(body)
    }

    fn owned(&self, id: &str, session: &str) -> Result<Job, Refusal> {
        let inner = self.lock();
        let job = inner
            .jobs
            .iter()
            .find(|j| j.id == id)
            .ok_or((Failure::NotFound, "NPU job not found".to_owned()))?;
        if job.session_id != session {
            return Err(invalid("NPU job belongs to another session"));
        }
        Ok(job.clone())
    }

    pub fn list(&self, session: &str) -> String {
        let inner = self.lock();
        let jobs: Vec<Job> =
            inner.jobs.iter().filter(|j| j.session_id == session).map(Job::summary).collect();
        serde_json::to_string(&jobs).unwrap_or_default()
    }

    pub fn active(&self) -> String {
        let inner = self.lock();
        let jobs: Vec<Job> = inner.jobs.iter().filter(|j| !j.state.terminal()).map(Job::summary).collect();
        serde_json::to_string(&jobs).unwrap_or_default()
    }

    pub fn get(&self, id: &str, session: &str) -> Result<String, Refusal> {
        Ok(serde_json::to_string(&self.owned(id, session)?).unwrap_or_default())
    }

    pub fn logs(&self, id: &str, session: &str) -> Result<String, Refusal> {
        let job = self.owned(id, session)?;
        Ok(json!({
            "id": job.id,
            "state": job.state,
            "stdout": job.logs.stdout,
            "stderr": job.logs.stderr,
            "truncated": job.logs.truncated,
        })
        .to_string())
    }

    pub fn result(&self, id: &str, session: &str) -> Result<String, Refusal> {
        let job = self.owned(id, session)?;
        if !job.state.terminal() {
            return Err((Failure::NotTerminal, "NPU job is not terminal".to_owned()));
        }
        Ok(json!({ "job": job }).to_string())
    }

    /// Cancels: a queued job at once; a running one by SIGTERM to its process group, SIGKILL
    /// after [`KILL_GRACE`]; the answer waits (a little longer than that) for the end.
    pub async fn cancel(self: &Arc<Self>, id: &str, session: &str) -> Result<String, Refusal> {
        let job = self.owned(id, session)?;
        let mut finished = self.finished.subscribe();
        {
            let mut inner = self.lock();
            match job.state {
                State::Queued => {
                    inner.queue.retain(|q| q != id);
                    if let Some(j) = inner.jobs.iter_mut().find(|j| j.id == id) {
                        j.state = State::Cancelled;
                        j.finished_at = Some(timefmt::now_iso());
                        j.error = Some("NPU job was cancelled before it started".into());
                    }
                    self.persist(&mut inner);
                    tracing::info!(event = "npu_job_cancelled", job_id = %id, session_id = %session, was = "queued");
                    drop(inner);
                    return self.get(id, session);
                }
                State::Running => {
                    let Some(running) = inner.running.as_mut().filter(|r| r.id == id) else {
                        drop(inner);
                        return self.get(id, session);
                    };
                    running.cancel_requested = true;
                    let pgid = running.pgid;
                    tracing::info!(event = "npu_job_cancelled", job_id = %id, session_id = %session, was = "running", signal = "SIGTERM");
                    signal_group(pgid, libc::SIGTERM);
                    let me = self.clone();
                    let id = id.to_owned();
                    tokio::spawn(async move {
                        tokio::time::sleep(KILL_GRACE).await;
                        let still = me.lock().running.as_ref().is_some_and(|r| r.id == id && r.pgid == pgid);
                        if still {
                            tracing::info!(event = "npu_job_killed", job_id = %id, signal = "SIGKILL");
                            signal_group(pgid, libc::SIGKILL);
                        }
                    });
                }
                _ => {
                    drop(inner);
                    return self.get(id, session);
                }
            }
        }
        let deadline = tokio::time::Instant::now() + KILL_GRACE + Duration::from_secs(3);
        loop {
            let ended = self.lock().jobs.iter().any(|j| j.id == id && j.state.terminal());
            if ended {
                break;
            }
            if tokio::time::timeout_at(deadline, finished.changed()).await.is_err() {
                break;
            }
        }
        self.get(id, session)
    }

    /// The worker: one job at a time, in submission order.
    pub async fn work(self: Arc<Self>) {
        loop {
            let next = self.lock().queue.pop_front();
            match next {
                Some(id) => self.run(&id).await,
                None => self.wake.notified().await,
            }
        }
    }

    fn finish(&self, id: &str, update: impl FnOnce(&mut Job)) {
        let mut inner = self.lock();
        if inner.running.as_ref().is_some_and(|r| r.id == id) {
            inner.running = None;
        }
        if let Some(job) = inner.jobs.iter_mut().find(|j| j.id == id) {
            update(job);
            job.finished_at = Some(timefmt::now_iso());
            tracing::info!(
                event = "npu_job_finished",
                job_id = %job.id,
                session_id = %job.session_id,
                workload_id = %job.workload_id,
                state = ?job.state,
                exit_code = job.exit_code.unwrap_or(-1),
                signal = job.signal.as_deref().unwrap_or(""),
                error = job.error.as_deref().unwrap_or(""),
                created_files = job.created_files.len(),
            );
        }
        self.persist(&mut inner);
        drop(inner);
        self.finished.send_modify(|n| *n += 1);
    }

    /// The argv of a job, or why it cannot be built.
    fn argv(&self, job: &Job) -> Result<(String, Vec<String>, Option<PathBuf>), String> {
        let workload = self
            .workload(&job.workload_id)
            .ok_or_else(|| format!("Unknown NPU workload: {}", job.workload_id))?;
        let ws = PathBuf::from(&job.workspace_root);
        let data_dir = self.settings.data_dir.clone();
        let revision = job.environment_revision_id.clone();
        let managed = move || match revision.as_deref() {
            Some(rev) => managed_python(&data_dir, rev).map(|(python, _)| python),
            None => Err(format!("environmentRevisionId is required for NPU workload {}", job.workload_id)),
        };
        let env = |k: &str| (self.settings.template_env)(k);
        let ctx = Context {
            python: self.settings.python.as_deref(),
            managed_python: &managed,
            workspace: &ws,
            config_path: job.config_path.as_deref(),
            repo: &self.settings.repo_root,
            env: &env,
        };
        let program = template::expand(&workload.program, &ctx)?;
        let args = workload.args.iter().map(|a| template::expand(a, &ctx)).collect::<Result<Vec<_>, _>>()?;
        let site = match job.environment_revision_id.as_deref() {
            Some(rev) if workload.requires_environment_revision => {
                managed_python(&self.settings.data_dir, rev).ok().and_then(|(_, site)| site)
            }
            _ => None,
        };
        Ok((program, args, site))
    }

    async fn run(self: &Arc<Self>, id: &str) {
        let job = self.lock().jobs.iter().find(|j| j.id == id && j.state == State::Queued).cloned();
        let Some(job) = job else { return };
        let (program, args, site) = match self.argv(&job) {
            Ok(a) => a,
            Err(e) => {
                self.finish(id, |j| {
                    j.state = State::Failed;
                    j.error = Some(e);
                });
                return;
            }
        };
        let ws = PathBuf::from(&job.workspace_root);
        let mut child = match self.command(&ws, &program, &args, site.as_deref()).spawn() {
            Ok(c) => c,
            Err(e) => {
                self.finish(id, |j| {
                    j.state = State::Failed;
                    j.error = Some(format!("could not start {program}: {e}"));
                });
                return;
            }
        };
        let pgid = child.id().map_or(0, |p| p as i32);
        if !self.mark_running(id, pgid) {
            // Cancelled between leaving the queue and starting: it never runs.
            signal_group(pgid, libc::SIGKILL);
            let _ = child.wait().await;
            return;
        }
        tracing::info!(
            event = "npu_job_started",
            job_id = %id,
            session_id = %job.session_id,
            workload_id = %job.workload_id,
            program = %program,
            args = %serde_json::to_string(&args).unwrap_or_default(),
            pid = pgid,
            cwd = %ws.display(),
        );
        let out = child.stdout.take().map(|s| tokio::spawn(capture(self.clone(), id.to_owned(), s, false)));
        let err = child.stderr.take().map(|s| tokio::spawn(capture(self.clone(), id.to_owned(), s, true)));
        let status = child.wait().await;
        // Whatever the job left in its group goes with it.
        signal_group(pgid, libc::SIGKILL);
        for task in [out, err].into_iter().flatten() {
            let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        }
        let cancelled = self.lock().running.as_ref().is_some_and(|r| r.id == id && r.cancel_requested);
        let created = created_files(&ws, job.config_path.as_deref());
        self.finish(id, |j| {
            j.created_files = created;
            settle(j, status, cancelled);
        });
    }

    /// The job's process in the workspace (its `.npu-home` made first): the environment
    /// cleared to the job's, no stdin, both streams piped, a process group of its own.
    fn command(
        &self,
        ws: &Path,
        program: &str,
        args: &[String],
        site: Option<&Path>,
    ) -> tokio::process::Command {
        let _ = std::fs::create_dir_all(ws.join(".npu-home"));
        let env = environ::job_environment(self.settings.host_env.clone(), ws, site);
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(env)
            .current_dir(ws)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// At shutdown, after the worker stopped: the running job's process group ends with the
    /// broker. Its record stays `running` on disk, so the next start marks it interrupted.
    pub fn kill_running(&self) {
        if let Some(r) = self.lock().running.as_ref() {
            tracing::info!(event = "npu_job_killed", job_id = %r.id, signal = "SIGKILL", reason = "npu-brokerd is stopping");
            signal_group(r.pgid, libc::SIGKILL);
        }
    }

    /// Queued → running, unless it was cancelled meanwhile.
    fn mark_running(&self, id: &str, pgid: i32) -> bool {
        let mut inner = self.lock();
        let Some(j) = inner.jobs.iter_mut().find(|j| j.id == id && j.state == State::Queued) else {
            return false;
        };
        j.state = State::Running;
        j.started_at = Some(timefmt::now_iso());
        inner.running = Some(Running { id: id.to_owned(), pgid, cancel_requested: false });
        self.persist(&mut inner);
        true
    }

    fn append_log(&self, id: &str, chunk: &[u8], stderr: bool) {
        let mut inner = self.lock();
        if let Some(j) = inner.jobs.iter_mut().find(|j| j.id == id) {
            let text = if stderr { &mut j.logs.stderr } else { &mut j.logs.stdout };
            if append_tail(text, &String::from_utf8_lossy(chunk), LOG_LIMIT) {
                j.logs.truncated = true;
            }
        }
    }
}

/// Appends `chunk`, keeping the last `limit` bytes (cut at a character boundary); whether
/// anything was dropped.
pub fn append_tail(text: &mut String, chunk: &str, limit: usize) -> bool {
    text.push_str(chunk);
    if text.len() <= limit {
        return false;
    }
    let mut cut = text.len() - limit;
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    text.drain(..cut);
    true
}

async fn capture(
    broker: Arc<Broker>,
    id: String,
    mut stream: impl tokio::io::AsyncRead + Unpin,
    stderr: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => broker.append_log(&id, &buf[..n], stderr),
        }
    }
}

fn signal_group(pgid: i32, signal: i32) {
    if pgid > 1 {
        // Ignored: ESRCH means the whole group has already exited.
        // SAFETY: kill(2) with a negative pid addresses the job's own process group, which
        // the broker created for it (process_group(0)); no memory is involved.
        let _ = common::sys::cvt(unsafe { libc::kill(-pgid, signal) });
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGABRT => "SIGABRT".into(),
        other => format!("signal {other}"),
    }
}

fn new_job_id() -> String {
    let mut b = [0u8; 12];
    let _ = getrandom::fill(&mut b);
    format!("npu-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// A revision id as the original's store names them (`rev-…`), or any plain name.
fn valid_revision(rev: &str) -> bool {
    !rev.is_empty()
        && !rev.starts_with('.')
        && rev.len() <= 128
        && rev.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `${managedPython}`: the realpath of the interpreter of revision `rev` in runnerd's
/// managed environments (`<data>/scientific-envs/revisions/<env>/<rev>/bin/python`), and
/// that environment's site-packages when it has one.
pub fn managed_python(data_dir: &Path, rev: &str) -> Result<(PathBuf, Option<PathBuf>), String> {
    if !valid_revision(rev) {
        return Err(format!("environmentRevisionId {rev:?} is not a valid revision id"));
    }
    let revisions = layout::env_revisions(data_dir);
    let envs = std::fs::read_dir(&revisions).into_iter().flatten().flatten();
    for env in envs {
        let prefix = env.path().join(rev);
        for name in ["bin/python", "bin/python3"] {
            if let Ok(real) = std::fs::canonicalize(prefix.join(name))
                && real.is_file()
            {
                let site = std::fs::read_dir(prefix.join("lib"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path().join("site-packages"))
                    .find(|p| p.is_dir());
                return Ok((real, site));
            }
        }
    }
    Err(format!(
        "environment revision {rev} has no Python interpreter under {}; install the environment first",
        revisions.display()
    ))
}

fn read_config(path: &Path) -> Result<serde_json::Value, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("configPath cannot be read: {e}"))?;
    if meta.len() > CONFIG_LIMIT {
        return Err(format!("configPath is larger than {CONFIG_LIMIT} bytes"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("configPath cannot be read: {e}"))?;
    // Not JSON (YAML, say): its text is still scanned for AF3 intent.
    Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

/// A finished job's state from how its process ended (`cancelled`: a cancel was asked for).
fn settle(j: &mut Job, status: std::io::Result<std::process::ExitStatus>, cancelled: bool) {
    match status {
        Err(e) => {
            j.state = State::Failed;
            j.error = Some(format!("could not wait for the NPU job: {e}"));
        }
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt;
            j.exit_code = status.code();
            j.signal = status.signal().map(signal_name);
            if cancelled {
                j.state = State::Cancelled;
                j.error = Some("NPU job was cancelled".into());
            } else if status.success() {
                j.state = State::Succeeded;
            } else {
                j.state = State::Failed;
                j.error = Some(match (status.code(), status.signal()) {
                    (Some(code), _) => format!("NPU job exited with code {code}"),
                    (None, Some(sig)) => format!("NPU job was killed by {}", signal_name(sig)),
                    _ => "NPU job failed".into(),
                });
            }
        }
    }
}

/// `createdFiles`: the lines of `artifact_manifest.txt` in the workspace and next to the
/// config, workspace-relative, existing, inside the workspace, at most 50.
pub fn created_files(ws: &Path, config: Option<&str>) -> Vec<String> {
    let mut manifests = vec![ws.join("artifact_manifest.txt")];
    if let Some(dir) = config.and_then(|c| ws.join(c).parent().map(Path::to_owned)) {
        let m = dir.join("artifact_manifest.txt");
        if !manifests.contains(&m) {
            manifests.push(m);
        }
    }
    let mut out: Vec<String> = Vec::new();
    for m in manifests {
        let Ok(text) = std::fs::read_to_string(&m) else { continue };
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let rel =
                Path::new(line).strip_prefix(ws).map(Path::to_owned).unwrap_or_else(|_| PathBuf::from(line));
            let Some(rel_text) = rel.to_str().map(str::to_owned) else { continue };
            if template::inside(ws, &rel_text, "artifact", "the workspace").is_ok()
                && !out.contains(&rel_text)
                && out.len() < CREATED_FILES_LIMIT
            {
                out.push(rel_text);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_files_come_from_manifests_inside_the_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let ws = std::fs::canonicalize(dir.path()).unwrap().join("ws");
        std::fs::create_dir_all(ws.join("cfg")).unwrap();
        std::fs::write(ws.join("out.pdb"), "").unwrap();
        std::fs::write(ws.join("cfg/b.txt"), "").unwrap();
        std::fs::write(
            ws.join("artifact_manifest.txt"),
            format!("out.pdb\n\n{}\n../etc\nmissing\n/etc/passwd\n", ws.join("cfg/b.txt").display()),
        )
        .unwrap();
        std::fs::write(ws.join("cfg/artifact_manifest.txt"), "out.pdb\n").unwrap();
        assert_eq!(created_files(&ws, Some("cfg/run.json")), ["out.pdb", "cfg/b.txt"]);
    }

    fn broker(data: &Path) -> Arc<Broker> {
        let settings = Settings {
            workloads: workloads::defaults(),
            workload_config: "built-in defaults".into(),
            data_dir: data.to_owned(),
            repo_root: data.to_owned(),
            python: None,
            template_env: Box::new(|_| None),
            host_env: Vec::new(),
        };
        let confinement = Confinement { landlock: "test".into(), seccomp: false, no_new_privs: false };
        Broker::new(settings, Store::new(&data.join("state")), Vec::new(), confinement)
    }

    #[test]
    fn the_broker_checks_the_workspace_itself_whatever_runnerd_sent() {
        let dir = tempfile::tempdir().unwrap();
        let data = std::fs::canonicalize(dir.path()).unwrap();
        let ws = data.join("projects/p/sessions/s/workspace");
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::create_dir_all(data.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(data.join("elsewhere"), data.join("projects/p/link")).unwrap();
        let rev = data.join("scientific-envs/revisions/starter-python/rev-1/bin");
        std::fs::create_dir_all(&rev).unwrap();
        std::os::unix::fs::symlink("/bin/sh", rev.join("python")).unwrap();
        let b = broker(&data);
        let sub = |root: PathBuf| Submission {
            session_id: Some("s".into()),
            workload_id: Some("npu.smoke_test".into()),
            config_path: None,
            environment_revision_id: Some("rev-1".into()),
            workspace_root: root,
        };
        for bad in
            [data.join("elsewhere"), data.join("projects"), data.join("projects/p/link"), "/etc".into()]
        {
            let (failure, message) = b.submit(sub(bad.clone())).unwrap_err();
            assert_eq!(failure, Failure::Invalid, "{bad:?}");
            assert!(message.contains("workspaceRoot"), "{bad:?}: {message}");
        }
        let job: serde_json::Value = serde_json::from_str(&b.submit(sub(ws.clone())).unwrap()).unwrap();
        assert_eq!((job["state"].as_str(), job["workspaceRoot"].as_str()), (Some("queued"), ws.to_str()));
        // Persisted at once.
        let on_disk = Store::new(&data.join("state")).load("t").unwrap();
        assert_eq!(on_disk.interrupted.len(), 1, "a queued job left by a stop becomes interrupted");
        let (failure, message) =
            b.submit(Submission { environment_revision_id: Some("rev-9".into()), ..sub(ws) }).unwrap_err();
        assert_eq!(failure, Failure::Invalid);
        assert!(message.contains("environment revision rev-9 has no Python interpreter"), "{message}");
    }

    #[test]
    fn logs_keep_their_tail() {
        let cases: &[(&str, &str, usize, &str, bool)] = &[
            ("", "abc", 5, "abc", false),
            ("abc", "de", 5, "abcde", false),
            ("abc", "def", 5, "bcdef", true),
            ("", "0123456789", 4, "6789", true),
            ("", "aé€z", 4, "€z", true),
            // A cut inside a multi-byte character moves past it: never more than the limit.
            ("", "aé€z", 3, "z", true),
        ];
        for (before, chunk, limit, after, dropped) in cases {
            let mut text = (*before).to_owned();
            assert_eq!(append_tail(&mut text, chunk, *limit), *dropped, "{before:?}+{chunk:?}");
            assert_eq!(text, *after);
            assert!(text.len() <= *limit);
        }
    }

    #[test]
    fn managed_python_is_found_by_revision() {
        let dir = tempfile::tempdir().unwrap();
        let rev = dir.path().join("scientific-envs/revisions/starter-python/rev-1a");
        std::fs::create_dir_all(rev.join("bin")).unwrap();
        std::fs::create_dir_all(rev.join("lib/python3.11/site-packages")).unwrap();
        std::os::unix::fs::symlink("/bin/sh", rev.join("bin/python")).unwrap();
        let (python, site) = managed_python(dir.path(), "rev-1a").unwrap();
        assert_eq!(python, std::fs::canonicalize("/bin/sh").unwrap());
        assert!(site.unwrap().ends_with("lib/python3.11/site-packages"));
        assert!(managed_python(dir.path(), "rev-2").unwrap_err().contains("has no Python interpreter"));
        assert!(managed_python(dir.path(), "../x").unwrap_err().contains("not a valid revision id"));
    }
}
