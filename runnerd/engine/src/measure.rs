//! What the workspace holds, by `size:mtime` fingerprint (internals §2.5): for the quota
//! checks and for `createdFiles`/`modifiedFiles`. Regular files only; symlinks are never
//! followed; nothing is hashed (the content-addressed receipt is the versioning store's job).
//!
//! Ours, beyond the original (issue #14, hole 5): the walk goes by descriptor
//! (`openat(O_NOFOLLOW)`, `fstatat`), a file is charged its size as the original counts it
//! (`stat.size`, so a sparse file, which the version store would write out in full, counts
//! in full) plus the blocks allocated beyond that size rounded up to the filesystem's block
//! (issue #30: a 500-byte file is 500 bytes, and blocks `fallocate`d past the end still
//! count) — and a directory the
//! walk cannot read fails closed: its contents are unknown, so the quota check refuses rather
//! than count them as nothing.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::rc::Rc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::fsat::{self, Stat};

/// Workspace-relative path (`/`-separated) → (size, mtime in ns).
/// How often the workspace quota is re-measured during a run, at the most: the original
/// polls every 100 ms; ours waits 25 ms, or as long as the last walk took if that was longer
/// (a large workspace is never walked more than half the time), so the overshoot between
/// two measurements is a quarter of the original's on a small workspace.
pub const QUOTA_POLL: Duration = Duration::from_millis(25);

pub type Fingerprints = BTreeMap<String, (u64, i128)>;

/// Directory levels the walk descends at most (it holds a descriptor per level). Deeper is
/// reported as unreadable, so the quota fails closed; snapshots stop at 256 levels anyway.
pub const MAX_WALK_DEPTH: usize = 1024;

/// The most path text one walk keeps (every file's and every pending directory's
/// workspace-relative path): 50,000 empty files below 250 directories of 255-byte names
/// would otherwise cost gigabytes per walk, before a run, after it and at every poll. Past
/// it the walk stops and fails closed (the quota refuses; an unlimited run lists what it
/// kept).
pub const MAX_WALK_PATH_BYTES: usize = 128 << 20;

/// One walk over a workspace.
#[derive(Debug, Default)]
pub struct Measured {
    pub prints: Fingerprints,
    /// Path text kept so far ([`MAX_WALK_PATH_BYTES`]).
    path_bytes: usize,
    /// What the regular files cost, each its size plus blocks allocated beyond it ([`charged`]).
    pub bytes: u64,
    /// The first thing the walk could not read; what it holds is unknown.
    pub unreadable: Option<Unreadable>,
    /// Every entry the walk met (files, directories, links and the rest), the root aside.
    pub entries: u64,
    /// Counting only ([`count`]): no fingerprints kept, only pending directories' paths.
    counting: bool,
    /// Counting stops once more entries than this were met.
    entry_cap: u64,
    /// The first regular file with a set-user-ID or set-group-ID bit (workspace-relative):
    /// in an idmapped workspace a sandbox could rewrite it through a shared mapping, which
    /// keeps the bit, as its owner (issue #30).
    pub set_id: Option<String>,
}

/// A path (workspace-relative) the walk could not read, and why.
#[derive(Debug)]
pub struct Unreadable {
    pub path: String,
    pub error: io::Error,
}

impl Measured {
    fn fail(&mut self, path: &str, error: io::Error) {
        if self.unreadable.is_none() {
            let path = if path.is_empty() { ".".to_owned() } else { path.to_owned() };
            self.unreadable = Some(Unreadable { path, error });
        }
    }
}

pub use crate::quota::charged;

/// `RLIMIT_FSIZE` for a run under `limit` (0: none). One byte above the quota, so a write the
/// limit stops leaves a file that by itself is over the quota, which the post-check reports
/// as the original's quota error, never as a silently truncated file.
pub fn file_size_cap(limit: u64) -> Option<u64> {
    (limit > 0).then(|| limit.saturating_add(1))
}

