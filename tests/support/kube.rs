//! A stand-in Kubernetes API server for the router's membership tests (issue #35). The router
//! follows its pools' EndpointSlices with kube-rs's watcher; a real cluster (kind, k3s) is
//! neither in CI nor quick to start, so this serves, over plain HTTP on loopback, the routes
//! the watcher asks: the paginated LIST of `discovery.k8s.io/v1` EndpointSlices and the WATCH
//! that follows it, with label selectors, real increasing resourceVersions, a full event
//! history to resume from, bookmarks, and `410 Gone` after [`KubeStandIn::compact`].
//!
//! It keeps one slice per service holding every endpoint of that service, as the controller
//! does, so a change to one node is a `MODIFIED` of the whole slice. Tests drive it with sync
//! calls from any thread; it serves from a thread and runtime of its own, so it works from
//! plain tests and from `#[tokio::test]` alike. Never a mock of our own code.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, oneshot, watch};

/// The API group and version served.
pub const API_VERSION: &str = "discovery.k8s.io/v1";
/// The label the EndpointSlice controller puts on every slice: the service it belongs to.
pub const SERVICE_LABEL: &str = "kubernetes.io/service-name";
/// The longest a watch stays open, whatever `timeoutSeconds` asks (the real server's default
/// is 30-60 minutes; the watcher simply watches again from where it was).
pub const MAX_WATCH: Duration = Duration::from_secs(30);
/// How often an open watch sends a `BOOKMARK` when the client allows them.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(5);

/// A running stand-in API server for one namespace; stopped on drop.
#[derive(Debug)]
pub struct KubeStandIn {
    addr: SocketAddr,
    shared: Arc<Shared>,
    running: Mutex<Option<Running>>,
}

/// What the server tasks and the driving calls share.
#[derive(Debug)]
struct Shared {
    store: Mutex<Store>,
    /// The latest resourceVersion, for open watches to wake on.
    changed: watch::Sender<u64>,
    requests: Mutex<Vec<String>>,
}

/// The server thread, and how to stop it.
#[derive(Debug)]
struct Running {
    stop: oneshot::Sender<()>,
    thread: JoinHandle<()>,
}

/// The objects, as etcd would hold them: the current slices and every change ever made.
#[derive(Debug)]
struct Store {
    namespace: String,
    /// The resourceVersion of the latest change (0: none yet).
    rv: u64,
    /// Slices made so far, for uids and names.
    made: u64,
    /// By service.
    slices: BTreeMap<String, Slice>,
    history: Vec<Event>,
    /// Watches and continued LISTs from before this resourceVersion are answered `410 Gone`.
    compacted: u64,
}

#[derive(Debug, Clone)]
struct Slice {
    name: String,
    uid: String,
    service: String,
    port: u16,
    generation: u64,
    resource_version: u64,
    endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone)]
struct Endpoint {
    node: String,
    ip: String,
    ready: bool,
    serving: bool,
    terminating: bool,
}

/// One change: the object as it was right after it (as it was when deleted, for `DELETED`).
#[derive(Debug)]
struct Event {
    rv: u64,
    kind: &'static str,
    name: String,
    object: Value,
}

impl KubeStandIn {
    /// Serves an empty `namespace` on a free loopback port.
    pub fn start(namespace: &str) -> KubeStandIn {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the stand-in");
        let addr = listener.local_addr().unwrap();
        let store = Store {
            namespace: namespace.to_owned(),
            rv: 0,
            made: 0,
            slices: BTreeMap::new(),
            history: Vec::new(),
            compacted: 0,
        };
        let shared = Arc::new(Shared {
            store: Mutex::new(store),
            changed: watch::Sender::new(0),
            requests: Mutex::default(),
        });
        let running = serve(listener, shared.clone());
        KubeStandIn { addr, shared, running: Mutex::new(Some(running)) }
    }

