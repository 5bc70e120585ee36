//! The workspace writer protocol shared with the API process (versioning reference §6):
//! admission → lease → baseline → the operation → snapshot → record → compare-and-swap
//! commit of `workspaces/<sha256(root)>/head`, with poisoning when a commit fails; the
//! observer read (`committedWorkspaceSnapshot`); and, beyond the original, start-up recovery
//! of the writes our own crashed process left unfinished.
//!
//! The store work is blocking file I/O and runs on tokio's blocking pool.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use std::os::fd::OwnedFd;

use serde_json::Value;
use tokio::sync::watch;

use crate::coordination::{Admitted, CoordError, Lease, Lifecycle};
use crate::transfer::TransferError;
use crate::transfer::placement::Placement;
use crate::versioning::snapshot::{Reuse, SnapshotScope};
use crate::versioning::{
    self, ExecutionFields, Pool, Ref, Refs, Store, VersionError, execution_value, mutation_value,
    new_uuid_v4, workspace_head_name,
};

/// The observer's answer when a writer is busy and nothing was ever committed.
pub const NO_BASELINE: &str = "Workspace has no committed baseline yet; retry after admission completes";

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    // These two render their whole chain and expose no source: the API answers with
    // `to_string()` of a `WriteError`, and that text (the lock or store error and what caused
    // it, as before) must not lose its cause now that the inner messages no longer repeat it.
    #[error("{}", common::error_chain(.0))]
    Coordination(CoordError),
    #[error("{}", common::error_chain(.0))]
    Version(VersionError),
    #[error("{NO_BASELINE}")]
    NoBaseline,
    #[error("Invalid Workspace head kind")]
    HeadKind,
    #[error("Workspace was deleted before its snapshot; nothing was committed")]
    Deleted,
    #[error("The version store task stopped unexpectedly: {0}")]
    Task(String),
    /// The workspace moved to another node: this copy is stale and takes no writes.
    #[error("Workspace moved to {moved_to} (epoch {epoch}); send it there")]
    Fenced { moved_to: String, epoch: u64 },
    /// Placement, or an import that does not match what it claims (rendered whole, as above).
    #[error("{}", common::error_chain(.0))]
    Transfer(TransferError),
}

impl From<TransferError> for WriteError {
    fn from(e: TransferError) -> WriteError {
        WriteError::Transfer(e)
    }
}

impl From<CoordError> for WriteError {
    fn from(e: CoordError) -> WriteError {
        WriteError::Coordination(e)
    }
}

impl From<VersionError> for WriteError {
    fn from(e: VersionError) -> WriteError {
        WriteError::Version(e)
    }
}

impl WriteError {
    /// The workspace's own content was refused ([`VersionError::is_content`]): that write
    /// failed, but the workspace is not poisoned, so its next run or a DELETE can fix it.
    pub fn is_content(&self) -> bool {
        matches!(self, WriteError::Version(v) if v.is_content())
    }
}

/// The version store, its refs and the coordination state of one data directory.
pub struct Versions {
    store: Store,
    refs: Mutex<Refs>,
    lifecycle: Lifecycle,
    /// Where workspaces are opened beneath (recovery pins each by descriptor).
    data_dir: PathBuf,
    /// The most a snapshot may store where its caller sets no quota of its own (a baseline,
    /// an observed tree, a workspace route's commit): the configured workspace quota, so
    /// that a tree a run left over it (sparse files of distinct contents, say) is never
    /// written out into the shared store by another route (0: none).
    default_max_bytes: u64,
    /// The shared databases (refs, the lifecycle registry) the start-up integrity check
    /// found damaged: kept where they are, since the API process has them open too, and
    /// named in `/health` with the remedy (issue #32).
    damaged: Vec<(PathBuf, String)>,
    /// Where each workspace lives (issue #34): a fenced one refuses writers.
    placement: Placement,
    /// Told of every workspace head committed ([`Versions::on_commit`]).
    on_commit: OnceLock<CommitHook>,
}

/// What [`Versions::on_commit`] calls: the workspace's canonical path and its new head.
pub type CommitHook = Arc<dyn Fn(&Path, &Ref) + Send + Sync>;

impl std::fmt::Debug for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Versions").field("root", &self.store.root()).finish_non_exhaustive()
    }
}

/// A writer admitted and holding the lease, with a committed head. Dropping it releases
/// the lease (removing `.active`) and then the admission.
#[derive(Debug)]
pub struct Writer {
    root: PathBuf,
    pinned: OwnedFd,
    /// The quota the commit's snapshot may store at most (0: none).
    max_bytes: u64,
    /// The run's change journal: the commit's snapshot reuses the directories it says are
    /// unchanged since the last snapshot it served.
    journal: Option<Arc<dyn SnapshotJournal>>,
    _lease: Lease,
    _admitted: Admitted,
}

impl Writer {
    /// The workspace directory as opened under the locks (`O_PATH`).
    pub fn pinned(&self) -> &OwnedFd {
        &self.pinned
    }

    /// The directory to snapshot: the one the caller opened, whatever its path names now.
    fn snapshot_dir(&self) -> PathBuf {
        crate::fsat::pinned_dir(&self.pinned)
    }

    /// Bounds what this writer's commit may store: a tree whose files add up to more than
    /// `bytes` (the run's quota; 0: none) fails the commit before any of it is stored.
    pub fn limit_snapshot_bytes(&mut self, bytes: u64) {
        self.max_bytes = bytes;
    }

    /// Lets the commit's snapshot reuse the unchanged directories of an earlier one.
    pub fn attach_journal(&mut self, journal: impl SnapshotJournal + 'static) {
        self.journal = Some(Arc::new(journal));
    }

    /// Hands back the run's journal (a writer that is forgotten, its sandbox unresponsive,
    /// must not keep the journal's slot for that workspace held forever).
    pub fn take_journal(&mut self) -> Option<Arc<dyn SnapshotJournal>> {
        self.journal.take()
    }

    fn scope(&self) -> SnapshotScope {
        SnapshotScope { canonical: Some(self.root.clone()), max_bytes: self.max_bytes, reuse: None }
    }

    /// The commit's snapshot scope, attempt by attempt ([`Attempts`]).
    fn attempts(&self) -> Attempts {
        Attempts { base: self.scope(), journal: self.journal.clone(), count: Default::default() }
    }
}

/// What a commit's snapshot asks of the run's change journal (runnerd's
/// `journal::RunWatch`, which the writer does not know).
pub trait SnapshotJournal: std::fmt::Debug + Send + Sync {
    /// What the snapshot may reuse: the directories of the last snapshot the journal served
    /// and the paths changed since (blocking: the journal reads its pending events).
    fn reuse(&self) -> Arc<Reuse>;
    /// After the commit of a snapshot made with `reuse`: the journal keeps its directories.
    fn snapshot_done(&self, reuse: &Reuse);
}

