//! The lock primitive under both the lease and admission: `BEGIN IMMEDIATE` (SQLite's
//! RESERVED lock) on a database that holds no tables, with `busy_timeout=0` and a 20 ms
//! poll (reference §6.1). Our connections keep their rollback journal in memory
//! (`journal_mode=MEMORY`, a per-connection setting that the file does not record, unlike
//! WAL): the locking protocol on the file is the rollback journal's, the one Node's holders
//! speak, but `BEGIN IMMEDIATE` on the empty database no longer creates and deletes a
//! `-journal` file per lock. Nothing is ever written to a lock database (every
//! transaction is rolled back), so there is nothing for a journal to recover.
//!
//! A released lock's connection is kept open, idle, for the next holder of the same file
//! (issue #18: opening, checking and closing a connection per lock cost more than the lock).
//! It is reused only for the very inode the path names at that moment (checked like a new
//! one), so a lock database a sandbox swapped or removed is never locked through a stale
//! connection. Closing one is safe while another connection of ours holds the same file:
//! SQLite's unix VFS keeps a descriptor it is asked to close open until the process's
//! last lock on that inode is gone (closing it would drop them all, POSIX rules).

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode};
use tokio::sync::watch;

use super::{CoordError, vfs};
use crate::fsat::{self, Stat};

/// The original's poll interval while another holder has the lock.
pub const POLL: Duration = Duration::from_millis(20);

/// A lock database named relative to a directory descriptor (opened `O_NOFOLLOW` by the
/// caller), and how errors show it (relative, never a host path).
#[derive(Debug)]
pub struct LockFile {
    pub dir: OwnedFd,
    pub name: CString,
    pub shown: String,
}

/// A held lock: rolled back and closed on drop, which releases it. (The connection sits in
/// a mutex only so that holders can be shared across tasks; nothing uses it while held.)
/// The directory descriptor stays open as long as the connection: SQLite names every file
/// it opens (journals included) through it.
#[derive(Debug)]
pub struct SqliteLock {
    conn: Option<std::sync::Mutex<Connection>>,
    file: Option<LockFile>,
    /// The database file's identity, under which the connection is kept when released.
    id: (u64, u64),
}

/// A connection not in a transaction, with the directory it names its files through.
struct Idle {
    id: (u64, u64),
    conn: Connection,
    _file: LockFile,
}

/// How many idle connections are kept (one descriptor each, plus the directory's).
const IDLE_LIMIT: usize = 32;

/// The idle connections, most recently released last.
static IDLE: std::sync::Mutex<Vec<Idle>> = std::sync::Mutex::new(Vec::new());

fn idle() -> std::sync::MutexGuard<'static, Vec<Idle>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Takes the idle connection on the file `id`, if one is kept.
fn take_idle(id: (u64, u64)) -> Option<(LockFile, Connection)> {
    let mut idle = idle();
    let at = idle.iter().rposition(|i| i.id == id)?;
    let Idle { conn, _file, .. } = idle.remove(at);
    Some((_file, conn))
}

/// Keeps a connection (not in a transaction) for the next holder; the oldest beyond
/// [`IDLE_LIMIT`] is closed, outside the lock.
fn keep_idle(id: (u64, u64), file: LockFile, conn: Connection) {
    let evicted = {
        let mut idle = idle();
        idle.push(Idle { id, conn, _file: file });
        (idle.len() > IDLE_LIMIT).then(|| idle.remove(0))
    };
    drop(evicted);
}

impl SqliteLock {
    /// One attempt: `Ok(None)` when another connection (in any process) holds it.
    pub fn try_take(file: LockFile) -> Result<Option<SqliteLock>, CoordError> {
        let (file, conn, id) = Self::connect(file)?;
        match Self::try_begin(file, conn, id)? {
            Ok(lock) => Ok(Some(lock)),
            Err((file, conn)) => {
                keep_idle(id, file, conn);
                Ok(None)
            }
        }
    }