    /// `http://127.0.0.1:<port>`, for `kube::Config::new`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn namespace(&self) -> String {
        self.shared.store.lock().unwrap().namespace.clone()
    }

    /// The resourceVersion of the latest change, as the server writes it.
    pub fn resource_version(&self) -> String {
        self.shared.store.lock().unwrap().rv.to_string()
    }

    /// Adds `node_name` at `ip:port` to `service`'s slice (made on first use: `ADDED`, else
    /// `MODIFIED`), or replaces its endpoint when it is there. Serving follows `ready`. All
    /// endpoints of a service share one port, as in one slice.
    pub fn add_node(&self, service: &str, node_name: &str, ip: &str, port: u16, ready: bool) {
        let endpoint = Endpoint {
            node: node_name.to_owned(),
            ip: ip.to_owned(),
            ready,
            serving: ready,
            terminating: false,
        };
        self.change(|store| {
            if !store.slices.contains_key(service) {
                store.made += 1;
                let made = store.made;
                let slice = Slice {
                    name: format!("{service}-{}", suffix(made)),
                    uid: format!("00000000-0000-4000-8000-{made:012x}"),
                    service: service.to_owned(),
                    port,
                    generation: 0,
                    resource_version: 0,
                    endpoints: vec![endpoint],
                };
                store.slices.insert(service.to_owned(), slice);
                return store.record("ADDED", service);
            }
            let slice = store.slices.get_mut(service).unwrap();
            assert_eq!(slice.port, port, "{service}: the stand-in keeps one port per service");
            match slice.endpoints.iter_mut().find(|e| e.node == node_name) {
                Some(e) => *e = endpoint,
                None => slice.endpoints.push(endpoint),
            }
            store.record("MODIFIED", service)
        });
    }

    /// Sets the endpoint's `ready` (and `serving`, which follows it until it terminates): a
    /// `MODIFIED`, unless nothing changed (the controller writes only changes).
    pub fn set_ready(&self, service: &str, node_name: &str, ready: bool) {
        self.change_endpoint(service, node_name, |e| {
            e.ready = ready && !e.terminating;
            if !e.terminating {
                e.serving = ready;
            }
        });
    }

    /// Marks the endpoint terminating (its pod is being deleted): not ready, `serving` as it
    /// was, `terminating: true`.
    pub fn set_terminating(&self, service: &str, node_name: &str) {
        self.change_endpoint(service, node_name, |e| {
            e.ready = false;
            e.terminating = true;
        });
    }

    /// Takes the endpoint out of its slice: a `MODIFIED`. The last one's removal leaves the
    /// slice empty (the controller keeps a placeholder); [`KubeStandIn::remove_service`]
    /// deletes it.
    pub fn remove_node(&self, service: &str, node_name: &str) {
        self.change(|store| {
            let slice = store.slices.get_mut(service).unwrap_or_else(|| panic!("no service {service}"));
            let before = slice.endpoints.len();
            slice.endpoints.retain(|e| e.node != node_name);
            assert!(slice.endpoints.len() < before, "{service} has no endpoint {node_name}");
            store.record("MODIFIED", service)
        });
    }

    /// Deletes `service`'s slice: a `DELETED`.
    pub fn remove_service(&self, service: &str) {
        self.change(|store| {
            let mut slice = store.slices.remove(service).unwrap_or_else(|| panic!("no service {service}"));
            store.rv += 1;
            slice.resource_version = store.rv;
            let event = Event {
                rv: store.rv,
                kind: "DELETED",
                name: slice.name.clone(),
                object: slice.object(&store.namespace),
            };
            store.history.push(event);
            Some(store.rv)
        });
    }

    /// Forgets the history up to now, as etcd's compaction does: a WATCH or a continued LIST
    /// from an older resourceVersion gets `410 Gone`, and the watcher must LIST again.
    pub fn compact(&self) {
        let mut store = self.shared.store.lock().unwrap();
        store.compacted = store.rv;
    }

    /// Each request received, in order: `<method> <path>[?<query>]`, the query as sent
    /// (see [`query_pairs`]).
    pub fn requests(&self) -> Vec<String> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Stops serving: open watches end, new connections are refused. The objects are kept.
    pub fn kill(&self) {
        if let Some(running) = self.running.lock().unwrap().take() {
            let _ = running.stop.send(());
            running.thread.join().expect("the stand-in's thread");
        }
    }

    /// Serves again on the same port, with the same objects and history (an API server
    /// restarted on the same etcd). Does nothing while serving.
    pub fn revive(&self) {
        let mut running = self.running.lock().unwrap();
        if running.is_none() {
            let listener = TcpListener::bind(self.addr).expect("the stand-in's port again");
            *running = Some(serve(listener, self.shared.clone()));
        }
    }

    fn change_endpoint(&self, service: &str, node_name: &str, edit: impl FnOnce(&mut Endpoint)) {
        self.change(|store| {
            let slice = store.slices.get_mut(service).unwrap_or_else(|| panic!("no service {service}"));
            let endpoint = slice
                .endpoints
                .iter_mut()
                .find(|e| e.node == node_name)
                .unwrap_or_else(|| panic!("{service} has no endpoint {node_name}"));
            let before = endpoint.clone();
            edit(endpoint);
            let same = (before.ready, before.serving, before.terminating)
                == (endpoint.ready, endpoint.serving, endpoint.terminating);
            if same { None } else { store.record("MODIFIED", service) }
        });
    }

    /// Applies `edit`, then wakes open watches when it made a change (its resourceVersion).
    fn change(&self, edit: impl FnOnce(&mut Store) -> Option<u64>) {
        let rv = edit(&mut self.shared.store.lock().unwrap());
        if let Some(rv) = rv {
            self.shared.changed.send_replace(rv);
        }
    }
}

