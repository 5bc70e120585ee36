//! The router's own routes for operators (`runnerctl fleet …`): the nodes as the router sees
//! them, and drain. A drain marks the node draining *on the node* (so every router replica
//! stops placing there), then moves each of its workspaces to another node of its pool by
//! object hash (issue #34's push: the target gets only what it lacks, the source is fenced
//! and answers 409 `movedTo`, which the routers follow). Run it again to resume: it is
//! idempotent, and the node's list is what is left.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper::Response;
use runnerd::api::error::ApiError;
use serde_json::{Value, json};

use crate::classify::FleetOp;
use crate::fleet::{Node, Workspace};
use crate::node::Body;
use crate::placement;
use crate::route::{ASK_TIMEOUT, Router};
use crate::server::{Call, error, json};

/// How long one workspace's move may take.
const PUSH_TIMEOUT: Duration = Duration::from_secs(1800);
/// The most move failures a drain keeps to show.
const ERRORS_KEPT: usize = 20;
/// The most pages of a node's list a progress answer counts.
const COUNT_PAGES: usize = 20;

/// A drain this router runs.
#[derive(Debug, Clone, Default)]
pub struct DrainProgress {
    pub moved: u64,
    pub failed: u64,
    pub current: Option<String>,
    pub done: bool,
    pub errors: Vec<String>,
    pub stop: Arc<AtomicBool>,
}

impl DrainProgress {
    fn to_json(&self) -> Value {
        json!({"moved": self.moved, "failed": self.failed, "current": self.current, "done": self.done,
               "errors": self.errors})
    }
}

fn named(body: Option<&Value>, call: &Call) -> Option<String> {
    body.and_then(|b| b["node"].as_str().map(str::to_owned))
        .or_else(|| runnerd::api::query::get(call.query.as_deref(), "node"))
}

fn unknown_node(name: &str) -> ApiError {
    ApiError::with_status(404, "unknown_node", format!("No node named {name:?}; see GET /fleet/nodes"))
}

/// `GET /fleet/nodes`, `GET /fleet/drain?node=`, `POST /fleet/drain|undrain {"node"}`.
pub async fn fleet(router: &Router, op: FleetOp, call: &Call, body: Option<&Value>) -> Response<Body> {
    if op == FleetOp::List {
        return json(200, &list(router));
    }
    let Some(name) = named(body, call) else {
        return error(&ApiError::bad_request("node_required", "Name the node: {\"node\": NAME or URL}"));
    };
    let Some(node) = router.fleet.find(&name) else { return error(&unknown_node(&name)) };
    match op {
        FleetOp::List => unreachable_list(),
        FleetOp::Progress => json(200, &progress(router, &node).await),
        FleetOp::Drain | FleetOp::Undrain => {
            let draining = op == FleetOp::Drain;
            let flag = json!({"draining": draining});
            match router
                .client
                .json("POST", &node.member.url, "/workspace-transfer/draining", Some(&flag), ASK_TIMEOUT)
                .await
            {
                Ok((200, _)) => {}
                Ok((status, v)) => {
                    return error(&ApiError::with_status(
                        502,
                        "node_refused",
                        format!("node {} answered {status}: {v}", node.member.url),
                    ));
                }
                Err(e) => return error(&crate::route::unavailable("node_unavailable", e.to_string())),
            }
            tracing::warn!(event = if draining { "node_drain" } else { "node_undrain" }, node = %node.member.url);
            if draining {
                start_drain(router, &node);
            } else if let Some(p) =
                router.drains.lock().unwrap_or_else(|p| p.into_inner()).get(&node.member.url)
            {
                p.stop.store(true, Ordering::Relaxed);
            }
            // The node's flag shows in its next load poll; show it now.
            if let Some(mut load) = node.load.clone() {
                load.draining = draining;
                router.fleet.polled(&node.member.url, Ok(load));
            }
            let node = router.fleet.node(&node.member.url).unwrap_or(node);
            json(if draining { 202 } else { 200 }, &progress(router, &node).await)
        }
    }
}

fn unreachable_list() -> Response<Body> {
    error(&ApiError::not_found())
}

fn list(router: &Router) -> Value {
    let now = std::time::Instant::now();
    let drains = router.drains.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let nodes: Vec<Value> = router
        .fleet
        .nodes()
        .iter()
        .map(|n| {
            let mut v = n.to_json(now);
            v["drain"] = drains.get(&n.member.url).map_or(Value::Null, DrainProgress::to_json);
            v
        })
        .collect();
    let (workspaces, executions, npu_jobs) = router.fleet.catalog_sizes();
    json!({
        "nodes": nodes,
        "membership": crate::discovery::describe(&router.config.membership),
        "catalog": {"workspaces": workspaces, "executions": executions, "npuJobs": npu_jobs},
    })
}