    /// Opens the lock database without following anything a sandbox planted: the file is
    /// created with `mknodat` (no descriptor of ours is ever closed on it: that would drop
    /// this process's POSIX locks, another holder's included), checked to be a regular file
    /// with one link, opened by SQLite through the directory descriptor with `O_NOFOLLOW`,
    /// and SQLite's own descriptor is checked to be that same inode. An idle connection on
    /// that inode is reused instead (with the directory it was opened through).
    fn connect(file: LockFile) -> Result<(LockFile, Connection, (u64, u64)), CoordError> {
        let sqlite = |source| CoordError::Sqlite { name: file.shown.clone(), source };
        match fsat::mknod_regular_at(&file.dir, &file.name, 0o644) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(CoordError::io("create", &file.shown, e)),
        }
        let checked =
            Stat::at(&file.dir, &file.name).map_err(|e| CoordError::io("inspect", &file.shown, e))?;
        super::require_regular(&checked, &file.shown)?;
        let id = (checked.dev, checked.ino);
        if let Some((kept, conn)) = take_idle(id) {
            return Ok((kept, conn, id));
        }
        let path = format!(
            "/proc/self/fd/{}/{}",
            file.dir.as_raw_fd(),
            file.name.to_str().map_err(|_| CoordError::io(
                "name",
                &file.shown,
                std::io::Error::other("not UTF-8")
            ))?
        );
        let conn = vfs::open(&path).map_err(sqlite)?;
        let opened = vfs::opened_file(&conn).map_err(|e| CoordError::io("inspect", &file.shown, e))?;
        if (opened.dev, opened.ino) != (checked.dev, checked.ino) {
            return Err(CoordError::Planted {
                name: file.shown.clone(),
                found: "a different file swapped in while it was being opened",
                expected: "the lock database it was checked to be",
            });
        }
        conn.busy_timeout(Duration::ZERO).map_err(sqlite)?;
        conn.query_row("PRAGMA journal_mode=MEMORY", [], |row| row.get::<_, String>(0)).map_err(sqlite)?;
        Ok((file, conn, id))
    }

    /// One `BEGIN IMMEDIATE`; when busy, the file and connection come back for the next try.
    #[allow(clippy::result_large_err)]
    fn try_begin(
        file: LockFile,
        conn: Connection,
        id: (u64, u64),
    ) -> Result<Result<SqliteLock, (LockFile, Connection)>, CoordError> {
        let begun = conn.prepare_cached("BEGIN IMMEDIATE").and_then(|mut s| s.execute([]));
        match begun {
            Ok(_) => Ok(Ok(SqliteLock { conn: Some(std::sync::Mutex::new(conn)), file: Some(file), id })),
            Err(e) if is_busy(&e) => Ok(Err((file, conn))),
            Err(e) => Err(CoordError::Sqlite { name: file.shown.clone(), source: e }),
        }
    }

    /// Waits for the lock on one connection, retrying `BEGIN IMMEDIATE` every [`POLL`]; a
    /// cancel (the watch turning `true`) ends the wait with [`CoordError::Aborted`].
    pub async fn take(
        file: LockFile,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<SqliteLock, CoordError> {
        let (mut file, mut conn, id) = Self::connect(file)?;
        loop {
            if cancel.is_some_and(|c| *c.borrow()) {
                keep_idle(id, file, conn);
                return Err(CoordError::Aborted);
            }
            (file, conn) = match Self::try_begin(file, conn, id)? {
                Ok(lock) => return Ok(lock),
                Err(back) => back,
            };
            match cancel {
                Some(c) => {
                    let mut c = c.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(POLL) => {}
                        // A dropped sender never cancels (as runnerd's `exec::gone`).
                        Ok(_) = c.wait_for(|v| *v) => {
                            keep_idle(id, file, conn);
                            return Err(CoordError::Aborted);
                        }
                    }
                }
                None => tokio::time::sleep(POLL).await,
            }
        }
    }
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e.sqlite_error_code(), Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
}

impl Drop for SqliteLock {
    /// Rolls back (releasing the lock) and keeps the connection for the next holder; one
    /// whose rollback failed is closed instead (closing releases the lock too).
    fn drop(&mut self) {
        if let (Some(conn), Some(file)) = (self.conn.take(), self.file.take()) {
            let conn = conn.into_inner().unwrap_or_else(|p| p.into_inner());
            let rolled_back = conn.prepare_cached("ROLLBACK").and_then(|mut s| s.execute([])).is_ok();
            if rolled_back && conn.is_autocommit() {
                keep_idle(self.id, file, conn);
            } else {
                let _ = conn.close();
            }
        }
    }
}

