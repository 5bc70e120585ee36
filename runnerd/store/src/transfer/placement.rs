//! Where each workspace lives, as this node knows it (issue #34): its epoch, whether it moved
//! away (fenced, and when its files were removed), and what was last replicated to the object
//! store. Our own SQLite database, `<data>/runner-placement/placement.sqlite`: the API
//! process never reads it, so nothing here follows the original's formats.
//!
//! Rows are keyed by the workspace's canonical path as text (a node's own name for it; the
//! portable identity is the caller's). A workspace without a row has epoch 0 and no fence.

use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use super::TransferError;
use crate::coordination::DataDir;
use crate::fsat::Stat;
use crate::versioning::Ref;

/// The directory beneath the data directory that holds the database.
pub const PLACEMENT_DIR: &str = "runner-placement";
/// The database's file name.
pub const PLACEMENT_DB: &str = "placement.sqlite";
/// [`PLACEMENT_DB`] for the `*at` calls.
const PLACEMENT_DB_C: &std::ffi::CStr = c"placement.sqlite";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS placement(
    path TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL DEFAULT 0,
    moved_to TEXT,
    fenced_at_ms INTEGER,
    removed_at_ms INTEGER,
    replicated_head TEXT,
    replicated_epoch INTEGER,
    replicated_at_ms INTEGER
);
CREATE TABLE IF NOT EXISTS replicated(record TEXT PRIMARY KEY);
";

/// What this node knows of one workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placed {
    pub epoch: u64,
    /// Where the workspace moved (its files here are stale): writes are refused.
    pub moved_to: Option<String>,
    pub fenced_at_ms: Option<u64>,
    /// When the stale copy's files were removed.
    pub removed_at_ms: Option<u64>,
    pub replicated_head: Option<Ref>,
    pub replicated_epoch: Option<u64>,
    pub replicated_at_ms: Option<u64>,
}

/// The placement database: one connection, shared behind a mutex (every call is one short
/// statement or transaction).
#[derive(Debug)]
pub struct Placement {
    conn: Mutex<Connection>,
    /// Whether any copy here was ever fenced (since this process opened the database):
    /// while none was, a writer's fence check reads nothing (every execution makes one).
    /// Only ever set: this process is the database's only writer.
    any_fenced: std::sync::atomic::AtomicBool,
    /// `runner-placement`, as opened and checked.
    _dir: OwnedFd,
}

impl Placement {
    /// Opens (creating) the database beneath `realpath(data_dir)`, as runnerd's other
    /// databases there: the directory created 0700 and opened without following a link, the
    /// database opened `SQLITE_OPEN_NOFOLLOW` in that same directory (checked by dev/ino) and
    /// required to be a regular file of its own; WAL, synchronous=FULL, busy_timeout 5 s.
    /// (Not through the lock databases' descriptor-relative VFS: that one refuses WAL files.)
    pub fn open(data_dir: &Path) -> Result<Placement, TransferError> {
        let real = std::fs::canonicalize(data_dir).map_err(|source| TransferError::Io {
            what: "resolve the data directory",
            path: data_dir.to_owned(),
            source,
        })?;
        let dir_path = real.join(PLACEMENT_DIR);
        let dir = DataDir::open(real).and_then(|d| d.own_dir(PLACEMENT_DIR)).map_err(TransferError::Dir)?;
        let shown = format!("{PLACEMENT_DIR}/{PLACEMENT_DB}");
        let io = |what| {
            let path = dir_path.clone();
            move |source| TransferError::Io { what, path, source }
        };
        let opened = Stat::of_fd(&dir).map_err(io("inspect"))?;
        let named = std::fs::symlink_metadata(&dir_path).map_err(io("inspect"))?;
        if (named.dev(), named.ino()) != (opened.dev, opened.ino) {
            return Err(TransferError::Planted { name: PLACEMENT_DIR.to_owned() });
        }
        let sql = |what| move |source| TransferError::Sql { what, source };
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_NOFOLLOW;
        let conn = Connection::open_with_flags(dir_path.join(PLACEMENT_DB), flags).map_err(sql("open"))?;
        // Only runnerd writes here; anything but a file of its own is damage, never used.
        let file = Stat::at(&dir, PLACEMENT_DB_C).map_err(io("inspect the database in"))?;
        if file.kind() != libc::S_IFREG || file.nlink != 1 {
            return Err(TransferError::Planted { name: shown });
        }
        conn.busy_timeout(std::time::Duration::from_millis(5000)).map_err(sql("set busy_timeout"))?;
        crate::coordination::enable_wal(&conn).map_err(sql("enable WAL"))?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(sql("set synchronous=FULL"))?;
        conn.execute_batch(SCHEMA).map_err(sql("create the schema"))?;
        let fenced: bool = conn
            .query_row("SELECT EXISTS(SELECT 1 FROM placement WHERE moved_to IS NOT NULL)", [], |r| r.get(0))
            .map_err(sql("look for fenced workspaces"))?;
        Ok(Placement { conn: Mutex::new(conn), any_fenced: fenced.into(), _dir: dir })
    }

