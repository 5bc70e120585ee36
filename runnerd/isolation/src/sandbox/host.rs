//! Host facts a sandbox needs, detected once at start-up: the one-line `/etc/passwd` and
//! `/etc/group` for the sandbox user (the launcher hands them to bwrap as data, see
//! [`crate::launch::LaunchIdentity`]), the read-only `/etc` pieces that
//! make TLS and fonts work (CA certificates, alternatives), and which `python-packages`
//! directory an execution binds. Each decision is a pure function; the `detect_*` functions
//! are the thin I/O around them.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use runner_store::fsat;

/// Read-only binds and environment the sandbox gets from the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostRuntime {
    /// Host paths bound read-only at the same place.
    pub ro_binds: Vec<PathBuf>,
    /// CA variables (`SSL_CERT_FILE`, `CURL_CA_BUNDLE`, `REQUESTS_CA_BUNDLE`, `SSL_CERT_DIR`).
    pub env: Vec<(String, String)>,
}

impl HostRuntime {
    pub fn bind_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        for path in &self.ro_binds {
            let p = path.to_string_lossy().into_owned();
            args.extend(["--ro-bind".to_owned(), p.clone(), p]);
        }
        args
    }

    pub fn env(&self) -> Vec<(String, String)> {
        self.env.clone()
    }
}

const ETC_DIRS: &[&str] = &["/etc/alternatives", "/etc/fonts"];
const CERT_DIRS: &[&str] = &["/etc/ssl/certs", "/etc/pki/tls/certs", "/etc/pki/ca-trust"];
const CERT_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Which `/etc` pieces to bind and which CA variables to set, given which paths exist
/// (internals §2.2 item 8, §2.3 item 7).
pub fn etc_runtime(exists: impl Fn(&Path) -> bool) -> (Vec<PathBuf>, Vec<(String, String)>) {
    let mut binds: Vec<PathBuf> = ETC_DIRS.iter().map(PathBuf::from).filter(|p| exists(p)).collect();
    let cert_dirs: Vec<PathBuf> = CERT_DIRS.iter().map(PathBuf::from).filter(|p| exists(p)).collect();
    binds.extend(cert_dirs.iter().cloned());
    let mut env = Vec::new();
    if let Some(bundle) = CERT_BUNDLES.iter().map(PathBuf::from).find(|p| exists(p)) {
        if !cert_dirs.iter().any(|d| bundle.starts_with(d)) {
            binds.push(bundle.clone());
        }
        let b = bundle.to_string_lossy().into_owned();
        for key in ["SSL_CERT_FILE", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE"] {
            env.push((key.to_owned(), b.clone()));
        }
    }
    if let Some(dir) = cert_dirs.first() {
        env.push(("SSL_CERT_DIR".to_owned(), dir.to_string_lossy().into_owned()));
    }
    (binds, env)
}

/// The sandbox user's name: the host user's if it is safe in a passwd line, else a fixed one.
pub fn sandbox_user_name(host_name: Option<&str>) -> &str {
    match host_name {
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) => n,
        _ => "sciencediscovery",
    }
}

/// One-line `passwd` and `group` files for the sandbox user (home `/tmp`).
pub fn identity_lines(name: &str, uid: u32, gid: u32) -> (String, String) {
    (
        format!("{name}:x:{uid}:{gid}:ScienceDiscovery sandbox user:/tmp:/bin/sh\n"),
        format!("{name}:x:{gid}:\n"),
    )
}

/// Detects the `/etc` binds and CA variables.
pub fn detect_host_runtime() -> HostRuntime {
    let (ro_binds, env) = etc_runtime(|p| p.exists());
    HostRuntime { ro_binds, env }
}

/// Where `<dataDir>/python-packages` appears inside the sandbox (contract §2A env rules).
pub const PYTHON_PACKAGES_MOUNT: &str = "/opt/sciencediscovery-python-packages";

/// `X.Y` from an interpreter's file name (`python3.12` → `(3, 12)`), the version whose
/// `pyX.Y` directory is preferred.
pub fn python_version_of(file_name: &str) -> Option<(u32, u32)> {
    let (major, minor) = file_name.strip_prefix("python")?.split_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(major) && digits(minor)).then(|| Some((major.parse().ok()?, minor.parse().ok()?)))?
}

