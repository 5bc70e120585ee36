//! Filesystem access relative to directory descriptors, never re-resolving a path from `/`
//! and never following a final symlink: what every walk over a workspace (snapshots,
//! listings) uses, so that a sandbox swapping a directory for a symlink mid-walk cannot
//! lead it outside.

use std::ffi::{CStr, CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

/// The `lstat` fields a walk looks at, read relative to a directory descriptor
/// (`fstatat`), so no path is resolved again below the root.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub size: u64,
    /// 512-byte blocks allocated (`st_blocks`): what the file really takes on disk.
    pub blocks: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
}

impl Stat {
    fn from_raw(st: &libc::stat) -> Stat {
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Stat {
            dev: st.st_dev,
            ino: st.st_ino,
            mode: st.st_mode,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
            ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
        }
    }

    /// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
    pub fn at(dir: &OwnedFd, name: &CStr) -> io::Result<Stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstatat writes a full `stat` into the buffer on success (checked); the
        // name is NUL-terminated and the descriptor is ours.
        let rc = unsafe {
            libc::fstatat(dir.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW)
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: initialised by the successful call above.
        let st = unsafe { st.assume_init() };
        Ok(Stat::from_raw(&st))
    }

    /// `fstat(fd)`.
    pub fn of_fd(fd: &impl AsRawFd) -> io::Result<Stat> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: as above, for fstat on a descriptor we own.
        let rc = unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: initialised by the successful call above.
        let st = unsafe { st.assume_init() };
        Ok(Stat::from_raw(&st))
    }

    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
}

pub fn open_at(dir: &OwnedFd, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: openat relative to a directory descriptor we own, NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `readlinkat`, growing the buffer until the target fits.
pub fn readlink_at(dir: &OwnedFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: readlinkat writes at most `buf.len()` bytes into `buf`.
        let n =
            unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
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
pub fn open_dir_at(dir: &OwnedFd, name: &CStr) -> io::Result<OwnedFd> {
    open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
}