/// A commit's snapshot scopes, one per attempt, made in the blocking task (reading the
/// change journal's events is blocking work): the first reuses what the journal says is
/// unchanged; a retry walks everything (what went wrong may lie in what it would reuse).
struct Attempts {
    base: SnapshotScope,
    journal: Option<Arc<dyn SnapshotJournal>>,
    count: std::sync::atomic::AtomicUsize,
}

impl Attempts {
    fn scope(&self) -> SnapshotScope {
        let first = self.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0;
        let reuse = self.journal.as_ref().filter(|_| first).map(|j| j.reuse());
        SnapshotScope { reuse, ..self.base.clone() }
    }

    /// After the commit of a snapshot made with `scope`: the journal keeps its directories.
    fn committed(&self, scope: &SnapshotScope) {
        if let (Some(journal), Some(reuse)) = (&self.journal, &scope.reuse) {
            journal.snapshot_done(reuse);
        }
    }
}

/// How far [`Versions::try_hold`] got without waiting.
#[derive(Debug)]
enum Quick {
    /// Admitted and leased; whether the workspace has a head (no baseline needed).
    Held(Admitted, Box<Lease>, bool),
    /// Admitted; another writer holds the lease.
    Admitted(Admitted),
    /// Another writer is admitted.
    Busy,
}

/// Whether a writer may take a workspace that moved to another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fence {
    /// Every ordinary writer: a fenced workspace is refused ([`WriteError::Fenced`]).
    Refuse,
    /// A copy coming back (an import): the fence is what it lifts.
    Pass,
}

/// The ref a commit moves.
#[derive(Debug, Clone, Copy)]
enum Target<'a> {
    /// A workspace's head, by its canonical path (what [`Versions::on_commit`] is told).
    Workspace(&'a Path),
    /// Any other ref (`workspace-exports/<id>`).
    Named(&'a str),
}

impl Target<'_> {
    fn name(self) -> String {
        match self {
            Target::Workspace(root) => workspace_head_name(root),
            Target::Named(name) => name.to_owned(),
        }
    }
}

/// How much of a commit's closure is checked.
#[derive(Debug, Clone, Copy)]
enum Closure {
    /// Everything reachable, each blob at least stat'ed ([`Store::validate_closure`]).
    Full,
    /// Everything not already validated by a commit of this process
    /// ([`Store::validate_closure_since_validated`]): a snapshot that reused the journal's
    /// unchanged directories, so the commit costs what changed.
    SinceValidated,
}

impl Closure {
    fn of(scope: &SnapshotScope) -> Closure {
        if scope.reuse.is_some() { Closure::SinceValidated } else { Closure::Full }
    }
}

/// What a commit compares the head with.
#[derive(Debug)]
enum Expected {
    /// The head as the commit's transaction finds it (the lease serialises writers).
    Current,
    /// This head (none: the ref must not exist yet).
    Exactly(Option<Ref>),
}

/// Opens a content stream (logs are streamed into the store, never held whole).
pub type ContentSource = Arc<dyn Fn() -> Box<dyn std::io::Read + Send> + Send + Sync>;

impl std::fmt::Debug for ExecutionFacts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutionFacts")
            .field("execution_id", &self.execution_id)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// What a managed execution's version records.
#[derive(Clone)]
pub struct ExecutionFacts {
    pub agent_id: String,
    pub session_id: String,
    pub execution_id: String,
    pub environment_revision_id: Option<String>,
    pub state: crate::execution_state::ManagedState,
    pub code: String,
    /// The stream's content, opened afresh for each attempt (a commit may be retried).
    pub stdout: ContentSource,
    pub stderr: ContentSource,
}

impl Versions {
    pub fn open(data_dir: &Path) -> Result<Versions, WriteError> {
        let damaged: Vec<(PathBuf, String)> = [
            data_dir.join(common::layout::VERSIONING).join(common::layout::REFS_DB),
            data_dir.join(common::layout::LIFECYCLE_DIR).join(common::layout::LIFECYCLE_REGISTRY),
        ]
        .into_iter()
        .filter_map(|path| crate::dbcheck::damage(&path).map(|problem| (path, problem)))
        .collect();
        for (path, problem) in &damaged {
            tracing::error!(event = "shared_database_damaged", path = %path.display(), problem = %problem,
                remedy = %crate::dbcheck::recover_hint(path));
        }
        let lifecycle = Lifecycle::open(data_dir)?;
        let placement = Placement::open(data_dir)?;
        let store = Store::open(data_dir)?;
        let refs = Refs::open(&store)?;
        let swept = store.sweep_temporaries();
        if swept > 0 {
            tracing::warn!(
                event = "temporaries_swept",
                count = swept,
                reason = "left by a commit whose process died"
            );
        }
        Ok(Versions {
            store,
            refs: Mutex::new(refs),
            lifecycle,
            data_dir: data_dir.to_owned(),
            default_max_bytes: 0,
            damaged,
            placement,
            on_commit: OnceLock::new(),
        })
    }

    /// Where each workspace lives, as this node knows it.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Calls `hook` after every successful workspace head commit (any kind: baseline,
    /// mutation, execution, checkpoint, recovery, repair, import), outside every lock, with
    /// the canonical path and the new head: the replicator follows heads this way. Set once
    /// (a second hook is ignored); it must be quick and must not panic.
    pub fn on_commit(&self, hook: CommitHook) {
        if self.on_commit.set(hook).is_err() {
            tracing::warn!(event = "commit_hook_ignored", reason = "a commit hook is already set");
        }
    }

    /// With [`Versions::default_max_bytes`] set: the workspace quota (0: none).
    pub fn with_default_snapshot_limit(self, bytes: u64) -> Versions {
        Versions { default_max_bytes: bytes, ..self }
    }

