//! Filesystem access relative to directory descriptors, never re-resolving a path from `/`
//! and never following a final symlink: what every walk over a workspace (snapshots,
//! listings) uses, so that a sandbox swapping a directory for a symlink mid-walk cannot
//! lead it outside.

use std::ffi::{CStr, CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use common::sys::cvt;

/// The `lstat` fields a walk looks at, read relative to a directory descriptor
/// (`fstatat`), so no path is resolved again below the root.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u64,
    /// 512-byte blocks allocated (`st_blocks`): what the file really takes on disk.
    pub blocks: u64,
    /// The filesystem's block size for this file (`st_blksize`).
    pub blksize: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
    pub atime_ns: i128,
}

impl Stat {
    fn from_raw(st: &libc::stat) -> Stat {
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Stat {
            dev: st.st_dev,
            ino: st.st_ino,
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            nlink: st.st_nlink,
            blocks: st.st_blocks as u64,
            blksize: st.st_blksize as u64,
            mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
            ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
            atime_ns: ns(st.st_atime, st.st_atime_nsec),
        }
    }

    /// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
    pub fn at(dir: &impl AsRawFd, name: &CStr) -> io::Result<Stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstatat writes a full `stat` into the buffer on success (checked); the
        // name is NUL-terminated and the descriptor is ours.
        cvt(unsafe {
            libc::fstatat(dir.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW)
        })?;
        // SAFETY: initialised by the successful call above.
        let st = unsafe { st.assume_init() };
        Ok(Stat::from_raw(&st))
    }

    /// `fstat(fd)`.
    pub fn of_fd(fd: &impl AsRawFd) -> io::Result<Stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: as above, for fstat on a descriptor we own.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
        // SAFETY: initialised by the successful call above.
        let st = unsafe { st.assume_init() };
        Ok(Stat::from_raw(&st))
    }

    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
}

/// `fsync` of the directory `dir` names (what was renamed into or out of it is durable).
pub fn sync_dir(dir: &impl AsRawFd) -> io::Result<()> {
    std::fs::File::from(open_at(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY)?).sync_all()
}

pub fn open_at(dir: &impl AsRawFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: openat relative to a directory descriptor we own, NUL-terminated name.
    let fd = cvt(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Creates a file `O_CREAT | O_EXCL | O_NOFOLLOW` (never through a symlink, never an
/// existing file) with `mode`, opened for writing.
pub fn create_new_at(dir: &impl AsRawFd, name: &CStr, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: openat relative to a directory descriptor we own, NUL-terminated name; the mode
    // is passed as the variadic third argument openat expects with O_CREAT.
    let fd = cvt(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, libc::c_uint::from(mode)) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens `name` for writing, creating it (`mode`) if it is absent, never through a symlink
/// (`O_NOFOLLOW`) and never blocking on a FIFO (`O_NONBLOCK`). Nothing is truncated here:
/// check what was opened first.
pub fn open_or_create_at(dir: &impl AsRawFd, name: &CStr, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: as in `create_new_at`.
    let fd = cvt(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, libc::c_uint::from(mode)) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `open(path, flags | O_CLOEXEC)` of an absolute path: where a walk starts (the data
/// directory, a store's own directory), never a name below a workspace.
pub fn open_path(path: &std::path::Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: open(2) of a NUL-terminated path; the result is checked.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `renameat(dir, from, dir, to)`: replaces `to` (never following a symlink at either name).
pub fn rename_at(dir: &impl AsRawFd, from: &CStr, to: &CStr) -> io::Result<()> {
    // SAFETY: renameat between NUL-terminated names in one directory descriptor we own.
    cvt(unsafe { libc::renameat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr()) })?;
    Ok(())
}

/// `renameat2(dir, from, dir, to, RENAME_NOREPLACE)`: moves a name (never following a
/// symlink at either) only if `to` does not exist; an existing `to` is `AlreadyExists`.
pub fn rename_noreplace_at(dir: &impl AsRawFd, from: &CStr, to: &CStr) -> io::Result<()> {
    // SAFETY: renameat2 between NUL-terminated names in one directory descriptor we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            dir.as_raw_fd(),
            from.as_ptr(),
            dir.as_raw_fd(),
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    match cvt(r) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
            Err(io::Error::from_raw_os_error(libc::EEXIST))
        }
        r => r.map(|_| ()),
    }
}

/// `renameat(from_dir, from, to_dir, to)`: moves a name into another directory (both held
/// by descriptor), replacing `to`; neither name is followed.
pub fn rename_between(
    from_dir: &impl AsRawFd,
    from: &CStr,
    to_dir: &impl AsRawFd,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: renameat between NUL-terminated names in two directory descriptors we own.
    cvt(unsafe { libc::renameat(from_dir.as_raw_fd(), from.as_ptr(), to_dir.as_raw_fd(), to.as_ptr()) })?;
    Ok(())
}

/// `linkat(dir, from, dir, to, 0)`: a second name, never replacing one (`EEXIST`); without
/// `AT_SYMLINK_FOLLOW` a symlink at `from` is linked itself, never its target.
pub fn link_at(dir: &impl AsRawFd, from: &CStr, to: &CStr) -> io::Result<()> {
    // SAFETY: linkat between NUL-terminated names in one directory descriptor we own.
    cvt(unsafe { libc::linkat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr(), 0) })?;
    Ok(())
}

/// `mkdirat(dir, name, mode)`; an existing entry (of any kind) is `AlreadyExists`.
pub fn mkdir_at(dir: &impl AsRawFd, name: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: mkdirat relative to a directory descriptor we own, NUL-terminated name.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) })?;
    Ok(())
}

