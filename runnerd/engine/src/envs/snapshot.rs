//! The v2 revision snapshot (internals §5.4): `snapshots/<revId>.json`, written once and
//! never overwritten, whose sha256 is the revision's `packageSpecHash` and `snapshot.hash`.
//!
//! The bytes are what the original's `JSON.stringify(snapshot, null, 2) + "\n"` writes:
//! serde_json's pretty printer indents by two spaces, puts `": "` between key and value and
//! writes the keys in struct order (the workspace builds serde_json with `preserve_order`,
//! so maps keep theirs too). The hash covers exactly these bytes, and every read re-checks
//! them, so a tampered snapshot is refused rather than served.

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;

use serde::{Deserialize, Serialize};

use super::catalog::{ContentRef, EnvironmentRevision, Language, LocalWheel, PROVISIONER, node_platform};
use super::disk::{self, Found};
use super::ids::{self, IdError, Manager};

pub const FORMAT: &str = "sciencediscovery-environment-revision-v2";
pub const RECONSTRUCTION_STATUS: &str = "reference-only";
pub const RECONSTRUCTION_REASON: &str =
    "Package inventory is retained; remote installation artifacts are not guaranteed to remain available.";
/// A snapshot larger than this is never read (an inventory of thousands of packages is a
/// few hundred KiB).
pub const MAX_SNAPSHOT_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Id(#[from] IdError),
    #[error("Environment revision snapshot already exists: {0}")]
    Exists(String),
    /// Missing, not a regular file, or bytes other than the recorded ones.
    #[error("Environment revision snapshot is corrupt: {0}")]
    Corrupt(String),
    #[error("Could not {0} the environment revision snapshot")]
    Io(&'static str, #[source] std::io::Error),
}

/// One conda package of the prefix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CondaPackage {
    pub name: String,
    pub version: String,
    pub build: String,
    pub channel: String,
}

impl From<&common::provision::Package> for CondaPackage {
    fn from(p: &common::provision::Package) -> Self {
        CondaPackage {
            name: p.name.clone(),
            version: p.version.clone(),
            build: p.build.clone(),
            channel: p.channel.clone(),
        }
    }
}

/// One Python distribution (`importlib.metadata`: name, version, `INSTALLER`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PythonPackage {
    pub name: String,
    pub version: String,
    pub installer: String,
}

/// One R package (`installed.packages()`: Package, Version, Repository).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RPackage {
    pub name: String,
    pub version: String,
    pub repository: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Installed {
    pub conda: Vec<CondaPackage>,
    pub python: Vec<PythonPackage>,
    pub r: Vec<RPackage>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconstruction {
    pub status: String,
    pub reason: String,
}

/// The snapshot, fields in the original's order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub format: String,
    pub channels: Vec<String>,
    pub created_at: String,
    pub environment_id: String,
    pub installed: Installed,
    /// What this revision's step asked for: `conda:scanpy=1.10`, `cran:survival`,
    /// `conda:remove:scanpy`.
    pub requested_changes: Vec<String>,
    pub reconstruction: Reconstruction,
    pub language: Language,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_wheels: Option<Vec<LocalWheel>>,
    pub packages: Vec<String>,
    pub platform: String,
    pub provisioner: String,
    pub revision_id: String,
}

/// What a provisioning step leaves to record.
#[derive(Debug, Clone)]
pub struct Parts {
    pub revision_id: String,
    pub environment_id: String,
    pub language: Language,
    pub created_at: String,
    /// The channels (or pip index) the step used; stored sorted and unique.
    pub channels: Vec<String>,
    pub requested_changes: Vec<String>,
    pub installed: Installed,
    /// `None` when the environment has none (the field is then absent).
    pub local_wheels: Option<Vec<LocalWheel>>,
}

