//! What the router knows of its nodes: membership (from `--nodes` or Kubernetes), each
//! node's readiness, reachability, drain flag and polled load, and the catalog of which node
//! holds which workspace and runs which managed execution. Everything here is a cache of
//! what the nodes say: a router that restarts, or another replica, learns it again from them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use serde_json::{Value, json};

/// A node pool: which chips its nodes carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    Cpu,
    Nvidia,
    Ascend,
}

impl Pool {
    pub const ALL: [Pool; 3] = [Pool::Cpu, Pool::Nvidia, Pool::Ascend];

    pub fn parse(text: &str) -> Option<Pool> {
        Pool::ALL.into_iter().find(|p| p.name() == text)
    }

    pub fn name(self) -> &'static str {
        match self {
            Pool::Cpu => "cpu",
            Pool::Nvidia => "nvidia",
            Pool::Ascend => "ascend",
        }
    }
}

/// A workspace as the nodes name it: a remote workspace key, or a path under `projects/`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Workspace {
    Remote(String),
    Project(String),
}

impl Workspace {
    /// The query that names it on a node's transfer routes.
    pub fn query(&self) -> String {
        match self {
            Workspace::Remote(k) => format!("workspace={}", crate::classify::query_escape(k)),
            Workspace::Project(p) => format!("project={}", crate::classify::query_escape(p)),
        }
    }

    /// Its JSON form on the nodes' transfer routes.
    pub fn to_json(&self) -> Value {
        match self {
            Workspace::Remote(k) => json!({"workspace": k}),
            Workspace::Project(p) => json!({"project": p}),
        }
    }

    /// The workspaces it lies inside, innermost first (`a/b/c`: `a/b`, then `a`): a nested
    /// workspace lives on its parent's node, inside its directory.
    pub fn ancestors(&self) -> Vec<Workspace> {
        let (name, make): (&str, fn(String) -> Workspace) = match self {
            Workspace::Remote(k) => (k, Workspace::Remote),
            Workspace::Project(p) => (p, Workspace::Project),
        };
        let mut out = Vec::new();
        let mut rest = name;
        while let Some((parent, _)) = rest.rsplit_once('/') {
            if !parent.is_empty() {
                out.push(make(parent.to_owned()));
            }
            rest = parent;
        }
        out
    }

    /// From a node's JSON form (`list` answers).
    pub fn from_json(v: &Value) -> Option<Workspace> {
        match (v["workspace"].as_str(), v["project"].as_str()) {
            (Some(k), None) => Some(Workspace::Remote(k.to_owned())),
            (None, Some(p)) => Some(Workspace::Project(p.to_owned())),
            _ => None,
        }
    }
}

impl std::fmt::Display for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workspace::Remote(k) => write!(f, "workspace {k}"),
            Workspace::Project(p) => write!(f, "project {p}"),
        }
    }
}

/// A node's load as its `GET /load` last said.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Load {
    pub running: u64,
    pub slots: u64,
    pub admitted: u64,
    pub queue_capacity: u64,
    pub disk_available: Option<u64>,
    pub draining: bool,
}

impl Load {
    pub fn from_json(v: &Value) -> Option<Load> {
        Some(Load {
            running: v["running"].as_u64()?,
            slots: v["slots"].as_u64()?,
            admitted: v["admitted"].as_u64()?,
            queue_capacity: v["queueCapacity"].as_u64()?,
            disk_available: v["diskAvailableBytes"].as_u64(),
            draining: v["draining"].as_bool().unwrap_or(false),
        })
    }
}

/// One node as membership reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub url: String,
    pub pool: Pool,
    /// Its name for people (the Kubernetes node name, else the URL).
    pub name: String,
    /// Membership's readiness (an EndpointSlice condition; always true for `--nodes`).
    pub ready: bool,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub member: Member,
    /// Still listed by membership (a node removed from its Service is kept, not ready, so
    /// that its workspaces answer 503 instead of being made anew elsewhere).
    pub listed: bool,
    /// The last load poll answered.
    pub reachable: bool,
    pub load: Option<Load>,
    pub last_error: Option<String>,
    /// Since when it has not been routable (for the lost-node grace).
    pub down_since: Option<Instant>,
    /// New workspaces sent to it since its last load poll (counted into its score).
    pub placed_since_poll: u64,
}

impl Node {
    /// Whether requests may go to it: listed, ready and answering.
    pub fn routable(&self) -> bool {
        self.listed && self.member.ready && self.reachable
    }

    /// Whether new workspaces may go to it.
    pub fn placeable(&self) -> bool {
        self.routable() && !self.load.as_ref().is_some_and(|l| l.draining)
    }