/// Creates an empty regular file without opening it (`mknodat(S_IFREG)`): no descriptor
/// of it exists in this process afterwards, so none is closed later (closing any
/// descriptor of a file drops every POSIX lock this process holds on it). Never follows
/// a symlink: any existing entry is `AlreadyExists`.
pub fn mknod_regular_at(dir: &impl AsRawFd, name: &CStr, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: mknodat relative to a directory descriptor we own, NUL-terminated name; a
    // regular file needs no device number.
    cvt(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), libc::S_IFREG | mode, 0) })?;
    Ok(())
}

/// `symlinkat(target, dir, name)`: a new symlink with the raw `target` bytes (never
/// resolved); an existing entry of any kind is `AlreadyExists`.
pub fn symlink_at(dir: &impl AsRawFd, name: &CStr, target: &CStr) -> io::Result<()> {
    // SAFETY: symlinkat with NUL-terminated strings relative to a directory descriptor we own.
    cvt(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) })?;
    Ok(())
}

/// `fchownat(dir, name, uid, gid, AT_SYMLINK_NOFOLLOW)`: changes the entry itself (a
/// symlink's own owner, never its target's).
pub fn lchown_at(dir: &impl AsRawFd, name: &CStr, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: fchownat relative to a directory descriptor we own, NUL-terminated name.
    cvt(unsafe { libc::fchownat(dir.as_raw_fd(), name.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(())
}

/// `fchmod(fd, mode)` of a file or directory opened (not `O_PATH`): exactly `mode`, no umask.
pub fn fchmod(fd: &impl AsRawFd, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: fchmod of a descriptor we own; the result is checked.
    cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode) })?;
    Ok(())
}

/// `unlinkat(dir, name, 0)`: removes the entry itself (a symlink, never its target).
pub fn unlink_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: unlinkat relative to a directory descriptor we own, NUL-terminated name.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })?;
    Ok(())
}

/// `unlinkat(dir, name, AT_REMOVEDIR)`: removes an empty directory.
pub fn rmdir_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<()> {
    // SAFETY: unlinkat relative to a directory descriptor we own, NUL-terminated name.
    cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
    Ok(())
}

/// Levels of [`remove_tree_at`] that keep their descriptor open; deeper ones close theirs
/// and are reopened through `..` on the way back up.
const REMOVE_OPEN_LEVELS: usize = 64;
/// Names of one directory [`remove_tree_at`] holds in memory at a time.
const REMOVE_BATCH: usize = 4096;

