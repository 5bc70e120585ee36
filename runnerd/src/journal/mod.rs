//! The change journal (issue #31): what a run changed, from the kernel's file events, so the
//! work after a run — the quota, `createdFiles`/`modifiedFiles`, the snapshot — costs what
//! the run touched rather than what the workspace holds.
//!
//! One inotify instance serves every recently used workspace: each directory of a journaled
//! workspace carries a watch (added when the directory is opened, before its names are
//! read, so nothing changed after a listing goes unseen), set up by the workspace's first
//! walk and kept across runs, writes outside a lease included. A bounded number of
//! workspaces ([`JournalSettings::workspaces`]) and watches ([`JournalSettings::watches`])
//! are kept; the least recently used workspace gives its watches back. Events only say
//! where to look: each named path is read again by descriptor ([`tree`]), after the
//! sandbox's PID namespace has ended for the run's result, so a write through `mmap`
//! (which raises no event) is seen with its file's close. Anything the journal cannot vouch
//! for — a queue overflow, the watch limit, an unreadable directory, the workspace root
//! itself moved — makes that workspace's next measurement one full walk, counted in
//! `/metrics`, and the watches are set up again by that walk.
//!
//! inotify rather than fanotify even as root: one mechanism for both deployments, no
//! filesystem-wide mark that sees every other tenant's writes, and it follows a workspace
//! through the idmapped bind mounts the sandboxes write through (watches are on inodes).

pub mod tree;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};

use crate::exec::files::{Fingerprints, Measured};
use crate::fsat::{self, Stat};
use crate::versioning::snapshot::Reuse;
use tree::{Lost, Tree};

/// `SCIENCE_AGENT_JOURNAL_WORKSPACES`: workspaces journaled at once (0: no journal).
pub const WORKSPACES_VAR: &str = "SCIENCE_AGENT_JOURNAL_WORKSPACES";
/// `SCIENCE_AGENT_JOURNAL_WATCHES`: directory watches held at once, over all of them.
pub const WATCHES_VAR: &str = "SCIENCE_AGENT_JOURNAL_WATCHES";
/// `SCIENCE_AGENT_JOURNAL_FILES`: files kept in memory over all journaled workspaces, each
/// workspace its share (about 150 bytes each: 300 MB at the default, at most).
pub const FILES_VAR: &str = "SCIENCE_AGENT_JOURNAL_FILES";
pub const DEFAULT_WORKSPACES: usize = 16;
pub const DEFAULT_WATCHES: usize = 65_536;
pub const DEFAULT_FILES: usize = 2_000_000;
/// Paths changed since a workspace was last measured, kept at most (or its share of files,
/// if fewer): past it, one walk is cheaper than reading each again, and the set stays
/// bounded while no run comes.
const MAX_PENDING: usize = 100_000;
/// Why a workspace new to the journal is walked once.
const FIRST_USE: &str = "first use";

/// The events that can change what a walk finds: names appearing, going, moving; contents,
/// sizes and modes changing; a file written through a mapping is closed (its last chance
/// to raise anything); and the watched directory itself going away.
fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// The journal's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalSettings {
    pub workspaces: usize,
    pub watches: usize,
    pub files: usize,
}

impl JournalSettings {
    /// The files one workspace's tree may hold.
    fn files_per_workspace(&self) -> usize {
        self.files / self.workspaces.max(1)
    }
}

impl Default for JournalSettings {
    fn default() -> Self {
        JournalSettings { workspaces: DEFAULT_WORKSPACES, watches: DEFAULT_WATCHES, files: DEFAULT_FILES }
    }
}

/// What one event means for a workspace path, decided from its mask alone (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// The path changed: read it again.
    Changed,
    /// A directory appeared at the path: watch it (and what is below it), then read it.
    DirAppeared,
    /// A directory left the path: its watches no longer name it.
    DirLeft,
    /// The watched directory itself went away (meaningful for a workspace root).
    SelfGone,
    /// The watched directory's own mode or owner changed (for a workspace root, which no
    /// watched parent names: it may have become unreadable).
    SelfChanged,
    /// The kernel dropped the watch.
    Ignored,
    /// The kernel's queue overflowed: events were lost.
    Overflow,
    Nothing,
}

