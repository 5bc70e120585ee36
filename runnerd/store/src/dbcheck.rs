//! The start-up integrity check of the SQLite databases runnerd reads (issue #32): an
//! executions database with corrupt pages late in the file used to be opened as if whole,
//! and the damage surfaced later as "not found" answers.
//!
//! `PRAGMA quick_check` reads every page once (the b-trees' structure, not the indexes'
//! agreement with their tables): its cost is one read of the file, paid once at start-up.

use std::path::Path;

use rusqlite::config::DbConfig;
use rusqlite::{Connection, OpenFlags};

/// Problems a check reports at most (SQLite stops looking after them).
const PROBLEMS: usize = 5;

/// What `quick_check` found wrong with the database at `path`, if anything. `None` too
/// when there is no file yet, or it cannot be opened: the caller's own open says why.
/// The connection never checkpoints on close: a damaged database's WAL is evidence, and
/// writing it back into the damaged file would change what is set aside.
pub fn damage(path: &Path) -> Option<String> {
    if !std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file() && m.len() > 0) {
        return None;
    }
    // No link followed: a link planted at the name is not the database to judge.
    let flags =
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_NOFOLLOW;
    let conn = Connection::open_with_flags(path, flags).ok()?;
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true).ok()?;
    let _ = conn.busy_timeout(std::time::Duration::from_millis(5000));
    let rows = conn
        .prepare(&format!("PRAGMA quick_check({PROBLEMS})"))
        .and_then(|mut s| s.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>());
    match rows {
        Ok(rows) if rows.len() == 1 && rows[0] == "ok" => None,
        Ok(rows) => Some(format!("integrity check failed: {}", rows.join("; "))),
        Err(rusqlite::Error::SqliteFailure(e, msg))
            if matches!(e.code, rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase) =>
        {
            Some(format!("integrity check failed: {}", msg.unwrap_or_else(|| e.to_string())))
        }
        Err(_) => None,
    }
}

/// The remedy a journal line and `/health` give for a damaged database that was kept.
pub fn recover_hint(path: &Path) -> String {
    format!(
        "stop runnerd (and the API process, which shares it), keep a copy, then rebuild it with \
         `sqlite3 {0} .recover | sqlite3 {0}.recovered` and move the recovered file into place",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database of `rows` rows of 1 kB, closed.
    fn database(path: &Path, rows: usize) {
        let conn = Connection::open(path).unwrap();
        conn.execute_batch("CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT NOT NULL)").unwrap();
        for i in 0..rows {
            conn.execute("INSERT INTO t(v) VALUES(?1)", [format!("{i:01000}")]).unwrap();
        }
    }

    #[test]
    fn late_corrupt_pages_are_found_and_a_whole_database_passes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        assert_eq!(damage(&path), None, "no file yet");
        database(&path, 400);
        assert_eq!(damage(&path), None);
        // Garbage over a page near the end of the file.
        let mut bytes = std::fs::read(&path).unwrap();
        let page = 4096;
        let at = (bytes.len() / page - 2) * page;
        for (i, b) in bytes[at..at + page].iter_mut().enumerate() {
            *b = (i * 37 % 251) as u8;
        }
        std::fs::write(&path, &bytes).unwrap();
        let found = damage(&path).expect("damage found");
        assert!(found.starts_with("integrity check failed"), "{found}");
        assert!(recover_hint(&path).contains(".recover"));
    }
}
