//! Who owns what runnerd creates for a sandbox (a remote workspace's directories, an uploaded
//! file): the sandbox user, which the store's callers know (runnerd's
//! `sandbox::user::Identity`) and the store does not.

use std::io;
use std::os::fd::BorrowedFd;

/// Gives a file or directory just created for the sandbox to the sandbox user, so the
/// sandbox can write it; works on `O_PATH` descriptors.
pub trait HandOver {
    fn hand_over(&self, fd: BorrowedFd<'_>) -> io::Result<()>;
}

/// Nobody to hand over to (tests): what is created stays the caller's.
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Keep;

#[cfg(test)]
impl HandOver for Keep {
    fn hand_over(&self, _fd: BorrowedFd<'_>) -> io::Result<()> {
        Ok(())
    }
}
