//! Where each request goes, and the forwarding itself. A workspace's requests go to the node
//! that holds it: the catalog's answer, else the nodes' own (`where` on each), else a new
//! placement ([`crate::placement`]) — unless a node that might hold it is not ready, when the
//! answer is 503 with `Retry-After` (or, past the lost-node grace, a restore from the object
//! store elsewhere, [`crate::recover`]). Requests are forwarded byte for byte: the body,
//! the headers and the signature the caller made, so that the node checks them again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, HOST, HeaderName, TRANSFER_ENCODING};
use hyper::{Request, Response};
use runnerd::api::error::ApiError;
use runnerd::auth::Gate;
use serde_json::{Value, json};

use crate::classify::{self, Creates, Target};
use crate::config::Config;
use crate::fleet::{Fleet, Node, Pool, Workspace};
use crate::metrics::Metrics;
use crate::node::{Body, NodeClient, NodeError, full, streamed};
use crate::placement;
use crate::server::{Call, Received, error, json};

/// How long the router's own questions to a node may take.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// What a 503 of the router asks the caller to wait (seconds).
pub const RETRY_AFTER_S: u64 = 5;
/// Broadcasts served at once (the others wait): bounds what they hold to BROADCASTS × nodes
/// × 8 MiB, whatever callers send.
const BROADCASTS: usize = 4;
/// The most bytes of a node's error answer the router reads to learn its `code`.
const PEEK_LIMIT: usize = 64 << 10;

/// The router's state, shared by every request and background task.
#[derive(Debug)]
pub struct Router {
    pub config: Config,
    pub gate: Gate,
    pub fleet: Arc<Fleet>,
    pub client: NodeClient,
    pub metrics: Metrics,
    pub started: Instant,
    /// One placement at a time per workspace in this router, so that two first calls of a
    /// new workspace land on one node.
    placing: Mutex<HashMap<Workspace, Arc<tokio::sync::Mutex<()>>>>,
    /// One restore at a time per workspace.
    pub(crate) restoring: Mutex<HashMap<Workspace, Arc<tokio::sync::Mutex<()>>>>,
    /// Drains this router runs (their progress), by node URL.
    pub(crate) drains: Mutex<HashMap<String, crate::admin::DrainProgress>>,
    /// Broadcasts at once: each holds its body and every node's answer (up to 8 MiB each).
    broadcasts: tokio::sync::Semaphore,
    /// Itself, for the tasks a request starts (a drain).
    me: std::sync::OnceLock<std::sync::Weak<Router>>,
}

/// A 503 for a request whose node cannot be reached now.
pub fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
    let mut e = ApiError::with_status(503, code, message);
    e.retry_after = Some(RETRY_AFTER_S);
    e
}

/// Where a workspace's request goes.
#[derive(Debug)]
enum Resolved {
    Holder(String),
    New(Vec<String>),
    Unavailable(ApiError),
}

/// A node's answer, its error `code` read when it is an error the router acts on.
struct Answer {
    response: Response<Body>,
    status: u16,
    code: Option<String>,
    moved_to: Option<String>,
}

/// Keyed async locks (a map entry per key in use).
pub(crate) fn keyed(
    map: &Mutex<HashMap<Workspace, Arc<tokio::sync::Mutex<()>>>>,
    ws: &Workspace,
) -> Arc<tokio::sync::Mutex<()>> {
    let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
    if m.len() > 10_000 {
        m.retain(|_, lock| Arc::strong_count(lock) > 1);
    }
    m.entry(ws.clone()).or_default().clone()
}

/// Headers a proxy never passes on (RFC 9110 §7.6.1), plus `Host`, which names the node, and
/// `Expect` (the router answered the client's `100-continue` and holds the body).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "expect"
    ) || name == HOST
}

/// The node's response as the caller gets it: status, headers and body unchanged, streamed.
fn passthrough(response: Response<Incoming>) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(CONNECTION);
    parts.headers.remove(TRANSFER_ENCODING);
    Response::from_parts(parts, streamed(body))
}

impl Call {
    /// The body for one more try: a whole body as often as needed, a streamed one once.
    fn take_body(&mut self) -> Option<Body> {
        match std::mem::replace(&mut self.body, Received::Spent) {
            Received::Whole(bytes) => {
                self.body = Received::Whole(bytes.clone());
                Some(full(bytes))
            }
            Received::Stream(incoming) => Some(streamed(incoming)),
            Received::Spent => None,
        }
    }

