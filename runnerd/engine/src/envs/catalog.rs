//! `catalog.json` (internals §5.1, §5.4, §5.5): the environments and every revision record,
//! `{environments, revisions, version: 1}`, in the original's field order and spelling so
//! that an original catalog loads and ours reads back in the original.
//!
//! The file is replaced atomically (`catalog.json.<pid>.<uuid>.tmp`, 0600, `O_EXCL`, fsync,
//! `renameat`, directory fsync), always relative to the store's directory descriptor. Loading
//! refuses any other version and validates every id, since ids become paths.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::disk::{self, Found};
use super::ids::{self, IdError};
use crate::fsat;
use crate::versioning::new_uuid_v4;

/// The only catalog version there is.
pub const CATALOG_VERSION: u64 = 1;
/// A catalog larger than this is refused rather than read (thousands of revisions are a
/// few MiB).
pub const MAX_CATALOG_BYTES: u64 = 64 << 20;
/// The revisions' `provisioner`: the basename of the binary that provisions.
pub const PROVISIONER: &str = "runner-provisioner";

/// `error` of an environment whose in-place update failed (internals §5.5 step 3).
pub const UPDATE_FAILED: &str = "In-place update failed; installed files may differ from the last successful revision. Retry through environment management.";
/// `error` of an environment found `updating` at start-up (internals §5.5 step 4).
pub const UPDATE_INTERRUPTED: &str =
    "Environment update was interrupted; repair through environment management before execution.";

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(transparent)]
    Id(#[from] IdError),
    #[error("Environment catalog version {0} is not supported")]
    Version(serde_json::Value),
    #[error("Environment catalog is not valid")]
    Invalid(#[source] serde_json::Error),
    #[error("Environment catalog lists {0} twice")]
    Duplicate(String),
    #[error("Environment catalog is not a regular file")]
    NotRegular,
    #[error("Environment catalog is larger than {MAX_CATALOG_BYTES} bytes")]
    TooLarge,
    #[error("Could not {0} the environment catalog")]
    Io(&'static str, #[source] std::io::Error),
    #[error("Could not open {0} of the scientific-environment store")]
    Store(String, #[source] std::io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Starter,
    Task,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    Python,
    R,
}

impl Language {
    /// `python` / `r`, as the wire spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::R => "r",
        }
    }

    /// The original's starter specs (`SCIENCE_AGENT_STARTER_*_SPECS` unset).
    pub fn default_starter_specs(self) -> &'static [&'static str] {
        match self {
            Language::Python => &["python=3.12", "numpy=2.0", "pandas=2.2", "scipy=1.14", "matplotlib=3.9"],
            Language::R => &["r-base=4.4", "r-tidyverse=2.0", "r-data.table=1.16"],
        }
    }

    /// The starter environment of this language.
    pub fn starter_id(self) -> &'static str {
        match self {
            Language::Python => ids::STARTER_PYTHON,
            Language::R => ids::STARTER_R,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ready,
    Updating,
    Failed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ready => "ready",
            Status::Updating => "updating",
            Status::Failed => "failed",
        }
    }
}

/// One named environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Environment {
    pub id: String,
    pub name: String,
    pub kind: Kind,
    pub language: Language,
    pub status: Status,
    /// The latest successful revision: the only executable one.
    pub current_revision_id: String,
    /// The revision whose prefix directory was created first; updates happen in place in
    /// it, so it names the prefix for the environment's whole life. Absent in catalogs that
    /// predate it: the current revision's then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_revision_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_environment_id: Option<String>,
    pub created_at: String,
    pub updated_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Environment {
    /// The revision whose directory is the prefix.
    pub fn runtime_revision(&self) -> &str {
        self.runtime_revision_id.as_deref().unwrap_or(&self.current_revision_id)
    }

    /// `revisions/<envId>/<runtimeRevisionId>`, relative to the store, ids validated.
    pub fn prefix_rel(&self) -> Result<PathBuf, IdError> {
        ids::check_env_id(&self.id)?;
        ids::check_revision_id(self.runtime_revision())?;
        Ok([common::layout::ENV_REVISIONS, &self.id, self.runtime_revision()].iter().collect())
    }

    fn check_ids(&self) -> Result<(), IdError> {
        ids::check_env_id(&self.id)?;
        ids::check_revision_id(&self.current_revision_id)?;
        self.runtime_revision_id.as_deref().map_or(Ok(()), ids::check_revision_id)?;
        self.base_environment_id.as_deref().map_or(Ok(()), ids::check_env_id)
    }
}

