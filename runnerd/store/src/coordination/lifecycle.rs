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

use std::os::fd::OwnedFd;

use super::lease::{COORDINATION_DIR, Lease, LeaseDir, LeaseNames};
use super::sqlite_lock::{LockFile, SqliteLock};
use super::{CoordError, DataDir, cname, path_hex, private_dir};

/// The lifecycle directory's name in `realpath(dataDir)`.
pub use common::layout::LIFECYCLE_DIR;

/// A held admission: the per-root admission lock. Take the lease inside it.
#[derive(Debug)]
pub struct Admitted {
    _lock: SqliteLock,
}

#[derive(Debug)]
pub struct Lifecycle {
    data: DataDir,
    /// `.workspace-lifecycle`, opened `O_NOFOLLOW`: the admission locks are named through it.
    dir_fd: OwnedFd,
    #[cfg_attr(not(test), allow(dead_code))]
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
        let real = std::fs::canonicalize(data_dir)
            .map_err(|e| CoordError::io("resolve", "the data directory", e))?;
        let data = DataDir::open(real)?;
        let dir_fd = data.own_dir(LIFECYCLE_DIR)?;
        let dir = data.real.join(LIFECYCLE_DIR);
        let journal = data_dir.join(common::layout::RUNNER_EXECUTIONS).join(common::layout::LEASE_JOURNAL);
        private_dir(&journal)?;
        let registry = dir.join("registry.sqlite");
        let conn = open_registry(&registry)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS roots(path TEXT PRIMARY KEY);
             CREATE TABLE IF NOT EXISTS fences(scope TEXT PRIMARY KEY, owner TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending');",
        )
        .map_err(|source| CoordError::Sqlite { name: REGISTRY_SHOWN.into(), source })?;
        let registry_conn = std::sync::Arc::new(Mutex::new(conn));
        Ok(Lifecycle { data, dir_fd, registry, registry_conn, journal, poisoned: Mutex::default() })
    }

    /// `withWorkspaceAdmission`: fence check and root registration in one registry
    /// transaction, then the per-root lock (waited for), then the fences again.
    pub async fn admit(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Admitted, CoordError> {
        self.register(canonical).await?;
        let lock = SqliteLock::take(self.admission_lock(canonical)?, cancel).await?;
        self.check_fences(canonical).await?;
        Ok(Admitted { _lock: lock })
    }

    /// One attempt at admission (the observer's `onBusy` path): `None` when another
    /// writer is admitted on this root.
    pub async fn try_admit(&self, canonical: &Path) -> Result<Option<Admitted>, CoordError> {
        self.register(canonical).await?;
        let Some(lock) = SqliteLock::try_take(self.admission_lock(canonical)?)? else {
            return Ok(None);
        };
        self.check_fences(canonical).await?;
        Ok(Some(Admitted { _lock: lock }))
    }

    /// [`Lifecycle::try_admit`] on the calling thread (it blocks on the registry: call it
    /// off the async runtime), so that an uncontended writer is admitted and leased in one
    /// blocking task rather than a hop to the blocking pool per step.
    pub fn try_admit_blocking(&self, canonical: &Path) -> Result<Option<Admitted>, CoordError> {
        register_in(&self.registry_conn, canonical)?;
        let Some(lock) = SqliteLock::try_take(self.admission_lock(canonical)?)? else {
            return Ok(None);
        };
        check_fences_in(&self.registry_conn, canonical)?;
        Ok(Some(Admitted { _lock: lock }))
    }

    /// Takes the writer lease (waiting for other holders; cancellable).
    pub async fn lease(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Lease, CoordError> {
        self.take_lease(canonical, cancel, Poison::Refuse).await
    }

    /// Waits for the lock, then establishes the lease; a poisoned root is refused unless
    /// this is a repair.
    async fn take_lease(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
        poison: Poison,
    ) -> Result<Lease, CoordError> {
        let dir = self.lease_dir(canonical)?;
        let lock = SqliteLock::take(dir.lock_file()?, cancel).await?;
        if cancel.is_some_and(|c| *c.borrow()) {
            return Err(CoordError::Aborted);
        }
        match poison {
            Poison::Refuse => {
                Lease::establish(canonical, dir, lock, self.is_poisoned(canonical), Some(&self.journal))
            }
            Poison::Repair => Lease::establish_despite_poison(canonical, dir, lock, Some(&self.journal)),
        }
    }

    /// The root's coordination directory, opened without following anything (created 0700).
    fn lease_dir(&self, canonical: &Path) -> Result<LeaseDir, CoordError> {
        let fd = self.data.coordination_dir(canonical, COORDINATION_DIR)?;
        Ok(LeaseDir { fd, names: LeaseNames::for_root(canonical) })
    }

    /// Whether `<H>.failed` stands in the root's coordination directory (any entry there,
    /// a planted symlink included, counts; an error counts too: fail closed).
    pub fn poison_marked(&self, canonical: &Path) -> bool {
        self.lease_dir(canonical).and_then(|d| d.present(&d.names.failed)).unwrap_or(true)
    }

    /// One attempt at the lease: `None` when another writer holds it.
    pub fn try_lease(&self, canonical: &Path) -> Result<Option<Lease>, CoordError> {
        let dir = self.lease_dir(canonical)?;
        match SqliteLock::try_take(dir.lock_file()?)? {
            Some(lock) => {
                Lease::establish(canonical, dir, lock, self.is_poisoned(canonical), Some(&self.journal))
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    /// The lease for a repair: waited for like every writer's (and cancellable), but taken
    /// although the root is poisoned (its `.active` marker and journal entry as usual).
    pub async fn repair_lease(
        &self,
        canonical: &Path,
        cancel: Option<&watch::Receiver<bool>>,
    ) -> Result<Lease, CoordError> {
        self.take_lease(canonical, cancel, Poison::Repair).await
    }

    /// Ends the poisoning of a repaired root: unlinks `<H>.failed` (the entry itself,
    /// whatever it is, named through the coordination directory's descriptor; never
    /// followed) and forgets the root in this process's set. Call with the lease held.
    /// Returns whether a marker was there.
    pub fn clear_poison(&self, canonical: &Path, held: &Lease) -> Result<bool, CoordError> {
        // Through the held lease's own directory descriptor: not a second walk, which a
        // swapped directory could redirect.
        let had = held.remove_poison_marker()?;
        self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).remove(canonical);
        Ok(had)
    }

    /// `poisonWorkspace`: refuse this root in this process and write `.failed`.
    pub fn poison(&self, canonical: &Path) -> Result<(), CoordError> {
        self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).insert(canonical.to_owned());
        self.lease_dir(canonical)?.write_poison()
    }

    pub fn is_poisoned(&self, canonical: &Path) -> bool {
        self.poisoned.lock().unwrap_or_else(|p| p.into_inner()).contains(canonical)
    }

    /// Every workspace root the registry has admitted (`roots`): the version collector
    /// names each head's workspace by them. Empty when the registry cannot be read.
    pub fn registered_roots(&self) -> Vec<PathBuf> {
        let conn = self.registry_conn.lock().unwrap_or_else(|p| p.into_inner());
        let Ok(mut stmt) = conn.prepare("SELECT path FROM roots") else { return Vec::new() };
        stmt.query_map([], |row| row.get::<_, String>(0))
            .map(|rows| rows.flatten().map(PathBuf::from).collect())
            .unwrap_or_default()
    }

    /// Roots whose lease this runner's previous process held when it stopped (the journal
    /// entries left behind), for start-up recovery.
    pub fn journaled_roots(&self) -> Vec<(PathBuf, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.journal) else { return Vec::new() };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            // An empty entry is a released lease (entries are kept, see `lease`).
            if let Ok(bytes) = std::fs::read(&path)
                && !bytes.is_empty()
            {
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
        let dir = self.lease_dir(root)?;
        if !dir.present(&dir.names.active)? {
            let _ = std::fs::remove_file(entry);
            return Ok(None);
        }
        let Some(lock) = SqliteLock::try_take(dir.lock_file()?)? else { return Ok(None) };
        Ok(Some(Lease::take_over(root, dir, lock, entry.to_owned())))
    }

    /// `<realpath(dataDir)>/.workspace-lifecycle/<hex>.sqlite`, named through the directory.
    fn admission_lock(&self, canonical: &Path) -> Result<LockFile, CoordError> {
        let name = format!("{}.sqlite", path_hex(canonical));
        let shown = format!("{LIFECYCLE_DIR}/{name}");
        let dir = crate::fsat::dup(&self.dir_fd).map_err(|e| CoordError::io("open", &shown, e))?;
        Ok(LockFile { dir, name: cname(&name, &shown)?, shown })
    }

    async fn register(&self, canonical: &Path) -> Result<(), CoordError> {
        let conn = self.registry_conn.clone();
        let path = canonical.to_owned();
        blocking(move || register_in(&conn, &path)).await
    }

    async fn check_fences(&self, canonical: &Path) -> Result<(), CoordError> {
        let conn = self.registry_conn.clone();
        let path = canonical.to_owned();
        blocking(move || check_fences_in(&conn, &path)).await
    }
}

/// The fence check and root registration, in one registry transaction (blocking).
fn register_in(conn: &Mutex<Connection>, path: &Path) -> Result<(), CoordError> {
    let sqlite = |source| CoordError::Sqlite { name: REGISTRY_SHOWN.into(), source };
    let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(sqlite)?;
    if fenced(&tx, path).map_err(sqlite)? {
        return Err(CoordError::Retired);
    }
    tx.prepare_cached("INSERT OR IGNORE INTO roots VALUES(?1)")
        .and_then(|mut s| s.execute(params![path.to_string_lossy()]))
        .map_err(sqlite)?;
    tx.commit().map_err(sqlite)
}

/// The fences again, once the admission lock is held (blocking).
fn check_fences_in(conn: &Mutex<Connection>, path: &Path) -> Result<(), CoordError> {
    let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
    match fenced(&conn, path) {
        Ok(true) => Err(CoordError::Retired),
        Ok(false) => Ok(()),
        Err(source) => Err(CoordError::Sqlite { name: REGISTRY_SHOWN.into(), source }),
    }
}

/// How errors name the registry (never a host path).
const REGISTRY_SHOWN: &str = ".workspace-lifecycle/registry.sqlite";

fn open_registry(path: &Path) -> Result<Connection, CoordError> {
    let sqlite = |source| CoordError::Sqlite { name: REGISTRY_SHOWN.into(), source };
    let conn = Connection::open(path).map_err(sqlite)?;
    conn.busy_timeout(Duration::from_millis(5000)).map_err(sqlite)?;
    crate::coordination::enable_wal(&conn).map_err(sqlite)?;
    Ok(conn)
}

/// Whether any fence (in any state) covers `path`: `path == scope` or under `scope/`.
fn fenced(conn: &Connection, path: &Path) -> rusqlite::Result<bool> {
    let path = path.to_string_lossy();
    // Twice per admission, on the one registry connection: parsed once.
    let mut stmt = conn.prepare_cached("SELECT scope FROM fences")?;
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
            name: "the coordination task".into(),
            source: std::io::Error::other(e.to_string()),
        })
    })
}