    fn json_body(&self) -> Option<Value> {
        match &self.body {
            Received::Whole(b) if classify::needs_body(&self.method, &self.path) => {
                serde_json::from_slice(b).ok()
            }
            _ => None,
        }
    }

    /// The request as node `url` gets it.
    fn to_node(&self, url: &str, body: Body) -> Result<Request<Body>, NodeError> {
        let uri = match &self.query {
            Some(q) => format!("{url}{}?{q}", self.path),
            None => format!("{url}{}", self.path),
        };
        let mut req = Request::builder()
            .method(self.method.as_str())
            .uri(uri)
            .body(body)
            .map_err(|e| NodeError::Request { url: url.to_owned(), source: Box::new(e) })?;
        for (name, value) in &self.headers {
            if !hop_by_hop(name) {
                req.headers_mut().append(name.clone(), value.clone());
            }
        }
        Ok(req)
    }
}

impl Router {
    pub fn new(config: Config, gate: Gate, fleet: Arc<Fleet>, client: NodeClient) -> Router {
        Router {
            config,
            gate,
            fleet,
            client,
            metrics: Metrics::default(),
            started: Instant::now(),
            placing: Mutex::default(),
            restoring: Mutex::default(),
            drains: Mutex::default(),
            broadcasts: tokio::sync::Semaphore::new(BROADCASTS),
            me: std::sync::OnceLock::new(),
        }
    }

    /// The router in its `Arc`, for tasks that outlive a request.
    pub fn into_shared(self) -> Arc<Router> {
        let shared = Arc::new(self);
        let _ = shared.me.set(Arc::downgrade(&shared));
        shared
    }

    pub(crate) fn me(&self) -> Option<Arc<Router>> {
        self.me.get().and_then(std::sync::Weak::upgrade)
    }

    /// Answers one authorised call.
    pub async fn route(&self, mut call: Call) -> Response<Body> {
        let body = call.json_body();
        let target = classify::classify(
            &call.method,
            &call.path,
            call.query.as_deref(),
            body.as_ref(),
            &self.config.data_dir,
        );
        let started = Instant::now();
        let kind = target_kind(&target);
        let response = match target {
            Target::Own(own) => self.own(own).await,
            Target::Fleet(op) => crate::admin::fleet(self, op, &call, body.as_ref()).await,
            Target::Workspace { ws: None, pool, .. } => self.to_any(&mut call, pool).await,
            Target::Workspace { ws: Some(ws), pool, creates } => {
                self.to_workspace(&mut call, &ws, pool, creates, body.as_ref()).await
            }
            Target::Execution(id) => self.to_run(&mut call, &id, Run::Execution).await,
            Target::NpuJob(id) => self.to_run(&mut call, &id, Run::NpuJob).await,
            Target::Broadcast => self.broadcast(&mut call).await,
            Target::SkillPackage => self.skill_package(&mut call).await,
            Target::Refused(why) => error(&refusal(why)),
            Target::Any(pool) => self.to_any(&mut call, pool).await,
        };
        self.metrics.request(kind, response.status().as_u16(), started.elapsed());
        response
    }

    /// Sends the call to `url` and reads the error code of an answer the router acts on
    /// (409 `workspace_moved`, 503 `queue_full`); every other answer streams untouched.
    async fn send(&self, url: &str, call: &mut Call) -> Result<Answer, NodeError> {
        let Some(body) = call.take_body() else {
            return Err(NodeError::Connect {
                url: url.to_owned(),
                source: crate::node::BoxError::from("the upload was sent already"),
            });
        };
        let started = Instant::now();
        let response = match call.to_node(url, body) {
            Ok(req) => self.client.send(url, req).await,
            Err(e) => Err(e),
        };
        self.metrics.forwarded(started.elapsed());
        let response = match response {
            Ok(r) => r,
            Err(e) => {
                if e.retryable() {
                    self.fleet.polled(url, Err(e.to_string()));
                }
                return Err(e);
            }
        };
        let status = response.status().as_u16();
        if status != 409 && status != 503 {
            return Ok(Answer { response: passthrough(response), status, code: None, moved_to: None });
        }
        let (parts, incoming) = response.into_parts();
        let bytes =
            Limited::new(incoming, PEEK_LIMIT).collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let code = value["code"].as_str().map(str::to_owned);
        let moved_to = value["movedTo"].as_str().map(str::to_owned);
        let mut response = Response::from_parts(parts, full(Bytes::from(bytes.to_vec())));
        response.headers_mut().remove(TRANSFER_ENCODING);
        // The body is what was read (at most PEEK_LIMIT): its length is hyper's to state.
        response.headers_mut().remove(hyper::header::CONTENT_LENGTH);
        Ok(Answer { response, status, code, moved_to })
    }

