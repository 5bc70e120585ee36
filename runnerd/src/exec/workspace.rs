//! Which directory a request may run in (contract §2A "Workspace identification", "cwd"):
//! remote workspace keys, the projects/remote-workspaces roots by realpath, and `cwd`.
//! Validation of names is pure; the rest is a thin layer over the filesystem that never
//! follows a symlink it did not resolve first.

use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::api::error::ApiError;
use crate::sandbox::user::Identity;

pub const REMOTE_WORKSPACES: &str = "remote-workspaces";
pub const PROJECTS: &str = "projects";

fn invalid_key() -> ApiError {
    ApiError::bad_request("invalid_workspace_key", "Invalid remote workspace key")
}

fn symlinked() -> ApiError {
    ApiError::bad_request("workspace_symlink", "Remote workspace path must not contain symbolic links")
}

/// Splits a `runnerWorkspaceKey` into its segments: trimmed, 1–500 characters, no `\`,
/// relative, each `/` segment non-empty, not `.` or `..`, and `[A-Za-z0-9._-]+`.
pub fn key_segments(key: &str) -> Result<Vec<&str>, ApiError> {
    let key = key.trim();
    if key.is_empty() || key.chars().count() > 500 || key.contains('\\') || key.starts_with('/') {
        return Err(invalid_key());
    }
    let segments: Vec<&str> = key.split('/').collect();
    for segment in &segments {
        let charset_ok = segment.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if segment.is_empty() || *segment == "." || *segment == ".." || !charset_ok {
            return Err(invalid_key());
        }
    }
    Ok(segments)
}

/// Node's message for a failed `realpath`, which the original passes through as the 400
/// text (`ENOENT: no such file or directory, realpath '…'`).
pub fn realpath_error(path: &Path, e: &io::Error) -> ApiError {
    let code = e.raw_os_error().map(errno_name).unwrap_or("EIO");
    let text = match e.raw_os_error() {
        Some(libc::ENOENT) => "no such file or directory".to_owned(),
        Some(libc::ENOTDIR) => "not a directory".to_owned(),
        Some(libc::EACCES) => "permission denied".to_owned(),
        Some(libc::ELOOP) => "too many symbolic links encountered".to_owned(),
        _ => e.to_string(),
    };
    ApiError::bad_request("path_not_found", format!("{code}: {text}, realpath '{}'", path.display()))
}

fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::ENOENT => "ENOENT",
        libc::ENOTDIR => "ENOTDIR",
        libc::EACCES => "EACCES",
        libc::ELOOP => "ELOOP",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        _ => "EIO",
    }
}

/// `<data>/remote-workspaces/<key>`, created one segment at a time; every segment must be a
/// real directory (never a symlink), and the result must stay inside the data directory.
/// The key's segments runnerd creates belong to the sandbox user (`owner`).
pub fn ensure_remote_workspace(data_dir: &Path, key: &str, owner: &Identity) -> Result<PathBuf, ApiError> {
    let segments = key_segments(key)?;
    fs::create_dir_all(data_dir).map_err(|e| {
        ApiError::bad_request(
            "workspace_create_failed",
            format!("Could not create the data directory {}: {e}", data_dir.display()),
        )
    })?;
    // Walk by descriptor: each segment is created with mkdirat and opened with O_NOFOLLOW
    // relative to the previous one, so a segment swapped for a symlink mid-walk is refused
    // and nothing is ever created through it.
    let data_real = fs::canonicalize(data_dir).map_err(|e| realpath_error(data_dir, &e))?;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| invalid_key());
    let root = std::ffi::CString::new(data_real.as_os_str().as_bytes()).map_err(|_| invalid_key())?;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
    // SAFETY: opens a path as a new descriptor; the result is checked.
    let mut dir =
        cvt_fd(unsafe { libc::open(root.as_ptr(), flags) }).map_err(|e| realpath_error(data_dir, &e))?;
    let mut path = data_dir.to_owned();
    for segment in std::iter::once(REMOTE_WORKSPACES).chain(segments) {
        path.push(segment);
        let name = c(segment)?;
        // SAFETY: mkdirat relative to a directory descriptor we own.
        let made = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) };
        if made == -1 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::AlreadyExists {
                return Err(ApiError::bad_request(
                    "workspace_create_failed",
                    format!("Could not create remote workspace directory {}: {e}", path.display()),
                ));
            }
        }
        // SAFETY: openat relative to a directory descriptor we own; O_NOFOLLOW refuses a symlink.
        dir = cvt_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_NOFOLLOW) })
            .map_err(|_| symlinked())?;
        if made == 0 && segment != REMOTE_WORKSPACES {
            owner.hand_over(dir.as_fd()).map_err(|e| {
                ApiError::bad_request(
                    "workspace_create_failed",
                    format!("Could not hand remote workspace directory {key:?} to the sandbox user: {e}"),
                )
            })?;
        }
    }
    let real = fs::canonicalize(&path).map_err(|e| realpath_error(&path, &e))?;
    if !real.starts_with(&data_real) {
        return Err(ApiError::bad_request(
            "workspace_escape",
            "Remote workspace escapes the runner data directory",
        ));
    }
    Ok(path)
}