impl Snapshot {
    /// The snapshot of a step, inventories sorted, `packages` derived from them, this
    /// runner's platform and provisioner.
    pub fn new(parts: Parts) -> Snapshot {
        let mut installed = parts.installed;
        sort_unique(&mut installed.conda);
        sort_unique(&mut installed.python);
        sort_unique(&mut installed.r);
        let mut channels = parts.channels;
        sort_unique(&mut channels);
        Snapshot {
            format: FORMAT.to_owned(),
            channels,
            created_at: parts.created_at,
            environment_id: parts.environment_id,
            packages: package_strings(&installed),
            installed,
            requested_changes: parts.requested_changes,
            reconstruction: Reconstruction {
                status: RECONSTRUCTION_STATUS.to_owned(),
                reason: RECONSTRUCTION_REASON.to_owned(),
            },
            language: parts.language,
            local_wheels: parts.local_wheels,
            platform: node_platform(),
            provisioner: PROVISIONER.to_owned(),
            revision_id: parts.revision_id,
        }
    }

    /// 2-space pretty JSON and a trailing newline: the file, and what the hash covers.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("a snapshot always serialises");
        bytes.push(b'\n');
        bytes
    }

    /// The revision record of this snapshot, once its bytes are stored as `stored`.
    pub fn revision(&self, stored: ContentRef) -> EnvironmentRevision {
        EnvironmentRevision {
            channels: self.channels.clone(),
            created_at: self.created_at.clone(),
            environment_id: self.environment_id.clone(),
            id: self.revision_id.clone(),
            language: self.language,
            language_version: language_version(self.language, &self.installed.conda),
            local_wheels: self.local_wheels.clone(),
            packages: self.packages.clone(),
            package_spec_hash: stored.hash.clone(),
            platform: self.platform.clone(),
            provisioner: self.provisioner.clone(),
            runner_version: crate::app::runner_version().to_owned(),
            snapshot: stored,
        }
    }

    /// Writes the snapshot once below the store `dir` and returns its revision record.
    pub fn record(&self, dir: &impl AsRawFd) -> Result<EnvironmentRevision, SnapshotError> {
        let stored = write_once(dir, &self.revision_id, &self.to_bytes())?;
        Ok(self.revision(stored))
    }
}

/// `requestedChanges` of an install: `<manager>:<package>` (`conda:scanpy=1.10`,
/// `cran:survival`, `pip:wheels/pkg-1.0-py3-none-any.whl`).
pub fn requested_install<S: AsRef<str>>(manager: Manager, packages: &[S]) -> Vec<String> {
    packages.iter().map(|p| format!("{}:{}", manager.as_str(), p.as_ref())).collect()
}

/// `requestedChanges` of an uninstall: `conda:remove:<package>`.
pub fn requested_removal<S: AsRef<str>>(packages: &[S]) -> Vec<String> {
    packages.iter().map(|p| format!("conda:remove:{}", p.as_ref())).collect()
}

fn sort_unique<T: Ord>(v: &mut Vec<T>) {
    v.sort();
    v.dedup();
}

/// The revision's `packages`: conda `name=ver=build` (`name=ver` without a build),
/// `python:<n>==<v>`, `r:<n>==<v>`; sorted, unique.
pub fn package_strings(installed: &Installed) -> Vec<String> {
    let conda = installed.conda.iter().map(|p| match p.build.is_empty() {
        true => format!("{}={}", p.name, p.version),
        false => format!("{}={}={}", p.name, p.version, p.build),
    });
    let python = installed.python.iter().map(|p| format!("python:{}=={}", p.name, p.version));
    let r = installed.r.iter().map(|p| format!("r:{}=={}", p.name, p.version));
    conda.chain(python).chain(r).collect::<BTreeSet<_>>().into_iter().collect()
}

/// `X.Y` of the installed interpreter package (`python` or `r-base`), `None` without one.
pub fn language_version(language: Language, conda: &[CondaPackage]) -> Option<String> {
    let name = match language {
        Language::Python => "python",
        Language::R => "r-base",
    };
    // The full version, as the original records it (`3.11.2`, not `3.11`: issue #30).
    conda.iter().find(|p| p.name == name).map(|p| p.version.clone())
}

