//! Which directory a request may run in (contract §2A "Workspace identification", "cwd"):
//! remote workspace keys, the projects/remote-workspaces roots, and `cwd`.
//!
//! Everything is resolved beneath the data directory with no symbolic link in any
//! component (a walk by descriptor, `O_NOFOLLOW` at every step), because a sandbox can plant
//! links in its own workspace: the original's `realpath` would follow `proj -> <another
//! tenant's workspace>`. The roots themselves (`projects`, `remote-workspaces`) and the
//! coordination directories are refused, and no error names a host path the caller did
//! not send. The policy on the resulting names is pure ([`workspace_names`]).
//!
//! Refusals are [`WorkspaceError`]s, whose texts are the contract's; runnerd gives each its
//! stable code (`EngineError`).

use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::fsat::{self, Stopped};
use crate::owner::HandOver;

pub use common::layout::{PROJECTS, REMOTE_WORKSPACES};

/// Names runnerd or the API keep in a workspace's parent (or the data directory): never a
/// workspace, a key segment or a part of a workspace path. The published skill packages
/// (`projects/.skill-packages`) are among them: mounted writable they could be rewritten.
pub const RESERVED_NAMES: [&str; 3] =
    [common::layout::COORDINATION_DIR, common::layout::LIFECYCLE_DIR, common::layout::SKILL_PACKAGES];

pub const OUTSIDE_ROOTS: &str =
    "Runner workspace must be inside the configured projects or remote-workspaces directory";
pub const IS_A_ROOT: &str = "Runner workspace must be a workspace inside the projects or remote-workspaces directory, not that directory itself";
pub const WORKSPACE_SYMLINK: &str = "Runner workspace path must not contain symbolic links";

/// Why a workspace, a remote workspace key or a `cwd` is refused. The texts are the
/// contract's, each cause after them as [`common::error_chain`] prints it.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("Invalid remote workspace key")]
    InvalidKey,
    /// A segment of a remote workspace key is (or became) a symbolic link.
    #[error("Remote workspace path must not contain symbolic links")]
    KeySymlink,
    /// One of the [`RESERVED_NAMES`] in a key or on a workspace's path.
    #[error("{0:?} is reserved for runner coordination files and cannot name a workspace or a part of one")]
    Reserved(&'static str),
    /// Node's message for a failed `realpath`, which the original passes through as the 400
    /// text (`ENOENT: no such file or directory, realpath '…'`): the cause is written into it
    /// as Node writes it, so it is no `source`. `shown` is what the caller sent.
    #[error("{}", realpath_text(.shown, .error))]
    Realpath { shown: PathBuf, error: io::Error },
    #[error("The runner data directory is unavailable")]
    DataDirUnavailable(#[source] io::Error),
    /// `what`: `remote-workspaces`, or the key's segments so far, quoted.
    #[error("Could not create remote workspace directory {what}")]
    Create {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("Could not hand remote workspace directory '{shown}' to the sandbox user")]
    HandOver {
        shown: String,
        #[source]
        source: io::Error,
    },
    #[error("{OUTSIDE_ROOTS}")]
    OutsideRoots,
    #[error("{IS_A_ROOT}")]
    IsARoot,
    #[error("{WORKSPACE_SYMLINK}")]
    Symlink,
    #[error("Runner workspace must be a directory")]
    NotDirectory,
    /// [`open_beneath`]: the path validated earlier now meets a symlink, or is gone.
    #[error("Runner workspace changed under it: a path component is now a symbolic link or missing")]
    Changed,
    #[error("cwd must be workspace-relative")]
    CwdAbsolute,
    #[error("cwd must remain inside the writable workspace")]
    CwdOutside,
    #[error("cwd must not contain symbolic links")]
    CwdSymlink,
    #[error("cwd must be a directory")]
    CwdNotDirectory,
}

fn is_reserved(name: &OsStr) -> Option<&'static str> {
    RESERVED_NAMES.into_iter().find(|r| name.as_bytes() == r.as_bytes())
}