/// `realpath(path)`, which must equal or lie under `realpath(<data>/projects)` or
/// `realpath(<data>/remote-workspaces)` (the latter only if it is not itself a symlink).
pub fn validated_workspace(data_dir: &Path, path: &Path) -> Result<PathBuf, ApiError> {
    let real = fs::canonicalize(path).map_err(|e| realpath_error(path, &e))?;
    let projects = data_dir.join(PROJECTS);
    let remote = data_dir.join(REMOTE_WORKSPACES);
    let mut roots = Vec::new();
    if let Ok(r) = fs::canonicalize(&projects) {
        roots.push(r);
    }
    if fs::symlink_metadata(&remote).is_ok_and(|m| !m.file_type().is_symlink())
        && let Ok(r) = fs::canonicalize(&remote)
    {
        roots.push(r);
    }
    if !roots.iter().any(|root| real.starts_with(root)) {
        return Err(ApiError::bad_request(
            "workspace_outside_roots",
            "Runner workspace must be inside the configured projects or remote-workspaces directory",
        ));
    }
    if !real.is_dir() {
        return Err(ApiError::bad_request("workspace_not_directory", "Runner workspace must be a directory"));
    }
    Ok(real)
}

/// Resolves a shell request's `cwd` against the (canonical) writable root; returns the
/// relative path to use below the mount point (`""` for the root itself).
pub fn resolve_cwd(root: &Path, cwd: &str) -> Result<String, ApiError> {
    if Path::new(cwd).is_absolute() {
        return Err(ApiError::bad_request("invalid_cwd", "cwd must be workspace-relative"));
    }
    let joined = root.join(cwd);
    let real = fs::canonicalize(&joined).map_err(|e| realpath_error(&joined, &e))?;
    let rel = real
        .strip_prefix(root)
        .map_err(|_| ApiError::bad_request("invalid_cwd", "cwd must remain inside the writable workspace"))?;
    if !real.is_dir() {
        return Err(ApiError::bad_request("invalid_cwd", "cwd must be a directory"));
    }
    debug_assert!(rel.components().all(|c| matches!(c, Component::Normal(_))));
    Ok(rel.to_string_lossy().into_owned())
}

/// Opens `path` (canonical, inside `data_dir`) as an `O_PATH` directory descriptor, one
/// component at a time from the data directory, refusing every symlink on the way. The
/// directory a sandbox gets is the one opened here, whatever happens to the path after
/// (bwrap binds it with `--bind-fd`): a workspace that another sandbox renamed or replaced
/// by a symlink between validation and launch is refused instead of followed.
pub fn open_beneath(data_dir: &Path, path: &Path) -> Result<OwnedFd, ApiError> {
    let escaped = || {
        ApiError::bad_request(
            "workspace_symlink",
            "Runner workspace changed under it: a path component is now a symbolic link or missing",
        )
    };
    let data_real = fs::canonicalize(data_dir).map_err(|e| realpath_error(data_dir, &e))?;
    let rel = path.strip_prefix(&data_real).map_err(|_| escaped())?;
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
    let c = |p: &std::ffi::OsStr| std::ffi::CString::new(p.as_bytes()).map_err(|_| escaped());
    let root = c(data_real.as_os_str())?;
    // SAFETY: opens a path we own as a new descriptor; the result is checked.
    let mut dir = cvt_fd(unsafe { libc::open(root.as_ptr(), flags) }).map_err(|_| escaped())?;
    for component in rel.components() {
        let Component::Normal(name) = component else { return Err(escaped()) };
        let name = c(name)?;
        // SAFETY: openat relative to a directory descriptor we own; O_NOFOLLOW with
        // O_PATH|O_DIRECTORY refuses a symlink (ENOTDIR/ELOOP) instead of following it.
        dir = cvt_fd(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_NOFOLLOW) })
            .map_err(|_| escaped())?;
    }
    Ok(dir)
}

