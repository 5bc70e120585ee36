//! Uninstalling conda packages, and deleting an environment (its revisions stay).

use common::provision::Op;

use crate::app::App;
use crate::envs::catalog::{self, EnvironmentRevision, LocalWheel};
use crate::envs::ids::{self, STARTER_PYTHON, STARTER_R};
use crate::envs::snapshot;
use crate::envs::wheels;

use super::changes::Change;
use super::{EnvStore, StoreError, audit, audit_failed, open_dir};

impl EnvStore {
    /// `POST /environments/:id/uninstall` (conda packages).
    pub async fn uninstall(
        &self,
        app: &App,
        id: &str,
        packages: Vec<String>,
    ) -> Result<EnvironmentRevision, StoreError> {
        self.require_available()?;
        self.task_environment(id).await?;
        ids::check_specs(&packages)?;
        let _w = self.gates.write(id).await;
        let env = self.task_environment(id).await?;
        let current = self.cat().revision(&env.current_revision_id).cloned();
        let prefix = self.root.join(env.prefix_rel()?);
        let channels = self.conda_channels(&current.as_ref().map(|r| r.channels.clone()).unwrap_or_default());
        let urls = self.channel_urls(&channels)?;
        self.begin_update(id).await?;
        let remove = Op::Remove { names: packages.clone() };
        let answer = match self.conda_change(app, remove, &prefix, &urls, &[]).await {
            Ok(a) => a,
            Err(e) => {
                self.fail_update(id).await;
                audit_failed("environment_uninstall_failed", id, &e);
                return Err(e);
            }
        };
        let requested = snapshot::requested_removal(&packages);
        let wheels = current.and_then(|r| r.local_wheels);
        self.commit_change(app, &env, Change { prefix: &prefix, channels, answer, requested, wheels }).await
    }

    /// `DELETE /environments/:id`: the prefix goes; revisions and snapshots stay.
    pub async fn delete(&self, id: &str) -> Result<String, StoreError> {
        self.require_available()?;
        if id == STARTER_PYTHON || id == STARTER_R {
            return Err(StoreError::Invalid(format!("Starter environment {id} cannot be deleted")));
        }
        self.task_environment(id).await?;
        let _w = self.gates.write(id).await;
        let kept = self.persist(|catalog| {
            if catalog.environment(id).is_none() {
                return Err(StoreError::NotFound(id.to_owned()));
            }
            catalog.environments.retain(|e| e.id != id);
            Ok(catalog.revisions_of(id).count())
        })?;
        // Its wheels no live environment names go with it (nothing installs from a deleted
        // environment's revisions again).
        let carried: Vec<LocalWheel> =
            self.cat().revisions_of(id).flat_map(|r| r.local_wheels.iter().flatten().cloned()).collect();
        if let Ok(dir) = open_dir(&self.root) {
            wheels::forget(&dir, &carried, &self.wheels_in_use, &|w| self.wheel_named(w));
        }
        // A prefix may hold whatever a pip or R step left (millions of files): removed on the
        // blocking pool, never on an async worker.
        let root = open_dir(&self.root)?;
        let owned = id.to_owned();
        let removed = tokio::task::spawn_blocking(move || catalog::remove_env_dir(&root, &owned)).await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(event = "environment_prefix_left", environment = id, error = %crate::error_chain(&e))
            }
            Err(e) => tracing::warn!(event = "environment_prefix_left", environment = id, error = %e),
        }
        audit("environment_deleted", id, "", &format!("{kept} revisions and their snapshots kept"));
        Ok(id.to_owned())
    }
}