pub fn meaning(mask: AddWatchFlags, named: bool) -> Meaning {
    use AddWatchFlags as F;
    if mask.contains(F::IN_Q_OVERFLOW) {
        return Meaning::Overflow;
    }
    if mask.contains(F::IN_IGNORED) {
        return Meaning::Ignored;
    }
    if !named {
        return if mask.intersects(F::IN_DELETE_SELF | F::IN_MOVE_SELF | F::IN_UNMOUNT) {
            Meaning::SelfGone
        } else if mask.contains(F::IN_ATTRIB) {
            Meaning::SelfChanged
        } else {
            Meaning::Nothing
        };
    }
    let dir = mask.contains(F::IN_ISDIR);
    if dir && mask.intersects(F::IN_CREATE | F::IN_MOVED_TO) {
        Meaning::DirAppeared
    } else if dir && mask.intersects(F::IN_DELETE | F::IN_MOVED_FROM) {
        Meaning::DirLeft
    } else if mask.intersects(
        F::IN_CREATE
            | F::IN_DELETE
            | F::IN_MOVED_FROM
            | F::IN_MOVED_TO
            | F::IN_MODIFY
            | F::IN_ATTRIB
            | F::IN_CLOSE_WRITE,
    ) {
        Meaning::Changed
    } else {
        Meaning::Nothing
    }
}

/// Why a run was measured by walking rather than from the journal (`/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The workspace's first use (or first since it was evicted or lost): one walk, which
    /// also sets up its watches.
    First,
    /// Events were lost (queue overflow, the root moved, a watch could not be added).
    Lost,
    /// The tree could not be represented (unreadable, non-UTF-8 names, too large).
    Unrepresentable,
    /// Every journal slot is held by a running workspace, or the journal is off.
    NoSlot,
}

impl Fallback {
    pub fn label(self) -> &'static str {
        match self {
            Fallback::First => "first_use",
            Fallback::Lost => "events_lost",
            Fallback::Unrepresentable => "unrepresentable",
            Fallback::NoSlot => "no_slot",
        }
    }
    pub const ALL: [Fallback; 4] =
        [Fallback::First, Fallback::Lost, Fallback::Unrepresentable, Fallback::NoSlot];
}

/// The change journal of one runnerd (clones share it).
#[derive(Clone)]
pub struct Journal {
    inner: Option<Arc<Inner>>,
    /// Why there is none, when there is none.
    off: Option<String>,
    settings: JournalSettings,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("settings", &self.settings).field("off", &self.off).finish()
    }
}

struct Inner {
    inotify: Inotify,
    watches: Mutex<Watches>,
    spaces: Mutex<HashMap<PathBuf, Arc<Watched>>>,
    settings: JournalSettings,
    clock: AtomicU64,
    next_id: AtomicU64,
    fallbacks: [AtomicU64; 4],
    journaled: AtomicU64,
}

/// Watch descriptor → the (workspace, directory) pairs it stands for (a nested workspace's
/// directories are also its parent's).
#[derive(Default)]
struct Watches {
    by_wd: HashMap<WatchDescriptor, Vec<(u64, String)>>,
}

/// One journaled workspace.
struct Watched {
    id: u64,
    /// The workspace directory (`O_PATH`), as first pinned.
    root: OwnedFd,
    dev_ino: (u64, u64),
    pending: Mutex<Pending>,
    tree: Mutex<Option<Tree>>,
    notify: tokio::sync::Notify,
    in_use: AtomicUsize,
    last_used: AtomicU64,
}

