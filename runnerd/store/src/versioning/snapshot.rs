//! Workspace snapshots as `WorkspaceTree` records (§4 of the format), plus incremental
//! hashing: a file whose (dev, ino, size, mtime, ctime) match what was hashed before, and
//! whose blob is still in the data pool, reuses its `DataRef` without being read again.
//!
//! The cache can only shortcut work, never change a digest: it is keyed and checked on the
//! same stat fields the change detection relies on, and entries are only kept for files whose
//! last change (ctime) lies clearly before they were hashed. A file written again within the
//! same timestamp tick could otherwise keep size, mtime and ctime (git's "racy clean" problem).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{CStr, CString, OsString};
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::names::b64url_encode;
use super::store::Store;
use super::{Pool, Ref, VersionError, io_err};
use crate::fsat::{Stat, open_at, readlink_at};

/// Beyond this many files the cache is dropped wholesale (about 200 MB at most).
const CACHE_LIMIT: usize = 1_000_000;
/// A file is cached only if its ctime is this much older than the start of its hashing: more
/// than the timestamp granularity of any filesystem a workspace lives on (FAT: 2 s).
const RACY_MARGIN_NS: i128 = 2_000_000_000;

/// The stat fields a cached content ref is valid for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stamp {
    fn of(m: &Stat) -> Stamp {
        Stamp { size: m.size, mtime_ns: m.mtime_ns, ctime_ns: m.ctime_ns }
    }
}

/// The incremental-hashing cache, (dev, ino) → stamp and content; shared by all snapshots.
#[derive(Default)]
pub(crate) struct FileCache {
    entries: Mutex<HashMap<(u64, u64), (Stamp, Ref)>>,
    /// SHA-256 of a directory's entries (binary form) → its `WorkspaceTree` record, so an
    /// unchanged directory costs no JSON, no canonicalisation and no record write.
    trees: Mutex<HashMap<[u8; 32], Ref>>,
    hashed: AtomicU64,
}

impl FileCache {
    pub(crate) fn clear(&self) {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.trees.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Drops the entries whose object is `gone` (the collector deleted it).
    pub(crate) fn forget(&self, gone: impl Fn(&Ref) -> bool) {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, (_, r)| !gone(r));
        self.trees.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, r| !gone(r));
    }

    fn tree(&self, fingerprint: &[u8; 32]) -> Option<Ref> {
        self.trees.lock().unwrap_or_else(|e| e.into_inner()).get(fingerprint).cloned()
    }

    fn store_tree(&self, fingerprint: [u8; 32], r: Ref) {
        let mut trees = self.trees.lock().unwrap_or_else(|e| e.into_inner());
        if trees.len() >= CACHE_LIMIT {
            trees.clear();
        }
        trees.insert(fingerprint, r);
    }

    fn lookup(&self, key: (u64, u64), stamp: Stamp) -> Option<Ref> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.get(&key).filter(|(s, _)| *s == stamp).map(|(_, r)| r.clone())
    }

    fn store(&self, key: (u64, u64), entry: Option<(Stamp, Ref)>) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        match entry {
            Some(entry) => {
                if entries.len() >= CACHE_LIMIT {
                    entries.clear();
                }
                entries.insert(key, entry);
            }
            None => {
                entries.remove(&key);
            }
        }
    }
}

/// What a snapshot knows beyond the directory it walks (ours; nothing here changes a byte of
/// what is written for a tree the original would accept).
#[derive(Debug, Clone, Default)]
pub struct SnapshotScope {
    /// The workspace's canonical path. With it the walk recognises nested workspaces (a
    /// subdirectory whose lease database `<H>.sqlite` sits in its parent's
    /// `.workspace-coordination`): their FIFOs, sockets, devices, unreadable or over-deep
    /// parts are left out of this snapshot instead of failing it — they are the nested
    /// workspace's to answer for, in its own commits.
    pub canonical: Option<PathBuf>,
    /// Refuses, before storing anything more, a tree whose regular files add up to more than
    /// this many bytes (0: no limit), so a run over its quota (sparse files included, which
    /// are written out in full) cannot fill the version store.
    pub max_bytes: u64,
    /// An earlier snapshot's directories and what changed since ([`Reuse`]).
    pub reuse: Option<std::sync::Arc<Reuse>>,
}

/// What a snapshot may take from an earlier one of the same workspace, and what it walked
/// (issue #31): the change journal knows which paths changed since that snapshot, so a
/// directory with no changed path at or below it keeps its tree ref (and the bytes below
/// it, for [`SnapshotScope::max_bytes`]) without being opened. Refs are content addresses:
/// a reused one is exactly what walking the unchanged directory would give.
#[derive(Debug, Default)]
pub struct Reuse {
    /// Each directory (workspace-relative, `""` the root) of the earlier snapshot → its tree
    /// and the bytes of the regular files below it. `None`: walk everything.
    known: Mutex<Option<BTreeMap<String, (Ref, u64)>>>,
    /// Paths changed since (files, or directories that appeared, went or changed mode).
    dirty: BTreeSet<String>,
    /// The journal's sequence number when `dirty` was taken.
    seq: u64,
    /// What this snapshot walked.
    walked: Mutex<Vec<(String, Ref, u64)>>,
}

impl Reuse {
    pub fn new(known: Option<BTreeMap<String, (Ref, u64)>>, dirty: BTreeSet<String>, seq: u64) -> Reuse {
        Reuse { known: Mutex::new(known), dirty, seq, walked: Mutex::default() }
    }

    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The earlier tree of the directory `rel`, if nothing at or below it changed; `fresh`:
    /// it lies below a path that changed (appeared, moved, changed mode).
    fn reusable(&self, rel: &str, fresh: bool) -> Option<(Ref, u64)> {
        if fresh || self.dirty.contains(rel) {
            return None;
        }
        let below = if rel.is_empty() {
            !self.dirty.is_empty()
        } else {
            let lo = format!("{rel}/");
            self.dirty.range(lo.clone()..).next().is_some_and(|d| d.starts_with(&lo))
        };
        if below {
            return None;
        }
        self.known.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?.get(rel).cloned()
    }