/// Which directory under `python-packages` to bind, in the original's order: `pyX.Y` for the
/// interpreter's version, else `py3`, else the directory itself (internals §2.2 item 17).
pub fn python_packages_candidates(version: Option<(u32, u32)>) -> Vec<String> {
    let mut out: Vec<String> = version.map(|(x, y)| format!("py{x}.{y}")).into_iter().collect();
    out.extend(["py3".to_owned(), ".".to_owned()]);
    out
}

/// Why `<dataDir>/python-packages` is not bound although it exists.
#[derive(Debug, thiserror::Error)]
pub enum PackagesError {
    #[error("{} cannot be opened as a directory without following a symlink", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{} is writable by group or others (mode {mode:o}) or owned by uid {owner}, neither root nor \
         runnerd: a sandbox-reachable user could change what every sandbox imports",
        path.display()
    )]
    Unsafe { path: PathBuf, mode: u32, owner: u32 },
    #[error("the sandbox user cannot search {} (mode {mode:o}); bwrap resolves the bind as that user", blocked.display())]
    Unreachable { blocked: PathBuf, mode: u32 },
}

/// Finds the directory to bind for `python` (the configured interpreter's path), if
/// `<data_dir>/python-packages` exists. Every component below the data directory is opened
/// `O_NOFOLLOW` relative to its parent and must be a directory owned by root or by runnerd
/// and writable by neither group nor others; the sandbox user must be able to reach it.
/// Ran per execution, so packages an operator adds are seen without a restart.
pub fn detect_python_packages(
    data_dir: &Path,
    python: &str,
    sandbox_user: &super::user::Identity,
) -> Result<Option<PathBuf>, PackagesError> {
    use std::os::unix::fs::MetadataExt;
    let base = data_dir.join(common::layout::PYTHON_PACKAGES);
    let open_in = |dir: &fs::File, name: &str| -> io::Result<fs::File> {
        let name = std::ffi::CString::new(name).map_err(io::Error::other)?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        fsat::open_at(dir, &name, flags).map(fs::File::from)
    };
    let check = |file: &fs::File, path: &Path| -> Result<(), PackagesError> {
        let m = file.metadata().map_err(|source| PackagesError::Open { path: path.to_owned(), source })?;
        let own = nix::unistd::geteuid().as_raw();
        if m.mode() & 0o022 != 0 || (m.uid() != 0 && m.uid() != own) {
            return Err(PackagesError::Unsafe {
                path: path.to_owned(),
                mode: m.mode() & 0o7777,
                owner: m.uid(),
            });
        }
        Ok(())
    };
    let root = match fs::File::open(data_dir).and_then(|data| open_in(&data, common::layout::PYTHON_PACKAGES))
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(PackagesError::Open { path: base, source }),
    };
    check(&root, &base)?;
    let version = fs::canonicalize(python)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .and_then(|n| python_version_of(&n));
    for candidate in python_packages_candidates(version) {
        let (path, dir) = if candidate == "." {
            (
                base.clone(),
                root.try_clone().map_err(|source| PackagesError::Open { path: base.clone(), source })?,
            )
        } else {
            let path = base.join(&candidate);
            match open_in(&root, &candidate) {
                Ok(f) => (path, f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => return Err(PackagesError::Open { path, source }),
            }
        };
        check(&dir, &path)?;
        if let Some((blocked, mode)) = super::user::unreachable_component(sandbox_user, &path) {
            return Err(PackagesError::Unreachable { blocked, mode });
        }
        return Ok(Some(path));
    }
    Ok(None)
}

