//! Durable managed-execution records and logs (contract §3 "What survives a restart",
//! versioning reference §3.5): `<dataDir>/runner-executions/executions.sqlite`, WAL with
//! `synchronous=FULL`, the original's two tables and its plain-JSON record text. Ids stay
//! used forever; on open, unfinished records become `unknown` and are never replayed.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ManagedState;
use super::logs::{LogRow, stream_name};
use crate::launch::Stream;

pub const RESTARTED: &str = "Runner restarted before completion was recorded; the command was not replayed";
/// The start of the error of a record whose stored text cannot be read.
pub const UNREADABLE: &str = "The stored execution record is unreadable, so the outcome is unknown";

/// The HTTP and on-disk `ManagedExecution`, keys in the original's order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ManagedExecution {
    pub agent_id: String,
    pub session_id: String,
    pub id: String,
    pub state: ManagedState,
    pub queued_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_truncated: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<Value>,
}

impl ManagedExecution {
    /// A record as first saved: `queued`, nothing else set.
    pub fn queued(agent_id: String, session_id: String, id: String, queued_at: String) -> ManagedExecution {
        ManagedExecution {
            agent_id,
            session_id,
            id,
            state: ManagedState::Queued,
            queued_at,
            started_at: None,
            finished_at: None,
            log_truncated: None,
            result: None,
            error: None,
            version: None,
        }
    }

    pub fn is_terminal(&self) -> bool {
        self.state.is_terminal()
    }
}

/// Whether a state read as text (a stored record's, an answer's) is terminal; a text that
/// names no state is not.
pub fn is_terminal(state: &str) -> bool {
    ManagedState::parse(state).is_some_and(ManagedState::is_terminal)
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("The execution database {} failed", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("Could not create the execution directory {}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("An execution record could not be encoded")]
    Record(#[source] serde_json::Error),
    #[error("Could not set the damaged execution database {} aside", path.display())]
    SetAside {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl DbError {
    /// Whether the database file itself is damaged (not a database, or malformed): then it
    /// is set aside and a new one started, rather than refusing to start.
    fn is_damage(&self) -> bool {
        use rusqlite::ErrorCode::{DatabaseCorrupt, NotADatabase};
        matches!(self, DbError::Sqlite { source: rusqlite::Error::SqliteFailure(e, _), .. }
            if matches!(e.code, DatabaseCorrupt | NotADatabase))
    }
}

/// What opening found: unfinished records turned `unknown`, unreadable rows, and a damaged
/// database set aside (then every other list is about the new one).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OpenReport {
    pub turned: Vec<String>,
    /// (id, why) of each row whose record cannot be read; each answers as `unknown`.
    pub unreadable: Vec<(String, String)>,
    pub set_aside: Option<SetAside>,
}

/// A damaged database moved aside: the names it and its WAL now have, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    pub moved: Vec<PathBuf>,
    pub reason: String,
}

/// A row's record text, parsed: bytes that are not UTF-8 or not a record are a reason.
fn parse_record(bytes: &[u8]) -> Result<ManagedExecution, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("invalid UTF-8: {e}"))?;
    serde_json::from_str(text).map_err(|e| format!("not a record: {e}"))
}

/// Any column's bytes (TEXT, BLOB; NULL or a number as their text), never an error.
fn column_bytes(row: &rusqlite::Row<'_>, i: usize) -> Vec<u8> {
    use rusqlite::types::ValueRef;
    match row.get_ref(i) {
        Ok(ValueRef::Text(b) | ValueRef::Blob(b)) => b.to_vec(),
        Ok(ValueRef::Integer(n)) => n.to_string().into_bytes(),
        Ok(ValueRef::Real(f)) => f.to_string().into_bytes(),
        Ok(ValueRef::Null) | Err(_) => Vec::new(),
    }
}

/// What an unreadable row answers: `unknown`, with the reason; owner and id as stored
/// (an owner that is not UTF-8 matches no caller).
fn unreadable_record(id: &str, session: &[u8], agent: &[u8], why: &str, now_iso: &str) -> ManagedExecution {
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap_or_else(|_| "\u{fffd}".into());
    ManagedExecution {
        state: ManagedState::Unknown,
        finished_at: Some(now_iso.to_owned()),
        error: Some(format!("{UNREADABLE} ({why})")),
        ..ManagedExecution::queued(text(agent), text(session), id.to_owned(), now_iso.to_owned())
    }
}

/// The names a damaged database and its companions are moved to: `<name>.corrupt-<stamp>`.
pub fn aside_name(name: &str, stamp: &str) -> String {
    format!("{name}.corrupt-{stamp}")
}

/// What the routes check before they read a record ([`ExecutionsDb::meta`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordMeta {
    pub session_id: String,
    pub agent_id: String,
    pub state: String,
    pub log_truncated: bool,
    /// The record's text, in bytes.
    pub size: u64,
    /// The text is valid JSON (and UTF-8); when not, [`ExecutionsDb::get`] answers the
    /// `unknown` record that says why.
    pub readable: bool,
}

