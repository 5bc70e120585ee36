//! Workspace snapshots as `WorkspaceTree` records (§4 of the format), plus incremental
//! hashing: a file whose (dev, ino, size, mtime, ctime) match what was hashed before, and
//! whose blob is still in the data pool, reuses its `DataRef` without being read again.
//!
//! The cache can only shortcut work, never change a digest: it is keyed and checked on the
//! same stat fields the change detection relies on, and entries are only kept for files whose
//! last change (ctime) lies clearly before they were hashed. A file written again within the
//! same timestamp tick could otherwise keep size, mtime and ctime (git's "racy clean" problem).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, Metadata, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::names::b64url_encode;
use super::store::Store;
use super::{Pool, Ref, VersionError, io_err};

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
    fn of(m: &Metadata) -> Stamp {
        Stamp { size: m.len(), mtime_ns: mtime_ns(m), ctime_ns: ctime_ns(m) }
    }
}

/// The incremental-hashing cache, (dev, ino) → stamp and content; shared by all snapshots.
#[derive(Default)]
pub(crate) struct FileCache {
    entries: Mutex<HashMap<(u64, u64), (Stamp, Ref)>>,
    hashed: AtomicU64,
}

impl FileCache {
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

impl Store {
    /// Snapshots the directory `root` into `WorkspaceTree` records and returns the root tree's
    /// ref. The caller holds the workspace's writer lease; concurrent changes that are
    /// noticed fail with `Workspace changed during snapshot`.
    pub fn snapshot(&self, root: &Path) -> Result<Ref, VersionError> {
        let root = std::path::absolute(root).map_err(io_err("resolve the workspace root", root))?;
        let meta = fs::symlink_metadata(&root).map_err(io_err("inspect the workspace root", &root))?;
        if !meta.file_type().is_dir() {
            return Err(VersionError::RootNotDirectory);
        }
        self.snapshot_dir(&root, &meta)
    }

    /// How many regular files snapshots have actually opened and hashed (cache misses).
    pub fn files_hashed(&self) -> u64 {
        self.cache.hashed.load(Ordering::Relaxed)
    }

    /// One directory: children first (depth-first, raw names in memcmp order), then its record.
    fn snapshot_dir(&self, dir: &Path, before: &Metadata) -> Result<Ref, VersionError> {
        let mut names = fs::read_dir(dir)
            .and_then(|entries| {
                entries.map(|e| e.map(|e| e.file_name())).collect::<io::Result<Vec<OsString>>>()
            })
            .map_err(changed_or_io("read the directory", dir))?;
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        let mut entries = Vec::with_capacity(names.len());
        for name in names {
            let path = dir.join(&name);
            let meta = fs::symlink_metadata(&path).map_err(changed_or_io("inspect", &path))?;
            let b64_name = b64url_encode(name.as_bytes());
            let kind = meta.file_type();
            let entry = if kind.is_symlink() {
                let target = fs::read_link(&path).map_err(changed_or_io("read the symlink", &path))?;
                json!({ "name": b64_name, "target": b64url_encode(&target.into_os_string().into_vec()), "type": "symlink" })
            } else if kind.is_dir() {
                let tree = self.snapshot_dir(&path, &meta)?;
                json!({ "name": b64_name, "tree": tree.to_value(), "type": "directory" })
            } else if kind.is_file() {
                let content = self.snapshot_file(&path, &meta)?;
                json!({
                    "content": content.to_value(),
                    "executable": meta.mode() & 0o111,
                    "name": b64_name,
                    "type": "file",
                })
            } else {
                return Err(VersionError::SpecialFile);
            };
            let after = fs::symlink_metadata(&path).map_err(changed_or_io("inspect", &path))?;
            if after.ino() != meta.ino() || after.dev() != meta.dev() || ctime_ns(&after) != ctime_ns(&meta) {
                return Err(VersionError::Changed);
            }
            entries.push(entry);
        }
        let after = fs::symlink_metadata(dir).map_err(changed_or_io("inspect", dir))?;
        if after.ino() != before.ino() || ctime_ns(&after) != ctime_ns(before) {
            return Err(VersionError::Changed);
        }
        self.put_record("WorkspaceTree", json!({ "entries": Value::Array(entries) }))
    }

    /// One regular file's content ref: from the cache when provably unchanged, otherwise opened
    /// without following links or blocking, streamed into the data pool and checked stable.
    fn snapshot_file(&self, path: &Path, lstat: &Metadata) -> Result<Ref, VersionError> {
        let key = (lstat.dev(), lstat.ino());
        if let Some(cached) = self.cache.lookup(key, Stamp::of(lstat)) {
            if self.has(&cached) {
                return Ok(cached);
            }
        }
        let started = now_ns();
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(changed_or_io("open", path))?;
        let opened = file.metadata().map_err(io_err("stat", path))?;
        if !opened.file_type().is_file() || opened.ino() != lstat.ino() || opened.dev() != lstat.dev() {
            return Err(VersionError::Changed);
        }
        self.cache.hashed.fetch_add(1, Ordering::Relaxed);
        let content = self.put_stream(Pool::Data, &mut file)?;
        let done = file.metadata().map_err(io_err("stat", path))?;
        let stamp = Stamp::of(&done);
        if stamp != Stamp::of(&opened) || content.size != stamp.size {
            return Err(VersionError::Changed);
        }
        let settled = stamp.ctime_ns + RACY_MARGIN_NS < started;
        self.cache.store(key, settled.then(|| (stamp, content.clone())));
        Ok(content)
    }
}

fn mtime_ns(m: &Metadata) -> i128 {
    i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec())
}

fn ctime_ns(m: &Metadata) -> i128 {
    i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec())
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
