//! A change's lifecycle: the environment it may touch, `updating`, `failed`, and the revision
//! record it ends in (a new environment's first, or the next one).

use std::path::Path;

use common::provision;

use crate::app::App;
use crate::envs::catalog::{self, Environment, EnvironmentRevision, Kind, LocalWheel, Status};
use crate::envs::ids;
use crate::envs::sandboxed;
use crate::envs::snapshot::{CondaPackage, Installed, Parts, PythonPackage, RPackage, Snapshot};
use crate::envs::steps;

use super::prefixes::remove_prefix;
use super::{EnvStore, StoreError, audit, open_dir};

/// The most one revision's package list may take, serialised (a real environment of a few
/// thousand packages takes a few hundred kilobytes).
pub const MAX_INSTALLED_BYTES: usize = 4 << 20;

/// What a change left in its prefix, to be recorded as a revision: the prefix, the channels
/// (or the index, or the repository) the record names, the provisioner's answer (its conda
/// packages), the changes the request named, and the local wheels the revision carries.
pub(super) struct Change<'a> {
    pub(super) prefix: &'a Path,
    pub(super) channels: Vec<String>,
    pub(super) answer: provision::Response,
    pub(super) requested: Vec<String>,
    pub(super) wheels: Option<Vec<LocalWheel>>,
}

impl EnvStore {
    /// A new environment's first revision and its catalog entry (a starter replaces an entry
    /// of its id; a task environment's name must still be free). On any failure the prefix
    /// goes, so nothing is left that no record names.
    pub(super) async fn publish_new(
        &self,
        app: &App,
        env: Environment,
        change: Change<'_>,
    ) -> Result<Environment, StoreError> {
        let rev = env.current_revision_id.clone();
        let prefix = change.prefix;
        let published = match self.record_revision(app, &env, &rev, change).await {
            Ok(revision) => self.persist(|catalog| {
                match env.kind {
                    Kind::Starter => catalog.environments.retain(|e| e.id != env.id),
                    // Names are unique: a concurrent create may have taken it meanwhile.
                    Kind::Task => ids::check_new_name(&env.name, catalog.names())?,
                }
                catalog.environments.push(env.clone());
                catalog.revisions.push(revision);
                Ok(())
            }),
            Err(e) => Err(e),
        };
        if let Err(e) = published {
            let _ = remove_prefix(prefix);
            return Err(e);
        }
        // A starter published again replaces the one sandboxes started ahead bind.
        app.sandbox
            .forget(crate::isolation::prestart::Scope::All, crate::isolation::prestart::Discard::Environment);
        Ok(env)
    }

    /// The revision record and its snapshot for the prefix as it is now.
    async fn record_revision(
        &self,
        app: &App,
        env: &Environment,
        rev: &str,
        change: Change<'_>,
    ) -> Result<EnvironmentRevision, StoreError> {
        let Change { prefix, channels, answer, requested, wheels } = change;
        // Which interpreters the prefix has, from the provisioner's answer: never a look at
        // the prefix from the host, where a pip or R step may have planted links.
        let has = |name: &str| answer.installed.iter().any(|p| p.name == name);
        let too_large =
            |e: steps::InventoryTooLarge| StoreError::Step { label: "inventory", detail: e.to_string() };
        let python = match has("python") {
            true => match sandboxed::run(app, steps::python_inventory(prefix)).await {
                Ok(out) => steps::parse_python_inventory(&out.stdout).map_err(too_large)?,
                Err(_) => Vec::new(),
            },
            false => Vec::new(),
        };
        let r = match env.language == catalog::Language::R && has("r-base") {
            true => match sandboxed::run(app, steps::r_inventory(prefix)).await {
                Ok(out) => steps::parse_r_inventory(&out.stdout).map_err(too_large)?,
                Err(_) => Vec::new(),
            },
            false => Vec::new(),
        };
        if answer.installed.len() > steps::MAX_INVENTORY_ENTRIES {
            return Err(too_large(steps::InventoryTooLarge { language: "conda" }));
        }
        let installed = Installed {
            conda: answer.installed.iter().map(CondaPackage::from).collect(),
            python: python
                .into_iter()
                .map(|(name, version, installer)| PythonPackage { name, version, installer })
                .collect(),
            r: r.into_iter()
                .map(|(name, version, repository)| RPackage { name, version, repository })
                .collect(),
        };
        // Every revision's list stays in the catalog: a forged one (long channel or build
        // texts in conda records a package step wrote) fails the change, not the catalog.
        let bytes = serde_json::to_vec(&installed).map_or(usize::MAX, |b| b.len());
        if bytes > MAX_INSTALLED_BYTES {
            return Err(StoreError::Step {
                label: "inventory",
                detail: format!(
                    "the environment's package list takes {bytes} bytes, more than {MAX_INSTALLED_BYTES}; a package step may have forged its records"
                ),
            });
        }
        let snap = Snapshot::new(Parts {
            revision_id: rev.to_owned(),
            environment_id: env.id.clone(),
            language: env.language,
            created_at: crate::timefmt::now_iso(),
            channels,
            requested_changes: requested,
            installed,
            local_wheels: wheels.filter(|w| !w.is_empty()),
        });
        Ok(snap.record(&open_dir(&self.root)?)?)
    }