    fn walked(&self, rel: &Path, tree: &Ref, bytes: u64) {
        if let Some(rel) = rel.to_str() {
            self.walked.lock().unwrap_or_else(|e| e.into_inner()).push((rel.to_owned(), tree.clone(), bytes));
        }
    }

    /// The directories of this snapshot, for the next one: the earlier ones less every
    /// changed path and what lay below it, plus what this one walked.
    pub fn updated(&self) -> BTreeMap<String, (Ref, u64)> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        for d in &self.dirty {
            let lo = format!("{d}/");
            let below: Vec<String> = known
                .range(lo.clone()..)
                .take_while(|(k, _)| k.starts_with(&lo))
                .map(|(k, _)| k.clone())
                .collect();
            for k in below {
                known.remove(&k);
            }
            known.remove(d);
        }
        for (rel, tree, bytes) in self.walked.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            known.insert(rel, (tree, bytes));
        }
        known
    }
}

/// One snapshot's walk: where it started, its scope, and the bytes of files seen so far.
struct Walk<'a> {
    root: &'a Path,
    scope: &'a SnapshotScope,
    bytes: Cell<u64>,
}

impl Walk<'_> {
    /// Counts a directory's regular files before any of them is stored.
    fn charge(&self, bytes: u64) -> Result<(), VersionError> {
        let total = self.bytes.get().saturating_add(bytes);
        self.bytes.set(total);
        match self.scope.max_bytes {
            0 => Ok(()),
            limit if total > limit => Err(VersionError::OverQuota { limit }),
            _ => Ok(()),
        }
    }

    /// Whether the subdirectory `name` of the directory at `rel` is a nested workspace.
    fn is_nested(&self, coordination: Option<&OwnedFd>, rel: &Path, name: &OsString) -> bool {
        let (Some(coord), Some(canonical)) = (coordination, &self.scope.canonical) else { return false };
        let hex = crate::coordination::path_hex(&canonical.join(rel).join(name));
        let Ok(lock) = CString::new(format!("{hex}.sqlite")) else { return false };
        Stat::at(coord, &lock).is_ok_and(|st| st.kind() == libc::S_IFREG)
    }

    /// The coordination directory among a directory's entries (`listed`), opened, when
    /// nested workspaces are looked for ([`SnapshotScope::canonical`]).
    fn coordination_dir(&self, dir: &OwnedFd, listed: &[(OsString, CString, Stat)]) -> Option<OwnedFd> {
        listed
            .iter()
            .find(|(name, _, st)| name.as_bytes() == COORDINATION_DIR && st.kind() == libc::S_IFDIR)
            .filter(|_| self.scope.canonical.is_some())
            .and_then(|(_, cname, _)| crate::fsat::open_dir_at(dir, cname).ok())
    }

    /// That the entry `name` of `dir` (at `rel`) is still what its `lstat` (`meta`) was: the
    /// same inode, unchanged since.
    fn still(&self, dir: &OwnedFd, name: &CStr, meta: &Stat, rel: &Path) -> Result<(), VersionError> {
        let after = Stat::at(dir, name).map_err(self.err("inspect", rel))?;
        if after.ino != meta.ino || after.dev != meta.dev || after.ctime_ns != meta.ctime_ns {
            return Err(VersionError::Changed);
        }
        Ok(())
    }

    /// The directory's entries, raw names in memcmp order, each with its `lstat`.
    fn list(&self, dir: &OwnedFd, rel: &Path) -> Result<Vec<(OsString, CString, Stat)>, VersionError> {
        let mut names = crate::fsat::names(dir).map_err(self.err("read the directory", rel))?;
        names.sort_by(|(a, _), (b, _)| a.as_bytes().cmp(b.as_bytes()));
        let mut listed = Vec::with_capacity(names.len());
        for (name, cname) in names {
            let meta = Stat::at(dir, &cname).map_err(self.err("inspect", &rel.join(&name)))?;
            listed.push((name, cname, meta));
        }
        Ok(listed)
    }

    /// An error at `rel`: vanished or swapped (changed), unreadable (the workspace's content,
    /// named), or the host's I/O failure.
    fn err(&self, action: &'static str, rel: &Path) -> impl FnOnce(io::Error) -> VersionError + use<'_> {
        let rel = rel.to_path_buf();
        move |e| match e.raw_os_error() {
            Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR) => VersionError::Changed,
            Some(libc::EACCES | libc::EPERM) => VersionError::Unreadable { path: shown(&rel), source: e },
            _ => VersionError::Io { action, path: self.root.join(rel), source: e },
        }
    }
}

/// A workspace-relative path for an error message; the tail of a very long one.
fn shown(rel: &Path) -> String {
    const MAX: usize = 300;
    let text = rel.to_string_lossy();
    if text.is_empty() {
        return ".".to_owned();
    }
    match text.char_indices().rev().nth(MAX - 1) {
        Some((cut, _)) => format!("…{}", &text[cut..]),
        None => text.into_owned(),
    }
}

impl Store {
    /// Snapshots the directory `root` into `WorkspaceTree` records and returns the root tree's
    /// ref. The caller holds the workspace's writer lease; concurrent changes that are
    /// noticed fail with `Workspace changed during snapshot`.
    ///
    /// A trailing slash is kept, so `lstat` sees the directory a final symlink names: runnerd
    /// passes `/proc/self/fd/N/` to snapshot the directory it pinned, not whatever the path
    /// names by now.
    pub fn snapshot(&self, root: &Path) -> Result<Ref, VersionError> {
        self.snapshot_scoped(root, &SnapshotScope::default())
    }

