//! The scientific-environment routes (contract §2, §5.2): the catalog, setup, revisions and
//! snapshots, and the changes. Every store failure answers 400 with the store's text, as the
//! original's handler does; a missing environment or revision is a 400 too (the original
//! throws), with our `code` telling them apart.

use serde_json::{Value, json};

use super::error::ApiError;
use super::request;
use super::{ApiResponse, ok};
use crate::app::App;
use crate::envs::ids::Manager;
use crate::envs::store::{InstallRequest, StoreError};
use crate::sandbox::Language;

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        let code = match &e {
            StoreError::Unavailable(_) => "environments_unavailable",
            StoreError::Invalid(_) | StoreError::Ids(_) | StoreError::Wheel(_) => "invalid_request",
            StoreError::NotFound(_) | StoreError::UnknownRevision(_) => "environment_not_found",
            StoreError::Snapshot(_) => "snapshot_corrupt",
            StoreError::Step { .. } => "provisioning_failed",
            StoreError::Sandboxed(_) => "provisioning_unavailable",
            StoreError::Catalog(_) | StoreError::Io { .. } => "internal",
        };
        ApiError::bad_request(code, crate::error_chain(&e))
    }
}

/// The audit record of an environment change request (R-OPS-2): who asked, what, and how it
/// ended (the new revision, or the error).
fn audit<T>(
    peer: &str,
    action: &'static str,
    environment: &str,
    what: &str,
    outcome: &Result<T, StoreError>,
    revision: impl Fn(&T) -> String,
) {
    match outcome {
        Ok(done) => {
            tracing::info!(event = "environment_change", action, peer, environment, packages = what, revision = %revision(done))
        }
        Err(e) => {
            tracing::warn!(event = "environment_change_refused", action, peer, environment, packages = what, error = %crate::error_chain(e))
        }
    }
}

fn created(body: Value) -> Result<ApiResponse, ApiError> {
    Ok(ApiResponse::json(201, body.to_string()))
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// An array of strings, or the field's error.
fn strings(obj: &request::Object, field: &str) -> Result<Option<Vec<String>>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect::<Option<Vec<String>>>()
            .map(Some)
            .ok_or_else(|| {
                ApiError::bad_request("invalid_request", format!("{field} must be an array of strings"))
            }),
        Some(_) => {
            Err(ApiError::bad_request("invalid_request", format!("{field} must be an array of strings")))
        }
    }
}

pub(crate) async fn list(app: &App) -> Result<ApiResponse, ApiError> {
    ok(to_value(&app.envs.list().await?))
}

pub(crate) async fn revisions(app: &App) -> Result<ApiResponse, ApiError> {
    ok(to_value(&app.envs.revisions().await?))
}

pub(crate) fn setup(app: &App) -> Result<ApiResponse, ApiError> {
    ok(app.envs.setup_view())
}

/// `POST /environment-setup`: `{confirmed: true}` starts (or retries) setup; 202.
pub(crate) fn start_setup(
    app: &std::sync::Arc<App>,
    peer: &str,
    body: &[u8],
) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    if obj.get("confirmed") != Some(&Value::Bool(true)) {
        return Err(ApiError::bad_request(
            "confirmation_required",
            "Scientific environment setup requires explicit confirmation",
        ));
    }
    if !app.envs.settings.enabled {
        return Err(ApiError::bad_request(
            "environments_unavailable",
            "Scientific environments are disabled by configuration",
        ));
    }
    let started = crate::envs::store::EnvStore::start_setup(app);
    tracing::info!(event = "environment_setup_requested", peer, started);
    Ok(ApiResponse::json(202, app.envs.setup_view().to_string()))
}

/// `GET /environment-revisions/:id/snapshot`: the stored bytes, re-verified.
pub(crate) async fn snapshot(app: &App, id: &str) -> Result<ApiResponse, ApiError> {
    let bytes = app.envs.snapshot(id).await?;
    let text = String::from_utf8(bytes).map_err(|_| {
        ApiError::bad_request("snapshot_corrupt", format!("Environment revision snapshot is corrupt: {id}"))
    })?;
    Ok(ApiResponse {
        status: 200,
        body: String::new(),
        download: Some(super::stream::Download::from_text(text, "application/json; charset=utf-8")),
    })
}