impl Drop for KubeStandIn {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Five characters after the service's name, as the controller names its slices.
fn suffix(n: u64) -> String {
    let mut n = n.wrapping_mul(2_654_435_761) % 36u64.pow(5);
    (0..5)
        .map(|_| {
            let c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(n % 36) as usize];
            n /= 36;
            c as char
        })
        .collect()
}

impl Slice {
    fn object(&self, namespace: &str) -> Value {
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|e| {
                json!({
                    "addresses": [e.ip],
                    "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
                    "nodeName": e.node,
                    "targetRef": {"kind": "Pod", "namespace": namespace, "name": e.node},
                })
            })
            .collect();
        json!({
            "apiVersion": API_VERSION,
            "kind": "EndpointSlice",
            "metadata": {
                "name": self.name,
                "namespace": namespace,
                "uid": self.uid,
                "resourceVersion": self.resource_version.to_string(),
                "generation": self.generation,
                "labels": {
                    SERVICE_LABEL: self.service,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                },
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "http", "port": self.port, "protocol": "TCP"}],
        })
    }
}

impl Store {
    /// Stamps a new resourceVersion on `service`'s slice and records it as a `kind` event.
    fn record(&mut self, kind: &'static str, service: &str) -> Option<u64> {
        self.rv += 1;
        let slice = self.slices.get_mut(service).unwrap();
        slice.resource_version = self.rv;
        slice.generation += 1;
        let event =
            Event { rv: self.rv, kind, name: slice.name.clone(), object: slice.object(&self.namespace) };
        self.history.push(event);
        Some(self.rv)
    }

    /// The objects as they were at resourceVersion `at`, by name.
    fn at(&self, at: u64) -> BTreeMap<&str, &Value> {
        let mut objects = BTreeMap::new();
        for event in self.history.iter().take_while(|e| e.rv <= at) {
            match event.kind {
                "DELETED" => objects.remove(event.name.as_str()),
                _ => objects.insert(event.name.as_str(), &event.object),
            };
        }
        objects
    }
}

/// What a LIST or WATCH selects: the namespace in its path (none: all) and its label selector.
#[derive(Debug)]
struct Filter {
    namespace: Option<String>,
    labels: Vec<Requirement>,
}

impl Filter {
    fn matches(&self, object: &Value) -> bool {
        let in_namespace = self.namespace.as_ref().is_none_or(|ns| object["metadata"]["namespace"] == **ns);
        let labels = object["metadata"]["labels"].as_object();
        in_namespace && self.labels.iter().all(|r| r.matches(labels))
    }
}

/// One requirement of a label selector.
#[derive(Debug, PartialEq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Requirement {
    fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let value = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        match self {
            Requirement::Equals(k, v) => value(k) == Some(v),
            Requirement::NotEquals(k, v) => value(k) != Some(v),
            Requirement::In(k, vs) => value(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => !value(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::Exists(k) => value(k).is_some(),
            Requirement::NotExists(k) => value(k).is_none(),
        }
    }
}