/// What the events said since they were last taken.
#[derive(Default)]
struct Pending {
    paths: BTreeSet<String>,
    lost: Option<String>,
    /// Paths changed since the last snapshot this journal served, with the sequence number
    /// of their last change, and that snapshot's directories.
    since_snapshot: BTreeMap<String, u64>,
    seq: u64,
    known: Option<BTreeMap<String, (crate::versioning::Ref, u64)>>,
    /// [`MAX_PENDING`], or the workspace's share of files if fewer.
    max: usize,
}

impl Pending {
    fn changed(&mut self, path: String) {
        if self.lost.is_some() {
            return;
        }
        self.seq += 1;
        self.since_snapshot.insert(path.clone(), self.seq);
        self.paths.insert(path);
        if self.paths.len().max(self.since_snapshot.len()) > self.max {
            self.lose(format!("more than {} paths changed since the last measurement", self.max));
        }
    }

    /// A path no event named changed (another name of a linked file): only snapshots care.
    fn changed_unseen(&mut self, paths: Vec<String>) {
        for path in paths {
            self.seq += 1;
            self.since_snapshot.insert(path, self.seq);
        }
    }

    fn lose(&mut self, why: String) {
        self.lost.get_or_insert(why);
        self.paths.clear();
        self.since_snapshot.clear();
        self.known = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Journal {
    /// The journal, or none (with why) where inotify cannot be had or it is switched off.
    pub fn new(settings: JournalSettings) -> Journal {
        if settings.workspaces == 0 || settings.watches == 0 || settings.files == 0 {
            return Journal { inner: None, off: Some(format!("{WORKSPACES_VAR} is 0")), settings };
        }
        match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
            Ok(inotify) => {
                let inner = Arc::new(Inner {
                    inotify,
                    watches: Mutex::default(),
                    spaces: Mutex::default(),
                    settings,
                    clock: AtomicU64::new(0),
                    next_id: AtomicU64::new(1),
                    fallbacks: Default::default(),
                    journaled: AtomicU64::new(0),
                });
                let weak = Arc::downgrade(&inner);
                let started = std::thread::Builder::new().name("journal".into()).spawn(move || reader(weak));
                match started {
                    Ok(_) => Journal { inner: Some(inner), off: None, settings },
                    Err(e) => Journal { inner: None, off: Some(format!("its reader thread: {e}")), settings },
                }
            }
            Err(e) => Journal { inner: None, off: Some(format!("inotify_init1: {e}")), settings },
        }
    }

    /// No journal: every run walks (tests, and `--check-config`).
    pub fn off(why: &str) -> Journal {
        Journal { inner: None, off: Some(why.to_owned()), settings: JournalSettings::default() }
    }

    /// `/health`'s account of how runs are measured.
    pub fn describe(&self) -> serde_json::Value {
        let (workspaces, watches, _, _) = self.counts();
        match (&self.inner, &self.off) {
            (Some(_), _) => serde_json::json!({
                "mode": "inotify",
                "workspaces": workspaces,
                "maxWorkspaces": self.settings.workspaces,
                "watches": watches,
                "maxWatches": self.settings.watches,
                "maxFilesPerWorkspace": self.settings.files_per_workspace(),
            }),
            (None, off) => serde_json::json!({
                "mode": "walk",
                "reason": off.clone().unwrap_or_default(),
            }),
        }
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// What `/metrics` shows of the journal.
    pub fn metrics(&self) -> crate::metrics::JournalCounts {
        let (workspaces, watches, journaled, walked) = self.counts();
        crate::metrics::JournalCounts {
            workspaces,
            watches,
            journaled,
            walked: Fallback::ALL.iter().zip(walked).map(|(f, n)| (f.label(), n)).collect(),
        }
    }

    /// (workspaces journaled, watches held, runs measured from the journal, fallbacks by
    /// [`Fallback::ALL`]).
    pub fn counts(&self) -> (usize, usize, u64, [u64; 4]) {
        match &self.inner {
            Some(i) => {
                // One lock at a time: the reader takes `watches`, then `spaces`.
                let workspaces = lock(&i.spaces).len();
                let watches = i.watch_count();
                let fallbacks = std::array::from_fn(|k| i.fallbacks[k].load(Ordering::Relaxed));
                (workspaces, watches, i.journaled.load(Ordering::Relaxed), fallbacks)
            }
            None => (0, 0, 0, [0; 4]),
        }
    }

    /// Starts measuring a run in the workspace `key` (its canonical path), pinned as `root`:
    /// the workspace as it is now, and the run's watch when the journal has one for it.
    /// Blocking (it may walk the workspace).
    pub fn begin(&self, key: &Path, root: &OwnedFd) -> (Measured, Option<RunWatch>) {
        let Some(inner) = &self.inner else {
            return (crate::exec::files::measure(root.as_fd()), None);
        };
        let Some(watched) = inner.slot(key, root) else {
            inner.count(Fallback::NoSlot);
            return (crate::exec::files::measure(root.as_fd()), None);
        };
        // `slot` counted this run as a user of the workspace; dropping the run uncounts it.
        let run = RunWatch(Arc::new(Run { inner: inner.clone(), watched }));
        match run.start() {
            (m, true) => (m, Some(run)),
            (m, false) => (m, None),
        }
    }
}

impl Inner {
    fn count(&self, f: Fallback) {
        self.fallbacks[Fallback::ALL.iter().position(|x| *x == f).unwrap_or(0)]
            .fetch_add(1, Ordering::Relaxed);
    }

    fn watch_count(&self) -> usize {
        lock(&self.watches).by_wd.len()
    }

    /// The workspace's journal entry, counted in use, made (evicting the least recently used
    /// idle one at the bound) or remade when its directory is no longer the one it watched.
    fn slot(&self, key: &Path, root: &OwnedFd) -> Option<Arc<Watched>> {
        let st = Stat::of_fd(root).ok()?;
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        // The watches of what is dropped go after `spaces` is released (the reader takes
        // `watches` first, then `spaces`).
        let mut dropped = Vec::new();
        let made = self.slot_locked(&mut lock(&self.spaces), key, root, (st.dev, st.ino), now, &mut dropped);
        for id in dropped {
            self.forget(id, None);
        }
        made
    }

    fn slot_locked(
        &self,
        spaces: &mut HashMap<PathBuf, Arc<Watched>>,
        key: &Path,
        root: &OwnedFd,
        dev_ino: (u64, u64),
        now: u64,
        dropped: &mut Vec<u64>,
    ) -> Option<Arc<Watched>> {
        if let Some(w) = spaces.get(key) {
            if w.dev_ino == dev_ino {
                w.last_used.store(now, Ordering::Relaxed);
                // Held before `spaces` is released, so no other run's slot can evict it.
                w.in_use.fetch_add(1, Ordering::AcqRel);
                return Some(w.clone());
            }
            if w.in_use.load(Ordering::Acquire) > 0 {
                return None;
            }
            dropped.extend(spaces.remove(key).map(|w| w.id));
        }
        if spaces.len() >= self.settings.workspaces {
            let victim = spaces
                .iter()
                .filter(|(_, w)| w.in_use.load(Ordering::Acquire) == 0)
                .min_by_key(|(_, w)| w.last_used.load(Ordering::Relaxed))
                .map(|(k, _)| k.clone())?;
            dropped.extend(spaces.remove(&victim).map(|w| w.id));
        }
        let root = fsat::dup(root).ok()?;
        let st = (dev_ino.0, dev_ino.1);
        let w = Arc::new(Watched {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            root,
            dev_ino: st,
            pending: Mutex::new(Pending {
                lost: Some(FIRST_USE.into()),
                max: MAX_PENDING.min(self.settings.files_per_workspace()),
                ..Pending::default()
            }),
            tree: Mutex::new(None),
            notify: tokio::sync::Notify::new(),
            in_use: AtomicUsize::new(1),
            last_used: AtomicU64::new(now),
        });
        spaces.insert(key.to_owned(), w.clone());
        Some(w)
    }

    /// Drops the watches of workspace `id` at `below` and beneath it (all of them: `None`).
    fn forget(&self, id: u64, below: Option<&str>) {
        let mut watches = lock(&self.watches);
        self.forget_locked(&mut watches, id, below);
    }

    fn forget_locked(&self, watches: &mut Watches, id: u64, below: Option<&str>) {
        let inside = |rel: &str| match below {
            None => true,
            Some(b) => rel == b || rel.strip_prefix(b).is_some_and(|r| r.starts_with('/')),
        };
        let mut emptied = Vec::new();
        for (wd, owners) in watches.by_wd.iter_mut() {
            owners.retain(|(w, rel)| !(*w == id && inside(rel)));
            if owners.is_empty() {
                emptied.push(*wd);
            }
        }
        for wd in emptied {
            watches.by_wd.remove(&wd);
            // EINVAL: the kernel already dropped it (its directory is gone).
            let _ = self.inotify.rm_watch(wd);
        }
    }

    /// Watches the directory `dir` as `rel` of workspace `id`.
    fn watch(&self, watches: &mut Watches, id: u64, dir: BorrowedFd<'_>, rel: &str) -> Result<(), Lost> {
        if watches.by_wd.len() >= self.settings.watches {
            return Err(format!(
                "the journal's {} watches are all in use ({WATCHES_VAR})",
                self.settings.watches
            ));
        }
        // The descriptor's own directory: /proc/self/fd/N is followed to exactly it.
        let path = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd =
            self.inotify.add_watch(path.as_str(), mask()).map_err(|e| format!("inotify_add_watch: {e}"))?;
        let owners = watches.by_wd.entry(wd).or_default();
        owners.retain(|(w, _)| *w != id);
        owners.push((id, rel.to_owned()));
        Ok(())
    }

    /// Reads every queued event and files it with the workspaces it concerns. Called by the
    /// reader thread and before any measurement, so a measurement sees every event queued
    /// before it started.
    fn drain(&self) {
        let mut watches = lock(&self.watches);
        loop {
            match self.inotify.read_events() {
                Ok(events) if !events.is_empty() => {
                    for e in events {
                        self.file(&mut watches, e);
                    }
                }
                _ => return,
            }
        }
    }

    fn space(&self, id: u64) -> Option<Arc<Watched>> {
        lock(&self.spaces).values().find(|w| w.id == id).cloned()
    }

    fn file(&self, watches: &mut Watches, e: InotifyEvent) {
        let meaning = meaning(e.mask, e.name.is_some());
        if meaning == Meaning::Overflow {
            for w in lock(&self.spaces).values() {
                lock(&w.pending).lose("the kernel's event queue overflowed".into());
                w.notify.notify_one();
            }
            return;
        }
        let owners = watches.by_wd.get(&e.wd).cloned().unwrap_or_default();
        if meaning == Meaning::Ignored {
            watches.by_wd.remove(&e.wd);
            return;
        }
        let name = e.name.as_ref().map(|n| n.to_string_lossy().into_owned());
        for (id, rel) in owners {
            let Some(w) = self.space(id) else { continue };
            let path = match &name {
                Some(n) if rel.is_empty() => n.clone(),
                Some(n) => format!("{rel}/{n}"),
                None => String::new(),
            };
            match meaning {
                Meaning::SelfGone if rel.is_empty() => {
                    lock(&w.pending).lose("the workspace directory itself was moved or removed".into());
                }
                Meaning::SelfChanged if rel.is_empty() => {
                    lock(&w.pending).lose("the workspace directory's own mode or owner changed".into());
                }
                Meaning::Changed => lock(&w.pending).changed(path),
                Meaning::DirLeft => {
                    self.forget_locked(watches, id, Some(&path));
                    lock(&w.pending).changed(path);
                }
                Meaning::DirAppeared => {
                    if let Err(why) = self.watch_new(watches, &w, &path) {
                        lock(&w.pending).lose(why);
                    } else {
                        lock(&w.pending).changed(path);
                    }
                }
                _ => continue,
            }
            w.notify.notify_one();
        }
    }

    /// Watches a directory that appeared at `path` and every directory below it (each
    /// before its names are read), reached by descriptor without following a link.
    fn watch_new(&self, watches: &mut Watches, w: &Watched, path: &str) -> Result<(), Lost> {
        let dir = match fsat::walk_beneath(&w.root, Path::new(path).components()) {
            Ok((fd, _)) => fd,
            // Gone again, or not a directory now: a later event says what happened.
            Err(_) => return Ok(()),
        };
        let mut lost = None;
        crate::exec::files::walk_observed(dir.as_fd(), path, &mut |seen| {
            if let crate::exec::files::Seen::Opened(fd, rel) = seen
                && lost.is_none()
                && let Err(why) = self.watch(watches, w.id, fd, rel)
            {
                lost = Some(why);
            }
        });
        lost.map_or(Ok(()), Err)
    }
}

/// Drains the queue whenever the kernel has events, until the journal is dropped.
fn reader(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let fd = strong.inotify.as_fd().as_raw_fd();
        drop(strong);
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; the descriptor stays open while `inner` lives, and a
        // closed one only makes poll report POLLNVAL, after which the upgrade fails.
        let ready = unsafe { libc::poll(&mut pfd, 1, 1000) };
        let Some(strong) = inner.upgrade() else { return };
        if ready > 0 {
            strong.drain();
        }
    }
}

/// A run's sorted `(createdFiles, modifiedFiles)`.
pub type Changes = (Vec<String>, Vec<String>);

/// One run's view of its workspace's journal (the run, its quota watchdog and its commit
/// share it). Dropping the last clone releases the workspace's slot.
#[derive(Clone)]
pub struct RunWatch(Arc<Run>);

struct Run {
    inner: Arc<Inner>,
    watched: Arc<Watched>,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.watched.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for RunWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunWatch").field("workspace", &self.0.watched.id).finish()
    }
}