/// Removes `name` below `dir`, and when it is a directory everything in it, by descriptor:
/// each level opened `O_DIRECTORY | O_NOFOLLOW` from its parent, anything else (a symlink
/// included: removed, never followed) unlinked. The tree may have been built by a sandbox to
/// hurt whoever removes it, so nothing grows with it: no recursion (a chain deeper than a
/// thread's stack), at most [`REMOVE_OPEN_LEVELS`] descriptors (a level above them is
/// reopened through `..` of its child, and must still be the directory it was, by dev/ino),
/// and at most [`REMOVE_BATCH`] names of each open level in memory (a level is listed again
/// until it is empty; a closed one keeps none). Entries that vanish meanwhile are not an error.
pub fn remove_tree_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<()> {
    let mut stack: Vec<RemovedLevel> = match RemovedLevel::open(&dir.as_raw_fd(), name) {
        Ok(Some(top)) => vec![top],
        Ok(None) => return Ok(()),
        Err(e) if is_gone(&e) => return Ok(()),
        Err(e) => return Err(e),
    };
    while let Some(level) = stack.last_mut() {
        // The deepest level's descriptor is always open.
        let Some(fd) = level.fd.as_ref() else { return Err(io::Error::other("remove_tree_at lost a level")) };
        if let Some(child) = level.pending.pop() {
            match RemovedLevel::open(fd, &child) {
                Ok(Some(sub)) => {
                    stack.push(sub);
                    if let Some(far) = stack.len().checked_sub(REMOVE_OPEN_LEVELS + 1) {
                        // Its names go too (it is listed again when reopened): memory stays
                        // bounded by the open levels, not by the depth.
                        stack[far].fd = None;
                        stack[far].pending = Vec::new();
                    }
                }
                Ok(None) => {}
                Err(e) if is_gone(&e) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        let more = removal_batch(fd)?;
        if !more.is_empty() {
            level.pending = more;
            continue;
        }
        let done = stack.pop().expect("a level is on the stack");
        let parent = match stack.last_mut() {
            None => dir.as_raw_fd(),
            Some(up) => up.reopened_above(&done)?.as_raw_fd(),
        };
        match rmdir_at(&parent, &done.name) {
            Err(e) if !is_gone(&e) => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// One directory level [`remove_tree_at`] is emptying.
struct RemovedLevel {
    /// Closed above the [`REMOVE_OPEN_LEVELS`] deepest levels.
    fd: Option<OwnedFd>,
    name: CString,
    /// (dev, ino), to recognise the directory when it is reopened through `..`.
    id: (u64, u64),
    /// Names still to remove ([`REMOVE_BATCH`] at most; none while closed).
    pending: Vec<CString>,
}

impl RemovedLevel {
    /// Opens the directory `name` below `parent` and lists its first names; `None` when it is
    /// no directory (a symlink included), which is unlinked instead.
    fn open(parent: &dyn AsRawFd, name: &CStr) -> io::Result<Option<RemovedLevel>> {
        let opened = match open_dir_at(&parent.as_raw_fd(), name) {
            // A directory its owner cannot read or search (a sandbox's `chmod 000`, which an
            // unprivileged runnerd, the same user, cannot pass): made the owner's again.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
                own_again_at(&parent.as_raw_fd(), name)?;
                open_dir_at(&parent.as_raw_fd(), name)
            }
            other => other,
        };
        match opened {
            Ok(fd) => {
                let st = Stat::of_fd(&fd)?;
                if st.mode & 0o300 != 0o300 {
                    // Its entries could not be unlinked (no write or search for its owner).
                    chmod_fd(&fd, 0o700)?;
                }
                let pending = removal_batch(&fd)?;
                Ok(Some(RemovedLevel { fd: Some(fd), name: name.to_owned(), id: (st.dev, st.ino), pending }))
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                unlink_at(&parent.as_raw_fd(), name).map(|()| None)
            }
            Err(e) => Err(e),
        }
    }

    /// This level's descriptor, to remove its emptied child `done` from: reopened through
    /// the child's `..` if it was closed, and refused unless it is still the same directory.
    fn reopened_above(&mut self, done: &RemovedLevel) -> io::Result<&OwnedFd> {
        if self.fd.is_none() {
            let child = done.fd.as_ref().expect("the deepest level is open");
            let reopened = open_dir_at(child, c"..")?;
            let st = Stat::of_fd(&reopened)?;
            if (st.dev, st.ino) != self.id {
                return Err(io::Error::other("a directory being removed was moved meanwhile"));
            }
            self.fd = Some(reopened);
        }
        self.fd.as_ref().ok_or_else(|| io::Error::other("remove_tree_at lost a level"))
    }
}

/// The next [`REMOVE_BATCH`] names of the directory `fd`.
fn removal_batch(fd: &OwnedFd) -> io::Result<Vec<CString>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(fd_dir_path(fd))?.take(REMOVE_BATCH) {
        let name = entry?.file_name();
        out.push(
            CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()))
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?,
        );
    }
    Ok(out)
}

/// An entry that vanished meanwhile: not an error while removing.
fn is_gone(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOENT)
}

