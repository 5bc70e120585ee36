//! A node that stopped being ready, and the workspaces on it. Within the operator's grace
//! (`lost_grace_secs`) they answer 503 with `Retry-After`: the node may come back, and its
//! copy is the newest. Past it, each is restored from the object store on another node of its
//! pool — the same node in every router replica (rendezvous hashing), which raises the
//! workspace's epoch, so that the old copy is fenced if its node returns (issue #34). A
//! workspace the router has never seen is looked up in the store before it is made anew.

use std::sync::Arc;
use std::time::{Duration, Instant};

use runnerd::api::error::ApiError;
use serde_json::{Value, json};

use crate::fleet::{Node, Pool, Workspace};
use crate::placement;
use crate::route::{ASK_TIMEOUT, Router, keyed, unavailable};

/// How long a restore (fetching a whole workspace from the store) may take.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(600);
/// How often the lost nodes' known workspaces are looked at.
const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// How long the sweep leaves a workspace whose restore failed.
const RETRY_FAILED_AFTER: Duration = Duration::from_secs(60);

/// What the store says of a workspace no ready node holds.
#[derive(Debug)]
pub enum Unseen {
    /// The store has no head for it: a new workspace.
    New,
    /// It was restored from the store on this node.
    Restored(String),
}

/// Whether every node in `urls` has been down longer than the grace (`false` with no grace).
fn past_grace(router: &Router, urls: &[String], now: Instant) -> bool {
    let Some(grace) = router.config.lost_grace else { return false };
    urls.iter().all(|url| {
        router.fleet.node(url).is_none_or(|n| n.down_since.is_some_and(|t| now.duration_since(t) >= grace))
    })
}

/// `ws`'s holder `url` is not routable: restore it elsewhere when the grace has passed
/// (`Some(new node)`), else `None` (the caller answers 503).
pub async fn after_loss(router: &Router, ws: &Workspace, url: &str) -> Result<Option<String>, ApiError> {
    if !past_grace(router, &[url.to_owned()], Instant::now()) {
        return Ok(None);
    }
    let pool = router.fleet.node(url).map_or(Pool::Cpu, |n| n.member.pool);
    restore(router, ws, pool).await.map(Some)
}

/// `ws` is on no routable node, and the nodes in `unknown` could not say: the store decides.
pub async fn unseen(router: &Router, ws: &Workspace, unknown: &[String]) -> Result<Unseen, ApiError> {
    let names = unknown.join(", ");
    let asked = router.fleet.nodes().into_iter().find(Node::routable);
    let Some(asked) = asked else {
        return Err(unavailable("no_nodes", "No runner node is ready; retry later"));
    };
    let path = format!("/workspace-transfer/where?{}&store=1", ws.query());
    let store = match router.client.json("GET", &asked.member.url, &path, None, ASK_TIMEOUT).await {
        Ok((200, v)) => v["store"].clone(),
        Ok((status, v)) => {
            return Err(unavailable(
                "node_unavailable",
                format!("node {} answered {status}: {v}", asked.member.url),
            ));
        }
        Err(e) => return Err(unavailable("node_unavailable", e.to_string())),
    };
    if store["enabled"] != json!(true) {
        // No store to ask: past the grace the silent nodes count as lost, and the workspace
        // as new (if one of them returns holding it, that copy is the older: see the note on
        // SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS).
        if past_grace(router, unknown, Instant::now()) {
            return Ok(Unseen::New);
        }
        return Err(unavailable(
            "workspace_unknown",
            format!(
                "{ws} is on no ready node, and node(s) {names} are not ready: without an object store the \
                 router cannot tell whether it exists there; retry later"
            ),
        ));
    }
    if let Some(e) = store["error"].as_str() {
        return Err(unavailable("store_unreachable", format!("the object store could not be read: {e}")));
    }
    if store["head"].is_null() {
        return Ok(Unseen::New);
    }
    if !past_grace(router, unknown, Instant::now()) {
        let last = store["head"]["node"].as_str().unwrap_or("another node");
        return Err(unavailable(
            "node_unavailable",
            format!("{ws} was last on {last}, and node(s) {names} are not ready; retry later"),
        ));
    }
    let pool = unknown.first().and_then(|u| router.fleet.node(u)).map_or(Pool::Cpu, |n| n.member.pool);
    restore(router, ws, pool).await.map(Unseen::Restored)
}

/// Restores `ws` from the store on the node every replica picks for it; answers that node.
pub async fn restore(router: &Router, ws: &Workspace, pool: Pool) -> Result<String, ApiError> {
    let lock = keyed(&router.restoring, ws);
    let _one = lock.lock().await;
    if let Some(url) = router.fleet.holder(ws).filter(|u| router.fleet.node(u).is_some_and(|n| n.routable()))
    {
        return Ok(url);
    }
    let nodes: Vec<Node> = router.fleet.nodes().into_iter().filter(|n| n.member.pool == pool).collect();
    let Some(target) = placement::restore_target(&ws.to_string(), &nodes) else {
        return Err(unavailable(
            "no_nodes",
            format!("No {} node is ready to restore {ws} on; retry later", pool.name()),
        ));
    };
    // Another replica may have restored it there already.
    let path = format!("/workspace-transfer/where?{}", ws.query());
    if let Ok((200, v)) = router.client.json("GET", &target, &path, None, ASK_TIMEOUT).await
        && v["exists"] == json!(true)
        && v["fenced"] == json!(false)
        && v["epoch"].as_u64().unwrap_or(0) > 0
    {
        router.fleet.hold(ws, &target);
        return Ok(target);
    }
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
            tracing::warn!(event = "workspace_restore_failed", workspace = %ws, to = %target, status, error = %why);
            Err(unavailable("restore_failed", format!("{ws} could not be restored on {target}: {why}")))
        }
        Err(e) => {
            router.metrics.restore("failed");
            Err(unavailable("restore_failed", format!("{ws} could not be restored on {target}: {e}")))
        }
    }
}

/// Restores, past the grace, the workspaces the catalog places on lost nodes (those it has
/// not seen are restored when first called).
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
                        // Kept in the catalog (its calls answer 503, never a new workspace);
                        // tried again after a pause, or at its next call.
                        retry_at.insert(ws.clone(), now + RETRY_FAILED_AFTER);
                        tracing::warn!(event = "lost_workspace_not_restored", workspace = %ws, node = %node.member.url,
                            error = %e.message, retry_in_secs = RETRY_FAILED_AFTER.as_secs());
                    }
                }
            }
        }
    }
}
