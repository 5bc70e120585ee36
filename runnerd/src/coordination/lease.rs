//! The writer lease (reference §6.1): `<dirname(C)>/.workspace-coordination/<H>.sqlite`
//! locked with `BEGIN IMMEDIATE`, refused while `<H>.failed` exists, and marked by an
//! exclusive `<H>.active` for as long as it is held.
//!
//! Beyond the original, runnerd journals each lease it holds under
//! `<dataDir>/runner-executions/active-leases/<H>` (the root's path) before it creates the
//! marker, so after a crash of *our* process it can tell its own interrupted writes from
//! someone else's and recover them (see `crate::writer::Versions::recover_interrupted`).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::sqlite_lock::SqliteLock;
use super::{ACTIVE_TEXT, CoordError, POISONED, path_hex, private_dir};

/// Where a root's lease files live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasePaths {
    pub dir: PathBuf,
    pub lock: PathBuf,
    pub active: PathBuf,
    pub failed: PathBuf,
    pub hex: String,
}

impl LeasePaths {
    /// For a canonical (realpath'd) root.
    pub fn for_root(canonical: &Path) -> LeasePaths {
        let hex = path_hex(canonical);
        let dir = canonical.parent().unwrap_or(Path::new("/")).join(".workspace-coordination");
        LeasePaths {
            lock: dir.join(format!("{hex}.sqlite")),
            active: dir.join(format!("{hex}.active")),
            failed: dir.join(format!("{hex}.failed")),
            dir,
            hex,
        }
    }
}

/// A held writer lease. Dropping it removes the marker it created, then the journal entry,
/// then releases the lock (the original's order).
#[derive(Debug)]
pub struct Lease {
    paths: LeasePaths,
    journal: Option<PathBuf>,
    created_active: bool,
    _lock: SqliteLock,
}

impl Lease {
    pub fn paths(&self) -> &LeasePaths {
        &self.paths
    }

    /// Checks the poison marker and creates `.active`; the lock is already held.
    /// `journal_dir`, when given, records the lease for crash recovery.
    pub(super) fn establish(
        root: &Path,
        lock: SqliteLock,
        poisoned_here: bool,
        journal_dir: Option<&Path>,
    ) -> Result<Lease, CoordError> {
        let paths = LeasePaths::for_root(root);
        let mut lease = Lease { paths, journal: None, created_active: false, _lock: lock };
        if poisoned_here || lease.paths.failed.exists() {
            return Err(CoordError::Poisoned);
        }
        if let Some(dir) = journal_dir {
            // An entry that already exists belongs to an interrupted write of an earlier
            // process (its marker refuses us below): it is left for start-up recovery.
            let entry = dir.join(&lease.paths.hex);
            match write_new_file(&entry, root.as_os_str().as_encoded_bytes()) {
                Ok(()) => lease.journal = Some(entry),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(CoordError::io("record the lease in", &entry, e)),
            }
        }
        match write_new_file(&lease.paths.active, ACTIVE_TEXT.as_bytes()) {
            Ok(()) => lease.created_active = true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(CoordError::Interrupted),
            Err(e) => return Err(CoordError::io("create the lease marker", &lease.paths.active, e)),
        }
        Ok(lease)
    }

    /// Takes over the marker a crashed holder left: the lock is held, so the marker's
    /// writer is gone; dropping this lease removes the marker.
    pub(super) fn take_over(root: &Path, lock: SqliteLock, journal: PathBuf) -> Lease {
        Lease { paths: LeasePaths::for_root(root), journal: Some(journal), created_active: true, _lock: lock }
    }

    /// Releases the lock but keeps the marker and the journal entry: the write stays
    /// refused (and a later start retries its recovery).
    pub fn release_keeping_marker(mut self) {
        self.created_active = false;
        self.journal = None;
    }
}

pub(super) fn write_poison(paths: &LeasePaths) -> Result<(), CoordError> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&paths.failed)
        .map_err(|e| CoordError::io("write the poison marker", &paths.failed, e))?;
    f.write_all(POISONED.as_bytes()).map_err(|e| CoordError::io("write the poison marker", &paths.failed, e))
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.created_active {
            let _ = std::fs::remove_file(&self.paths.active);
        }
        if let Some(entry) = &self.journal {
            let _ = std::fs::remove_file(entry);
        }
    }
}

/// Creates the lease directory (0700) for a root.
pub(super) fn prepare(paths: &LeasePaths) -> Result<(), CoordError> {
    private_dir(&paths.dir)
}

/// Creates a small file exclusively (`O_EXCL`, 0600). Not fsynced: markers and journal
/// entries describe a *process* that died mid-write, whose page cache survives it (the
/// original does not sync `.active` either); each fsync costs a launch about a millisecond.
fn write_new_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_reference_layout() {
        let p = LeasePaths::for_root(Path::new("/srv/sd-data/remote-workspaces/project-1/session-1"));
        let hex = "a4a7686a94446f5d656e37e92ba1dcf4b0b00a48a1e588d6d5554ea53c5ea9f4";
        assert_eq!(p.dir, Path::new("/srv/sd-data/remote-workspaces/project-1/.workspace-coordination"));
        assert_eq!(p.lock, p.dir.join(format!("{hex}.sqlite")));
        assert_eq!(p.active, p.dir.join(format!("{hex}.active")));
        assert_eq!(p.failed, p.dir.join(format!("{hex}.failed")));
    }
}
