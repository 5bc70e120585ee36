//! The workspace wheels an install copies into the store, and letting go of them.

use std::path::{Path, PathBuf};

use crate::app::App;
use crate::envs::catalog::{Catalog, LocalWheel};
use crate::envs::wheels;

use super::{EnvStore, StoreError, open_dir};

impl EnvStore {
    /// Copies the workspace wheels into the store (hashed, up to gigabytes each, on the
    /// blocking pool), each held until [`Self::release_wheels`]; if one fails, those copied
    /// before it are released.
    pub(super) async fn persist_wheels(
        &self,
        app: &App,
        workspace: &Path,
        paths: &[String],
    ) -> Result<Vec<LocalWheel>, StoreError> {
        let root_fd = crate::workspace::open_beneath(&app.data_dir, workspace)
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        let dir = open_dir(&self.root)?;
        let paths = paths.to_vec();
        let in_use = self.wheels_in_use.clone();
        let (done, failed) = tokio::task::spawn_blocking(move || {
            let mut done = Vec::with_capacity(paths.len());
            for p in &paths {
                match wheels::persist(&dir, &root_fd, p, &in_use) {
                    Ok(w) => done.push(w),
                    Err(e) => return (done, Some(StoreError::from(e))),
                }
            }
            (done, None)
        })
        .await
        .map_err(|e| StoreError::Invalid(format!("Local wheels could not be copied: {e}")))?;
        match failed {
            None => Ok(done),
            Some(e) => {
                self.release_wheels(&done);
                Err(e)
            }
        }
    }

    /// Lets go of wheels an install copied ([`wheels::release`]).
    fn release_wheels(&self, held: &[LocalWheel]) {
        if held.is_empty() {
            return;
        }
        let Ok(dir) = open_dir(&self.root) else { return };
        let removed = wheels::release(&dir, held, &self.wheels_in_use, &|w| self.wheel_named(w));
        if removed > 0 {
            tracing::info!(
                event = "environment_wheels_removed",
                count = removed,
                reason = "the install that copied them did not land"
            );
        }
    }

    /// Whether a revision of an environment that still exists names `wheel` (read now, from
    /// the catalog in memory).
    pub(super) fn wheel_named(&self, wheel: &LocalWheel) -> bool {
        named_by_live(&self.cat(), &wheel.content.hash, &wheel.filename)
    }

    pub(super) fn wheel_path(&self, w: &LocalWheel) -> Result<PathBuf, StoreError> {
        Ok(self.root.join(wheels::stored_rel_path(w)?))
    }
}

/// The wheels an install copied, let go of when it ends however it ends.
pub(super) struct HeldWheels<'a> {
    pub(super) store: &'a EnvStore,
    pub(super) wheels: Vec<LocalWheel>,
}

impl Drop for HeldWheels<'_> {
    fn drop(&mut self) {
        self.store.release_wheels(&self.wheels);
    }
}

/// Whether a revision of an environment the catalog still holds names the stored wheel
/// `hash`/`filename`: a deleted environment's revisions stay as records, but nothing
/// installs from them again.
pub(super) fn named_by_live(catalog: &Catalog, hash: &str, filename: &str) -> bool {
    catalog.environments.iter().any(|env| {
        catalog.revisions_of(&env.id).any(|r| {
            r.local_wheels.iter().flatten().any(|w| w.content.hash == hash && w.filename == filename)
        })
    })
}