    /// `/health`'s `sharedDatabases`: each damaged one with what is wrong and the remedy.
    pub fn damaged_json(&self) -> serde_json::Value {
        self.damaged
            .iter()
            .map(|(path, problem)| {
                serde_json::json!({
                    "path": path.display().to_string(),
                    "problem": problem,
                    "remedy": crate::dbcheck::recover_hint(path),
                })
            })
            .collect()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// One run of the version collector over this store and its refs ([`versioning::gc`]).
    pub fn collect(
        &self,
        named: &[Ref],
        workspace_of: &dyn Fn(&str) -> Option<String>,
        how: versioning::gc::Collection,
    ) -> Result<versioning::gc::Report, VersionError> {
        // A connection of its own: the collector's long reads never hold the mutex every
        // commit takes.
        let refs = Mutex::new(Refs::open(&self.store)?);
        versioning::gc::collect(&self.store, &refs, named, workspace_of, how)
    }

    /// The current head of a workspace, if any.
    pub fn head(&self, canonical: &Path) -> Result<Option<Ref>, WriteError> {
        Ok(self.refs().head(&workspace_head_name(canonical))?)
    }

    /// The heads a workspace has had that its history still keeps, oldest first (a restore
    /// names one of them).
    pub fn history(&self, canonical: &Path) -> Result<Vec<Ref>, WriteError> {
        Ok(self.refs().history(&workspace_head_name(canonical))?)
    }

    fn refs(&self) -> std::sync::MutexGuard<'_, Refs> {
        self.refs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admission, then the lease (both waited for; `cancel` ends the wait), then a baseline
    /// if the workspace has no head. A failed baseline poisons the workspace — unless what
    /// failed it is the workspace's own content (a FIFO, say): then there is no baseline and
    /// the write goes ahead (ours: so that the write, a DELETE say, can remove it). `pinned`
    /// is the workspace directory as the caller opened it (snapshots read it, not the path).
    /// A workspace that moved to another node is refused once the lease is taken
    /// ([`WriteError::Fenced`]; the lease is dropped): its copy here is stale.
    pub async fn begin(
        self: &Arc<Self>,
        canonical: &Path,
        pinned: OwnedFd,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Writer, WriteError> {
        self.begin_as(canonical, pinned, cancel, Fence::Refuse).await
    }

    /// [`Versions::begin`] for a copy coming back to this node (an import), which a fence
    /// does not refuse: the import's commit is what replaces the stale copy.
    pub async fn begin_import(
        self: &Arc<Self>,
        canonical: &Path,
        pinned: OwnedFd,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Writer, WriteError> {
        self.begin_as(canonical, pinned, cancel, Fence::Pass).await
    }

    async fn begin_as(
        self: &Arc<Self>,
        canonical: &Path,
        pinned: OwnedFd,
        cancel: Option<&watch::Receiver<bool>>,
        fence: Fence,
    ) -> Result<Writer, WriteError> {
        let quick = if cancel.is_some_and(|c| *c.borrow()) {
            Quick::Busy
        } else {
            let (me, root) = (self.clone(), canonical.to_owned());
            crate::blocking::run(move || me.try_hold(&root, fence))
                .await
                .map_err(|e| WriteError::Task(e.to_string()))??
        };
        let (admitted, lease, has_head) = match quick {
            Quick::Held(admitted, lease, has_head) => (admitted, *lease, has_head),
            Quick::Admitted(admitted) => {
                let lease = self.lifecycle.lease(canonical, cancel).await?;
                self.refuse_fenced_blocking(canonical, fence).await?;
                (admitted, lease, false)
            }
            Quick::Busy => {
                let admitted = self.lifecycle.admit(canonical, cancel).await?;
                let lease = self.lifecycle.lease(canonical, cancel).await?;
                self.refuse_fenced_blocking(canonical, fence).await?;
                (admitted, lease, false)
            }
        };
        let writer = Writer {
            root: canonical.to_owned(),
            pinned,
            max_bytes: self.default_max_bytes,
            journal: None,
            _lease: lease,
            _admitted: admitted,
        };
        // An import replaces the files whole and commits its own head (and the sweep empties
        // a copy that has one): no baseline of what is about to go, whose commit would also
        // wake the replicator with a head that is not the workspace's.
        if has_head || fence == Fence::Pass {
            return Ok(writer);
        }
        let me = self.clone();
        let (root, dir, scope) = (writer.root.clone(), writer.snapshot_dir(), writer.scope());
        let baseline = blocking_retry(self.clone(), move || me.ensure_baseline(&root, &dir, &scope)).await;
        match baseline {
            Err(e) if e.is_content() => {
                tracing::warn!(event = "workspace_baseline_skipped", workspace = %writer.root.display(), error = %common::error_chain(&e));
            }
            Err(e) => {
                self.poison(&writer.root, &e);
                return Err(e);
            }
            Ok(_) => {}
        }
        Ok(writer)
    }

    /// Admission, the lease and whether the workspace has a head, without waiting, in one
    /// blocking task: the uncontended writer's path (the same steps in the same order as
    /// [`Versions::begin`]'s waiting path, which takes over where this one finds a holder).
    fn try_hold(&self, canonical: &Path, fence: Fence) -> Result<Quick, WriteError> {
        let Some(admitted) = self.lifecycle.try_admit_blocking(canonical)? else { return Ok(Quick::Busy) };
        let Some(lease) = self.lifecycle.try_lease(canonical)? else { return Ok(Quick::Admitted(admitted)) };
        // Refused with the lease held, so no move can slip between the check and the write;
        // returning drops the lease and the admission.
        self.refuse_fenced(canonical, fence)?;
        let has_head = self.refs().head(&workspace_head_name(canonical))?.is_some();
        Ok(Quick::Held(admitted, Box::new(lease), has_head))
    }

    /// [`WriteError::Fenced`] when the workspace moved away and `fence` refuses that.
    fn refuse_fenced(&self, canonical: &Path, fence: Fence) -> Result<(), WriteError> {
        if fence == Fence::Pass {
            return Ok(());
        }
        self.fenced(canonical)
    }

    /// [`WriteError::Fenced`] when the workspace moved to another node (a placement that
    /// cannot be read refuses too): for work that writes a workspace without this store's
    /// lease (an NPU job) or is refused before it queues (a managed run).
    pub fn fenced(&self, canonical: &Path) -> Result<(), WriteError> {
        if !self.placement.may_be_fenced() {
            return Ok(());
        }
        match self.placement.get(canonical)? {
            Some(placed) => match placed.moved_to {
                Some(moved_to) => Err(WriteError::Fenced { moved_to, epoch: placed.epoch }),
                None => Ok(()),
            },
            None => Ok(()),
        }
    }

    /// [`Versions::refuse_fenced`] from the waiting path (a database read: blocking work).
    async fn refuse_fenced_blocking(
        self: &Arc<Self>,
        canonical: &Path,
        fence: Fence,
    ) -> Result<(), WriteError> {
        let (me, root) = (self.clone(), canonical.to_owned());
        crate::blocking::run(move || me.refuse_fenced(&root, fence))
            .await
            .map_err(|e| WriteError::Task(e.to_string()))?
    }

    fn ensure_baseline(
        &self,
        root: &Path,
        dir: &Path,
        scope: &SnapshotScope,
    ) -> Result<Option<Ref>, WriteError> {
        let name = workspace_head_name(root);
        if self.refs().head(&name)?.is_some() {
            return Ok(None);
        }
        let tree = self.snapshot_live(dir, scope)?;
        let record = self.commit_mutation_record(
            root,
            &tree,
            (None, "baseline", true),
            Expected::Exactly(None),
            Closure::Full,
        )?;
        tracing::info!(event = "workspace_baseline", workspace = %root.display(), head = %record.digest);
        Ok(Some(record))
    }

    /// Snapshots the workspace and commits a `WorkspaceMutation` as its new head; returns the
    /// tree. A failure poisons the workspace, unless the workspace's content was refused
    /// ([`WriteError::is_content`]).
    pub async fn commit_mutation(
        self: &Arc<Self>,
        writer: &Writer,
        kind: &str,
        id: Option<String>,
        completed: bool,
    ) -> Result<Ref, WriteError> {
        self.commit_mutation_timed(writer, kind, id, completed).await.0
    }

    /// [`Versions::commit_mutation`], also saying how long its snapshot took (the rest was
    /// the commit), for the execution's phase breakdown.
    pub async fn commit_mutation_timed(
        self: &Arc<Self>,
        writer: &Writer,
        kind: &str,
        id: Option<String>,
        completed: bool,
    ) -> (Result<Ref, WriteError>, std::time::Duration) {
        let me = self.clone();
        let (dir, root, kind_owned) = (writer.snapshot_dir(), writer.root.clone(), kind.to_owned());
        let attempts = writer.attempts();
        let id = id.unwrap_or_else(new_uuid_v4);
        let snapshot_took = Arc::new(Mutex::new(std::time::Duration::ZERO));
        let took = snapshot_took.clone();
        let committed = blocking_retry(self.clone(), move || {
            let started = std::time::Instant::now();
            let scope = attempts.scope();
            let closure = Closure::of(&scope);
            let tree = me.snapshot_live(&dir, &scope)?;
            *took.lock().unwrap_or_else(|p| p.into_inner()) += started.elapsed();
            me.commit_mutation_record(
                &root,
                &tree,
                (Some(&id), &kind_owned, completed),
                Expected::Current,
                closure,
            )?;
            attempts.committed(&scope);
            Ok(tree)
        })
        .await;
        if let Err(e) = &committed {
            self.fail_commit(&writer.root, e);
        }
        let snapshot = *snapshot_took.lock().unwrap_or_else(|p| p.into_inner());
        (committed, snapshot)
    }

    /// Snapshots the workspace and commits a `WorkspaceExecution` as its head; returns the
    /// record (`version`) and the tree (`result.workspaceSnapshot`). The caller poisons on
    /// failure (its message differs), through [`Versions::fail_commit`].
    pub async fn commit_execution(
        self: &Arc<Self>,
        writer: &Writer,
        facts: ExecutionFacts,
    ) -> Result<(Ref, Ref), WriteError> {
        let me = self.clone();
        let (dir, root, attempts) = (writer.snapshot_dir(), writer.root.clone(), writer.attempts());
        blocking_retry(self.clone(), move || {
            let scope = attempts.scope();
            let closure = Closure::of(&scope);
            let tree = me.snapshot_live(&dir, &scope)?;
            let put = |text: &str| me.store.put(Pool::AgentState, text.as_bytes(), versioning::OCTET_STREAM);
            let stream = |open: &ContentSource| me.store.put_stream(Pool::AgentState, &mut *open());
            let (code, stdout, stderr) = (put(&facts.code)?, stream(&facts.stdout)?, stream(&facts.stderr)?);
            let value = execution_value(&ExecutionFields {
                agent_id: &facts.agent_id,
                code: &code,
                environment_revision_id: facts.environment_revision_id.as_deref(),
                execution_id: &facts.execution_id,
                session_id: &facts.session_id,
                state: facts.state,
                stderr: &stderr,
                stdout: &stdout,
                workspace: &tree,
            });
            let record = me.store.put_record("WorkspaceExecution", value)?;
            me.commit_head(&root, &record, closure)?;
            attempts.committed(&scope);
            Ok((record, tree))
        })
        .await
    }

    /// Commits `head`, a version made on another node (its objects already stored here), as
    /// the workspace's head over the current one, once the files under the writer are that
    /// version: their snapshot must be `tree` and `head` must name `tree` (else
    /// [`TransferError::TreeMismatch`] or [`TransferError::HeadMismatch`], and nothing moves).
    /// The head is the very ref the source committed, so both nodes agree on the version.
    /// Nothing is poisoned on failure: the caller decides what a failed import means.
    pub async fn commit_imported(
        self: &Arc<Self>,
        writer: &Writer,
        head: &Ref,
        tree: &Ref,
    ) -> Result<(), WriteError> {
        let me = self.clone();
        let root = writer.root.clone();
        let pinned = crate::fsat::dup(writer.pinned()).map_err(|e| WriteError::Task(e.to_string()))?;
        let (head, tree) = (head.clone(), tree.clone());
        blocking_retry(self.clone(), move || {
            // The files must be the tree's (checked by structure: the caller wrote them from
            // objects checked by digest, and a snapshot would store every file once more).
            crate::transfer::verify::matches_tree(&me.store, &tree, std::os::fd::AsFd::as_fd(&pinned))?;
            let named = me.tree_of(&head)?;
            if named != tree {
                return Err(TransferError::HeadMismatch {
                    head: head.digest.clone(),
                    tree: tree.digest.clone(),
                }
                .into());
            }
            me.commit_ref(Target::Workspace(&root), Expected::Current, &head, Closure::Full)
        })
        .await
    }

    /// Snapshots a pinned workspace directory, refusing one that was deleted meanwhile (its
    /// descriptor would show an empty directory, which is not what the workspace holds).
    fn snapshot_live(&self, dir: &Path, scope: &SnapshotScope) -> Result<Ref, WriteError> {
        use std::os::unix::fs::MetadataExt;
        match std::fs::metadata(dir) {
            Ok(m) if m.nlink() == 0 => Err(WriteError::Deleted),
            _ => Ok(self.store.snapshot_scoped(dir, scope)?),
        }
    }

    /// Commits over the current head: the lease this writer holds serialises the head's
    /// writers ([`Expected::Current`]).
    fn commit_head(&self, root: &Path, record: &Ref, closure: Closure) -> Result<(), WriteError> {
        self.commit_ref(Target::Workspace(root), Expected::Current, record, closure)
    }

    /// Validates `record`'s closure and makes its objects durable — without the refs lock,
    /// so one commit's checks do not hold up other workspaces' commits — then commits it
    /// under the lock (compare-and-swap against `expected`, or over the current head).
    /// Every ref commit passes here: a workspace head's is told to [`Versions::on_commit`].
    fn commit_ref(
        &self,
        target: Target<'_>,
        expected: Expected,
        record: &Ref,
        closure: Closure,
    ) -> Result<(), WriteError> {
        match closure {
            Closure::Full => self.store.validate_closure(record)?,
            Closure::SinceValidated => self.store.validate_closure_since_validated(record)?,
        };
        self.store.sync_pending()?;
        let name = target.name();
        {
            let mut refs = self.refs();
            match expected {
                Expected::Current => refs.commit_over_current(&name, record)?,
                Expected::Exactly(r) => refs.commit_validated(&name, r.as_ref(), record)?,
            }
        }
        if let (Target::Workspace(root), Some(hook)) = (target, self.on_commit.get()) {
            hook(root, record);
        }
        Ok(())
    }

    /// Puts a `WorkspaceMutation` for `tree` and commits it as the head of `root`.
    fn commit_mutation_record(
        &self,
        root: &Path,
        tree: &Ref,
        (id, kind, completed): (Option<&str>, &str, bool),
        expected: Expected,
        closure: Closure,
    ) -> Result<Ref, WriteError> {
        let record = self.store.put_record("WorkspaceMutation", mutation_value(id, kind, completed, tree))?;
        self.commit_ref(Target::Workspace(root), expected, &record, closure)?;
        Ok(record)
    }

    /// A failed commit: poisons the workspace unless only its content was refused (then
    /// the write failed, and the workspace stays writable so its next run or a DELETE can
    /// remove what was refused; a nested workspace's content never gets this far, see
    /// [`SnapshotScope::canonical`]).
    pub fn fail_commit(&self, root: &Path, cause: &WriteError) {
        if cause.is_content() {
            tracing::warn!(event = "workspace_commit_refused", workspace = %root.display(), error = %common::error_chain(cause));
        } else {
            self.poison(root, cause);
        }
    }

    /// Records the failure and refuses later writers (`.failed` plus this process's set).
    pub fn poison(&self, root: &Path, cause: &dyn std::fmt::Display) {
        tracing::error!(event = "workspace_poisoned", workspace = %root.display(), error = %cause);
        if let Err(e) = self.lifecycle.poison(root) {
            tracing::error!(event = "workspace_poison_failed", workspace = %root.display(), error = %common::error_chain(&e));
        }
    }

    /// `committedWorkspaceSnapshot`: when a writer is admitted or holds the lease, the last
    /// committed tree without waiting; otherwise a fresh snapshot, committed as a
    /// `checkpoint` when it differs from the head.
    pub async fn observed_tree(
        self: &Arc<Self>,
        canonical: &Path,
        pinned: &OwnedFd,
    ) -> Result<Ref, WriteError> {
        let busy = || {
            let (me, root) = (self.clone(), canonical.to_owned());
            blocking_retry(self.clone(), move || me.head_tree(&root)?.ok_or(WriteError::NoBaseline))
        };
        let Some(admitted) = self.lifecycle.try_admit(canonical).await? else { return busy().await };
        let Some(lease) = self.lifecycle.try_lease(canonical)? else { return busy().await };
        match self.refuse_fenced_blocking(canonical, Fence::Refuse).await {
            // A copy that moved away commits nothing more: its last committed tree.
            Err(WriteError::Fenced { .. }) => return busy().await,
            Err(e) => return Err(e),
            Ok(()) => {}
        }
        let me = self.clone();
        let (root, dir) = (canonical.to_owned(), crate::fsat::pinned_dir(pinned));
        let observed = blocking_retry(self.clone(), move || {
            let name = workspace_head_name(&root);
            let scope =
                SnapshotScope { canonical: Some(root.clone()), max_bytes: me.default_max_bytes, reuse: None };
            let tree = me.snapshot_live(&dir, &scope)?;
            if me.head_tree(&root)?.is_some_and(|t| t.digest == tree.digest) {
                return Ok(tree);
            }
            let head = me.refs().head(&name)?;
            let kind = if head.is_some() { "checkpoint" } else { "baseline" };
            me.commit_mutation_record(
                &root,
                &tree,
                (None, kind, true),
                Expected::Exactly(head),
                Closure::Full,
            )?;
            Ok(tree)
        })
        .await;
        drop(lease);
        drop(admitted);
        observed
    }

    /// The tree of the current head (`value.workspace` of a mutation or execution record).
    pub fn head_tree(&self, canonical: &Path) -> Result<Option<Ref>, WriteError> {
        let Some(head) = self.head(canonical)? else { return Ok(None) };
        Ok(Some(self.tree_of(&head)?))
    }

    /// The tree a head record names (`value.workspace` of a mutation or execution record).
    fn tree_of(&self, head: &Ref) -> Result<Ref, WriteError> {
        let record = self.store.read_record(head, None)?;
        if record.kind != "WorkspaceMutation" && record.kind != "WorkspaceExecution" {
            return Err(WriteError::HeadKind);
        }
        let tree = record.value.get("workspace").ok_or(WriteError::HeadKind)?;
        Ok(Ref::from_value(tree)?)
    }

    /// Start-up recovery (ours): every workspace whose lease our previous process held when
    /// it died gets a `runner-recovery` mutation committed (the files as they are now), its
    /// `.active` marker removed, and an audit event. Roots someone else holds are left; a
    /// fenced one (it moved away) has its marker removed and nothing committed.
    pub async fn recover_interrupted(self: &Arc<Self>) -> Vec<PathBuf> {
        let mut recovered = Vec::new();
        for (root, entry) in self.lifecycle.journaled_roots() {
            if self.recover_one(&root, &entry).await {
                recovered.push(root);
            }
        }
        recovered
    }

    /// [`Versions::recover_interrupted`] of one root, whose lease journal entry is `entry`:
    /// whether a recovery commit was made.
    async fn recover_one(self: &Arc<Self>, root: &Path, entry: &Path) -> bool {
        // Admission first, as for every writer: a fenced (retired) or busy root is left.
        let admitted = match self.lifecycle.try_admit(root).await {
            Ok(Some(a)) => a,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(event = "workspace_recovery_skipped", workspace = %root.display(), reason = %common::error_chain(&e));
                return false;
            }
        };
        if self.lifecycle.poison_marked(root) {
            // Poisoned before the crash: that needs a person, not a recovery commit.
            tracing::warn!(event = "workspace_recovery_skipped", workspace = %root.display(), reason = crate::coordination::POISONED);
            return false;
        }
        let lease = match self.lifecycle.take_over_interrupted(root, entry) {
            Ok(Some(lease)) => lease,
            Ok(None) => return false,
            Err(e) => {
                tracing::error!(event = "workspace_recovery_failed", workspace = %root.display(), error = %common::error_chain(&e));
                return false;
            }
        };
        // Checked with the lease held, so no move slips in between. A copy that moved away
        // commits nothing: a crash while its files were being cleared would otherwise make
        // the half-cleared tree a new head here. Its marker and journal entry go (dropping
        // the lease): nothing is left to recover on this node.
        match self.refuse_fenced_blocking(root, Fence::Refuse).await {
            Ok(()) => {}
            Err(WriteError::Fenced { moved_to, epoch }) => {
                tracing::warn!(
                    event = "workspace_recovery_fenced",
                    workspace = %root.display(),
                    movedTo = %moved_to,
                    epoch,
                    reason = "runnerd stopped while it held the lease of a workspace that moved away; nothing was committed",
                );
                drop(lease);
                drop(admitted);
                return false;
            }
            Err(e) => {
                tracing::error!(event = "workspace_recovery_failed", workspace = %root.display(), error = %common::error_chain(&e));
                lease.release_keeping_marker();
                return false;
            }
        }
        // Pinned by descriptor, walked beneath the data directory without following a
        // symlink, like every other commit: an enclosing sandbox may have planted one.
        let pinned = match crate::workspace::open_beneath(&self.data_dir, root) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(event = "workspace_recovery_failed", workspace = %root.display(), error = %common::error_chain(&e));
                return false;
            }
        };
        let (me, r, dir) = (self.clone(), root.to_owned(), crate::fsat::pinned_dir(&pinned));
        let committed = blocking_retry(self.clone(), move || me.commit_recovery(&r, &dir)).await;
        let recovered = match committed {
            Ok(record) => {
                tracing::warn!(
                    event = "workspace_recovered",
                    workspace = %root.display(),
                    head = %record.digest,
                    reason = "runnerd stopped while it held this workspace's writer lease",
                );
                drop(lease);
                true
            }
            Err(e) => {
                // Keep the marker: the workspace stays refused until a person looks.
                tracing::error!(event = "workspace_recovery_failed", workspace = %root.display(), error = %e);
                lease.release_keeping_marker();
                false
            }
        };
        drop(admitted);
        recovered
    }