/// `{hash, size}`: lowercase hex sha256 and byte count of a stored file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentRef {
    pub hash: String,
    pub size: u64,
}

impl ContentRef {
    pub fn of(bytes: &[u8]) -> ContentRef {
        ContentRef { hash: crate::versioning::names::sha256_hex(bytes), size: bytes.len() as u64 }
    }
}

/// The only installer of local wheels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WheelManager {
    Pip,
}

/// A workspace wheel persisted under `wheels/<content.hash>/<filename>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalWheel {
    pub content: ContentRef,
    /// PEP 503-normalised (`example_pkg` → `example-pkg`).
    pub distribution: String,
    pub filename: String,
    pub manager: WheelManager,
    /// The workspace-relative path it was installed from.
    pub source_path: String,
    pub version: String,
}

/// One revision record (internals §5.4): audit metadata that outlives its environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentRevision {
    /// Sorted.
    pub channels: Vec<String>,
    pub created_at: String,
    pub environment_id: String,
    pub id: String,
    pub language: Language,
    /// `X.Y` of the installed `python` / `r-base`; `null` when there is none.
    pub language_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_wheels: Option<Vec<LocalWheel>>,
    /// Sorted, unique: `name=ver=build`, `python:<n>==<v>`, `r:<n>==<v>`.
    pub packages: Vec<String>,
    /// The snapshot's sha256 (the same as `snapshot.hash`).
    pub package_spec_hash: String,
    pub platform: String,
    pub provisioner: String,
    pub runner_version: String,
    pub snapshot: ContentRef,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Catalog {
    pub environments: Vec<Environment>,
    pub revisions: Vec<EnvironmentRevision>,
    pub version: u64,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog { environments: Vec::new(), revisions: Vec::new(), version: CATALOG_VERSION }
    }
}

/// `<process.platform>-<process.arch>` as Node spells them (`linux-x64`, `linux-arm64`).
pub fn node_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        "x86" => "ia32",
        "powerpc64" => "ppc64",
        "loongarch64" => "loong64",
        other => other,
    };
    format!("{}-{arch}", std::env::consts::OS)
}

/// `<data>/scientific-envs` (created, as is its `revisions/`): its canonical path (conda
/// prefixes embed theirs, so prefixes are made and mounted at canonical paths) and an
/// `O_PATH` descriptor of it, every component below the data directory opened without
/// following a symlink. Both directories are 0755: bwrap resolves a bind's source as the
/// sandbox user, who must reach the prefixes (the files that are private, the catalog and
/// the snapshots, are 0600 and 0700).
pub fn open_store(data_dir: &Path) -> Result<(PathBuf, OwnedFd), CatalogError> {
    let store_err = |what: &str| {
        let what = what.to_owned();
        move |e| CatalogError::Store(what, e)
    };
    let real = std::fs::canonicalize(data_dir).map_err(store_err("the data directory"))?;
    let data =
        fsat::open_path(&real, libc::O_PATH | libc::O_DIRECTORY).map_err(store_err("the data directory"))?;
    let store = disk::ensure_dir(&data, common::layout::SCIENTIFIC_ENVS, 0o755)
        .map_err(store_err(common::layout::SCIENTIFIC_ENVS))?;
    disk::ensure_dir(&store, common::layout::ENV_REVISIONS, 0o755)
        .map_err(store_err(common::layout::ENV_REVISIONS))?;
    Ok((real.join(common::layout::SCIENTIFIC_ENVS), store))
}

/// `revisions/<envId>/` below the store, created (0755); the provisioner creates the
/// revision's prefix inside it.
pub fn ensure_env_dir(store: &impl AsRawFd, env_id: &str) -> Result<OwnedFd, CatalogError> {
    ids::check_env_id(env_id)?;
    let open = |e| CatalogError::Store(format!("{}/{env_id}", common::layout::ENV_REVISIONS), e);
    let revisions =
        fsat::open_dir_at(store, &disk::cstr(common::layout::ENV_REVISIONS).map_err(open)?).map_err(open)?;
    disk::ensure_dir(&revisions, env_id, 0o755).map_err(open)
}

