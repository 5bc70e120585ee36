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

use crate::fsat::{self, Stat};
use crate::measure::{Fingerprints, Measured};
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
/// The path text those keep at most (a walk keeps 128 MiB).
const MAX_PENDING_BYTES: usize = 32 << 20;
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
    /// A name appeared (`IN_CREATE`; `replacing`: `IN_MOVED_TO`, which may have replaced
    /// whatever held the name).
    Arrived {
        replacing: bool,
    },
    /// A name went (`IN_DELETE`, `IN_MOVED_FROM`).
    Gone,
    /// A file's content, size or mode changed through the name (`IN_MODIFY`,
    /// `IN_CLOSE_WRITE`, `IN_ATTRIB`): through an open descriptor, that may be an inode the
    /// name no longer holds.
    Written,
    /// A directory's own mode or owner changed: read it (and what is below it) again.
    DirChanged,
    /// A directory appeared at the path: read it (its watches are added as it is read).
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
    } else if dir && mask.contains(F::IN_ATTRIB) {
        Meaning::DirChanged
    } else if mask.contains(F::IN_CREATE) {
        Meaning::Arrived { replacing: false }
    } else if mask.contains(F::IN_MOVED_TO) {
        Meaning::Arrived { replacing: true }
    } else if mask.intersects(F::IN_DELETE | F::IN_MOVED_FROM) {
        Meaning::Gone
    } else if mask.intersects(F::IN_MODIFY | F::IN_ATTRIB | F::IN_CLOSE_WRITE) {
        Meaning::Written
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
    /// The same, by workspace and directory: what a directory that left takes with it is
    /// found by range, not by scanning every watch.
    by_space: HashMap<u64, BTreeMap<String, WatchDescriptor>>,
}

/// One journaled workspace.
struct Watched {
    id: u64,
    /// Its canonical path (the key it is kept under).
    key: PathBuf,
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
    /// Path text held in `paths` and `since_snapshot` (bounded like a walk's).
    bytes: usize,
    /// Since the run began (or, between runs, since the last one ended): names that
    /// appeared, and names removed or replaced (`true`: while holding an inode that
    /// appeared meanwhile, which the tree may never have measured).
    appeared: BTreeSet<String>,
    replaced: BTreeMap<String, bool>,
    /// Names written after they were removed or replaced ([`tree::Tree::update`]).
    suspects: BTreeMap<String, bool>,
}

impl Pending {
    /// Files one event ([`Meaning`]) about `path`.
    fn event(&mut self, meaning: Meaning, path: String) {
        if self.lost.is_some() {
            return;
        }
        match meaning {
            Meaning::Arrived { replacing } => {
                if replacing {
                    let risky = self.appeared.contains(&path);
                    *self.replaced.entry(path.clone()).or_default() |= risky;
                }
                self.appeared.insert(path.clone());
            }
            Meaning::Gone => {
                let risky = self.appeared.contains(&path);
                *self.replaced.entry(path.clone()).or_default() |= risky;
            }
            Meaning::Written => {
                if let Some(risky) = self.replaced.get(&path).copied() {
                    *self.suspects.entry(path.clone()).or_default() |= risky;
                }
            }
            _ => {}
        }
        self.changed(path);
    }

    fn changed(&mut self, path: String) {
        if self.lost.is_some() {
            return;
        }
        self.seq += 1;
        if self.since_snapshot.insert(path.clone(), self.seq).is_none() {
            self.bytes = self.bytes.saturating_add(path.len());
        }
        if !self.paths.contains(&path) {
            self.bytes = self.bytes.saturating_add(path.len());
            self.paths.insert(path);
        }
        let held =
            self.paths.len().max(self.since_snapshot.len()).max(self.replaced.len()).max(self.appeared.len());
        if held > self.max {
            self.lose(format!("more than {} paths changed since the last measurement", self.max));
        } else if self.bytes > MAX_PENDING_BYTES {
            self.lose(format!(
                "more than {MAX_PENDING_BYTES} bytes of changed paths since the last measurement"
            ));
        }
    }

    /// A path no event named changed (another name of a linked file): only snapshots care.
    fn changed_unseen(&mut self, paths: Vec<String>) {
        for path in paths {
            self.seq += 1;
            if self.since_snapshot.insert(path.clone(), self.seq).is_none() {
                self.bytes = self.bytes.saturating_add(path.len());
            }
        }
    }