/// [`detect_python_packages`] for one execution: a directory that exists but may not be
/// bound is logged and left out (the execution runs without it, as if it were absent).
pub fn python_packages_for_execution(
    data_dir: &Path,
    python: &str,
    sandbox_user: &super::user::Identity,
) -> Option<PathBuf> {
    detect_python_packages(data_dir, python, sandbox_user).unwrap_or_else(|e| {
        tracing::warn!(event = "python_packages_skipped", error = %common::error_chain(&e));
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn etc_runtime_table() {
        let debian: HashSet<&str> =
            ["/etc/alternatives", "/etc/ssl/certs", "/etc/ssl/certs/ca-certificates.crt"].into();
        let (binds, env) = etc_runtime(|p| debian.contains(p.to_str().unwrap()));
        assert_eq!(binds, [PathBuf::from("/etc/alternatives"), PathBuf::from("/etc/ssl/certs")]);
        assert_eq!(env.len(), 4);
        assert_eq!(env[0], ("SSL_CERT_FILE".into(), "/etc/ssl/certs/ca-certificates.crt".into()));
        assert_eq!(env[3], ("SSL_CERT_DIR".into(), "/etc/ssl/certs".into()));

        // A bundle outside every bound directory gets its own bind.
        let alpine: HashSet<&str> = ["/etc/ssl/cert.pem"].into();
        let (binds, env) = etc_runtime(|p| alpine.contains(p.to_str().unwrap()));
        assert_eq!(binds, [PathBuf::from("/etc/ssl/cert.pem")]);
        assert_eq!(env.len(), 3);

        let (binds, env) = etc_runtime(|_| false);
        assert!(binds.is_empty() && env.is_empty());
    }

    #[test]
    fn python_packages_choice_table() {
        let cases: &[(&str, Option<(u32, u32)>)] = &[
            ("python3.12", Some((3, 12))),
            ("python3.9", Some((3, 9))),
            ("python3", None),
            ("python", None),
            ("python3.", None),
            ("python3.x", None),
            ("pypy3.10", None),
            ("python3.12.1", None),
        ];
        for (name, want) in cases {
            assert_eq!(python_version_of(name), *want, "{name}");
        }
        assert_eq!(python_packages_candidates(Some((3, 12))), ["py3.12", "py3", "."]);
        assert_eq!(python_packages_candidates(None), ["py3", "."]);
    }

    #[test]
    fn python_packages_detection_prefers_the_version_and_refuses_symlinks_and_shared_dirs() {
        use std::os::unix::fs::PermissionsExt;
        let me = crate::sandbox::user::Identity {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            name: "me".into(),
            origin: crate::sandbox::user::Origin::Runner,
        };
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path();
        let python = data.join("python3.11");
        fs::write(&python, "").unwrap();
        let py = python.to_str().unwrap();
        assert!(detect_python_packages(data, py, &me).unwrap().is_none(), "absent: nothing bound");
        let base = data.join("python-packages");
        fs::create_dir(&base).unwrap();
        fs::set_permissions(&base, fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(detect_python_packages(data, py, &me).unwrap(), Some(base.clone()));
        fs::create_dir(base.join("py3")).unwrap();
        assert_eq!(detect_python_packages(data, py, &me).unwrap(), Some(base.join("py3")));
        fs::create_dir(base.join("py3.11")).unwrap();
        assert_eq!(detect_python_packages(data, py, &me).unwrap(), Some(base.join("py3.11")));
        // A planted symlink is never followed.
        fs::remove_dir(base.join("py3.11")).unwrap();
        std::os::unix::fs::symlink("/etc", base.join("py3.11")).unwrap();
        let err = detect_python_packages(data, py, &me).unwrap_err();
        assert!(matches!(err, PackagesError::Open { .. }), "{err}");
        fs::remove_file(base.join("py3.11")).unwrap();
        // A directory others may write is refused.
        fs::set_permissions(base.join("py3"), fs::Permissions::from_mode(0o777)).unwrap();
        let err = detect_python_packages(data, py, &me).unwrap_err();
        assert!(matches!(err, PackagesError::Unsafe { .. }), "{err}");
        // python-packages itself as a symlink: refused too.
        let elsewhere = data.join("elsewhere");
        fs::rename(&base, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &base).unwrap();
        assert!(matches!(detect_python_packages(data, py, &me), Err(PackagesError::Open { .. })));
    }

    #[test]
    fn user_names() {
        assert_eq!(sandbox_user_name(Some("alice")), "alice");
        assert_eq!(sandbox_user_name(Some("svc.runner-1_x")), "svc.runner-1_x");
        assert_eq!(sandbox_user_name(Some("bad:name")), "sciencediscovery");
        assert_eq!(sandbox_user_name(Some("new\nline")), "sciencediscovery");
        assert_eq!(sandbox_user_name(Some("")), "sciencediscovery");
        assert_eq!(sandbox_user_name(None), "sciencediscovery");
    }

    #[test]
    fn identity_is_one_line_each() {
        let (p, g) = identity_lines("alice", 1000, 1001);
        assert_eq!(p, "alice:x:1000:1001:ScienceDiscovery sandbox user:/tmp:/bin/sh\n");
        assert_eq!(g, "alice:x:1001:\n");
    }
}
