//! Admission (reference §6.3) and the per-process side of the lease: the registry at
//! `realpath(dataDir)/.workspace-lifecycle/registry.sqlite` whose fences refuse writers
//! under a workspace being deleted, the per-root admission lock, the in-process poisoned
//! set, and the lease journal used for crash recovery.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{Connection, params};
use tokio::sync::watch;

use super::lease::{self, Lease, LeasePaths};
use super::sqlite_lock::SqliteLock;
use super::{CoordError, path_hex, private_dir};

/// A held admission: the per-root admission lock. Take the lease inside it.
#[derive(Debug)]
pub struct Admitted {
    _lock: SqliteLock,
}

#[derive(Debug)]
pub struct Lifecycle {
    dir: PathBuf,
    registry: PathBuf,
    /// One connection for every registry transaction (opening one costs several files).
    registry_conn: std::sync::Arc<Mutex<Connection>>,
    journal: PathBuf,
    poisoned: Mutex<HashSet<PathBuf>>,
}

impl Lifecycle {
    /// Prepares `realpath(dataDir)/.workspace-lifecycle` (0700) and the registry schema,
    /// and the lease journal under `<dataDir>/runner-executions/active-leases`.
    pub fn open(data_dir: &Path) -> Result<Lifecycle, CoordError> {
        private_dir(data_dir)?;
        let real = std::fs::canonicalize(data_dir).map_err(|e| CoordError::io("resolve", data_dir, e))?;
        let dir = real.join(".workspace-lifecycle");
        private_dir(&dir)?;
        let journal = data_dir.join("runner-executions").join("active-leases");
        private_dir(&journal)?;
        let registry = dir.join("registry.sqlite");
        let conn = open_registry(&registry)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS roots(path TEXT PRIMARY KEY);
             CREATE TABLE IF NOT EXISTS fences(scope TEXT PRIMARY KEY, owner TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending');",
        )
        .map_err(|source| CoordError::Sqlite { path: registry.clone(), source })?;
        let registry_conn = std::sync::Arc::new(Mutex::new(conn));
        Ok(Lifecycle { dir, registry, registry_conn, journal, poisoned: Mutex::default() })
    }

    /// `withWorkspaceAdmission`: fence check and root registration in one registry
    /// transaction, then the per-root lock (waited for), then the fences again.
    pub async fn admit(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Admitted, CoordError> {
        self.register(canonical).await?;
        let lock = SqliteLock::take(&self.admission_lock(canonical), cancel).await?;
        self.check_fences(canonical).await?;
        Ok(Admitted { _lock: lock })
    }

    /// One attempt at admission (the observer's `onBusy` path): `None` when another
    /// writer is admitted on this root.
    pub async fn try_admit(&self, canonical: &Path) -> Result<Option<Admitted>, CoordError> {
        self.register(canonical).await?;
        let Some(lock) = SqliteLock::try_take(&self.admission_lock(canonical))? else {
            return Ok(None);
        };
        self.check_fences(canonical).await?;
        Ok(Some(Admitted { _lock: lock }))
    }

    /// Takes the writer lease (waiting for other holders; cancellable).
    pub async fn lease(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Lease, CoordError> {
        let paths = LeasePaths::for_root(canonical);
        lease::prepare(&paths)?;
        let lock = SqliteLock::take(&paths.lock, cancel).await?;
        if cancel.is_some_and(|c| *c.borrow()) {
            return Err(CoordError::Aborted);
        }
        Lease::establish(canonical, lock, self.is_poisoned(canonical), Some(&self.journal))
    }

    /// One attempt at the lease: `None` when another writer holds it.
    pub fn try_lease(&self, canonical: &Path) -> Result<Option<Lease>, CoordError> {
        let paths = LeasePaths::for_root(canonical);
        lease::prepare(&paths)?;
        match SqliteLock::try_take(&paths.lock)? {
            Some(lock) => {
                Lease::establish(canonical, lock, self.is_poisoned(canonical), Some(&self.journal)).map(Some)
            }
            None => Ok(None),
        }
    }

    /// `poisonWorkspace`: refuse this root in this process and write `.failed`.
    pub fn poison(&self, canonical: &Path) -> Result<(), CoordError> {
        self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).insert(canonical.to_owned());
        lease::write_poison(&LeasePaths::for_root(canonical))
    }

    pub fn is_poisoned(&self, canonical: &Path) -> bool {
        self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).contains(canonical)
    }

