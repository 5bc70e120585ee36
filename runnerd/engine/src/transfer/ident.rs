//! A workspace's name that means the same on every node (issue #34): a remote workspace key,
//! or a project path relative to `<data>/projects`. Each node maps it to its own canonical
//! path, so head names (`workspaces/<sha256(canonical)>/head`) may differ between nodes while
//! the identity does not. Pure: parsing, the JSON form, the object-store name, and the way
//! back from a canonical path.

use std::path::{Component, Path, PathBuf};

use serde_json::{Value, json};

use runner_store::workspace::{PROJECTS, REMOTE_WORKSPACES, key_segments};

/// Which workspace, portably.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ident {
    /// `remote-workspaces/<key>` (a `runnerWorkspaceKey`).
    Remote(String),
    /// `projects/<path>` (an API-made `workspaceRoot`), `/`-separated.
    Project(String),
}

/// Why a workspace name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentError {
    #[error(
        "name the workspace with exactly one of `workspace` (a remote workspace key) or `project` (a path under projects/)"
    )]
    Missing,
    #[error("Invalid remote workspace key")]
    InvalidKey,
    #[error(
        "a project is named by its path under projects/: segments of letters, digits, '.', '_' and '-', not '.' or '..', no reserved name"
    )]
    InvalidProject,
}

impl Ident {
    /// `{"workspace": KEY}` or `{"project": PATH}` (exactly one of them).
    pub fn from_json(obj: &serde_json::Map<String, Value>) -> Result<Ident, IdentError> {
        let text =
            |name: &str| obj.get(name).and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty());
        match (text("workspace"), text("project")) {
            (Some(key), None) => Ident::remote(key),
            (None, Some(path)) => Ident::project(path),
            _ => Err(IdentError::Missing),
        }
    }

    /// A remote workspace key, checked as the remote routes check it.
    pub fn remote(key: &str) -> Result<Ident, IdentError> {
        let segments = key_segments(key).map_err(|_| IdentError::InvalidKey)?;
        Ok(Ident::Remote(segments.join("/")))
    }

    /// A project path (relative to `projects/`), held to the key's rules: what a node must
    /// be able to create beneath its own `projects/`, with no name that means something else.
    pub fn project(path: &str) -> Result<Ident, IdentError> {
        let segments = key_segments(path).map_err(|_| IdentError::InvalidProject)?;
        Ok(Ident::Project(segments.join("/")))
    }

    /// The JSON form the routes exchange.
    pub fn to_json(&self) -> Value {
        match self {
            Ident::Remote(key) => json!({"workspace": key}),
            Ident::Project(path) => json!({"project": path}),
        }
    }

    /// The query that names it (`workspace=K` or `project=P`): its segments are
    /// `[A-Za-z0-9._-]`, which a query carries as they are.
    pub fn query(&self) -> String {
        match self {
            Ident::Remote(key) => format!("workspace={key}"),
            Ident::Project(path) => format!("project={path}"),
        }
    }

    /// The path's segments beneath the data directory (`remote-workspaces/…` or `projects/…`).
    pub fn segments(&self) -> Vec<&str> {
        let (top, rest) = match self {
            Ident::Remote(key) => (REMOTE_WORKSPACES, key),
            Ident::Project(path) => (PROJECTS, path),
        };
        std::iter::once(top).chain(rest.split('/')).collect()
    }

    /// Where it lives beneath the data directory's real path.
    pub fn path_under(&self, data_real: &Path) -> PathBuf {
        self.segments().iter().fold(data_real.to_owned(), |p, s| p.join(s))
    }

    /// The name an object store keeps it under: the segments after a kind, each already
    /// limited to `[A-Za-z0-9._-]`, so no escaping is needed and no two idents share one.
    pub fn object_name(&self) -> String {
        match self {
            Ident::Remote(key) => format!("remote/{key}"),
            Ident::Project(path) => format!("project/{path}"),
        }
    }

    /// The ident of a canonical workspace path under `data_real` (the data directory's real
    /// path), if it is one this module can name.
    pub fn from_canonical(data_real: &Path, canonical: &Path) -> Option<Ident> {
        let rest = canonical.strip_prefix(data_real).ok()?;
        let mut names = Vec::new();
        for c in rest.components() {
            match c {
                Component::Normal(n) => names.push(n.to_str()?),
                _ => return None,
            }
        }
        let (top, tail) = names.split_first()?;
        let joined = tail.join("/");
        match *top {
            REMOTE_WORKSPACES => Ident::remote(&joined).ok(),
            PROJECTS => Ident::project(&joined).ok(),
            _ => None,
        }
    }
}

impl std::fmt::Display for Ident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ident::Remote(key) => write!(f, "workspace {key}"),
            Ident::Project(path) => write!(f, "project {path}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn parsed_from_json() {
        let cases: [(Value, Result<Ident, IdentError>); 9] = [
            (json!({"workspace": "p1/s1"}), Ok(Ident::Remote("p1/s1".into()))),
            (json!({"workspace": " p1 "}), Ok(Ident::Remote("p1".into()))),
            (json!({"project": "team/run-2"}), Ok(Ident::Project("team/run-2".into()))),
            (json!({}), Err(IdentError::Missing)),
            (json!({"workspace": "a", "project": "b"}), Err(IdentError::Missing)),
            (json!({"workspace": "../x"}), Err(IdentError::InvalidKey)),
            (json!({"workspace": ".workspace-coordination"}), Err(IdentError::InvalidKey)),
            (json!({"project": "a//b"}), Err(IdentError::InvalidProject)),
            (json!({"project": "/abs"}), Err(IdentError::InvalidProject)),
        ];
        for (input, want) in cases {
            assert_eq!(Ident::from_json(&obj(input.clone())), want, "{input}");
        }
    }

    #[test]
    fn json_and_paths_round_trip() {
        let data = Path::new("/srv/data");
        for ident in [Ident::Remote("p/s".into()), Ident::Project("a.b/c_d-1".into())] {
            assert_eq!(Ident::from_json(&obj(ident.to_json())).unwrap(), ident);
            let path = ident.path_under(data);
            assert_eq!(Ident::from_canonical(data, &path), Some(ident.clone()), "{}", path.display());
        }
        assert_eq!(
            Ident::Remote("p/s".into()).path_under(data),
            Path::new("/srv/data/remote-workspaces/p/s")
        );
        assert_eq!(Ident::Project("x".into()).object_name(), "project/x");
        assert_eq!(Ident::Remote("p/s".into()).query(), "workspace=p/s");
    }

    #[test]
    fn only_workspace_paths_have_idents() {
        let data = Path::new("/srv/data");
        for path in ["/srv/data", "/srv/data/projects", "/srv/other/projects/a", "/srv/data/versioning/x"] {
            assert_eq!(Ident::from_canonical(data, Path::new(path)), None, "{path}");
        }
    }
}