    pub fn to_json(&self, now: Instant) -> Value {
        let load = self.load.as_ref().map(|l| {
            json!({"running": l.running, "slots": l.slots, "admitted": l.admitted,
                   "queueCapacity": l.queue_capacity, "diskAvailableBytes": l.disk_available})
        });
        json!({
            "name": self.member.name,
            "url": self.member.url,
            "pool": self.member.pool.name(),
            "ready": self.member.ready && self.listed,
            "reachable": self.reachable,
            "routable": self.routable(),
            "draining": self.load.as_ref().is_some_and(|l| l.draining),
            "downForSeconds": self.down_since.map(|t| now.duration_since(t).as_secs()),
            "load": load,
            "lastError": self.last_error,
        })
    }
}

/// The most entries each catalog map keeps (a cache: a miss asks the nodes).
const CATALOG_LIMIT: usize = 200_000;

/// Where a workspace is, as far as this router knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub url: String,
    /// A node said so (`where`, a move, a restore); otherwise only this router's placement,
    /// which the nodes are asked about again until one holds it.
    pub confirmed: bool,
}

#[derive(Debug, Default)]
struct Catalog {
    workspaces: HashMap<Workspace, Held>,
    executions: HashMap<String, String>,
    npu_jobs: HashMap<String, String>,
}

fn remember<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>, key: K, value: V) {
    if map.len() >= CATALOG_LIMIT && !map.contains_key(&key) {
        // Only a cache: forgetting a tenth costs one question to the nodes later for each.
        let keep = CATALOG_LIMIT - CATALOG_LIMIT / 10;
        let mut n = 0;
        map.retain(|_, _| {
            n += 1;
            n <= keep
        });
    }
    map.insert(key, value);
}

/// The router's view of the fleet.
#[derive(Debug, Default)]
pub struct Fleet {
    nodes: RwLock<BTreeMap<String, Node>>,
    catalog: Mutex<Catalog>,
}

impl Fleet {
    fn nodes_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Node>> {
        self.nodes.write().unwrap_or_else(|p| p.into_inner())
    }