/// The node's own list of what it still holds live (counted over a few pages), and this
/// router's drain of it.
async fn progress(router: &Router, node: &Node) -> Value {
    let mut remaining = 0u64;
    let mut complete = true;
    let mut after: Option<String> = None;
    for page in 0.. {
        if page == COUNT_PAGES {
            complete = false;
            break;
        }
        let path = match &after {
            Some(a) => format!("/workspace-transfer/list?after={}", crate::classify::query_escape(a)),
            None => "/workspace-transfer/list".to_owned(),
        };
        match router.client.json("GET", &node.member.url, &path, None, ASK_TIMEOUT).await {
            Ok((200, v)) => {
                remaining += v["workspaces"].as_array().map_or(0, |a| a.len() as u64);
                match v["next"].as_str() {
                    Some(next) => after = Some(next.to_owned()),
                    None => break,
                }
            }
            _ => {
                complete = false;
                break;
            }
        }
    }
    let drain = router.drains.lock().unwrap_or_else(|p| p.into_inner()).get(&node.member.url).cloned();
    json!({
        "node": node.member.name,
        "url": node.member.url,
        "draining": node.load.as_ref().is_some_and(|l| l.draining),
        "remaining": remaining,
        "remainingComplete": complete,
        "drain": drain.as_ref().map(DrainProgress::to_json),
    })
}

fn start_drain(router: &Router, node: &Node) {
    let mut drains = router.drains.lock().unwrap_or_else(|p| p.into_inner());
    if drains.get(&node.member.url).is_some_and(|p| !p.done) {
        return;
    }
    let progress = DrainProgress::default();
    drains.insert(node.member.url.clone(), progress);
    drop(drains);
    let Some(router) = router.me() else { return };
    let node = node.clone();
    tokio::spawn(async move { drain(router, node).await });
}

fn update(router: &Router, url: &str, f: impl FnOnce(&mut DrainProgress)) {
    if let Some(p) = router.drains.lock().unwrap_or_else(|p| p.into_inner()).get_mut(url) {
        f(p);
    }
}

/// The workspaces `url` holds live, every page of its list.
async fn held_live(router: &Router, url: &str) -> Result<Vec<Workspace>, String> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(a) => format!("/workspace-transfer/list?after={}", crate::classify::query_escape(a)),
            None => "/workspace-transfer/list".to_owned(),
        };
        let page = match router.client.json("GET", url, &path, None, ASK_TIMEOUT).await {
            Ok((200, v)) => v,
            other => return Err(format!("the node's list could not be read: {other:?}")),
        };
        out.extend(page["workspaces"].as_array().into_iter().flatten().filter_map(Workspace::from_json));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return Ok(out),
        }
    }
}

/// The most passes a drain makes (a parent moves only after the workspaces inside it).
const PASSES: usize = 3;

/// Moves every live workspace of `node` to another node of its pool: nested workspaces
/// before the ones they lie in, and a whole tree to one node; passes again while a pass moved
/// something and something is left.
async fn drain(router: Arc<Router>, node: Node) {
    let url = node.member.url.clone();
    let stop = router.drains.lock().unwrap_or_else(|p| p.into_inner()).get(&url).map(|p| p.stop.clone());
    let stopped = || stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed));
    'passes: for _ in 0..PASSES {
        let mut list = match held_live(&router, &url).await {
            Ok(list) => list,
            Err(why) => {
                update(&router, &url, |p| p.errors.push(why));
                break;
            }
        };
        if list.is_empty() {
            break;
        }
        // Innermost first: `a/b` before `a`.
        list.sort_by(|a, b| b.cmp(a));
        let mut moved_this_pass = 0;
        for ws in list {
            if stopped() {
                break 'passes;
            }
            update(&router, &url, |p| p.current = Some(ws.to_string()));
            match move_one(&router, &node, &ws).await {
                Ok(to) => {
                    router.fleet.hold(&ws, &to);
                    router.metrics.moved("moved");
                    moved_this_pass += 1;
                    update(&router, &url, |p| p.moved += 1);
                }
                Err(why) => {
                    router.metrics.moved("failed");
                    tracing::warn!(event = "drain_move_failed", node = %url, workspace = %ws, error = %why);
                    update(&router, &url, |p| {
                        p.failed += 1;
                        if p.errors.len() < ERRORS_KEPT {
                            p.errors.push(format!("{ws}: {why}"));
                        }
                    });
                }
            }
        }
        if moved_this_pass == 0 {
            break;
        }
    }
    update(&router, &url, |p| {
        p.done = true;
        p.current = None;
    });
    tracing::warn!(event = "node_drain_done", node = %url);
}

/// The outermost workspace name of `ws` (`a` of `a/b/c`): a tree moves to one node.
fn tree(ws: &Workspace) -> String {
    ws.ancestors().last().unwrap_or(ws).to_string()
}

/// One workspace from `node` to the best other placeable node of its pool.
async fn move_one(router: &Router, node: &Node, ws: &Workspace) -> Result<String, String> {
    let others: Vec<Node> = router
        .fleet
        .nodes()
        .into_iter()
        .filter(|n| n.member.pool == node.member.pool && n.member.url != node.member.url)
        .collect();
    // By the tree's hash alone: every workspace of one tree, and every router, picks the same.
    let to = placement::restore_target(&tree(ws), &others)
        .ok_or_else(|| format!("no other {} node can take it", node.member.pool.name()))?;
    let mut body = ws.to_json();
    body["to"] = json!(to);
    match router
        .client
        .json("POST", &node.member.url, "/workspace-transfer/push", Some(&body), PUSH_TIMEOUT)
        .await
    {
        Ok((200, _)) => Ok(to),
        Ok((status, v)) => {
            Err(format!("{status}: {}", v["error"].as_str().map_or_else(|| v.to_string(), str::to_owned)))
        }
        Err(e) => Err(e.to_string()),
    }
}