/// `enforced.workspaceBytes` and its reason (R-PEER-1), for `/health` and any result that
/// reports enforcement: `"partial"` with the bound (no host gets a kernel-enforced total yet:
/// no project quota, no size-limited mount), `false` when unlimited. `journal`: whether the
/// change journal keeps the total during runs (`crate::journal`).
pub fn quota_enforcement(limit: u64, journal: bool) -> (Value, String) {
    if limit == 0 {
        return (json!(false), "maxWorkspaceBytes is 0 (unlimited)".to_owned());
    }
    let poll = QUOTA_POLL.as_millis();
    let during = if journal {
        format!(
            "kept during a run from the change journal (each file an event names is measured again as it \
             is written: no walk), so a run is stopped shortly after the write that crosses it and exceeds it \
             by what it writes until then (measured: 2-16 MiB past a 64 MiB quota for dd at full speed, against \
             3-96 MiB with the walk); where the journal cannot \
             vouch for a workspace (its first run, lost events, more workspaces or directories than its \
             bounds) the workspace is walked every {poll} ms during the run instead (or the last walk's \
             duration, if longer), at a cost of one walk per poll"
        )
    } else {
        format!(
            "measured every {poll} ms during a run (or the last walk's duration, if longer): a run can exceed \
             it by what it writes between two measurements (about 1.5-3x a 20 MB quota at ~1 GB/s)"
        )
    };
    (
        json!("partial"),
        format!(
            "per file hard (RLIMIT_FSIZE = quota + 1 byte; fallocate refused by seccomp); the total, each file \
             charged its size plus the blocks allocated beyond it, is checked before and after a run and \
             {during}, failing closed on what it cannot read; an overshoot stays on disk and makes the next \
             run's pre-check refuse; a commit never stores more than the quota"
        ),
    )
}

/// Why a workspace is over its quota.
#[derive(Debug)]
pub enum Breach {
    Over { bytes: u64 },
    Unreadable(Unreadable),
}

/// The quota verdict on one walk (`limit` 0: unlimited, never a breach).
pub fn check(m: Measured, limit: u64) -> Result<Measured, Breach> {
    if limit == 0 {
        return Ok(m);
    }
    if let Some(u) = m.unreadable {
        return Err(Breach::Unreadable(u));
    }
    if m.bytes > limit {
        return Err(Breach::Over { bytes: m.bytes });
    }
    Ok(m)
}

/// Walks the workspace directory `root` (the descriptor runnerd pinned, `O_PATH` or not)
/// without ever resolving a path: the root is reopened as `.` relative to it, and every
/// level below with `openat(O_DIRECTORY | O_NOFOLLOW)` relative to its parent, each entry
/// classified by `fstatat(AT_SYMLINK_NOFOLLOW)` ([`fsat`]). So a sandbox that swaps a
/// directory for a symlink between the listing and the descent (this walk runs every
/// [`QUOTA_POLL`](QUOTA_POLL) while code runs) makes the open fail (`ELOOP`/`ENOTDIR`)
/// and the walk skips the name: what the symlink points at is never counted nor listed.
/// Never fails (what it could not read is in [`Measured::unreadable`]). Entries that vanish
/// mid-walk (a running sandbox deleting them) are simply not there.
pub fn measure(root: BorrowedFd<'_>) -> Measured {
    walk_observed(root, "", &mut |_| {})
}

/// [`measure`] without the fingerprints: bytes and entries only, its memory the pending
/// directories' paths (a watchdog walks a prefix of up to millions of files every few
/// hundred milliseconds; keeping every path each time would cost gigabytes). It stops once
/// it has met more than [`common::provision::MAX_PREFIX_ENTRIES`] entries: the watchdog
/// refuses that many, and a walk of a tenant's tree goes no further than needed to say so.
pub fn count(root: BorrowedFd<'_>) -> Measured {
    count_capped(root, common::provision::MAX_PREFIX_ENTRIES)
}

