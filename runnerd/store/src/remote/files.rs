//! File operations of the remote workspace routes, always relative to a workspace directory
//! descriptor and never through a symlink: open for reading, create parents and publish an
//! upload (rename to overwrite, hard link to refuse clobbering), list, and clear.

use std::ffi::CString;
use std::fs::{File, Metadata};

use crate::fsat::{self, Stat};
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::owner::HandOver;
use std::path::{Path, PathBuf};

pub const ESCAPES: &str = "Workspace path escapes through a symbolic link";
pub const NOT_REGULAR: &str = "Workspace path is not a regular file";
pub const PARENT_NOT_DIR: &str = "Workspace parent must be a real directory";
pub const TARGET_SYMLINK: &str = "Workspace target is a symbolic link";
pub const EXISTS: &str = "Remote workspace file already exists";
pub const QUOTA: &str = "Remote workspace exceeds its execution quota";

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("{ESCAPES}")]
    Escapes,
    #[error("{NOT_REGULAR}")]
    NotRegular,
    #[error("{PARENT_NOT_DIR}")]
    ParentNotDir,
    #[error("{TARGET_SYMLINK}")]
    TargetSymlink,
    #[error("{EXISTS}")]
    Exists,
    #[error("{QUOTA}")]
    Quota,
    /// Node's message for a missing file, which the original passes through.
    #[error("ENOENT: no such file or directory, open '{}'", .0.display())]
    NotFound(PathBuf),
    #[error("Could not {what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `openat` of a name given as text (the file routes' names are UTF-8).
fn openat(dir: &OwnedFd, name: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    fsat::open_at(dir, &cname(name)?, flags)
}

/// `lstat` of `name` in `dir` (never follows a final symlink).
fn lstat_at(dir: &OwnedFd, name: &str) -> io::Result<Metadata> {
    std::fs::symlink_metadata(fsat::fd_dir_path(dir).join(name))
}

const DIR_FLAGS: libc::c_int = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW;

fn is_symlink_error(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR))
}

/// Opens a regular file for reading: parents walked without following symlinks; returns the
/// file and its size.
pub fn open_file(root: &OwnedFd, root_path: &Path, segs: &[&str]) -> Result<(File, u64), RemoteError> {
    let full = segs.iter().fold(root_path.to_owned(), |p, s| p.join(s));
    let (name, parents) = segs.split_last().ok_or(RemoteError::NotRegular)?;
    let mut dir =
        root.try_clone().map_err(|e| RemoteError::Io { what: "open", path: full.clone(), source: e })?;
    for seg in parents {
        dir = match openat(&dir, seg, DIR_FLAGS) {
            Ok(d) => d,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(RemoteError::NotFound(full)),
            Err(e) if is_symlink_error(&e) => {
                return Err(if lstat_at(&dir, seg).is_ok_and(|m| m.file_type().is_symlink()) {
                    RemoteError::Escapes
                } else {
                    RemoteError::NotFound(full)
                });
            }
            Err(e) => return Err(RemoteError::Io { what: "open", path: full, source: e }),
        };
    }
    let fd = match openat(&dir, name, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(RemoteError::NotFound(full)),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(RemoteError::Escapes),
        Err(e) => return Err(RemoteError::Io { what: "open", path: full, source: e }),
    };
    let file = File::from(fd);
    let meta = file.metadata().map_err(|e| RemoteError::Io { what: "inspect", path: full, source: e })?;
    if !meta.file_type().is_file() {
        return Err(RemoteError::NotRegular);
    }
    Ok((file, meta.len()))
}

/// The directory an upload lands in, created segment by segment (mode 0777 less umask);
/// what it creates belongs to the sandbox user (`owner`).
pub fn parent_for_write(
    root: &OwnedFd,
    parents: &[&str],
    owner: &dyn HandOver,
) -> Result<OwnedFd, RemoteError> {
    let mut dir = root.try_clone().map_err(|e| RemoteError::Io {
        what: "open",
        path: fsat::fd_dir_path(root),
        source: e,
    })?;
    for seg in parents {
        let name = cname(seg).map_err(|_| RemoteError::ParentNotDir)?;
        let made = match fsat::mkdir_at(&dir, &name, 0o777) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
            Err(e) => {
                return Err(RemoteError::Io {
                    what: "create the directory",
                    path: fsat::fd_dir_path(&dir).join(seg),
                    source: e,
                });
            }
        };
        dir = openat(&dir, seg, DIR_FLAGS).map_err(|_| RemoteError::ParentNotDir)?;
        if made {
            owner.hand_over(dir.as_fd()).map_err(|e| RemoteError::Io {
                what: "hand to the sandbox user",
                path: fsat::fd_dir_path(&dir),
                source: e,
            })?;
        }
    }
    Ok(dir)
}

