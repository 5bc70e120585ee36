//! Whether a workspace holds nested workspaces ([`contains_nested`]): their leases live in a
//! `.workspace-coordination` directory inside it, so moving, replacing or sweeping it would
//! take live leases (and the workspaces they guard) with it.
//!
//! The directory was written by a sandbox, so the walk is the one every walk over a workspace
//! is: by descriptor, never following a link, iterative, with at most [`OPEN_LEVELS`]
//! directory descriptors however deep (a level above them is reopened through its child's
//! `..` and must still be the directory it was, by dev/ino).

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use super::TransferError;
use crate::fsat::{self, Stat};

/// Directory levels that keep their descriptor open.
pub(super) const OPEN_LEVELS: usize = 64;

/// One directory being looked through.
struct Level {
    /// Closed above the [`OPEN_LEVELS`] deepest levels.
    fd: Option<OwnedFd>,
    name: CString,
    /// (dev, ino), to recognise the directory when it is reopened through `..`.
    id: (u64, u64),
    /// Its subdirectories not yet looked into.
    pending: Vec<CString>,
}

/// Whether any directory at any depth under `dir`, `dir` included, holds an entry (of any
/// kind) named `.workspace-coordination`: then nested workspaces live inside it, and callers
/// refuse to move, replace or sweep it. Links are never followed (a link to another
/// workspace is not a workspace inside this one); an entry that vanishes meanwhile is not
/// an error. A directory that cannot be read is an error: the answer would be a guess.
pub fn contains_nested(dir: BorrowedFd<'_>) -> Result<bool, TransferError> {
    let root = fsat::dup(&dir).map_err(|source| failed("open", PathBuf::from("."), source))?;
    let Some(first) = list(root, CString::default(), &[])? else { return Ok(true) };
    let mut stack = vec![first];
    while let Some(level) = stack.last_mut() {
        let Some(name) = level.pending.pop() else {
            let done = stack.pop().expect("checked above");
            if let Some(parent) = stack.last_mut().filter(|p| p.fd.is_none()) {
                reopen(parent, &done)?;
            }
            continue;
        };
        let fd = level.fd.as_ref().expect("the deepest level is open");
        let sub = match fsat::open_dir_at(fd, &name) {
            Ok(sub) => sub,
            // Gone, or no longer a directory (a link put in its place): nothing beneath it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)) => {
                continue;
            }
            Err(e) => return Err(failed("open", shown(&stack, &name), e)),
        };
        let Some(level) = list(sub, name, &stack)? else { return Ok(true) };
        stack.push(level);
        if let Some(far) = stack.len().checked_sub(OPEN_LEVELS + 1) {
            stack[far].fd = None;
        }
    }
    Ok(false)
}

/// Lists the directory `fd` (named `name` below `stack`): `None` when it holds the
/// coordination directory's name, else its level with its subdirectories pending.
fn list(fd: OwnedFd, name: CString, stack: &[Level]) -> Result<Option<Level>, TransferError> {
    let here = || shown(stack, &name);
    let st = Stat::of_fd(&fd).map_err(|e| failed("inspect", here(), e))?;
    let mut pending = Vec::new();
    let listing = std::fs::read_dir(fsat::fd_dir_path(&fd)).map_err(|e| failed("list", here(), e))?;
    for entry in listing {
        let entry = entry.map_err(|e| failed("list", here(), e))?;
        let entry_name = entry.file_name();
        if entry_name.as_bytes() == common::layout::COORDINATION_DIR.as_bytes() {
            return Ok(None);
        }
        // From the directory entry, or an lstat: a link is never taken for its target.
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => pending.push(
                CString::new(entry_name.into_vec())
                    .map_err(|e| failed("list", here(), io::Error::other(e)))?,
            ),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(failed("inspect", shown(stack, &name).join(&entry_name), e)),
        }
    }
    Ok(Some(Level { fd: Some(fd), name, id: (st.dev, st.ino), pending }))
}

/// Reopens the closed `level` through the `..` of its finished child, refusing anything but
/// the directory it was.
fn reopen(level: &mut Level, child: &Level) -> Result<(), TransferError> {
    let from = child.fd.as_ref().expect("a finished level is the deepest, open");
    let path = || PathBuf::from(OsStr::from_bytes(level.name.as_bytes()));
    let fd = fsat::open_dir_at(from, c"..").map_err(|e| failed("reopen", path(), e))?;
    let st = Stat::of_fd(&fd).map_err(|e| failed("reopen", path(), e))?;
    if (st.dev, st.ino) != level.id {
        let moved = io::Error::other("a directory being looked through was moved meanwhile");
        return Err(failed("reopen", path(), moved));
    }
    level.fd = Some(fd);
    Ok(())
}