/// Removes `revisions/<envId>/` and everything in it (a deleted task environment; its
/// revision records and snapshots stay). Absent is fine.
pub fn remove_env_dir(store: &impl AsRawFd, env_id: &str) -> Result<(), CatalogError> {
    ids::check_env_id(env_id)?;
    let err = |e| CatalogError::Store(format!("{}/{env_id}", common::layout::ENV_REVISIONS), e);
    let Some(revisions) = disk::open_dir(store, common::layout::ENV_REVISIONS).map_err(err)? else {
        return Ok(());
    };
    fsat::remove_tree_at(&revisions, &disk::cstr(env_id).map_err(err)?).map_err(err)
}

impl Catalog {
    /// Reads `catalog.json` below `dir` (the store's directory). An absent file is an empty
    /// catalog; another version, or any unsafe id, is refused.
    pub fn load(dir: &impl AsRawFd) -> Result<Catalog, CatalogError> {
        let bytes = match disk::read_regular(dir, common::layout::ENV_CATALOG, MAX_CATALOG_BYTES)
            .map_err(|e| CatalogError::Io("read", e))?
        {
            Found::Bytes(b) => b,
            Found::Missing => return Ok(Catalog::default()),
            Found::NotRegular => return Err(CatalogError::NotRegular),
            Found::TooLarge => return Err(CatalogError::TooLarge),
        };
        Catalog::parse(&bytes)
    }

    /// The file's bytes to a checked catalog: the version is looked at before the shape, so
    /// a future format is reported as such rather than as malformed.
    pub fn parse(bytes: &[u8]) -> Result<Catalog, CatalogError> {
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(CatalogError::Invalid)?;
        let version = value.get("version").cloned().unwrap_or(serde_json::Value::Null);
        if version.as_u64() != Some(CATALOG_VERSION) {
            return Err(CatalogError::Version(version));
        }
        let catalog: Catalog = serde_json::from_value(value).map_err(CatalogError::Invalid)?;
        catalog.check_ids()?;
        catalog.check_unique()?;
        Ok(catalog)
    }

    /// Every id, and every name ignoring ASCII case, at most once: lookups take the first.
    fn check_unique(&self) -> Result<(), CatalogError> {
        let mut seen = std::collections::HashSet::new();
        let envs = self
            .environments
            .iter()
            .flat_map(|e| [e.id.clone(), format!("name:{}", e.name.to_ascii_lowercase())]);
        let revs = self.revisions.iter().map(|r| r.id.clone());
        match envs.chain(revs).find(|key| !seen.insert(key.clone())) {
            Some(key) => Err(CatalogError::Duplicate(key.strip_prefix("name:").unwrap_or(&key).to_owned())),
            None => Ok(()),
        }
    }

    fn check_ids(&self) -> Result<(), IdError> {
        self.environments.iter().try_for_each(Environment::check_ids)?;
        self.revisions.iter().try_for_each(|r| {
            ids::check_revision_id(&r.id)?;
            ids::check_env_id(&r.environment_id)
        })
    }

