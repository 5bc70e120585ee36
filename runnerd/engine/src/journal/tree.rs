//! A journaled workspace's regular files, kept in memory between runs: what a full walk
//! ([`files::measure`]) would find, updated only where the journal says something changed.
//!
//! Every update re-reads what is there now, by descriptor and without following a link
//! (the parent reached with `openat(O_NOFOLLOW)` one component at a time, the entry with
//! `fstatat(AT_SYMLINK_NOFOLLOW)`, a directory walked as [`files::walk_observed`] walks), so
//! a planted symlink or a directory swapped mid-run is read as what it is and never
//! traversed; an event is only ever a hint of where to look. Whatever this cannot represent
//! exactly (an unreadable directory, a name that is not UTF-8, too much path text) makes
//! the update fail, and the caller falls back to a full walk, which reports it as it
//! always has.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use crate::fsat::{self, Stat};
use crate::measure::{self as files, Fingerprints, Measured, Seen};

/// What the journal keeps of one regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileState {
    pub size: u64,
    pub mtime_ns: i128,
    /// Any change to the file (its content, mode, links) moves it.
    pub ctime_ns: i128,
    /// What it costs against the quota ([`files::charged`]).
    pub charged: u64,
    pub set_id: bool,
    pub dev: u64,
    pub ino: u64,
    pub nlink: u64,
}

impl FileState {
    pub fn of(st: &Stat) -> FileState {
        FileState {
            size: st.size,
            mtime_ns: st.mtime_ns,
            ctime_ns: st.ctime_ns,
            charged: files::charged(st.size, st.blocks, st.blksize),
            set_id: st.mode & (libc::S_ISUID | libc::S_ISGID) != 0,
            dev: st.dev,
            ino: st.ino,
            nlink: st.nlink,
        }
    }

    fn print(&self) -> (u64, i128) {
        (self.size, self.mtime_ns)
    }
}

/// Why the tree can no longer say what a full walk would (the caller walks instead).
pub type Lost = String;

/// The files of one workspace, as of the last update.
#[derive(Debug, Default)]
pub struct Tree {
    files: BTreeMap<String, FileState>,
    dirs: BTreeSet<String>,
    /// Symlinks, FIFOs, sockets, devices: no data, but their names count towards the
    /// walk's path-text bound, as they do in a walk.
    others: BTreeSet<String>,
    bytes: u64,
    set_ids: BTreeSet<String>,
    /// Files with more than one link: a write through another name (even one outside the
    /// workspace) changes them without an event naming them, so they are re-read at every
    /// update.
    multi: BTreeSet<String>,
    path_bytes: usize,
    /// While a run is watched: each path's state before the run first changed it.
    undo: Option<BTreeMap<String, Option<FileState>>>,
    undo_bytes: usize,
    /// Multiply linked inodes a name held before it was removed or replaced: an open
    /// descriptor may still write them, through a name no event will name again (its
    /// directory may be gone too), so their other names are read again at every update
    /// (a few at most: sandboxes cannot make hard links, only a host can).
    ghosts: BTreeMap<String, Vec<(u64, u64)>>,
    /// The most files kept (the journal's memory bound); past it the tree is given up.
    max_files: usize,
}

/// What one path holds now.
enum Found {
    Missing,
    File(Stat),
    Dir(OwnedFd),
    Other,
}

