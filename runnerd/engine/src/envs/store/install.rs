//! `POST /environments/:id/install`: the request checked, the workspace wheels copied under the
//! gate, the step, the new revision.

use std::path::PathBuf;

use common::provision::{self, Op};

use crate::app::App;
use crate::envs::catalog::{self, Environment, EnvironmentRevision, LocalWheel};
use crate::envs::ids::{self, Manager};
use crate::envs::snapshot;
use crate::envs::steps::{self, PYPI, PipSource};
use crate::envs::wheels;

use super::changes::Change;
use super::held_wheels::HeldWheels;
use super::{EnvStore, StoreError, audit_failed, open_dir};

/// The original refuses a package source the manager does not use: `indexUrl` is pip's,
/// `channels` conda's (an empty list names nothing and passes).
fn check_sources(
    manager: Manager,
    channels: Option<&[String]>,
    index_url: Option<&str>,
) -> Result<(), StoreError> {
    if index_url.is_some() && manager != Manager::Pip {
        return Err(StoreError::Invalid("indexUrl is only supported for pip installs".into()));
    }
    if channels.is_some_and(|c| !c.is_empty()) && manager != Manager::Conda {
        return Err(StoreError::Invalid("channels are only supported for conda installs".into()));
    }
    Ok(())
}

/// The install body, read by the route.
#[derive(Debug, Clone)]
pub struct InstallRequest {
    pub packages: Vec<String>,
    pub channels: Option<Vec<String>>,
    pub manager: Manager,
    pub index_url: Option<String>,
    pub workspace: crate::workspace::WorkspaceRef,
}

/// What an install checked before its gate: the specs (wheel paths apart), the conda
/// channels, pip's source, and the workspace its wheels come from.
struct Checked {
    specs: Vec<String>,
    wheel_paths: Vec<String>,
    channels: Vec<String>,
    pip_source: Option<PipSource>,
    workspace: Option<PathBuf>,
}

/// What [`EnvStore::install_held`] works with: the checked request, and what was read under
/// the gate (the current revision, the prefix, the conda channels' URLs).
struct InstallParts {
    checked: Checked,
    current: Option<EnvironmentRevision>,
    prefix: PathBuf,
    urls: Vec<String>,
}

impl EnvStore {
    /// `POST /environments/:id/install`.
    pub async fn install(
        &self,
        app: &App,
        id: &str,
        req: InstallRequest,
    ) -> Result<EnvironmentRevision, StoreError> {
        self.require_available()?;
        let env = self.task_environment(id).await?;
        let checked = self.check_install(app, &env, &req)?;
        let _w = self.gates.write(id).await;
        // The record may have changed while this waited.
        let env = self.task_environment(id).await?;
        let current = self.cat().revision(&env.current_revision_id).cloned();
        // Everything that can fail before a package is touched, before `updating`.
        let prefix = self.root.join(env.prefix_rel()?);
        check_carried(id, current.as_ref(), &checked.wheel_paths)?;
        let urls = self.channel_urls(&checked.channels)?;
        let new_wheels = match &checked.workspace {
            Some(root) => self.persist_wheels(app, root, &checked.wheel_paths).await?,
            None => Vec::new(),
        };
        // Whatever happens from here (an abandoned request included), this install lets go
        // of its copies: a failed one's go, unless another install holds them or a live
        // revision names them.
        let held = HeldWheels { store: self, wheels: new_wheels };
        let parts = InstallParts { checked, current, prefix, urls };
        self.install_held(app, &env, &req, parts, &held.wheels).await
    }