fn count_capped(root: BorrowedFd<'_>, entry_cap: u64) -> Measured {
    walk_within(root, "", &mut |_| {}, MAX_WALK_PATH_BYTES, Some(entry_cap))
}

/// [`count`] on the blocking pool, on a duplicate of `root` the walk owns; a walk that
/// could not start or run fails closed. The awaiting task is free meanwhile.
pub async fn count_blocking(root: &OwnedFd) -> Measured {
    let root = match root.try_clone() {
        Ok(fd) => fd,
        Err(e) => return unreadable(e),
    };
    tokio::task::spawn_blocking(move || count(root.as_fd()))
        .await
        .unwrap_or_else(|e| unmeasured(&e.to_string()))
}

/// [`measure`] as blocking work of the awaiting task (it makes a syscall per entry;
/// [`crate::blocking::run`]: no thread hop before a launch), on a duplicate of `root` that
/// the walk owns; a walk that could not start or run fails closed.
pub async fn measure_blocking(root: &OwnedFd) -> Measured {
    let root = match root.try_clone() {
        Ok(fd) => fd,
        Err(e) => return unreadable(e),
    };
    crate::blocking::run(move || measure(root.as_fd())).await.unwrap_or_else(|e| unmeasured(&e.to_string()))
}

/// A walk that could not run, failing closed (the workspace reads as unreadable).
pub fn unmeasured(why: &str) -> Measured {
    unreadable(io::Error::other(why.to_owned()))
}

fn unreadable(error: io::Error) -> Measured {
    Measured { unreadable: Some(Unreadable { path: ".".into(), error }), ..Default::default() }
}

/// What an observed walk ([`walk_observed`]) shows its observer, in walk order.
#[derive(Debug)]
pub enum Seen<'a> {
    /// A directory (workspace-relative; `""` is where the walk started) was opened, before
    /// its names are read: a change journal adds its watch here, so that nothing changed
    /// after the listing goes unseen.
    Opened(BorrowedFd<'a>, &'a str),
    /// A directory's names were read and classified, before anything below it is opened.
    Listed(&'a str),
    /// A regular file and what `fstatat` said of it.
    File(&'a str, &'a Stat),
    /// A subdirectory, about to be walked.
    Dir(&'a str),
    /// Anything else (a symlink, never followed; a FIFO, socket or device): no data, but
    /// its name counts towards [`MAX_WALK_PATH_BYTES`].
    Other(&'a str),
}

/// [`measure`], calling `listed` with each directory's relative path right after its names
/// were read and before anything below it is opened: the seam a test uses to swap a
/// directory for a symlink at exactly the moment a racing sandbox would.
#[cfg(test)]
fn walk(root: BorrowedFd<'_>, listed: &mut dyn FnMut(&str)) -> Measured {
    walk_observed(root, "", &mut |seen| {
        if let Seen::Listed(rel) = seen {
            listed(rel)
        }
    })
}

/// Walks the directory `dir`, which lies at `prefix` in its workspace (`""`: the root), as
/// [`measure`] does, showing `seen` everything it meets; paths in the result and in what
/// is seen are workspace-relative.
pub fn walk_observed(dir: BorrowedFd<'_>, prefix: &str, seen: &mut dyn FnMut(Seen<'_>)) -> Measured {
    walk_within(dir, prefix, seen, MAX_WALK_PATH_BYTES, None)
}

/// [`walk_observed`] keeping at most `max_path_bytes` of path text.
fn walk_within(
    root: BorrowedFd<'_>,
    prefix: &str,
    seen: &mut dyn FnMut(Seen<'_>),
    max_path_bytes: usize,
    count_up_to: Option<u64>,
) -> Measured {
    let mut m = Measured {
        counting: count_up_to.is_some(),
        entry_cap: count_up_to.unwrap_or(u64::MAX),
        ..Measured::default()
    };
    let root = match fsat::open_dir_at(&root, c".") {
        Ok(fd) => fd,
        Err(e) => {
            m.fail(prefix, e);
            return m;
        }
    };
    let depth = if prefix.is_empty() { 0 } else { prefix.split('/').count() };
    let mut walk = Walk { m, stack: Vec::new(), seen, max_path_bytes };
    (walk.seen)(Seen::Opened(root.as_fd(), prefix));
    walk.list(&Rc::new(root), prefix, depth);
    (walk.seen)(Seen::Listed(prefix));
    while let Some((parent, name, rel, depth)) = walk.stack.pop() {
        if walk.m.path_bytes > max_path_bytes || walk.m.entries > walk.m.entry_cap {
            break;
        }
        if depth > MAX_WALK_DEPTH {
            walk.m.fail(
                &rel,
                io::Error::other(format!("nests directories deeper than {MAX_WALK_DEPTH} levels")),
            );
            continue;
        }
        // No (dev, ino) comparison with the listing's stat: the open is relative to the
        // parent and follows nothing, so whatever directory it finds is in the workspace
        // (a rename since the listing), and counting what is there now is right.
        match fsat::open_dir_at(&parent, &name) {
            Ok(dir) => {
                (walk.seen)(Seen::Opened(dir.as_fd(), &rel));
                walk.list(&Rc::new(dir), &rel, depth);
                (walk.seen)(Seen::Listed(&rel));
            }
            // Gone, or swapped for a symlink or a file since it was listed: nothing to count.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)) => {}
            Err(e) => walk.m.fail(&rel, e),
        }
    }
    walk.m
}

/// One walk's state: what it measured so far, the directories still to walk, its observer,
/// and the path text it may keep.
struct Walk<'s> {
    m: Measured,
    /// Pending directories: the open parent, the name, the relative path, the depth. Parents
    /// are shared, so a depth-first walk holds about one descriptor per level.
    stack: Vec<(Rc<OwnedFd>, CString, String, usize)>,
    seen: &'s mut dyn FnMut(Seen<'_>),
    max_path_bytes: usize,
}