/// Gives the directory `name` below `dir` mode 0700 without following a link: opened
/// `O_PATH` (which needs no permission on it), then changed through its descriptor. The
/// kernel allows it only to the owner (or root).
fn own_again_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<()> {
    let fd = open_at(dir, name, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
    chmod_fd(&fd, 0o700)
}

/// `chmod` of what `fd` names (an `O_PATH` descriptor included: fchmod refuses those, the
/// `/proc/self/fd` link reaches the same inode and nothing else).
fn chmod_fd(fd: &OwnedFd, mode: libc::mode_t) -> io::Result<()> {
    let path = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL in a number");
    // SAFETY: chmod(2) of a NUL-terminated path; the result is checked.
    cvt(unsafe { libc::chmod(path.as_ptr(), mode) }).map(drop)
}

/// `dup` with close-on-exec.
pub fn dup(fd: &impl AsRawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own returns a new one or -1.
    let fd = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `readlinkat`, growing the buffer until the target fits.
pub fn readlink_at(dir: &OwnedFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: readlinkat writes at most `buf.len()` bytes into `buf`.
        let n = cvt(unsafe {
            libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        })?;
        let n = n.unsigned_abs();
        if n < buf.len() {
            buf.truncate(n);
            return Ok(buf);
        }
        buf.resize(buf.len() * 2, 0);
    }
}

/// `/proc/self/fd/N`: a path naming the directory itself (for `read_dir`, and joined with
/// names below it).
pub fn fd_dir_path(dir: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()))
}

/// `/proc/self/fd/N/`: the trailing slash makes `lstat` see the directory itself rather than
/// the magic link (what a snapshot's root check needs).
pub fn pinned_dir(dir: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}/", dir.as_raw_fd()))
}

/// The names in a directory, unsorted, as C strings ready for the `*at` calls.
pub fn names(dir: &OwnedFd) -> io::Result<Vec<(OsString, CString)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(fd_dir_path(dir))? {
        let name = entry?.file_name();
        let c = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()))
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        out.push((name, c));
    }
    Ok(out)
}

/// Opens a subdirectory without following a symlink (`O_DIRECTORY | O_NOFOLLOW`).
pub fn open_dir_at(dir: &impl AsRawFd, name: &CStr) -> io::Result<OwnedFd> {
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
}

/// Why [`walk_beneath`] stopped.
#[derive(Debug)]
pub enum Stopped {
    /// A component does not exist (the `ENOENT`, or another error, of its open).
    Missing(io::Error),
    /// A component is a symbolic link (never followed).
    Symlink,
    /// A component is something other than a directory.
    NotDirectory,
    /// A `..` would leave the starting directory.
    Escapes,
}