impl Tree {
    /// The tree a full walk of `root` finds, with `opened` called for each directory before
    /// its names are read (where the journal adds its watch; an `Err` makes the tree
    /// unusable). Returns the walk's own result either way, so a first run costs one walk.
    pub fn walk(
        root: BorrowedFd<'_>,
        max_files: usize,
        opened: &mut dyn FnMut(BorrowedFd<'_>, &str) -> Result<(), Lost>,
    ) -> (Measured, Result<Tree, Lost>) {
        let mut tree = Tree { max_files, ..Tree::default() };
        let (m, walked) = tree.walk_into(root, "", &mut BTreeSet::new(), opened);
        (m, walked.map(|()| tree))
    }

    /// Walks the directory `dir` at `prefix` into the tree (every walk's rules: by descriptor,
    /// no-follow), noting the inodes of multiply linked files in `linked`; what the walk could
    /// not read, or the tree cannot hold, is the `Err`.
    fn walk_into(
        &mut self,
        dir: BorrowedFd<'_>,
        prefix: &str,
        linked: &mut BTreeSet<(u64, u64)>,
        opened: &mut dyn FnMut(BorrowedFd<'_>, &str) -> Result<(), Lost>,
    ) -> (Measured, Result<(), Lost>) {
        let mut lost: Option<Lost> = None;
        let m = files::walk_observed(dir, prefix, &mut |seen| {
            if lost.is_some() {
                return;
            }
            let result = match seen {
                Seen::Opened(fd, rel) => opened(fd, rel),
                Seen::Dir(rel) => self.add_dir(rel),
                Seen::File(rel, st) => {
                    if st.nlink > 1 {
                        linked.insert((st.dev, st.ino));
                    }
                    self.add_file(rel, st)
                }
                Seen::Other(rel) => self.add_other(rel),
                Seen::Listed(_) => Ok(()),
            };
            if let Err(why) = result {
                lost = Some(why);
            }
        });
        let result = match (lost, &m.unreadable) {
            (Some(why), _) => Err(why),
            (None, Some(u)) => Err(format!("{:?} cannot be read ({})", u.path, u.error)),
            (None, None) => Ok(()),
        };
        (m, result)
    }

    fn add_dir(&mut self, rel: &str) -> Result<(), Lost> {
        representable(rel)?;
        if self.dirs.insert(rel.to_owned()) {
            self.path_bytes = self.path_bytes.saturating_add(rel.len());
        }
        self.bounded()
    }

    fn add_other(&mut self, rel: &str) -> Result<(), Lost> {
        representable(rel)?;
        if self.others.insert(rel.to_owned()) {
            self.path_bytes = self.path_bytes.saturating_add(rel.len());
        }
        self.bounded()
    }

    /// The walk's bounds, kept: past them the walk fails closed, so the tree gives up.
    fn bounded(&self) -> Result<(), Lost> {
        if self.path_bytes > files::MAX_WALK_PATH_BYTES {
            return Err(format!("holds more than {} bytes of file paths", files::MAX_WALK_PATH_BYTES));
        }
        // Directories and symlinks cost memory as files do: all count against the share.
        if self.files.len() + self.dirs.len() + self.others.len() > self.max_files {
            return Err(format!(
                "holds more than the {} files and directories the journal keeps per workspace",
                self.max_files
            ));
        }
        if self.undo_bytes > files::MAX_WALK_PATH_BYTES {
            return Err("changed more file paths in one run than a walk would keep".into());
        }
        Ok(())
    }

    fn add_file(&mut self, rel: &str, st: &Stat) -> Result<(), Lost> {
        representable(rel)?;
        self.set(rel, Some(FileState::of(st)))
    }

    /// Sets (or, with `None`, removes) one file, keeping the totals and the run's undo log.
    fn set(&mut self, rel: &str, state: Option<FileState>) -> Result<(), Lost> {
        let old = match state {
            Some(s) => self.files.insert(rel.to_owned(), s),
            None => self.files.remove(rel),
        };
        if old.is_none() && state.is_none() {
            return Ok(());
        }
        if let Some(undo) = &mut self.undo
            && !undo.contains_key(rel)
        {
            undo.insert(rel.to_owned(), old);
            self.undo_bytes = self.undo_bytes.saturating_add(rel.len());
        }
        if let Some(o) = old {
            self.bytes = self.bytes.saturating_sub(o.charged);
            self.path_bytes = self.path_bytes.saturating_sub(rel.len());
        }
        self.set_ids.remove(rel);
        self.multi.remove(rel);
        if let Some(s) = state {
            self.bytes = self.bytes.saturating_add(s.charged);
            self.path_bytes = self.path_bytes.saturating_add(rel.len());
            if s.set_id {
                self.set_ids.insert(rel.to_owned());
            }
            if s.nlink > 1 {
                self.multi.insert(rel.to_owned());
            }
        }
        self.bounded()
    }

    /// Forgets `rel` and everything below it; the inodes of multiply linked files it held.
    fn remove_below(&mut self, rel: &str, linked: &mut BTreeSet<(u64, u64)>) -> Result<(), Lost> {
        let (lo, hi) = (format!("{rel}/"), format!("{rel}0"));
        let mut gone: Vec<String> =
            self.files.range(lo.clone()..hi.clone()).map(|(k, _)| k.clone()).collect();
        gone.push(rel.to_owned());
        for path in gone {
            if let Some(old) = self.files.get(&path)
                && old.nlink > 1
            {
                linked.insert((old.dev, old.ino));
            }
            self.set(&path, None)?;
        }
        for set in [&mut self.dirs, &mut self.others] {
            let mut gone: Vec<String> = set.range(lo.clone()..hi.clone()).cloned().collect();
            gone.push(rel.to_owned());
            for d in gone {
                if set.remove(&d) {
                    self.path_bytes = self.path_bytes.saturating_sub(d.len());
                }
            }
        }
        Ok(())
    }

    /// Re-reads each of `paths` (workspace-relative) below `root` and everything beneath
    /// those that are directories now, then every other name of a multiply linked file
    /// among them — and, with `every_link`, every multiply linked file (a name outside the
    /// workspace may have written it: at a run's start and end, not at each quota update,
    /// where a workspace of hard links would cost a stat of each per event). `opened` is
    /// called for each directory walked (the journal's watch). Returns the other names
    /// that changed: no event named them, yet a snapshot must read them again.
    ///
    /// `suspects` are names written after they were removed or replaced during the run: an
    /// open descriptor writing an inode that name no longer holds, which may have other
    /// names no event will name. Every inode such a name held (its ghosts, and what it
    /// holds now) has its other names read again; a name whose earlier inode the tree may
    /// never have seen (`true`: it appeared and went between two updates) cannot be
    /// followed, and the update gives up.
    pub fn update<'a>(
        &mut self,
        root: BorrowedFd<'_>,
        paths: impl IntoIterator<Item = &'a String>,
        suspects: &BTreeMap<String, bool>,
        every_link: bool,
        opened: &mut dyn FnMut(BorrowedFd<'_>, &str) -> Result<(), Lost>,
    ) -> Result<Vec<String>, Lost> {
        let mut linked = BTreeSet::new();
        let mut again: Vec<String> =
            if every_link { self.multi.iter().cloned().collect() } else { Vec::new() };
        // An O_TMPFILE's writes are named "#<inode>" in its directory, also after a host
        // gave it a name with linkat: that name is found by its inode.
        let mut unnamed = BTreeSet::new();
        for rel in paths {
            self.reread(root, rel, &mut linked, opened)?;
            if let Some(ino) = unnamed_inode(rel)
                && !self.files.contains_key(rel)
            {
                unnamed.insert(ino);
            }
        }
        for (name, unseen) in suspects {
            if *unseen {
                return Err(format!(
                    "{name:?} was written after it was replaced, through an inode never measured"
                ));
            }
            linked.extend(self.files.get(name).map(|f| (f.dev, f.ino)));
        }
        linked.extend(self.ghosts.values().flatten().copied());
        if !linked.is_empty() || !unnamed.is_empty() {
            again.extend(
                self.files
                    .iter()
                    .filter(|(_, f)| linked.contains(&(f.dev, f.ino)) || unnamed.contains(&f.ino))
                    .map(|(k, _)| k.clone()),
            );
        }
        again.sort();
        again.dedup();
        let mut unused = BTreeSet::new();
        let mut changed = Vec::new();
        for rel in again {
            let old = self.files.get(&rel).copied();
            self.reread(root, &rel, &mut unused, opened)?;
            if self.files.get(&rel) != old.as_ref() {
                changed.push(rel);
            }
        }
        Ok(changed)
    }

    fn reread(
        &mut self,
        root: BorrowedFd<'_>,
        rel: &str,
        linked: &mut BTreeSet<(u64, u64)>,
        opened: &mut dyn FnMut(BorrowedFd<'_>, &str) -> Result<(), Lost>,
    ) -> Result<(), Lost> {
        if rel.is_empty() {
            return Err("the workspace root itself changed".into());
        }
        representable(rel)?;
        if rel.split('/').count() > files::MAX_WALK_DEPTH {
            return Err(format!("nests directories deeper than {} levels", files::MAX_WALK_DEPTH));
        }
        // Multiply linked files at or below `rel` that this re-read may find gone or replaced:
        // their inodes become ghosts (see `ghosts`).
        let (lo, hi) = (format!("{rel}/"), format!("{rel}0"));
        let held: Vec<(String, (u64, u64))> = self
            .files
            .get_key_value(rel)
            .into_iter()
            .chain(self.files.range(lo..hi))
            .filter(|(_, f)| f.nlink > 1)
            .map(|(k, f)| (k.clone(), (f.dev, f.ino)))
            .collect();
        self.reread_here(root, rel, linked, opened)?;
        for (path, ino) in held {
            if self.files.get(&path).map(|f| (f.dev, f.ino)) == Some(ino) {
                continue;
            }
            let inodes = self.ghosts.entry(path).or_default();
            if !inodes.contains(&ino) {
                inodes.push(ino);
            }
            if self.ghosts.len() > MAX_GHOSTS {
                return Err(format!("more than {MAX_GHOSTS} linked files were removed or replaced"));
            }
        }
        Ok(())
    }

    /// [`Tree::reread`]'s work: forget what `rel` held, read what it holds now.
    fn reread_here(
        &mut self,
        root: BorrowedFd<'_>,
        rel: &str,
        linked: &mut BTreeSet<(u64, u64)>,
        opened: &mut dyn FnMut(BorrowedFd<'_>, &str) -> Result<(), Lost>,
    ) -> Result<(), Lost> {
        self.remove_below(rel, linked)?;
        let found = find(root, rel)?;
        match found {
            Found::Missing => Ok(()),
            Found::Other => self.add_other(rel),
            Found::File(st) => {
                if st.nlink > 1 {
                    linked.insert((st.dev, st.ino));
                }
                self.set(rel, Some(FileState::of(&st)))
            }
            Found::Dir(fd) => {
                self.add_dir(rel)?;
                self.walk_into(fd.as_fd(), rel, linked, opened).1
            }
        }
    }

    /// What a full walk would measure now, without the fingerprints (the run's changes come
    /// from [`Tree::changes`]).
    pub fn measured(&self) -> Measured {
        let mut m = Measured::default();
        m.bytes = self.bytes;
        m.set_id = self.set_ids.first().cloned();
        m
    }

    /// Every file's fingerprint, as a full walk lists them.
    pub fn prints(&self) -> Fingerprints {
        self.files.iter().map(|(k, f)| (k.clone(), f.print())).collect()
    }

    /// Starts a run's undo log.
    pub fn begin_run(&mut self) {
        self.undo = Some(BTreeMap::new());
        self.undo_bytes = 0;
    }

    /// Ends the run's undo log: the fingerprints as they were when the run began (what a
    /// walk before it found), for a caller that must fall back to walking after it.
    pub fn before_prints(&mut self) -> Fingerprints {
        let undo = self.undo.take().unwrap_or_default();
        let mut prints = self.prints();
        for (path, old) in undo {
            match old {
                Some(f) => prints.insert(path, f.print()),
                None => prints.remove(&path),
            };
        }
        prints
    }

    /// Ends the run's undo log: sorted `(created, modified)` exactly as
    /// [`files::changes`] finds them between the walk before the run and one now.
    pub fn changes(&mut self) -> (Vec<String>, Vec<String>) {
        let mut created = Vec::new();
        let mut modified = Vec::new();
        for (path, old) in self.undo.take().unwrap_or_default() {
            match (old, self.files.get(&path)) {
                (None, Some(_)) => created.push(path),
                (Some(o), Some(n)) if o.print() != n.print() => modified.push(path),
                _ => {}
            }
        }
        (created, modified)
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The inode an O_TMPFILE's events name (`dir/#<inode>`), if `rel` is such a name.
fn unnamed_inode(rel: &str) -> Option<u64> {
    let name = rel.rsplit('/').next()?;
    name.strip_prefix('#').filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()
}

/// Ghost names kept at most ([`Tree::ghosts`]); past it the tree is given up.
const MAX_GHOSTS: usize = 10_000;

/// A path the tree can key exactly: the walks name entries with `to_string_lossy`, so a
/// name that is not UTF-8 could not be found again by its key.
fn representable(rel: &str) -> Result<(), Lost> {
    if rel.contains(char::REPLACEMENT_CHARACTER) {
        return Err("holds a name that is not UTF-8".into());
    }
    Ok(())
}

/// What `rel` is now, reached from `root` one component at a time without following a
/// link; a parent that is gone or is not a directory means nothing is there.
fn find(root: BorrowedFd<'_>, rel: &str) -> Result<Found, Lost> {
    let path = Path::new(rel);
    let (parent, name) = match rel.rsplit_once('/') {
        Some((parent, name)) => (Some(parent), name),
        None => (None, rel),
    };
    let parent_fd = match parent {
        Some(p) => match fsat::walk_beneath(&root, Path::new(p).components()) {
            Ok((fd, _)) => fd,
            Err(fsat::Stopped::Missing(e)) if e.raw_os_error() == Some(libc::ENOENT) => {
                return Ok(Found::Missing);
            }
            Err(fsat::Stopped::Symlink | fsat::Stopped::NotDirectory) => return Ok(Found::Missing),
            Err(fsat::Stopped::Missing(e)) => return Err(format!("{:?} cannot be read ({e})", path)),
            Err(fsat::Stopped::Escapes) => return Err(format!("{rel:?} is not a workspace path")),
        },
        None => fsat::dup(&root).map_err(|e| format!("the workspace cannot be reopened ({e})"))?,
    };
    let cname = CString::new(name).map_err(|_| format!("{rel:?} is not a file name"))?;
    let st = match Stat::at(&parent_fd, &cname) {
        Ok(st) => st,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
            return Ok(Found::Missing);
        }
        Err(e) => return Err(format!("{rel:?} cannot be read ({e})")),
    };
    Ok(match st.kind() {
        libc::S_IFREG => Found::File(st),
        libc::S_IFDIR => match fsat::open_dir_at(&parent_fd, &cname) {
            Ok(fd) => Found::Dir(fd),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)) => {
                Found::Missing
            }
            Err(e) => return Err(format!("{rel:?} cannot be read ({e})")),
        },
        _ => Found::Other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn open(p: &Path) -> OwnedFd {
        OwnedFd::from(fs::File::open(p).unwrap())
    }

    fn none(_: BorrowedFd<'_>, _: &str) -> Result<(), Lost> {
        Ok(())
    }

    /// The tree after updating `paths` says what a fresh walk says: prints, bytes, changes.
    fn agrees(
        root: &Path,
        tree: &mut Tree,
        before: &Fingerprints,
        paths: &[&str],
    ) -> (Vec<String>, Vec<String>) {
        let fd = open(root);
        let paths: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
        tree.update(fd.as_fd(), &paths, &BTreeMap::new(), true, &mut none).unwrap();
        let walked = files::measure(fd.as_fd());
        assert_eq!(tree.prints(), walked.prints);
        assert_eq!(tree.bytes(), walked.bytes);
        let changes = tree.changes();
        assert_eq!(changes, files::changes(before, &walked.prints));
        changes
    }

    #[test]
    fn updates_agree_with_a_walk() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/f"), "one").unwrap();
        fs::write(root.join("g"), "two").unwrap();
        let fd = open(root);
        let (m, tree) = Tree::walk(fd.as_fd(), usize::MAX, &mut none);
        let mut tree = tree.unwrap();
        assert_eq!(tree.prints(), m.prints);

        tree.begin_run();
        fs::write(root.join("a/b/f"), "longer").unwrap();
        fs::write(root.join("a/new"), "x").unwrap();
        let (created, modified) = agrees(root, &mut tree, &m.prints, &["a/b/f", "a/new"]);
        assert_eq!((created, modified), (vec!["a/new".to_string()], vec!["a/b/f".to_string()]));

        // A directory renamed: its old name is gone, its new one holds everything again.
        let before = tree.prints();
        tree.begin_run();
        fs::rename(root.join("a"), root.join("c")).unwrap();
        let (created, _) = agrees(root, &mut tree, &before, &["a", "c"]);
        assert_eq!(created, vec!["c/b/f".to_string(), "c/new".to_string()]);

        // A directory swapped for a symlink to one outside: never followed.
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("secret"), "s").unwrap();
        let before = tree.prints();
        tree.begin_run();
        fs::remove_dir_all(root.join("c/b")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("c/b")).unwrap();
        agrees(root, &mut tree, &before, &["c/b", "c/b/f", "c/b/secret"]);
        assert!(!tree.prints().keys().any(|k| k.contains("secret")));
    }

    #[test]
    fn another_name_of_a_linked_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::write(root.join("a"), "one").unwrap();
        let fd = open(root);
        let mut tree = Tree::walk(fd.as_fd(), usize::MAX, &mut none).1.unwrap();
        let before = tree.prints();
        tree.begin_run();
        fs::hard_link(root.join("a"), root.join("b")).unwrap();
        fs::write(root.join("b"), "written through b").unwrap();
        // Only b is named; a changed with it.
        let (created, modified) = agrees(root, &mut tree, &before, &["b"]);
        assert_eq!((created, modified), (vec!["b".to_string()], vec!["a".to_string()]));
        // Written through a name outside the workspace, with no event at all.
        let outside = tempfile::tempdir().unwrap();
        fs::hard_link(root.join("a"), outside.path().join("x")).unwrap();
        let before = tree.prints();
        tree.begin_run();
        fs::write(outside.path().join("x"), "from outside, longer").unwrap();
        let (_, modified) = agrees(root, &mut tree, &before, &[]);
        assert_eq!(modified, vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn what_it_cannot_represent_is_lost_not_guessed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let fd = open(root);
        let mut tree = Tree::walk(fd.as_fd(), usize::MAX, &mut none).1.unwrap();
        fs::write(root.join(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"bad\xff")), "x")
            .unwrap();
        let name = "bad\u{FFFD}".to_string();
        assert!(tree.update(fd.as_fd(), [&name], &BTreeMap::new(), true, &mut none).is_err());
        assert!(tree.update(fd.as_fd(), [&String::new()], &BTreeMap::new(), true, &mut none).is_err());
    }
}
