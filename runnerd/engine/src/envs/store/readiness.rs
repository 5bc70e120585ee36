//! Setup in the background (the provisioner, then `starter-python`) and the views `/health`
//! and `/environment-setup` read from it.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::app::App;
use crate::envs::catalog::{self, Catalog, Status};
use crate::envs::ids::STARTER_PYTHON;
use crate::envs::setup;
use crate::sandbox::Language;

use super::{EnvStore, StoreError};

impl EnvStore {
    /// `/health.scientificEnvs`.
    pub fn health(&self) -> Value {
        let v = self.lock_view();
        v.setup.health(&self.settings, v.starter_python_ready)
    }

    /// `GET /environment-setup`.
    pub fn setup_view(&self) -> Value {
        self.lock_view().setup.view(&self.settings)
    }

    /// Whether executions may use environments now.
    pub fn available(&self) -> bool {
        let v = self.lock_view();
        self.settings.enabled && v.setup.state == setup::State::Ready && v.starter_python_ready
    }

    pub(super) fn require_available(&self) -> Result<(), StoreError> {
        let v = self.lock_view();
        if !self.settings.enabled {
            return Err(StoreError::Unavailable(
                "Scientific environments are disabled by configuration".into(),
            ));
        }
        if v.setup.state == setup::State::Ready && v.starter_python_ready {
            return Ok(());
        }
        Err(StoreError::Unavailable(v.setup.unavailable_reason()))
    }

    /// Starts setup in the background unless it is running or disabled; `false` then.
    pub fn start_setup(app: &Arc<App>) -> bool {
        let store = &app.envs;
        {
            let mut v = store.lock_view();
            // A ready store answers `ready` and changes nothing, as the original's.
            if !store.settings.enabled
                || v.running
                || (v.setup.state == setup::State::Ready && v.starter_python_ready)
            {
                return false;
            }
            v.running = true;
            v.setup.begin(crate::timefmt::now_iso());
        }
        let app = app.clone();
        tokio::spawn(async move {
            let store = &app.envs;
            let outcome = store.run_setup(&app).await;
            let mut v = store.lock_view();
            v.running = false;
            let now = crate::timefmt::now_iso();
            match outcome {
                Ok(detail) => {
                    v.starter_python_ready = true;
                    tracing::info!(event = "environment_setup_ready", detail = %detail);
                    v.setup.ready(now, detail);
                }
                Err(e) => {
                    let text = crate::error_chain(&e);
                    let action = setup::action(
                        e.kind(),
                        &store.settings,
                        &store.provisioner.to_string_lossy(),
                        &store.root.to_string_lossy(),
                    );
                    tracing::warn!(event = "environment_setup_failed", error = %text, action = %action);
                    v.setup.failed(now, text, action);
                }
            }
        });
        true
    }

    async fn run_setup(&self, app: &App) -> Result<String, StoreError> {
        let detail = check_provisioner(&self.provisioner, &app.sandbox.user)
            .map_err(|e| StoreError::Step { label: "provisioner", detail: e });
        let detail = match detail {
            Ok(d) => d,
            Err(e) => {
                // The provisioner phase fails: the view says so before the error is returned.
                return Err(e);
            }
        };
        self.lock_view().setup.provisioner_ready(detail);
        if starter_ready(&self.cat(), STARTER_PYTHON) {
            return Ok("starter-python is ready".into());
        }
        self.create_starter(app, Language::Python).await?;
        Ok("starter-python was created".into())
    }
}

pub(super) fn starter_ready(catalog: &Catalog, id: &str) -> bool {
    catalog.environment(id).is_some_and(|e| e.status == Status::Ready)
}

/// The provisioner is a regular file the sandbox user may execute.
fn check_provisioner(path: &Path, user: &crate::sandbox::user::Identity) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{} could not be read: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let mode = meta.mode();
    let bits = if user.uid == meta.uid() {
        mode >> 6
    } else if user.gid == meta.gid() {
        mode >> 3
    } else {
        mode
    };
    if bits & 0o1 == 0 {
        return Err(format!("{} is not executable by the sandbox user {}", path.display(), user.name));
    }
    Ok(format!("{} at {}", catalog::PROVISIONER, path.display()))
}