/// Parses a label selector (`a=b,c!=d,e in (f,g),h notin (i),j,!k`) as the API server does.
fn parse_selector(text: &str) -> Result<Vec<Requirement>, String> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&text[start..]);
    terms.into_iter().map(str::trim).filter(|t| !t.is_empty()).map(parse_requirement).collect()
}

fn parse_requirement(term: &str) -> Result<Requirement, String> {
    let bad = || format!("unable to parse requirement: {term:?}");
    let key = |k: &str| {
        let k = k.trim();
        (!k.is_empty() && !k.contains(char::is_whitespace)).then(|| k.to_owned()).ok_or_else(bad)
    };
    if let Some((head, rest)) = term.split_once('(') {
        let values = rest.strip_suffix(')').ok_or_else(bad)?;
        let values: Vec<String> =
            values.split(',').map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned).collect();
        let words: Vec<&str> = head.split_whitespace().collect();
        return match words.as_slice() {
            [k, "in"] => Ok(Requirement::In(key(k)?, values)),
            [k, "notin"] => Ok(Requirement::NotIn(key(k)?, values)),
            _ => Err(bad()),
        };
    }
    if let Some(k) = term.strip_prefix('!') {
        return Ok(Requirement::NotExists(key(k)?));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Requirement::NotEquals(key(k)?, v.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Requirement::Equals(key(k)?, v.trim().to_owned()));
    }
    Ok(Requirement::Exists(key(term)?))
}

/// A query string's pairs, percent-decoded (`+` is a space), in order. For asserting on
/// [`KubeStandIn::requests`]: pass the whole request line or just its query.
pub fn query_pairs(request: &str) -> Vec<(String, String)> {
    let query = request.split_once('?').map_or(request, |(_, q)| q);
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex =
            bytes.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

type ReplyBody = BoxBody<Bytes, Infallible>;

/// A response body fed from a channel: a watch's events, one JSON line each, as they happen.
#[derive(Debug)]
struct Lines(mpsc::Receiver<Bytes>);

impl Body for Lines {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|line| line.map(|l| Ok(Frame::data(l))))
    }
}

/// Serves `listener` from a thread with a runtime of its own, until stopped.
fn serve(listener: TcpListener, shared: Arc<Shared>) -> Running {
    listener.set_nonblocking(true).unwrap();
    let (stop, stopped) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("kube-stand-in".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the stand-in");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let accept = async {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else { continue };
                        let shared = shared.clone();
                        tokio::spawn(async move {
                            let service = hyper::service::service_fn(move |req| handle(shared.clone(), req));
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                };
                tokio::select! {
                    () = accept => {}
                    _ = stopped => {}
                }
            });
            // Dropping the runtime ends every connection and open watch.
        })
        .expect("the stand-in's thread");
    Running { stop, thread }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<ReplyBody>, Infallible> {
    let target = req.uri().path_and_query().map_or(req.uri().path(), |p| p.as_str());
    shared.requests.lock().unwrap().push(format!("{} {target}", req.method()));
    if req.method() != Method::GET {
        return Ok(status(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "the stand-in only reads"));
    }
    let query: HashMap<String, String> = query_pairs(req.uri().query().unwrap_or("")).into_iter().collect();
    let segments: Vec<&str> = req.uri().path().trim_matches('/').split('/').collect();
    let (namespace, name) = match segments.as_slice() {
        ["apis", "discovery.k8s.io", "v1", "endpointslices"] => (None, None),
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices"] => (Some(*ns), None),
        ["apis", "discovery.k8s.io", "v1", "namespaces", ns, "endpointslices", name] => {
            (Some(*ns), Some(*name))
        }
        _ => return Ok(status(StatusCode::NOT_FOUND, "NotFound", "the stand-in serves only EndpointSlices")),
    };
    if let Some(name) = name {
        return Ok(get(&shared, namespace.unwrap(), name));
    }
    if query.contains_key("fieldSelector") {
        return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", "the stand-in has no field selectors"));
    }
    let labels = match parse_selector(query.get("labelSelector").map_or("", String::as_str)) {
        Ok(labels) => labels,
        Err(why) => return Ok(status(StatusCode::BAD_REQUEST, "BadRequest", &why)),
    };
    let filter = Filter { namespace: namespace.map(str::to_owned), labels };
    let flag = |name: &str| query.get(name).is_some_and(|v| v == "true" || v == "1");
    if flag("watch") {
        Ok(start_watch(shared, filter, &query, flag("allowWatchBookmarks"), flag("sendInitialEvents")))
    } else {
        Ok(list(&shared, &filter, &query))
    }
}