/// What a lease does with a poisoned root.
#[derive(Debug, Clone, Copy)]
enum Poison {
    Refuse,
    /// A repair takes it anyway, to verify, commit and clear the marker.
    Repair,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordination::LeasePaths;
    use crate::coordination::{ACTIVE_TEXT, INTERRUPTED, POISONED};
    use std::os::unix::fs::OpenOptionsExt;

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
    async fn the_marker_keeps_its_inode_across_leases_and_a_planted_spare_is_never_used() {
        use std::os::unix::fs::MetadataExt;
        let (d, life, root) = fixture();
        let paths = LeasePaths::for_root(&root);
        let spare = paths.dir.join(format!("{}.active-idle", paths.hex));
        let first = life.lease(&root, None).await.unwrap();
        let ino = std::fs::metadata(&paths.active).unwrap().ino();
        drop(first);
        assert!(!paths.active.exists());
        assert_eq!(std::fs::symlink_metadata(&spare).unwrap().ino(), ino, "kept as the spare");
        let second = life.lease(&root, None).await.unwrap();
        assert_eq!(std::fs::metadata(&paths.active).unwrap().ino(), ino, "no new inode");
        assert_eq!(std::fs::read_to_string(&paths.active).unwrap(), ACTIVE_TEXT);
        assert!(!spare.exists());
        drop(second);

        // A spare swapped for a symlink to a host file, a hard link or a FIFO: the marker
        // is a new file of its own with the exact text, and nothing outside is touched.
        let host = d.path().join("host-file");
        std::fs::write(&host, "host").unwrap();
        for plant in ["symlink", "hard link", "fifo", "directory"] {
            match std::fs::symlink_metadata(&spare) {
                Ok(m) if m.is_dir() => std::fs::remove_dir(&spare).unwrap(),
                _ => std::fs::remove_file(&spare).unwrap(),
            }
            match plant {
                "symlink" => std::os::unix::fs::symlink(&host, &spare).unwrap(),
                "hard link" => std::fs::hard_link(&host, &spare).unwrap(),
                "fifo" => nix::unistd::mkfifo(&spare, nix::sys::stat::Mode::S_IRWXU).unwrap(),
                _ => std::fs::create_dir(&spare).unwrap(),
            }
            let lease = life.lease(&root, None).await.unwrap();
            let st = std::fs::symlink_metadata(&paths.active).unwrap();
            assert!(st.is_file() && st.nlink() == 1);
            assert_eq!(std::fs::read_to_string(&paths.active).unwrap(), ACTIVE_TEXT);
            drop(lease);
            assert!(!paths.active.exists());
            assert_eq!(std::fs::read_to_string(&host).unwrap(), "host");
        }
        // With a marker present the spare changes nothing: still interrupted.
        std::fs::write(&paths.active, ACTIVE_TEXT).unwrap();
        assert_eq!(life.lease(&root, None).await.unwrap_err().to_string(), INTERRUPTED);
        assert!(paths.active.exists() && spare.exists());
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

    /// A released lease empties its journal entry and keeps the file: the next lease of
    /// the root creates no inode, and recovery sees nothing to take over.
    #[tokio::test]
    async fn a_released_lease_keeps_its_journal_entry_empty() {
        let (_d, life, root) = fixture();
        let entry = life.journal.join(LeasePaths::for_root(&root).hex);
        let lease = life.lease(&root, None).await.unwrap();
        assert_eq!(std::fs::read(&entry).unwrap(), root.as_os_str().as_encoded_bytes());
        assert_eq!(life.journaled_roots().len(), 1);
        drop(lease);
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(&entry).unwrap().ino();
        assert_eq!(std::fs::metadata(&entry).unwrap().len(), 0);
        assert!(life.journaled_roots().is_empty());
        let again = life.lease(&root, None).await.unwrap();
        assert_eq!(std::fs::metadata(&entry).unwrap().ino(), ino, "the same entry, not a new file");
        assert_eq!(life.journaled_roots(), vec![(root.clone(), entry.clone())]);
        drop(again);
        assert!(life.journaled_roots().is_empty());
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

    /// Everything a sandbox of the enclosing workspace can plant in the coordination
    /// directory is refused, and nothing outside is created, truncated or followed.
    #[tokio::test]
    async fn planted_coordination_entries_are_never_followed() {
        use std::os::unix::fs::symlink;
        let (d, life, root) = fixture();
        let paths = LeasePaths::for_root(&root);
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let host_file = outside.join("host-file");
        std::fs::write(&host_file, "precious").unwrap();
        drop(life.lease(&root, None).await.unwrap());

        // `.failed` -> a host path: poisoning refuses to write through it.
        let target = outside.join("created-by-poison");
        symlink(&target, &paths.failed).unwrap();
        let err = life.poison(&root).unwrap_err();
        assert!(matches!(err, CoordError::Planted { .. }), "{err}");
        assert!(!target.exists(), "poison followed the symlink");
        std::fs::remove_file(&paths.failed).unwrap();
        symlink(&host_file, &paths.failed).unwrap();
        assert!(life.poison(&root).is_err());
        assert_eq!(std::fs::read_to_string(&host_file).unwrap(), "precious", "a host file was rewritten");
        // A planted `.failed` of any kind refuses the lease (fail closed).
        assert_eq!(life.lease(&root, None).await.unwrap_err().to_string(), crate::coordination::POISONED);
        std::fs::remove_file(&paths.failed).unwrap();
        life.poisoned.lock().unwrap().clear();

        // A FIFO (with no reader, and with one) never blocks and is never written.
        nix_mkfifo(&paths.failed);
        assert!(matches!(life.poison(&root).unwrap_err(), CoordError::Planted { .. }));
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&paths.failed)
            .unwrap();
        assert!(matches!(life.poison(&root).unwrap_err(), CoordError::Planted { .. }));
        std::fs::remove_file(&paths.failed).unwrap();
        // A hard link to another file is refused too.
        let other = paths.dir.join("other");
        std::fs::write(&other, "other").unwrap();
        std::fs::hard_link(&other, &paths.failed).unwrap();
        assert!(matches!(life.poison(&root).unwrap_err(), CoordError::Planted { .. }));
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "other");
        std::fs::remove_file(&paths.failed).unwrap();
        life.poisoned.lock().unwrap().clear();

        // `.active` -> a host path: O_EXCL refuses it (interrupted), nothing is created,
        // and the symlink is left for a person (someone else's marker).
        let target = outside.join("created-by-active");
        symlink(&target, &paths.active).unwrap();
        assert_eq!(life.lease(&root, None).await.unwrap_err().to_string(), crate::coordination::INTERRUPTED);
        assert!(!target.exists());
        std::fs::remove_file(&paths.active).unwrap();

        // `.sqlite` -> a host path: SQLite never opens (or creates) it.
        std::fs::remove_file(&paths.lock).unwrap();
        let target = outside.join("created-by-sqlite");
        symlink(&target, &paths.lock).unwrap();
        let err = life.lease(&root, None).await.unwrap_err();
        assert!(matches!(err, CoordError::Planted { .. }), "{err}");
        assert!(!err.to_string().contains(d.path().to_str().unwrap()), "a host path in {err}");
        assert!(life.try_lease(&root).is_err());
        assert!(!target.exists(), "SQLite created the symlink's target");
        std::fs::remove_file(&paths.lock).unwrap();

        // The coordination directory itself -> a host directory.
        std::fs::remove_dir_all(&paths.dir).unwrap();
        symlink(&outside, &paths.dir).unwrap();
        let err = life.lease(&root, None).await.unwrap_err();
        assert!(matches!(err, CoordError::Planted { .. }), "{err}");
        assert!(life.poison(&root).is_err());
        assert!(life.poison_marked(&root), "an unusable directory counts as poisoned");
        let entries: Vec<_> = std::fs::read_dir(&outside).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(entries, vec![std::ffi::OsString::from("host-file")]);
        assert_eq!(std::fs::read_to_string(&host_file).unwrap(), "precious");
    }

    fn nix_mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    /// SQLite's unix VFS refuses paths over 512 bytes; the lock databases are named through
    /// their directory's descriptor instead, so a deep root (a 500-character key) works.
    #[tokio::test]
    async fn a_root_whose_path_is_longer_than_sqlite_allows_takes_its_lease() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let key: Vec<String> = (0..10).map(|i| format!("{i}{}", "k".repeat(48))).collect();
        let root = data.join("remote-workspaces").join(key.join("/"));
        std::fs::create_dir_all(&root).unwrap();
        let life = Lifecycle::open(&data).unwrap();
        let root = std::fs::canonicalize(root).unwrap();
        let paths = LeasePaths::for_root(&root);
        assert!(paths.lock.as_os_str().len() > 512, "{}", paths.lock.display());
        drop(life.admit(&root, None).await.unwrap());
        let lease = life.lease(&root, None).await.unwrap();
        assert!(paths.active.exists());
        assert!(!crate::coordination::tests::free_for_another_process(&paths.lock));
        drop(lease);
        assert!(crate::coordination::tests::free_for_another_process(&paths.lock));
    }
}
