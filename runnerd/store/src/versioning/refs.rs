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

/// What a commit's transaction compares the head with.
#[derive(Debug, Clone, Copy)]
enum Over<'a> {
    /// Whatever it is (the caller's lease serialises the head's writers).
    Current,
    /// This head (`None`: the ref must not exist yet), else [`VersionError::HeadChanged`].
    Exactly(Option<&'a Ref>),
}

/// One row of `history_refs`: a version of the head `name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryRow {
    pub id: i64,
    pub name: String,
    pub target: Ref,
}

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
        let path = store.root().join(common::layout::REFS_DB);
        let conn = Connection::open(&path).map_err(sql("open", &path))?;
        let refs = Refs { conn, path };
        refs.conn.busy_timeout(Duration::from_millis(5000)).map_err(sql("set busy_timeout", &refs.path))?;
        crate::coordination::enable_wal(&refs.conn).map_err(sql("enable WAL", &refs.path))?;
        refs.conn
            .pragma_update(None, "synchronous", "FULL")
            .map_err(sql("set synchronous=FULL", &refs.path))?;
        refs.conn.execute_batch(SCHEMA).map_err(sql("create the schema", &refs.path))?;
        Ok(refs)
    }

    /// The live target of `name`, if any.
    pub fn head(&self, name: &str) -> Result<Option<Ref>, VersionError> {
        let text: Option<String> = self
            .conn
            .prepare_cached("SELECT target FROM live_refs WHERE name=?")
            .and_then(|mut s| s.query_row([name], |row| row.get(0)).optional())
            .map_err(sql("read a head", &self.path))?;
        text.map(|t| parse_target(&t)).transpose()
    }

    /// Moves `name` from `expected` (None: must not exist) to `target` after verifying the
    /// whole closure of `target`. Fails with [`VersionError::HeadChanged`] if the head is no
    /// longer `expected`; the live upsert and history insert happen in one transaction.
    /// (The tests' entry point: runnerd's writers validate outside their locks and call
    /// [`Refs::commit_validated`].)
    #[cfg(test)]
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
        store.sync_pending()?;
        self.commit_validated(name, expected, target)
    }

    /// The transaction of [`Refs::commit`] alone, for a caller that has already run
    /// `validate_closure` and `sync_pending` on `target` itself (outside any lock it holds
    /// around this call, so that one commit's closure check does not hold others up).
    pub fn commit_validated(
        &mut self,
        name: &str,
        expected: Option<&Ref>,
        target: &Ref,
    ) -> Result<(), VersionError> {
        self.commit_over(name, Over::Exactly(expected), target)
    }

    /// [`Refs::commit_validated`] over whatever head `name` has: for a writer that holds the
    /// workspace lease, which serialises every writer of the head, so reading the head in a
    /// transaction of its own first would only repeat this one's read.
    pub fn commit_over_current(&mut self, name: &str, target: &Ref) -> Result<(), VersionError> {
        self.commit_over(name, Over::Current, target)
    }

    fn commit_over(&mut self, name: &str, expected: Over<'_>, target: &Ref) -> Result<(), VersionError> {
        validate_name(name)?;
        target.require_pool(Pool::AgentState)?;
        let path = self.path.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql("begin a commit", &path))?;
        let current: Option<String> = tx
            .prepare_cached("SELECT target FROM live_refs WHERE name=?")
            .and_then(|mut s| s.query_row([name], |row| row.get(0)).optional())
            .map_err(sql("read a head", &path))?;
        match expected {
            // Over any head, but an unreadable one fails the commit (which poisons the
            // workspace) rather than being written over unnoticed.
            Over::Current => {
                if let Some(text) = &current {
                    parse_target(text)?;
                }
            }
            Over::Exactly(expected) => {
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
            }
        }
        let text = target.jcs();
        // Cached statements: every commit runs the same three (parsed once per connection).
        tx.prepare_cached(
            "INSERT INTO live_refs(name, target) VALUES(?, ?) \
             ON CONFLICT(name) DO UPDATE SET target=excluded.target",
        )
        .and_then(|mut s| s.execute(params![name, text]))
        .map_err(sql("update a head", &path))?;
        tx.prepare_cached("INSERT INTO history_refs(name, target) VALUES(?, ?)")
            .and_then(|mut s| s.execute(params![name, text]))
            .map_err(sql("append to the history", &path))?;
        tx.commit().map_err(sql("commit", &path))
    }

    /// Every history row after `after` (an id), oldest first: the collector's view of the
    /// versions (issue #32). A row whose target does not parse is left out (it roots
    /// nothing that could be read).
    pub fn history_rows(&self, after: i64) -> Result<Vec<HistoryRow>, VersionError> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, name, target FROM history_refs WHERE id > ? ORDER BY id")
            .map_err(sql("prepare a query", &self.path))?;
        let rows = stmt
            .query_map([after], |row| {
                Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?, row.get::<_, String>(2)?))
            })
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(sql("read the history", &self.path))?;
        Ok(rows
            .into_iter()
            .filter_map(|(id, name, text)| {
                parse_target(&text).ok().map(|target| HistoryRow { id, name, target })
            })
            .collect())
    }

    /// Every live ref: (name, target); one whose target does not parse is left out.
    pub fn live_rows(&self) -> Result<Vec<(String, Ref)>, VersionError> {
        let mut stmt = self
            .conn
            .prepare("SELECT name, target FROM live_refs")
            .map_err(sql("prepare a query", &self.path))?;
        let rows = stmt
            .query_map([], |row| Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?)))
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(sql("read the heads", &self.path))?;
        Ok(rows.into_iter().filter_map(|(name, text)| parse_target(&text).ok().map(|t| (name, t))).collect())
    }

    /// Removes history rows (the retention's verdict), in one transaction. A head is a
    /// live ref and stays whatever its history rows.
    pub fn delete_history(&mut self, ids: &[i64]) -> Result<usize, VersionError> {
        let path = self.path.clone();
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql("begin a history pruning", &path))?;
        let mut deleted = 0;
        {
            let mut stmt =
                tx.prepare("DELETE FROM history_refs WHERE id = ?").map_err(sql("prepare a query", &path))?;
            for id in ids {
                deleted += stmt.execute([id]).map_err(sql("prune the history", &path))?;
            }
        }
        tx.commit().map_err(sql("commit", &path))?;
        Ok(deleted)
    }

    /// Every target `name` has had, oldest first.
    pub fn history(&self, name: &str) -> Result<Vec<Ref>, VersionError> {
        self.targets("SELECT target FROM history_refs WHERE name=? ORDER BY id", [name])
    }

    /// Every target that is or was live under any name (the GC roots), de-duplicated.
    #[cfg(test)]
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::versioning::testutil::{example_workspace, temp_store};
    use crate::versioning::{OCTET_STREAM, mutation_value, workspace_head_name};

    fn record_with_leaf(store: &Store, text: &[u8]) -> Ref {
        let leaf = store.put(Pool::Data, text, OCTET_STREAM).unwrap();
        store.put_record("Test", json!({ "leaf": leaf.to_value() })).unwrap()
    }

    #[test]
    fn schema_pragmas_and_the_stored_target_text() {
        let (_dir, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        example_workspace(ws.path());
        let tree = store.snapshot(ws.path()).unwrap();
        let baseline =
            store.put_record("WorkspaceMutation", mutation_value(None, "baseline", true, &tree)).unwrap();
        let mut refs = Refs::open(&store).unwrap();
        let name =
            workspace_head_name(std::path::Path::new("/srv/sd-data/remote-workspaces/project-1/session-1"));
        refs.commit(&store, &name, None, &baseline).unwrap();
        assert_eq!(refs.head(&name).unwrap(), Some(baseline));

        let conn = Connection::open(store.root().join("refs.sqlite")).unwrap();
        let target: String =
            conn.query_row("SELECT target FROM live_refs WHERE name=?", [&name], |r| r.get(0)).unwrap();
        assert_eq!(
            target,
            r#"{"digest":"sha256:2436366ad32fa74d4bb0308c853a6de9daf13b88f5776f6a8e74e8f461c6203b","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":484}"#
        );
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
        let objects: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        for expected in ["history_by_name", "history_refs", "live_refs", "sqlite_sequence"] {
            assert!(objects.iter().any(|o| o == expected), "{objects:?}");
        }
        drop(refs);
        assert_eq!(Refs::open(&store).unwrap().history(&name).unwrap().len(), 1, "reopening keeps rows");
    }

    #[test]
    fn history_order_and_roots() {
        let (_dir, store) = temp_store();
        let mut refs = Refs::open(&store).unwrap();
        let first = record_with_leaf(&store, b"first");
        let second = record_with_leaf(&store, b"second");
        refs.commit(&store, "agent/main", None, &first).unwrap();
        refs.commit(&store, "agent/main", Some(&first), &second).unwrap();
        assert_eq!(refs.history("agent/main").unwrap(), vec![first.clone(), second.clone()]);
        assert_eq!(refs.head("agent/main").unwrap(), Some(second.clone()));
        let roots = refs.roots().unwrap();
        assert_eq!(roots.len(), 2);
        assert!(roots.contains(&first) && roots.contains(&second));
        assert_eq!(refs.head("absent").unwrap(), None);
        assert!(refs.history("absent").unwrap().is_empty());
    }

    #[test]
    fn compare_and_swap_lets_exactly_one_writer_win() {
        let (_dir, store) = temp_store();
        let base = record_with_leaf(&store, b"base");
        let a = record_with_leaf(&store, b"a");
        let b = record_with_leaf(&store, b"b");
        let mut one = Refs::open(&store).unwrap();
        let mut two = Refs::open(&store).unwrap();
        one.commit(&store, "agent/x", None, &base).unwrap();
        one.commit(&store, "agent/x", Some(&base), &a).unwrap();
        let e = two.commit(&store, "agent/x", Some(&base), &b).unwrap_err();
        assert!(matches!(e, VersionError::HeadChanged));
        assert_eq!(e.to_string(), "Agent head changed");
        assert!(matches!(two.commit(&store, "agent/x", None, &b).unwrap_err(), VersionError::HeadChanged));
        assert_eq!(two.head("agent/x").unwrap(), Some(a.clone()));
        assert_eq!(two.history("agent/x").unwrap(), vec![base, a]);
    }

    #[test]
    fn a_commit_over_the_current_head_creates_or_moves_it_and_keeps_the_history() {
        let (_dir, store) = temp_store();
        let (first, second) = (record_with_leaf(&store, b"first"), record_with_leaf(&store, b"second"));
        let mut one = Refs::open(&store).unwrap();
        let mut two = Refs::open(&store).unwrap();
        one.commit_over_current("agent/y", &first).unwrap();
        // Whatever another connection committed meanwhile is the head it moves from.
        two.commit_over_current("agent/y", &second).unwrap();
        assert_eq!(one.head("agent/y").unwrap(), Some(second.clone()));
        assert_eq!(one.history("agent/y").unwrap(), vec![first.clone(), second]);
        let refused = one.commit_over_current("bad\u{1}name", &first);
        assert!(matches!(refused, Err(VersionError::InvalidRefName)), "{refused:?}");
        // An unreadable head is not written over.
        let conn = Connection::open(store.root().join("refs.sqlite")).unwrap();
        conn.execute("UPDATE live_refs SET target='not a ref' WHERE name='agent/y'", []).unwrap();
        let refused = one.commit_over_current("agent/y", &first);
        assert!(matches!(refused, Err(VersionError::InvalidRef)), "{refused:?}");
        let target: String =
            conn.query_row("SELECT target FROM live_refs WHERE name='agent/y'", [], |r| r.get(0)).unwrap();
        assert_eq!(target, "not a ref");
    }

    #[test]
    fn concurrent_commits_on_threads_serialise() {
        let (_dir, store) = temp_store();
        let store = std::sync::Arc::new(store);
        let targets: Vec<Ref> =
            (0..6).map(|i| record_with_leaf(&store, format!("t{i}").as_bytes())).collect();
        let threads: Vec<_> = targets
            .into_iter()
            .map(|t| {
                let store = std::sync::Arc::clone(&store);
                std::thread::spawn(move || {
                    Refs::open(&store).unwrap().commit(&store, "agent/race", None, &t).is_ok()
                })
            })
            .collect();
        let wins = threads.into_iter().map(|t| t.join().unwrap()).filter(|ok| *ok).count();
        assert_eq!(wins, 1);
        assert_eq!(Refs::open(&store).unwrap().history("agent/race").unwrap().len(), 1);
    }

    #[test]
    fn broken_closures_and_bad_names_leave_the_head_unchanged() {
        let (_dir, store) = temp_store();
        let mut refs = Refs::open(&store).unwrap();
        let leaf = store.put(Pool::Data, b"leaf", OCTET_STREAM).unwrap();
        let root = store.put_record("Test", json!({ "leaf": leaf.to_value() })).unwrap();
        std::fs::remove_file(store.blob_path(Pool::Data, leaf.hex())).unwrap();
        assert!(refs.commit(&store, "agent/broken", None, &root).is_err());
        assert_eq!(refs.head("agent/broken").unwrap(), None);

        // An embedded ref missing from dependencies cannot be committed.
        let good = store.put(Pool::Data, b"good", OCTET_STREAM).unwrap();
        let text = format!(
            r#"{{"dependencies":[],"kind":"Test","schemaVersion":1,"value":{{"leaf":{}}}}}"#,
            good.jcs()
        );
        let undeclared =
            store.put(Pool::AgentState, text.as_bytes(), crate::versioning::RECORD_MEDIA_TYPE).unwrap();
        let e = refs.commit(&store, "agent/undeclared", None, &undeclared).unwrap_err();
        assert_eq!(e.to_string(), "Undeclared record dependency");

        let ok = record_with_leaf(&store, b"ok");
        let long = "x".repeat(513);
        for name in ["", "a\nb", "tab\there", "\u{1f}", long.as_str()] {
            let e = refs.commit(&store, name, None, &ok).unwrap_err();
            assert_eq!(e.to_string(), "Invalid ref name", "{name:?}");
        }
        refs.commit(&store, &"€".repeat(512), None, &ok).unwrap();
        let data_target = store.put(Pool::Data, b"not state", OCTET_STREAM).unwrap();
        let e = refs.commit(&store, "agent/data", None, &data_target).unwrap_err();
        assert_eq!(e.to_string(), "Invalid or cross-pool reference");
        assert!(refs.roots().unwrap().iter().all(|r| *r == ok));
    }

    #[test]
    fn a_failure_after_the_live_upsert_rolls_back_both_writes() {
        let (_dir, store) = temp_store();
        let mut refs = Refs::open(&store).unwrap();
        let first = record_with_leaf(&store, b"first");
        let second = record_with_leaf(&store, b"second");
        refs.commit(&store, "agent/fault", None, &first).unwrap();
        // Fault injection between step 6 (live upsert) and step 7 (history insert).
        refs.conn
            .execute_batch(
                "CREATE TRIGGER inject BEFORE INSERT ON history_refs \
                 BEGIN SELECT RAISE(ABORT, 'injected after live ref'); END;",
            )
            .unwrap();
        let e = refs.commit(&store, "agent/fault", Some(&first), &second).unwrap_err();
        assert!(common::error_chain(&e).contains("injected after live ref"), "{e}");
        assert_eq!(refs.head("agent/fault").unwrap(), Some(first.clone()));
        assert_eq!(refs.history("agent/fault").unwrap(), vec![first.clone()]);
        refs.conn.execute_batch("DROP TRIGGER inject").unwrap();
        refs.commit(&store, "agent/fault", Some(&first), &second).unwrap();
        assert_eq!(refs.history("agent/fault").unwrap(), vec![first, second]);
    }
}
