//! The writer lease (reference §6.1): `<dirname(C)>/.workspace-coordination/<H>.sqlite`
//! locked with `BEGIN IMMEDIATE`, refused while `<H>.failed` exists, and marked by an
//! exclusive `<H>.active` for as long as it is held.
//!
//! Beyond the original, runnerd journals each lease it holds under
//! `<dataDir>/runner-executions/active-leases/<H>` (the root's path) before it creates the
//! marker, so after a crash of *our* process it can tell its own interrupted writes from
//! someone else's and recover them (see `crate::writer::Versions::recover_interrupted`).
//! The entry's *content* says whether it is held: the root's path while held, empty once
//! released. The file itself stays, one per root like the lock database, so a lease
//! creates and removes no inode of ours (issue #18: ext4 inode churn was the launch path's
//! largest kernel cost). Nor does the protocol's `.active` marker: a released lease renames
//! it to `<H>.active-idle`, and the next lease renames that back without replacing anything
//! (`RENAME_NOREPLACE`, as exclusive as the original's `O_EXCL`), so the name comes and goes
//! but the inode stays.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::sqlite_lock::{LockFile, SqliteLock};
use super::{ACTIVE_TEXT, CoordError, POISONED, cname, path_hex, require_regular};
use crate::fsat::{self, Stat};

/// The lease directory's name, in the parent of every workspace root.
pub use common::layout::COORDINATION_DIR;

/// Where a root's lease files live (host paths: for tests and operators' messages; runnerd
/// itself reaches them only through [`LeaseNames`] and a directory descriptor).
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
        let names = LeaseNames::for_root(canonical);
        let dir = canonical.parent().unwrap_or(Path::new("/")).join(COORDINATION_DIR);
        LeasePaths {
            lock: dir.join(&names.lock),
            active: dir.join(&names.active),
            failed: dir.join(&names.failed),
            dir,
            hex: names.hex,
        }
    }
}

/// A root's lease file names inside its coordination directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseNames {
    pub lock: String,
    pub active: String,
    pub failed: String,
    /// Ours: the released marker, kept for the next lease ([`LeaseDir::place_marker`]).
    pub spare: String,
    pub hex: String,
}

impl LeaseNames {
    pub fn for_root(canonical: &Path) -> LeaseNames {
        let hex = path_hex(canonical);
        LeaseNames {
            lock: format!("{hex}.sqlite"),
            active: format!("{hex}.active"),
            failed: format!("{hex}.failed"),
            spare: format!("{hex}.active-idle"),
            hex,
        }
    }

    /// How errors name a file: relative to the workspace's parent.
    pub fn shown(name: &str) -> String {
        format!("{COORDINATION_DIR}/{name}")
    }
}

/// A root's opened coordination directory with its names.
#[derive(Debug)]
pub(super) struct LeaseDir {
    pub(super) fd: OwnedFd,
    pub(super) names: LeaseNames,
}

impl LeaseDir {
    fn c(&self, name: &str) -> Result<CString, CoordError> {
        cname(name, &LeaseNames::shown(name))
    }

    pub(super) fn lock_file(&self) -> Result<LockFile, CoordError> {
        let shown = LeaseNames::shown(&self.names.lock);
        let dir = fsat::dup(&self.fd).map_err(|e| CoordError::io("open", &shown, e))?;
        Ok(LockFile { dir, name: self.c(&self.names.lock)?, shown })
    }