impl RunWatch {
    /// The workspace before the run, and whether the journal vouches for it: the kept tree
    /// brought up to date; or (first use, events lost) one walk that also sets the watches
    /// up — journaled from then on unless the tree could not be kept.
    fn start(&self) -> (Measured, bool) {
        let w = &self.0.watched;
        let mut tree = lock(&w.tree);
        let (paths, lost) = self.taken(true);
        if lost.is_none()
            && let Some(t) = tree.as_mut()
        {
            match self.update(t, &paths, true) {
                Ok(()) => {
                    t.begin_run();
                    self.0.inner.journaled.fetch_add(1, Ordering::Relaxed);
                    return (t.measured(), true);
                }
                Err(why) => {
                    tracing::info!(event = "journal_fallback", reason = %why);
                    lock(&w.pending).lose(why);
                    *tree = None;
                    self.0.inner.count(Fallback::Unrepresentable);
                    return (crate::exec::files::measure(w.root.as_fd()), false);
                }
            }
        }
        let first = lost.as_deref() == Some(FIRST_USE);
        self.0.inner.count(if first { Fallback::First } else { Fallback::Lost });
        if !first {
            tracing::info!(event = "journal_fallback", reason = ?lost);
        }
        // Set up again from scratch: the old watches of this workspace go, one walk adds
        // them back (each before its directory is listed) and is the measurement.
        self.0.inner.forget(w.id, None);
        lock(&w.pending).paths.clear();
        let max_files = self.0.inner.settings.files_per_workspace();
        let (m, walked) = Tree::walk(w.root.as_fd(), max_files, &mut |fd, rel| self.watch(fd, rel));
        *tree = match walked {
            Ok(mut t) => {
                t.begin_run();
                Some(t)
            }
            Err(why) => {
                tracing::info!(event = "journal_fallback", reason = %why);
                self.0.inner.forget(w.id, None);
                lock(&w.pending).lose(why);
                None
            }
        };
        (m, tree.is_some())
    }