impl Walk<'_> {
    /// Reads `dir`'s names (at `rel`, `depth` levels down), counting each and pushing its
    /// subdirectories onto the stack.
    fn list(&mut self, dir: &Rc<OwnedFd>, rel: &str, depth: usize) {
        let Walk { m, stack, seen, max_path_bytes } = self;
        let max_path_bytes = *max_path_bytes;
        let names = match fsat::names(dir) {
            Ok(names) => names,
            Err(e) => return m.fail(rel, e),
        };
        for (name, cname) in names {
            let name = name.to_string_lossy();
            let child = if rel.is_empty() { name.into_owned() } else { format!("{rel}/{name}") };
            m.entries = m.entries.saturating_add(1);
            if m.entries > m.entry_cap {
                return;
            }
            let too_long = |m: &mut Measured, held: usize| {
                m.path_bytes = m.path_bytes.saturating_add(held);
                m.path_bytes > max_path_bytes
            };
            if !m.counting && too_long(m, child.len()) {
                let error = format!("holds more than {max_path_bytes} bytes of file paths");
                return m.fail(rel, io::Error::other(error));
            }
            let st = match Stat::at(dir, &cname) {
                Ok(st) => st,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => {
                    m.fail(&child, e);
                    continue;
                }
            };
            // Counting keeps only the directories still to walk.
            if m.counting && st.kind() == libc::S_IFDIR && too_long(m, child.len()) {
                let error = format!("holds more than {max_path_bytes} bytes of directory paths");
                return m.fail(rel, io::Error::other(error));
            }
            match st.kind() {
                libc::S_IFDIR => {
                    seen(Seen::Dir(&child));
                    stack.push((dir.clone(), cname, child, depth + 1));
                }
                libc::S_IFREG => {
                    m.bytes = m.bytes.saturating_add(charged(st.size, st.blocks, st.blksize));
                    if st.mode & (libc::S_ISUID | libc::S_ISGID) != 0 && m.set_id.is_none() {
                        m.set_id = Some(child.clone());
                    }
                    seen(Seen::File(&child, &st));
                    if !m.counting {
                        m.prints.insert(child, (st.size, st.mtime_ns));
                    }
                }
                // Symlinks hold no data here; FIFOs, sockets and devices none either (a commit
                // refuses them, without poisoning the workspace).
                _ => seen(Seen::Other(&child)),
            }
        }
    }
}

