//! What a conda fetch step adds to the shared package cache (`scientific-envs/provisioner`,
//! issue #32), and taking it out again when the step was stopped.
//!
//! A fetch step writes the cache holding its exclusive gate ([`super::store`]): nothing else
//! writes it meanwhile, so whatever the cache gains while the step runs is the step's own.
//! The step is measured as its growth — the cache counted now, less the cache counted when
//! it started — against `env_step_max_fetch_bytes` and the entry bound, by the same
//! watchdog as a prefix ([`super::sandboxed`]).
//!
//! A large cache is not walked whole at every poll: the package directories that
//! `pkgs/` held when the step started are left out of every count (the start's and the
//! polls'), so they cancel out. rattler never writes into a finished package directory: it
//! extracts into a fresh hidden directory beside it and renames that in (replacing an entry
//! removes the old directory only then), so a replaced entry is a new directory (a new
//! inode, or a reused one with a new change time) and is counted in full. Everything else (`repodata/`, the lock files, whatever is new) is
//! counted each time; a poll costs a listing of `pkgs/` and a walk of what is not sealed.
//!
//! A step stopped or killed (the watchdog, the file limit, the timeout, out of memory) may
//! leave a half-extracted package behind (rattler's hidden directory, or a finished one
//! whose hash was not recorded yet): [`remove_new`] takes out every entry, one and two
//! levels down, that was not there when the step started or changed since (a lock file or a
//! repodata file rewritten: cache, fetched again when needed).

use std::collections::HashSet;
use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crate::fsat::{self, Stat};
use crate::measure::{self as files, Measured, Unreadable};

/// rattler's package layer inside the cache (`runner-provisioner`'s layout).
const PACKAGES: &CStr = c"pkgs";

/// An entry as it was: device, inode and change time (an inode freed during the step and
/// reused for a new entry is not the old one; a file written since is not either).
type Id = (u64, u64, i128);

fn id(st: &Stat) -> Id {
    (st.dev, st.ino, st.ctime_ns)
}

/// The cache when a step started.
#[derive(Debug, Default)]
pub struct Start {
    /// The directories of the cache root (`pkgs/`, `repodata/`): device and inode only,
    /// since adding an entry changes a directory's change time.
    layers: HashSet<(u64, u64)>,
    /// Every other entry of the cache root and of those directories.
    known: HashSet<Id>,
    /// The package directories of `pkgs/` among them: never counted.
    sealed: HashSet<Id>,
    bytes: u64,
    entries: u64,
}

/// Reads the cache at `root` before a step runs: what it holds one and two levels down, and
/// its count without the package directories. What cannot be read fails the step's start.
pub fn start(root: &OwnedFd) -> io::Result<Start> {
    let mut s = Start::default();
    for (_, name) in fsat::names(root)? {
        let st = Stat::at(root, &name)?;
        if st.kind() != libc::S_IFDIR {
            s.known.insert(id(&st));
            continue;
        }
        s.layers.insert((st.dev, st.ino));
        let dir = fsat::open_dir_at(root, &name)?;
        for (_, child) in fsat::names(&dir)? {
            let cst = Stat::at(&dir, &child)?;
            s.known.insert(id(&cst));
            if name.as_c_str() == PACKAGES && cst.kind() == libc::S_IFDIR {
                s.sealed.insert(id(&cst));
            }
        }
    }
    let m = count(root, &s.sealed);
    if let Some(u) = m.unreadable {
        return Err(io::Error::new(u.error.kind(), format!("{}: {}", u.path, u.error)));
    }
    (s.bytes, s.entries) = (m.bytes, m.entries);
    Ok(s)
}

/// The growth since `start`: `now` less what the start counted (what was removed meanwhile
/// makes it smaller, never below zero); what could not be read stays unreadable. Pure.
pub fn growth(start: &Start, mut now: Measured) -> Measured {
    now.bytes = now.bytes.saturating_sub(start.bytes);
    now.entries = now.entries.saturating_sub(start.entries);
    now
}

/// [`growth`] measured now, on the blocking pool; a walk that could not run fails closed.
pub async fn grown_blocking(root: &OwnedFd, start: &Arc<Start>) -> Measured {
    let (root, start) = match root.try_clone() {
        Ok(fd) => (fd, start.clone()),
        Err(e) => return files::unmeasured(&e.to_string()),
    };
    tokio::task::spawn_blocking(move || growth(&start, count(&root, &start.sealed)))
        .await
        .unwrap_or_else(|e| files::unmeasured(&e.to_string()))
}