    /// Whether an entry named `name` exists (of any kind: a planted symlink counts, and
    /// is never followed).
    pub(super) fn present(&self, name: &str) -> Result<bool, CoordError> {
        match Stat::at(&self.fd, &self.c(name)?) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(CoordError::io("inspect", &LeaseNames::shown(name), e)),
        }
    }

    /// Puts `.active` in place with the marker text: the spare a released lease kept,
    /// renamed without replacing anything, else a new file (`O_CREAT|O_EXCL`). An existing
    /// marker is [`CoordError::Interrupted`] either way. A spare that is not a marker of its
    /// own (this directory is writable by the sandbox of an enclosing workspace) is removed
    /// from the marker's name and a new one made.
    fn place_marker(&self) -> Result<(), CoordError> {
        let (active, spare) = (self.c(&self.names.active)?, self.c(&self.names.spare)?);
        let shown = LeaseNames::shown(&self.names.active);
        match fsat::rename_noreplace_at(&self.fd, &spare, &active) {
            Ok(()) => {
                let ours = Stat::at(&self.fd, &active).is_ok_and(|st| {
                    st.kind() == libc::S_IFREG && st.nlink == 1 && st.size == ACTIVE_TEXT.len() as u64
                });
                if ours {
                    return Ok(());
                }
                // Moved back where it was when it cannot be unlinked (a directory), so that
                // it never stands at the marker's name.
                if fsat::unlink_at(&self.fd, &active).is_err() {
                    fsat::rename_at(&self.fd, &active, &spare)
                        .map_err(|e| CoordError::io("replace the lease marker", &shown, e))?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(CoordError::Interrupted),
            // No spare yet (or a filesystem without `renameat2`): a new marker.
            Err(_) => {}
        }
        match fsat::create_new_at(&self.fd, &active, 0o600) {
            Ok(fd) => std::fs::File::from(fd).write_all(ACTIVE_TEXT.as_bytes()).map_err(|e| {
                // Ours and not yet a lease's: it must not refuse the next writer.
                let _ = fsat::unlink_at(&self.fd, &active);
                CoordError::io("create the lease marker", &shown, e)
            }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(CoordError::Interrupted),
            Err(e) => Err(CoordError::io("create the lease marker", &shown, e)),
        }
    }

    /// Takes `.active` away (the entry itself, whatever it is now; never followed): renamed
    /// to the spare for the next lease, or unlinked where that fails.
    fn remove_marker(&self) {
        let (Ok(active), Ok(spare)) = (self.c(&self.names.active), self.c(&self.names.spare)) else { return };
        if fsat::rename_at(&self.fd, &active, &spare).is_err() {
            let _ = fsat::unlink_at(&self.fd, &active);
        }
    }

    /// `poisonWorkspace`'s file: `<H>.failed`, created (0600) or truncated, with the poison
    /// text, opened `O_NOFOLLOW | O_NONBLOCK` and checked to be a regular file of its own
    /// before anything is truncated or written.
    pub(super) fn write_poison(&self) -> Result<(), CoordError> {
        let shown = LeaseNames::shown(&self.names.failed);
        let failed = |e| CoordError::io("write the poison marker", &shown, e);
        let fd = match fsat::open_or_create_at(&self.fd, &self.c(&self.names.failed)?, 0o600) {
            Ok(fd) => fd,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO | libc::EISDIR)) => {
                let found = Stat::at(&self.fd, &self.c(&self.names.failed)?)
                    .map(|st| super::kind_name(&st.kind()))
                    .unwrap_or("not a regular file");
                return Err(CoordError::Planted { name: shown, found, expected: "a regular file" });
            }
            Err(e) => return Err(failed(e)),
        };
        require_regular(&Stat::of_fd(&fd).map_err(failed)?, &shown)?;
        let mut file = std::fs::File::from(fd);
        file.set_len(0).map_err(failed)?;
        file.write_all(POISONED.as_bytes()).map_err(failed)
    }
}

/// A held writer lease. Dropping it removes the marker it created, then the journal entry,
/// then releases the lock (the original's order).
#[derive(Debug)]
pub struct Lease {
    paths: LeasePaths,
    dir: LeaseDir,
    journal: Option<JournalEntry>,
    created_active: bool,
    _lock: SqliteLock,
}

/// This lease's entry in the lease journal, and how its release clears it.
#[derive(Debug)]
enum JournalEntry {
    /// Written by this lease: emptied (kept) on release.
    Held(std::fs::File),
    /// Left by a crashed process and taken over by recovery: removed on release.
    Recovered(PathBuf),
}

