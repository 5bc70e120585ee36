//! Checks each package a step links, as the package cache holds it, before rattler's linker
//! sees it: every `paths.json` entry must name a plain relative path, a file must be a
//! regular file reached through no link, and a link must be a link whose target stays in
//! the prefix. Nothing is written until every package passed.
//!
//! rattler would otherwise write where an absolute or `..` path points (stopped only by the
//! sandbox's read-only mounts), and with symbolic links off it *copies a link's target*
//! (`copy_symlink_target_to_destination`, which never asks the external-symlink policy): a
//! 548-byte package linking `/proc/self/pagemap` wrote 537 MiB into a prefix in 0.45 s. The
//! linker's source is `package_dir.join(path)`, followed wherever it leads, so a file entry
//! whose archive member (or any directory above it) is a link, a FIFO or a device is refused
//! here too. Links are then created as links ([`crate::install`]), never copied.
//!
//! The cache is read-only in a link step, so what is checked here is what is linked.

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path};

use rattler_conda_types::package::{PathType, PathsJson};

use crate::links;

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error(
        "Package {package} lists {path:?} in its paths.json, which is not a relative path inside the prefix (absolute, empty, or climbing with '..'); the package is refused and nothing was installed"
    )]
    Path { package: String, path: String },
    #[error(
        "Package {package} links {path} to {target:?}, which leaves the prefix (an absolute target, or one that climbs above it); the package is refused and nothing was installed"
    )]
    LinkEscapes { package: String, path: String, target: String },
    #[error(
        "Package {package} lists {path} as a {listed}, but its archive holds {found} there; the package is refused and nothing was installed"
    )]
    Mismatch { package: String, path: String, listed: &'static str, found: &'static str },
    #[error(
        "Package {package} marks its link {path} not to be linked (no_link), which would copy whatever the link points at; the package is refused and nothing was installed"
    )]
    UnlinkedLink { package: String, path: String },
    #[error("Package {package} could not be read from the package cache ({path})")]
    Read {
        package: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "The packages this change installs hold {bytes} bytes, more than the {limit} bytes a prefix may hold (env_step_max_prefix_bytes, SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES); nothing was installed: install fewer or smaller packages, or ask the operator to raise the limit"
    )]
    TooLarge { bytes: u64, limit: u64 },
}

/// What an entry's source in the package directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// A regular file of this many bytes.
    File(u64),
    Dir,
    /// A symbolic link (never followed).
    Link,
    /// A FIFO, socket or device.
    Special,
    /// Absent, or a directory on the way is not one.
    Missing,
    /// A directory on the way is a link.
    LinkOnTheWay,
}

impl Found {
    fn describe(self) -> &'static str {
        match self {
            Found::File(_) => "a file",
            Found::Dir => "a directory",
            Found::Link => "a symbolic link",
            Found::Special => "a FIFO, socket or device",
            Found::Missing => "nothing",
            Found::LinkOnTheWay => "a path through a symbolic link",
        }
    }
}

/// The verdict on one entry, given what its source is and (for a link) its target: `Ok`
/// with the bytes a file adds to the prefix. Pure.
pub fn judge(
    package: &str,
    path: &Path,
    path_type: PathType,
    no_link: bool,
    found: Found,
    target: Option<&Path>,
) -> Result<u64, PackageError> {
    let text = path.display().to_string();
    if !plain_relative(path) {
        return Err(PackageError::Path { package: package.to_owned(), path: text });
    }
    let mismatch = |listed| PackageError::Mismatch {
        package: package.to_owned(),
        path: text.clone(),
        listed,
        found: found.describe(),
    };
    match (path_type, found) {
        (PathType::HardLink, Found::File(bytes)) => Ok(bytes),
        (PathType::HardLink, _) => Err(mismatch("file")),
        (PathType::Directory, Found::Dir) => Ok(0),
        (PathType::Directory, _) => Err(mismatch("directory")),
        (PathType::SoftLink, Found::Link) => {
            if no_link {
                return Err(PackageError::UnlinkedLink { package: package.to_owned(), path: text });
            }
            let target = target.unwrap_or(Path::new(""));
            // Judged as it will be made: at `path` in a prefix, by its text.
            let prefix = Path::new("/prefix");
            let inside = !target.as_os_str().is_empty()
                && target.is_relative()
                && links::stays_inside(prefix, &prefix.join(path), target);
            match inside {
                true => Ok(0),
                false => Err(PackageError::LinkEscapes {
                    package: package.to_owned(),
                    path: text,
                    target: target.display().to_string(),
                }),
            }
        }
        (PathType::SoftLink, _) => Err(mismatch("symbolic link")),
    }
}