    fn routable(&self, url: &str) -> bool {
        self.fleet.node(url).is_some_and(|n| n.routable())
    }

    fn pool_nodes(&self, pool: Pool) -> Vec<Node> {
        self.fleet.nodes().into_iter().filter(|n| n.member.pool == pool).collect()
    }

    async fn to_workspace(
        &self,
        call: &mut Call,
        ws: &Workspace,
        pool: Pool,
        creates: Creates,
        body: Option<&Value>,
    ) -> Response<Body> {
        let mut redirects = 0;
        loop {
            let answer = match self.resolve(ws, pool).await {
                Resolved::Unavailable(e) => return error(&e),
                Resolved::Holder(url) => match self.send(&url, call).await {
                    Ok(answer) => (url, answer),
                    Err(e) => {
                        return error(&unavailable(
                            "node_unavailable",
                            format!("{ws} is on node {url}, which did not answer ({e}); retry later"),
                        ));
                    }
                },
                Resolved::New(order) => match self.place(ws, &order, call).await {
                    Ok(answered) => answered,
                    Err(e) => return error(&e),
                },
            };
            let (url, answer) = answer;
            // The node says the workspace moved (a drain or a restore elsewhere): follow it
            // once when the body can be sent again and the new node is one of ours.
            if answer.status == 409 && answer.code.as_deref() == Some("workspace_moved") {
                let target = answer.moved_to.as_deref().and_then(crate::config::node_url);
                match target {
                    Some(to)
                        if redirects == 0 && self.routable(&to) && !matches!(call.body, Received::Spent) =>
                    {
                        tracing::info!(event = "workspace_followed", workspace = %ws, from = %url, to = %to);
                        self.fleet.hold(ws, &to);
                        redirects += 1;
                        continue;
                    }
                    _ => self.fleet.forget(ws),
                }
                // Not followed (a streamed upload, a second move): the contract's 409 means
                // something else on these routes, so the caller is asked to retry.
                return Self::moved_retry(answer.response).await;
            }
            if (200..300).contains(&answer.status) {
                if creates != Creates::Nothing || matches!(call.method.as_str(), "POST" | "PUT") {
                    self.fleet.hold(ws, &url);
                }
                return self.record(creates, &url, body, answer.response).await;
            }
            return answer.response;
        }
    }

