//! A workspace no routable node holds. Either it is new, or it is on a node that is not ready
//! (or gone), or the object store has it. [`decide`] says which, from what the nodes and the
//! store answered (pure, table-tested): a workspace is made anew only when nothing says it
//! exists; one whose node is not ready waits (503, `Retry-After`) for the operator's grace
//! (`lost_grace_secs`); past it, it is restored from the store on another node of its pool —
//! the same node in every router replica (rendezvous hashing), in the background — which raises
//! its epoch, so the old copy is fenced if its node returns (issue #34).

use std::sync::Arc;
use std::time::{Duration, Instant};

use runnerd::api::error::ApiError;
use serde_json::{Value, json};

use crate::fleet::{Node, Pool, Workspace};
use crate::placement;
use crate::route::{Router, keyed, unavailable};

/// How long a restore (fetching a whole workspace from the store) may take.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(600);
/// How often the lost nodes' known workspaces are looked at.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// How long the sweep leaves a workspace whose restore failed.
const RETRY_FAILED_AFTER: Duration = Duration::from_secs(60);

/// What the object store holds of a workspace, as a node's `where?store=1` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreView {
    /// No routable node was asked.
    Unasked,
    /// The nodes replicate to no store.
    Disabled,
    NoHead,
    /// Its last head, written by this node.
    Head {
        node: String,
    },
    Error(String),
}

impl StoreView {
    pub fn from_json(v: &Value) -> StoreView {
        if v["enabled"] != json!(true) {
            return StoreView::Disabled;
        }
        if let Some(e) = v["error"].as_str() {
            return StoreView::Error(e.to_owned());
        }
        match v["head"]["node"].as_str() {
            Some(node) => {
                StoreView::Head { node: crate::config::node_url(node).unwrap_or_else(|| node.to_owned()) }
            }
            None if v["head"].is_null() => StoreView::NoHead,
            None => StoreView::Error(format!("an unexpected head document: {}", v["head"])),
        }
    }
}

/// What to do with a workspace no routable node holds.
#[derive(Debug)]
pub enum Decision {
    New,
    Wait(ApiError),
    /// Restore it from the store (it was last on `from`).
    Restore {
        from: Option<String>,
    },
}

/// See the module documentation. `known`: the node this router last knew it on (not
/// routable now); `absent`: routable nodes that said they do not hold it; `unknown`: nodes
/// that could not say; `past_grace`: whether every one of some nodes has been down past the
/// grace (a node not in the fleet at all counts as lost).
pub fn decide(
    ws: &Workspace,
    known: Option<&str>,
    unknown: &[String],
    absent: &[String],
    store: &StoreView,
    past_grace: impl Fn(&[String]) -> bool,
) -> Decision {
    let names = unknown.join(", ");
    match (store, known) {
        // Its last node is ready and says it is not there: it was deleted there.
        (StoreView::Head { node }, None) if absent.contains(node) => Decision::New,
        (StoreView::Head { node }, _) => {
            let from = known.map_or_else(|| node.clone(), str::to_owned);
            if past_grace(std::slice::from_ref(&from)) {
                Decision::Restore { from: Some(from) }
            } else {
                Decision::Wait(unavailable(
                    "node_unavailable",
                    format!("{ws} is on node {from}, which is not ready; retry later"),
                ))
            }
        }
        (_, Some(k)) => Decision::Wait(unavailable(
            "node_unavailable",
            format!(
                "{ws} is on node {k}, which is not ready (and the object store has no copy of it); retry later"
            ),
        )),
        (StoreView::NoHead, None) => Decision::New,
        (StoreView::Disabled | StoreView::Unasked, None) if unknown.is_empty() || past_grace(unknown) => {
            Decision::New
        }
        (StoreView::Disabled | StoreView::Unasked, None) => Decision::Wait(unavailable(
            "workspace_unknown",
            format!(
                "{ws} is on no ready node, and node(s) {names} are not ready: without an object store the router \
                 cannot tell whether it exists there; retry later"
            ),
        )),
        (StoreView::Error(_), None) if unknown.is_empty() => Decision::New,
        (StoreView::Error(e), None) => Decision::Wait(unavailable(
            "store_unreachable",
            format!(
                "{ws} is on no ready node, node(s) {names} are not ready, and the object store could not be read: {e}"
            ),
        )),
    }
}

