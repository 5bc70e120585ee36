//! Opening the store: its directories, the package cache, and what a previous process left.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::envs::catalog::{self, Catalog};
use crate::envs::gate::Gates;
use crate::envs::ids::STARTER_PYTHON;
use crate::envs::settings::EnvSettings;
use crate::envs::setup::Setup;
use crate::envs::wheels;

use super::held_wheels::named_by_live;
use super::masks::host_interpreters;
use super::prefixes::sweep_orphan_prefixes;
use super::readiness::starter_ready;
use super::{EnvStore, StoreError, View, open_dir};

impl EnvStore {
    /// Opens the store under `data_dir` (created if absent), loads the catalog and marks an
    /// update interrupted by a crash as failed. Disabled: nothing is touched.
    pub fn open(
        data_dir: &Path,
        settings: EnvSettings,
        provisioner: PathBuf,
        sandbox_user: &crate::sandbox::user::Identity,
    ) -> Result<EnvStore, StoreError> {
        let mut root = data_dir.join(common::layout::SCIENTIFIC_ENVS);
        let mut catalog = Catalog::default();
        let mut cache_dir = PathBuf::new();
        if settings.enabled {
            // At its canonical path: conda prefixes embed theirs.
            let (path, _) = catalog::open_store(data_dir)?;
            root = path;
            // The operator's offline cache is only ever read (it may be read-only, or shared);
            // what the store fetches itself goes into its own.
            cache_dir = root.join(common::layout::ENV_PACKAGE_CACHE);
            prepare_cache(&cache_dir, sandbox_user)?;
            let dir = open_dir(&root)?;
            let swept = Catalog::sweep_temporaries(&dir) + wheels::sweep_incoming(&dir);
            if swept > 0 {
                tracing::info!(
                    event = "environment_temporaries_swept",
                    count = swept,
                    reason = "left by a previous process"
                );
            }
            catalog = Catalog::load(&dir)?;
            let wheels_swept =
                wheels::sweep_unreferenced(&dir, &|hash, name| named_by_live(&catalog, hash, name));
            if wheels_swept > 0 {
                tracing::info!(
                    event = "environment_wheels_swept",
                    count = wheels_swept,
                    reason = "named by no revision of a live environment"
                );
            }
            let orphans = sweep_orphan_prefixes(&root.join(common::layout::ENV_REVISIONS), &catalog);
            if orphans > 0 {
                tracing::info!(
                    event = "environment_prefixes_swept",
                    count = orphans,
                    reason = "left by a create a crash interrupted, or a delete"
                );
            }
            if catalog.recover_interrupted(&crate::timefmt::now_iso()) {
                catalog.save(&dir)?;
                tracing::warn!(
                    event = "environment_update_interrupted",
                    "an environment update was interrupted by a restart; the environment is marked failed"
                );
            }
        }
        let read_only_caches = settings.package_cache_dir.iter().cloned().collect();
        let starter_python_ready = starter_ready(&catalog, STARTER_PYTHON);
        let view = View { setup: Setup::initial(settings.enabled), starter_python_ready, running: false };
        Ok(EnvStore {
            masks: host_interpreters(Path::new("/usr/bin")),
            settings,
            root,
            provisioner,
            cache_dir,
            read_only_caches,
            catalog: Mutex::new(catalog),
            view: Mutex::new(view),
            gates: Gates::default(),
            cache_gate: tokio::sync::RwLock::new(()),
            wheels_in_use: Arc::default(),
        })
    }
}

/// The package cache: the provisioner (as the sandbox user) unpacks packages into it. One
/// runnerd made is handed to that user; an operator's is used as it is.
fn prepare_cache(cache: &Path, user: &crate::sandbox::user::Identity) -> Result<(), StoreError> {
    // `pkgs/` too: a link step (the cache read-only) must find the layer there, even when
    // every package came from the operator's cache and no fetch step wrote one.
    for dir in [cache.to_path_buf(), cache.join("pkgs")] {
        let io = |source| StoreError::Io { path: dir.clone(), source };
        if dir.exists() {
            continue;
        }
        std::fs::create_dir_all(&dir).map_err(io)?;
        let fd =
            crate::fsat::open_path(&dir, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW).map_err(io)?;
        user.hand_over(std::os::fd::AsFd::as_fd(&fd)).map_err(io)?;
    }
    Ok(())
}