    /// Everything about the request that needs no gate, in this order: packages, sources,
    /// specs, wheels, conda channels, pip's source, an R manager's environment, and the
    /// workspace (found now; its wheels are copied only once the gate is held and
    /// everything else about the request has been checked, issue #32).
    fn check_install(
        &self,
        app: &App,
        env: &Environment,
        req: &InstallRequest,
    ) -> Result<Checked, StoreError> {
        if req.packages.is_empty() {
            return Err(ids::IdError::NoPackages.into());
        }
        check_sources(req.manager, req.channels.as_deref(), req.index_url.as_deref())?;
        let (wheel_paths, specs): (Vec<String>, Vec<String>) = match req.manager {
            Manager::Pip => req.packages.iter().cloned().partition(|p| wheels::is_wheel_request(p)),
            _ => (Vec::new(), req.packages.clone()),
        };
        for s in &specs {
            ids::check_spec(s)?;
        }
        if wheel_paths.len() > wheels::MAX_WHEELS_PER_INSTALL {
            return Err(StoreError::Invalid(format!(
                "At most {} local wheels may be installed at once",
                wheels::MAX_WHEELS_PER_INSTALL
            )));
        }
        for w in &wheel_paths {
            wheels::parse_request(w)?;
        }
        let channels = match req.manager {
            Manager::Conda => {
                ids::allowed_channels(req.channels.as_deref().unwrap_or_default(), &self.settings.channels)?
            }
            _ => Vec::new(),
        };
        let pip_source = self.pip_source(req, &specs)?;
        self.check_r_install(env, req)?;
        let workspace = match wheel_paths.is_empty() {
            true => None,
            false => Some(locate_workspace(app, req)?),
        };
        Ok(Checked { specs, wheel_paths, channels, pip_source, workspace })
    }

    /// Where a pip install reads packages from (`None` for another manager).
    fn pip_source(&self, req: &InstallRequest, specs: &[String]) -> Result<Option<PipSource>, StoreError> {
        Ok(match (req.manager, &req.index_url) {
            (Manager::Pip, _) if self.settings.offline() => {
                self.settings.package_cache_dir.clone().map(PipSource::Offline)
            }
            // Only workspace wheels and no index named: nothing is fetched.
            (Manager::Pip, None) if specs.is_empty() => Some(PipSource::WheelsOnly),
            (Manager::Pip, Some(url)) => {
                ids::check_index_url(url)?;
                Some(PipSource::Index(url.clone()))
            }
            (Manager::Pip, None) => Some(PipSource::Index(PYPI.to_owned())),
            _ => None,
        })
    }

    /// A CRAN or Bioconductor install needs the network and an R environment.
    fn check_r_install(&self, env: &Environment, req: &InstallRequest) -> Result<(), StoreError> {
        if !matches!(req.manager, Manager::Cran | Manager::Bioconductor) {
            return Ok(());
        }
        if self.settings.offline() {
            return Err(StoreError::Invalid(format!(
                "{} installs are unavailable in offline package-cache mode",
                if req.manager == Manager::Cran { "CRAN" } else { "Bioconductor" }
            )));
        }
        if env.language != catalog::Language::R {
            return Err(StoreError::Invalid(format!("Environment {} is not an R environment", env.id)));
        }
        Ok(())
    }

    /// The install once its gate is held and its wheels are copied: the step, then the new
    /// revision (or `failed`).
    async fn install_held(
        &self,
        app: &App,
        env: &Environment,
        req: &InstallRequest,
        parts: InstallParts,
        new_wheels: &[LocalWheel],
    ) -> Result<EnvironmentRevision, StoreError> {
        let id = env.id.as_str();
        let new_wheels = new_wheels.to_vec();
        let wheel_files = new_wheels.iter().map(|w| self.wheel_path(w)).collect::<Result<Vec<_>, _>>()?;
        self.begin_update(id).await?;
        let answer = match self.install_step(app, req.manager, &parts, &wheel_files).await {
            Ok(a) => a,
            Err(e) => {
                self.fail_update(id).await;
                audit_failed("environment_install_failed", id, &e);
                return Err(e);
            }
        };
        let InstallParts { checked, current, prefix, .. } = parts;
        let Checked { specs, wheel_paths, channels, pip_source, .. } = checked;
        let mut requested = snapshot::requested_install(req.manager, &specs);
        requested.extend(snapshot::requested_install(req.manager, &wheel_paths));
        let revision_channels = match (req.manager, &pip_source) {
            (Manager::Conda, _) => channels,
            (Manager::Pip, Some(PipSource::Index(url))) => vec![url.clone()],
            (Manager::Cran | Manager::Bioconductor, _) => vec![self.settings.cran_repo.clone()],
            _ => current.as_ref().map(|r| r.channels.clone()).unwrap_or_default(),
        };
        let wheels_kept = self.wheels_after(id, current.as_ref(), new_wheels)?;
        let change = Change {
            prefix: &prefix,
            channels: revision_channels,
            answer,
            requested,
            wheels: Some(wheels_kept),
        };
        self.commit_change(app, env, change).await
    }