    /// [`Store::snapshot`] within a [`SnapshotScope`].
    pub fn snapshot_scoped(&self, root: &Path, scope: &SnapshotScope) -> Result<Ref, VersionError> {
        let trailing_slash = root.as_os_str().as_encoded_bytes().ends_with(b"/");
        let mut root = lexical_absolute(root).map_err(io_err("resolve the workspace root", root))?;
        if trailing_slash && root != Path::new("/") {
            root.as_mut_os_string().push("/");
        }
        let meta = fs::symlink_metadata(&root).map_err(io_err("inspect the workspace root", &root))?;
        if !meta.file_type().is_dir() {
            return Err(VersionError::RootNotDirectory);
        }
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&root)
            .map_err(changed_or_io("open", &root))?;
        let dir = OwnedFd::from(dir);
        let before = Stat::of_fd(&dir).map_err(io_err("inspect the workspace root", &root))?;
        if before.ino != meta.ino() || before.dev != meta.dev() {
            return Err(VersionError::Changed);
        }
        let walk = Walk { root: &root, scope, bytes: Cell::new(0) };
        if let Some((tree, bytes)) = scope.reuse.as_ref().and_then(|r| r.reusable("", false)) {
            walk.charge(bytes)?;
            return Ok(tree);
        }
        self.snapshot_dir(&walk, &dir, Path::new(""), before, 0, (false, false))
    }

    /// Hashes the files of one directory that the cache cannot serve on several threads,
    /// before the ordered pass takes each result (only if the file's (dev, ino) and stamp
    /// are still what was hashed; errors are left for the ordered pass to meet and report).
    /// A first commit of a large workspace is where this pays: the cores hash and the
    /// fsyncs overlap. Nothing to hash, nothing spent.
    fn hash_misses(&self, dir: &OwnedFd, listed: &[(OsString, CString, Stat)]) -> Prehashed {
        let results: Prehashed = Mutex::default();
        let work: Vec<&(OsString, CString, Stat)> = listed
            .iter()
            .filter(|(_, _, st)| {
                st.kind() == libc::S_IFREG
                    && st.size > 0
                    && self.cache.lookup((st.dev, st.ino), Stamp::of(st)).is_none()
            })
            .collect();
        if work.len() < PREHASH_MIN_FILES {
            return results;
        }
        let workers = super::cores().min(PREHASH_THREADS);
        if workers < 2 {
            return results;
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    while let Some((_, name, lstat)) = work.get(next.fetch_add(1, Ordering::Relaxed)) {
                        if let Ok(Some(done)) = self.hash_file(dir, name, lstat) {
                            results
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert((lstat.dev, lstat.ino), done);
                        }
                    }
                });
            }
        });
        results
    }

    /// How many regular files snapshots have actually opened and hashed (cache misses).
    pub fn files_hashed(&self) -> u64 {
        self.cache.hashed.load(Ordering::Relaxed)
    }

    /// One directory, by descriptor: children first (depth-first, raw names in memcmp
    /// order), then its record. `rel` (workspace-relative) only names things in errors.
    /// `nested`: this directory lies inside a nested workspace ([`SnapshotScope::canonical`]);
    /// `fresh`: at or below a path changed since the snapshot [`SnapshotScope::reuse`] knows.
    fn snapshot_dir(
        &self,
        walk: &Walk<'_>,
        dir: &OwnedFd,
        rel: &Path,
        before: Stat,
        depth: usize,
        (nested, fresh): (bool, bool),
    ) -> Result<Ref, VersionError> {
        let start_bytes = walk.bytes.get();
        // Code in a sandbox can nest directories without limit; the walk recurses (and holds
        // a descriptor) per level, so it stops long before a thread's stack would.
        if depth >= MAX_DEPTH {
            return Err(VersionError::TooDeep { limit: MAX_DEPTH, path: shown(rel) });
        }
        let listed = walk.list(dir, rel)?;
        // Counted before anything of this directory is stored.
        walk.charge(
            listed.iter().filter(|(_, _, st)| st.kind() == libc::S_IFREG).map(|(_, _, st)| st.size).sum(),
        )?;
        let coordination = walk.coordination_dir(dir, &listed);
        let prehashed = self.hash_misses(dir, &listed);
        let mut entries = Vec::with_capacity(listed.len());
        let mut fingerprint = Sha256::new();
        for (name, cname, meta) in listed {
            let child_rel = rel.join(&name);
            let (entry, recheck) = match meta.kind() {
                libc::S_IFLNK => {
                    let target =
                        readlink_at(dir, &cname).map_err(walk.err("read the symlink", &child_rel))?;
                    (Entry::Symlink { name: name.as_bytes().to_vec(), target }, true)
                }
                libc::S_IFDIR => {
                    let inner = nested || walk.is_nested(coordination.as_ref(), rel, &name);
                    let reuse = walk.scope.reuse.as_deref();
                    let child_fresh =
                        fresh || reuse.zip(child_rel.to_str()).is_some_and(|(r, c)| r.dirty.contains(c));
                    let subdir = (cname.as_c_str(), meta);
                    let Some((tree, recheck)) =
                        self.snapshot_subdir(walk, dir, subdir, &child_rel, depth, (inner, child_fresh))?
                    else {
                        continue;
                    };
                    (Entry::Dir { name: name.as_bytes().to_vec(), tree }, recheck)
                }
                libc::S_IFREG => {
                    let (content, hashed) =
                        match self.snapshot_file(walk, dir, &cname, &child_rel, &meta, &prehashed) {
                            Err(VersionError::Unreadable { .. }) if nested => continue,
                            other => other?,
                        };
                    let entry =
                        Entry::File { name: name.as_bytes().to_vec(), content, exec: meta.mode & 0o111 };
                    // A file served from the cache was not read: the stat just taken is the
                    // observation, and re-taking it would only double the cost of a walk.
                    (entry, hashed)
                }
                _ if nested => continue,
                _ => return Err(VersionError::SpecialFile { path: shown(&child_rel) }),
            };
            if recheck {
                walk.still(dir, &cname, &meta, &child_rel)?;
            }
            entry.fingerprint(&mut fingerprint);
            entries.push(entry);
        }
        let after = Stat::of_fd(dir).map_err(walk.err("inspect", rel))?;
        if after.ino != before.ino || after.ctime_ns != before.ctime_ns {
            return Err(VersionError::Changed);
        }
        let record = self.tree_record(fingerprint.finalize().into(), &entries)?;
        if let Some(reuse) = &walk.scope.reuse
            && !nested
        {
            reuse.walked(rel, &record, walk.bytes.get() - start_bytes);
        }
        Ok(record)
    }

    /// A subdirectory (`name` and its `lstat` in `dir`; `rel` names it) of a directory at
    /// `depth`: its tree, and whether its entry must be checked unchanged afterwards (not
    /// when the tree is the one the change journal's last snapshot gave it, reused unopened).
    /// `None`: left out, inside a nested workspace (`inner`), as what a snapshot cannot take.
    fn snapshot_subdir(
        &self,
        walk: &Walk<'_>,
        dir: &OwnedFd,
        (name, meta): (&CStr, Stat),
        rel: &Path,
        depth: usize,
        (inner, fresh): (bool, bool),
    ) -> Result<Option<(Ref, bool)>, VersionError> {
        // Inside a nested workspace what a snapshot cannot take is left out.
        if inner && depth + 1 >= MAX_DEPTH {
            return Ok(None);
        }
        let known = match (walk.scope.reuse.as_deref(), rel.to_str()) {
            (Some(r), Some(c)) if !inner => r.reusable(c, fresh),
            _ => None,
        };
        if let Some((tree, bytes)) = known {
            walk.charge(bytes)?;
            return Ok(Some((tree, false)));
        }
        let child = match open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .map_err(walk.err("open", rel))
        {
            Err(VersionError::Unreadable { .. }) if inner => return Ok(None),
            other => other?,
        };
        let opened = Stat::of_fd(&child).map_err(io_err("inspect", walk.root.join(rel)))?;
        if opened.ino != meta.ino || opened.dev != meta.dev {
            return Err(VersionError::Changed);
        }
        match self.snapshot_dir(walk, &child, rel, meta, depth + 1, (inner, fresh)) {
            Err(VersionError::Unreadable { .. }) if inner => Ok(None),
            other => other.map(|tree| Some((tree, true))),
        }
    }

    /// The `WorkspaceTree` record of `entries`: the one a directory with the same
    /// `fingerprint` got before, or stored now.
    fn tree_record(&self, fingerprint: [u8; 32], entries: &[Entry]) -> Result<Ref, VersionError> {
        if let Some(known) = self.cache.tree(&fingerprint) {
            return Ok(known);
        }
        let entries: Vec<Value> = entries.iter().map(Entry::to_value).collect();
        let record = self.put_record("WorkspaceTree", json!({ "entries": Value::Array(entries) }))?;
        self.cache.store_tree(fingerprint, record.clone());
        Ok(record)
    }

    /// One regular file's content ref (and whether it was read): from the cache when provably
    /// unchanged, otherwise opened without following links or blocking, streamed into the
    /// data pool and checked stable.
    fn snapshot_file(
        &self,
        walk: &Walk<'_>,
        dir: &OwnedFd,
        name: &CStr,
        rel: &Path,
        lstat: &Stat,
        prehashed: &Prehashed,
    ) -> Result<(Ref, bool), VersionError> {
        let key = (lstat.dev, lstat.ino);
        // A cached blob is not checked here: the commit's closure check stats every blob,
        // and a missing one makes the writer forget the caches and snapshot again.
        if let Some(cached) = self.cache.lookup(key, Stamp::of(lstat)) {
            return Ok((cached, false));
        }
        // An empty file is the empty blob: no need to open it. This matters beyond speed:
        // a nested workspace's lease database (an empty SQLite file inside this tree) must
        // never be opened and closed by this process, because closing any descriptor of a
        // file drops every POSIX lock the process holds on it, the lease's included.
        if lstat.size == 0 {
            return Ok((self.put(Pool::Data, b"", super::OCTET_STREAM)?, false));
        }
        let early = prehashed.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
        if let Some((_, content)) = early.filter(|(stamp, _)| *stamp == Stamp::of(lstat)) {
            return Ok((content, true));
        }
        match self.hash_file(dir, name, lstat).map_err(|e| match e {
            HashError::Changed => VersionError::Changed,
            HashError::Open(e) => walk.err("open", rel)(e),
            HashError::Stat(e) => io_err("stat", walk.root.join(rel))(e),
            HashError::Store(e) => e,
        })? {
            Some((_, content)) => Ok((content, true)),
            None => Err(VersionError::Changed),
        }
    }

    /// Opens a regular file without following links or blocking, streams it into the data
    /// pool and checks it stayed the file `lstat` saw; caches the result when settled.
    /// `Ok(None)`: it changed while being read.
    fn hash_file(&self, dir: &OwnedFd, name: &CStr, lstat: &Stat) -> Result<Option<(Stamp, Ref)>, HashError> {
        let started = now_ns();
        let fd = open_at(dir, name, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .map_err(HashError::Open)?;
        let mut file = fs::File::from(fd);
        let opened = Stat::of_fd(&file).map_err(HashError::Stat)?;
        if opened.kind() != libc::S_IFREG || opened.ino != lstat.ino || opened.dev != lstat.dev {
            return Err(HashError::Changed);
        }
        self.cache.hashed.fetch_add(1, Ordering::Relaxed);
        // Never more than one byte past what was counted: a file still growing (another
        // workspace's sandbox may write into this tree) cannot stream without bound into the
        // store; the size check below then calls it changed.
        let content = self
            .put_stream(Pool::Data, &mut io::Read::take(&mut file, lstat.size.saturating_add(1)))
            .map_err(HashError::Store)?;
        let done = Stat::of_fd(&file).map_err(HashError::Stat)?;
        let stamp = Stamp::of(&done);
        if stamp != Stamp::of(&opened) || content.size != stamp.size {
            return Ok(None);
        }
        let settled = stamp.ctime_ns + RACY_MARGIN_NS < started;
        self.cache.store((lstat.dev, lstat.ino), settled.then(|| (stamp, content.clone())));
        Ok(Some((stamp, content)))
    }
}