/// One page of logs: rows after a cursor, and whether more exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPage {
    pub rows: Vec<(u64, String, String)>,
    pub more: bool,
}

#[derive(Debug)]
pub struct ExecutionsDb {
    conn: Mutex<Connection>,
    path: PathBuf,
}

impl ExecutionsDb {
    /// Opens (creating) the database and turns every unfinished record into `unknown`;
    /// rows that cannot be read are reported, not fatal. A file that is not a database or
    /// is malformed is moved aside with its WAL (`executions.sqlite.corrupt-<stamp>`,
    /// `executions.sqlite-wal.corrupt-<stamp>`) and a new database started; every other
    /// file is left as it is.
    pub fn open(data_dir: &Path, now_iso: &str) -> Result<(ExecutionsDb, OpenReport), DbError> {
        let dir = data_dir.join(common::layout::RUNNER_EXECUTIONS);
        std::fs::create_dir_all(&dir).map_err(|source| DbError::Dir { path: dir.clone(), source })?;
        let path = dir.join(common::layout::EXECUTIONS_DB);
        // A file that is not SQLite's is set aside before SQLite opens it (closing a
        // connection to it could delete the WAL beside it).
        // So is one whose pages are damaged (issue #32: corrupt pages late in the file were
        // used, and surfaced later as "not found").
        let first = not_sqlite(&path)
            .or_else(|| corrupt(&path))
            .map_or(Ok(()), Err)
            .and_then(|()| Self::connect(&path))
            .and_then(|conn| {
                let db = ExecutionsDb { conn: Mutex::new(conn), path: path.clone() };
                let report = db.mark_unfinished_unknown(now_iso)?;
                Ok((db, report))
            });
        match first {
            Err(e) if e.is_damage() => {
                let reason = crate::error_chain(&e);
                let stamp = now_iso.replace([':', '.'], "-");
                let moved = set_aside(&path, &stamp)?;
                let db = ExecutionsDb { conn: Mutex::new(Self::connect(&path)?), path };
                let mut report = db.mark_unfinished_unknown(now_iso)?;
                report.set_aside = Some(SetAside { moved, reason });
                Ok((db, report))
            }
            other => other,
        }
    }

    fn connect(path: &Path) -> Result<Connection, DbError> {
        let sqlite = |source| DbError::Sqlite { path: path.to_owned(), source };
        let conn = Connection::open(path).map_err(sqlite)?;
        conn.busy_timeout(std::time::Duration::from_millis(5000)).map_err(sqlite)?;
        crate::coordination::enable_wal(&conn).map_err(sqlite)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(sqlite)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS executions(id TEXT PRIMARY KEY, session TEXT NOT NULL, agent TEXT NOT NULL, record TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS logs(execution TEXT NOT NULL, cursor INTEGER NOT NULL, stream TEXT NOT NULL, text TEXT NOT NULL, PRIMARY KEY(execution, cursor));",
        )
        .map_err(sqlite)?;
        Ok(conn)
    }