    /// The recovery commit of `root` (pinned as `dir`): a `runner-recovery` mutation over
    /// its head, or its baseline when it has none.
    fn commit_recovery(&self, root: &Path, dir: &Path) -> Result<Ref, WriteError> {
        let name = workspace_head_name(root);
        let scope = SnapshotScope {
            canonical: Some(root.to_owned()),
            max_bytes: self.default_max_bytes,
            reuse: None,
        };
        let tree = self.snapshot_live(dir, &scope)?;
        let head = self.refs().head(&name)?;
        let (id, kind) = match head {
            Some(_) => (Some(new_uuid_v4()), "runner-recovery"),
            None => (None, "baseline"),
        };
        self.commit_mutation_record(
            root,
            &tree,
            (id.as_deref(), kind, true),
            Expected::Exactly(head),
            Closure::Full,
        )
    }
}

/// What a repair found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct Repaired {
    /// The head before the repair, and the result of verifying its closure (objects
    /// checked, or why it failed: the repair commits a new head that does not need it).
    pub previous: Option<(Ref, Result<usize, String>)>,
    /// The `repair` mutation now the head.
    pub head: Ref,
    /// Whether a poison marker (`.failed`) was cleared.
    pub cleared: bool,
}

impl Versions {
    /// The operator's repair of a workspace a storage failure poisoned (ours, beyond the
    /// original): admission, then the lease, as every writer (so the API process is never
    /// raced; the lease is taken although `.failed` stands); then verify the store (the
    /// head's closure, every object re-hashed if not known good), snapshot the files as
    /// they are, commit a `repair` mutation against the head read under the lease, and
    /// only then clear `.failed` and this process's poisoned entry. A repair that fails
    /// leaves the marker.
    pub async fn repair(self: &Arc<Self>, canonical: &Path, pinned: OwnedFd) -> Result<Repaired, WriteError> {
        let admitted = self.lifecycle.admit(canonical, None).await?;
        let lease = self.lifecycle.repair_lease(canonical, None).await?;
        self.refuse_fenced_blocking(canonical, Fence::Refuse).await?;
        let me = self.clone();
        let (root, dir) = (canonical.to_owned(), crate::fsat::pinned_dir(&pinned));
        let committed = blocking_retry(self.clone(), move || {
            let name = workspace_head_name(&root);
            let head = me.refs().head(&name)?;
            let previous = head.clone().map(|h| {
                let verified = me.store.validate_closure(&h).map_err(|e| common::error_chain(&e));
                (h, verified)
            });
            let scope =
                SnapshotScope { canonical: Some(root.clone()), max_bytes: me.default_max_bytes, reuse: None };
            let tree = me.snapshot_live(&dir, &scope)?;
            let id = new_uuid_v4();
            let record = me.commit_mutation_record(
                &root,
                &tree,
                (Some(&id), "repair", true),
                Expected::Exactly(head),
                Closure::Full,
            )?;
            Ok((previous, record))
        })
        .await;
        let (previous, head) = match committed {
            Ok(done) => done,
            Err(e) => {
                tracing::error!(event = "workspace_repair_failed", workspace = %canonical.display(), error = %common::error_chain(&e));
                return Err(e);
            }
        };
        let cleared = self.lifecycle.clear_poison(canonical, &lease)?;
        drop(lease);
        drop(admitted);
        tracing::warn!(
            event = "workspace_repaired",
            workspace = %canonical.display(),
            head = %head.digest,
            previous_head = previous.as_ref().map(|p| p.0.digest.as_str()).unwrap_or(""),
            previous_verified = %previous.as_ref().map(|p| match &p.1 { Ok(n) => format!("{n} objects"), Err(e) => e.clone() }).unwrap_or_default(),
            marker_cleared = cleared,
        );
        Ok(Repaired { previous, head, cleared })
    }
}