/// Results of a directory's parallel hashing, by (dev, ino).
type Prehashed = Mutex<HashMap<(u64, u64), (Stamp, Ref)>>;

/// Directory levels a snapshot walks at most.
pub const MAX_DEPTH: usize = 256;

/// Where a workspace's lease files live, in its parent (versioning reference §6.1).
const COORDINATION_DIR: &[u8] = common::layout::COORDINATION_DIR.as_bytes();

/// Threads that hash a first snapshot; more would only queue on the disk.
const PREHASH_THREADS: usize = 4;
/// Below this many files to hash in a directory, the ordered pass alone is as quick.
const PREHASH_MIN_FILES: usize = 8;

enum HashError {
    Changed,
    Open(io::Error),
    Stat(io::Error),
    Store(VersionError),
}

/// One directory entry, turned into JSON only when its directory's record must be written.
enum Entry {
    File { name: Vec<u8>, content: Ref, exec: u32 },
    Dir { name: Vec<u8>, tree: Ref },
    Symlink { name: Vec<u8>, target: Vec<u8> },
}

impl Entry {
    /// Adds the entry to its directory's fingerprint ([`fingerprint_entry`]).
    fn fingerprint(&self, h: &mut Sha256) {
        match self {
            Entry::File { name, content, exec } => {
                fingerprint_entry(h, b'f', name, &ref_bytes(content), *exec)
            }
            Entry::Dir { name, tree } => fingerprint_entry(h, b'd', name, &ref_bytes(tree), 0),
            Entry::Symlink { name, target } => fingerprint_entry(h, b'l', name, target, 0),
        }
    }