    /// Forgets the paths a snapshot up to sequence `upto` took. Each path's text is counted
    /// once for `since_snapshot` (and once more while it is in `paths`).
    fn forget_snapshot_paths(&mut self, upto: u64) {
        let mut freed = 0;
        self.since_snapshot.retain(|path, seq| {
            let keep = *seq > upto;
            if !keep {
                freed += path.len();
            }
            keep
        });
        self.bytes = self.bytes.saturating_sub(freed);
    }

    /// Takes the paths to read again (their text no longer held here).
    fn take_paths(&mut self) -> BTreeSet<String> {
        let paths = std::mem::take(&mut self.paths);
        self.bytes = self.bytes.saturating_sub(paths.iter().map(String::len).sum());
        paths
    }

    /// A run's bounds: what appeared or was replaced before it says nothing about it.
    fn new_run(&mut self) {
        self.appeared.clear();
        self.replaced.clear();
        self.suspects.clear();
    }

    fn lose(&mut self, why: String) {
        self.lost.get_or_insert(why);
        self.paths.clear();
        self.since_snapshot.clear();
        self.bytes = 0;
        self.known = None;
        self.new_run();
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
            return (crate::measure::measure(root.as_fd()), None);
        };
        let Some(watched) = inner.slot(key, root) else {
            inner.count(Fallback::NoSlot);
            return (crate::measure::measure(root.as_fd()), None);
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
            key: key.to_owned(),
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
        let Some(mine) = watches.by_space.get_mut(&id) else { return };
        let gone: Vec<(String, WatchDescriptor)> = match below {
            None => std::mem::take(mine).into_iter().collect(),
            Some(b) => {
                let lo = format!("{b}/");
                let mut gone: Vec<(String, WatchDescriptor)> = mine
                    .range(lo.clone()..)
                    .take_while(|(k, _)| k.starts_with(&lo))
                    .map(|(k, w)| (k.clone(), *w))
                    .collect();
                gone.extend(mine.get(b).map(|w| (b.to_owned(), *w)));
                for (rel, _) in &gone {
                    mine.remove(rel);
                }
                gone
            }
        };
        if mine.is_empty() {
            watches.by_space.remove(&id);
        }
        for (rel, wd) in gone {
            let Some(owners) = watches.by_wd.get_mut(&wd) else { continue };
            owners.retain(|(w, r)| !(*w == id && *r == rel));
            if owners.is_empty() {
                watches.by_wd.remove(&wd);
                // EINVAL: the kernel already dropped it (its directory is gone).
                let _ = self.inotify.rm_watch(wd);
            }
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
        let mine = watches.by_space.entry(id).or_default();
        for (_, old) in owners.iter().filter(|(w, _)| *w == id) {
            mine.remove(old);
        }
        owners.retain(|(w, _)| *w != id);
        owners.push((id, rel.to_owned()));
        mine.insert(rel.to_owned(), wd);
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

    /// Paths of workspace `from` that changed with no event naming them (other names of a
    /// linked file) are changes of any journaled workspace nested in it, too: an enclosing
    /// workspace's sandbox can link a nested workspace's file into its own directories and
    /// write it there, where no watch of the nested workspace sees it.
    fn propagate(&self, from: &Watched, paths: &[String]) {
        if paths.is_empty() {
            return;
        }
        let nested: Vec<Arc<Watched>> = lock(&self.spaces)
            .values()
            .filter(|w| w.id != from.id && w.key.starts_with(&from.key) && w.key != from.key)
            .cloned()
            .collect();
        for w in nested {
            let Ok(prefix) = w.key.strip_prefix(&from.key) else { continue };
            let Some(prefix) = prefix.to_str() else { continue };
            let mut p = lock(&w.pending);
            for path in paths {
                if let Some(rel) = path.strip_prefix(prefix).and_then(|r| r.strip_prefix('/')) {
                    p.changed(rel.to_owned());
                }
            }
            drop(p);
            w.notify.notify_one();
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
            for (id, rel) in owners {
                if let Some(mine) = watches.by_space.get_mut(&id)
                    && mine.get(&rel) == Some(&e.wd)
                {
                    mine.remove(&rel);
                }
            }
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
                Meaning::Arrived { .. } | Meaning::Gone | Meaning::Written => {
                    lock(&w.pending).event(meaning, path)
                }
                // Read again when the path is: each directory is watched before it is listed
                // (nothing is walked here, holding every workspace's watches).
                Meaning::DirAppeared | Meaning::DirChanged => lock(&w.pending).changed(path),
                Meaning::DirLeft => {
                    self.forget_locked(watches, id, Some(&path));
                    lock(&w.pending).changed(path);
                }
                _ => continue,
            }
            w.notify.notify_one();
        }
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

/// What the events said, taken for one update of the tree.
struct Taken {
    paths: BTreeSet<String>,
    suspects: BTreeMap<String, bool>,
    lost: Option<String>,
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
        let taken = self.taken(true);
        if taken.lost.is_none()
            && let Some(t) = tree.as_mut()
        {
            match self.update(t, &taken, true) {
                Ok(()) => {
                    t.begin_run();
                    lock(&w.pending).new_run();
                    self.0.inner.journaled.fetch_add(1, Ordering::Relaxed);
                    return (t.measured(), true);
                }
                Err(why) => {
                    tracing::info!(event = "journal_fallback", reason = %why);
                    lock(&w.pending).lose(why);
                    *tree = None;
                    self.0.inner.count(Fallback::Unrepresentable);
                    return (crate::measure::measure(w.root.as_fd()), false);
                }
            }
        }
        let first = taken.lost.as_deref() == Some(FIRST_USE);
        self.0.inner.count(if first { Fallback::First } else { Fallback::Lost });
        if !first {
            tracing::info!(event = "journal_fallback", reason = ?taken.lost);
        }
        // Set up again from scratch: the old watches of this workspace go, one walk adds
        // them back (each before its directory is listed) and is the measurement.
        self.0.inner.forget(w.id, None);
        {
            let mut p = lock(&w.pending);
            p.take_paths();
            p.new_run();
        }
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

    /// Every event queued so far filed, then what they said (taken). `clear_lost`: forget
    /// that the journal lost track, for a fresh start.
    fn taken(&self, clear_lost: bool) -> Taken {
        self.0.inner.drain();
        let mut p = lock(&self.0.watched.pending);
        Taken {
            paths: p.take_paths(),
            suspects: std::mem::take(&mut p.suspects),
            lost: if clear_lost { p.lost.take() } else { p.lost.clone() },
        }
    }

    /// Brings `tree` up to date with what was taken, marking for the snapshot what changed
    /// unseen (`every_link`: [`Tree::update`]).
    fn update(&self, tree: &mut Tree, taken: &Taken, every_link: bool) -> Result<(), Lost> {
        let root = self.0.watched.root.as_fd();
        let unseen =
            tree.update(root, &taken.paths, &taken.suspects, every_link, &mut |fd, rel| self.watch(fd, rel))?;
        self.0.inner.propagate(&self.0.watched, &unseen);
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
        let taken = self.taken(false);
        let t = tree.as_mut()?;
        if taken.lost.is_some() {
            return None;
        }
        match self.update(t, &taken, false) {
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
        let taken = self.taken(false);
        let updated = match &taken.lost {
            Some(why) => Err(why.clone()),
            None => self.update(t, &taken, true),
        };
        match updated {
            Ok(()) => {
                lock(&self.0.watched.pending).new_run();
                Ok((t.measured(), t.changes()))
            }
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
    /// journal served and the paths changed since (none known: events were lost; the
    /// snapshot walks everything and its directories are kept for the next one). The tree
    /// is brought up to date first — a run that timed out or was cancelled never reached
    /// [`RunWatch::finish`] — so the other names of linked files it wrote are marked too
    /// (not every linked file again: the run's start and end read those).
    pub fn reuse(&self) -> Arc<Reuse> {
        {
            let mut guard = lock(&self.0.watched.tree);
            let taken = self.taken(false);
            if let Some(t) = guard.as_mut()
                && taken.lost.is_none()
                && let Err(why) = self.update(t, &taken, false)
            {
                lock(&self.0.watched.pending).lose(why);
                *guard = None;
            }
            if guard.is_none() {
                lock(&self.0.watched.pending).lose("the tree is not kept".into());
            }
        }
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
        p.forget_snapshot_paths(upto);
        p.known = Some(reuse.updated());
    }
}

/// The writer's view of the journal: what a commit's snapshot may reuse.
impl crate::writer::SnapshotJournal for RunWatch {
    fn reuse(&self) -> Arc<Reuse> {
        RunWatch::reuse(self)
    }

    fn snapshot_done(&self, reuse: &Reuse) {
        RunWatch::snapshot_done(self, reuse)
    }
}

#[cfg(test)]
mod tests;