impl Versions {
    /// Stores a `WorkspaceExport` record at `workspace-exports/<uuid>` (expected: none).
    pub fn put_export(&self, value: Value) -> Result<(String, Ref), WriteError> {
        // From the record to its ref, the collector deletes nothing (issue #32).
        let _guard = self.store.commit_guard();
        let record = self.store.put_record("WorkspaceExport", value)?;
        let id = new_uuid_v4();
        let name = format!("workspace-exports/{id}");
        self.commit_ref(Target::Named(&name), Expected::Exactly(None), &record, Closure::Full)?;
        Ok((id, record))
    }

    /// The `WorkspaceExport` record of an export id, if it exists.
    pub fn read_export(&self, id: &str) -> Result<Option<versioning::Record>, WriteError> {
        let Some(head) = self.refs().head(&format!("workspace-exports/{id}"))? else { return Ok(None) };
        Ok(Some(self.store.read_record(&head, Some("WorkspaceExport"))?))
    }
}

/// Snapshots retried after `Workspace changed during snapshot` before the write fails.
const SNAPSHOT_RETRIES: u32 = 3;

/// Runs store work for the awaiting task ([`crate::blocking::run`]). An object found
/// missing (deleted behind the store's caches) makes it forget every cache and try once
/// more, re-reading and re-storing what it needs, so a damaged pool heals instead of
/// failing the write; a tree that changed under the walk is walked again (a few times,
/// briefly apart).
async fn blocking_retry<T: Send + 'static>(
    versions: Arc<Versions>,
    f: impl Fn() -> Result<T, WriteError> + Send + 'static,
) -> Result<T, WriteError> {
    crate::blocking::run(move || {
        let mut changed = 0;
        loop {
            // Each attempt, from its snapshot to its ref, holds off the collector's deletions
            // (issue #32): nothing it found stored is deleted before its ref roots it.
            let attempt = {
                let _guard = versions.store.commit_guard();
                f()
            };
            match attempt {
                Err(WriteError::Version(VersionError::Missing { digest, .. })) if changed < SNAPSHOT_RETRIES => {
                    tracing::warn!(event = "object_missing", digest = %digest, detail = "caches dropped; snapshotting again");
                    versions.store.forget_caches();
                    changed = SNAPSHOT_RETRIES;
                }
                // A nested workspace's writer (its files, or its lease markers, live inside
                // this tree) can change it mid-walk; a moment later the walk usually holds.
                Err(WriteError::Version(VersionError::Changed)) if changed < SNAPSHOT_RETRIES => {
                    changed += 1;
                    tracing::info!(event = "snapshot_retry", attempt = changed, reason = "workspace changed during snapshot");
                    std::thread::sleep(std::time::Duration::from_millis(50 * changed as u64));
                }
                other => return other,
            }
        }
    })
    .await
    .unwrap_or_else(|e| Err(WriteError::Task(e.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_their_cause_once_and_the_writer_answers_with_the_chain() {
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let version = VersionError::Io { action: "read", path: "/d/x".into(), source: io() };
        let coord = CoordError::Io { what: "open", name: "the lock".into(), source: io() };
        let remote = crate::remote::files::RemoteError::Io { what: "list", path: "/w".into(), source: io() };
        let all: [&dyn std::error::Error; 3] = [&version, &coord, &remote];
        for e in all {
            assert!(!common::repeats_its_source(e), "{e}");
            assert_eq!(common::error_chain(e).matches(&io().to_string()).count(), 1, "{e}");
        }
        // The API answers with a WriteError's text: the store's or the lock's error and its
        // cause, once, whichever way it is printed.
        let want = format!("could not read /d/x: {}", io());
        assert_eq!(common::error_chain(&version), want);
        let written = WriteError::from(version);
        assert_eq!((written.to_string(), common::error_chain(&written)), (want.clone(), want));
        let written = WriteError::from(coord);
        assert_eq!(written.to_string(), format!("Could not open the lock: {}", io()));
        assert_eq!(common::error_chain(&written), written.to_string());
    }

    use crate::coordination::tests::free_for_another_process;

    /// A nested workspace's lease database lives inside its parent's tree. Snapshotting the
    /// parent must not open (and close) it: closing any descriptor of a file drops every
    /// POSIX lock this process holds on it, the child's lease included.
    #[tokio::test]
    async fn snapshotting_a_parent_keeps_a_nested_lease_locked() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let parent = data.join("remote-workspaces/p/s");
        let child = parent.join("agents/c");
        std::fs::create_dir_all(&child).unwrap();
        std::fs::write(parent.join("f.txt"), "x").unwrap();
        let versions = Arc::new(Versions::open(&data).unwrap());
        let (parent, child) = (parent.canonicalize().unwrap(), child.canonicalize().unwrap());
        let pin = |p: &Path| OwnedFd::from(std::fs::File::open(p).unwrap());
        let child_writer = versions.begin(&child, pin(&child), None).await.unwrap();
        let lock = crate::coordination::LeasePaths::for_root(&child).lock;
        assert!(lock.starts_with(&parent), "the nested lease lives in the parent's tree");
        assert!(!free_for_another_process(&lock), "held");
        let parent_writer = versions.begin(&parent, pin(&parent), None).await.unwrap();
        versions.commit_mutation(&parent_writer, "test", None, true).await.unwrap();
        assert!(!free_for_another_process(&lock), "the parent's snapshot released the child's lease");
        drop(parent_writer);
        drop(child_writer);
        assert!(free_for_another_process(&lock));
    }

    /// A poisoned workspace refuses writers until a repair: verify, snapshot, commit a
    /// `repair` mutation, clear `.failed`; then writers are admitted again.
    #[tokio::test]
    async fn a_repair_makes_a_poisoned_workspace_writable_and_keeps_its_history() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let root = data.join("remote-workspaces/w");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("f.txt"), "v1").unwrap();
        let root = root.canonicalize().unwrap();
        let versions = Arc::new(Versions::open(&data).unwrap());
        let pin = |p: &Path| OwnedFd::from(std::fs::File::open(p).unwrap());
        let writer = versions.begin(&root, pin(&root), None).await.unwrap();
        versions.commit_mutation(&writer, "test", None, true).await.unwrap();
        drop(writer);
        let committed = versions.head(&root).unwrap().unwrap();
        versions.poison(&root, &"a test failure");
        let failed = crate::coordination::LeasePaths::for_root(&root).failed;
        assert!(failed.exists());
        let refused = versions.begin(&root, pin(&root), None).await.unwrap_err();
        assert_eq!(refused.to_string(), crate::coordination::POISONED);

        std::fs::write(root.join("f.txt"), "v2").unwrap();
        let repaired = versions.repair(&root, pin(&root)).await.unwrap();
        let (previous, verified) = repaired.previous.clone().unwrap();
        assert_eq!(previous, committed);
        assert!(verified.is_ok_and(|n| n > 0), "{repaired:?}");
        assert!(repaired.cleared && !failed.exists());
        let head = versions.head(&root).unwrap().unwrap();
        assert_eq!(head, repaired.head);
        let record = versions.store().read_record(&head, Some("WorkspaceMutation")).unwrap();
        assert_eq!(record.value["kind"], "repair");
        assert!(versions.store().read_record(&committed, None).is_ok(), "the last version is intact");
        let writer = versions.begin(&root, pin(&root), None).await.expect("writable again");
        versions.commit_mutation(&writer, "test", None, true).await.unwrap();
        assert!(!versions.lifecycle().is_poisoned(&root));
    }

    /// Start-up removes a dead runnerd's temporaries and stale foreign ones, and keeps a
    /// fresh foreign one (the API process may be writing it).
    #[test]
    fn opening_sweeps_only_temporaries_no_live_writer_owns() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        drop(Versions::open(&data).unwrap());
        let blobs = data.join("versioning/data/blobs/sha256");
        let dead = blobs.join("x.runnerd-999999999.tmp");
        let fresh = blobs.join("y.tmp");
        let stale = blobs.join("z.tmp");
        for p in [&dead, &fresh, &stale] {
            std::fs::write(p, "partial").unwrap();
        }
        let old = std::time::SystemTime::now() - crate::versioning::sweep::STALE_TEMPORARY;
        std::fs::File::options().write(true).open(&stale).unwrap().set_modified(old).unwrap();
        drop(Versions::open(&data).unwrap());
        assert!(!dead.exists() && !stale.exists() && fresh.exists());
    }

    /// A workspace, its data directory and versions, and a pin maker (issue #34 tests).
    fn node(name: &str, base: &Path) -> (Arc<Versions>, PathBuf) {
        let data = base.join(name);
        let root = data.join("remote-workspaces/w");
        std::fs::create_dir_all(&root).unwrap();
        let root = root.canonicalize().unwrap();
        (Arc::new(Versions::open(&data).unwrap()), root)
    }

    fn pin(p: &Path) -> OwnedFd {
        OwnedFd::from(std::fs::File::open(p).unwrap())
    }

    /// A copy that moved away refuses writers, saying where it went; an import passes.
    #[tokio::test]
    async fn a_fenced_workspace_refuses_writers_but_takes_an_import() {
        let dir = tempfile::tempdir().unwrap();
        let (versions, root) = node("a", dir.path());
        versions.placement().fence(&root, 7, "http://node-b:8080", 1).unwrap();
        let e = versions.begin(&root, pin(&root), None).await.unwrap_err();
        assert!(
            matches!(&e, WriteError::Fenced { moved_to, epoch: 7 } if moved_to == "http://node-b:8080"),
            "{e}"
        );
        assert_eq!(e.to_string(), "Workspace moved to http://node-b:8080 (epoch 7); send it there");
        assert_eq!(versions.head(&root).unwrap(), None, "no baseline for a stale copy");
        let e = versions.repair(&root, pin(&root)).await.unwrap_err();
        assert!(matches!(e, WriteError::Fenced { .. }), "{e}");
        let e = versions.observed_tree(&root, &pin(&root)).await.unwrap_err();
        assert!(matches!(e, WriteError::NoBaseline), "an observer commits no checkpoint: {e}");
        // The refusal let go of the lease: an import takes it at once.
        let writer = versions.begin_import(&root, pin(&root), None).await.unwrap();
        drop(writer);
        versions.placement().set_epoch(&root, 8).unwrap();
        versions.begin(&root, pin(&root), None).await.expect("back here: writable");
    }

    /// A crash while a moved copy's files were being cleared leaves its marker and journal
    /// entry: start-up recovery removes both and commits nothing (the half-cleared files
    /// must not become a head on a copy that moved away); an unfenced one is recovered.
    #[tokio::test]
    async fn recovery_commits_nothing_for_a_fenced_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let (versions, root) = node("a", dir.path());
        std::fs::write(root.join("f.txt"), "v1").unwrap();
        drop(versions.begin(&root, pin(&root), None).await.unwrap());
        let head = versions.head(&root).unwrap().unwrap();
        let crash = |versions: Arc<Versions>, root: PathBuf| async move {
            // What a crash leaves: the marker and the journal entry, the lock gone.
            let lease = versions.lifecycle().lease(&root, None).await.unwrap();
            let active = lease.paths().active.clone();
            lease.release_keeping_marker();
            assert!(active.exists() && versions.lifecycle().journaled_roots().len() == 1);
            active
        };
        let active = crash(versions.clone(), root.clone()).await;
        versions.placement().fence(&root, 3, "http://node-b:8080", 1).unwrap();
        std::fs::remove_file(root.join("f.txt")).unwrap(); // half cleared
        assert!(versions.recover_interrupted().await.is_empty(), "nothing recovered");
        assert_eq!(versions.head(&root).unwrap(), Some(head.clone()), "no recovery version");
        assert!(!active.exists(), "the marker is gone");
        assert!(versions.lifecycle().journaled_roots().is_empty(), "so is the journal entry");

        // Back here, the same crash is recovered as before.
        versions.placement().set_epoch(&root, 4).unwrap();
        let active = crash(versions.clone(), root.clone()).await;
        assert_eq!(versions.recover_interrupted().await, vec![root.clone()]);
        assert_ne!(versions.head(&root).unwrap(), Some(head));
        assert!(!active.exists());
    }

    /// Node A's head arrives at node B object by object, B writes the tree out and commits
    /// A's very head; files that are not that tree are refused and the head stays.
    #[tokio::test]
    async fn an_imported_head_is_committed_as_it_is_only_over_its_own_tree() {
        let dir = tempfile::tempdir().unwrap();
        let (a, a_root) = node("a", dir.path());
        std::fs::create_dir(a_root.join("sub")).unwrap();
        std::fs::write(a_root.join("sub/f.txt"), "from a").unwrap();
        let writer = a.begin(&a_root, pin(&a_root), None).await.unwrap();
        let tree = a.commit_mutation(&writer, "test", None, true).await.unwrap();
        drop(writer);
        let head = a.head(&a_root).unwrap().unwrap();

        let (b, b_root) = node("b", dir.path());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook_seen = seen.clone();
        b.on_commit(Arc::new(move |root: &Path, head: &Ref| {
            hook_seen.lock().unwrap().push((root.to_owned(), head.clone()));
        }));
        for r in crate::transfer::closure::closure(a.store(), &head, &mut |_| false).unwrap() {
            let mut bytes = a.store().open_reader(&r).unwrap();
            assert!(b.store().put_verified(&r, &mut bytes).unwrap());
        }
        let writer = b.begin_import(&b_root, pin(&b_root), None).await.unwrap();
        assert_eq!(b.head(&b_root).unwrap(), None, "an import commits no baseline of what it replaces");
        let staging = b_root.parent().unwrap().join(".staging");
        std::fs::create_dir(&staging).unwrap();
        crate::transfer::materialize::materialize(
            b.store(),
            &tree,
            std::os::fd::AsFd::as_fd(&pin(&staging)),
            None,
        )
        .unwrap();
        std::fs::write(b_root.join("stray"), "not in the tree").unwrap();
        crate::transfer::materialize::swap_in(
            std::os::fd::AsFd::as_fd(&pin(&staging)),
            std::os::fd::AsFd::as_fd(&pin(&b_root)),
        )
        .unwrap();
        std::fs::write(b_root.join("late"), "written after the swap").unwrap();
        let e = b.commit_imported(&writer, &head, &tree).await.unwrap_err();
        assert!(matches!(e, WriteError::Transfer(TransferError::TreeMismatch { .. })), "{e}");
        assert!(e.to_string().contains(&tree.digest), "{e}");
        assert_eq!(b.head(&b_root).unwrap(), None, "the head did not move");
        // A head that names another tree is refused even over the right files.
        std::fs::remove_file(b_root.join("late")).unwrap();
        let empty = b.store().put_record("WorkspaceTree", serde_json::json!({"entries": []})).unwrap();
        let other =
            b.store().put_record("WorkspaceMutation", mutation_value(None, "x", true, &empty)).unwrap();
        let e = b.commit_imported(&writer, &other, &tree).await.unwrap_err();
        assert!(matches!(e, WriteError::Transfer(TransferError::HeadMismatch { .. })), "{e}");
        assert_eq!(b.head(&b_root).unwrap(), None);

        b.commit_imported(&writer, &head, &tree).await.unwrap();
        assert_eq!(b.head(&b_root).unwrap(), Some(head.clone()), "exactly A's head");
        assert_eq!(b.head_tree(&b_root).unwrap(), Some(tree));
        assert_eq!(*seen.lock().unwrap(), vec![(b_root.clone(), head)]);
    }

    /// The hook hears of every workspace head commit, whatever made it, and of nothing else.
    #[tokio::test]
    async fn the_commit_hook_hears_every_workspace_head_and_only_those() {
        let dir = tempfile::tempdir().unwrap();
        let (versions, root) = node("a", dir.path());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook_seen = seen.clone();
        versions.on_commit(Arc::new(move |root: &Path, head: &Ref| {
            hook_seen.lock().unwrap().push((root.to_owned(), head.clone()));
        }));
        let writer = versions.begin(&root, pin(&root), None).await.unwrap();
        let baseline = versions.head(&root).unwrap().unwrap();
        std::fs::write(root.join("f"), "x").unwrap();
        versions.commit_mutation(&writer, "test", None, true).await.unwrap();
        let mutation = versions.head(&root).unwrap().unwrap();
        drop(writer);
        versions.put_export(serde_json::json!({"workspace": "w"})).unwrap();
        std::fs::write(root.join("g"), "y").unwrap();
        versions.observed_tree(&root, &pin(&root)).await.unwrap();
        let checkpoint = versions.head(&root).unwrap().unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(root.clone(), baseline), (root.clone(), mutation), (root.clone(), checkpoint)],
            "an export is no workspace head"
        );
    }
}
