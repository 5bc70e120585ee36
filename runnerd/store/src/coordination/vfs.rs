//! SQLite opened relative to a directory descriptor, for the lock databases that live where
//! a sandbox can write (`<parent>/.workspace-coordination/<H>.sqlite`).
//!
//! SQLite is handed `/proc/self/fd/<dirfd>/<name>`: the kernel resolves the magic link to
//! exactly the directory runnerd opened (no path re-walked from `/`), and the unix VFS
//! opens the last component with `O_NOFOLLOW`. The stock VFS would spoil that in its
//! `xFullPathname`, which resolves every symlink of the path by `readlink` (turning the fd
//! link back into the directory's path string, and refusing the name outright under
//! `SQLITE_OPEN_NOFOLLOW`); it also caps a path at 512 bytes, which a valid 500-character
//! workspace key exceeds. So this module registers `runnerd-beneath`, a copy of the default
//! unix VFS (same locking: POSIX fcntl locks, as the API process's SQLite takes) in which:
//!
//! - `xFullPathname` keeps a descriptor-relative name as it is and refuses any other name;
//! - `xOpen` and `xDelete` refuse any name that is not descriptor-relative, and `xOpen`
//!   refuses super-journals: a hot journal planted next to a lock database could name one
//!   anywhere, and SQLite deletes a super-journal it finds unreferenced.
//!
//! After opening, [`opened_file`] reads the descriptor SQLite itself holds, so the caller
//! can check that SQLite opened the very inode it inspected.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::BorrowedFd;
use std::sync::OnceLock;

use rusqlite::{Connection, OpenFlags, ffi};

use crate::fsat::Stat;

/// The VFS's registered name.
const NAME: &CStr = c"runnerd-beneath";

/// The registered copy and the VFS it delegates to (both live for the whole process).
struct Registered {
    ours: *mut ffi::sqlite3_vfs,
    base: *mut ffi::sqlite3_vfs,
}

// SAFETY: both pointers name VFS objects that are never freed or mutated after
// registration; SQLite itself calls them from any thread.
unsafe impl Send for Registered {}
// SAFETY: as above.
unsafe impl Sync for Registered {}

static REGISTERED: OnceLock<Option<Registered>> = OnceLock::new();

fn registered() -> Option<&'static Registered> {
    REGISTERED.get_or_init(register).as_ref()
}

fn register() -> Option<Registered> {
    // SAFETY: sqlite3_vfs_find(NULL) initialises SQLite and returns the default VFS (or
    // NULL); it takes no pointer we own.
    let base = unsafe { ffi::sqlite3_vfs_find(std::ptr::null()) };
    if base.is_null() {
        return None;
    }
    // SAFETY: `base` is SQLite's default VFS, valid for the life of the process.
    let mut copy = unsafe { *base };
    copy.zName = NAME.as_ptr();
    copy.pNext = std::ptr::null_mut();
    copy.xOpen = Some(x_open);
    copy.xDelete = Some(x_delete);
    copy.xFullPathname = Some(x_full_pathname);
    let ours = Box::into_raw(Box::new(copy));
    // SAFETY: `ours` is a complete VFS that is leaked, so it outlives every connection;
    // 0 = not the default VFS.
    let rc = unsafe { ffi::sqlite3_vfs_register(ours, 0) };
    (rc == ffi::SQLITE_OK).then_some(Registered { ours, base })
}

/// Whether `name` is `/proc/self/fd/<digits>/<one name>` (what this VFS accepts).
pub fn descriptor_relative(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(b"/proc/self/fd/") else { return false };
    let Some(slash) = rest.iter().position(|&b| b == b'/') else { return false };
    let (fd, file) = (&rest[..slash], &rest[slash + 1..]);
    !fd.is_empty()
        && fd.iter().all(u8::is_ascii_digit)
        && !file.is_empty()
        && file != b"."
        && file != b".."
        && !file.contains(&b'/')
}

/// # Safety
/// Called by SQLite with a NUL-terminated name (or NULL).
unsafe fn name_ok(name: *const c_char) -> bool {
    // SAFETY: SQLite passes a NUL-terminated string, checked non-null first.
    !name.is_null() && descriptor_relative(unsafe { CStr::from_ptr(name) }.to_bytes())
}