    /// The install's own step: conda's fetch and link, pip, or R's.
    async fn install_step(
        &self,
        app: &App,
        manager: Manager,
        parts: &InstallParts,
        wheel_files: &[PathBuf],
    ) -> Result<provision::Response, StoreError> {
        let (prefix, specs) = (&parts.prefix, &parts.checked.specs);
        match manager {
            Manager::Conda => {
                self.conda_change(app, Op::Install { specs: specs.clone() }, prefix, &parts.urls, &[]).await
            }
            Manager::Pip => {
                let source = parts.checked.pip_source.clone().unwrap_or(PipSource::Index(PYPI.to_owned()));
                self.run_tool(app, steps::pip(prefix, &source, specs, wheel_files)).await
            }
            Manager::Cran | Manager::Bioconductor => {
                let mut step = steps::r_install(
                    prefix,
                    manager == Manager::Bioconductor,
                    &self.settings.cran_repo,
                    specs,
                );
                steps::pin_configured(&mut step, std::slice::from_ref(&self.settings.cran_repo));
                self.run_tool(app, step).await
            }
        }
    }

    /// The wheels the new revision carries: the current revision's whose stored copy is
    /// still intact (carried wheels are recorded only while it is), then this install's,
    /// each replacing a carried one of its filename.
    fn wheels_after(
        &self,
        id: &str,
        current: Option<&EnvironmentRevision>,
        new_wheels: Vec<LocalWheel>,
    ) -> Result<Vec<LocalWheel>, StoreError> {
        let store_dir = open_dir(&self.root)?;
        let mut wheels_kept = current.and_then(|r| r.local_wheels.clone()).unwrap_or_default();
        wheels_kept.retain(|w| match wheels::verify_persisted(&store_dir, w) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(event = "environment_wheel_dropped", environment = id, wheel = %w.filename, error = %crate::error_chain(&e));
                false
            }
        });
        for w in new_wheels {
            wheels_kept.retain(|k| k.filename != w.filename);
            wheels_kept.push(w);
        }
        Ok(wheels_kept)
    }
}

/// The workspace an install's wheels are copied from; the request must name one.
fn locate_workspace(app: &App, req: &InstallRequest) -> Result<PathBuf, StoreError> {
    if req.workspace.key.is_none() && req.workspace.root.is_none() {
        return Err(wheels::WheelError::NoWorkspace.into());
    }
    let located =
        crate::workspace::locate(app, &req.workspace).map_err(|e| StoreError::Invalid(e.to_string()))?;
    Ok(located.root)
}

/// An environment carries at most [`wheels::MAX_WHEELS_PER_REVISION`] local wheels: those
/// the current revision carries and these (a new one replaces a kept one of its file name).
fn check_carried(
    id: &str,
    current: Option<&EnvironmentRevision>,
    wheel_paths: &[String],
) -> Result<(), StoreError> {
    let kept = current.and_then(|r| r.local_wheels.as_deref()).unwrap_or_default();
    let mut names = Vec::with_capacity(wheel_paths.len());
    for w in wheel_paths {
        names.push(wheels::parse_request(w)?.filename);
    }
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    if wheels::carried_after(kept, &names) > wheels::MAX_WHEELS_PER_REVISION {
        return Err(StoreError::Invalid(format!(
            "Environment {id} would carry more than {} local wheels; create a new environment for more",
            wheels::MAX_WHEELS_PER_REVISION
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_the_manager_does_not_use_is_refused() {
        let ch = vec!["conda-forge".to_owned()];
        type Case<'a> = (Manager, Option<&'a [String]>, Option<&'a str>, Option<&'a str>);
        let cases: &[Case] = &[
            (Manager::Conda, Some(&ch), None, None),
            (Manager::Pip, None, Some("https://x/simple"), None),
            (Manager::Pip, Some(&[]), None, None),
            (
                Manager::Conda,
                None,
                Some("https://x/simple"),
                Some("indexUrl is only supported for pip installs"),
            ),
            (
                Manager::Cran,
                None,
                Some("https://x/simple"),
                Some("indexUrl is only supported for pip installs"),
            ),
            (Manager::Pip, Some(&ch), None, Some("channels are only supported for conda installs")),
            (Manager::Cran, Some(&ch), None, Some("channels are only supported for conda installs")),
        ];
        for (manager, channels, index, want) in cases {
            let got = check_sources(*manager, *channels, *index).err().map(|e| e.to_string());
            assert_eq!(got.as_deref(), *want, "{manager:?} {channels:?} {index:?}");
        }
    }
}