    fn to_value(&self) -> Value {
        match self {
            Entry::File { name, content, exec } => json!({
                "content": content.to_value(),
                "executable": exec,
                "name": b64url_encode(name),
                "type": "file",
            }),
            Entry::Dir { name, tree } => {
                json!({ "name": b64url_encode(name), "tree": tree.to_value(), "type": "directory" })
            }
            Entry::Symlink { name, target } => {
                json!({ "name": b64url_encode(name), "target": b64url_encode(target), "type": "symlink" })
            }
        }
    }
}

/// A ref's identity for fingerprints: every field, length-delimited, without formatting JSON.
fn ref_bytes(r: &Ref) -> Vec<u8> {
    let mut out = Vec::with_capacity(r.digest.len() + r.media_type.len() + 24);
    out.extend_from_slice(r.pool.as_str().as_bytes());
    out.push(0);
    out.extend_from_slice(r.digest.as_bytes());
    out.push(0);
    out.extend_from_slice(&r.size.to_le_bytes());
    out.extend_from_slice(r.media_type.as_bytes());
    out
}

/// Feeds one entry into a directory's fingerprint: kind, length-prefixed name and payload
/// (the content or tree ref's text, or the symlink target), and the exec bits.
fn fingerprint_entry(h: &mut Sha256, kind: u8, name: &[u8], payload: &[u8], exec: u32) {
    h.update([kind]);
    h.update((name.len() as u64).to_le_bytes());
    h.update(name);
    h.update((payload.len() as u64).to_le_bytes());
    h.update(payload);
    h.update(exec.to_le_bytes());
}

/// Node's `path.resolve`: absolute, with `.` and `..` removed textually (symlinks untouched).
fn lexical_absolute(path: &Path) -> io::Result<PathBuf> {
    let mut out = PathBuf::new();
    for part in std::path::absolute(path)?.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Ok(out)
}

fn now_ns() -> i128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as i128).unwrap_or(0)
}

