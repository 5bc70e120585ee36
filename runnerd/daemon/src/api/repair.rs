//! `POST /remote-workspace/repair` (ours, beyond the contract): the operator's repair of a
//! workspace a storage failure poisoned. Signed like the execution routes (the body names
//! the workspace, so the signature covers it; a `repairId` makes each body unique, as the
//! replay check needs). The work is [`crate::writer::Versions::repair`]; `runnerctl repair`
//! calls this route.

use std::sync::Arc;

use serde_json::{Value, json};

use super::ApiResponse;
use super::error::ApiError;
use super::request;
use crate::app::App;
use crate::isolation::prestart::{Discard, Scope};
use crate::workspace;

pub const KEY_REQUIRED: &str = "workspace is required";

/// Resolves the workspace as every `/remote-workspace` route does, then repairs it.
pub async fn repair(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let key = match obj.get("workspace") {
        Some(Value::String(k)) if !k.trim().is_empty() => k.trim().to_owned(),
        _ => return Err(ApiError::bad_request("workspace_required", KEY_REQUIRED)),
    };
    let root = workspace::ensure_remote_workspace(&app.data_dir, &key, &app.sandbox.user)?;
    let root = workspace::validated_workspace(&app.data_dir, &root)?;
    let pinned = workspace::open_beneath(&app.data_dir, &root)?;
    tracing::warn!(event = "workspace_repair_requested", workspace = %root.display(), key = %key);
    let repaired = app.versions.repair(&root, pinned).await.map_err(ApiError::from_write);
    // After the repair held the workspace: a sandbox started by a call that ended meanwhile
    // goes too.
    app.sandbox.forget(Scope::Beneath(&root), Discard::Workspace);
    let repaired = repaired?;
    let previous = repaired.previous.as_ref().map(|(head, verified)| {
        let verified = match verified {
            Ok(objects) => json!({"ok": true, "objects": objects}),
            Err(error) => json!({"ok": false, "error": error}),
        };
        json!({"head": head.to_value(), "verified": verified})
    });
    let answer = json!({
        "workspace": key,
        "repaired": true,
        "head": repaired.head.to_value(),
        "previous": previous,
        "markerCleared": repaired.cleared,
    });
    Ok(ApiResponse::json(200, answer.to_string()))
}