    /// Roots whose lease this runner's previous process held when it stopped (the journal
    /// entries left behind), for start-up recovery.
    pub fn journaled_roots(&self) -> Vec<(PathBuf, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.journal) else { return Vec::new() };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if let Ok(bytes) = std::fs::read(&path) {
                use std::os::unix::ffi::OsStringExt;
                out.push((PathBuf::from(std::ffi::OsString::from_vec(bytes)), path));
            }
        }
        out
    }

    /// Takes over a journaled root whose `.active` marker our crashed process left: takes
    /// the lock without waiting; `Ok(None)` when someone holds it (they are alive, so it is
    /// not ours to recover) or when there is no marker (then the entry is just removed).
    pub fn take_over_interrupted(&self, root: &Path, entry: &Path) -> Result<Option<Lease>, CoordError> {
        let paths = LeasePaths::for_root(root);
        if !paths.active.exists() {
            let _ = std::fs::remove_file(entry);
            return Ok(None);
        }
        let Some(lock) = SqliteLock::try_take(&paths.lock)? else { return Ok(None) };
        Ok(Some(Lease::take_over(root, lock, entry.to_owned())))
    }

    fn admission_lock(&self, canonical: &Path) -> PathBuf {
        self.dir.join(format!("{}.sqlite", path_hex(canonical)))
    }

    async fn register(&self, canonical: &Path) -> Result<(), CoordError> {
        let registry = self.registry.clone();
        let conn = self.registry_conn.clone();
        let path = canonical.to_owned();
        blocking(move || {
            let sqlite = |source| CoordError::Sqlite { path: registry.clone(), source };
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            let tx =
                conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(sqlite)?;
            if fenced(&tx, &path).map_err(sqlite)? {
                return Err(CoordError::Retired);
            }
            tx.execute("INSERT OR IGNORE INTO roots VALUES(?1)", params![path.to_string_lossy()])
                .map_err(sqlite)?;
            tx.commit().map_err(sqlite)
        })
        .await
    }

    async fn check_fences(&self, canonical: &Path) -> Result<(), CoordError> {
        let registry = self.registry.clone();
        let conn = self.registry_conn.clone();
        let path = canonical.to_owned();
        blocking(move || {
            let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            match fenced(&conn, &path) {
                Ok(true) => Err(CoordError::Retired),
                Ok(false) => Ok(()),
                Err(source) => Err(CoordError::Sqlite { path: registry.clone(), source }),
            }
        })
        .await
    }
}

fn open_registry(path: &Path) -> Result<Connection, CoordError> {
    let sqlite = |source| CoordError::Sqlite { path: path.to_owned(), source };
    let conn = Connection::open(path).map_err(sqlite)?;
    conn.busy_timeout(Duration::from_millis(5000)).map_err(sqlite)?;
    crate::coordination::enable_wal(&conn).map_err(sqlite)?;
    Ok(conn)
}

