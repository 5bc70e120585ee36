//! Where a request goes (pure): the route table of runnerd's API seen from the router. A
//! request either names a workspace (in its JSON body or its query), a managed execution or
//! an NPU job by id, changes what every node must hold alike (skill packages, environments),
//! reads what any node of a pool can answer, or is the router's own (`/health`, `/status`,
//! `/resources`, `/metrics`, `/fleet/…`). Nothing here decides a node: [`crate::route`] does.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use crate::fleet::{Pool, Workspace};

/// What the router does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The router answers: `/health`, `/status`, `/resources`, `/metrics`.
    Own(Own),
    /// `GET /fleet/nodes`, `POST /fleet/drain|undrain {"node"}`.
    Fleet(FleetOp),
    /// To the node holding the workspace (placed when none does). `None`: the request names
    /// none the router can read, so any node answers it (with runnerd's own error).
    Workspace {
        ws: Option<Workspace>,
        pool: Pool,
        /// The managed execution or NPU job the answer creates (recorded to its node).
        creates: Creates,
    },
    /// To the node running this managed execution.
    Execution(String),
    /// To the node running this NPU job.
    NpuJob(String),
    /// To every routable node; the answers must agree.
    Broadcast,
    /// `GET /skill-packages/:id`: published only when every routable node has it.
    SkillPackage,
    /// Refused by the router with this answer (see [`Refusal`]).
    Refused(Refusal),
    /// To any routable node of the pool.
    Any(Pool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Own {
    Health,
    Status,
    Resources,
    Metrics,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetOp {
    List,
    /// `GET /fleet/drain?node=`: what the node still holds, and this router's drain of it.
    Progress,
    Drain,
    Undrain,
}

/// Requests the router does not pass on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not an origin-form path (`OPTIONS *`, absolute-form): runnerd's 404.
    NotFound,
    /// Node-to-node routes (push, objects, commit, restore, backup, draining): they move or
    /// fence a workspace, and only the router's drain and restore may ask for that.
    NodeInternal,
    /// Managed environments are made per node with ids of their own: a fleet cannot hold
    /// one environment under one id yet.
    Environments,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Creates {
    Nothing,
    Execution,
    NpuJob,
}

/// Whether the request's body must be read before the route is known (a JSON body that names
/// the workspace; at most runnerd's own 2,000,000-byte limit). Other bodies stream.
pub fn needs_body(method: &str, path: &str) -> bool {
    method == "POST"
        && matches!(
            path,
            "/execute"
                | "/execute-shell"
                | "/shell-executions"
                | "/npu/jobs"
                | "/remote-workspace/files"
                | "/remote-workspace/snapshots"
                | "/remote-workspace/repair"
                | "/workspace-transfer/push"
                | "/workspace-transfer/restore"
                | "/workspace-transfer/backup"
                | "/workspace-transfer/commit"
                | "/fleet/drain"
                | "/fleet/undrain"
        )
}

/// A query value, percent-decoded (runnerd's own parser, so both read the same name).
fn query(q: Option<&str>, name: &str) -> Option<String> {
    runnerd::api::query::get(q, name)
}

/// Percent-escapes what a query value may not carry as it is.
pub fn query_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The lexical form of an absolute path: `.` and `..` resolved, no trailing slash.
fn lexical(path: &str) -> Option<PathBuf> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The longest name the router keeps for a workspace (a longer one is left to the node).
const MAX_NAME: usize = 1024;

/// A remote workspace key as runnerd checks it (`None`: the node refuses it itself).
fn remote(key: &str) -> Option<Workspace> {
    match runnerd::transfer::Ident::remote(key).ok()? {
        runnerd::transfer::Ident::Remote(k) => Some(Workspace::Remote(k)),
        runnerd::transfer::Ident::Project(_) => None,
    }
}

/// A path under `projects/`: normalised by the transfer routes' rules where it meets them,
/// else kept as written (a project directory may have any name; the router only needs one
/// name per directory).
fn project(path: &str) -> Option<Workspace> {
    match runnerd::transfer::Ident::project(path) {
        Ok(runnerd::transfer::Ident::Project(p)) => Some(Workspace::Project(p)),
        _ => (!path.is_empty() && path.len() <= MAX_NAME).then(|| Workspace::Project(path.to_owned())),
    }
}

/// The workspace a `workspaceRoot` names beneath the nodes' data directory, if any.
pub fn workspace_of_root(data_dir: &Path, root: &str) -> Option<Workspace> {
    let data = lexical(data_dir.to_str()?)?;
    let rest = lexical(root)?.strip_prefix(&data).ok()?.to_str()?.to_owned();
    let (top, tail) = rest.split_once('/')?;
    if tail.is_empty() {
        return None;
    }
    match top {
        "remote-workspaces" => remote(tail),
        "projects" => project(tail),
        _ => None,
    }
}

/// The workspace an execution's body names: `runnerWorkspaceKey` when it is a non-empty
/// string (it wins, as in runnerd), else `workspaceRoot`.
fn workspace_of_body(data_dir: &Path, body: &Value) -> Option<Workspace> {
    match body.get("runnerWorkspaceKey").and_then(Value::as_str).map(str::trim) {
        Some(key) if !key.is_empty() => remote(key),
        _ => workspace_of_root(data_dir, body.get("workspaceRoot")?.as_str()?),
    }
}

/// The pool a request's chips need: NPU devices → ascend, GPU devices → nvidia.
fn pool_of_body(body: &Value) -> Pool {
    let wants = |field: &str| body.get(field).and_then(Value::as_array).is_some_and(|a| !a.is_empty());
    if wants("npuDevices") {
        Pool::Ascend
    } else if wants("gpuDevices") {
        Pool::Nvidia
    } else {
        Pool::Cpu
    }
}

/// The workspace a `/remote-workspace/…` or `/workspace-transfer/…` request names in its
/// query or (for POSTs with a JSON body) its body.
fn named_workspace(q: Option<&str>, body: Option<&Value>) -> Option<Workspace> {
    let from_body = |field: &str| body.and_then(|b| b.get(field)).and_then(Value::as_str).map(str::to_owned);
    let pick = |field: &str| from_body(field).or_else(|| query(q, field)).map(|v| v.trim().to_owned());
    match (pick("workspace"), pick("project")) {
        (Some(k), _) if !k.is_empty() => remote(&k),
        (_, Some(p)) if !p.is_empty() => project(&p),
        _ => None,
    }
}

/// Where `method path?query` with `body` (parsed when [`needs_body`] asked for it) goes.
pub fn classify(method: &str, path: &str, q: Option<&str>, body: Option<&Value>, data_dir: &Path) -> Target {
    if !path.starts_with('/') {
        return Target::Refused(Refusal::NotFound);
    }
    let segments: Vec<&str> = path.strip_prefix('/').unwrap_or("").split('/').collect();
    let decoded = |s: &str| runnerd::api::query::decode_path(s);
    let ws = |creates| Target::Workspace {
        ws: body.and_then(|b| workspace_of_body(data_dir, b)),
        pool: body.map_or(Pool::Cpu, pool_of_body),
        creates,
    };
    match (method, segments.as_slice()) {
        ("GET", ["health"]) => Target::Own(Own::Health),
        ("GET", ["status"]) => Target::Own(Own::Status),
        ("GET", ["resources"]) => Target::Own(Own::Resources),
        ("GET", ["metrics"]) => Target::Own(Own::Metrics),
        ("GET", ["fleet", "nodes"]) => Target::Fleet(FleetOp::List),
        ("GET", ["fleet", "drain"]) => Target::Fleet(FleetOp::Progress),
        ("POST", ["fleet", "drain"]) => Target::Fleet(FleetOp::Drain),
        ("POST", ["fleet", "undrain"]) => Target::Fleet(FleetOp::Undrain),
        ("POST", ["execute" | "execute-shell"]) => ws(Creates::Nothing),
        ("POST", ["shell-executions"]) => ws(Creates::Execution),
        ("POST", ["npu", "jobs"]) => match ws(Creates::NpuJob) {
            Target::Workspace { ws, creates, .. } => Target::Workspace { ws, pool: Pool::Ascend, creates },
            other => other,
        },
        ("GET" | "POST", ["shell-executions", id, ..]) if !id.is_empty() => Target::Execution(decoded(id)),
        ("GET" | "POST", ["npu", "jobs", id, ..]) if !id.is_empty() => Target::NpuJob(decoded(id)),
        ("GET", ["npu", ..]) => Target::Any(Pool::Ascend),
        ("GET", ["gpu", ..]) => Target::Any(Pool::Nvidia),
        ("GET", ["workspace-transfer", "where"]) | (_, ["remote-workspace", ..]) => {
            Target::Workspace { ws: named_workspace(q, body), pool: Pool::Cpu, creates: Creates::Nothing }
        }
        (_, ["workspace-transfer", ..]) => Target::Refused(Refusal::NodeInternal),
        ("POST" | "DELETE", ["environments", ..]) => Target::Refused(Refusal::Environments),
        ("GET", ["skill-packages", id]) if !id.is_empty() => Target::SkillPackage,
        ("POST" | "DELETE", ["skill-packages", ..] | ["environment-setup"])
        | ("POST", ["kernels", ..] | ["versioning", "gc"]) => Target::Broadcast,
        _ => Target::Any(Pool::Cpu),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DATA: &str = "/var/lib/sciencediscovery";

    fn c(method: &str, path: &str, q: Option<&str>, body: Option<Value>) -> Target {
        classify(method, path, q, body.as_ref(), Path::new(DATA))
    }

    fn remote(k: &str) -> Option<Workspace> {
        Some(Workspace::Remote(k.into()))
    }

    #[test]
    fn workspace_roots_map_beneath_the_data_directory() {
        let cases: &[(&str, Option<Workspace>)] = &[
            ("/var/lib/sciencediscovery/remote-workspaces/team/w1", remote("team/w1")),
            ("/var/lib/sciencediscovery/remote-workspaces/team/w1/", remote("team/w1")),
            ("/var/lib/sciencediscovery/projects/p1", Some(Workspace::Project("p1".into()))),
            ("/var/lib/sciencediscovery/projects/p1/../p2/./x", Some(Workspace::Project("p2/x".into()))),
            ("/var/lib/sciencediscovery/projects", None),
            ("/var/lib/sciencediscovery/projects/", None),
            ("/var/lib/sciencediscovery/other/p", None),
            ("/var/lib/sciencediscovery/projects/../../etc", None),
            ("/elsewhere/projects/p", None),
            ("relative/projects/p", None),
            ("/nonexistent/control/workspace", None),
        ];
        for (root, want) in cases {
            assert_eq!(workspace_of_root(Path::new(DATA), root), *want, "{root}");
        }
    }

    #[test]
    fn routes() {
        let exec =
            json!({"runnerWorkspaceKey": "team/w1", "workspaceRoot": "/nonexistent/control/workspace"});
        let by_root = json!({"workspaceRoot": format!("{DATA}/projects/p")});
        let gpu = json!({"runnerWorkspaceKey": "k", "gpuDevices": [0]});
        let npu = json!({"runnerWorkspaceKey": "k", "npuDevices": [1]});
        let blank_key =
            json!({"runnerWorkspaceKey": " ", "workspaceRoot": format!("{DATA}/remote-workspaces/x")});
        let w = |ws: Option<Workspace>, pool, creates| Target::Workspace { ws, pool, creates };
        type Case<'a> = (&'a str, &'a str, Option<&'a str>, Option<Value>, Target);
        let cases: Vec<Case> = vec![
            ("GET", "/health", None, None, Target::Own(Own::Health)),
            ("GET", "/status", None, None, Target::Own(Own::Status)),
            ("GET", "/resources", None, None, Target::Own(Own::Resources)),
            ("GET", "/metrics", None, None, Target::Own(Own::Metrics)),
            ("GET", "/fleet/nodes", None, None, Target::Fleet(FleetOp::List)),
            ("POST", "/fleet/drain", None, None, Target::Fleet(FleetOp::Drain)),
            (
                "POST",
                "/execute-shell",
                None,
                Some(exec.clone()),
                w(remote("team/w1"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "POST",
                "/execute",
                None,
                Some(by_root),
                w(Some(Workspace::Project("p".into())), Pool::Cpu, Creates::Nothing),
            ),
            ("POST", "/execute-shell", None, Some(gpu), w(remote("k"), Pool::Nvidia, Creates::Nothing)),
            ("POST", "/execute-shell", None, Some(npu), w(remote("k"), Pool::Ascend, Creates::Nothing)),
            ("POST", "/execute-shell", None, Some(blank_key), w(remote("x"), Pool::Cpu, Creates::Nothing)),
            ("POST", "/execute-shell", None, Some(json!([1])), w(None, Pool::Cpu, Creates::Nothing)),
            ("POST", "/execute-shell", None, None, w(None, Pool::Cpu, Creates::Nothing)),
            (
                "POST",
                "/shell-executions",
                None,
                Some(exec.clone()),
                w(remote("team/w1"), Pool::Cpu, Creates::Execution),
            ),
            ("POST", "/npu/jobs", None, Some(exec), w(remote("team/w1"), Pool::Ascend, Creates::NpuJob)),
            (
                "GET",
                "/shell-executions/ab%2Fc/logs",
                Some("cursor=1"),
                None,
                Target::Execution("ab/c".into()),
            ),
            ("POST", "/shell-executions/e1/cancel", None, None, Target::Execution("e1".into())),
            ("GET", "/npu/jobs/j1/result", None, None, Target::NpuJob("j1".into())),
            ("GET", "/npu/jobs", Some("session_id=s"), None, Target::Any(Pool::Ascend)),
            ("GET", "/npu/workloads", None, None, Target::Any(Pool::Ascend)),
            ("GET", "/gpu/devices", None, None, Target::Any(Pool::Nvidia)),
            (
                "GET",
                "/remote-workspace/file",
                Some("workspace=team%2Fw1&path=a"),
                None,
                w(remote("team/w1"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "PUT",
                "/remote-workspace/file",
                Some("workspace=w&path=a"),
                None,
                w(remote("w"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "POST",
                "/remote-workspace/files",
                None,
                Some(json!({"workspace": "w"})),
                w(remote("w"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "DELETE",
                "/remote-workspace",
                Some("workspace=w"),
                None,
                w(remote("w"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "GET",
                "/workspace-transfer/where",
                Some("project=p"),
                None,
                w(Some(Workspace::Project("p".into())), Pool::Cpu, Creates::Nothing),
            ),
            ("GET", "/remote-workspace/files", None, None, w(None, Pool::Cpu, Creates::Nothing)),
            ("POST", "/workspace-transfer/push", None, None, Target::Refused(Refusal::NodeInternal)),
            ("POST", "/workspace-transfer/draining", None, None, Target::Refused(Refusal::NodeInternal)),
            ("GET", "/workspace-transfer/list", None, None, Target::Refused(Refusal::NodeInternal)),
            ("OPTIONS", "*", None, None, Target::Refused(Refusal::NotFound)),
            ("GET", "http://node:1/status", None, None, Target::Refused(Refusal::NotFound)),
            (
                "POST",
                "/execute-shell",
                None,
                Some(json!({"runnerWorkspaceKey": "../x"})),
                w(None, Pool::Cpu, Creates::Nothing),
            ),
            (
                "POST",
                "/execute-shell",
                None,
                Some(json!({"runnerWorkspaceKey": " a/b "})),
                w(remote("a/b"), Pool::Cpu, Creates::Nothing),
            ),
            (
                "POST",
                "/execute-shell",
                None,
                Some(json!({"runnerWorkspaceKey": "a//b"})),
                w(None, Pool::Cpu, Creates::Nothing),
            ),
            ("POST", "/environments", None, None, Target::Refused(Refusal::Environments)),
            ("POST", "/skill-packages", None, None, Target::Broadcast),
            ("DELETE", "/skill-packages/abc", None, None, Target::Broadcast),
            ("POST", "/environments/e/install", None, None, Target::Refused(Refusal::Environments)),
            ("POST", "/environments", None, None, Target::Refused(Refusal::Environments)),
            ("POST", "/environment-setup", None, None, Target::Broadcast),
            ("POST", "/kernels/teardown", None, None, Target::Broadcast),
            ("POST", "/versioning/gc", None, None, Target::Broadcast),
            ("GET", "/skill-packages/abc", None, None, Target::SkillPackage),
            ("GET", "/environments", None, None, Target::Any(Pool::Cpu)),
            ("GET", "/kernels", None, None, Target::Any(Pool::Cpu)),
            ("GET", "/nowhere", None, None, Target::Any(Pool::Cpu)),
            ("DELETE", "/shell-executions/x", None, None, Target::Any(Pool::Cpu)),
        ];
        for (method, path, q, body, want) in cases {
            assert_eq!(c(method, path, q, body.clone()), want, "{method} {path} {q:?} {body:?}");
        }
    }

    #[test]
    fn query_escaping() {
        assert_eq!(query_escape("team/w-1.x_~"), "team/w-1.x_~");
        assert_eq!(query_escape("a b&c=d%"), "a%20b%26c%3Dd%25");
    }
}