pub(crate) async fn create(app: &App, peer: &str, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let name = obj.get("name").and_then(Value::as_str).unwrap_or("");
    let language = match obj.get("language").and_then(Value::as_str) {
        Some("python") | None => Language::Python,
        Some("r") => Language::R,
        Some(other) => {
            return Err(ApiError::bad_request(
                "invalid_request",
                format!("Unsupported environment language: {other}"),
            ));
        }
    };
    let base = request::non_blank(&obj, "baseEnvironmentId");
    let env = app.envs.create(app, name, language, base).await;
    audit(peer, "create", base.unwrap_or("(starter)"), name, &env, |e| {
        format!("{} {}", e.id, e.current_revision_id)
    });
    created(to_value(&env?))
}

pub(crate) async fn install(app: &App, peer: &str, id: &str, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let packages = strings(&obj, "packages")?.unwrap_or_default();
    let manager = match obj.get("manager") {
        None | Some(Value::Null) => Manager::Conda,
        Some(Value::String(m)) => {
            Manager::parse(m).map_err(|e| ApiError::bad_request("invalid_request", e.to_string()))?
        }
        Some(_) => return Err(ApiError::bad_request("invalid_request", "manager must be a string")),
    };
    let index_url = request::non_blank(&obj, "indexUrl").map(str::to_owned);
    let req = InstallRequest {
        packages,
        channels: strings(&obj, "channels")?,
        manager,
        index_url,
        workspace: request::workspace_ref(&obj),
    };
    let what = format!("{}:{}", manager.as_str(), req.packages.join(","));
    let revision = app.envs.install(app, id, req).await;
    audit(peer, "install", id, &what, &revision, |r| r.id.clone());
    created(to_value(&revision?))
}

pub(crate) async fn uninstall(app: &App, peer: &str, id: &str, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let packages = strings(&obj, "packages")?.unwrap_or_default();
    let what = packages.join(",");
    let revision = app.envs.uninstall(app, id, packages).await;
    audit(peer, "uninstall", id, &what, &revision, |r| r.id.clone());
    created(to_value(&revision?))
}

pub(crate) async fn delete(app: &App, peer: &str, id: &str) -> Result<ApiResponse, ApiError> {
    let deleted = app.envs.delete(id).await;
    // Only a deletion that happened can have removed a prefix something waits with: a
    // refused one (unknown id, a starter…) must not discard every caller's waiting sandbox.
    if deleted.is_ok() {
        app.sandbox
            .forget(crate::isolation::prestart::Scope::All, crate::isolation::prestart::Discard::Environment);
    }
    audit(peer, "delete", id, "", &deleted, |_| String::new());
    ok(json!({"deleted": deleted?}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envs::ids::IdError;

    #[test]
    fn every_store_failure_is_a_400_with_its_own_code_and_the_stores_text() {
        let cases: Vec<(StoreError, &str, &str)> = vec![
            (
                StoreError::Unavailable("Scientific environments are disabled by configuration".into()),
                "environments_unavailable",
                "Scientific environments are disabled by configuration",
            ),
            (
                StoreError::Invalid("Starter environment x is read-only".into()),
                "invalid_request",
                "Starter environment x is read-only",
            ),
            (StoreError::NotFound("task-1".into()), "environment_not_found", "Environment not found: task-1"),
            (
                StoreError::UnknownRevision("rev-9".into()),
                "environment_not_found",
                "Unknown environment revision: rev-9",
            ),
            (StoreError::Ids(IdError::NoPackages), "invalid_request", "At least one package is required"),
            (
                StoreError::Step { label: "conda", detail: "Could not solve".into() },
                "provisioning_failed",
                "conda step failed: Could not solve",
            ),
        ];
        for (e, code, text) in cases {
            let api = ApiError::from(e);
            assert_eq!((api.status, api.code, api.message.as_str()), (400, code, text));
        }
    }
}