    fn sqlite(&self, source: rusqlite::Error) -> DbError {
        DbError::Sqlite { path: self.path.clone(), source }
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_unfinished_unknown(&self, now_iso: &str) -> Result<OpenReport, DbError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.sqlite(e))?;
        let mut report = OpenReport::default();
        {
            let mut stmt = tx.prepare("SELECT id, record FROM executions").map_err(|e| self.sqlite(e))?;
            let records = stmt
                .query_map([], |row| Ok((column_bytes(row, 0), column_bytes(row, 1))))
                .map_err(|e| self.sqlite(e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| self.sqlite(e))?;
            for (id, bytes) in records {
                let mut rec = match parse_record(&bytes) {
                    Ok(rec) => rec,
                    Err(why) => {
                        // Left as stored (evidence); every read answers it as `unknown`.
                        report.unreadable.push((String::from_utf8_lossy(&id).into_owned(), why));
                        continue;
                    }
                };
                if rec.is_terminal() {
                    continue;
                }
                rec.state = ManagedState::Unknown;
                rec.finished_at = Some(now_iso.to_owned());
                rec.error = Some(RESTARTED.into());
                let json = serde_json::to_string(&rec).map_err(DbError::Record)?;
                tx.execute("UPDATE executions SET record=?1 WHERE id=?2", params![json, rec.id])
                    .map_err(|e| self.sqlite(e))?;
                report.turned.push(rec.id);
            }
        }
        tx.commit().map_err(|e| self.sqlite(e))?;
        Ok(report)
    }

    /// Stores a new record; `Ok(false)` when the id was ever used before.
    pub fn insert_new(&self, rec: &ManagedExecution) -> Result<bool, DbError> {
        let json = serde_json::to_string(rec).map_err(DbError::Record)?;
        let n = self
            .conn()
            .execute(
                "INSERT OR IGNORE INTO executions(id, session, agent, record) VALUES(?1, ?2, ?3, ?4)",
                params![rec.id, rec.session_id, rec.agent_id, json],
            )
            .map_err(|e| self.sqlite(e))?;
        Ok(n == 1)
    }

    #[cfg(test)]
    fn exists(&self, id: &str) -> Result<bool, DbError> {
        self.conn()
            .query_row("SELECT 1 FROM executions WHERE id=?1", params![id], |_| Ok(()))
            .optional()
            .map(|r| r.is_some())
            .map_err(|e| self.sqlite(e))
    }

    /// Upserts the record (every state change).
    pub fn save(&self, rec: &ManagedExecution) -> Result<(), DbError> {
        let json = serde_json::to_string(rec).map_err(DbError::Record)?;
        self.save_json(&rec.id, &rec.session_id, &rec.agent_id, &json)
    }

    /// Upserts the record as `json`, its text serialized by the caller (no second copy of a
    /// large result).
    pub fn save_json(&self, id: &str, session: &str, agent: &str, json: &str) -> Result<(), DbError> {
        self.conn()
            .execute(
                "INSERT INTO executions(id, session, agent, record) VALUES(?1, ?2, ?3, ?4)
                 ON CONFLICT(id) DO UPDATE SET record=excluded.record",
                params![id, session, agent, json],
            )
            .map(|_| ())
            .map_err(|e| self.sqlite(e))
    }