/// Sorted `(created, modified)`; deletions are not reported (as the original).
pub fn changes(before: &Fingerprints, after: &Fingerprints) -> (Vec<String>, Vec<String>) {
    let mut created = Vec::new();
    let mut modified = Vec::new();
    for (path, print) in after {
        match before.get(path) {
            None => created.push(path.clone()),
            Some(old) if old != print => modified.push(path.clone()),
            Some(_) => {}
        }
    }
    (created, modified)
}

const QUOTA_SUFFIX: &str =
    "(current limit from system quota settings / SCIENCE_AGENT_MAX_WORKSPACE_BYTES; set to 0 for unlimited)";

/// Before and after a run.
pub fn quota_exceeds_message(limit: u64) -> String {
    format!("Workspace exceeds the {limit} byte execution quota {QUOTA_SUFFIX}")
}

/// During a run, when the poll kills it.
pub fn quota_exceeded_message(limit: u64) -> String {
    format!("Workspace exceeded the {limit} byte execution quota {QUOTA_SUFFIX}")
}

/// The quota error for a breach: the original's text (`during`: the poll's wording), and for
/// a path the walk could not read, that path and what to do.
pub fn breach_message(limit: u64, breach: &Breach, during: bool) -> String {
    let base = if during { quota_exceeded_message(limit) } else { quota_exceeds_message(limit) };
    match breach {
        Breach::Over { .. } => base,
        Breach::Unreadable(u) => format!(
            "{base}: the runner cannot read {:?} ({}), so its contents are counted as over the quota; make it readable or remove it",
            u.path, u.error
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    use std::path::Path;

    fn walk(root: &Path) -> Measured {
        let dir = fs::File::open(root).unwrap();
        measure(dir.as_fd())
    }

    /// A count sees what a measure sees, keeps none of the paths, and counts every entry.
    #[test]
    fn a_count_measures_the_bytes_and_entries_and_keeps_no_paths() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir_all(tmp.path().join("a/b")).unwrap();
        fs::write(tmp.path().join("a/b/f"), b"12345").unwrap();
        fs::write(tmp.path().join("g"), b"xyz").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tmp.path().join("a/l")).unwrap();
        let dir = fs::File::open(tmp.path()).unwrap();
        let (full, counted) = (measure(dir.as_fd()), count(dir.as_fd()));
        assert_eq!((counted.bytes, counted.entries), (full.bytes, 5), "a, a/b, a/b/f, a/l, g");
        assert!(full.bytes >= 8 && full.prints.len() == 2 && counted.prints.is_empty());
        assert!(counted.unreadable.is_none());
        // Past its cap a count stops: it says "more than the cap", no more.
        let capped = count_capped(dir.as_fd(), 2);
        assert_eq!(capped.entries, 3, "the walk stopped at the first entry past 2");
    }

    #[test]
    fn a_walk_keeps_at_most_its_path_text_and_then_fails_closed() {
        let tmp = tempfile::tempdir().unwrap();
        let long = "n".repeat(200);
        let deep = tmp.path().join(&long).join(&long);
        fs::create_dir_all(&deep).unwrap();
        for i in 0..50 {
            fs::write(deep.join(format!("{i}")), "").unwrap();
        }
        let dir = fs::File::open(tmp.path()).unwrap();
        let all = walk_within(dir.as_fd(), "", &mut |_| {}, 1 << 20, None);
        assert_eq!((all.prints.len(), all.unreadable.is_none()), (50, true));
        // 50 paths of about 400 bytes: a 4 KiB budget stops the walk part way.
        let cut = walk_within(dir.as_fd(), "", &mut |_| {}, 4096, None);
        assert!(cut.prints.len() < 50, "{}", cut.prints.len());
        let u = cut.unreadable.as_ref().expect("fails closed");
        assert_eq!(u.error.to_string(), "holds more than 4096 bytes of file paths");
        assert!(matches!(check(cut, 1 << 30), Err(Breach::Unreadable(_))));
    }

    #[test]
    fn walk_skips_symlinks_and_reports_changes() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/one.txt"), "1").unwrap();
        fs::write(root.join("keep.txt"), "22").unwrap();
        fs::write(root.join("gone.txt"), "333").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("dirlink")).unwrap();
        let before = walk(root);
        assert!(before.unreadable.is_none());
        assert_eq!(before.prints.keys().collect::<Vec<_>>(), ["a/b/one.txt", "gone.txt", "keep.txt"]);
        // Three small files, each at least what it allocates (a block, on most filesystems).
        let blocks: u64 = ["a/b/one.txt", "gone.txt", "keep.txt"]
            .iter()
            .map(|p| {
                let m = fs::metadata(root.join(p)).unwrap();
                charged(
                    std::os::unix::fs::MetadataExt::size(&m),
                    std::os::unix::fs::MetadataExt::blocks(&m),
                    std::os::unix::fs::MetadataExt::blksize(&m),
                )
            })
            .sum();
        assert_eq!(before.bytes, blocks);
        assert!(before.bytes >= 6);

        std::thread::sleep(std::time::Duration::from_millis(5));
        fs::write(root.join("a/b/one.txt"), "1111").unwrap();
        fs::write(root.join("new.txt"), "").unwrap();
        fs::remove_file(root.join("gone.txt")).unwrap();
        let after = walk(root);
        let (created, modified) = changes(&before.prints, &after.prints);
        assert_eq!(created, ["new.txt"]);
        assert_eq!(modified, ["a/b/one.txt"]);
    }

    #[test]
    fn a_directory_swapped_for_a_symlink_mid_walk_is_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let (ws, outside) = (t.path().join("ws"), t.path().join("outside"));
        fs::create_dir_all(ws.join("sub")).unwrap();
        fs::write(ws.join("sub/mine"), "1").unwrap();
        fs::write(ws.join("top"), "22").unwrap();
        fs::create_dir_all(outside.join("deep")).unwrap();
        fs::write(outside.join("big"), vec![7u8; 1 << 20]).unwrap();
        fs::write(outside.join("deep/also"), "x").unwrap();
        let swap = || {
            fs::remove_dir_all(ws.join("sub")).unwrap();
            std::os::unix::fs::symlink(&outside, ws.join("sub")).unwrap();
        };
        // The pinned workspace descriptor is `O_PATH`, as runnerd's is.
        let pinned =
            fsat::open_at(&fs::File::open(&ws).unwrap(), c".", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        let mut swaps = 0;
        let m = super::walk(pinned.as_fd(), &mut |rel| {
            if rel.is_empty() {
                // "sub" was listed as a directory; a racing sandbox makes it a symlink to a
                // big host directory before the walk descends.
                swap();
                swaps += 1;
            }
        });
        assert_eq!(swaps, 1);
        assert!(
            fs::metadata(ws.join("sub/big")).is_ok(),
            "a walk by path would now reach the host directory"
        );
        assert!(m.unreadable.is_none(), "{:?}", m.unreadable);
        assert_eq!(m.prints.keys().collect::<Vec<_>>(), ["top"], "nothing below the symlink is listed");
        assert!(m.bytes < 1 << 20, "the host file is not counted: {}", m.bytes);
        // Walked again, the symlink is seen as one and skipped too.
        let again = measure(pinned.as_fd());
        assert_eq!(again.prints.keys().collect::<Vec<_>>(), ["top"]);
        assert_eq!(again.bytes, m.bytes);
    }

    #[test]
    fn a_root_that_is_not_a_directory_is_unreadable() {
        let t = tempfile::tempdir().unwrap();
        fs::write(t.path().join("f"), "x").unwrap();
        let file = fs::File::open(t.path().join("f")).unwrap();
        let m = measure(file.as_fd());
        let u = m.unreadable.expect("fails closed");
        assert_eq!((u.path.as_str(), u.error.raw_os_error()), (".", Some(libc::ENOTDIR)));
    }

    #[test]
    fn a_file_size_cap_is_one_byte_above_the_quota() {
        assert_eq!(file_size_cap(0), None);
        assert_eq!(file_size_cap(1000), Some(1001));
        assert_eq!(file_size_cap(u64::MAX), Some(u64::MAX));
    }

    #[test]
    fn sparse_and_preallocated_files_count_what_they_can_become() {
        let dir = tempfile::tempdir().unwrap();
        let sparse = fs::File::create(dir.path().join("sparse")).unwrap();
        sparse.set_len(256 << 20).unwrap();
        assert!(walk(dir.path()).bytes >= 256 << 20, "a sparse file counts its apparent size");
        fs::remove_file(dir.path().join("sparse")).unwrap();

        let pre = fs::File::create(dir.path().join("pre")).unwrap();
        // SAFETY: fallocate on a descriptor we own; the result is checked.
        let rc = unsafe {
            libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&pre), libc::FALLOC_FL_KEEP_SIZE, 0, 8 << 20)
        };
        if rc != 0 {
            eprintln!("SKIP preallocation: fallocate is not supported here ({})", io::Error::last_os_error());
            return;
        }
        assert_eq!(pre.metadata().unwrap().len(), 0);
        assert!(walk(dir.path()).bytes >= 8 << 20, "blocks allocated past the end count");
    }

    #[test]
    fn an_unreadable_directory_fails_closed_or_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let hidden = dir.path().join("x/hidden");
        fs::create_dir_all(&hidden).unwrap();
        fs::write(hidden.join("data"), vec![1u8; 100_000]).unwrap();
        fs::set_permissions(&hidden, fs::Permissions::from_mode(0o000)).unwrap();
        let m = walk(dir.path());
        fs::set_permissions(&hidden, fs::Permissions::from_mode(0o755)).unwrap();
        if nix::unistd::geteuid().is_root() {
            // Permission bits do not stop root: the contents are simply counted.
            assert!(m.unreadable.is_none());
            assert!(m.bytes >= 100_000);
        } else {
            let u = m.unreadable.as_ref().expect("reported, not skipped");
            assert_eq!(u.path, "x/hidden");
            let e = check(m, 1_000_000).unwrap_err();
            let text = breach_message(1_000_000, &e, false);
            assert!(text.starts_with(&quota_exceeds_message(1_000_000)), "{text}");
            assert!(text.contains("\"x/hidden\""), "{text}");
        }
    }

    #[test]
    fn the_verdict_fails_closed_and_zero_is_unlimited() {
        let unreadable = || Measured {
            unreadable: Some(Unreadable { path: "d".into(), error: io::Error::other("x") }),
            ..Default::default()
        };
        assert!(check(unreadable(), 0).is_ok());
        assert!(matches!(check(unreadable(), u64::MAX), Err(Breach::Unreadable(_))));
        let sized = |bytes| Measured { bytes, ..Default::default() };
        assert!(check(sized(1000), 1000).is_ok());
        assert!(matches!(check(sized(1001), 1000), Err(Breach::Over { bytes: 1001 })));
        assert_eq!(breach_message(1000, &Breach::Over { bytes: 1001 }, true), quota_exceeded_message(1000));
    }

    #[test]
    fn quota_messages_are_the_originals() {
        assert_eq!(
            quota_exceeds_message(1000),
            "Workspace exceeds the 1000 byte execution quota (current limit from system quota settings / SCIENCE_AGENT_MAX_WORKSPACE_BYTES; set to 0 for unlimited)"
        );
        assert!(quota_exceeded_message(5).starts_with("Workspace exceeded the 5 byte execution quota ("));
    }
}