/// Splits a `runnerWorkspaceKey` into its segments: trimmed, 1–500 characters, no `\`,
/// relative, each `/` segment non-empty, not `.` or `..`, and `[A-Za-z0-9._-]+`; and none of
/// the [`RESERVED_NAMES`] (stricter than the original, whose pattern allows them).
pub fn key_segments(key: &str) -> Result<Vec<&str>, WorkspaceError> {
    let key = key.trim();
    if key.is_empty() || key.chars().count() > 500 || key.contains('\\') || key.starts_with('/') {
        return Err(WorkspaceError::InvalidKey);
    }
    let segments: Vec<&str> = key.split('/').collect();
    for segment in &segments {
        let charset_ok = segment.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if segment.is_empty() || *segment == "." || *segment == ".." || !charset_ok {
            return Err(WorkspaceError::InvalidKey);
        }
    }
    if let Some(name) = segments.iter().find_map(|s| is_reserved(OsStr::new(s))) {
        return Err(WorkspaceError::Reserved(name));
    }
    Ok(segments)
}

/// [`WorkspaceError::Realpath`] for what the caller sent (`shown`).
fn realpath_error(shown: &Path, error: io::Error) -> WorkspaceError {
    WorkspaceError::Realpath { shown: shown.to_owned(), error }
}

/// Node's text for a failed `realpath` of `shown`.
fn realpath_text(shown: &Path, e: &io::Error) -> String {
    let code = e.raw_os_error().map(errno_name).unwrap_or("EIO");
    let text = match e.raw_os_error() {
        Some(libc::ENOENT) => "no such file or directory".to_owned(),
        Some(libc::ENOTDIR) => "not a directory".to_owned(),
        Some(libc::EACCES) => "permission denied".to_owned(),
        Some(libc::ELOOP) => "too many symbolic links encountered".to_owned(),
        _ => e.to_string(),
    };
    format!("{code}: {text}, realpath '{}'", shown.display())
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

/// `realpath(dataDir)` and an `O_PATH` descriptor of it.
fn open_data_dir(data_dir: &Path) -> Result<(PathBuf, OwnedFd), WorkspaceError> {
    let real = fs::canonicalize(data_dir).map_err(WorkspaceError::DataDirUnavailable)?;
    let fd = fsat::open_path(&real, libc::O_PATH | libc::O_DIRECTORY)
        .map_err(WorkspaceError::DataDirUnavailable)?;
    Ok((real, fd))
}

/// `<data>/remote-workspaces/<key>`, created one segment at a time; every segment must be a
/// real directory (never a symlink). The path returned is canonical (no symlink below the
/// data directory's realpath, which the walk guarantees). The key's segments runnerd
/// creates belong to the sandbox user (`owner`).
pub fn ensure_remote_workspace(
    data_dir: &Path,
    key: &str,
    owner: &dyn HandOver,
) -> Result<PathBuf, WorkspaceError> {
    ensure_workspace_under(data_dir, REMOTE_WORKSPACES, key, owner)
}

/// [`ensure_remote_workspace`] beneath `projects/`: a project workspace moved or restored to
/// a node that never had it (issue #34), its path held to the key's rules.
pub fn ensure_project_workspace(
    data_dir: &Path,
    path: &str,
    owner: &dyn HandOver,
) -> Result<PathBuf, WorkspaceError> {
    ensure_workspace_under(data_dir, PROJECTS, path, owner)
}

fn ensure_workspace_under(
    data_dir: &Path,
    top: &'static str,
    key: &str,
    owner: &dyn HandOver,
) -> Result<PathBuf, WorkspaceError> {
    let segments = key_segments(key)?;
    fs::create_dir_all(data_dir).map_err(WorkspaceError::DataDirUnavailable)?;
    // Walk by descriptor: each segment is created with mkdirat and opened with O_NOFOLLOW
    // relative to the previous one, so a segment swapped for a symlink mid-walk is refused
    // and nothing is ever created through it.
    let (data_real, mut dir) = open_data_dir(data_dir)?;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| WorkspaceError::InvalidKey);
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC;
    let mut path = data_real;
    let mut shown = String::new();
    for (i, segment) in std::iter::once(top).chain(segments).enumerate() {
        path.push(segment);
        if i > 0 {
            shown.push_str(if shown.is_empty() { "" } else { "/" });
            shown.push_str(segment);
        }
        let name = c(segment)?;
        let made = match fsat::mkdir_at(&dir, &name, 0o755) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
            Err(source) => {
                let what = if shown.is_empty() { top.to_owned() } else { format!("'{shown}'") };
                return Err(WorkspaceError::Create { what, source });
            }
        };
        // O_NOFOLLOW refuses a symlink.
        dir = fsat::open_at(&dir, &name, flags | libc::O_NOFOLLOW).map_err(|_| WorkspaceError::KeySymlink)?;
        if made && i > 0 {
            owner
                .hand_over(dir.as_fd())
                .map_err(|source| WorkspaceError::HandOver { shown: shown.clone(), source })?;
        }
    }
    Ok(path)
}