    /// Every event queued so far filed, then the paths they named (taken) and why the
    /// journal lost track, if it did (`clear`: forgetting that, for a fresh start).
    fn taken(&self, clear: bool) -> (BTreeSet<String>, Option<String>) {
        self.0.inner.drain();
        let mut p = lock(&self.0.watched.pending);
        let paths = std::mem::take(&mut p.paths);
        (paths, if clear { p.lost.take() } else { p.lost.clone() })
    }

    /// Brings `tree` up to date with `paths`, marking for the snapshot what changed unseen
    /// (`every_link`: [`Tree::update`]).
    fn update(&self, tree: &mut Tree, paths: &BTreeSet<String>, every_link: bool) -> Result<(), Lost> {
        let root = self.0.watched.root.as_fd();
        let unseen = tree.update(root, paths, every_link, &mut |fd, rel| self.watch(fd, rel))?;
        lock(&self.0.watched.pending).changed_unseen(unseen);
        Ok(())
    }

    fn watch(&self, fd: BorrowedFd<'_>, rel: &str) -> Result<(), Lost> {
        let mut watches = lock(&self.0.inner.watches);
        self.0.inner.watch(&mut watches, self.0.watched.id, fd, rel)
    }

    /// Completes when an event concerning this workspace has arrived.
    pub async fn changed(&self) {
        self.0.watched.notify.notified().await
    }