/// Whether every node in `urls` has been down longer than the grace (never without a grace; a
/// node the fleet does not know at all counts as lost).
pub fn past_grace(router: &Router, urls: &[String], now: Instant) -> bool {
    let Some(grace) = router.config.lost_grace else { return false };
    urls.iter().all(|url| {
        router.fleet.node(url).is_none_or(|n| n.down_since.is_some_and(|t| now.duration_since(t) >= grace))
    })
}

/// Starts restoring `ws` in the background unless a restore of it is running.
pub fn start_restore(router: &Router, ws: &Workspace, pool: Pool) {
    let lock = keyed(&router.restoring, ws);
    if lock.try_lock().is_err() {
        return;
    }
    let Some(router) = router.me() else { return };
    let ws = ws.clone();
    tokio::spawn(async move {
        if let Err(e) = restore(&router, &ws, pool).await {
            tracing::warn!(event = "workspace_restore_failed", workspace = %ws, error = %e.message);
        }
    });
}

/// Restores `ws` from the store on the node every replica picks for it; answers that node.
/// A live copy a routable node holds wins over any restore.
pub async fn restore(router: &Router, ws: &Workspace, pool: Pool) -> Result<String, ApiError> {
    let lock = keyed(&router.restoring, ws);
    let _one = lock.lock().await;
    let found = router.locate(ws).await;
    if let Some(url) = found.holder {
        router.fleet.hold(ws, &url);
        return Ok(url);
    }
    let nodes: Vec<Node> = router.fleet.nodes().into_iter().filter(|n| n.member.pool == pool).collect();
    let Some(target) = placement::restore_target(&ws.to_string(), &nodes) else {
        return Err(unavailable(
            "no_nodes",
            format!("No {} node is ready to restore {ws} on; retry later", pool.name()),
        ));
    };
    let mut body = ws.to_json();
    body["fromStore"] = Value::Bool(true);
    tracing::warn!(event = "workspace_restoring", workspace = %ws, to = %target, reason = "its node is lost");
    match router
        .client
        .json("POST", &target, "/workspace-transfer/restore", Some(&body), RESTORE_TIMEOUT)
        .await
    {
        Ok((200, answer)) => {
            router.metrics.restore("restored");
            tracing::warn!(event = "workspace_restored", workspace = %ws, to = %target, answer = %answer);
            router.fleet.hold(ws, &target);
            Ok(target)
        }
        Ok((status, answer)) => {
            router.metrics.restore("failed");
            let why = answer["error"].as_str().map_or_else(|| answer.to_string(), str::to_owned);
            Err(unavailable(
                "restore_failed",
                format!("{ws} could not be restored on {target} ({status}): {why}"),
            ))
        }
        Err(e) => {
            router.metrics.restore("failed");
            Err(unavailable("restore_failed", format!("{ws} could not be restored on {target}: {e}")))
        }
    }
}