    fn catalog(&self) -> std::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every node (a copy).
    pub fn nodes(&self) -> Vec<Node> {
        self.nodes.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    pub fn node(&self, url: &str) -> Option<Node> {
        self.nodes.read().unwrap_or_else(|p| p.into_inner()).get(url).cloned()
    }

    /// The node called `name_or_url` (its name or its URL).
    pub fn find(&self, name_or_url: &str) -> Option<Node> {
        let url = crate::config::node_url(name_or_url);
        self.nodes().into_iter().find(|n| n.member.name == name_or_url || Some(&n.member.url) == url.as_ref())
    }

    /// Membership's whole current list: new nodes join, listed ones update, missing ones
    /// stay known as unlisted (not routable).
    pub fn set_members(&self, members: Vec<Member>) {
        let now = Instant::now();
        let mut nodes = self.nodes_mut();
        for node in nodes.values_mut() {
            node.listed = false;
        }
        for m in members {
            match nodes.get_mut(&m.url) {
                Some(node) => {
                    node.member = m;
                    node.listed = true;
                }
                None => {
                    let node = Node {
                        member: m.clone(),
                        listed: true,
                        reachable: true,
                        load: None,
                        last_error: None,
                        down_since: None,
                        placed_since_poll: 0,
                    };
                    nodes.insert(m.url, node);
                }
            }
        }
        for node in nodes.values_mut() {
            note_down(node, now);
        }
    }

    /// A load poll's outcome for `url`.
    pub fn polled(&self, url: &str, outcome: Result<Load, String>) {
        let mut nodes = self.nodes_mut();
        let Some(node) = nodes.get_mut(url) else { return };
        match outcome {
            Ok(load) => {
                node.reachable = true;
                node.load = Some(load);
                node.last_error = None;
                node.placed_since_poll = 0;
            }
            Err(e) => {
                node.reachable = false;
                node.last_error = Some(e);
            }
        }
        note_down(node, Instant::now());
    }

    /// A new workspace was sent to `url` (its score counts it until the next poll).
    pub fn placed(&self, url: &str) {
        if let Some(node) = self.nodes_mut().get_mut(url) {
            node.placed_since_poll += 1;
        }
    }

    /// A node answered `503 queue_full`: its queue counts as full until the next poll.
    pub fn full(&self, url: &str) {
        if let Some(node) = self.nodes_mut().get_mut(url)
            && let Some(load) = node.load.as_mut()
        {
            load.admitted = load.admitted.max(load.queue_capacity);
        }
    }

    /// The node holding `ws`, confirmed by a node or not.
    pub fn holder(&self, ws: &Workspace) -> Option<String> {
        self.catalog().workspaces.get(ws).map(|h| h.url.clone())
    }

    pub fn held(&self, ws: &Workspace) -> Option<Held> {
        self.catalog().workspaces.get(ws).cloned()
    }

    /// A node holds `ws` (it said so).
    pub fn hold(&self, ws: &Workspace, url: &str) {
        remember(&mut self.catalog().workspaces, ws.clone(), Held { url: url.to_owned(), confirmed: true });
    }

    /// This router placed `ws` on `url`; no node has said it holds it yet.
    pub fn place(&self, ws: &Workspace, url: &str) {
        remember(&mut self.catalog().workspaces, ws.clone(), Held { url: url.to_owned(), confirmed: false });
    }

    pub fn forget(&self, ws: &Workspace) {
        self.catalog().workspaces.remove(ws);
    }

    /// The workspaces the catalog places on `url`.
    pub fn held_by(&self, url: &str) -> Vec<Workspace> {
        let mut out: Vec<Workspace> =
            self.catalog().workspaces.iter().filter(|(_, h)| h.url == url).map(|(w, _)| w.clone()).collect();
        out.sort();
        out
    }

    pub fn execution(&self, id: &str) -> Option<String> {
        self.catalog().executions.get(id).cloned()
    }

    pub fn runs(&self, id: &str, url: &str) {
        remember(&mut self.catalog().executions, id.to_owned(), url.to_owned());
    }

    pub fn npu_job(&self, id: &str) -> Option<String> {
        self.catalog().npu_jobs.get(id).cloned()
    }

    pub fn runs_npu_job(&self, id: &str, url: &str) {
        remember(&mut self.catalog().npu_jobs, id.to_owned(), url.to_owned());
    }

    /// How many entries the catalog holds (workspaces, executions, NPU jobs).
    pub fn catalog_sizes(&self) -> (usize, usize, usize) {
        let c = self.catalog();
        (c.workspaces.len(), c.executions.len(), c.npu_jobs.len())
    }
}

fn note_down(node: &mut Node, now: Instant) {
    match (node.routable(), node.down_since) {
        (true, _) => node.down_since = None,
        (false, None) => node.down_since = Some(now),
        (false, Some(_)) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(url: &str, ready: bool) -> Member {
        Member { url: url.into(), pool: Pool::Cpu, name: url.into(), ready }
    }

    #[test]
    fn membership_readiness_and_polls_decide_what_is_routable() {
        let fleet = Fleet::default();
        fleet.set_members(vec![member("http://a:1", true), member("http://b:1", false)]);
        let routable = |f: &Fleet| {
            f.nodes().iter().filter(|n| n.routable()).map(|n| n.member.url.clone()).collect::<Vec<_>>()
        };
        assert_eq!(routable(&fleet), ["http://a:1"]);
        assert!(fleet.node("http://b:1").unwrap().down_since.is_some());
        fleet.polled("http://a:1", Err("connection refused".into()));
        assert!(routable(&fleet).is_empty());
        let load = Load { slots: 4, queue_capacity: 8, draining: true, ..Load::default() };
        fleet.polled("http://a:1", Ok(load));
        let a = fleet.node("http://a:1").unwrap();
        assert!(a.routable() && !a.placeable(), "draining: routable for its workspaces, no new ones");
        assert_eq!(a.down_since, None);
        // Removed from membership: kept, not routable.
        fleet.set_members(vec![member("http://b:1", true)]);
        let a = fleet.node("http://a:1").unwrap();
        assert!(!a.listed && !a.routable() && a.down_since.is_some());
        assert_eq!(routable(&fleet), ["http://b:1"]);
        assert_eq!(fleet.find("http://b:1/").unwrap().member.url, "http://b:1");
    }

    #[test]
    fn the_catalog_remembers_and_forgets() {
        let fleet = Fleet::default();
        let ws = Workspace::Remote("team/w".into());
        fleet.hold(&ws, "http://a:1");
        fleet.hold(&Workspace::Project("p".into()), "http://b:1");
        assert_eq!(fleet.holder(&ws).as_deref(), Some("http://a:1"));
        assert_eq!(fleet.held_by("http://a:1"), std::slice::from_ref(&ws));
        fleet.forget(&ws);
        assert_eq!(fleet.holder(&ws), None);
        fleet.runs("e1", "http://b:1");
        assert_eq!(fleet.execution("e1").as_deref(), Some("http://b:1"));
    }

    #[test]
    fn ancestors_innermost_first() {
        let r = |k: &str| Workspace::Remote(k.into());
        assert_eq!(r("a/b/c").ancestors(), vec![r("a/b"), r("a")]);
        assert_eq!(r("a").ancestors(), Vec::<Workspace>::new());
        assert_eq!(Workspace::Project("p/s".into()).ancestors(), vec![Workspace::Project("p".into())]);
    }

    #[test]
    fn the_catalog_is_bounded() {
        let mut map = HashMap::new();
        for i in 0..CATALOG_LIMIT + 5 {
            remember(&mut map, i, "u".to_owned());
        }
        assert!(map.len() <= CATALOG_LIMIT, "{}", map.len());
    }
}