    /// The workspace now, from the events so far (blocking): `None` when the journal lost
    /// track, and the caller must walk.
    pub fn measure(&self) -> Option<Measured> {
        let mut tree = lock(&self.0.watched.tree);
        let (paths, lost) = self.taken(false);
        let t = tree.as_mut()?;
        if lost.is_some() {
            return None;
        }
        match self.update(t, &paths, false) {
            Ok(()) => Some(t.measured()),
            Err(why) => {
                lock(&self.0.watched.pending).lose(why);
                None
            }
        }
    }

    /// The run's end, once nothing of the sandbox is left (blocking): the workspace now and
    /// the sorted `(created, modified)` — or, when the journal lost track during the run,
    /// the fingerprints from before it, for the caller's walk to compare with. (A run that
    /// began journaled always has its tree here: only `start` drops it.)
    pub fn finish(&self) -> Result<(Measured, Changes), Fingerprints> {
        let mut guard = lock(&self.0.watched.tree);
        let Some(t) = guard.as_mut() else { return Err(Fingerprints::new()) };
        let (paths, lost) = self.taken(false);
        let updated = match lost {
            Some(why) => Err(why),
            None => self.update(t, &paths, true),
        };
        match updated {
            Ok(()) => Ok((t.measured(), t.changes())),
            Err(why) => {
                let before = t.before_prints();
                lock(&self.0.watched.pending).lose(why);
                self.0.inner.count(Fallback::Lost);
                *guard = None;
                Err(before)
            }
        }
    }

    /// What the commit's snapshot may reuse: the directories of the last snapshot this
    /// journal served and the paths changed since (`None`: events were lost; the snapshot
    /// walks everything and its directories are kept for the next one).
    pub fn reuse(&self) -> Arc<Reuse> {
        self.0.inner.drain();
        let mut p = lock(&self.0.watched.pending);
        let trusted = p.lost.is_none();
        let dirty: BTreeSet<String> = p.since_snapshot.keys().cloned().collect();
        // A nested workspace's lease files decide how its parent's snapshot treats it.
        let nested = dirty.iter().any(|d| d.split('/').any(|c| c == common::layout::COORDINATION_DIR));
        let known = if trusted && !nested { p.known.take() } else { None };
        Arc::new(Reuse::new(known, dirty, p.seq))
    }

    /// Keeps a committed snapshot's directories for the next one.
    pub fn snapshot_done(&self, reuse: &Reuse) {
        let mut p = lock(&self.0.watched.pending);
        if p.lost.is_some() {
            return;
        }
        let upto = reuse.seq();
        p.since_snapshot.retain(|_, seq| *seq > upto);
        p.known = Some(reuse.updated());
    }
}

#[cfg(test)]
mod tests;