/// The size of the regular file `name` would replace (0 when there is none); refuses a
/// symlink or anything that is not a regular file.
pub fn replaced_size(parent: &OwnedFd, name: &str) -> Result<u64, RemoteError> {
    match lstat_at(parent, name) {
        Ok(m) if m.file_type().is_symlink() => Err(RemoteError::TargetSymlink),
        Ok(m) if m.file_type().is_file() => {
            use std::os::unix::fs::MetadataExt;
            // The quota's own measure, so what the upload replaces is taken off exactly what
            // the workspace's measurement charged for it.
            Ok(crate::quota::charged(m.size(), m.blocks(), m.blksize()))
        }
        Ok(_) => Err(RemoteError::NotRegular),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => {
            Err(RemoteError::Io { what: "inspect", path: fsat::fd_dir_path(parent).join(name), source: e })
        }
    }
}

/// Moves the staged file next to its target (a temp name, mode `0600 | exec`, owned by the
/// sandbox user), then publishes it: `rename` when overwriting, `link` (no clobber) otherwise.
pub fn publish(
    parent: &OwnedFd,
    name: &str,
    staged: &Path,
    overwrite: bool,
    exec_bits: u32,
    owner: &dyn HandOver,
) -> Result<(), RemoteError> {
    let tmp = format!(".{name}.{}.tmp", crate::versioning::new_uuid_v4());
    let io_err = |what, source| RemoteError::Io { what, path: fsat::fd_dir_path(parent).join(name), source };
    let tmp_path = fsat::fd_dir_path(parent).join(&tmp);
    // The mode is set while the file is still in the private staging directory: once inside
    // the workspace, its name could be swapped for a symlink by a sandbox.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::Permissions::from_mode(0o600 | (exec_bits & 0o111));
    std::fs::set_permissions(staged, mode.clone()).map_err(|e| io_err("set the mode of", e))?;
    let hand_over = |file: &File| owner.hand_over(file.as_fd());
    File::open(staged).and_then(|f| hand_over(&f)).map_err(|e| io_err("hand to the sandbox user", e))?;
    if let Err(e) = std::fs::rename(staged, &tmp_path) {
        if e.raw_os_error() != Some(libc::EXDEV) {
            return Err(io_err("move the upload into", e));
        }
        copy_new(staged, &tmp_path, mode, &hand_over).map_err(|e| io_err("copy the upload into", e))?;
    }
    let cleanup = TempName(tmp_path.clone());
    let (tmp_c, name_c) =
        (cname(&tmp).map_err(|e| io_err("name", e))?, cname(name).map_err(|e| io_err("name", e))?);
    let published = if overwrite {
        fsat::rename_at(parent, &tmp_c, &name_c)
    } else {
        // No clobber; the source is our own regular file.
        fsat::link_at(parent, &tmp_c, &name_c)
    };
    if let Err(e) = published {
        return Err(match e.raw_os_error() {
            Some(libc::EEXIST) => RemoteError::Exists,
            Some(libc::EISDIR) | Some(libc::ENOTDIR) => RemoteError::NotRegular,
            _ => io_err("publish", e),
        });
    }
    drop(cleanup);
    Ok(())
}

/// Removes a temp name on drop (after a rename it is already gone).
struct TempName(PathBuf);

impl Drop for TempName {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Copies into a new file (`O_EXCL`, never through a symlink), mode set on the handle.
fn copy_new(
    from: &Path,
    to: &Path,
    mode: std::fs::Permissions,
    hand_over: &dyn Fn(&File) -> io::Result<()>,
) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut src = File::open(from)?;
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(to)?;
    hand_over(&dst)?;
    io::copy(&mut src, &mut dst)?;
    dst.set_permissions(mode)?;
    dst.sync_all()
}

/// One listed file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub path: String,
    pub size: u64,
    pub mtime_ms: u64,
}

/// Directory levels a listing descends at most (snapshots refuse deeper trees anyway).
const MAX_LIST_DEPTH: usize = crate::versioning::snapshot::MAX_DEPTH;

fn child_path(rel: &str, name: &str) -> String {
    if rel.is_empty() { name.to_owned() } else { format!("{rel}/{name}") }
}

fn listed(path: String, st: &Stat) -> Listed {
    Listed { path, size: st.size, mtime_ms: (st.mtime_ns.max(0) / 1_000_000) as u64 }
}

/// Regular files below the directory `dir` (named `rel`), by descriptor: symlinks are
/// skipped and never followed, even one swapped in mid-walk.
/// The most path text one listing holds: a sandbox can make every path 64 KB long (250
/// levels of 255-byte names), and 50,000 empty files would then take gigabytes of runnerd's
/// memory per request. Past it the listing fails and says so.
pub const MAX_LIST_PATH_BYTES: usize = 64 << 20;