/// Whether `path` names something inside a prefix: relative, not empty, only names (and
/// `.`), never `..`.
pub fn plain_relative(path: &Path) -> bool {
    path.components().any(|c| matches!(c, Component::Normal(_)))
        && path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// Checks the extracted package at `dir` (its `info/paths.json`, or the older `info/files`
/// that rattler falls back to); the bytes its files add to a prefix.
pub fn check(package: &str, dir: &Path) -> Result<u64, PackageError> {
    let read = |path: &str, source| PackageError::Read {
        package: package.to_owned(),
        path: path.to_owned(),
        source,
    };
    let paths = PathsJson::from_package_directory_with_deprecated_fallback(dir)
        .map_err(|e| read("info/paths.json", e))?;
    let root = open_dir(dir).map_err(|e| read(&dir.display().to_string(), e))?;
    let mut total = 0u64;
    for entry in &paths.paths {
        let path = &entry.relative_path;
        let (found, target) = match plain_relative(path) {
            true => inspect(&root, path).map_err(|e| read(&path.display().to_string(), e))?,
            false => (Found::Missing, None),
        };
        let bytes = judge(package, path, entry.path_type, entry.no_link, found, target.as_deref())?;
        total = total.saturating_add(bytes);
    }
    Ok(total)
}

/// The most bytes a step's packages may add, if `limit` (0: none) says so.
pub fn within(bytes: u64, limit: u64) -> Result<(), PackageError> {
    match limit > 0 && bytes > limit {
        true => Err(PackageError::TooLarge { bytes, limit }),
        false => Ok(()),
    }
}

/// What `path` (plain relative) is beneath `root`, each directory on the way opened with
/// `O_NOFOLLOW` relative to the one before (no `openat2`: the sandbox's filter refuses it),
/// the last looked at without following; a link's target with it.
fn inspect(root: &OwnedFd, path: &Path) -> std::io::Result<(Found, Option<std::path::PathBuf>)> {
    let names: Vec<&OsStr> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    let Some((last, dirs)) = names.split_last() else { return Ok((Found::Missing, None)) };
    let mut held: Option<OwnedFd> = None;
    for name in dirs {
        let parent = held.as_ref().unwrap_or(root);
        let c = cstring(name)?;
        match stat_at(parent, &c)? {
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {}
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFLNK => return Ok((Found::LinkOnTheWay, None)),
            _ => return Ok((Found::Missing, None)),
        }
        held = Some(open_at(parent, &c, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)?);
    }
    let parent = held.as_ref().unwrap_or(root);
    let c = cstring(last)?;
    let Some(st) = stat_at(parent, &c)? else { return Ok((Found::Missing, None)) };
    Ok(match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => (Found::File(u64::try_from(st.st_size).unwrap_or(u64::MAX)), None),
        libc::S_IFDIR => (Found::Dir, None),
        libc::S_IFLNK => (Found::Link, Some(read_link_at(parent, &c)?)),
        _ => (Found::Special, None),
    })
}

fn cstring(name: &OsStr) -> std::io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

