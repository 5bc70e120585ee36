//! The one place where a raw syscall's `-1` becomes an `io::Error`, plus the few raw calls
//! that neither `std` nor `nix` offer (pidfds, `close_range`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Turns the C convention (`-1` and `errno`) into `io::Result`.
pub fn cvt<T: IsMinusOne>(ret: T) -> io::Result<T> {
    if ret.is_minus_one() { Err(io::Error::last_os_error()) } else { Ok(ret) }
}

/// Integer return types of raw syscalls.
pub trait IsMinusOne: Copy {
    /// Whether this is the error sentinel `-1`.
    fn is_minus_one(self) -> bool;
}

impl IsMinusOne for libc::c_int {
    fn is_minus_one(self) -> bool {
        self == -1
    }
}

impl IsMinusOne for libc::c_long {
    fn is_minus_one(self) -> bool {
        self == -1
    }
}

/// `ssize_t`: `read`, `recv`, `send`, `splice`, `readlinkat`.
impl IsMinusOne for isize {
    fn is_minus_one(self) -> bool {
        self == -1
    }
}

/// Opens a pidfd for `pid` (Linux ≥ 5.3). The descriptor is close-on-exec.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `signal` to the process behind `pidfd`; immune to pid reuse.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: libc::c_int) -> io::Result<()> {
    // SAFETY: pidfd is a valid descriptor for the call's duration; info NULL means "as kill()".
    cvt(unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    })?;
    Ok(())
}

/// Closes every descriptor in `first..=last` (Linux ≥ 5.9).
pub fn close_range(first: libc::c_uint, last: libc::c_uint) -> io::Result<()> {
    // SAFETY: close_range only closes descriptors; callers own every descriptor in the range.
    cvt(unsafe { libc::syscall(libc::SYS_close_range, first, last, 0) })?;
    Ok(())
}

/// `open_tree(dir, "", OPEN_TREE_CLONE | AT_RECURSIVE | AT_EMPTY_PATH)`: a detached copy of
/// the mounts at and below `dir`, rooted at `dir`, as a recursive bind would make it
/// (Linux ≥ 5.2). Close-on-exec.
pub fn open_tree_clone(dir: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let flags = OPEN_TREE_CLONE
        | libc::O_CLOEXEC as libc::c_uint
        | libc::AT_RECURSIVE as libc::c_uint
        | libc::AT_EMPTY_PATH as libc::c_uint;
    // SAFETY: open_tree reads a NUL-terminated path (empty, with AT_EMPTY_PATH) relative to a
    // descriptor we borrow, and returns a new descriptor or -1.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_open_tree, dir.as_raw_fd(), c"".as_ptr(), flags) })?;
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The kernel's `struct mount_attr` (`linux/mount.h`).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `MOUNT_ATTR_IDMAP`: ids seen through the mount are mapped by a user namespace.
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
/// `MOUNT_ATTR_RDONLY`.
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
/// `MOUNT_ATTR_NOSUID`.
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
/// `MOUNT_ATTR_NODEV`.
pub const MOUNT_ATTR_NODEV: u64 = 0x4;

/// Sets `attrs` (with [`MOUNT_ATTR_IDMAP`], the mapping of `userns`) on the top mount of the
/// detached tree `tree`, not on its submounts (Linux ≥ 5.12; the filesystem must allow
/// idmapped mounts, and the mount must not be idmapped already).
pub fn mount_setattr_idmap(tree: BorrowedFd<'_>, userns: BorrowedFd<'_>, attrs: u64) -> io::Result<()> {
    let attr =
        MountAttr { attr_set: attrs, attr_clr: 0, propagation: 0, userns_fd: userns.as_raw_fd() as u64 };
    // SAFETY: mount_setattr reads `size` bytes of the struct we own and an empty path; the
    // descriptors are borrowed for the call.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &raw const attr,
            std::mem::size_of::<MountAttr>(),
        )
    })?;
    Ok(())
}

/// `move_mount(tree, "", onto, "", F_EMPTY_PATH | T_EMPTY_PATH)`: attaches the detached
/// mount `tree` on top of the directory `onto` (which must be in the caller's mount
/// namespace).
pub fn move_mount_onto(tree: BorrowedFd<'_>, onto: BorrowedFd<'_>) -> io::Result<()> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
    // SAFETY: move_mount reads two empty NUL-terminated paths relative to descriptors we
    // borrow for the call.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            onto.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    })?;
    Ok(())
}

/// The kernel's `struct open_how` (`linux/openat2.h`).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens the absolute `path` as an `O_PATH` directory without following any symbolic link
/// (or magic link) in any component: `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`
/// (Linux ≥ 5.6). Close-on-exec.
pub fn open_dir_no_symlinks(path: &std::ffi::CStr) -> io::Result<OwnedFd> {
    const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
    const RESOLVE_NO_SYMLINKS: u64 = 0x04;
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 reads the NUL-terminated path and `size` bytes of the struct we own,
    // and returns a new descriptor or -1.
    let fd = cvt(unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            path.as_ptr(),
            &raw const how,
            std::mem::size_of::<OpenHow>(),
        )
    })?;
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