    /// The versions and trees the records name (`version`, `result.workspaceSnapshot`):
    /// the version collector keeps them, and their history rows (issue #32). A record that
    /// does not parse names nothing. Read on a read-only connection of its own (WAL lets it
    /// read beside the writer), so the managed runs' log appends and saves never wait for
    /// this scan of every record.
    pub fn named_versions(&self) -> Result<Vec<crate::versioning::Ref>, DbError> {
        use rusqlite::OpenFlags;
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NOFOLLOW
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.path, flags).map_err(|e| self.sqlite(e))?;
        conn.busy_timeout(std::time::Duration::from_millis(5000)).map_err(|e| self.sqlite(e))?;
        let mut stmt = conn
            .prepare("SELECT json_extract(record, '$.version'), json_extract(record, '$.result.workspaceSnapshot') FROM executions WHERE json_valid(record)")
            .map_err(|e| self.sqlite(e))?;
        let mut rows = stmt.query([]).map_err(|e| self.sqlite(e))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(e))? {
            for i in 0..2 {
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(&column_bytes(row, i)) else {
                    continue;
                };
                if let Ok(r) = crate::versioning::Ref::from_value(&v) {
                    out.push(r);
                }
            }
        }
        Ok(out)
    }

    /// The record; one whose stored text cannot be read answers `unknown` with the reason.
    pub fn get(&self, id: &str) -> Result<Option<ManagedExecution>, DbError> {
        let row = self
            .conn()
            .query_row("SELECT session, agent, record FROM executions WHERE id=?1", params![id], |row| {
                Ok((column_bytes(row, 0), column_bytes(row, 1), column_bytes(row, 2)))
            })
            .optional()
            .map_err(|e| self.sqlite(e))?;
        Ok(row.map(|(session, agent, record)| {
            parse_record(&record).unwrap_or_else(|why| {
                unreadable_record(id, &session, &agent, &why, &crate::timefmt::now_iso())
            })
        }))
    }

    /// The owner, the state, `logTruncated` and the size of a record, read by SQLite without
    /// loading its text here (a record holds megabytes of result output).
    pub fn meta(&self, id: &str) -> Result<Option<RecordMeta>, DbError> {
        // A damaged row (not UTF-8, not JSON) must not fail the read: its owner is read as
        // bytes and its state left empty, `readable` false.
        self.conn()
            .query_row(
                "SELECT session, agent, \
                 CASE WHEN json_valid(record) THEN json_extract(record, '$.state') END, \
                 CASE WHEN json_valid(record) THEN coalesce(json_extract(record, '$.logTruncated'), 0) ELSE 0 END, \
                 octet_length(record), json_valid(record) \
                 FROM executions WHERE id=?1",
                params![id],
                |row| {
                    let text = |i| String::from_utf8_lossy(&column_bytes(row, i)).into_owned();
                    Ok(RecordMeta {
                        session_id: text(0),
                        agent_id: text(1),
                        state: row.get::<_, Option<String>>(2).ok().flatten().unwrap_or_default(),
                        log_truncated: row.get::<_, i64>(3).unwrap_or(0) != 0,
                        size: row.get::<_, i64>(4).unwrap_or(0).max(0) as u64,
                        readable: row.get::<_, i64>(5).unwrap_or(0) != 0,
                    })
                },
            )
            .optional()
            .map_err(|e| self.sqlite(e))
    }

    /// The stored text of a record (owner, text); read only when [`RecordMeta::readable`].
    pub fn record_text(&self, id: &str) -> Result<Option<(String, String, String)>, DbError> {
        self.conn()
            .query_row("SELECT session, agent, record FROM executions WHERE id=?1", params![id], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?))
            })
            .optional()
            .map_err(|e| self.sqlite(e))
    }

    /// Appends rows with cursors `first, first+1, …` in one transaction.
    pub fn append_logs(&self, id: &str, first: u64, rows: &[LogRow]) -> Result<(), DbError> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.sqlite(e))?;
        {
            let mut stmt = tx
                .prepare_cached("INSERT INTO logs(execution, cursor, stream, text) VALUES(?1, ?2, ?3, ?4)")
                .map_err(|e| self.sqlite(e))?;
            for (i, row) in rows.iter().enumerate() {
                stmt.execute(params![id, (first + i as u64) as i64, stream_name(row.stream), row.text])
                    .map_err(|e| self.sqlite(e))?;
            }
        }
        tx.commit().map_err(|e| self.sqlite(e))
    }

    /// Up to `limit` rows with cursor > `after`, ascending, and whether more follow.
    pub fn page(&self, id: &str, after: u64, limit: usize) -> Result<LogPage, DbError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(
                "SELECT cursor, stream, text FROM logs WHERE execution=?1 AND cursor>?2 ORDER BY cursor LIMIT ?3",
            )
            .map_err(|e| self.sqlite(e))?;
        let mut rows = stmt
            .query_map(params![id, after as i64, (limit + 1) as i64], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, String>(1)?, r.get::<_, String>(2)?))
            })
            .map_err(|e| self.sqlite(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.sqlite(e))?;
        let more = rows.len() > limit;
        rows.truncate(limit);
        Ok(LogPage { rows, more })
    }

    /// Whether any row of `stream` was retained.
    pub fn has_rows(&self, id: &str, stream: Stream) -> Result<bool, DbError> {
        self.conn()
            .query_row(
                "SELECT 1 FROM logs WHERE execution=?1 AND stream=?2 LIMIT 1",
                params![id, stream_name(stream)],
                |_| Ok(()),
            )
            .optional()
            .map(|r| r.is_some())
            .map_err(|e| self.sqlite(e))
    }

    /// Up to `limit` rows of one stream after `after`, as (cursor, text).
    fn stream_rows(
        &self,
        id: &str,
        stream: Stream,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, String)>, DbError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(
                "SELECT cursor, text FROM logs WHERE execution=?1 AND stream=?2 AND cursor>?3 ORDER BY cursor LIMIT ?4",
            )
            .map_err(|e| self.sqlite(e))?;
        let rows: Result<Vec<(u64, String)>, _> = stmt
            .query_map(params![id, stream_name(stream), after as i64, limit as i64], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, String>(1)?))
            })
            .map_err(|e| self.sqlite(e))?
            .collect();
        rows.map_err(|e| self.sqlite(e))
    }
}