/// Whether any fence (in any state) covers `path`: `path == scope` or under `scope/`.
fn fenced(conn: &Connection, path: &Path) -> rusqlite::Result<bool> {
    let path = path.to_string_lossy();
    let mut stmt = conn.prepare("SELECT scope FROM fences")?;
    let scopes = stmt.query_map([], |row| row.get::<_, String>(0))?;
    for scope in scopes {
        if covers(&scope?, &path) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The fence rule, pure: a scope covers itself and everything below it.
pub fn covers(scope: &str, path: &str) -> bool {
    path == scope || path.strip_prefix(scope).is_some_and(|rest| rest.starts_with('/'))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CoordError> + Send + 'static,
) -> Result<T, CoordError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(CoordError::Io {
            what: "run",
            path: PathBuf::new(),
            source: std::io::Error::other(e.to_string()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordination::{ACTIVE_TEXT, INTERRUPTED, POISONED};

    #[test]
    fn fence_coverage_table() {
        for (scope, path, covered) in [
            ("/d/p", "/d/p", true),
            ("/d/p", "/d/p/s", true),
            ("/d/p", "/d/pp", false),
            ("/d/p", "/d", false),
            ("/d/p/s", "/d/p", false),
        ] {
            assert_eq!(covers(scope, path), covered, "{scope} {path}");
        }
    }

    fn fixture() -> (tempfile::TempDir, Lifecycle, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let root = data.join("remote-workspaces/p/s");
        std::fs::create_dir_all(&root).unwrap();
        let life = Lifecycle::open(&data).unwrap();
        let root = std::fs::canonicalize(root).unwrap();
        (dir, life, root)
    }

    #[tokio::test]
    async fn lease_markers_follow_the_original() {
        let (_d, life, root) = fixture();
        let paths = LeasePaths::for_root(&root);
        let lease = life.lease(&root, None).await.unwrap();
        assert_eq!(std::fs::read_to_string(&paths.active).unwrap(), ACTIVE_TEXT);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&paths.dir).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(life.try_lease(&root).unwrap().is_none(), "held");
        drop(lease);
        assert!(!paths.active.exists());
        // A marker left by a crashed holder refuses later writers.
        std::fs::write(&paths.active, ACTIVE_TEXT).unwrap();
        let err = life.lease(&root, None).await.unwrap_err();
        assert_eq!(err.to_string(), INTERRUPTED);
        assert!(paths.active.exists(), "someone else's marker is never removed");
        std::fs::remove_file(&paths.active).unwrap();
        // Poison: in-process and on disk.
        life.poison(&root).unwrap();
        assert_eq!(std::fs::read_to_string(&paths.failed).unwrap(), POISONED);
        assert_eq!(life.lease(&root, None).await.unwrap_err().to_string(), POISONED);
    }

    #[tokio::test]
    async fn fences_refuse_admission_under_their_scope_only() {
        let (_d, life, root) = fixture();
        drop(life.admit(&root, None).await.unwrap());
        let conn = Connection::open(&life.registry).unwrap();
        let parent = root.parent().unwrap().to_string_lossy().into_owned();
        conn.execute("INSERT INTO fences(scope, owner) VALUES(?1, 'api')", params![parent]).unwrap();
        let err = life.admit(&root, None).await.unwrap_err();
        assert_eq!(
            (err.to_string().as_str(), err.code()),
            (crate::coordination::RETIRED, Some("WORKSPACE_RETIRED"))
        );
        let sibling = root.parent().unwrap().parent().unwrap().join("other");
        std::fs::create_dir_all(&sibling).unwrap();
        assert!(life.admit(&sibling, None).await.is_ok());
        conn.execute("DELETE FROM fences", []).unwrap();
        assert!(life.admit(&root, None).await.is_ok());
        let roots: i64 = conn.query_row("SELECT count(*) FROM roots", [], |r| r.get(0)).unwrap();
        assert_eq!(roots, 2);
    }

    #[tokio::test]
    async fn the_journal_lets_a_restart_take_over_its_own_marker() {
        let (_d, life, root) = fixture();
        let lease = life.lease(&root, None).await.unwrap();
        let paths = lease.paths().clone();
        std::mem::forget(lease); // a crash: marker and journal stay; the lock is released below
        let journaled = life.journaled_roots();
        assert_eq!(journaled.len(), 1);
        assert_eq!(journaled[0].0, root);
        // Our forgotten connection still holds the lock in this process: not taken over.
        assert!(life.take_over_interrupted(&root, &journaled[0].1).unwrap().is_none());
        assert!(paths.active.exists());
    }

    #[tokio::test]
    async fn a_refused_write_leaves_a_crashed_writers_journal_entry_for_recovery() {
        let (_d, life, root) = fixture();
        let paths = LeasePaths::for_root(&root);
        // What a crash leaves: the marker and our journal entry (the lock died with us).
        drop(life.lease(&root, None).await.unwrap());
        std::fs::write(&paths.active, ACTIVE_TEXT).unwrap();
        let entry = life.journal.join(&paths.hex);
        std::fs::write(&entry, root.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(life.lease(&root, None).await.unwrap_err().to_string(), INTERRUPTED);
        assert!(entry.exists(), "the refused writer must not take the entry away");
        let journaled = life.journaled_roots();
        assert_eq!(journaled, vec![(root.clone(), entry.clone())]);
        let recovered = life.take_over_interrupted(&root, &entry).unwrap().expect("lock is free");
        drop(recovered);
        assert!(!paths.active.exists() && !entry.exists());
        assert!(life.lease(&root, None).await.is_ok());
    }
}
