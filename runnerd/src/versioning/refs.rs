//! Live and history refs in `<dataDir>/versioning/refs.sqlite` (§5): compare-and-swap
//! commits whose targets are stored as JCS text, which the API matches byte for byte.

use std::path::PathBuf;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde_json::Value;

use super::store::Store;
use super::{Pool, Ref, VersionError, jcs};

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS live_refs(name TEXT PRIMARY KEY, target TEXT NOT NULL);
    CREATE TABLE IF NOT EXISTS history_refs(
        id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, target TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS history_by_name ON history_refs(name, id);
";

/// One connection to the refs database. Send, not Sync: give each thread its own.
#[derive(Debug)]
pub struct Refs {
    conn: Connection,
    path: PathBuf,
}

impl Refs {
    /// Opens (creating if needed) `refs.sqlite` of an initialised store, with the original's
    /// pragmas: WAL, synchronous=FULL, busy_timeout=5000.
    pub fn open(store: &Store) -> Result<Refs, VersionError> {
        let path = store.root().join("refs.sqlite");
        let conn = Connection::open(&path).map_err(sql("open", &path))?;
        let refs = Refs { conn, path };
        refs.conn
            .query_row("PRAGMA journal_mode=WAL", [], |row| row.get::<_, String>(0))
            .map_err(sql("enable WAL", &refs.path))?;
        refs.conn
            .pragma_update(None, "synchronous", "FULL")
            .map_err(sql("set synchronous=FULL", &refs.path))?;
        refs.conn.busy_timeout(Duration::from_millis(5000)).map_err(sql("set busy_timeout", &refs.path))?;
        refs.conn.execute_batch(SCHEMA).map_err(sql("create the schema", &refs.path))?;
        Ok(refs)
    }

    /// The live target of `name`, if any.
    pub fn head(&self, name: &str) -> Result<Option<Ref>, VersionError> {
        let text: Option<String> = self
            .conn
            .query_row("SELECT target FROM live_refs WHERE name=?", [name], |row| row.get(0))
            .optional()
            .map_err(sql("read a head", &self.path))?;
        text.map(|t| parse_target(&t)).transpose()
    }

    /// Moves `name` from `expected` (None: must not exist) to `target` after verifying the
    /// whole closure of `target`. Fails with [`VersionError::HeadChanged`] if the head is no
    /// longer `expected`; the live upsert and history insert happen in one transaction.
    pub fn commit(
        &mut self,
        store: &Store,
        name: &str,
        expected: Option<&Ref>,
        target: &Ref,
    ) -> Result<(), VersionError> {
        validate_name(name)?;
        target.require_pool(Pool::AgentState)?;
        store.validate_closure(target)?;
        let path = self.path.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql("begin a commit", &path))?;
        let current: Option<String> = tx
            .query_row("SELECT target FROM live_refs WHERE name=?", [name], |row| row.get(0))
            .optional()
            .map_err(sql("read a head", &path))?;
        let current = match current {
            Some(text) => jcs::canonicalize(
                &serde_json::from_str::<Value>(&text).map_err(|_| VersionError::InvalidRef)?,
            )?,
            None => "null".to_string(),
        };
        let expected = expected.map_or_else(|| "null".to_string(), Ref::jcs);
        if current != expected {
            return Err(VersionError::HeadChanged);
        }
        let text = target.jcs();
        tx.execute(
            "INSERT INTO live_refs(name, target) VALUES(?, ?) ON CONFLICT(name) DO UPDATE SET target=excluded.target",
            params![name, text],
        )
        .map_err(sql("update a head", &path))?;
        tx.execute("INSERT INTO history_refs(name, target) VALUES(?, ?)", params![name, text])
            .map_err(sql("append to the history", &path))?;
        tx.commit().map_err(sql("commit", &path))
    }

    /// Every target `name` has had, oldest first.
    pub fn history(&self, name: &str) -> Result<Vec<Ref>, VersionError> {
        self.targets("SELECT target FROM history_refs WHERE name=? ORDER BY id", [name])
    }

    /// Every target that is or was live under any name (the GC roots), de-duplicated.
    pub fn roots(&self) -> Result<Vec<Ref>, VersionError> {
        self.targets("SELECT target FROM live_refs UNION SELECT target FROM history_refs ORDER BY target", [])
    }

    fn targets<P: rusqlite::Params>(&self, query: &str, params: P) -> Result<Vec<Ref>, VersionError> {
        let mut stmt = self.conn.prepare(query).map_err(sql("prepare a query", &self.path))?;
        let texts = stmt
            .query_map(params, |row| row.get::<_, String>(0))
            .and_then(|rows| rows.collect::<Result<Vec<String>, _>>())
            .map_err(sql("read refs", &self.path))?;
        texts.iter().map(|t| parse_target(t)).collect()
    }
}

/// Non-empty, at most 512 UTF-16 units, no C0 control characters.
fn validate_name(name: &str) -> Result<(), VersionError> {
    let ok = !name.is_empty() && name.encode_utf16().count() <= 512 && !name.chars().any(|c| c < '\u{20}');
    if ok { Ok(()) } else { Err(VersionError::InvalidRefName) }
}

fn parse_target(text: &str) -> Result<Ref, VersionError> {
    let v: Value = serde_json::from_str(text).map_err(|_| VersionError::InvalidRef)?;
    Ref::from_value(&v)
}

fn sql(action: &'static str, path: &std::path::Path) -> impl FnOnce(rusqlite::Error) -> VersionError {
    let path = path.to_path_buf();
    move |source| VersionError::Sqlite { action, path, source }
}