fn open_dir(dir: &Path) -> std::io::Result<OwnedFd> {
    let c = cstring(dir.as_os_str())?;
    // SAFETY: open(2) with a NUL-terminated path; the result is checked and owned once.
    let fd = common::sys::cvt(unsafe {
        libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
    })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_at(dir: &OwnedFd, name: &CStr, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    // SAFETY: openat(2) relative to a live descriptor with a NUL-terminated name; checked.
    let fd =
        common::sys::cvt(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fstatat(AT_SYMLINK_NOFOLLOW)`; `None` when there is nothing (or a file on the way).
fn stat_at(dir: &OwnedFd, name: &CStr) -> std::io::Result<Option<libc::stat>> {
    // SAFETY: stat is plain data, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat(2) relative to a live descriptor, a NUL-terminated name, a writable stat.
    let ret = unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    match common::sys::cvt(ret) {
        Ok(_) => Ok(Some(st)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => Ok(None),
        Err(e) => Err(e),
    }
}

fn read_link_at(dir: &OwnedFd, name: &CStr) -> std::io::Result<std::path::PathBuf> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: readlinkat(2) relative to a live descriptor into a buffer of the length given.
    let n = common::sys::cvt(unsafe {
        libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    })?;
    buf.truncate(n as usize);
    Ok(std::path::PathBuf::from(std::ffi::OsString::from_vec(buf)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_judged_by_their_path_and_what_the_archive_holds() {
        let p = Path::new;
        let ok = |bytes| Ok::<u64, ()>(bytes);
        for (path, kind, no_link, found, target, want) in [
            ("lib/libz.so.1", PathType::HardLink, false, Found::File(7), None, ok(7)),
            ("share/empty", PathType::Directory, false, Found::Dir, None, ok(0)),
            ("lib/libz.so", PathType::SoftLink, false, Found::Link, Some("libz.so.1"), ok(0)),
            ("bin/x", PathType::SoftLink, false, Found::Link, Some("../lib/x"), ok(0)),
            ("./bin/y", PathType::SoftLink, false, Found::Link, Some("./y2"), ok(0)),
            // Out of the prefix, or reading anything but the package's own regular file.
            ("/etc/x", PathType::HardLink, false, Found::File(1), None, Err(())),
            ("../pkgs/x", PathType::HardLink, false, Found::File(1), None, Err(())),
            ("a/../../x", PathType::HardLink, false, Found::File(1), None, Err(())),
            ("", PathType::HardLink, false, Found::File(1), None, Err(())),
            ("lib/passwd", PathType::SoftLink, false, Found::Link, Some("/etc/passwd"), Err(())),
            ("share/map", PathType::SoftLink, false, Found::Link, Some("/proc/self/pagemap"), Err(())),
            ("lib/x", PathType::SoftLink, false, Found::Link, Some("../../other"), Err(())),
            ("x", PathType::SoftLink, false, Found::Link, Some(".."), Err(())),
            ("x", PathType::SoftLink, false, Found::Link, Some(""), Err(())),
            ("lib/x", PathType::SoftLink, true, Found::Link, Some("y"), Err(())),
            ("lib/x", PathType::HardLink, false, Found::Link, None, Err(())),
            ("lib/x", PathType::HardLink, false, Found::Special, None, Err(())),
            ("lib/x", PathType::HardLink, false, Found::LinkOnTheWay, None, Err(())),
            ("lib/x", PathType::HardLink, false, Found::Missing, None, Err(())),
            ("lib/x", PathType::SoftLink, false, Found::File(3), None, Err(())),
            ("lib/x", PathType::Directory, false, Found::Link, None, Err(())),
        ] {
            let got = judge("evil", p(path), kind, no_link, found, target.map(p)).map_err(drop);
            assert_eq!(got, want, "{path} {kind:?} {found:?} {target:?}");
        }
    }

    #[test]
    fn the_errors_say_what_was_refused_and_that_nothing_was_installed() {
        let e = judge("evil", Path::new("/etc/x"), PathType::HardLink, false, Found::Missing, None);
        assert_eq!(
            e.unwrap_err().to_string(),
            "Package evil lists \"/etc/x\" in its paths.json, which is not a relative path inside the prefix (absolute, empty, or climbing with '..'); the package is refused and nothing was installed"
        );
        let e = judge(
            "evil",
            Path::new("m"),
            PathType::SoftLink,
            false,
            Found::Link,
            Some(Path::new("/proc/self/pagemap")),
        );
        assert!(
            e.unwrap_err().to_string().contains("links m to \"/proc/self/pagemap\", which leaves the prefix")
        );
        let e = within(11, 10).unwrap_err().to_string();
        assert!(
            e.contains("hold 11 bytes, more than the 10 bytes")
                && e.contains("SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES"),
            "{e}"
        );
        within(10, 10).unwrap();
        within(u64::MAX, 0).unwrap();
    }

    /// A package directory as the cache holds it, with the hostile shapes an archive can
    /// unpack to.
    #[test]
    fn a_package_directory_is_read_without_following_anything() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path();
        std::fs::create_dir_all(pkg.join("info")).unwrap();
        std::fs::create_dir_all(pkg.join("lib")).unwrap();
        std::fs::write(pkg.join("lib/real"), b"12345").unwrap();
        std::os::unix::fs::symlink("real", pkg.join("lib/alias")).unwrap();
        std::os::unix::fs::symlink("/proc/self", pkg.join("proc")).unwrap();
        std::os::unix::fs::symlink("/proc/self/pagemap", pkg.join("lib/pagemap")).unwrap();
        let write_paths = |entries: serde_json::Value| {
            let json = serde_json::json!({"paths": entries, "paths_version": 1});
            std::fs::write(pkg.join("info/paths.json"), json.to_string()).unwrap();
        };
        let hard = |p: &str| serde_json::json!({"_path": p, "path_type": "hardlink", "sha256": "0".repeat(64), "size_in_bytes": 1});
        let soft = |p: &str| serde_json::json!({"_path": p, "path_type": "softlink"});
        write_paths(serde_json::json!([hard("lib/real"), soft("lib/alias")]));
        assert_eq!(check("ok", pkg).unwrap(), 5);
        for (entries, want) in [
            (serde_json::json!([hard("proc/pagemap")]), "a path through a symbolic link"),
            (serde_json::json!([hard("lib/pagemap")]), "holds a symbolic link there"),
            (serde_json::json!([soft("lib/pagemap")]), "which leaves the prefix"),
            (serde_json::json!([hard("/etc/passwd")]), "not a relative path inside the prefix"),
            (serde_json::json!([hard("../../etc/passwd")]), "not a relative path inside the prefix"),
            (serde_json::json!([hard("lib/absent")]), "holds nothing there"),
        ] {
            write_paths(entries.clone());
            let e = check("evil", pkg).unwrap_err().to_string();
            assert!(e.contains(want), "{entries}: {e}");
        }
    }
}