/// Why a workspace path's names (relative to the data directory, `..` applied) are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamesRefused {
    /// Not under `projects/` or `remote-workspaces/` (or climbs out of the data directory).
    OutsideRoots,
    /// `projects` or `remote-workspaces` itself: every tenant's files and lease directories.
    IsARoot,
    /// A coordination directory (or another reserved name) on the way.
    Reserved(&'static str),
}

/// The pure policy: the names `rel` (relative to the data directory) lexically normalised,
/// or why they are refused. With no symlink allowed on the way (the walk checks that), the
/// lexical result is the physical one.
pub fn workspace_names<'a>(
    rel: impl IntoIterator<Item = Component<'a>>,
) -> Result<Vec<&'a OsStr>, NamesRefused> {
    let mut names: Vec<&OsStr> = Vec::new();
    for component in rel {
        match component {
            Component::Normal(n) => names.push(n),
            Component::ParentDir => {
                names.pop().ok_or(NamesRefused::OutsideRoots)?;
            }
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err(NamesRefused::OutsideRoots),
        }
    }
    match names.first() {
        Some(first) if *first == OsStr::new(PROJECTS) || *first == OsStr::new(REMOTE_WORKSPACES) => {}
        _ => return Err(NamesRefused::OutsideRoots),
    }
    if names.len() < 2 {
        return Err(NamesRefused::IsARoot);
    }
    if let Some(name) = names.iter().find_map(|n| is_reserved(n)) {
        return Err(NamesRefused::Reserved(name));
    }
    Ok(names)
}