fn walk(dir: &OwnedFd, rel: &str, out: &mut Vec<Listed>, depth: usize) -> io::Result<()> {
    walk_within(dir, rel, out, depth, &mut 0, MAX_LIST_PATH_BYTES)
}

fn walk_within(
    dir: &OwnedFd,
    rel: &str,
    out: &mut Vec<Listed>,
    depth: usize,
    held: &mut usize,
    max_path_bytes: usize,
) -> io::Result<()> {
    if depth >= MAX_LIST_DEPTH {
        return Ok(());
    }
    let mut names = fsat::names(dir)?;
    names.sort();
    for (name, cname) in names {
        let Some(name) = name.to_str() else { continue };
        let Ok(st) = Stat::at(dir, &cname) else { continue };
        *held = held.saturating_add(rel.len() + name.len() + 1);
        if *held > max_path_bytes {
            return Err(io::Error::other(format!(
                "the workspace holds more than {max_path_bytes} bytes of file paths; list a directory of it instead"
            )));
        }
        match st.kind() {
            libc::S_IFDIR => {
                if let Ok(sub) = fsat::open_dir_at(dir, &cname) {
                    walk_within(&sub, &child_path(rel, name), out, depth + 1, held, max_path_bytes)?;
                }
            }
            libc::S_IFREG => out.push(listed(child_path(rel, name), &st)),
            _ => {}
        }
    }
    Ok(())
}

/// Lists the workspace (`selection: None`) or only the selected paths: directories
/// expanded, missing paths ignored, symlinks skipped, a symlink on the way refused.
pub fn list(root: &OwnedFd, selection: Option<&[Vec<&str>]>) -> Result<Vec<Listed>, RemoteError> {
    let io_err = |e| RemoteError::Io { what: "list", path: fsat::fd_dir_path(root), source: e };
    let mut out = Vec::new();
    match selection {
        None => walk(root, "", &mut out, 0).map_err(io_err)?,
        Some(paths) => {
            'paths: for segs in paths {
                let Some((last, parents)) = segs.split_last() else { continue };
                let mut dir = root.try_clone().map_err(io_err)?;
                let mut rel = String::new();
                for seg in parents {
                    let c = cname(seg).map_err(io_err)?;
                    match Stat::at(&dir, &c) {
                        Ok(st) if st.kind() == libc::S_IFLNK => return Err(RemoteError::Escapes),
                        Ok(st) if st.kind() == libc::S_IFDIR => {}
                        _ => continue 'paths,
                    }
                    dir = match fsat::open_dir_at(&dir, &c) {
                        Ok(d) => d,
                        Err(e) if is_symlink_error(&e) => return Err(RemoteError::Escapes),
                        Err(_) => continue 'paths,
                    };
                    rel = child_path(&rel, seg);
                }
                let c = cname(last).map_err(io_err)?;
                let path = child_path(&rel, last);
                match Stat::at(&dir, &c) {
                    Ok(st) if st.kind() == libc::S_IFDIR => {
                        if let Ok(sub) = fsat::open_dir_at(&dir, &c) {
                            walk(&sub, &path, &mut out, segs.len()).map_err(io_err)?;
                        }
                    }
                    Ok(st) if st.kind() == libc::S_IFREG => out.push(listed(path, &st)),
                    _ => {}
                }
            }
            out.sort_by(|a, b| a.path.cmp(&b.path));
            out.dedup_by(|a, b| a.path == b.path);
        }
    }
    out.sort_by(|a, b| super::paths::locale_order(&a.path, &b.path));
    Ok(out)
}