fn cvt_fd(fd: libc::c_int) -> io::Result<OwnedFd> {
    let fd = common::sys::cvt(fd)?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// runnerd's own user (`--dev` so that a root test run gets nobody).
    fn me() -> Identity {
        crate::sandbox::user::resolve(None, true).unwrap()
    }

    #[test]
    fn key_table() {
        let ok = ["project/session", "project/session/agents/child", "a", "A.b-c_d", " padded "];
        for key in ok {
            assert!(key_segments(key).is_ok(), "{key:?}");
        }
        let long = "a".repeat(501);
        let bad = [
            "",
            "   ",
            "../x",
            "/abs",
            "a//b",
            "a\\b",
            "a/./b",
            "a/../b",
            "a/",
            "a b",
            "ü",
            "a/..",
            long.as_str(),
        ];
        for key in bad {
            assert_eq!(key_segments(key).unwrap_err().message, "Invalid remote workspace key", "{key:?}");
        }
        assert!(key_segments(&"a".repeat(500)).is_ok());
    }

    #[test]
    fn remote_workspaces_are_created_segment_by_segment_without_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path();
        let ws = ensure_remote_workspace(data, "project/session/agents/child", &me()).unwrap();
        assert!(ws.is_dir());
        assert!(ws.ends_with("remote-workspaces/project/session/agents/child"));

        // A symlinked segment is refused and nothing is created through it.
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        symlink(&outside, data.join("remote-workspaces/escape")).unwrap();
        let err = ensure_remote_workspace(data, "escape/child", &me()).unwrap_err();
        assert_eq!(err.message, "Remote workspace path must not contain symbolic links");
        assert!(!outside.join("child").exists());
    }

    #[test]
    fn a_symlinked_remote_workspaces_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir_all(&data).unwrap();
        fs::create_dir_all(&elsewhere).unwrap();
        symlink(&elsewhere, data.join("remote-workspaces")).unwrap();
        assert!(ensure_remote_workspace(&data, "k", &me()).is_err());
        assert!(!elsewhere.join("k").exists());
        // And a path under it is not accepted as a root either.
        let err = validated_workspace(&data, &elsewhere).unwrap_err();
        assert!(err.message.contains("must be inside"));
    }

    #[test]
    fn validated_workspace_table() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let project_ws = data.join("projects/p/sessions/s/workspace");
        fs::create_dir_all(&project_ws).unwrap();
        fs::create_dir_all(data.join("logs")).unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        symlink(&outside, project_ws.join("link")).unwrap();

        assert_eq!(validated_workspace(&data, &project_ws).unwrap(), project_ws.canonicalize().unwrap());
        // Only remote-workspaces, no projects: fine.
        let data2 = dir.path().join("data2");
        let remote_ws = ensure_remote_workspace(&data2, "k/s", &me()).unwrap();
        assert!(validated_workspace(&data2, &remote_ws).is_ok());
        // Escapes and other subdirectories.
        for bad in [data.join("logs"), project_ws.join("link"), outside.clone(), data.clone()] {
            let err = validated_workspace(&data, &bad).unwrap_err();
            assert!(err.message.contains("workspace must be inside"), "{}: {}", bad.display(), err.message);
        }
        let missing = data.join("projects/nope");
        let err = validated_workspace(&data, &missing).unwrap_err();
        assert_eq!(
            err.message,
            format!("ENOENT: no such file or directory, realpath '{}'", missing.display())
        );
    }

    #[test]
    fn opening_beneath_refuses_a_swapped_in_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let child = ensure_remote_workspace(&data, "t/s/agents/c", &me()).unwrap();
        let child = validated_workspace(&data, &child).unwrap();
        let fd = open_beneath(&data, &child).unwrap();
        fs::write(child.join("mine.txt"), "x").unwrap();
        assert!(crate::fsat::fd_dir_path(&fd).join("mine.txt").exists());
        // The parent's sandbox swaps the child for a symlink to somewhere else.
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let agents = child.parent().unwrap().to_owned();
        fs::rename(&child, agents.join("c.old")).unwrap();
        symlink(&outside, &child).unwrap();
        assert!(open_beneath(&data, &child).is_err());
        // A descriptor opened before the swap still names the original directory.
        assert!(crate::fsat::fd_dir_path(&fd).join("mine.txt").exists());
        assert!(!outside.join("mine.txt").exists());
    }

    #[test]
    fn cwd_table() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ws");
        fs::create_dir_all(root.join("analysis/run1")).unwrap();
        fs::write(root.join("file.txt"), "").unwrap();
        symlink(dir.path(), root.join("up")).unwrap();
        let root = root.canonicalize().unwrap();
        assert_eq!(resolve_cwd(&root, "analysis").unwrap(), "analysis");
        assert_eq!(resolve_cwd(&root, "analysis/run1/..").unwrap(), "analysis");
        assert_eq!(resolve_cwd(&root, ".").unwrap(), "");
        let cases = [
            ("/etc", "cwd must be workspace-relative"),
            ("../../..", "cwd must remain inside the writable workspace"),
            ("up", "cwd must remain inside the writable workspace"),
            ("file.txt", "cwd must be a directory"),
        ];
        for (cwd, message) in cases {
            assert_eq!(resolve_cwd(&root, cwd).unwrap_err().message, message, "{cwd}");
        }
        assert!(resolve_cwd(&root, "missing").unwrap_err().message.starts_with("ENOENT"));
    }
}