/// The cache counted as [`files::count`] counts, the `sealed` directories of `pkgs/` left out.
fn count(root: &OwnedFd, sealed: &HashSet<Id>) -> Measured {
    let mut m = Measured::default();
    let names = match fsat::names(root) {
        Ok(n) => n,
        Err(e) => return fail(m, ".", e),
    };
    for (shown, name) in names {
        let rel = shown.to_string_lossy();
        let Some(st) = stat_or_gone(&mut m, root, &name, &rel) else { continue };
        m.entries = m.entries.saturating_add(1);
        if st.kind() != libc::S_IFDIR {
            add_file(&mut m, &st);
            continue;
        }
        let dir = match fsat::open_dir_at(root, &name) {
            Ok(d) => d,
            Err(e) if gone(&e) => continue,
            Err(e) => return fail(m, &rel, e),
        };
        let children = match fsat::names(&dir) {
            Ok(n) => n,
            Err(e) => return fail(m, &rel, e),
        };
        for (shown, child) in children {
            let rel = format!("{rel}/{}", shown.to_string_lossy());
            let Some(cst) = stat_or_gone(&mut m, &dir, &child, &rel) else { continue };
            if cst.kind() == libc::S_IFDIR && sealed.contains(&id(&cst)) {
                continue;
            }
            m.entries = m.entries.saturating_add(1);
            if cst.kind() != libc::S_IFDIR {
                add_file(&mut m, &cst);
                continue;
            }
            let sub = match fsat::open_dir_at(&dir, &child) {
                Ok(d) => files::count(d.as_fd()),
                Err(e) if gone(&e) => continue,
                Err(e) => return fail(m, &rel, e),
            };
            m.bytes = m.bytes.saturating_add(sub.bytes);
            m.entries = m.entries.saturating_add(sub.entries);
            if let Some(u) = sub.unreadable {
                let path = if u.path == "." { rel } else { format!("{rel}/{}", u.path) };
                m.unreadable = Some(Unreadable { path, error: u.error });
                return m;
            }
        }
    }
    m
}

fn add_file(m: &mut Measured, st: &Stat) {
    if st.kind() == libc::S_IFREG {
        m.bytes = m.bytes.saturating_add(files::charged(st.size, st.blocks, st.blksize));
    }
}

/// Removed or swapped since it was listed: nothing to count there.
fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP))
}

fn stat_or_gone(m: &mut Measured, dir: &OwnedFd, name: &CStr, rel: &str) -> Option<Stat> {
    match Stat::at(dir, name) {
        Ok(st) => Some(st),
        Err(e) if gone(&e) => None,
        Err(e) => {
            if m.unreadable.is_none() {
                m.unreadable = Some(Unreadable { path: rel.to_owned(), error: e });
            }
            None
        }
    }
}

fn fail(mut m: Measured, rel: &str, error: io::Error) -> Measured {
    m.unreadable.get_or_insert(Unreadable { path: rel.to_owned(), error });
    m
}