    /// A node's `409 workspace_moved` as a `503` with `Retry-After` (the same body and code).
    async fn moved_retry(response: Response<Body>) -> Response<Body> {
        let (mut parts, body) = response.into_parts();
        let bytes = crate::node::collect(body, PEEK_LIMIT).await.unwrap_or_default();
        parts.status = hyper::StatusCode::SERVICE_UNAVAILABLE;
        parts.headers.insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from(1u64));
        parts.headers.remove(hyper::header::CONTENT_LENGTH);
        Response::from_parts(parts, full(bytes))
    }

    /// A new managed execution or NPU job is remembered with its node.
    async fn record(
        &self,
        creates: Creates,
        url: &str,
        body: Option<&Value>,
        response: Response<Body>,
    ) -> Response<Body> {
        match creates {
            Creates::Nothing => response,
            Creates::Execution => {
                if let Some(id) = body.and_then(|b| b["executionId"].as_str()) {
                    self.fleet.runs(id, url);
                }
                response
            }
            Creates::NpuJob => {
                let (parts, body) = response.into_parts();
                let bytes = match crate::node::collect(body, 4 << 20).await {
                    Ok(b) => b,
                    Err(_) => {
                        return error(&ApiError::with_status(
                            502,
                            "node_failed",
                            "The node's answer could not be read",
                        ));
                    }
                };
                let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                if let Some(id) = value["id"].as_str().or(value["jobId"].as_str()) {
                    self.fleet.runs_npu_job(id, url);
                }
                Response::from_parts(parts, full(bytes))
            }
        }
    }

    /// A new workspace: the placement order, trying the next node on `queue_full` or when one
    /// cannot be reached (the request never reached it).
    async fn place(
        &self,
        ws: &Workspace,
        order: &[String],
        call: &mut Call,
    ) -> Result<(String, Answer), ApiError> {
        let mut last = None;
        for url in order {
            self.fleet.place(ws, url);
            self.fleet.placed(url);
            match self.send(url, call).await {
                Ok(answer) if answer.status == 503 && answer.code.as_deref() == Some("queue_full") => {
                    self.fleet.full(url);
                    self.metrics.placement("spilled");
                    if matches!(call.body, Received::Spent) {
                        return Ok((url.clone(), answer));
                    }
                    last = Some(answer);
                }
                Ok(answer) => {
                    self.metrics.placement("placed");
                    tracing::info!(event = "workspace_placed", workspace = %ws, node = %url);
                    return Ok((url.clone(), answer));
                }
                Err(e) if e.retryable() => {
                    self.metrics.placement("unreachable");
                    tracing::warn!(event = "placement_unreachable", workspace = %ws, node = %url, error = %e);
                }
                Err(e) => {
                    return Err(ApiError::with_status(502, "node_failed", format!("node {url} failed: {e}")));
                }
            }
        }
        self.fleet.forget(ws);
        match last {
            Some(answer) => Ok((order.last().cloned().unwrap_or_default(), answer)),
            None => {
                Err(unavailable("no_nodes", "No node of the pool can take a new workspace now; retry later"))
            }
        }
    }

    /// Where `ws` is: see the module documentation.
    async fn resolve(&self, ws: &Workspace, pool: Pool) -> Resolved {
        let settled = |held: &Option<crate::fleet::Held>| {
            held.as_ref().filter(|h| h.confirmed && self.routable(&h.url)).map(|h| h.url.clone())
        };
        if let Some(url) = settled(&self.fleet.held(ws)) {
            return Resolved::Holder(url);
        }
        let lock = keyed(&self.placing, ws);
        let _one = lock.lock().await;
        let held = self.fleet.held(ws);
        if let Some(url) = settled(&held) {
            return Resolved::Holder(url);
        }
        let found = self.locate(ws).await;
        if let Some(url) = found.holder {
            self.fleet.hold(ws, &url);
            return Resolved::Holder(url);
        }
        // Placed by this router and not made yet: still its place.
        if let Some(h) = held.as_ref().filter(|h| self.routable(&h.url)) {
            return Resolved::Holder(h.url.clone());
        }
        let known = held.map(|h| h.url);
        let now = Instant::now();
        let past = |urls: &[String]| crate::recover::past_grace(self, urls, now);
        let decision =
            crate::recover::decide(ws, known.as_deref(), &found.unknown, &found.absent, &found.store, past);
        match decision {
            crate::recover::Decision::New => {
                let order = placement::order(&ws.to_string(), &self.pool_nodes(pool), self.config.sample);
                match order.first() {
                    Some(first) => {
                        self.fleet.place(ws, first);
                        Resolved::New(order)
                    }
                    None => Resolved::Unavailable(unavailable(
                        "no_nodes",
                        format!("No {} node can take a new workspace now; retry later", pool.name()),
                    )),
                }
            }
            crate::recover::Decision::Wait(e) => Resolved::Unavailable(e),
            crate::recover::Decision::Restore { from } => {
                let from_pool =
                    from.as_deref().and_then(|u| self.fleet.node(u)).map_or(pool, |n| n.member.pool);
                crate::recover::start_restore(self, ws, from_pool);
                Resolved::Unavailable(unavailable(
                    "workspace_restoring",
                    format!(
                        "{ws} was on {}, which is lost: it is being restored from the object store on another node; retry shortly",
                        from.as_deref().unwrap_or("a node that is gone")
                    ),
                ))
            }
        }
    }

    /// Asks every routable node whether it holds `ws` (one of them also what the object store
    /// holds): the live copy with the highest epoch, else the node of a workspace it lies in;
    /// the nodes that said no; those that could not say.
    pub(crate) async fn locate(&self, ws: &Workspace) -> Located {
        let nodes = self.fleet.nodes();
        let routable: Vec<String> =
            nodes.iter().filter(|n| n.routable()).map(|n| n.member.url.clone()).collect();
        let mut unknown: Vec<String> =
            nodes.iter().filter(|n| !n.routable()).map(|n| n.member.url.clone()).collect();
        let answers = self.ask_where(ws, &routable, true).await;
        let mut store = crate::recover::StoreView::Unasked;
        let mut absent = Vec::new();
        let mut best: Option<((u64, bool), String)> = None;
        for (url, answer) in answers {
            match answer {
                Ok((200, v)) => {
                    if !v["store"].is_null() {
                        store = crate::recover::StoreView::from_json(&v["store"]);
                    }
                    if v["exists"] == json!(true) && v["fenced"] == json!(false) {
                        // Among equals, the copy with versions (a node that refused a new
                        // workspace's first call may keep its empty directory).
                        let rank = (v["epoch"].as_u64().unwrap_or(0), !v["head"].is_null());
                        if best.as_ref().is_none_or(|(r, _)| rank > *r) {
                            best = Some((rank, url));
                        }
                    } else {
                        absent.push(url);
                    }
                }
                Ok((400 | 404, _)) => absent.push(url),
                Ok(_) | Err(_) => unknown.push(url),
            }
        }
        let mut holder = best.map(|(_, u)| u);
        if holder.is_none() {
            for parent in ws.ancestors() {
                let answers = self.ask_where(&parent, &routable, false).await;
                // Only a workspace (with versions) holds another; a directory that only
                // groups keys (`team` of `team/w1`) does not.
                holder = answers.into_iter().find_map(|(url, a)| {
                    matches!(a, Ok((200, ref v)) if v["exists"] == json!(true) && v["fenced"] == json!(false)
                        && !v["head"].is_null())
                    .then_some(url)
                });
                if holder.is_some() {
                    break;
                }
            }
        }
        Located { holder, absent, unknown, store }
    }

    /// `where` for `ws` on each of `urls` at once (the first also asked for the store's head).
    async fn ask_where(
        &self,
        ws: &Workspace,
        urls: &[String],
        store: bool,
    ) -> Vec<(String, Result<(u16, Value), NodeError>)> {
        let asks = urls.iter().enumerate().map(|(i, url)| {
            let path = if store && i == 0 {
                format!("/workspace-transfer/where?{}&store=1", ws.query())
            } else {
                format!("/workspace-transfer/where?{}", ws.query())
            };
            async move { (url.clone(), self.client.json("GET", url, &path, None, ASK_TIMEOUT).await) }
        });
        futures::future::join_all(asks).await
    }

    /// A managed execution or NPU job: to the node that runs it.
    async fn to_run(&self, call: &mut Call, id: &str, run: Run) -> Response<Body> {
        let cached = match run {
            Run::Execution => self.fleet.execution(id),
            Run::NpuJob => self.fleet.npu_job(id),
        };
        let url = match cached {
            Some(url) => Some(url),
            None => self.find_run(call, run).await,
        };
        let Some(url) = url else {
            let unknown: Vec<String> =
                self.fleet.nodes().iter().filter(|n| !n.routable()).map(|n| n.member.name.clone()).collect();
            if !unknown.is_empty() {
                return error(&unavailable(
                    "node_unavailable",
                    format!(
                        "No ready node runs {id}; it may be on {} (not ready); retry later",
                        unknown.join(", ")
                    ),
                ));
            }
            // Nobody runs it: any node answers runnerd's own "not found".
            return self.to_any(call, run.pool()).await;
        };
        if !self.routable(&url) {
            return error(&unavailable(
                "node_unavailable",
                format!("{id} runs on node {url}, which is not ready; retry later"),
            ));
        }
        match self.send(&url, call).await {
            Ok(answer) => answer.response,
            Err(e) => error(&unavailable(
                "node_unavailable",
                format!("node {url} did not answer ({e}); retry later"),
            )),
        }
    }

    /// Asks the routable nodes which runs the call's execution or job (its `GET`, with the
    /// caller's query, which names the session).
    async fn find_run(&self, call: &Call, run: Run) -> Option<String> {
        let segments: Vec<&str> = call.path.split('/').collect();
        let base = match run {
            Run::Execution => segments.get(..3)?.join("/"),
            Run::NpuJob => segments.get(..4)?.join("/"),
        };
        let path = match &call.query {
            Some(q) => format!("{base}?{q}"),
            None => base,
        };
        let asks =
            self.fleet.nodes().into_iter().filter(Node::routable).map(|n| {
                let (client, path) = (&self.client, &path);
                async move {
                    (n.member.url.clone(), client.json("GET", &n.member.url, path, None, ASK_TIMEOUT).await)
                }
            });
        let found = futures::future::join_all(asks)
            .await
            .into_iter()
            .find_map(|(url, a)| matches!(a, Ok((200, _))).then_some(url))?;
        let id = |i: usize| runnerd::api::query::decode_path(segments.get(i).copied().unwrap_or_default());
        match run {
            Run::Execution => self.fleet.runs(&id(2), &found),
            Run::NpuJob => self.fleet.runs_npu_job(&id(3), &found),
        }
        Some(found)
    }

    /// To the least loaded routable node of `pool` (any routable node when the pool has none).
    async fn to_any(&self, call: &mut Call, pool: Pool) -> Response<Body> {
        let mut nodes: Vec<Node> = self.pool_nodes(pool).into_iter().filter(Node::routable).collect();
        if nodes.is_empty() {
            nodes = self.fleet.nodes().into_iter().filter(Node::routable).collect();
        }
        nodes.sort_by(|a, b| {
            placement::score(a.load.as_ref(), a.placed_since_poll)
                .total_cmp(&placement::score(b.load.as_ref(), b.placed_since_poll))
        });
        for node in &nodes {
            match self.send(&node.member.url, call).await {
                Ok(answer) => return answer.response,
                Err(e) if e.retryable() => continue,
                Err(e) => {
                    return error(&ApiError::with_status(
                        502,
                        "node_failed",
                        format!("node {} failed: {e}", node.member.url),
                    ));
                }
            }
        }
        error(&unavailable("no_nodes", "No runner node is ready; retry later"))
    }

    /// `GET /skill-packages/:id`: `{id, root}` only when every routable node has the package;
    /// else the answer of one that lacks it (`{id}`), so that the caller publishes it again
    /// (a broadcast, idempotent) and a node that missed it, or joined since, gets it.
    async fn skill_package(&self, call: &mut Call) -> Response<Body> {
        let nodes: Vec<Node> = self.fleet.nodes().into_iter().filter(Node::routable).collect();
        if nodes.is_empty() {
            return error(&unavailable("no_nodes", "No runner node is ready; retry later"));
        }
        let path = match &call.query {
            Some(q) => format!("{}?{q}", call.path),
            None => call.path.clone(),
        };
        let asks = nodes.iter().map(|n| {
            let (client, path) = (&self.client, &path);
            async move { client.json("GET", &n.member.url, path, None, ASK_TIMEOUT).await }
        });
        let answers = futures::future::join_all(asks).await;
        let lacking = answers.iter().find(|a| !matches!(a, Ok((200, v)) if v.get("root").is_some()));
        match lacking.or(answers.first()) {
            Some(Ok((status, v))) => json(*status, v),
            _ => error(&unavailable("node_unavailable", "A runner node did not answer; retry later")),
        }
    }

    /// A change every node must hold alike (a skill package, an environment): sent to every
    /// routable node; the caller gets their common answer, or 502 naming each when they differ.
    async fn broadcast(&self, call: &mut Call) -> Response<Body> {
        let Ok(_turn) = self.broadcasts.acquire().await else {
            return error(&unavailable("no_nodes", "The router is stopping; retry later"));
        };
        let nodes: Vec<Node> = self.fleet.nodes().into_iter().filter(Node::routable).collect();
        let missed: Vec<String> = self
            .fleet
            .nodes()
            .iter()
            .filter(|n| n.listed && !n.routable())
            .map(|n| n.member.name.clone())
            .collect();
        if nodes.is_empty() {
            return error(&unavailable("no_nodes", "No runner node is ready; retry later"));
        }
        let Received::Whole(bytes) = &call.body else {
            return error(&ApiError::bad_request("bad_request", "This route cannot be streamed"));
        };
        let bytes = bytes.clone();
        let sends = nodes.iter().map(|n| {
            let url = n.member.url.clone();
            let req = call.to_node(&url, full(bytes.clone()));
            async move {
                let sent = match req {
                    Ok(req) => self.client.send(&url, req).await,
                    Err(e) => Err(e),
                };
                let answer = match sent {
                    Ok(r) => {
                        let (parts, body) = r.into_parts();
                        match Limited::new(body, 8 << 20).collect().await {
                            Ok(c) => Ok((parts, c.to_bytes())),
                            Err(e) => Err(e.to_string()),
                        }
                    }
                    Err(e) => Err(e.to_string()),
                };
                (url, answer)
            }
        });
        let answers = futures::future::join_all(sends).await;
        let statuses: Vec<Option<u16>> =
            answers.iter().map(|(_, a)| a.as_ref().ok().map(|(p, _)| p.status.as_u16())).collect();
        if statuses.iter().all(|s| s.is_some() && *s == statuses[0]) {
            let (_, first) = answers.into_iter().next().expect("one node at least");
            let (mut parts, body) = first.expect("checked above");
            parts.headers.remove(TRANSFER_ENCODING);
            if !missed.is_empty() {
                tracing::warn!(event = "broadcast_missed", path = %call.path, nodes = %missed.join(","),
                    remedy = "repeat the request when those nodes are ready");
                if let Ok(v) = hyper::header::HeaderValue::from_str(&missed.join(",")) {
                    parts.headers.insert("x-runner-fleet-missed", v);
                }
            }
            return Response::from_parts(parts, full(body));
        }
        let detail: Vec<Value> = answers
            .iter()
            .map(|(url, a)| match a {
                Ok((p, b)) => json!({"node": url, "status": p.status.as_u16(),
                    "answer": serde_json::from_slice::<Value>(b).unwrap_or_else(|_| json!(String::from_utf8_lossy(&b[..b.len().min(512)])))}),
                Err(e) => json!({"node": url, "error": e}),
            })
            .collect();
        let shown = Value::Array(detail.clone());
        tracing::warn!(event = "broadcast_disagreed", path = %call.path, answers = %shown);
        json(
            502,
            &json!({"error": "The runner nodes answered differently; see answers", "code": "fleet_disagrees", "answers": detail}),
        )
    }
}