/// One slice by name.
fn get(shared: &Shared, namespace: &str, name: &str) -> Response<ReplyBody> {
    let store = shared.store.lock().unwrap();
    let found = store.slices.values().find(|s| s.name == name && store.namespace == namespace);
    match found {
        Some(slice) => reply(StatusCode::OK, &slice.object(&store.namespace)),
        None => status(StatusCode::NOT_FOUND, "NotFound", &format!("endpointslices {name:?} not found")),
    }
}

/// A LIST, a page of `limit` at a time: each page from the same resourceVersion (the
/// `continue` token carries it, as the real one does), items in name order.
fn list(shared: &Shared, filter: &Filter, query: &HashMap<String, String>) -> Response<ReplyBody> {
    let store = shared.store.lock().unwrap();
    let (at, after) = match query.get("continue").filter(|c| !c.is_empty()) {
        None => (store.rv, String::new()),
        Some(token) => match token.split_once(':').and_then(|(rv, name)| Some((rv.parse().ok()?, name))) {
            Some((rv, _)) if rv < store.compacted => {
                return status(StatusCode::GONE, "Expired", "the provided continue parameter is too old");
            }
            Some((rv, name)) => (rv, name.to_owned()),
            None => return status(StatusCode::BAD_REQUEST, "BadRequest", "malformed continue token"),
        },
    };
    let limit = query.get("limit").and_then(|l| l.parse::<usize>().ok()).filter(|l| *l > 0);
    let selected: Vec<(&str, &Value)> =
        store.at(at).into_iter().filter(|(name, o)| *name > after.as_str() && filter.matches(o)).collect();
    let page = limit.map_or(selected.len(), |l| l.min(selected.len()));
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if page < selected.len() {
        metadata["continue"] = json!(format!("{at}:{}", selected[page - 1].0));
        metadata["remainingItemCount"] = json!(selected.len() - page);
    }
    let items: Vec<&Value> = selected[..page].iter().map(|(_, o)| *o).collect();
    let body =
        json!({"apiVersion": API_VERSION, "kind": "EndpointSliceList", "metadata": metadata, "items": items});
    reply(StatusCode::OK, &body)
}

/// A WATCH: the events after `resourceVersion` (unset or `0`: the current objects as
/// `ADDED` first), then each change as it is made, until `timeoutSeconds` (at most
/// [`MAX_WATCH`]) or the client goes.
fn start_watch(
    shared: Arc<Shared>,
    filter: Filter,
    query: &HashMap<String, String>,
    bookmarks: bool,
    initial_events: bool,
) -> Response<ReplyBody> {
    let from = query.get("resourceVersion").filter(|rv| !rv.is_empty() && *rv != "0");
    let from = match from.map(|rv| rv.parse::<u64>()) {
        None => None,
        Some(Ok(rv)) => Some(rv),
        Some(Err(_)) => {
            return status(StatusCode::BAD_REQUEST, "BadRequest", "resourceVersion is not a number");
        }
    };
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(MAX_WATCH, |t| Duration::from_secs(t).min(MAX_WATCH));
    let initial = initial_events || from.is_none();
    // Where the watch starts is decided now, as the request arrives, not when its task runs.
    let changed = shared.changed.subscribe();
    let (first, follow) = {
        let store = shared.store.lock().unwrap();
        match from {
            Some(rv) if rv < store.compacted => {
                let gone = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": format!("too old resource version: {rv} ({})", store.compacted),
                    "reason": "Expired", "code": 410,
                });
                (vec![line("ERROR", &gone)], None)
            }
            Some(rv) if !initial => (Vec::new(), Some(rv)),
            _ => {
                let objects = store.at(store.rv);
                let mut first: Vec<Bytes> =
                    objects.values().filter(|o| filter.matches(o)).map(|o| line("ADDED", o)).collect();
                if initial_events && bookmarks {
                    first.push(bookmark(store.rv, true));
                }
                (first, Some(store.rv))
            }
        }
    };
    let (tx, rx) = mpsc::channel(64);
    let watch = Watch { shared, filter, changed, bookmarks, deadline: tokio::time::Instant::now() + timeout };
    tokio::spawn(watch.stream(first, follow, tx));
    let mut response = Response::new(Lines(rx).boxed());
    response.headers_mut().insert(CONTENT_TYPE, "application/json".parse().unwrap());
    response
}