/// The workspace-relative path of `name` below the levels on `stack`, for errors.
fn shown(stack: &[Level], name: &CString) -> PathBuf {
    let mut path: PathBuf = stack.iter().skip(1).map(|l| OsStr::from_bytes(l.name.as_bytes())).collect();
    if !name.as_bytes().is_empty() {
        path.push(OsStr::from_bytes(name.as_bytes()));
    }
    path
}

fn failed(what: &'static str, path: PathBuf, source: io::Error) -> TransferError {
    TransferError::Io { what, path, source }
}

#[cfg(test)]
mod tests {
    use std::fs::{self, File};
    use std::os::fd::AsFd;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    use super::*;

    fn nested(dir: &Path) -> bool {
        contains_nested(File::open(dir).unwrap().as_fd()).unwrap()
    }

    #[test]
    fn a_coordination_entry_at_any_depth_is_found_and_links_are_not_followed() {
        let base = tempfile::tempdir().unwrap();
        let ws = base.path().join("ws");
        fs::create_dir_all(ws.join("a/b/c")).unwrap();
        fs::write(ws.join("a/b/f"), "x").unwrap();
        assert!(!nested(&ws), "no workspace inside");

        // Another workspace's leases, reached only through a link: not inside this one.
        let other = base.path().join("other");
        fs::create_dir_all(other.join(".workspace-coordination")).unwrap();
        symlink(&other, ws.join("a/link")).unwrap();
        assert!(!nested(&ws));

        fs::create_dir(ws.join("a/b/c/.workspace-coordination")).unwrap();
        assert!(nested(&ws), "a directory deep down");
        fs::remove_dir(ws.join("a/b/c/.workspace-coordination")).unwrap();
        fs::write(ws.join("a/b/.workspace-coordination"), "").unwrap();
        assert!(nested(&ws), "any kind of entry");
        fs::remove_file(ws.join("a/b/.workspace-coordination")).unwrap();
        symlink("nowhere", ws.join(".workspace-coordination")).unwrap();
        assert!(nested(&ws), "at the top, even a dangling link");
        // Names that only resemble it are no workspace.
        fs::remove_file(ws.join(".workspace-coordination")).unwrap();
        fs::create_dir(ws.join("a/.workspace-coordination2")).unwrap();
        assert!(!nested(&ws));
    }

    /// Three times deeper than the descriptors it may hold, in a child whose descriptor limit
    /// is a little above them.
    #[test]
    fn a_deep_tree_is_looked_through_with_few_descriptors() {
        const CHILD: &str = "NESTED_DEEP_CHILD_ROOT";
        if let Some(root) = std::env::var_os(CHILD) {
            let cap = (OPEN_LEVELS + 40) as libc::rlim_t;
            let limit = libc::rlimit { rlim_cur: cap, rlim_max: cap };
            // SAFETY: setrlimit reads the struct; lowering our own limit is always allowed.
            common::sys::cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }).unwrap();
            // The whole walk, down and back up through every closed level; then a find at the
            // bottom.
            let root = Path::new(&root);
            assert!(!nested(root));
            let bottom = (0..OPEN_LEVELS * 3).fold(root.to_owned(), |p, _| p.join("d"));
            fs::create_dir(bottom.join(".workspace-coordination")).unwrap();
            assert!(nested(root));
            return;
        }
        let base = tempfile::tempdir().unwrap();
        let ws = base.path().join("ws");
        let mut deep = ws.clone();
        for i in 0..(OPEN_LEVELS * 3) {
            deep.push("d");
            // Siblings on the way down, looked through after the deep branch.
            fs::create_dir_all(deep.with_file_name(format!("s{i}"))).unwrap();
        }
        fs::create_dir_all(&deep).unwrap();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transfer::nested::tests::a_deep_tree_is_looked_through_with_few_descriptors",
                "--test-threads=1",
            ])
            .env(CHILD, &ws)
            .status()
            .unwrap();
        assert!(status.success(), "the walk ran out of descriptors or failed");
        assert!(deep.join(".workspace-coordination").is_dir());
    }
}
