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