/// Empties the workspace directory (the directory itself stays), by descriptor
/// ([`fsat::remove_tree_at`]). Never follows a symlink: links are removed, not their targets.
pub fn clear(root: &OwnedFd) -> Result<(), RemoteError> {
    let io_err = |e| RemoteError::Io { what: "clear", path: fsat::fd_dir_path(root), source: e };
    for (_, name) in fsat::names(root).map_err(io_err)? {
        fsat::remove_tree_at(root, &name).map_err(io_err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// runnerd's own user: nothing is handed over.
    fn me() -> crate::owner::Keep {
        crate::owner::Keep
    }

    fn root(dir: &Path) -> OwnedFd {
        fsat::open_path(dir, DIR_FLAGS).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()))
    }

    #[test]
    fn a_listing_holds_at_most_its_path_text() {
        let t = tempfile::tempdir().unwrap();
        let long = "n".repeat(200);
        let deep = t.path().join(&long).join(&long);
        std::fs::create_dir_all(&deep).unwrap();
        for i in 0..50 {
            std::fs::write(deep.join(format!("{i}")), "").unwrap();
        }
        let fd = root(t.path());
        let mut out = Vec::new();
        walk_within(&fd, "", &mut out, 0, &mut 0, 1 << 20).unwrap();
        assert_eq!(out.len(), 50);
        let mut out = Vec::new();
        let e = walk_within(&fd, "", &mut out, 0, &mut 0, 4096).unwrap_err();
        assert!(e.to_string().starts_with("the workspace holds more than 4096 bytes of file paths"), "{e}");
    }

    #[test]
    fn reads_refuse_symlinks_and_non_files() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("ws");
        std::fs::create_dir_all(ws.join("d")).unwrap();
        std::fs::write(ws.join("d/f.txt"), "hello").unwrap();
        std::fs::write(t.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(t.path(), ws.join("up")).unwrap();
        std::os::unix::fs::symlink(t.path().join("secret"), ws.join("link")).unwrap();
        let fd = root(&ws);
        let (_, size) = open_file(&fd, &ws, &["d", "f.txt"]).unwrap();
        assert_eq!(size, 5);
        for (segs, want) in [
            (&["up", "secret"][..], ESCAPES.to_owned()),
            (&["link"][..], ESCAPES.to_owned()),
            (&["d"][..], NOT_REGULAR.to_owned()),
            (
                &["nope"][..],
                format!("ENOENT: no such file or directory, open '{}'", ws.join("nope").display()),
            ),
        ] {
            assert_eq!(open_file(&fd, &ws, segs).unwrap_err().to_string(), want, "{segs:?}");
        }
    }

    #[test]
    fn publishing_links_or_renames_and_never_writes_through_a_symlink() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("ws");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(&ws).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("esc")).unwrap();
        let fd = root(&ws);
        let stage = |text: &str| {
            let p = t.path().join(format!("stage-{}", crate::versioning::new_uuid_v4()));
            std::fs::write(&p, text).unwrap();
            p
        };
        let parent = parent_for_write(&fd, &["a", "b"], &me()).unwrap();
        publish(&parent, "f", &stage("one"), false, 0, &me()).unwrap();
        assert_eq!(std::fs::read_to_string(ws.join("a/b/f")).unwrap(), "one");
        assert!(matches!(publish(&parent, "f", &stage("two"), false, 0, &me()), Err(RemoteError::Exists)));
        publish(&parent, "f", &stage("three"), true, 0o111, &me()).unwrap();
        assert_eq!(std::fs::read_to_string(ws.join("a/b/f")).unwrap(), "three");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(ws.join("a/b/f")).unwrap().permissions().mode() & 0o777, 0o711);
        assert!(matches!(parent_for_write(&fd, &["esc", "x"], &me()), Err(RemoteError::ParentNotDir)));
        assert!(std::fs::read_dir(&outside).unwrap().next().is_none(), "nothing written outside");
        std::os::unix::fs::symlink(outside.join("t"), ws.join("a/b/ln")).unwrap();
        assert!(matches!(replaced_size(&parent, "ln"), Err(RemoteError::TargetSymlink)));
        // No temp names are left behind.
        let names: Vec<_> =
            std::fs::read_dir(ws.join("a/b")).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn listing_and_clearing() {
        let t = tempfile::tempdir().unwrap();
        let ws = t.path().join("ws");
        std::fs::create_dir_all(ws.join("inputs/deep")).unwrap();
        std::fs::write(ws.join("inputs/data.txt"), "remote-data").unwrap();
        std::fs::write(ws.join("inputs/deep/x"), "x").unwrap();
        std::fs::write(ws.join("B.txt"), "b").unwrap();
        std::fs::write(t.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(t.path(), ws.join("up")).unwrap();
        let fd = root(&ws);
        let all: Vec<String> = list(&fd, None).unwrap().into_iter().map(|l| l.path).collect();
        assert_eq!(all, vec!["B.txt", "inputs/data.txt", "inputs/deep/x"]);
        let sel = vec![vec!["inputs"], vec!["inputs", "data.txt"], vec!["missing"]];
        let picked: Vec<(String, u64)> =
            list(&fd, Some(&sel)).unwrap().into_iter().map(|l| (l.path, l.size)).collect();
        assert_eq!(picked, vec![("inputs/data.txt".into(), 11), ("inputs/deep/x".into(), 1)]);
        assert!(matches!(list(&fd, Some(&[vec!["up", "secret"]])), Err(RemoteError::Escapes)));
        clear(&fd).unwrap();
        assert!(std::fs::read_dir(&ws).unwrap().next().is_none());
        assert!(t.path().join("secret").exists(), "a symlink's target survives a clear");
    }
}
