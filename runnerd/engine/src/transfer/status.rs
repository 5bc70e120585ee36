//! `where`: what this node knows of one workspace — its head, its epoch, whether it is fenced
//! and where it went, what the object store holds of it, and a move in flight.

use serde_json::{Value, json};

use super::receive::existing_workspace;
use super::{Ident, TransferFailed};
use crate::app::App;

/// The answer of `GET /workspace-transfer/where`.
pub fn where_is(app: &App, ident: &Ident) -> Result<Value, TransferFailed> {
    let (canonical, _pinned) = match existing_workspace(app, ident) {
        Ok(found) => found,
        Err(e) if e.code() == crate::code::ErrorCode::PathNotFound => {
            return Ok(json!({"ident": ident.to_json(), "exists": false}));
        }
        Err(e) => return Err(e.into()),
    };
    let head = app.versions.head(&canonical)?;
    let tree = app.versions.head_tree(&canonical).ok().flatten();
    let placed = app.versions.placement().get(&canonical)?;
    let iso = |ms: Option<u64>| ms.map(crate::timefmt::iso8601);
    let (epoch, moved_to, fenced_at, removed_at, replicated) = match &placed {
        Some(p) => (
            p.epoch,
            p.moved_to.clone(),
            iso(p.fenced_at_ms),
            iso(p.removed_at_ms),
            p.replicated_head
                .as_ref()
                .map(|h| json!({"head": h, "epoch": p.replicated_epoch, "at": iso(p.replicated_at_ms)})),
        ),
        None => (0, None, None, None, None),
    };
    Ok(json!({
        "ident": ident.to_json(),
        "exists": true,
        "head": head,
        "tree": tree,
        "epoch": epoch,
        "fenced": moved_to.is_some(),
        "movedTo": moved_to,
        "fencedAt": fenced_at,
        "removedAt": removed_at,
        "replicated": replicated,
        "replicatedUpToDate": placed.as_ref().and_then(|p| p.replicated_head.as_ref()) == head.as_ref() && head.is_some(),
        "transfer": app.moves.get(&canonical).map(|p| p.to_json()),
    }))
}

/// The most workspaces one `list` answer names.
pub const LIST_LIMIT: usize = 1000;

/// `list`: the workspaces this node holds live (named, not fenced), in name order, at most
/// `limit` after the name `after` (their `query()` form), and the name to continue from.
/// What a drain moves away, page by page.
pub fn held(app: &App, after: Option<&str>, limit: usize) -> (Vec<Ident>, Option<String>) {
    let Ok(data_real) = std::fs::canonicalize(&app.data_dir) else { return (Vec::new(), None) };
    let mut named: Vec<(String, std::path::PathBuf, Ident)> = app
        .versions
        .lifecycle()
        .registered_roots()
        .into_iter()
        .filter_map(|canonical| {
            let ident = Ident::from_canonical(&data_real, &canonical)?;
            Some((ident.query(), canonical, ident))
        })
        .filter(|(name, _, _)| after.is_none_or(|a| name.as_str() > a))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let limit = limit.clamp(1, LIST_LIMIT);
    let mut out = Vec::new();
    let mut last = None;
    for (name, canonical, ident) in named {
        if out.len() == limit {
            return (out, last);
        }
        let live = canonical.is_dir()
            && app.versions.placement().get(&canonical).ok().flatten().is_none_or(|p| p.moved_to.is_none());
        last = Some(name);
        if live {
            out.push(ident);
        }
    }
    (out, None)
}