/// Removes every entry of the cache root and of its directories that was not there at
/// `start`, or has changed since (no link followed, bounded descriptors: [`fsat::remove_tree_at`]); the number
/// removed, and the first failure (the rest is still tried).
pub fn remove_new(root: &OwnedFd, start: &Start) -> (u64, Option<io::Error>) {
    let (mut removed, mut first) = (0u64, None);
    let mut remove =
        |dir: &OwnedFd, name: &CStr, first: &mut Option<io::Error>| match fsat::remove_tree_at(dir, name) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        };
    let names = match fsat::names(root) {
        Ok(n) => n,
        Err(e) => return (0, Some(e)),
    };
    for (_, name) in names {
        let Ok(st) = Stat::at(root, &name) else { continue };
        let layer = st.kind() == libc::S_IFDIR && start.layers.contains(&(st.dev, st.ino));
        if !layer {
            if !start.known.contains(&id(&st)) {
                remove(root, &name, &mut first);
            }
            continue;
        }
        let listed = fsat::open_dir_at(root, &name).and_then(|dir| Ok((fsat::names(&dir)?, dir)));
        let (children, dir) = match listed {
            Ok(l) => l,
            Err(e) => {
                first.get_or_insert(e);
                continue;
            }
        };
        for (_, child) in children {
            if Stat::at(&dir, &child).is_ok_and(|cst| !start.known.contains(&id(&cst))) {
                remove(&dir, &child, &mut first);
            }
        }
    }
    (removed, first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn open(p: &Path) -> OwnedFd {
        fsat::open_path(p, libc::O_RDONLY | libc::O_DIRECTORY).unwrap()
    }

    #[test]
    fn growth_is_the_count_now_less_the_start_and_never_negative() {
        let at = |bytes, entries| Start { bytes, entries, ..Start::default() };
        let now = |bytes, entries| {
            let mut m = Measured::default();
            (m.bytes, m.entries) = (bytes, entries);
            m
        };
        for ((b0, e0), (b1, e1), want) in [
            ((100, 10), (100, 10), (0, 0)),
            ((100, 10), (1100, 15), (1000, 5)),
            ((100, 10), (40, 2), (0, 0)),
            ((0, 0), (u64::MAX, 7), (u64::MAX, 7)),
        ] {
            let g = growth(&at(b0, e0), now(b1, e1));
            assert_eq!((g.bytes, g.entries), want, "{b0},{e0} -> {b1},{e1}");
        }
        let mut unreadable = now(0, 0);
        unreadable.unreadable = Some(Unreadable { path: "pkgs/x".into(), error: io::Error::other("no") });
        assert_eq!(growth(&at(5, 5), unreadable).unreadable.unwrap().path, "pkgs/x");
    }

    /// The layout runner-provisioner leaves: packages and their lock files in `pkgs/`,
    /// repodata beside it.
    fn cache() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let pkgs = tmp.path().join("pkgs");
        std::fs::create_dir_all(pkgs.join("old-1.0-0/info")).unwrap();
        std::fs::write(pkgs.join("old-1.0-0/info/index.json"), vec![b'x'; 5000]).unwrap();
        std::fs::write(pkgs.join("old-1.0-0.lock"), "1").unwrap();
        std::fs::create_dir_all(tmp.path().join("repodata")).unwrap();
        std::fs::write(tmp.path().join("repodata/abc.json"), "{}").unwrap();
        std::fs::write(tmp.path().join("repodata/untouched.json"), "{}").unwrap();
        tmp
    }

    #[test]
    fn a_step_is_charged_what_it_adds_and_not_the_packages_it_found() {
        let tmp = cache();
        let root = open(tmp.path());
        let start = start(&root).unwrap();
        // pkgs, repodata, the lock file and the two repodata files: the sealed package is
        // not counted.
        assert_eq!((start.bytes, start.entries), (5, 5));
        let grown = |start: &Start| growth(start, count(&root, &start.sealed));
        let g = grown(&start);
        assert_eq!((g.bytes, g.entries), (0, 0));

        // A half-extracted package (rattler's hidden directory), repodata grown in place.
        let pkgs = tmp.path().join("pkgs");
        std::fs::create_dir_all(pkgs.join(".new-1.0-0abc/lib")).unwrap();
        std::fs::write(pkgs.join(".new-1.0-0abc/lib/zeros"), vec![0u8; 10_000]).unwrap();
        std::fs::write(tmp.path().join("repodata/abc.json"), "{\"a\": 1}").unwrap();
        let g = grown(&start);
        assert_eq!((g.bytes, g.entries), (10_006, 3));

        // A sealed package replaced as rattler does (extracted beside it, the old one
        // removed, the new one renamed in) counts in full.
        std::fs::create_dir_all(pkgs.join(".old-1.0-0xyz")).unwrap();
        std::fs::write(pkgs.join(".old-1.0-0xyz/big"), vec![1u8; 7000]).unwrap();
        std::fs::remove_dir_all(pkgs.join("old-1.0-0")).unwrap();
        std::fs::rename(pkgs.join(".old-1.0-0xyz"), pkgs.join("old-1.0-0")).unwrap();
        let g = grown(&start);
        assert_eq!((g.bytes, g.entries), (17_006, 5));

        // A stopped step's additions and changes go; what it left as it was stays.
        let (removed, failed) = remove_new(&root, &start);
        assert!(failed.is_none(), "{failed:?}");
        assert_eq!(removed, 3, "the hidden directory, the replaced package, the rewritten repodata");
        let mut left: Vec<_> = std::fs::read_dir(&pkgs).unwrap().map(|e| e.unwrap().file_name()).collect();
        left.sort();
        assert_eq!(left, ["old-1.0-0.lock"]);
        let repodata: Vec<_> =
            std::fs::read_dir(tmp.path().join("repodata")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(repodata, ["untouched.json"]);
        let g = grown(&start);
        assert_eq!((g.bytes, g.entries), (0, 0));
    }

    #[test]
    fn what_cannot_be_read_fails_closed_with_its_path() {
        let tmp = cache();
        let root = open(tmp.path());
        let start = start(&root).unwrap();
        let deep = tmp.path().join("pkgs/.new-1.0-0abc");
        let mut p = deep.clone();
        for _ in 0..=files::MAX_WALK_DEPTH {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let u = count(&root, &start.sealed).unreadable.expect("too deep to count");
        assert!(u.path.starts_with("pkgs/.new-1.0-0abc/d/d"), "{}", u.path);
        let (removed, failed) = remove_new(&root, &start);
        assert!(failed.is_none() && removed == 1 && !deep.exists(), "{failed:?}");
    }
}