/// Where the caller's absolute `path` enters the data directory: the number of its leading
/// components that name `data_real`. A prefix that lands *below* the data directory without
/// passing its top (only a symlink into the tree does that) is refused.
fn data_prefix_len(data_dir: &Path, data_real: &Path, path: &Path) -> Option<usize> {
    let components: Vec<Component> = path.components().collect();
    for spelling in [data_real, data_dir] {
        if path.starts_with(spelling) && spelling.is_absolute() {
            return Some(spelling.components().count());
        }
    }
    for i in 1..=components.len() {
        let prefix: PathBuf = components[..i].iter().collect();
        match fs::canonicalize(&prefix) {
            Ok(real) if real == data_real => return Some(i),
            Ok(real) if real.starts_with(data_real) => return None,
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// `validatedWorkspace`: the workspace `path` (absolute, as the caller sent it) must lie
/// inside `<data>/projects/` or `<data>/remote-workspaces/`, reached with no symbolic link
/// below the data directory, must not be either root itself nor pass a reserved name, and
/// must be a directory. Returns its canonical path (`realpath(dataDir)` + the names).
pub fn validated_workspace(data_dir: &Path, path: &Path) -> Result<PathBuf, WorkspaceError> {
    let (data_real, data_fd) = open_data_dir(data_dir)?;
    if !path.is_absolute() {
        return Err(WorkspaceError::OutsideRoots);
    }
    let skip = data_prefix_len(data_dir, &data_real, path).ok_or(WorkspaceError::OutsideRoots)?;
    let rest = || path.components().skip(skip);
    let names = workspace_names(rest()).map_err(|refused| match refused {
        NamesRefused::OutsideRoots => WorkspaceError::OutsideRoots,
        NamesRefused::IsARoot => WorkspaceError::IsARoot,
        NamesRefused::Reserved(name) => WorkspaceError::Reserved(name),
    })?;
    fsat::walk_beneath(&data_fd, rest()).map_err(|stopped| match stopped {
        Stopped::Missing(e) => realpath_error(path, e),
        // The original resolves links with realpath and answers where it lands: a link
        // leading outside both roots gets its text; one staying inside, our stricter refusal.
        Stopped::Symlink
            if link_leads_outside(
                &data_real,
                rest(),
                &[&data_real.join(PROJECTS), &data_real.join(REMOTE_WORKSPACES)],
            ) =>
        {
            WorkspaceError::OutsideRoots
        }
        Stopped::Symlink => WorkspaceError::Symlink,
        Stopped::NotDirectory => WorkspaceError::NotDirectory,
        Stopped::Escapes => WorkspaceError::OutsideRoots,
    })?;
    Ok(names.iter().fold(data_real, |p, n| p.join(n)))
}

/// Resolves a shell request's `cwd` beneath the (canonical) writable root, walking from the
/// root's descriptor with no symlink followed; returns the relative path to use below the
/// mount point (`""` for the root itself). Errors name `cwd` as sent, never a host path.
pub fn resolve_cwd(data_dir: &Path, root: &Path, cwd: &str) -> Result<String, WorkspaceError> {
    check_cwd_text(cwd)?;
    let root_fd = open_beneath(data_dir, root)?;
    let (_, names) =
        fsat::walk_beneath(&root_fd, Path::new(cwd).components()).map_err(|stopped| match stopped {
            Stopped::Missing(e) => realpath_error(Path::new(cwd), e),
            // As for the workspace: a link leading out of it gets the original's text.
            Stopped::Symlink if link_leads_outside(root, Path::new(cwd).components(), &[root]) => {
                WorkspaceError::CwdOutside
            }
            Stopped::Symlink => WorkspaceError::CwdSymlink,
            Stopped::NotDirectory => WorkspaceError::CwdNotDirectory,
            Stopped::Escapes => WorkspaceError::CwdOutside,
        })?;
    let rel: PathBuf = names.iter().collect();
    Ok(rel.to_string_lossy().into_owned())
}

/// Whether `rest`, walked from `base` (canonical), meets a symbolic link whose text — with
/// the components after it — leads outside every one of `inside`. Decided on the link's text
/// alone (`fstatat` and `readlinkat` of the link, nothing resolved through it): only the
/// error's wording depends on it, and a tenant must not learn from it whether a host path
/// exists.
fn link_leads_outside<'a>(
    base: &Path,
    rest: impl IntoIterator<Item = Component<'a>>,
    inside: &[&Path],
) -> bool {
    let rest: Vec<Component> = rest.into_iter().collect();
    // Walked by descriptor, no link followed (a directory swapped for a link meanwhile is
    // read as that link, never traversed); the path text only keeps the lexical position.
    let Ok(mut dir) = fsat::open_path(base, libc::O_PATH | libc::O_DIRECTORY) else { return false };
    let mut current = base.to_path_buf();
    for (i, component) in rest.iter().enumerate() {
        let name = match component {
            Component::Normal(name) => *name,
            Component::ParentDir => OsStr::new(".."),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => continue,
        };
        let Ok(cname) = std::ffi::CString::new(name.as_bytes()) else { return false };
        match fsat::Stat::at(&dir, &cname) {
            Ok(st) if st.kind() == libc::S_IFLNK => {
                let Ok(target) = fsat::readlink_at(&dir, &cname) else { return false };
                let mut landed = current.join(OsStr::from_bytes(&target));
                landed.extend(&rest[i + 1..]);
                let landed = lexically_normal(&landed);
                return !inside.iter().any(|inner| landed.starts_with(inner));
            }
            Ok(_) => match fsat::open_at(&dir, &cname, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
                Ok(next) => {
                    dir = next;
                    match component {
                        Component::ParentDir => {
                            current.pop();
                        }
                        _ => current.push(name),
                    }
                }
                Err(_) => return false,
            },
            Err(_) => return false,
        }
    }
    false
}

/// `path` with `.` dropped and each `..` taking off the component before it (never above `/`).
fn lexically_normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// The checks of a `cwd` that need no filesystem: workspace-relative, never above the root
/// (a managed run checks these before its 202 and resolves the directory when it starts,
/// since a run queued before it may create it).
pub fn check_cwd_text(cwd: &str) -> Result<(), WorkspaceError> {
    if Path::new(cwd).is_absolute() {
        return Err(WorkspaceError::CwdAbsolute);
    }
    let mut depth = 0usize;
    for component in Path::new(cwd).components() {
        match component {
            Component::Normal(_) => depth += 1,
            Component::ParentDir => depth = depth.checked_sub(1).ok_or(WorkspaceError::CwdOutside)?,
            _ => {}
        }
    }
    Ok(())
}

/// Opens `path` (canonical, inside `data_dir`) as an `O_PATH` directory descriptor, one
/// component at a time from the data directory, refusing every symlink on the way. The
/// directory a sandbox gets is the one opened here, whatever happens to the path after
/// (bwrap binds it with `--bind-fd`): a workspace that another sandbox renamed or replaced
/// by a symlink between validation and launch is refused instead of followed.
pub fn open_beneath(data_dir: &Path, path: &Path) -> Result<OwnedFd, WorkspaceError> {
    let (data_real, data_fd) = open_data_dir(data_dir)?;
    let rel = path.strip_prefix(&data_real).map_err(|_| WorkspaceError::Changed)?;
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(WorkspaceError::Changed);
    }
    fsat::walk_beneath(&data_fd, rel.components()).map(|(fd, _)| fd).map_err(|_| WorkspaceError::Changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// runnerd's own user: nothing is handed over.
    fn me() -> crate::owner::Keep {
        crate::owner::Keep
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
            assert_eq!(key_segments(key).unwrap_err().to_string(), "Invalid remote workspace key", "{key:?}");
        }
        assert!(key_segments(&"a".repeat(500)).is_ok());
        for key in [
            ".workspace-coordination",
            "p/.workspace-coordination",
            ".workspace-coordination/x",
            "a/.workspace-lifecycle/b",
        ] {
            let err = key_segments(key).unwrap_err();
            assert!(matches!(err, WorkspaceError::Reserved(_)), "{key:?}");
            assert!(err.to_string().contains("is reserved"), "{err}");
        }
        assert!(key_segments(".workspace-coordinationx/a").is_ok());
    }

    #[test]
    fn workspace_names_table() {
        use NamesRefused::*;
        let cases: [(&str, Result<Vec<&str>, NamesRefused>); 12] = [
            ("projects/p/sessions/s/workspace", Ok(vec!["projects", "p", "sessions", "s", "workspace"])),
            ("remote-workspaces/k", Ok(vec!["remote-workspaces", "k"])),
            ("remote-workspaces/a/../b", Ok(vec!["remote-workspaces", "b"])),
            ("projects", Err(IsARoot)),
            ("remote-workspaces/", Err(IsARoot)),
            ("remote-workspaces/k/..", Err(IsARoot)),
            ("", Err(OutsideRoots)),
            ("logs/x", Err(OutsideRoots)),
            ("projects/../logs", Err(OutsideRoots)),
            ("..", Err(OutsideRoots)),
            ("remote-workspaces/p/.workspace-coordination", Err(Reserved(".workspace-coordination"))),
            ("projects/p/.workspace-coordination/x", Err(Reserved(".workspace-coordination"))),
        ];
        for (rel, expected) in cases {
            let got = workspace_names(Path::new(rel).components())
                .map(|v| v.iter().map(|n| n.to_str().unwrap()).collect::<Vec<_>>());
            assert_eq!(got, expected, "{rel:?}");
        }
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
        assert_eq!(err.to_string(), "Remote workspace path must not contain symbolic links");
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
        assert!(err.to_string().contains("must be inside"));
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
        for bad in [data.join("logs"), outside.clone(), data.clone(), PathBuf::from("relative/path")] {
            let err = validated_workspace(&data, &bad).unwrap_err();
            assert!(err.to_string().contains("workspace must be inside"), "{}: {err}", bad.display());
        }
        // A symlink anywhere below the data directory is never followed, wherever it
        // points: outside, or at another tenant's workspace inside the roots.
        let other = data.join("projects/q/sessions/t/workspace");
        fs::create_dir_all(&other).unwrap();
        symlink(&other, project_ws.join("proj")).unwrap();
        symlink(&other, data.join("projects/p/sessions/alias")).unwrap();
        // One leading outside both roots answers the original's text (its realpath lands
        // there); one staying inside keeps our stricter refusal.
        for (bad, text) in [
            (project_ws.join("link"), OUTSIDE_ROOTS),
            (project_ws.join("proj"), WORKSPACE_SYMLINK),
            (data.join("projects/p/sessions/alias"), WORKSPACE_SYMLINK),
        ] {
            let err = validated_workspace(&data, &bad).unwrap_err();
            assert_eq!(err.to_string(), text, "{}", bad.display());
        }
        // Entering the data tree through a symlink that does not name the data dir itself.
        symlink(&other, dir.path().join("alias-into-data")).unwrap();
        let err = validated_workspace(&data, &dir.path().join("alias-into-data")).unwrap_err();
        assert!(matches!(err, WorkspaceError::OutsideRoots), "{err}");
        // Another spelling of the data directory itself is fine.
        symlink(&data, dir.path().join("data-alias")).unwrap();
        let via_alias = dir.path().join("data-alias/projects/p/sessions/s/workspace");
        assert_eq!(validated_workspace(&data, &via_alias).unwrap(), project_ws.canonicalize().unwrap());
        // The roots themselves and coordination directories.
        for bad in [data.join("projects"), data.join("remote-workspaces"), data.join("projects/p/..")] {
            let err = validated_workspace(&data, &bad).unwrap_err();
            assert!(matches!(err, WorkspaceError::IsARoot), "{}", bad.display());
            assert_eq!(err.to_string(), IS_A_ROOT);
        }
        fs::create_dir_all(data.join("projects/p/sessions/.workspace-coordination")).unwrap();
        let err = validated_workspace(&data, &data.join("projects/p/sessions/.workspace-coordination"))
            .unwrap_err();
        assert!(matches!(err, WorkspaceError::Reserved(".workspace-coordination")), "{err}");
        fs::write(project_ws.join("file"), "").unwrap();
        let err = validated_workspace(&data, &project_ws.join("file")).unwrap_err();
        assert!(matches!(err, WorkspaceError::NotDirectory), "{err}");
        let missing = data.join("projects/nope");
        let err = validated_workspace(&data, &missing).unwrap_err();
        assert_eq!(
            common::error_chain(&err),
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
        symlink(root.join("analysis"), root.join("inside-link")).unwrap();
        symlink("/nonexistent-cwd-target", root.join("gone")).unwrap();
        let root = root.canonicalize().unwrap();
        let data = dir.path().canonicalize().unwrap();
        let cwd = |c: &str| resolve_cwd(&data, &root, c);
        assert_eq!(cwd("analysis").unwrap(), "analysis");
        assert_eq!(cwd("analysis/run1/..").unwrap(), "analysis");
        assert_eq!(cwd("analysis/run1").unwrap(), "analysis/run1");
        assert_eq!(cwd(".").unwrap(), "");
        let cases = [
            ("/etc", "cwd must be workspace-relative"),
            ("../../..", "cwd must remain inside the writable workspace"),
            ("analysis/../..", "cwd must remain inside the writable workspace"),
            // A link leading out of the workspace: the original's text, whether its target
            // exists or not (no oracle on host paths); one inside: ours.
            ("up", "cwd must remain inside the writable workspace"),
            ("gone", "cwd must remain inside the writable workspace"),
            ("up/ws", "cwd must not contain symbolic links"),
            ("inside-link", "cwd must not contain symbolic links"),
            ("file.txt", "cwd must be a directory"),
        ];
        for (c, message) in cases {
            assert_eq!(cwd(c).unwrap_err().to_string(), message, "{c}");
        }
        // A missing directory names the cwd as sent, not the host path of the workspace.
        assert_eq!(
            common::error_chain(&cwd("missing/x").unwrap_err()),
            "ENOENT: no such file or directory, realpath 'missing/x'"
        );
    }
}