/// `PRAGMA journal_mode=WAL`, retried for up to 5 s. Switching a new database to WAL takes
/// its exclusive lock, and SQLite answers BUSY at once (not after the busy timeout) when
/// another connection is opening it at the same moment, to avoid a lock cycle.
pub fn enable_wal(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match conn.query_row("PRAGMA journal_mode=WAL", [], |row| row.get::<_, String>(0)) {
            Ok(_) => return Ok(()),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn lock_file(dir: &std::path::Path, name: &str) -> LockFile {
        let dir = std::fs::File::open(dir).unwrap();
        LockFile { dir: dir.into(), name: CString::new(name).unwrap(), shown: name.to_owned() }
    }

    /// A sandbox that owns the coordination directory (it encloses the workspace) plants a
    /// non-empty lock database and a FIFO as its "hot" journal or WAL: the lock fails at
    /// once instead of blocking a thread on the FIFO forever (review helper).
    #[test]
    fn a_planted_journal_or_wal_fails_the_lock_and_never_blocks() {
        for (suffix, header) in [
            ("-journal", [0u8; 100]),
            ("-wal", {
                // A WAL-mode header: file format versions 2.
                let mut h = [0u8; 100];
                h[..16].copy_from_slice(b"SQLite format 3\0");
                h[16..18].copy_from_slice(&4096u16.to_be_bytes());
                (h[18], h[19]) = (2, 2);
                h
            }),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mut db = vec![0u8; 4096];
            db[..100].copy_from_slice(&header);
            std::fs::write(dir.path().join("x.sqlite"), &db).unwrap();
            let fifo = CString::new(format!("{}/x.sqlite{suffix}", dir.path().display())).unwrap();
            // SAFETY: mkfifo reads the NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
            let path = dir.path().to_owned();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(SqliteLock::try_take(lock_file(&path, "x.sqlite")).map(|l| l.is_some()));
            });
            let got = rx.recv_timeout(Duration::from_secs(5)).expect("the lock blocked on the planted FIFO");
            assert!(got.is_err(), "{suffix}: {got:?}");
        }
    }

    #[tokio::test]
    async fn a_held_lock_excludes_a_second_connection_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let first = SqliteLock::try_take(lock_file(&path, "x.sqlite")).unwrap().expect("free");
        for _ in 0..3 {
            let second = SqliteLock::try_take(lock_file(&path, "x.sqlite")).unwrap();
            assert!(second.is_none(), "same process, second connection: busy");
        }
        // The refused attempts closed nothing that drops the first holder's POSIX lock.
        assert!(!crate::coordination::tests::free_for_another_process(&path.join("x.sqlite")));
        let p = path.clone();
        let waiter =
            tokio::spawn(async move { SqliteLock::take(lock_file(&p, "x.sqlite"), None).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!waiter.is_finished());
        drop(first);
        tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap().unwrap();
    }

    /// A released lock's connection serves the next holder of the same file, and only of
    /// that file: a lock database replaced meanwhile gets a connection of its own.
    #[test]
    fn a_released_connection_is_reused_only_for_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let db = path.join("r.sqlite");
        let kept = |id| idle().iter().any(|i| i.id == id);
        let first = SqliteLock::try_take(lock_file(&path, "r.sqlite")).unwrap().expect("free");
        let id = first.id;
        drop(first);
        assert!(kept(id), "kept for the next holder");
        assert!(crate::coordination::tests::free_for_another_process(&db), "released");
        let again = SqliteLock::try_take(lock_file(&path, "r.sqlite")).unwrap().expect("free");
        assert_eq!(again.id, id);
        assert!(!kept(id), "in use, not idle");
        assert!(!crate::coordination::tests::free_for_another_process(&db), "held again");
        drop(again);
        std::fs::remove_file(&db).unwrap();
        let fresh = SqliteLock::try_take(lock_file(&path, "r.sqlite")).unwrap().expect("free");
        assert_ne!(fresh.id, id, "a new file, a new connection");
        assert!(!crate::coordination::tests::free_for_another_process(&db), "the new file is the one held");
    }

    #[tokio::test]
    async fn a_cancelled_waiter_aborts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let _held = SqliteLock::try_take(lock_file(&path, "x.sqlite")).unwrap().unwrap();
        let (tx, rx) = watch::channel(false);
        let p = path.clone();
        let waiter =
            tokio::spawn(
                async move { SqliteLock::take(lock_file(&p, "x.sqlite"), Some(&rx)).await.map(|_| ()) },
            );
        tokio::time::sleep(Duration::from_millis(30)).await;
        tx.send(true).unwrap();
        let err = tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap().unwrap_err();
        assert!(matches!(err, CoordError::Aborted));
    }

    /// A lock database that is not a regular file of its own is refused without blocking
    /// and without opening through it.
    #[test]
    fn a_planted_lock_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_owned();
        let c = CString::new(path.join("fifo.sqlite").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::fs::write(path.join("real"), "").unwrap();
        std::fs::hard_link(path.join("real"), path.join("linked.sqlite")).unwrap();
        std::os::unix::fs::symlink(path.join("elsewhere.sqlite"), path.join("link.sqlite")).unwrap();
        std::fs::create_dir(path.join("dir.sqlite")).unwrap();
        for name in ["fifo.sqlite", "linked.sqlite", "link.sqlite", "dir.sqlite"] {
            let err = SqliteLock::try_take(lock_file(&path, name)).unwrap_err();
            assert!(matches!(err, CoordError::Planted { .. }), "{name}: {err}");
            assert!(
                err.to_string().starts_with(&format!("Refusing the workspace coordination entry {name}: ")),
                "{err}"
            );
        }
        assert!(!path.join("elsewhere.sqlite").exists());
    }
}