unsafe extern "C" fn x_full_pathname(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    n_out: c_int,
    out: *mut c_char,
) -> c_int {
    // SAFETY: SQLite passes a NUL-terminated name.
    if !unsafe { name_ok(name) } {
        return ffi::SQLITE_CANTOPEN;
    }
    // SAFETY: checked non-null and NUL-terminated above.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes_with_nul();
    if bytes.len() > usize::try_from(n_out).unwrap_or(0) {
        return ffi::SQLITE_CANTOPEN;
    }
    // SAFETY: `out` has room for `n_out` bytes (SQLite's contract), checked above.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, bytes.len()) };
    ffi::SQLITE_OK
}

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let Some(reg) = registered() else { return ffi::SQLITE_CANTOPEN };
    // Temporary files have no name; every named file must be descriptor-relative. No
    // journal or WAL file is ever opened: a lock database is never written (its journal is
    // in memory), so one found beside it was planted, by an enclosing workspace's sandbox
    // that owns the coordination directory, and SQLite opens a "hot" journal without
    // O_NONBLOCK to roll it back: a FIFO there would hang the thread for good. Refused, the
    // lock fails with an error instead.
    let planted = ffi::SQLITE_OPEN_SUPER_JOURNAL | ffi::SQLITE_OPEN_MAIN_JOURNAL | ffi::SQLITE_OPEN_WAL;
    // SAFETY: SQLite passes a NUL-terminated name or NULL.
    if flags & planted != 0 || (!name.is_null() && !unsafe { name_ok(name) }) {
        return ffi::SQLITE_CANTOPEN;
    }
    // SAFETY: the base VFS's own xOpen with SQLite's arguments; `vfs` is our copy, whose
    // fields (pAppData, mxPathname) are the base's, so the unix VFS treats it as its own.
    match unsafe { (*reg.base).xOpen } {
        // SAFETY: as above.
        Some(open) => unsafe { open(vfs, name, file, flags, out_flags) },
        None => ffi::SQLITE_CANTOPEN,
    }
}

unsafe extern "C" fn x_delete(vfs: *mut ffi::sqlite3_vfs, name: *const c_char, sync_dir: c_int) -> c_int {
    let Some(reg) = registered() else { return ffi::SQLITE_IOERR_DELETE };
    // SAFETY: SQLite passes a NUL-terminated name.
    if !unsafe { name_ok(name) } {
        return ffi::SQLITE_IOERR_DELETE;
    }
    // SAFETY: the base VFS's xDelete with SQLite's arguments (unlink does not follow).
    match unsafe { (*reg.base).xDelete } {
        // SAFETY: as above.
        Some(delete) => unsafe { delete(vfs, name, sync_dir) },
        None => ffi::SQLITE_IOERR_DELETE,
    }
}

/// Opens `path` (descriptor-relative, see [`descriptor_relative`]) read-write, created if
/// absent, through `runnerd-beneath` with `SQLITE_OPEN_NOFOLLOW`.
pub fn open(path: &str) -> rusqlite::Result<Connection> {
    if registered().is_none() {
        return Err(rusqlite::Error::SqliteFailure(
            ffi::Error::new(ffi::SQLITE_CANTOPEN),
            Some("the descriptor-relative SQLite VFS could not be registered".into()),
        ));
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    Connection::open_with_flags_and_vfs(path, flags, NAME)
}

/// The first fields of the unix VFS's `unixFile` (sqlite3.c: `pMethod`, `pVfs`, `pInode`,
/// `h`), unchanged for over a decade. Read only after checking `pVfs` is our VFS.
#[repr(C)]
struct UnixFileHead {
    methods: *const c_void,
    vfs: *mut ffi::sqlite3_vfs,
    inode: *mut c_void,
    h: c_int,
}

/// What the main database file of `conn` (opened by [`open`]) is: `fstat` of the
/// descriptor SQLite holds.
pub fn opened_file(conn: &Connection) -> std::io::Result<Stat> {
    let unknown = || std::io::Error::other("SQLite did not show which file it opened");
    let reg = registered().ok_or_else(unknown)?;
    let mut file: *mut ffi::sqlite3_file = std::ptr::null_mut();
    // SAFETY: FILE_POINTER writes the main database's sqlite3_file pointer into `file`;
    // the handle is the live connection's.
    let rc = unsafe {
        ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            ffi::SQLITE_FCNTL_FILE_POINTER,
            (&raw mut file).cast::<c_void>(),
        )
    };
    if rc != ffi::SQLITE_OK || file.is_null() {
        return Err(unknown());
    }
    let head = file.cast::<UnixFileHead>();
    // SAFETY: every file opened through our xOpen is a unixFile (the base VFS's), which
    // begins with these fields; `pVfs` being ours confirms it before `h` is read.
    let (vfs, h) = unsafe { ((*head).vfs, (*head).h) };
    if vfs != reg.ours || h < 0 {
        return Err(unknown());
    }
    // SAFETY: `h` is SQLite's open descriptor for this connection's file, which stays open
    // while `conn` is borrowed; it is only fstat'ed, never closed here.
    Stat::of_fd(&unsafe { BorrowedFd::borrow_raw(h) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_relative_name_table() {
        for (name, ok) in [
            ("/proc/self/fd/7/abc.sqlite", true),
            ("/proc/self/fd/12/abc.sqlite-journal", true),
            ("/proc/self/fd/7/", false),
            ("/proc/self/fd//x", false),
            ("/proc/self/fd/7x/x", false),
            ("/proc/self/fd/7/a/b", false),
            ("/proc/self/fd/7/..", false),
            ("/proc/self/fd/7/.", false),
            ("/proc/1/fd/7/x", false),
            ("/srv/data/x.sqlite", false),
            ("x.sqlite", false),
        ] {
            assert_eq!(descriptor_relative(name.as_bytes()), ok, "{name}");
        }
    }
}
