//! The lock primitive under both the lease and admission: `BEGIN IMMEDIATE` (SQLite's
//! RESERVED lock) on a database that holds no tables, with `busy_timeout=0` and a 20 ms
//! poll (reference §6.1). The journal mode is never changed, so Node's holders and ours
//! speak the same locking protocol.

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
    _file: LockFile,
}

impl SqliteLock {
    /// One attempt: `Ok(None)` when another connection (in any process) holds it.
    pub fn try_take(file: LockFile) -> Result<Option<SqliteLock>, CoordError> {
        let conn = Self::connect(&file)?;
        Self::try_begin(file, conn).map(|r| r.ok())
    }

    /// Opens the lock database without following anything a sandbox planted: the file is
    /// created with `mknodat` (no descriptor of ours is ever closed on it: that would drop
    /// this process's POSIX locks, another holder's included), checked to be a regular file
    /// with one link, opened by SQLite through the directory descriptor with `O_NOFOLLOW`,
    /// and SQLite's own descriptor is checked to be that same inode.
    fn connect(file: &LockFile) -> Result<Connection, CoordError> {
        let sqlite = |source| CoordError::Sqlite { name: file.shown.clone(), source };
        match fsat::mknod_regular_at(&file.dir, &file.name, 0o644) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(CoordError::io("create", &file.shown, e)),
        }
        let checked =
            Stat::at(&file.dir, &file.name).map_err(|e| CoordError::io("inspect", &file.shown, e))?;
        super::require_regular(&checked, &file.shown)?;
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
        Ok(conn)
    }

    /// One `BEGIN IMMEDIATE`; when busy, the file and connection come back for the next try.
    #[allow(clippy::result_large_err)]
    fn try_begin(
        file: LockFile,
        conn: Connection,
    ) -> Result<Result<SqliteLock, (LockFile, Connection)>, CoordError> {
        match conn.execute_batch("BEGIN IMMEDIATE") {
            Ok(()) => Ok(Ok(SqliteLock { conn: Some(std::sync::Mutex::new(conn)), _file: file })),
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
        let mut conn = Self::connect(&file)?;
        let mut file = file;
        loop {
            if cancel.is_some_and(|c| *c.borrow()) {
                return Err(CoordError::Aborted);
            }
            (file, conn) = match Self::try_begin(file, conn)? {
                Ok(lock) => return Ok(lock),
                Err(back) => back,
            };
            match cancel {
                Some(c) => {
                    let mut c = c.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(POLL) => {}
                        // A dropped sender never cancels (as `exec::gone`).
                        Ok(_) = c.wait_for(|v| *v) => return Err(CoordError::Aborted),
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
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            let conn = conn.into_inner().unwrap_or_else(|p| p.into_inner());
            let _ = conn.execute_batch("ROLLBACK");
            let _ = conn.close();
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