/// Restores, past the grace, the workspaces the catalog places on lost nodes (those it has
/// not seen are restored when first called). Only with a grace; a node that is merely slow
/// to answer this router is not lost while membership still calls it ready.
pub async fn watch_losses(router: Arc<Router>, mut stopping: tokio::sync::watch::Receiver<bool>) {
    if router.config.lost_grace.is_none() {
        return;
    }
    let mut retry_at: std::collections::HashMap<Workspace, Instant> = std::collections::HashMap::new();
    loop {
        retry_at.retain(|_, t| *t > Instant::now());
        tokio::select! {
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = stopping.changed() => return,
        }
        let now = Instant::now();
        for node in router.fleet.nodes() {
            if node.routable() || !past_grace(&router, std::slice::from_ref(&node.member.url), now) {
                continue;
            }
            for ws in router.fleet.held_by(&node.member.url) {
                if retry_at.get(&ws).is_some_and(|t| now < *t) {
                    continue;
                }
                match restore(&router, &ws, node.member.pool).await {
                    Ok(_) => {
                        retry_at.remove(&ws);
                    }
                    Err(e) => {
                        // Kept in the catalog (its calls answer 503, never a new workspace).
                        retry_at.insert(ws.clone(), now + RETRY_FAILED_AFTER);
                        tracing::warn!(event = "lost_workspace_not_restored", workspace = %ws, node = %node.member.url,
                            error = %e.message, retry_in_secs = RETRY_FAILED_AFTER.as_secs());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(d: &Decision) -> String {
        match d {
            Decision::New => "new".into(),
            Decision::Wait(e) => format!("wait {}", e.code),
            Decision::Restore { from } => format!("restore from {}", from.as_deref().unwrap_or("?")),
        }
    }

    #[test]
    fn a_workspace_is_new_only_when_nothing_says_it_exists() {
        let ws = Workspace::Remote("w".into());
        let (a, b) = ("http://a:1".to_owned(), "http://b:1".to_owned());
        let head_a = StoreView::Head { node: a.clone() };
        let none: Vec<String> = Vec::new();
        let down_a = vec![a.clone()];
        let both = vec![a.clone(), b.clone()];
        let only_a = vec![a.clone()];
        let only_b = vec![b.clone()];
        type Case<'a> = (Option<&'a str>, &'a [String], &'a [String], StoreView, bool, &'a str);
        let cases: Vec<Case> = vec![
            // Every node answered, none holds it.
            (None, &none, &both, StoreView::NoHead, false, "new"),
            (None, &none, &only_a, StoreView::Disabled, false, "new"),
            (None, &none, &only_a, StoreView::Error("x".into()), false, "new"),
            // The store's head names a node that is ready and says no: deleted there.
            (None, &none, &both, head_a.clone(), false, "new"),
            // The store's head names a node that is down: wait, then restore.
            (None, &down_a, &only_b, head_a.clone(), false, "wait node_unavailable"),
            (None, &down_a, &only_b, head_a.clone(), true, "restore from http://a:1"),
            // Known on a node that is down.
            (Some("http://a:1"), &down_a, &only_b, head_a.clone(), true, "restore from http://a:1"),
            (Some("http://a:1"), &down_a, &only_b, StoreView::NoHead, true, "wait node_unavailable"),
            (Some("http://a:1"), &down_a, &only_b, StoreView::Disabled, true, "wait node_unavailable"),
            // Not known, a node down, the store says nothing of it: new.
            (None, &down_a, &only_b, StoreView::NoHead, false, "new"),
            // No store: wait for the grace, then new.
            (None, &down_a, &only_b, StoreView::Disabled, false, "wait workspace_unknown"),
            (None, &down_a, &only_b, StoreView::Disabled, true, "new"),
            (None, &down_a, &only_b, StoreView::Error("x".into()), true, "wait store_unreachable"),
        ];
        for (known, unknown, absent, store, past, want) in cases {
            let d = decide(&ws, known, unknown, absent, &store, |_| past);
            assert_eq!(kind(&d), want, "{known:?} {unknown:?} {absent:?} {store:?} past={past}");
        }
    }

    #[test]
    fn store_views() {
        assert_eq!(StoreView::from_json(&json!({"enabled": false})), StoreView::Disabled);
        assert_eq!(StoreView::from_json(&json!({"enabled": true, "head": null})), StoreView::NoHead);
        assert_eq!(
            StoreView::from_json(&json!({"enabled": true, "head": {"node": "http://a:1/"}})),
            StoreView::Head { node: "http://a:1".into() }
        );
        assert!(matches!(
            StoreView::from_json(&json!({"enabled": true, "error": "down"})),
            StoreView::Error(_)
        ));
    }
}