/// Walks `components` (`Normal` names and `..`; `.` and the root are skipped) from `start`,
/// one `openat(O_PATH | O_DIRECTORY | O_NOFOLLOW)` at a time, so no symlink is ever
/// followed and `..` never climbs above `start` (it pops what this walk opened). Returns the
/// directory reached and its names relative to `start`, with the `..` applied.
pub fn walk_beneath<'a>(
    start: &impl AsRawFd,
    components: impl IntoIterator<Item = std::path::Component<'a>>,
) -> Result<(OwnedFd, Vec<OsString>), Stopped> {
    use std::path::Component;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    let first = dup(start).map_err(Stopped::Missing)?;
    let mut stack: Vec<(OsString, OwnedFd)> = Vec::new();
    for component in components {
        match component {
            Component::Normal(name) => {
                let c = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name))
                    .map_err(|_| Stopped::Missing(io::Error::from_raw_os_error(libc::EINVAL)))?;
                let here = stack.last().map_or(&first, |(_, fd)| fd);
                match open_at(here, &c, flags) {
                    Ok(fd) => stack.push((name.to_owned(), fd)),
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                        return Err(match Stat::at(here, &c) {
                            Ok(st) if st.kind() == libc::S_IFLNK => Stopped::Symlink,
                            Ok(_) => Stopped::NotDirectory,
                            Err(e) => Stopped::Missing(e),
                        });
                    }
                    Err(e) => return Err(Stopped::Missing(e)),
                }
            }
            Component::ParentDir => {
                if stack.pop().is_none() {
                    return Err(Stopped::Escapes);
                }
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    let names = stack.iter().map(|(n, _)| n.clone()).collect();
    let fd = match stack.pop() {
        Some((_, fd)) => fd,
        None => first,
    };
    Ok((fd, names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    /// A sandbox's `chmod 000` (and `chmod 500`) on directories it made: an unprivileged
    /// runnerd, the same user, removes them all the same (as root it always could).
    #[test]
    fn removing_a_tree_passes_directories_their_owner_locked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("t/locked/readonly/inner")).unwrap();
        std::fs::write(root.join("t/locked/readonly/inner/f"), "x").unwrap();
        std::fs::write(root.join("t/locked/readonly/g"), "y").unwrap();
        let mode =
            |p: &str, m: u32| std::fs::set_permissions(root.join(p), std::fs::Permissions::from_mode(m));
        mode("t/locked/readonly/inner", 0o000).unwrap();
        mode("t/locked/readonly", 0o500).unwrap();
        mode("t/locked", 0o000).unwrap();
        let fd =
            open_at(&std::fs::File::open(&root).unwrap(), c".", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        remove_tree_at(&fd, c"t").unwrap();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }

    #[test]
    fn removing_a_tree_removes_links_not_their_targets() {
        let dir = tempfile::tempdir().unwrap();
        let (root, outside) = (dir.path().join("root"), dir.path().join("outside"));
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("keep"), "k").unwrap();
        // Deeper than a recursive removal would like, with files, links and a FIFO on the way.
        let mut deep = root.join("t");
        for i in 0..300 {
            deep.push(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), "x").unwrap();
        symlink(&outside, root.join("t/d0/out")).unwrap();
        symlink(&outside, deep.join("out")).unwrap();
        nix::unistd::mkfifo(&root.join("t/d0/fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600))
            .unwrap();
        std::fs::write(root.join("plain"), "p").unwrap();
        let fd =
            open_at(&std::fs::File::open(&root).unwrap(), c".", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        remove_tree_at(&fd, c"t").unwrap();
        remove_tree_at(&fd, c"plain").unwrap();
        remove_tree_at(&fd, c"absent").unwrap();
        assert!(std::fs::read_dir(&root).unwrap().next().is_none());
        assert_eq!(std::fs::read_to_string(outside.join("keep")).unwrap(), "k");
    }

    #[test]
    fn removing_a_deep_wide_tree_holds_few_descriptors() {
        const CHILD: &str = "FSAT_REMOVE_TREE_CHILD_ROOT";
        let open_root = |root: &Path| {
            open_at(&std::fs::File::open(root).unwrap(), c".", libc::O_PATH | libc::O_DIRECTORY).unwrap()
        };
        if let Some(root) = std::env::var_os(CHILD) {
            // The child: descriptors capped a little above what the removal may hold (the
            // tree is three times deeper than that).
            let cap = (REMOVE_OPEN_LEVELS + 40) as libc::rlim_t;
            let limit = libc::rlimit { rlim_cur: cap, rlim_max: cap };
            // SAFETY: setrlimit reads the struct; lowering our own limit is always allowed.
            cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }).unwrap();
            remove_tree_at(&open_root(Path::new(&root)), c"t").unwrap();
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let mut deep = root.join("t");
        for _ in 0..(REMOVE_OPEN_LEVELS * 3) {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        for i in 0..(REMOVE_BATCH + 10) {
            std::fs::write(root.join("t").join(format!("f{i}")), "").unwrap();
        }
        std::fs::write(deep.join("f"), "x").unwrap();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "fsat::tests::removing_a_deep_wide_tree_holds_few_descriptors",
                "--test-threads=1",
            ])
            .env(CHILD, &root)
            .status()
            .unwrap();
        assert!(status.success(), "the removal ran out of descriptors or failed");
        assert!(std::fs::read_dir(&root).unwrap().next().is_none());
    }

    #[test]
    fn walking_beneath_never_follows_a_symlink_nor_climbs_out() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/file"), "").unwrap();
        symlink(root.join("a/b"), root.join("a/link")).unwrap();
        let start =
            open_at(&std::fs::File::open(&root).unwrap(), c".", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        let walk = |p: &str| walk_beneath(&start, Path::new(p).components());
        let (_, names) = walk("a/b/../b").unwrap();
        assert_eq!(names, vec![OsString::from("a"), OsString::from("b")]);
        assert!(walk("..").is_err_and(|e| matches!(e, Stopped::Escapes)));
        assert!(walk("a/../..").is_err_and(|e| matches!(e, Stopped::Escapes)));
        assert!(walk("a/link").is_err_and(|e| matches!(e, Stopped::Symlink)));
        assert!(walk("a/link/..").is_err_and(|e| matches!(e, Stopped::Symlink)));
        assert!(walk("a/file").is_err_and(|e| matches!(e, Stopped::NotDirectory)));
        assert!(walk("a/nope").is_err_and(|e| matches!(e, Stopped::Missing(_))));
        assert_eq!(walk("").unwrap().1, Vec::<OsString>::new());
    }
}