impl Lease {
    pub fn paths(&self) -> &LeasePaths {
        &self.paths
    }

    /// Unlinks `<H>.failed` (the entry itself, whatever it is; never followed) in this
    /// lease's coordination directory. Whether a marker was there.
    pub(super) fn remove_poison_marker(&self) -> Result<bool, CoordError> {
        let shown = LeaseNames::shown(&self.dir.names.failed);
        let name = cname(&self.dir.names.failed, &shown)?;
        match crate::fsat::unlink_at(&self.dir.fd, &name) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(CoordError::io("remove the poison marker", &shown, e)),
        }
    }

    /// Checks the poison marker and creates `.active`; the lock is already held.
    /// `journal_dir`, when given, records the lease for crash recovery.
    pub(super) fn establish(
        root: &Path,
        dir: LeaseDir,
        lock: SqliteLock,
        poisoned_here: bool,
        journal_dir: Option<&Path>,
    ) -> Result<Lease, CoordError> {
        if poisoned_here || dir.present(&dir.names.failed)? {
            return Err(CoordError::Poisoned);
        }
        Lease::establish_despite_poison(root, dir, lock, journal_dir)
    }

    /// [`Lease::establish`] without the poison check: for the repair of a poisoned root
    /// (the lock is held, so no other writer can start; the marker is cleared only after
    /// the repair committed).
    pub(super) fn establish_despite_poison(
        root: &Path,
        dir: LeaseDir,
        lock: SqliteLock,
        journal_dir: Option<&Path>,
    ) -> Result<Lease, CoordError> {
        let paths = LeasePaths::for_root(root);
        let mut lease = Lease { paths, dir, journal: None, created_active: false, _lock: lock };
        if let Some(journal) = journal_dir {
            // An entry that already exists belongs to an interrupted write of an earlier
            // process (its marker refuses us below): it is left for start-up recovery.
            let entry = journal.join(&lease.paths.hex);
            match hold_entry(&entry, root.as_os_str().as_encoded_bytes()) {
                Ok(Some(file)) => lease.journal = Some(JournalEntry::Held(file)),
                Ok(None) => {}
                Err(e) => return Err(CoordError::io("record the lease in", "the lease journal", e)),
            }
        }
        lease.dir.place_marker()?;
        lease.created_active = true;
        Ok(lease)
    }

    /// Takes over the marker a crashed holder left: the lock is held, so the marker's
    /// writer is gone; dropping this lease removes the marker.
    pub(super) fn take_over(root: &Path, dir: LeaseDir, lock: SqliteLock, journal: PathBuf) -> Lease {
        Lease {
            paths: LeasePaths::for_root(root),
            dir,
            journal: Some(JournalEntry::Recovered(journal)),
            created_active: true,
            _lock: lock,
        }
    }

    /// Releases the lock but keeps the marker and the journal entry: the write stays
    /// refused (and a later start retries its recovery).
    pub fn release_keeping_marker(mut self) {
        self.created_active = false;
        self.journal = None;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.created_active {
            self.dir.remove_marker();
        }
        match &self.journal {
            Some(JournalEntry::Held(file)) => {
                let _ = file.set_len(0);
            }
            Some(JournalEntry::Recovered(entry)) => {
                let _ = std::fs::remove_file(entry);
            }
            None => {}
        }
    }
}

/// Marks a root's entry in the lease journal (in the data directory, where no sandbox
/// writes) held: opens it (created 0600 the first time), and writes `bytes` into it if it
/// is empty. `None` when it is not: a crashed earlier process held it, and it is left for
/// start-up recovery. Not fsynced: markers and journal entries describe a *process* that
/// died mid-write, whose page cache survives it (the original does not sync `.active`
/// either); each fsync costs a launch about a millisecond.
fn hold_entry(path: &Path, bytes: &[u8]) -> std::io::Result<Option<std::fs::File>> {
    use std::os::unix::fs::FileExt;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if f.metadata()?.len() > 0 {
        return Ok(None);
    }
    f.write_all_at(bytes, 0)?;
    Ok(Some(f))
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