    /// The environment a change may touch: it exists and is not a starter.
    pub(super) async fn task_environment(&self, id: &str) -> Result<Environment, StoreError> {
        ids::check_env_id(id).map_err(|_| StoreError::NotFound(id.to_owned()))?;
        let env = self.cat().environment(id).cloned();
        let env = env.ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        if env.kind == Kind::Starter {
            return Err(StoreError::Invalid(format!(
                "Starter environment {id} is read-only; create a task environment from it and change that"
            )));
        }
        Ok(env)
    }

    /// Marks the environment `updating` on disk before any package is touched.
    pub(super) async fn begin_update(&self, id: &str) -> Result<(), StoreError> {
        self.persist(|catalog| {
            catalog.begin_update(id, &crate::timefmt::now_iso());
            Ok(())
        })
    }

    /// `failed` with the original's text, keeping the current revision.
    pub(super) async fn fail_update(&self, id: &str) {
        let failed = self.persist(|catalog| {
            catalog.fail_update(id, &crate::timefmt::now_iso());
            Ok(())
        });
        if let Err(e) = failed {
            // The disk still says `updating`: a restart marks it failed ("interrupted").
            tracing::error!(event = "environment_catalog_write_failed", environment = id, error = %crate::error_chain(&e));
        }
    }

    /// A successful change: a new revision and snapshot, the environment ready on it.
    pub(super) async fn commit_change(
        &self,
        app: &App,
        env: &Environment,
        change: Change<'_>,
    ) -> Result<EnvironmentRevision, StoreError> {
        let rev = ids::new_revision_id();
        let recorded = self.record_revision(app, env, &rev, change).await;
        let revision = match recorded {
            Ok(r) => r,
            Err(e) => {
                self.fail_update(&env.id).await;
                return Err(e);
            }
        };
        let committed = self.persist(|catalog| {
            catalog.commit_revision(revision.clone(), &crate::timefmt::now_iso());
            Ok(())
        });
        if let Err(e) = committed {
            self.fail_update(&env.id).await;
            return Err(e);
        }
        audit("environment_changed", &env.id, &rev, &revision.packages.len().to_string());
        // A sandbox started ahead binds the prefix by path, as it was.
        app.sandbox
            .forget(crate::isolation::prestart::Scope::All, crate::isolation::prestart::Discard::Environment);
        Ok(revision)
    }
}

/// A new environment, ready on its first revision (which is also its prefix's).
pub(super) fn new_environment(
    id: &str,
    name: &str,
    kind: Kind,
    language: catalog::Language,
    rev: &str,
    base: Option<&str>,
) -> Environment {
    let now = crate::timefmt::now_iso();
    Environment {
        id: id.to_owned(),
        name: name.to_owned(),
        kind,
        language,
        status: Status::Ready,
        current_revision_id: rev.to_owned(),
        runtime_revision_id: Some(rev.to_owned()),
        base_environment_id: base.map(str::to_owned),
        created_at: now.clone(),
        updated_at: now,
        error: None,
    }
}