/// An open watch's task: what it selects, and until when.
#[derive(Debug)]
struct Watch {
    shared: Arc<Shared>,
    filter: Filter,
    changed: watch::Receiver<u64>,
    bookmarks: bool,
    deadline: tokio::time::Instant,
}

impl Watch {
    /// Sends `first`, then (unless `follow` is `None`) every selected change after
    /// resourceVersion `follow` as it is made, until the deadline or the client goes.
    async fn stream(mut self, first: Vec<Bytes>, follow: Option<u64>, tx: mpsc::Sender<Bytes>) {
        for event in first {
            if tx.send(event).await.is_err() {
                return;
            }
        }
        let Some(mut cursor) = follow else { return };
        let start = tokio::time::Instant::now() + BOOKMARK_EVERY;
        let mut ticks = tokio::time::interval_at(start, BOOKMARK_EVERY);
        loop {
            self.changed.borrow_and_update();
            let events: Vec<Bytes> = {
                let store = self.shared.store.lock().unwrap();
                let events = store.history.iter().filter(|e| e.rv > cursor && self.filter.matches(&e.object));
                let events = events.map(|e| line(e.kind, &e.object)).collect();
                cursor = cursor.max(store.rv);
                events
            };
            for event in events {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                changed = self.changed.changed() => if changed.is_err() { return },
                _ = ticks.tick(), if self.bookmarks => {
                    if tx.send(bookmark(cursor, false)).await.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(self.deadline) => return,
            }
        }
    }
}

/// One watch event, as a line of the stream.
fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": kind, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// A `BOOKMARK` at `rv`; `initial_end` marks the end of the initial events of a streaming list.
fn bookmark(rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line("BOOKMARK", &json!({"apiVersion": API_VERSION, "kind": "EndpointSlice", "metadata": metadata}))
}

fn reply(code: StatusCode, body: &Value) -> Response<ReplyBody> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = code;
    response.headers_mut().insert(CONTENT_TYPE, "application/json".parse().unwrap());
    response
}

/// A `Status` failure, as the API server answers errors.
fn status(code: StatusCode, reason: &str, message: &str) -> Response<ReplyBody> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    reply(code, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_parse_as_the_api_server_reads_them() {
        let s = |k: &str| k.to_owned();
        assert_eq!(
            parse_selector("kubernetes.io/service-name in (a, b),x!=y,z==w,!gone,here").unwrap(),
            vec![
                Requirement::In(s(SERVICE_LABEL), vec![s("a"), s("b")]),
                Requirement::NotEquals(s("x"), s("y")),
                Requirement::Equals(s("z"), s("w")),
                Requirement::NotExists(s("gone")),
                Requirement::Exists(s("here")),
            ]
        );
        assert!(parse_selector("").unwrap().is_empty());
        assert!(parse_selector("a b").is_err());
        assert!(parse_selector("a within (b)").is_err());
    }

    #[test]
    fn queries_decode_plus_and_percent() {
        assert_eq!(
            query_pairs("GET /x?labelSelector=a%2Fb+in+%28c%2Cd%29&limit=500&e=%20"),
            vec![(s("labelSelector"), s("a/b in (c,d)")), (s("limit"), s("500")), (s("e"), s(" "))]
        );
        fn s(k: &str) -> String {
            k.to_owned()
        }
    }
}