/// Something inside the workspace that vanished or turned into a symlink (ELOOP from
/// O_NOFOLLOW) between listing and use was changed concurrently.
fn changed_or_io(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> VersionError {
    let path = path.to_path_buf();
    move |e| match e.raw_os_error() {
        Some(libc::ENOENT | libc::ELOOP | libc::ENOTDIR) => VersionError::Changed,
        _ => VersionError::Io { action, path, source: e },
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::time::Duration;

    use super::*;
    use crate::versioning::names::b64url_decode;
    use crate::versioning::testutil::{blob_text, example_workspace, root_tree_ref, temp_store, write_mode};
    use crate::versioning::{OCTET_STREAM, RECORD_MEDIA_TYPE};

    const EMPTY_TREE: &str =
        r#"{"dependencies":[],"kind":"WorkspaceTree","schemaVersion":1,"value":{"entries":[]}}"#;
    const DATA_TREE: &str = r#"{"dependencies":[{"digest":"sha256:492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470","mediaType":"application/octet-stream","pool":"data","size":8}],"kind":"WorkspaceTree","schemaVersion":1,"value":{"entries":[{"content":{"digest":"sha256:492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470","mediaType":"application/octet-stream","pool":"data","size":8},"executable":0,"name":"eC5jc3Y","type":"file"}]}}"#;
    const ROOT_TREE: &str = r#"{"dependencies":[{"digest":"sha256:0389cba415fca9fe23c658bb86a70590e57fb5d3ad7cd3ef38f72991cd7c5409","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":83},{"digest":"sha256:29339eee4a81e3d32b49ea8ba160b2a739a5403deb5ced6ffac0fbe09ba15bb7","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":433},{"digest":"sha256:299001868fb8c02fd431c336c6d058f5558c5dff5b5af5e6fe04b870a6a9cbba","mediaType":"application/octet-stream","pool":"data","size":18},{"digest":"sha256:5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03","mediaType":"application/octet-stream","pool":"data","size":6}],"kind":"WorkspaceTree","schemaVersion":1,"value":{"entries":[{"content":{"digest":"sha256:5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03","mediaType":"application/octet-stream","pool":"data","size":6},"executable":0,"name":"UkVBRE1FLm1k","type":"file"},{"name":"ZGF0YQ","tree":{"digest":"sha256:29339eee4a81e3d32b49ea8ba160b2a739a5403deb5ced6ffac0fbe09ba15bb7","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":433},"type":"directory"},{"name":"ZW1wdHk","tree":{"digest":"sha256:0389cba415fca9fe23c658bb86a70590e57fb5d3ad7cd3ef38f72991cd7c5409","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":83},"type":"directory"},{"name":"bGluaw","target":"UkVBRE1FLm1k","type":"symlink"},{"content":{"digest":"sha256:299001868fb8c02fd431c336c6d058f5558c5dff5b5af5e6fe04b870a6a9cbba","mediaType":"application/octet-stream","pool":"data","size":18},"executable":73,"name":"cnVuLnNo","type":"file"}]}}"#;

    fn tree_ref(hex: &str, size: u64) -> Ref {
        Ref::new(Pool::AgentState, hex, size, RECORD_MEDIA_TYPE)
    }

    fn entries(store: &Store, tree: &Ref) -> Vec<Value> {
        store.read_record(tree, Some("WorkspaceTree")).unwrap().value["entries"].as_array().unwrap().clone()
    }

    #[test]
    fn example_workspace_matches_the_golden_vectors() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        example_workspace(ws.path());
        let root = store.snapshot(ws.path()).unwrap();
        assert_eq!(root, root_tree_ref());
        assert_eq!(blob_text(&store, &root), ROOT_TREE);
        let empty = tree_ref("0389cba415fca9fe23c658bb86a70590e57fb5d3ad7cd3ef38f72991cd7c5409", 83);
        assert_eq!(blob_text(&store, &empty), EMPTY_TREE);
        let data = tree_ref("29339eee4a81e3d32b49ea8ba160b2a739a5403deb5ced6ffac0fbe09ba15bb7", 433);
        assert_eq!(blob_text(&store, &data), DATA_TREE);
        for (hex, bytes) in [
            ("5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03", &b"hello\n"[..]),
            ("492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470", b"a,b\n1,2\n"),
            ("299001868fb8c02fd431c336c6d058f5558c5dff5b5af5e6fe04b870a6a9cbba", b"#!/bin/sh\necho hi\n"),
        ] {
            let r = Ref::new(Pool::Data, hex, bytes.len() as u64, OCTET_STREAM);
            assert_eq!(store.read(&r).unwrap(), bytes);
        }
        // root + 2 subtrees + 3 file blobs.
        assert_eq!(store.validate_closure(&root).unwrap(), 6);
    }

    #[test]
    fn names_are_raw_bytes_in_memcmp_order_and_symlinks_are_not_followed() {
        let (_data, store) = temp_store();
        let parent = tempfile::TempDir::new().unwrap();
        let ws = parent.path().join("ws");
        fs::create_dir(&ws).unwrap();
        for name in ["A", "a", "\u{e9}", "e\u{301}"] {
            fs::write(ws.join(name), name).unwrap();
        }
        fs::write(ws.join(std::ffi::OsStr::from_bytes(b"\xff")), b"raw").unwrap();
        fs::create_dir(ws.join("empty")).unwrap();
        symlink("../outside", ws.join("link")).unwrap();
        let tree = store.snapshot(&ws).unwrap();
        let entries = entries(&store, &tree);
        assert_eq!(entries.len(), 7);
        let names: Vec<Vec<u8>> =
            entries.iter().map(|e| b64url_decode(e["name"].as_str().unwrap()).unwrap()).collect();
        let expected: Vec<&[u8]> =
            vec![b"A", b"a", b"empty", b"e\xcc\x81", b"link", "\u{e9}".as_bytes(), b"\xff"];
        assert_eq!(names, expected);
        assert!(entries.iter().any(|e| e["name"] == "_w"));
        let link = entries.iter().find(|e| e["type"] == "symlink").unwrap();
        assert_eq!(b64url_decode(link["target"].as_str().unwrap()).unwrap(), b"../outside");
        assert_eq!(store.snapshot(&ws).unwrap(), tree);
    }

    #[test]
    fn mode_and_content_change_the_digest_but_times_do_not() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        let file = ws.path().join("f.txt");
        write_mode(&file, b"first", 0o644);
        let base = store.snapshot(ws.path()).unwrap();

        let old = fs::metadata(&file).unwrap().modified().unwrap();
        File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(old - Duration::from_secs(3600))
            .unwrap();
        assert_eq!(store.snapshot(ws.path()).unwrap(), base, "utimes alone");

        fs::set_permissions(&file, fs::Permissions::from_mode(0o755)).unwrap();
        let exec = store.snapshot(ws.path()).unwrap();
        assert_ne!(exec, base);
        assert_eq!(entries(&store, &exec)[0]["executable"], 73);
        fs::set_permissions(&file, fs::Permissions::from_mode(0o744)).unwrap();
        assert_eq!(entries(&store, &store.snapshot(ws.path()).unwrap())[0]["executable"], 64);
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(store.snapshot(ws.path()).unwrap(), base);

        let mtime = fs::metadata(&file).unwrap().modified().unwrap();
        fs::write(&file, b"other").unwrap();
        File::options().write(true).open(&file).unwrap().set_modified(mtime).unwrap();
        assert_ne!(store.snapshot(ws.path()).unwrap(), base, "same size and mtime, new content");
    }

    #[test]
    fn special_files_and_non_directory_roots_are_rejected() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        nix::unistd::mkfifo(&ws.path().join("pipe"), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        let e = store.snapshot(ws.path()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Workspace snapshot rejects FIFO, socket and device files: \"pipe\" is one; remove it"
        );
        assert!(e.is_content(), "the workspace's own content: never poisons");

        let other = tempfile::TempDir::new().unwrap();
        fs::create_dir(other.path().join("real")).unwrap();
        symlink("real", other.path().join("alias")).unwrap();
        fs::write(other.path().join("file"), b"x").unwrap();
        for root in [other.path().join("alias"), other.path().join("file")] {
            let e = store.snapshot(&root).unwrap_err();
            assert_eq!(e.to_string(), "Workspace root must be a directory, not a symlink");
        }
        // `..` is resolved textually, as Node's path.resolve does: `alias/..` is `other`.
        assert_eq!(
            lexical_absolute(&other.path().join("alias/../real/.")).unwrap(),
            other.path().join("real")
        );
        assert_eq!(lexical_absolute(Path::new("/..")).unwrap(), Path::new("/"));
        // Intermediate symlinks are fine; only the root itself must not be one.
        fs::create_dir(other.path().join("real/sub")).unwrap();
        assert!(store.snapshot(&other.path().join("alias/sub")).is_ok());
    }

    #[test]
    fn unchanged_files_are_not_rehashed_and_digests_stay_identical() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        example_workspace(ws.path());
        let file = ws.path().join("README.md");
        // Files changed within the racy margin are always re-read; let them settle.
        std::thread::sleep(Duration::from_nanos(RACY_MARGIN_NS as u64) + Duration::from_millis(200));
        let full = store.snapshot(ws.path()).unwrap();
        assert_eq!(full, root_tree_ref());
        let hashed = store.files_hashed();
        assert_eq!(hashed, 3);

        assert_eq!(store.snapshot(ws.path()).unwrap(), full);
        assert_eq!(store.files_hashed(), hashed, "nothing touched: served from the cache");

        // A blob missing from the pool: the closure check before any commit finds it, and
        // the writer then forgets the caches and snapshots again, which restores it.
        let csv = Ref::new(Pool::Data, crate::versioning::testutil::X_CSV_HEX, 8, OCTET_STREAM);
        fs::remove_file(store.blob_path(Pool::Data, csv.hex())).unwrap();
        assert_eq!(store.snapshot(ws.path()).unwrap(), full);
        assert!(matches!(store.validate_closure(&full), Err(VersionError::Missing { .. })));
        store.forget_caches();
        assert_eq!(store.snapshot(ws.path()).unwrap(), full);
        assert_eq!(store.files_hashed(), hashed + 3, "everything re-read after the caches were dropped");
        assert!(store.has(&csv));
        assert_eq!(store.validate_closure(&full).unwrap(), 6);
        let hashed = hashed + 2;

        // Same size, restored mtime: only ctime tells, and it is part of the key.
        let mtime = fs::metadata(&file).unwrap().modified().unwrap();
        fs::write(&file, b"HELLO\n").unwrap();
        File::options().write(true).open(&file).unwrap().set_modified(mtime).unwrap();
        let changed = store.snapshot(ws.path()).unwrap();
        assert_ne!(changed, full);
        assert_eq!(store.files_hashed(), hashed + 2);
        // Just changed, so within the racy margin: re-read again rather than trusted.
        assert_eq!(store.snapshot(ws.path()).unwrap(), changed);
        assert_eq!(store.files_hashed(), hashed + 3);

        // And a fresh store (no cache) agrees with the cached result.
        let (_data2, fresh) = temp_store();
        assert_eq!(fresh.snapshot(ws.path()).unwrap(), changed);
        assert_eq!(fresh.files_hashed(), 3);
    }

    #[test]
    fn freshly_changed_files_are_always_rehashed() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        fs::write(ws.path().join("f"), b"now").unwrap();
        store.snapshot(ws.path()).unwrap();
        store.snapshot(ws.path()).unwrap();
        assert_eq!(store.files_hashed(), 2, "within the racy margin nothing is cached");
    }

    #[test]
    fn a_parallel_first_snapshot_hashes_each_file_once_and_right() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        for d in 0..4 {
            fs::create_dir(ws.path().join(format!("d{d}"))).unwrap();
            for f in 0..20 {
                fs::write(ws.path().join(format!("d{d}/f{f}")), format!("content {d} {f}").repeat(100))
                    .unwrap();
            }
        }
        let root = store.snapshot(ws.path()).unwrap();
        assert_eq!(store.files_hashed(), 80, "each file hashed exactly once");
        let top = store.read_record(&root, Some("WorkspaceTree")).unwrap();
        for dir_entry in top.value["entries"].as_array().unwrap() {
            let dir = crate::versioning::names::b64url_decode(dir_entry["name"].as_str().unwrap()).unwrap();
            let tree = Ref::from_value(&dir_entry["tree"]).unwrap();
            for e in store.read_record(&tree, None).unwrap().value["entries"].as_array().unwrap() {
                let name = crate::versioning::names::b64url_decode(e["name"].as_str().unwrap()).unwrap();
                let path = ws
                    .path()
                    .join(String::from_utf8(dir.clone()).unwrap())
                    .join(String::from_utf8(name).unwrap());
                let want = crate::versioning::names::sha256_hex(&fs::read(path).unwrap());
                assert_eq!(Ref::from_value(&e["content"]).unwrap().hex(), want);
            }
        }
        // A fresh store agrees.
        let (_data2, fresh) = temp_store();
        assert_eq!(fresh.snapshot(ws.path()).unwrap(), root);
    }

    #[test]
    fn nesting_beyond_the_depth_limit_is_refused_not_a_crash() {
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        let mut deep = ws.path().to_owned();
        for _ in 0..MAX_DEPTH - 1 {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        let store = std::sync::Arc::new(store);
        let (s2, root) = (store.clone(), ws.path().to_owned());
        // The daemon's threads have 8 MiB stacks; so does this one.
        let run = move || {
            std::thread::Builder::new()
                .stack_size(8 << 20)
                .spawn(move || s2.snapshot(&root))
                .unwrap()
                .join()
                .unwrap()
        };
        assert!(run.clone()().is_ok(), "{} levels are fine", MAX_DEPTH);
        fs::create_dir(deep.join("d")).unwrap();
        match run() {
            Err(e @ VersionError::TooDeep { limit: MAX_DEPTH, .. }) => {
                assert!(e.is_content());
                let VersionError::TooDeep { path, .. } = &e else { unreachable!() };
                assert!(path.starts_with('…') && path.ends_with("d/d/d"), "{path}");
                assert!(path.chars().count() <= 301, "{path}");
            }
            other => panic!("{other:?}"),
        }
    }

    fn mkfifo(path: &Path) {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    }

    #[test]
    fn a_nested_workspaces_special_files_are_left_out_of_its_parents_snapshot() {
        let (_data, store) = temp_store();
        let t = tempfile::TempDir::new().unwrap();
        let parent = t.path().canonicalize().unwrap().join("p");
        let child = parent.join("agents/c");
        fs::create_dir_all(&child).unwrap();
        fs::write(parent.join("f.txt"), b"parent").unwrap();
        fs::write(child.join("kept.txt"), b"child").unwrap();
        mkfifo(&child.join("pipe"));
        let scope = SnapshotScope { canonical: Some(parent.clone()), ..SnapshotScope::default() };
        // Not (yet) a workspace: the FIFO is the parent's own content.
        let e = store.snapshot_scoped(&parent, &scope).unwrap_err();
        assert!(matches!(&e, VersionError::SpecialFile { path } if path == "agents/c/pipe"), "{e}");

        // A lease database in agents/.workspace-coordination makes agents/c a workspace.
        let coord = parent.join("agents/.workspace-coordination");
        fs::create_dir(&coord).unwrap();
        fs::write(coord.join(format!("{}.sqlite", crate::coordination::path_hex(&child))), b"").unwrap();
        let tree = store.snapshot_scoped(&parent, &scope).unwrap();
        let agents =
            entries(&store, &tree).into_iter().find(|e| e["name"] == b64url_encode(b"agents")).unwrap();
        let agents = Ref::from_value(&agents["tree"]).unwrap();
        let c = entries(&store, &agents).into_iter().find(|e| e["name"] == "Yw").unwrap();
        let names: Vec<Value> = entries(&store, &Ref::from_value(&c["tree"]).unwrap())
            .into_iter()
            .map(|e| e["name"].clone())
            .collect();
        assert_eq!(names, [json!(b64url_encode(b"kept.txt"))], "the FIFO is left out, the rest kept");
        // Without the scope (or in the workspace's own snapshot) it still fails.
        assert!(matches!(store.snapshot(&parent), Err(VersionError::SpecialFile { .. })));
        assert!(matches!(store.snapshot(&child), Err(VersionError::SpecialFile { .. })));
    }

    #[test]
    fn a_tree_over_the_byte_limit_is_refused_before_it_is_stored() {
        let (data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        for name in ["a", "b"] {
            let f = File::create(ws.path().join(name)).unwrap();
            f.set_len(64 << 20).unwrap();
        }
        let scope = SnapshotScope { max_bytes: 20 << 20, ..SnapshotScope::default() };
        let e = store.snapshot_scoped(ws.path(), &scope).unwrap_err();
        assert!(matches!(e, VersionError::OverQuota { limit } if limit == 20 << 20), "{e}");
        assert!(e.is_content());
        let stored: u64 = walkdir(data.path());
        assert!(stored < 1 << 20, "nothing of the sparse files was written out: {stored} bytes");
        let scope = SnapshotScope { max_bytes: 128 << 20, ..SnapshotScope::default() };
        assert!(store.snapshot_scoped(ws.path(), &scope).is_ok(), "exactly at the limit is fine");
    }

    fn walkdir(dir: &Path) -> u64 {
        let mut total = 0;
        for e in fs::read_dir(dir).unwrap().flatten() {
            let m = e.metadata().unwrap();
            total += if m.is_dir() { walkdir(&e.path()) } else { m.len() };
        }
        total
    }

    #[test]
    fn an_unreadable_directory_is_named_and_never_an_io_failure() {
        if nix::unistd::geteuid().is_root() {
            eprintln!("SKIP an_unreadable_directory_is_named: root reads every directory");
            return;
        }
        let (_data, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        fs::create_dir_all(ws.path().join("x/locked")).unwrap();
        fs::set_permissions(ws.path().join("x/locked"), fs::Permissions::from_mode(0o000)).unwrap();
        let e = store.snapshot(ws.path()).unwrap_err();
        fs::set_permissions(ws.path().join("x/locked"), fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(&e, VersionError::Unreadable { path, .. } if path == "x/locked"), "{e}");
        assert!(e.is_content());
    }
}
