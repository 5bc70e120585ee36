//! The lock primitive under both the lease and admission: `BEGIN IMMEDIATE` (SQLite's
//! RESERVED lock) on a database that holds no tables, with `busy_timeout=0` and a 20 ms
//! poll (reference §6.1). The journal mode is never changed, so Node's holders and ours
//! speak the same locking protocol.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, ErrorCode};
use tokio::sync::watch;

use super::CoordError;

/// The original's poll interval while another holder has the lock.
pub const POLL: Duration = Duration::from_millis(20);

/// A held lock: rolled back and closed on drop, which releases it. (The connection sits in
/// a mutex only so that holders can be shared across tasks; nothing uses it while held.)
#[derive(Debug)]
pub struct SqliteLock {
    conn: Option<std::sync::Mutex<Connection>>,
}

impl SqliteLock {
    /// One attempt: `Ok(None)` when another connection (in any process) holds it.
    pub fn try_take(path: &Path) -> Result<Option<SqliteLock>, CoordError> {
        let conn = Self::connect(path)?;
        Self::try_begin(path, conn).map(|r| r.ok())
    }

    fn connect(path: &Path) -> Result<Connection, CoordError> {
        let sqlite = |source| CoordError::Sqlite { path: path.to_owned(), source };
        let conn = Connection::open(path).map_err(sqlite)?;
        conn.busy_timeout(Duration::ZERO).map_err(sqlite)?;
        Ok(conn)
    }

    /// One `BEGIN IMMEDIATE`; when busy, the connection comes back for the next try.
    fn try_begin(path: &Path, conn: Connection) -> Result<Result<SqliteLock, Connection>, CoordError> {
        match conn.execute_batch("BEGIN IMMEDIATE") {
            Ok(()) => Ok(Ok(SqliteLock { conn: Some(std::sync::Mutex::new(conn)) })),
            Err(e) if is_busy(&e) => Ok(Err(conn)),
            Err(e) => Err(CoordError::Sqlite { path: path.to_owned(), source: e }),
        }
    }

    /// Waits for the lock on one connection, retrying `BEGIN IMMEDIATE` every [`POLL`]; a
    /// cancel (the watch turning `true`) ends the wait with [`CoordError::Aborted`].
    pub async fn take(path: &Path, cancel: Option<&watch::Receiver<bool>>) -> Result<SqliteLock, CoordError> {
        let mut conn = Self::connect(path)?;
        loop {
            if cancel.is_some_and(|c| *c.borrow()) {
                return Err(CoordError::Aborted);
            }
            conn = match Self::try_begin(path, conn)? {
                Ok(lock) => return Ok(lock),
                Err(conn) => conn,
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

    #[tokio::test]
    async fn a_held_lock_excludes_a_second_connection_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sqlite");
        let first = SqliteLock::try_take(&path).unwrap().expect("free");
        assert!(SqliteLock::try_take(&path).unwrap().is_none(), "same process, second connection: busy");
        let p = path.clone();
        let waiter = tokio::spawn(async move { SqliteLock::take(&p, None).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!waiter.is_finished());
        drop(first);
        tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_cancelled_waiter_aborts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sqlite");
        let _held = SqliteLock::try_take(&path).unwrap().unwrap();
        let (tx, rx) = watch::channel(false);
        let p = path.clone();
        let waiter = tokio::spawn(async move { SqliteLock::take(&p, Some(&rx)).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(30)).await;
        tx.send(true).unwrap();
        let err = tokio::time::timeout(Duration::from_secs(2), waiter).await.unwrap().unwrap().unwrap_err();
        assert!(matches!(err, CoordError::Aborted));
    }
}