    /// 2-space pretty JSON and a newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a catalog always serialises");
        bytes.push(b'\n');
        bytes
    }

    /// Replaces `catalog.json` below `dir` atomically and durably. Ids and the size are
    /// checked first: a catalog that could not be loaded again (at the next start) is never
    /// written.
    pub fn save(&self, dir: &impl AsRawFd) -> Result<(), CatalogError> {
        self.check_ids()?;
        let bytes = self.to_bytes();
        if bytes.len() as u64 > MAX_CATALOG_BYTES {
            return Err(CatalogError::TooLarge);
        }
        let tmp = format!("{}.{}.{}.tmp", common::layout::ENV_CATALOG, std::process::id(), new_uuid_v4());
        disk::write_new(dir, &tmp, &bytes, 0o600).map_err(|e| CatalogError::Io("write", e))?;
        let renamed = disk::cstr(&tmp)
            .and_then(|from| {
                let to = disk::cstr(common::layout::ENV_CATALOG)?;
                fsat::rename_at(dir, &from, &to).inspect_err(|_| {
                    let _ = fsat::unlink_at(dir, &from);
                })
            })
            .map_err(|e| CatalogError::Io("replace", e));
        renamed?;
        disk::sync_dir(dir).map_err(|e| CatalogError::Io("sync", e))
    }

    /// Removes `catalog.json.*.tmp` files a crash left below `dir` (at start-up, before any
    /// save); returns how many.
    pub fn sweep_temporaries(dir: &OwnedFd) -> usize {
        let prefix = format!("{}.", common::layout::ENV_CATALOG);
        disk::sweep(dir, |name| name.starts_with(&prefix) && name.ends_with(".tmp"))
    }

    pub fn environment(&self, id: &str) -> Option<&Environment> {
        self.environments.iter().find(|e| e.id == id)
    }

    pub fn environment_mut(&mut self, id: &str) -> Option<&mut Environment> {
        self.environments.iter_mut().find(|e| e.id == id)
    }

    pub fn revision(&self, id: &str) -> Option<&EnvironmentRevision> {
        self.revisions.iter().find(|r| r.id == id)
    }

    /// An environment's revisions, oldest first (the order they were recorded in).
    pub fn revisions_of<'a>(&'a self, env_id: &'a str) -> impl Iterator<Item = &'a EnvironmentRevision> + 'a {
        self.revisions.iter().filter(move |r| r.environment_id == env_id)
    }

    /// The environments' names (for [`ids::check_new_name`]).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.environments.iter().map(|e| e.name.as_str())
    }

    /// At start-up: every `updating` environment becomes `failed` with the original's text
    /// (its prefix may be half changed). Returns whether anything changed (then save).
    pub fn recover_interrupted(&mut self, now: &str) -> bool {
        let mut changed = false;
        for env in self.environments.iter_mut().filter(|e| e.status == Status::Updating) {
            env.status = Status::Failed;
            env.error = Some(UPDATE_INTERRUPTED.to_owned());
            env.updated_at = now.to_owned();
            changed = true;
        }
        changed
    }

    /// Update step 1: `updating`, to be saved before any package is touched. `false` when
    /// there is no such environment.
    pub fn begin_update(&mut self, env_id: &str, now: &str) -> bool {
        self.transition(env_id, now, Status::Updating, None)
    }

    /// Update step 2: the new revision is recorded and becomes current; `ready`.
    pub fn commit_revision(&mut self, revision: EnvironmentRevision, now: &str) -> bool {
        let (env_id, rev_id) = (revision.environment_id.clone(), revision.id.clone());
        let Some(env) = self.environment_mut(&env_id) else { return false };
        env.current_revision_id = rev_id;
        self.revisions.push(revision);
        self.transition(&env_id, now, Status::Ready, None)
    }

    /// Update step 3: `failed` with the original's text; the current revision stays.
    pub fn fail_update(&mut self, env_id: &str, now: &str) -> bool {
        self.transition(env_id, now, Status::Failed, Some(UPDATE_FAILED))
    }

    fn transition(&mut self, env_id: &str, now: &str, status: Status, error: Option<&str>) -> bool {
        let Some(env) = self.environment_mut(env_id) else { return false };
        env.status = status;
        env.error = error.map(str::to_owned);
        env.updated_at = now.to_owned();
        true
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    pub fn environment(id: &str, rev: &str) -> Environment {
        Environment {
            id: id.into(),
            name: id.into(),
            kind: if id.starts_with("starter-") { Kind::Starter } else { Kind::Task },
            language: Language::Python,
            status: Status::Ready,
            current_revision_id: rev.into(),
            runtime_revision_id: Some(rev.into()),
            base_environment_id: None,
            created_at: "2026-12-01T00:00:00.000Z".into(),
            updated_at: "2026-12-01T00:00:00.000Z".into(),
            error: None,
        }
    }

    pub fn revision(env: &str, id: &str) -> EnvironmentRevision {
        EnvironmentRevision {
            channels: vec!["conda-forge".into()],
            created_at: "2026-12-01T00:00:00.000Z".into(),
            environment_id: env.into(),
            id: id.into(),
            language: Language::Python,
            language_version: Some("3.12".into()),
            local_wheels: None,
            packages: vec!["python=3.12.7=h0_cpython".into()],
            package_spec_hash: "ab".repeat(32),
            platform: node_platform(),
            provisioner: PROVISIONER.into(),
            runner_version: "0.1.0".into(),
            snapshot: ContentRef { hash: "ab".repeat(32), size: 10 },
        }
    }

    fn store() -> (tempfile::TempDir, OwnedFd) {
        let tmp = tempfile::tempdir().unwrap();
        let fd = fsat::open_path(tmp.path(), libc::O_PATH | libc::O_DIRECTORY).unwrap();
        (tmp, fd)
    }

    #[test]
    fn the_json_is_the_originals_shape() {
        let mut env = environment("task-ab", "rev-01");
        env.base_environment_id = Some("starter-python".into());
        let json = serde_json::to_string(&env).unwrap();
        assert_eq!(
            json,
            r#"{"id":"task-ab","name":"task-ab","kind":"task","language":"python","status":"ready","currentRevisionId":"rev-01","runtimeRevisionId":"rev-01","baseEnvironmentId":"starter-python","createdAt":"2026-12-01T00:00:00.000Z","updatedAt":"2026-12-01T00:00:00.000Z"}"#
        );
        let keys: Vec<String> = serde_json::to_value(revision("task-ab", "rev-01"))
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let want = [
            "channels",
            "createdAt",
            "environmentId",
            "id",
            "language",
            "languageVersion",
            "packages",
            "packageSpecHash",
            "platform",
            "provisioner",
            "runnerVersion",
            "snapshot",
        ];
        assert_eq!(keys, want);
        let mut r = revision("task-ab", "rev-01");
        r.language_version = None;
        r.local_wheels = Some(vec![LocalWheel {
            content: ContentRef { hash: "00".repeat(32), size: 3 },
            distribution: "example-pkg".into(),
            filename: "example_pkg-1.2.3-py3-none-any.whl".into(),
            manager: WheelManager::Pip,
            source_path: "wheels/example_pkg-1.2.3-py3-none-any.whl".into(),
            version: "1.2.3".into(),
        }]);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["languageVersion"], serde_json::Value::Null);
        assert_eq!(
            serde_json::to_string(&v["localWheels"][0]).unwrap(),
            format!(
                r#"{{"content":{{"hash":"{}","size":3}},"distribution":"example-pkg","filename":"example_pkg-1.2.3-py3-none-any.whl","manager":"pip","sourcePath":"wheels/example_pkg-1.2.3-py3-none-any.whl","version":"1.2.3"}}"#,
                "00".repeat(32)
            )
        );
        assert_eq!(
            serde_json::to_string(&Catalog::default()).unwrap(),
            r#"{"environments":[],"revisions":[],"version":1}"#
        );
        assert!(
            ["linux-x64", "linux-arm64"].contains(&node_platform().as_str())
                || cfg!(not(target_os = "linux"))
        );
    }

    #[test]
    fn an_absent_catalog_is_empty_and_a_saved_one_loads_back() {
        let (tmp, dir) = store();
        assert_eq!(Catalog::load(&dir).unwrap(), Catalog::default());
        let mut c = Catalog::default();
        c.environments.push(environment("starter-python", "rev-01"));
        c.revisions.push(revision("starter-python", "rev-01"));
        c.save(&dir).unwrap();
        assert_eq!(Catalog::load(&dir).unwrap(), c);
        let path = tmp.path().join("catalog.json");
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("{\n  \"environments\": [\n    {\n      \"id\": \"starter-python\""),
            "{text}"
        );
        assert!(text.ends_with("}\n"));
        // A second save replaces it and leaves no temporary behind.
        c.environments[0].name = "renamed".into();
        c.save(&dir).unwrap();
        assert_eq!(Catalog::load(&dir).unwrap().environments[0].name, "renamed");
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["catalog.json"]);
    }

    #[test]
    fn a_catalog_too_large_to_load_again_is_never_written() {
        let (tmp, dir) = store();
        let mut c = Catalog::default();
        c.environments.push(environment("task-ab", "rev-01"));
        c.revisions.push(revision("task-ab", "rev-01"));
        c.save(&dir).unwrap();
        let kept = std::fs::read(tmp.path().join("catalog.json")).unwrap();
        let mut big = c.clone();
        big.revisions[0].packages = vec!["p".repeat(1 << 20); (MAX_CATALOG_BYTES >> 20) as usize + 1];
        assert!(matches!(big.save(&dir), Err(CatalogError::TooLarge)));
        // What was on disk stays, and still loads (a restart is not refused).
        assert_eq!(std::fs::read(tmp.path().join("catalog.json")).unwrap(), kept);
        assert_eq!(Catalog::load(&dir).unwrap(), c);
    }

    #[test]
    fn loading_refuses_what_it_cannot_trust() {
        let (tmp, dir) = store();
        let path = tmp.path().join("catalog.json");
        let good = serde_json::to_value(Catalog {
            environments: vec![environment("task-ab", "rev-01")],
            revisions: vec![revision("task-ab", "rev-01")],
            version: 1,
        })
        .unwrap();
        let edit = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            f(&mut v);
            serde_json::to_vec(&v).unwrap()
        };
        let unsafe_id = "Environment metadata contains an unsafe identifier";
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (edit(&|v| v["version"] = 2.into()), "Environment catalog version 2 is not supported"),
            (edit(&|v| v["version"] = "1".into()), "Environment catalog version \"1\" is not supported"),
            (b"{}".to_vec(), "Environment catalog version null is not supported"),
            (b"not json".to_vec(), "Environment catalog is not valid"),
            (edit(&|v| v["environments"][0]["id"] = "task-../../x".into()), unsafe_id),
            (edit(&|v| v["environments"][0]["currentRevisionId"] = "../rev".into()), unsafe_id),
            (edit(&|v| v["environments"][0]["runtimeRevisionId"] = "rev-/x".into()), unsafe_id),
            (edit(&|v| v["environments"][0]["baseEnvironmentId"] = "/etc".into()), unsafe_id),
            (edit(&|v| v["revisions"][0]["id"] = "rev-X".into()), unsafe_id),
            (edit(&|v| v["revisions"][0]["environmentId"] = "starter-julia".into()), unsafe_id),
            (edit(&|v| v["environments"][0]["status"] = "broken".into()), "Environment catalog is not valid"),
            (
                edit(&|v| {
                    let twin = v["revisions"][0].clone();
                    v["revisions"].as_array_mut().unwrap().push(twin);
                }),
                "Environment catalog lists rev-01 twice",
            ),
            (
                edit(&|v| {
                    let mut twin = v["environments"][0].clone();
                    twin["id"] = "task-cd".into();
                    twin["name"] = "TASK-AB".into();
                    v["environments"].as_array_mut().unwrap().push(twin);
                }),
                "Environment catalog lists task-ab twice",
            ),
        ];
        for (bytes, want) in cases {
            std::fs::write(&path, &bytes).unwrap();
            assert_eq!(
                Catalog::load(&dir).unwrap_err().to_string(),
                want,
                "{}",
                String::from_utf8_lossy(&bytes)
            );
        }
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
        assert!(matches!(Catalog::load(&dir), Err(CatalogError::NotRegular)));
        // A catalog holding an unsafe id is never written either.
        let mut bad = Catalog::default();
        bad.environments.push(environment("task-../x", "rev-01"));
        assert_eq!(bad.save(&dir).unwrap_err().to_string(), unsafe_id);
    }

    #[test]
    fn an_original_catalog_without_the_optional_fields_loads() {
        let text = r#"{"environments":[{"id":"starter-r","name":"R","kind":"starter","language":"r","status":"ready","currentRevisionId":"rev-02","createdAt":"a","updatedAt":"b"}],"revisions":[],"version":1}"#;
        let c = Catalog::parse(text.as_bytes()).unwrap();
        let env = c.environment("starter-r").unwrap();
        assert_eq!(env.runtime_revision(), "rev-02");
        assert_eq!(env.prefix_rel().unwrap(), PathBuf::from("revisions/starter-r/rev-02"));
        assert_eq!(c.environments.iter().map(|e| e.language.as_str()).collect::<Vec<_>>(), ["r"]);
    }

    #[test]
    fn starters() {
        for language in [Language::Python, Language::R] {
            ids::check_specs(language.default_starter_specs()).unwrap();
            ids::check_env_id(language.starter_id()).unwrap();
        }
        assert_eq!(Language::R.starter_id(), "starter-r");
    }

    #[test]
    fn update_transitions_and_recovery() {
        let mut c = Catalog::default();
        c.environments.push(environment("task-ab", "rev-01"));
        c.environments.push(environment("task-cd", "rev-02"));
        c.revisions.push(revision("task-ab", "rev-01"));
        assert!(!c.recover_interrupted("t0"));

        assert!(c.begin_update("task-ab", "t1"));
        assert!(!c.begin_update("task-ef", "t1"));
        assert_eq!(c.environment("task-ab").unwrap().status, Status::Updating);
        assert!(c.fail_update("task-ab", "t2"));
        let env = c.environment("task-ab").unwrap();
        assert_eq!(
            (env.status, env.error.as_deref(), env.current_revision_id.as_str()),
            (Status::Failed, Some(UPDATE_FAILED), "rev-01")
        );

        assert!(c.begin_update("task-ab", "t3"));
        assert!(c.commit_revision(revision("task-ab", "rev-03"), "t4"));
        let env = c.environment("task-ab").unwrap();
        assert_eq!(
            (env.status, env.error.as_deref(), env.current_revision_id.as_str()),
            (Status::Ready, None, "rev-03")
        );
        assert_eq!(
            env.prefix_rel().unwrap(),
            PathBuf::from("revisions/task-ab/rev-01"),
            "updates are in place"
        );
        assert_eq!(env.updated_at, "t4");
        assert_eq!(
            c.revisions_of("task-ab").map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["rev-01", "rev-03"]
        );
        assert!(c.revision("rev-03").is_some());
        assert!(!c.commit_revision(revision("task-zz", "rev-04"), "t5"));
        assert!(c.revision("rev-04").is_none());

        assert!(c.begin_update("task-cd", "t6"));
        assert!(c.recover_interrupted("t7"));
        let env = c.environment("task-cd").unwrap();
        assert_eq!(
            (env.status, env.error.as_deref(), env.updated_at.as_str()),
            (Status::Failed, Some(UPDATE_INTERRUPTED), "t7")
        );
        assert_eq!(c.environment("task-ab").unwrap().status, Status::Ready);
        assert!(!c.recover_interrupted("t8"));
    }

    #[test]
    fn the_store_and_its_environment_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let (path, store) = open_store(tmp.path()).unwrap();
        assert_eq!(path, tmp.path().canonicalize().unwrap().join("scientific-envs"));
        let mode = |p: &str| {
            let m = std::fs::symlink_metadata(tmp.path().join(p)).unwrap();
            std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777
        };
        assert_eq!((mode("scientific-envs"), mode("scientific-envs/revisions")), (0o755, 0o755));
        open_store(tmp.path()).unwrap();

        ensure_env_dir(&store, "task-ab").unwrap();
        std::fs::create_dir_all(tmp.path().join("scientific-envs/revisions/task-ab/rev-01/bin")).unwrap();
        assert_eq!(mode("scientific-envs/revisions/task-ab"), 0o755);
        assert!(matches!(ensure_env_dir(&store, "../x"), Err(CatalogError::Id(_))));
        remove_env_dir(&store, "task-ab").unwrap();
        remove_env_dir(&store, "task-ab").unwrap();
        assert!(!tmp.path().join("scientific-envs/revisions/task-ab").exists());
        assert!(matches!(remove_env_dir(&store, "task-../.."), Err(CatalogError::Id(_))));

        // A store that is a symlink is refused, whatever it points at.
        let other = tempfile::tempdir().unwrap();
        std::fs::create_dir(other.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(other.path().join("elsewhere"), other.path().join("scientific-envs"))
            .unwrap();
        assert_eq!(
            open_store(other.path()).unwrap_err().to_string(),
            "Could not open scientific-envs of the scientific-environment store"
        );
    }

    #[test]
    fn temporaries_are_swept() {
        let (tmp, _) = store();
        let dir = fsat::open_path(tmp.path(), libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
        std::fs::write(tmp.path().join("catalog.json.12.abc.tmp"), "").unwrap();
        std::fs::write(tmp.path().join("catalog.json"), "{}").unwrap();
        std::fs::write(tmp.path().join("other.tmp"), "").unwrap();
        assert_eq!(Catalog::sweep_temporaries(&dir), 1);
        assert!(tmp.path().join("catalog.json").exists() && tmp.path().join("other.tmp").exists());
    }
}
