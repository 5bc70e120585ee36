//! The few descriptor-relative file operations the store's files share, on top of
//! [`crate::fsat`]: every name is opened relative to the store's directory descriptor and
//! never through a symlink, and every write is fsynced with its directory, because a
//! catalog or snapshot that a crash left half-written would make an environment unusable.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};

use crate::fsat;

/// A name as the `*at` calls take it.
pub fn cstr(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// The subdirectory `name` of `dir`, created with exactly `mode` (whatever the umask) if
/// absent; never through a symlink (`ENOTDIR` or `ELOOP`), never anything but a directory.
pub fn ensure_dir(dir: &impl AsRawFd, name: &str, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = cstr(name)?;
    let created = match fsat::mkdir_at(dir, &c, mode) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
        Err(e) => return Err(e),
    };
    let fd = fsat::open_dir_at(dir, &c)?;
    if created {
        fchmod(&fd, mode)?;
        sync_dir(dir)?;
    }
    Ok(fd)
}

/// `fchmod`.
pub fn fchmod(fd: &impl AsRawFd, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: fchmod on a descriptor we own.
    common::sys::cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode) }).map(drop)
}

/// The subdirectory `name` of `dir` if it exists (`None` for `ENOENT`).
pub fn open_dir(dir: &impl AsRawFd, name: &str) -> io::Result<Option<OwnedFd>> {
    match fsat::open_dir_at(dir, &cstr(name)?) {
        Ok(fd) => Ok(Some(fd)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// What [`read_regular`] found at a name.
#[derive(Debug)]
pub enum Found {
    Bytes(Vec<u8>),
    /// Nothing (`ENOENT`).
    Missing,
    /// A symlink, a directory, a FIFO…: never read.
    NotRegular,
    /// More than the limit.
    TooLarge,
}

/// Reads the regular file `name` below `dir`, at most `max` bytes, without following a
/// symlink or blocking on a FIFO.
pub fn read_regular(dir: &impl AsRawFd, name: &str, max: u64) -> io::Result<Found> {
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    let fd = match fsat::open_at(dir, &cstr(name)?, flags) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(Found::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(Found::NotRegular),
        Err(e) => return Err(e),
    };
    let st = fsat::Stat::of_fd(&fd)?;
    if st.kind() != libc::S_IFREG {
        return Ok(Found::NotRegular);
    }
    if st.size > max {
        return Ok(Found::TooLarge);
    }
    let mut bytes = Vec::with_capacity(st.size as usize);
    File::from(fd).take(max + 1).read_to_end(&mut bytes)?;
    match bytes.len() as u64 > max {
        true => Ok(Found::TooLarge),
        false => Ok(Found::Bytes(bytes)),
    }
}

/// Creates `name` below `dir` (`O_EXCL | O_NOFOLLOW`, `mode`), writes `bytes` and fsyncs
/// it; on any failure the partial file is removed. The directory is not synced here.
pub fn write_new(dir: &impl AsRawFd, name: &str, bytes: &[u8], mode: libc::mode_t) -> io::Result<()> {
    let c = cstr(name)?;
    let mut f = File::from(fsat::create_new_at(dir, &c, mode)?);
    let written = f.write_all(bytes).and_then(|()| f.sync_all());
    if written.is_err() {
        let _ = fsat::unlink_at(dir, &c);
    }
    written
}

pub use crate::fsat::sync_dir;

/// Removes the entries of `dir` whose names `stale` selects (temporaries an interrupted
/// write left); best effort, returns how many went.
pub fn sweep(dir: &OwnedFd, stale: impl Fn(&str) -> bool) -> usize {
    let Ok(names) = fsat::names(dir) else { return 0 };
    names
        .into_iter()
        .filter(|(name, _)| name.to_str().is_some_and(&stale))
        .filter(|(_, c)| fsat::unlink_at(dir, c).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(dir: &tempfile::TempDir) -> OwnedFd {
        fsat::open_path(dir.path(), libc::O_PATH | libc::O_DIRECTORY).unwrap()
    }

    #[test]
    fn reading_never_follows_nor_blocks() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = root(&tmp);
        std::fs::write(tmp.path().join("f"), "abc").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("f"), tmp.path().join("l")).unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        nix::unistd::mkfifo(&tmp.path().join("p"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(matches!(read_regular(&dir, "f", 3).unwrap(), Found::Bytes(b) if b == b"abc"));
        assert!(matches!(read_regular(&dir, "f", 2).unwrap(), Found::TooLarge));
        assert!(matches!(read_regular(&dir, "l", 9).unwrap(), Found::NotRegular));
        assert!(matches!(read_regular(&dir, "d", 9).unwrap(), Found::NotRegular));
        assert!(matches!(read_regular(&dir, "p", 9).unwrap(), Found::NotRegular));
        assert!(matches!(read_regular(&dir, "absent", 9).unwrap(), Found::Missing));
    }

    #[test]
    fn directories_and_new_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = root(&tmp);
        let sub = ensure_dir(&dir, "sub", 0o751).unwrap();
        ensure_dir(&dir, "sub", 0o700).unwrap();
        let mode = std::fs::metadata(tmp.path().join("sub")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o751,
            "set once, at creation"
        );
        write_new(&sub, "x", b"1", 0o600).unwrap();
        assert_eq!(write_new(&sub, "x", b"2", 0o600).unwrap_err().raw_os_error(), Some(libc::EEXIST));
        assert_eq!(std::fs::read(tmp.path().join("sub/x")).unwrap(), b"1");
        std::os::unix::fs::symlink(tmp.path().join("sub"), tmp.path().join("link")).unwrap();
        let refused = ensure_dir(&dir, "link", 0o700).unwrap_err().raw_os_error();
        assert!(matches!(refused, Some(libc::ELOOP | libc::ENOTDIR)), "{refused:?}");
        assert!(open_dir(&dir, "absent").unwrap().is_none());
        sync_dir(&dir).unwrap();
        write_new(&sub, "x.tmp", b"", 0o600).unwrap();
        assert_eq!(sweep(&sub, |n| n.ends_with(".tmp")), 1);
        assert!(tmp.path().join("sub/x").exists());
    }
}