/// `<revId>.json`, the id checked.
fn file_name(revision_id: &str) -> Result<String, IdError> {
    ids::check_revision_id(revision_id)?;
    Ok(format!("{revision_id}.json"))
}

/// Creates `snapshots/<revId>.json` below the store `dir` (`O_EXCL | O_NOFOLLOW`, 0600),
/// writes and fsyncs it and the directory. An existing snapshot is never replaced.
pub fn write_once(dir: &impl AsRawFd, revision_id: &str, bytes: &[u8]) -> Result<ContentRef, SnapshotError> {
    let name = file_name(revision_id)?;
    let snapshots = disk::ensure_dir(dir, common::layout::ENV_SNAPSHOTS, 0o700)
        .map_err(|e| SnapshotError::Io("open the directory of", e))?;
    match disk::write_new(&snapshots, &name, bytes, 0o600) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            return Err(SnapshotError::Exists(revision_id.to_owned()));
        }
        Err(e) => return Err(SnapshotError::Io("write", e)),
    }
    disk::sync_dir(&snapshots).map_err(|e| SnapshotError::Io("sync", e))?;
    Ok(ContentRef::of(bytes))
}

/// The snapshot's bytes if they are exactly the recorded ones (size and sha256); anything
/// else, a missing file included, is corrupt.
pub fn read_verified(
    dir: &impl AsRawFd,
    revision_id: &str,
    expected: &ContentRef,
) -> Result<Vec<u8>, SnapshotError> {
    let name = file_name(revision_id)?;
    let corrupt = || SnapshotError::Corrupt(revision_id.to_owned());
    if expected.size > MAX_SNAPSHOT_BYTES {
        return Err(corrupt());
    }
    let read = |e| SnapshotError::Io("read", e);
    let Some(snapshots) = disk::open_dir(dir, common::layout::ENV_SNAPSHOTS).map_err(read)? else {
        return Err(corrupt());
    };
    match disk::read_regular(&snapshots, &name, expected.size).map_err(read)? {
        Found::Bytes(bytes) if ContentRef::of(&bytes) == *expected => Ok(bytes),
        _ => Err(corrupt()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envs::catalog::WheelManager;
    use crate::fsat;

    fn conda(name: &str, version: &str, build: &str) -> CondaPackage {
        CondaPackage {
            name: name.into(),
            version: version.into(),
            build: build.into(),
            channel: "https://conda.anaconda.org/conda-forge".into(),
        }
    }

    fn parts() -> Parts {
        Parts {
            revision_id: "rev-0a".into(),
            environment_id: "task-ab".into(),
            language: Language::Python,
            created_at: "2026-12-01T00:00:00.000Z".into(),
            channels: vec!["https://z.example/ch".into(), "conda-forge".into(), "conda-forge".into()],
            requested_changes: vec!["conda:scanpy=1.10".into()],
            installed: Installed {
                conda: vec![
                    conda("python", "3.12.7", "hab00c5b_0_cpython"),
                    conda("numpy", "2.0.2", "py312h0"),
                ],
                python: vec![PythonPackage {
                    name: "pip".into(),
                    version: "24.2".into(),
                    installer: "conda".into(),
                }],
                r: vec![],
            },
            local_wheels: None,
        }
    }

    fn store() -> (tempfile::TempDir, std::os::fd::OwnedFd) {
        let tmp = tempfile::tempdir().unwrap();
        let fd = fsat::open_path(tmp.path(), libc::O_PATH | libc::O_DIRECTORY).unwrap();
        (tmp, fd)
    }

    #[test]
    fn the_bytes_are_the_originals() {
        let s = Snapshot::new(parts());
        let text = String::from_utf8(s.to_bytes()).unwrap();
        let platform = node_platform();
        let want = format!(
            r#"{{
  "format": "sciencediscovery-environment-revision-v2",
  "channels": [
    "conda-forge",
    "https://z.example/ch"
  ],
  "createdAt": "2026-12-01T00:00:00.000Z",
  "environmentId": "task-ab",
  "installed": {{
    "conda": [
      {{
        "name": "numpy",
        "version": "2.0.2",
        "build": "py312h0",
        "channel": "https://conda.anaconda.org/conda-forge"
      }},
      {{
        "name": "python",
        "version": "3.12.7",
        "build": "hab00c5b_0_cpython",
        "channel": "https://conda.anaconda.org/conda-forge"
      }}
    ],
    "python": [
      {{
        "name": "pip",
        "version": "24.2",
        "installer": "conda"
      }}
    ],
    "r": []
  }},
  "requestedChanges": [
    "conda:scanpy=1.10"
  ],
  "reconstruction": {{
    "status": "reference-only",
    "reason": "Package inventory is retained; remote installation artifacts are not guaranteed to remain available."
  }},
  "language": "python",
  "packages": [
    "numpy=2.0.2=py312h0",
    "python:pip==24.2",
    "python=3.12.7=hab00c5b_0_cpython"
  ],
  "platform": "{platform}",
  "provisioner": "runner-provisioner",
  "revisionId": "rev-0a"
}}
"#
        );
        assert_eq!(text, want);
    }

    /// serde_json's pretty printer against Node's `JSON.stringify(v, null, 2) + "\n"` on
    /// the characters where JSON writers differ (escapes, control characters, DEL,
    /// non-ASCII, U+2028/9, empty containers, numbers). The expected bytes are Node's
    /// output, pasted.
    #[test]
    fn pretty_json_is_what_node_writes() {
        let node = "{\n  \"format\": \"x\",\n  \"s\": \"quote\\\" back\\\\ slash/ tab\\t nl\\n cr\\r bs\\b ff\\f ctl\\u0001\\u001f del\u{7f} \u{e9} \u{4e2d} \u{1f600} \u{2028}\u{2029}\",\n  \"e\": [],\n  \"o\": {},\n  \"n\": null,\n  \"num\": [\n    0,\n    1,\n    -1,\n    1.5,\n    12345678901\n  ],\n  \"nested\": {\n    \"a\": [\n      {\n        \"b\": []\n      }\n    ]\n  }\n}\n";
        let value: serde_json::Value = serde_json::from_str(node).unwrap();
        let mut ours = serde_json::to_vec_pretty(&value).unwrap();
        ours.push(b'\n');
        assert_eq!(String::from_utf8(ours).unwrap(), node);
    }

    #[test]
    fn requested_changes() {
        assert_eq!(requested_install(Manager::Conda, &["scanpy=1.10"]), ["conda:scanpy=1.10"]);
        assert_eq!(requested_install(Manager::Cran, &["survival"]), ["cran:survival"]);
        assert_eq!(requested_install(Manager::Bioconductor, &["DESeq2"]), ["bioconductor:DESeq2"]);
        assert_eq!(requested_removal(&["scanpy"]), ["conda:remove:scanpy"]);
    }

    #[test]
    fn packages_and_language_versions() {
        let installed = Installed {
            conda: vec![conda("r-base", "4.4.1", "h1"), conda("zlib", "1.3", ""), conda("zlib", "1.3", "")],
            python: vec![],
            r: vec![RPackage { name: "survival".into(), version: "3.7-0".into(), repository: "CRAN".into() }],
        };
        assert_eq!(package_strings(&installed), ["r-base=4.4.1=h1", "r:survival==3.7-0", "zlib=1.3"]);
        let cases: &[(Language, &[CondaPackage], Option<&str>)] = &[
            (Language::R, &installed.conda, Some("4.4.1")),
            (Language::Python, &installed.conda, None),
            (Language::Python, &[conda("python", "3.13.0rc1", "h")], Some("3.13.0rc1")),
            (Language::Python, &[conda("python", "3", "h")], Some("3")),
            (Language::R, &[], None),
        ];
        for (language, conda, want) in cases {
            assert_eq!(language_version(*language, conda).as_deref(), *want);
        }
    }

    #[test]
    fn the_revision_record_carries_the_snapshot_hash() {
        let (tmp, dir) = store();
        let mut p = parts();
        p.local_wheels = Some(vec![LocalWheel {
            content: ContentRef { hash: "11".repeat(32), size: 9 },
            distribution: "example-pkg".into(),
            filename: "example_pkg-1.2.3-py3-none-any.whl".into(),
            manager: WheelManager::Pip,
            source_path: "wheels/example_pkg-1.2.3-py3-none-any.whl".into(),
            version: "1.2.3".into(),
        }]);
        let s = Snapshot::new(p);
        let rev = s.record(&dir).unwrap();
        let bytes = std::fs::read(tmp.path().join("snapshots/rev-0a.json")).unwrap();
        assert_eq!(bytes, s.to_bytes());
        assert_eq!(rev.snapshot, ContentRef::of(&bytes));
        assert_eq!(rev.package_spec_hash, rev.snapshot.hash);
        assert_eq!(rev.snapshot.hash.len(), 64);
        assert_eq!(rev.language_version.as_deref(), Some("3.12.7"));
        assert_eq!(rev.channels, ["conda-forge", "https://z.example/ch"]);
        assert_eq!(rev.packages, s.packages);
        assert_eq!((rev.id.as_str(), rev.environment_id.as_str()), ("rev-0a", "task-ab"));
        assert_eq!(rev.local_wheels, s.local_wheels);
        assert_eq!(rev.runner_version, crate::app::runner_version());
        let back: Snapshot = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_snapshot_is_written_once_and_read_only_when_intact() {
        let (tmp, dir) = store();
        let stored = write_once(&dir, "rev-01", b"{}\n").unwrap();
        assert_eq!(stored.size, 3);
        assert_eq!(read_verified(&dir, "rev-01", &stored).unwrap(), b"{}\n");
        assert!(matches!(write_once(&dir, "rev-01", b"[]\n"), Err(SnapshotError::Exists(_))));
        assert_eq!(std::fs::read(tmp.path().join("snapshots/rev-01.json")).unwrap(), b"{}\n");
        let mode = std::fs::metadata(tmp.path().join("snapshots/rev-01.json")).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);

        let corrupt = "Environment revision snapshot is corrupt: rev-01";
        let wrong_hash = ContentRef { hash: "00".repeat(32), size: 3 };
        assert_eq!(read_verified(&dir, "rev-01", &wrong_hash).unwrap_err().to_string(), corrupt);
        let shorter = ContentRef { size: 2, ..stored.clone() };
        assert_eq!(read_verified(&dir, "rev-01", &shorter).unwrap_err().to_string(), corrupt);
        // Tampered in place: same size, other bytes.
        std::fs::write(tmp.path().join("snapshots/rev-01.json"), b"[]\n").unwrap();
        assert_eq!(read_verified(&dir, "rev-01", &stored).unwrap_err().to_string(), corrupt);
        // Replaced by a symlink to the right bytes elsewhere: still refused.
        std::fs::write(tmp.path().join("elsewhere"), b"{}\n").unwrap();
        std::fs::remove_file(tmp.path().join("snapshots/rev-01.json")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("elsewhere"), tmp.path().join("snapshots/rev-01.json"))
            .unwrap();
        assert_eq!(read_verified(&dir, "rev-01", &stored).unwrap_err().to_string(), corrupt);
        assert!(matches!(read_verified(&dir, "rev-02", &stored), Err(SnapshotError::Corrupt(_))));
        assert!(matches!(write_once(&dir, "rev-../x", b""), Err(SnapshotError::Id(_))));
        assert!(matches!(read_verified(&dir, "../rev-01", &stored), Err(SnapshotError::Id(_))));
    }

    #[test]
    fn a_missing_snapshots_directory_reads_as_corrupt() {
        let (_tmp, dir) = store();
        let r = read_verified(&dir, "rev-01", &ContentRef { hash: String::new(), size: 0 });
        assert!(matches!(r, Err(SnapshotError::Corrupt(_))));
    }
}
