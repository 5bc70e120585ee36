//! Whether a directory holds exactly a tree, checked without storing anything (issue #34):
//! the names of each directory are the tree's, in the order a snapshot writes them; each
//! entry is the kind the tree says, files of its size, execute bits and a data-pool content
//! ref, symlinks of its target. A snapshot of such a directory records this very tree — as
//! long as the files hold the bytes their refs name, which is what [`super::materialize`]
//! wrote into its private staging directory from objects checked by their digests. A move
//! checks the staged tree this way before the live copy is touched, and the workspace again
//! once it is swapped in, instead of snapshotting (which would stream every file into the
//! store once more, to find each object already there).

use std::collections::HashSet;
use std::ffi::{CStr, OsStr};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use super::TransferError;
use super::materialize::{Entry, entries_at};
use crate::fsat::{self, Stat};
use crate::versioning::{OCTET_STREAM, Pool, Ref, Store};

/// Directory levels checked at most (a snapshot walks no deeper).
const MAX_DEPTH: usize = crate::versioning::snapshot::MAX_DEPTH;

/// `Ok` when `dir` holds exactly `tree`; the first difference otherwise.
pub fn matches_tree(store: &Store, tree: &Ref, dir: BorrowedFd<'_>) -> Result<(), TransferError> {
    let dir = fsat::dup(&dir).map_err(|source| TransferError::Io {
        what: "reopen",
        path: PathBuf::new(),
        source,
    })?;
    check(store, tree, &dir, PathBuf::new(), 0).map_err(|found| match found {
        Differs::Found(found) => TransferError::TreeMismatch { expected: tree.digest.clone(), found },
        Differs::Failed(e) => e,
    })
}

enum Differs {
    /// Where and how the directory differs from the tree.
    Found(String),
    Failed(TransferError),
}

impl From<TransferError> for Differs {
    fn from(e: TransferError) -> Differs {
        Differs::Failed(e)
    }
}

fn name_of(e: &Entry) -> &CStr {
    match e {
        Entry::File { name, .. } | Entry::Dir { name, .. } | Entry::Symlink { name, .. } => name,
    }
}

fn check(store: &Store, tree: &Ref, dir: &OwnedFd, path: PathBuf, depth: usize) -> Result<(), Differs> {
    let at = |what: &str, name: &CStr| {
        let mut p = path.clone();
        p.push(OsStr::from_bytes(name.to_bytes()));
        Differs::Found(format!("{}: {what}", p.display()))
    };
    if depth > MAX_DEPTH {
        return Err(Differs::Found(format!("{}: deeper than {MAX_DEPTH} levels", path.display())));
    }
    let entries = entries_at(store, tree, || path.clone())?;
    // A snapshot lists a directory's names sorted as bytes: a tree in another order is not
    // one a snapshot of these files would record.
    if entries.windows(2).any(|w| name_of(&w[0]).to_bytes() >= name_of(&w[1]).to_bytes()) {
        return Err(Differs::Found(format!("{}: entries out of order", path.display())));
    }
    let io = |what: &'static str| {
        let path = path.clone();
        move |source| Differs::Failed(TransferError::Io { what, path, source })
    };
    let live = fsat::names(dir).map_err(io("list"))?;
    let wanted: HashSet<&[u8]> = entries.iter().map(|e| name_of(e).to_bytes()).collect();
    if live.len() != entries.len() || live.iter().any(|(_, c)| !wanted.contains(c.to_bytes())) {
        return Err(Differs::Found(format!("{}: other names than the tree's", path.display())));
    }
    for entry in &entries {
        let name = name_of(entry);
        let st = Stat::at(dir, name).map_err(io("stat"))?;
        match entry {
            Entry::File { content, exec, .. } => {
                if st.kind() != libc::S_IFREG {
                    return Err(at("not a regular file", name));
                }
                if st.size != content.size || st.mode & 0o111 != *exec {
                    return Err(at("size or execute bits differ", name));
                }
                if content.pool != Pool::Data || content.media_type != OCTET_STREAM {
                    return Err(at("content is not a data-pool octet-stream ref", name));
                }
            }
            Entry::Symlink { target, .. } => {
                if st.kind() != libc::S_IFLNK {
                    return Err(at("not a symbolic link", name));
                }
                if fsat::readlink_at(dir, name).map_err(io("read a link"))? != target.to_bytes() {
                    return Err(at("link target differs", name));
                }
            }
            Entry::Dir { tree: sub, .. } => {
                if st.kind() != libc::S_IFDIR {
                    return Err(at("not a directory", name));
                }
                let child = fsat::open_dir_at(dir, name).map_err(io("open"))?;
                let mut p = path.clone();
                p.push(OsStr::from_bytes(name.to_bytes()));
                check(store, sub, &child, p, depth + 1)?;
            }
        }
    }
    Ok(())
}