    /// Whether a fence may exist: `false` means none does, without a read.
    pub fn may_be_fenced(&self) -> bool {
        self.any_fenced.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What is known of the workspace at `canonical`; `None` when nothing is.
    pub fn get(&self, canonical: &Path) -> Result<Option<Placed>, TransferError> {
        let key = key(canonical)?;
        let row = self
            .conn()
            .prepare_cached(
                "SELECT epoch, moved_to, fenced_at_ms, removed_at_ms, replicated_head, replicated_epoch,
                        replicated_at_ms FROM placement WHERE path = ?1",
            )
            .and_then(|mut s| {
                s.query_row([key], |row| {
                    Ok((
                        Placed {
                            epoch: from_sql(row.get(0)?),
                            moved_to: row.get(1)?,
                            fenced_at_ms: row.get::<_, Option<i64>>(2)?.map(from_sql),
                            removed_at_ms: row.get::<_, Option<i64>>(3)?.map(from_sql),
                            replicated_head: None,
                            replicated_epoch: row.get::<_, Option<i64>>(5)?.map(from_sql),
                            replicated_at_ms: row.get::<_, Option<i64>>(6)?.map(from_sql),
                        },
                        row.get::<_, Option<String>>(4)?,
                    ))
                })
                .optional()
            })
            .map_err(|source| TransferError::Sql { what: "read a placement", source })?;
        let Some((mut placed, head)) = row else { return Ok(None) };
        placed.replicated_head = head.map(|text| parse_ref(&text)).transpose()?;
        Ok(Some(placed))
    }

    /// Sets the epoch and clears any fence (a copy that arrived or was restored here).
    pub fn set_epoch(&self, canonical: &Path, epoch: u64) -> Result<(), TransferError> {
        self.execute(
            "set an epoch",
            "INSERT INTO placement(path, epoch) VALUES(?1, ?2)
             ON CONFLICT(path) DO UPDATE SET epoch = excluded.epoch, moved_to = NULL,
                 fenced_at_ms = NULL, removed_at_ms = NULL",
            params![key(canonical)?, to_sql(epoch)],
        )
    }

    /// Fences the copy here: it moved to `moved_to`, which holds `epoch` now; writes here are
    /// refused and its files are removed once the grace period has passed. Never below the
    /// epoch held: a fence decided on an older reading (a replication that read the epoch
    /// before an import raised it) changes nothing.
    pub fn fence(
        &self,
        canonical: &Path,
        epoch: u64,
        moved_to: &str,
        now_ms: u64,
    ) -> Result<(), TransferError> {
        // Before the write: a checker that sees the row must also see the flag.
        self.any_fenced.store(true, std::sync::atomic::Ordering::SeqCst);
        self.execute(
            "fence a workspace",
            "INSERT INTO placement(path, epoch, moved_to, fenced_at_ms) VALUES(?1, ?2, ?3, ?4)
             ON CONFLICT(path) DO UPDATE SET epoch = excluded.epoch, moved_to = excluded.moved_to,
                 fenced_at_ms = excluded.fenced_at_ms, removed_at_ms = NULL
             WHERE excluded.epoch >= placement.epoch",
            params![key(canonical)?, to_sql(epoch), moved_to, to_sql(now_ms)],
        )
    }

    /// Puts a row back as it was read (`None`: none), its replication kept: what an import
    /// that raised the epoch and then failed to commit undoes.
    pub fn put_back(&self, canonical: &Path, was: Option<&Placed>) -> Result<(), TransferError> {
        let ms = |v: Option<u64>| v.map(to_sql);
        if was.is_some_and(|p| p.moved_to.is_some()) {
            self.any_fenced.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let (epoch, moved_to, fenced_at, removed_at) = match was {
            Some(p) => (p.epoch, p.moved_to.as_deref(), ms(p.fenced_at_ms), ms(p.removed_at_ms)),
            None => (0, None, None, None),
        };
        self.execute(
            "put a workspace's placement back",
            "INSERT INTO placement(path, epoch, moved_to, fenced_at_ms, removed_at_ms) VALUES(?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(path) DO UPDATE SET epoch = excluded.epoch, moved_to = excluded.moved_to,
                 fenced_at_ms = excluded.fenced_at_ms, removed_at_ms = excluded.removed_at_ms",
            params![key(canonical)?, to_sql(epoch), moved_to, fenced_at, removed_at],
        )
    }

    /// Fenced copies fenced before `before_ms` whose files are not removed yet.
    pub fn due_for_removal(&self, before_ms: u64) -> Result<Vec<PathBuf>, TransferError> {
        let sql = |source| TransferError::Sql { what: "list fenced workspaces", source };
        let conn = self.conn();
        let mut stmt = conn
            .prepare_cached(
                "SELECT path FROM placement WHERE moved_to IS NOT NULL AND fenced_at_ms < ?1
                 AND removed_at_ms IS NULL ORDER BY path",
            )
            .map_err(sql)?;
        let rows = stmt.query_map([to_sql(before_ms)], |row| row.get::<_, String>(0)).map_err(sql)?;
        rows.map(|r| r.map(PathBuf::from).map_err(sql)).collect()
    }

    /// Records that a fenced copy's files are gone (its row stays: it is still fenced).
    pub fn mark_removed(&self, canonical: &Path, now_ms: u64) -> Result<(), TransferError> {
        self.execute(
            "mark a workspace removed",
            "UPDATE placement SET removed_at_ms = ?2 WHERE path = ?1",
            params![key(canonical)?, to_sql(now_ms)],
        )
    }

    /// Records the head (and epoch) last replicated to the object store.
    pub fn set_replicated(
        &self,
        canonical: &Path,
        head: &Ref,
        epoch: u64,
        now_ms: u64,
    ) -> Result<(), TransferError> {
        self.execute(
            "record a replication",
            "INSERT INTO placement(path, replicated_head, replicated_epoch, replicated_at_ms)
             VALUES(?1, ?2, ?3, ?4)
             ON CONFLICT(path) DO UPDATE SET replicated_head = excluded.replicated_head,
                 replicated_epoch = excluded.replicated_epoch, replicated_at_ms = excluded.replicated_at_ms",
            params![key(canonical)?, head.jcs(), to_sql(epoch), to_sql(now_ms)],
        )
    }

    /// The records whose whole closure is in the object store (replication skips them).
    pub fn is_replicated(&self, record: &Ref) -> Result<bool, TransferError> {
        self.conn()
            .prepare_cached("SELECT 1 FROM replicated WHERE record = ?1")
            .and_then(|mut s| s.exists([record.jcs()]))
            .map_err(|source| TransferError::Sql { what: "read the replicated records", source })
    }

    /// Marks records whose whole closure reached the object store, in one transaction.
    pub fn mark_replicated(&self, records: &[Ref]) -> Result<(), TransferError> {
        let sql = |source| TransferError::Sql { what: "mark records replicated", source };
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(sql)?;
        {
            let mut stmt =
                tx.prepare_cached("INSERT OR IGNORE INTO replicated(record) VALUES(?1)").map_err(sql)?;
            for r in records {
                stmt.execute([r.jcs()]).map_err(sql)?;
            }
        }
        tx.commit().map_err(sql)
    }

    fn execute(
        &self,
        what: &'static str,
        sql: &str,
        params: &[&dyn rusqlite::ToSql],
    ) -> Result<(), TransferError> {
        self.conn()
            .prepare_cached(sql)
            .and_then(|mut s| s.execute(params))
            .map(drop)
            .map_err(|source| TransferError::Sql { what, source })
    }
}

/// A row's key: the canonical path's text. A path that is not UTF-8 has none (its text would
/// not round-trip to the directory it names).
fn key(canonical: &Path) -> Result<&str, TransferError> {
    canonical.to_str().ok_or_else(|| TransferError::PathNotUtf8 { path: canonical.to_owned() })
}

/// SQLite integers are i64: a u64 is stored with the same bits, so every value round-trips
/// ([`from_sql`]); only times are compared in SQL, and milliseconds since 1970 stay far below
/// where the sign bit would change their order.
fn to_sql(value: u64) -> i64 {
    value as i64
}

fn from_sql(value: i64) -> u64 {
    value as u64
}

fn parse_ref(text: &str) -> Result<Ref, TransferError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|_| crate::versioning::VersionError::InvalidRef)?;
    Ok(Ref::from_value(&value)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::versioning::{OCTET_STREAM, Pool};

    fn placement() -> (tempfile::TempDir, Placement) {
        let dir = tempfile::tempdir().unwrap();
        let placement = Placement::open(dir.path()).unwrap();
        (dir, placement)
    }

    fn a_ref(byte: &str) -> Ref {
        Ref::new(Pool::AgentState, &byte.repeat(32), 10, crate::versioning::RECORD_MEDIA_TYPE)
    }

    #[test]
    fn opening_makes_a_private_wal_database_and_reopening_keeps_its_rows() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, placement) = placement();
        let ws = Path::new("/data/remote-workspaces/a");
        placement.set_epoch(ws, 3).unwrap();
        let mode = std::fs::metadata(dir.path().join(PLACEMENT_DIR)).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "private: {mode:o}");
        let mode: String = placement.conn().query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
        let sync: i64 = placement.conn().query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
        assert_eq!(sync, 2, "FULL");
        assert!(dir.path().join(PLACEMENT_DIR).join(format!("{PLACEMENT_DB}-wal")).is_file());
        drop(placement);
        let again = Placement::open(dir.path()).unwrap();
        assert_eq!(again.get(ws).unwrap().unwrap().epoch, 3);
    }

    #[test]
    fn a_link_planted_at_the_directory_or_the_database_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), dir.path().join(PLACEMENT_DIR)).unwrap();
        assert!(matches!(Placement::open(dir.path()), Err(TransferError::Dir(_))));
        std::fs::remove_file(dir.path().join(PLACEMENT_DIR)).unwrap();
        std::fs::create_dir(dir.path().join(PLACEMENT_DIR)).unwrap();
        let target = elsewhere.path().join("db");
        std::os::unix::fs::symlink(&target, dir.path().join(PLACEMENT_DIR).join(PLACEMENT_DB)).unwrap();
        assert!(matches!(Placement::open(dir.path()), Err(TransferError::Sql { .. })));
        assert!(!target.exists(), "nothing created through the link");
        // A hard link to a file elsewhere is not a database of our own either.
        std::fs::remove_file(dir.path().join(PLACEMENT_DIR).join(PLACEMENT_DB)).unwrap();
        std::fs::write(&target, b"").unwrap();
        std::fs::hard_link(&target, dir.path().join(PLACEMENT_DIR).join(PLACEMENT_DB)).unwrap();
        assert!(matches!(Placement::open(dir.path()), Err(TransferError::Planted { .. })));
    }

    /// A row put back is the row that was read, whatever the epoch since.
    #[test]
    fn a_row_is_put_back_as_it_was() {
        let (_dir, placement) = placement();
        let ws = Path::new("/data/remote-workspaces/back");
        placement.fence(ws, 4, "http://there:1", 7).unwrap();
        let was = placement.get(ws).unwrap();
        placement.set_epoch(ws, 9).unwrap();
        placement.put_back(ws, was.as_ref()).unwrap();
        assert_eq!(placement.get(ws).unwrap(), was);
        let fresh = Path::new("/data/remote-workspaces/fresh");
        placement.set_epoch(fresh, 3).unwrap();
        placement.put_back(fresh, None).unwrap();
        assert_eq!(placement.get(fresh).unwrap().map(|p| (p.epoch, p.moved_to)), Some((0, None)));
    }

    /// A fence decided on an older reading (epoch 1, after an import raised it to 2) does
    /// not lower the epoch or fence the copy; one at the epoch held or above does.
    #[test]
    fn a_fence_never_lowers_the_epoch() {
        let (dir, placement) = placement();
        assert!(!placement.may_be_fenced(), "nothing fenced yet: no read needed");
        let ws = Path::new("/data/remote-workspaces/late");
        placement.set_epoch(ws, 2).unwrap();
        placement.fence(ws, 1, "http://old:1", 5).unwrap();
        let p = placement.get(ws).unwrap().unwrap();
        assert_eq!((p.epoch, p.moved_to), (2, None));
        placement.fence(ws, 3, "http://new:1", 6).unwrap();
        let p = placement.get(ws).unwrap().unwrap();
        assert_eq!((p.epoch, p.moved_to.as_deref()), (3, Some("http://new:1")));
        assert!(placement.may_be_fenced());
        drop(placement);
        assert!(Placement::open(dir.path()).unwrap().may_be_fenced(), "a fence found at open counts");
    }

    #[test]
    fn epochs_fences_and_removal() {
        let (_dir, placement) = placement();
        let (a, b) = (Path::new("/d/projects/a"), Path::new("/d/projects/b"));
        assert_eq!(placement.get(a).unwrap(), None, "never seen");
        placement.set_epoch(a, 1).unwrap();
        assert_eq!(placement.get(a).unwrap(), Some(Placed { epoch: 1, ..Placed::default() }));

        placement.fence(a, 2, "http://node-b:8080", 1_000).unwrap();
        placement.fence(b, 5, "http://node-c:8080", 3_000).unwrap();
        let fenced = placement.get(a).unwrap().unwrap();
        assert_eq!(
            (fenced.epoch, fenced.moved_to.as_deref(), fenced.fenced_at_ms, fenced.removed_at_ms),
            (2, Some("http://node-b:8080"), Some(1_000), None)
        );
        assert_eq!(placement.due_for_removal(1_000).unwrap(), Vec::<PathBuf>::new(), "strictly before");
        assert_eq!(placement.due_for_removal(1_001).unwrap(), vec![a.to_path_buf()]);
        assert_eq!(placement.due_for_removal(10_000).unwrap(), vec![a.to_path_buf(), b.to_path_buf()]);
        placement.mark_removed(a, 2_000).unwrap();
        assert_eq!(placement.get(a).unwrap().unwrap().removed_at_ms, Some(2_000));
        assert!(placement.get(a).unwrap().unwrap().moved_to.is_some(), "still fenced");
        assert_eq!(placement.due_for_removal(10_000).unwrap(), vec![b.to_path_buf()]);

        // The workspace comes back: a new epoch, no fence, nothing removed.
        placement.set_epoch(a, 3).unwrap();
        assert_eq!(placement.get(a).unwrap(), Some(Placed { epoch: 3, ..Placed::default() }));
        assert!(matches!(
            placement.set_epoch(
                Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"/d/\xff")),
                1
            ),
            Err(TransferError::PathNotUtf8 { .. })
        ));
    }

    #[test]
    fn replicated_heads_and_records() {
        let (_dir, placement) = placement();
        let ws = Path::new("/d/remote-workspaces/k");
        placement.fence(ws, 4, "http://b", 10).unwrap();
        let head = a_ref("ab");
        placement.set_replicated(ws, &head, 4, 99).unwrap();
        let placed = placement.get(ws).unwrap().unwrap();
        assert_eq!(
            (placed.replicated_head, placed.replicated_epoch, placed.replicated_at_ms),
            (Some(head.clone()), Some(4), Some(99))
        );
        assert_eq!(placed.moved_to.as_deref(), Some("http://b"), "a replication keeps the fence");
        let fresh = Path::new("/d/remote-workspaces/new");
        placement.set_replicated(fresh, &head, 0, 5).unwrap();
        assert_eq!(placement.get(fresh).unwrap().unwrap().epoch, 0);

        let (r1, r2) = (a_ref("01"), a_ref("02"));
        let blob = Ref { pool: Pool::Data, media_type: OCTET_STREAM.into(), ..r1.clone() };
        assert!(!placement.is_replicated(&r1).unwrap());
        placement.mark_replicated(&[r1.clone(), r2.clone()]).unwrap();
        placement.mark_replicated(std::slice::from_ref(&r1)).unwrap();
        assert!(placement.is_replicated(&r1).unwrap() && placement.is_replicated(&r2).unwrap());
        assert!(!placement.is_replicated(&blob).unwrap(), "keyed by the whole ref");
    }
}