/// `Some` (a damage error) when `path` exists, is not empty and does not begin with
/// SQLite's header string.
fn not_sqlite(path: &Path) -> Option<DbError> {
    use std::io::Read;
    let mut head = [0u8; 16];
    let mut file = std::fs::File::open(path).ok()?;
    let n = file.read(&mut head).ok()?;
    if n == 0 || head.starts_with(b"SQLite format 3\0") {
        return None;
    }
    let code = rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_NOTADB);
    let source =
        rusqlite::Error::SqliteFailure(code, Some("file is not a database (no SQLite header)".into()));
    Some(DbError::Sqlite { path: path.to_owned(), source })
}

/// The integrity check's finding ([`crate::dbcheck::damage`]) as a damage error.
fn corrupt(path: &Path) -> Option<DbError> {
    let problem = crate::dbcheck::damage(path)?;
    let code = rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT);
    Some(DbError::Sqlite {
        path: path.to_owned(),
        source: rusqlite::Error::SqliteFailure(code, Some(problem)),
    })
}

/// Moves `path` and its `-wal` and `-shm` (those that exist) to their aside names; returns
/// the new paths. Only regular files are moved (anything else is refused: not ours).
fn set_aside(path: &Path, stamp: &str) -> Result<Vec<PathBuf>, DbError> {
    let mut moved = Vec::new();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for suffix in ["", "-wal", "-shm"] {
        let from = path.with_file_name(format!("{name}{suffix}"));
        let fail = |source| DbError::SetAside { path: from.clone(), source };
        match std::fs::symlink_metadata(&from) {
            Ok(m) if m.file_type().is_file() => {}
            Ok(_) => return Err(fail(std::io::Error::other("not a regular file"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(fail(e)),
        }
        let to = path.with_file_name(aside_name(&format!("{name}{suffix}"), stamp));
        std::fs::rename(&from, &to).map_err(fail)?;
        moved.push(to);
    }
    Ok(moved)
}

/// Reads one stream's retained rows in cursor order, a page at a time: a 1 GiB log goes
/// into the version store without ever being held whole.
#[derive(Debug)]
pub struct RowReader {
    db: std::sync::Arc<ExecutionsDb>,
    id: String,
    stream: Stream,
    after: u64,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl RowReader {
    pub fn new(db: std::sync::Arc<ExecutionsDb>, id: &str, stream: Stream) -> RowReader {
        RowReader { db, id: id.to_owned(), stream, after: 0, buf: Vec::new(), pos: 0, done: false }
    }
}

impl std::io::Read for RowReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            let rows =
                self.db.stream_rows(&self.id, self.stream, self.after, 64).map_err(std::io::Error::other)?;
            self.done = rows.len() < 64;
            self.buf.clear();
            self.pos = 0;
            for (cursor, text) in rows {
                self.after = cursor;
                self.buf.extend_from_slice(text.as_bytes());
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(id: &str, state: &str) -> ManagedExecution {
        let queued = "2026-01-01T00:00:00.000Z".into();
        ManagedExecution {
            state: ManagedState::parse(state).unwrap(),
            ..ManagedExecution::queued("main".into(), "s".into(), id.into(), queued)
        }
    }

    #[test]
    fn a_record_whose_state_names_none_is_unreadable() {
        let text = r#"{"agentId":"main","sessionId":"s","id":"a","state":"paused","queuedAt":"t"}"#;
        let why = parse_record(text.as_bytes()).unwrap_err();
        assert!(why.starts_with("not a record: unknown variant `paused`"), "{why}");
    }

    #[test]
    fn the_record_text_is_the_originals_shape() {
        let text = serde_json::to_string(&record("a", "queued")).unwrap();
        assert_eq!(
            text,
            r#"{"agentId":"main","sessionId":"s","id":"a","state":"queued","queuedAt":"2026-01-01T00:00:00.000Z"}"#
        );
    }

    #[test]
    fn ids_are_used_forever_and_restarts_never_replay() {
        let dir = tempfile::tempdir().unwrap();
        let (db, report) = ExecutionsDb::open(dir.path(), "t0").unwrap();
        assert!(report.turned.is_empty());
        assert!(db.insert_new(&record("done", "queued")).unwrap());
        let mut done = record("done", "completed");
        done.finished_at = Some("t1".into());
        db.save(&done).unwrap();
        assert!(db.insert_new(&record("run", "queued")).unwrap());
        db.save(&record("run", "running")).unwrap();
        assert!(!db.insert_new(&record("done", "queued")).unwrap(), "a used id is refused");
        drop(db);
        let (db, report) = ExecutionsDb::open(dir.path(), "t2").unwrap();
        assert_eq!(report.turned, vec!["run".to_owned()]);
        let run = db.get("run").unwrap().unwrap();
        assert_eq!(
            (run.state.as_str(), run.error.as_deref(), run.finished_at.as_deref()),
            ("unknown", Some(RESTARTED), Some("t2"))
        );
        assert_eq!(db.get("done").unwrap().unwrap(), done);
        assert!(!db.insert_new(&record("run", "queued")).unwrap());
        assert!(db.exists("run").unwrap() && !db.exists("nope").unwrap());
    }

    #[test]
    fn pages_hold_four_rows_and_say_whether_more_follow() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _) = ExecutionsDb::open(dir.path(), "t").unwrap();
        let rows: Vec<LogRow> = (0..6)
            .map(|i| LogRow {
                stream: if i == 2 { Stream::Stderr } else { Stream::Stdout },
                text: format!("r{i}"),
            })
            .collect();
        db.append_logs("x", 1, &rows[..3]).unwrap();
        db.append_logs("x", 4, &rows[3..]).unwrap();
        let p1 = db.page("x", 0, 4).unwrap();
        assert_eq!(p1.rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert_eq!(p1.rows[2].1, "stderr");
        assert!(p1.more);
        let p2 = db.page("x", 4, 4).unwrap();
        assert_eq!((p2.rows.len(), p2.more), (2, false));
        assert!(db.page("x", 6, 4).unwrap().rows.is_empty());
        let db = std::sync::Arc::new(db);
        let mut text = String::new();
        std::io::Read::read_to_string(&mut RowReader::new(db.clone(), "x", Stream::Stdout), &mut text)
            .unwrap();
        assert_eq!(text, "r0r1r3r4r5");
        assert!(db.has_rows("x", Stream::Stderr).unwrap() && !db.has_rows("y", Stream::Stdout).unwrap());
    }

    #[test]
    fn an_unreadable_row_answers_unknown_and_stops_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _) = ExecutionsDb::open(dir.path(), "t0").unwrap();
        db.insert_new(&record("good", "queued")).unwrap();
        for id in ["utf8", "json"] {
            db.insert_new(&record(id, "running")).unwrap();
        }
        {
            let conn = db.conn();
            conn.execute("UPDATE executions SET record=CAST(x'7bff22' AS TEXT) WHERE id='utf8'", []).unwrap();
            conn.execute("UPDATE executions SET record='{\"state\":' WHERE id='json'", []).unwrap();
        }
        drop(db);
        let (db, report) = ExecutionsDb::open(dir.path(), "t1").unwrap();
        assert_eq!(report.turned, vec!["good".to_owned()]);
        let ids: Vec<&str> = report.unreadable.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["utf8", "json"]);
        assert!(report.unreadable[0].1.contains("UTF-8"), "{:?}", report.unreadable);
        for id in ["utf8", "json"] {
            let rec = db.get(id).unwrap().unwrap();
            assert_eq!(
                (rec.state.as_str(), rec.session_id.as_str(), rec.agent_id.as_str()),
                ("unknown", "s", "main")
            );
            assert!(rec.error.as_deref().unwrap().starts_with(UNREADABLE), "{rec:?}");
        }
        assert_eq!(db.get("good").unwrap().unwrap().state, ManagedState::Unknown);
    }

    #[test]
    fn the_versions_records_name_are_read_beside_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _) = ExecutionsDb::open(dir.path(), "2026-01-02T03:04:05.678Z").unwrap();
        let r = |hex: char| {
            json!({"pool": "agent-state", "digest": format!("sha256:{}", hex.to_string().repeat(64)),
                   "size": 5, "mediaType": crate::versioning::RECORD_MEDIA_TYPE})
        };
        let named = json!({"agentId": "a", "sessionId": "s", "id": "n", "state": "completed",
            "queuedAt": "t", "version": r('a'), "result": {"workspaceSnapshot": r('b')}});
        db.save_json("n", "s", "a", &named.to_string()).unwrap();
        db.save_json("bare", "s", "a", &json!({"id": "bare", "state": "queued"}).to_string()).unwrap();
        db.save_json("bad", "s", "a", "{not json").unwrap();
        db.save_json("wrong", "s", "a", &json!({"version": {"pool": "x"}}).to_string()).unwrap();
        // The writer's connection holds an open transaction: the scan reads beside it.
        let writer = db.conn();
        writer.execute_batch("BEGIN IMMEDIATE").unwrap();
        let mut found: Vec<String> =
            db.named_versions().unwrap().iter().map(|r| r.hex()[..1].to_owned()).collect();
        writer.execute_batch("ROLLBACK").unwrap();
        found.sort();
        assert_eq!(found, ["a", "b"]);
    }

    #[test]
    fn a_garbage_database_is_set_aside_with_its_wal_and_a_new_one_started() {
        let dir = tempfile::tempdir().unwrap();
        let execs = dir.path().join("runner-executions");
        std::fs::create_dir_all(&execs).unwrap();
        let garbage = vec![0x5au8; 8192];
        std::fs::write(execs.join("executions.sqlite"), &garbage).unwrap();
        std::fs::write(execs.join("executions.sqlite-wal"), b"wal bytes").unwrap();
        std::fs::write(execs.join("other.txt"), b"kept").unwrap();
        let (db, report) = ExecutionsDb::open(dir.path(), "2026-01-02T03:04:05.678Z").unwrap();
        let aside = report.set_aside.expect("set aside");
        let stamp = "2026-01-02T03-04-05-678Z";
        assert_eq!(
            aside.moved,
            vec![
                execs.join(aside_name("executions.sqlite", stamp)),
                execs.join(aside_name("executions.sqlite-wal", stamp)),
            ]
        );
        assert!(aside.reason.contains("not a database"), "{}", aside.reason);
        assert_eq!(std::fs::read(&aside.moved[0]).unwrap(), garbage);
        assert_eq!(std::fs::read(&aside.moved[1]).unwrap(), b"wal bytes");
        assert_eq!(std::fs::read(execs.join("other.txt")).unwrap(), b"kept");
        assert!(db.insert_new(&record("new", "queued")).unwrap());
        drop(db);
        let (_, report) = ExecutionsDb::open(dir.path(), "t").unwrap();
        assert_eq!((report.set_aside, report.turned), (None, vec!["new".to_owned()]));
    }
}
