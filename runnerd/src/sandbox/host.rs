//! Host facts a sandbox needs, detected once at start-up: the one-line `/etc/passwd` and
//! `/etc/group` for the sandbox user (the launcher hands them to bwrap as data, see
//! [`crate::launch::LaunchIdentity`]), the read-only `/etc` pieces that
//! make TLS and fonts work (CA certificates, alternatives), and the host interpreters to
//! mask when a science environment is mounted. Each decision is a pure function; the
//! `detect_*` functions are the thin I/O around them.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

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

/// Which interpreter binaries to mask, given `/usr/bin` entries and their resolved targets
/// (`None`: dangling). Only targets are masked — bwrap cannot bind over a symlink — and
/// names sharing a target collapse into one mask (internals §2.4).
pub fn mask_targets(entries: &[(String, Option<PathBuf>)]) -> Vec<PathBuf> {
    let mut targets: Vec<PathBuf> = entries
        .iter()
        .filter(|(name, _)| is_interpreter_name(name))
        .filter_map(|(_, target)| target.clone())
        .collect();
    targets.sort();
    targets.dedup();
    targets
}

/// `python`, `python3`, `python3.N`, `R`, `Rscript`.
fn is_interpreter_name(name: &str) -> bool {
    if name == "R" || name == "Rscript" || name == "python" || name == "python3" {
        return true;
    }
    name.strip_prefix("python3.").is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

/// Scans `bin_dir` (normally `/usr/bin`) for interpreters and resolves each.
pub fn detect_interpreter_masks(bin_dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut entries = Vec::new();
    for entry in fs::read_dir(bin_dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_interpreter_name(&name) {
            entries.push((name, fs::canonicalize(entry.path()).ok()));
        }
    }
    Ok(mask_targets(&entries))
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

    #[test]
    fn masks_by_target() {
        let e = |n: &str, t: Option<&str>| (n.to_owned(), t.map(PathBuf::from));
        let entries = vec![
            e("python", Some("/usr/bin/python3.11")),
            e("python3", Some("/usr/bin/python3.11")),
            e("python3.11", Some("/usr/bin/python3.11")),
            e("python3.x", Some("/usr/bin/python3.11")),
            e("pythonic-tool", Some("/usr/bin/pythonic-tool")),
            e("R", Some("/usr/lib/R/bin/R")),
            e("Rscript", None),
        ];
        assert_eq!(
            mask_targets(&entries),
            [PathBuf::from("/usr/bin/python3.11"), PathBuf::from("/usr/lib/R/bin/R")]
        );
    }

    #[test]
    fn detection_on_a_real_directory() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("python3.12");
        fs::write(&real, "").unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("python3")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("missing"), dir.path().join("Rscript")).unwrap();
        fs::write(dir.path().join("pythonic-tool"), "").unwrap();
        let masks = detect_interpreter_masks(dir.path()).unwrap();
        assert_eq!(masks, [fs::canonicalize(&real).unwrap()]);
        assert!(masks.iter().all(|m| !fs::symlink_metadata(m).unwrap().file_type().is_symlink()));
    }
}
