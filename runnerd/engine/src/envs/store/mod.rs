//! The environment store (internals §5): setup, create, install, uninstall, delete, the read
//! lease of an execution, and the views the routes answer with. The catalog is held in memory
//! behind one lock (the original's `mutationTail`) and written through on every change; each
//! environment has a FIFO readers/writer gate ([`super::gate`]).
//!
//! This module holds the store itself and its catalog access; each concern is a submodule:
//!
//! * [`error`]: [`StoreError`] and the setup action a failure asks for.
//! * [`open`]: opening the store, its package cache, what a previous process left.
//! * [`readiness`]: setup in the background and the views `/health` reads.
//! * [`provisioning`]: running conda, pip and R steps and reading their answers.
//! * [`prefixes`]: revision prefixes on disk, made, removed and swept.
//! * [`changes`]: a change's lifecycle and the revision record it ends in.
//! * [`create`], [`install`], [`removal`]: the routes' operations.
//! * [`held_wheels`]: the workspace wheels an install copies, and letting go of them.
//! * [`lease`]: an execution's selection and its read lease.
//! * [`masks`]: the host interpreters an environment run hides.

mod changes;
mod create;
mod error;
mod held_wheels;
mod install;
mod lease;
mod masks;
mod open;
mod prefixes;
mod provisioning;
mod readiness;
mod removal;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::catalog::{Catalog, Environment, EnvironmentRevision, Status};
use super::gate::Gates;
use super::settings::EnvSettings;
use super::setup::Setup;
use super::{snapshot, wheels};

pub use error::StoreError;
pub use install::InstallRequest;
pub use lease::Runtime;
pub use lease::Selection;

/// What `/health` and `/environment-setup` read without touching the disk.
#[derive(Debug)]
struct View {
    setup: Setup,
    starter_python_ready: bool,
    running: bool,
}

#[derive(Debug)]
pub struct EnvStore {
    pub settings: EnvSettings,
    /// `<dataDir>/scientific-envs`, absolute.
    root: PathBuf,
    provisioner: PathBuf,
    /// The package cache conda fetch steps write (`scientific-envs/provisioner`).
    cache_dir: PathBuf,
    /// The operator's offline cache (`SCIENCE_AGENT_PACKAGE_CACHE_DIR`), only ever read.
    read_only_caches: Vec<PathBuf>,
    masks: Vec<PathBuf>,
    catalog: Mutex<Catalog>,
    view: Mutex<View>,
    gates: Gates,
    /// The package cache: fetch steps (which may replace an entry) write, link steps (which
    /// copy from it, their rattler lock in a scratch layer of their own) read; a change holds
    /// it from its fetch to the end of its link (downgraded in between). A fetch step reads
    /// a prefix a pip or R step wrote while it holds this: the provisioner refuses what
    /// could hang it there (FIFOs, devices, more than two million entries) before reading.
    cache_gate: tokio::sync::RwLock<()>,
    /// The stored wheels installs in flight hold ([`wheels::InUse`]).
    wheels_in_use: Arc<wheels::InUse>,
}

impl EnvStore {
    /// Changes the catalog durably: `change` is applied to a copy, the copy is written, and
    /// only then does it replace the catalog in memory, so memory never runs ahead of the
    /// disk (a failed write leaves both as they were).
    fn persist<T>(
        &self,
        change: impl FnOnce(&mut Catalog) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let dir = open_dir(&self.root)?;
        let mut catalog = self.cat();
        let mut next = catalog.clone();
        let out = change(&mut next)?;
        next.save(&dir)?;
        *catalog = next;
        Ok(out)
    }

    /// The catalog, held only between awaits (a std lock: never across one).
    fn cat(&self) -> std::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `GET /environments`.
    pub async fn list(&self) -> Result<Vec<Environment>, StoreError> {
        self.require_available()?;
        Ok(self.cat().environments.clone())
    }

    /// `GET /environment-revisions`.
    pub async fn revisions(&self) -> Result<Vec<EnvironmentRevision>, StoreError> {
        self.require_available()?;
        Ok(self.cat().revisions.clone())
    }

    /// `GET /environment-revisions/:id/snapshot`: the stored bytes, re-verified.
    pub async fn snapshot(&self, id: &str) -> Result<Vec<u8>, StoreError> {
        self.require_available()?;
        let revision = self.cat().revision(id).cloned();
        let revision = revision.ok_or_else(|| StoreError::UnknownRevision(id.to_owned()))?;
        let dir = open_dir(&self.root)?;
        Ok(snapshot::read_verified(&dir, &revision.id, &revision.snapshot)?)
    }
}

/// `Environment <id> is <status>; repair it …`.
fn ready(env: &Environment) -> Result<(), StoreError> {
    match env.status {
        Status::Ready => Ok(()),
        status => Err(StoreError::Invalid(format!(
            "Environment {} is {}; repair it through environment management before execution",
            env.id,
            status.as_str()
        ))),
    }
}

fn audit(event: &'static str, environment: &str, revision: &str, detail: &str) {
    tracing::info!(event, environment, revision, detail);
}

fn audit_failed(event: &'static str, environment: &str, e: &StoreError) {
    tracing::warn!(event, environment, error = %crate::error_chain(e));
}

fn open_dir(path: &Path) -> Result<std::os::fd::OwnedFd, StoreError> {
    crate::fsat::open_path(path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .map_err(|source| StoreError::Io { path: path.to_path_buf(), source })
}