/// What the nodes said of a workspace.
#[derive(Debug)]
pub(crate) struct Located {
    /// The node with its live copy (or the directory it lies in).
    pub holder: Option<String>,
    /// Routable nodes that said they do not hold it.
    pub absent: Vec<String>,
    /// Nodes that could not say (not routable, or no answer).
    pub unknown: Vec<String>,
    /// What the object store holds of it.
    pub store: crate::recover::StoreView,
}

/// The router's answer to a request it does not pass on.
fn refusal(why: classify::Refusal) -> ApiError {
    match why {
        classify::Refusal::NotFound => ApiError::not_found(),
        classify::Refusal::NodeInternal => ApiError::with_status(
            403,
            "node_internal",
            "This route is between runner nodes: a fleet moves workspaces with runnerctl fleet drain, and \
             restores them itself; call a node directly to use it",
        ),
        classify::Refusal::Environments => ApiError::bad_request(
            "fleet_unsupported",
            "Managed environments are made per node, with ids of their own, so a fleet cannot hold one \
             environment under one id: manage them on each node (runnerctl --url NODE env ...)",
        ),
    }
}

#[derive(Debug, Clone, Copy)]
enum Run {
    Execution,
    NpuJob,
}

impl Run {
    fn pool(self) -> Pool {
        match self {
            Run::Execution => Pool::Cpu,
            Run::NpuJob => Pool::Ascend,
        }
    }
}

fn target_kind(t: &Target) -> &'static str {
    match t {
        Target::Own(_) => "own",
        Target::Fleet(_) => "fleet",
        Target::Workspace { .. } => "workspace",
        Target::Execution(_) => "execution",
        Target::NpuJob(_) => "npu_job",
        Target::Broadcast => "broadcast",
        Target::SkillPackage => "skill_package",
        Target::Refused(_) => "refused",
        Target::Any(_) => "any",
    }
}
