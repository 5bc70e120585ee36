//! Checks each package a step links, as the package cache holds it, before rattler's linker
//! sees it: its metadata files ([`check_metadata`]) must be regular files of a bounded size
//! reached through no link, every `paths.json` entry must name a plain relative path, a file
//! must be a regular file reached through no link, a link must be a link whose target stays
//! in the prefix, and only a regular file may carry a prefix placeholder. Nothing is written
//! until every package passed.
//!
//! rattler would otherwise write where an absolute or `..` path points (stopped only by the
//! sandbox's read-only mounts), and with symbolic links off it *copies a link's target*
//! (`copy_symlink_target_to_destination`, which never asks the external-symlink policy): a
//! 548-byte package linking `/proc/self/pagemap` wrote 537 MiB into a prefix in 0.45 s. The
//! linker's source is `package_dir.join(path)`, followed wherever it leads, so a file entry
//! whose archive member (or any directory above it) is a link, a FIFO or a device is refused
//! here too. An entry with a prefix placeholder is *read* (`File::open`, following links)
//! before rattler looks at its type, so a link entry with one (or an old-style `has_prefix`
//! line naming a link) would copy whatever the link leads to, a pipe or `/proc` included:
//! refused. Links are then created as links ([`crate::install`]); no target's bytes are ever
//! copied.
//!
//! rattler reads `info/index.json` and `info/paths.json` (or the older `info/files` and
//! `info/has_prefix`) whenever its cache looks a package up, following links: a package whose
//! `info/paths.json` is a link to a pipe would hang the step holding the cache's gate. So
//! [`check_metadata`] runs on a package's directory before any cache lookup can read it, and
//! right after a fetch extracted it ([`crate::install`]).
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
    #[error(
        "Package {package} lists a prefix placeholder for {path}, which its archive holds as {found}, not a regular file (the installer would copy whatever it leads to); the package is refused and nothing was installed"
    )]
    PlaceholderNotFile { package: String, path: String, found: &'static str },
    #[error(
        "Package {package} lists an empty prefix placeholder for {path}; the package is refused and nothing was installed"
    )]
    EmptyPlaceholder { package: String, path: String },
    #[error(
        "Package {package} holds {found} as its {file}, not a regular file; the package is refused and nothing was installed"
    )]
    Metadata { package: String, file: &'static str, found: &'static str },
    #[error(
        "Package {package}'s {file} is {bytes} bytes, more than the {limit} a package's metadata file may be; the package is refused and nothing was installed"
    )]
    MetadataTooLarge { package: String, file: &'static str, bytes: u64, limit: u64 },
    #[error("Package {package} could not be read from the package cache ({path})")]
    Read {
        package: String,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "The packages this change installs hold up to {bytes} bytes (their files, with each prefix placeholder counted as often as it could occur), more than the {limit} bytes a prefix may hold (env_step_max_prefix_bytes, SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES); nothing was installed: install fewer or smaller packages, or ask the operator to raise the limit"
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

/// One `paths.json` entry, as listed (after rattler's fallback to `info/files` and
/// `info/has_prefix` for an old package).
#[derive(Debug, Clone, Copy)]
pub struct Listed<'a> {
    pub path: &'a Path,
    pub path_type: PathType,
    pub no_link: bool,
    /// The length in bytes of its prefix placeholder, if it has one.
    pub placeholder: Option<usize>,
}

/// The verdict on one entry, given what its source is and (for a link) its target: `Ok`
/// with the most bytes its file adds to a prefix whose path is `prefix_len` bytes long.
/// Pure.
pub fn judge(
    package: &str,
    listed: Listed<'_>,
    found: Found,
    target: Option<&Path>,
    prefix_len: u64,
) -> Result<u64, PackageError> {
    let path = listed.path;
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
    // rattler reads an entry with a placeholder before it asks what the entry is: only a
    // file listed as one, and a regular file in the archive, is read.
    match (listed.placeholder, listed.path_type, found) {
        (None, ..) => {}
        (Some(0), ..) => {
            return Err(PackageError::EmptyPlaceholder { package: package.to_owned(), path: text });
        }
        (Some(_), PathType::HardLink, Found::File(_)) => {}
        (Some(_), PathType::HardLink, _) => return Err(mismatch("file")),
        (Some(_), ..) => {
            return Err(PackageError::PlaceholderNotFile {
                package: package.to_owned(),
                path: text,
                found: found.describe(),
            });
        }
    }
    match (listed.path_type, found) {
        (PathType::HardLink, Found::File(bytes)) => Ok(match listed.placeholder {
            Some(placeholder) => replaced_bound(bytes, placeholder, prefix_len),
            None => bytes,
        }),
        (PathType::HardLink, _) => Err(mismatch("file")),
        (PathType::Directory, Found::Dir) => Ok(0),
        (PathType::Directory, _) => Err(mismatch("directory")),
        (PathType::SoftLink, Found::Link) => {
            if listed.no_link {
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

/// The most bytes a file of `bytes` becomes once each placeholder of `placeholder` bytes in
/// it is replaced by a prefix of `prefix_len` bytes: every `placeholder` bytes of it one
/// occurrence, at worst (a one-byte placeholder in a file of that byte makes each byte the
/// whole prefix). Pure.
pub fn replaced_bound(bytes: u64, placeholder: usize, prefix_len: u64) -> u64 {
    let placeholder = u64::try_from(placeholder).unwrap_or(u64::MAX).max(1);
    match prefix_len.checked_sub(placeholder) {
        Some(growth) if growth > 0 => bytes.saturating_add((bytes / placeholder).saturating_mul(growth)),
        _ => bytes,
    }
}

/// Whether `path` names something inside a prefix: relative, not empty, only names (and
/// `.`), never `..`.
pub fn plain_relative(path: &Path) -> bool {
    path.components().any(|c| matches!(c, Component::Normal(_)))
        && path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// Checks the extracted package at `dir` (its `info/paths.json`, or the older `info/files`
/// that rattler falls back to); the most bytes its files add to a prefix whose path is
/// `prefix_len` bytes long.
pub fn check(package: &str, dir: &Path, prefix_len: u64) -> Result<u64, PackageError> {
    let read = |path: &str, source| PackageError::Read {
        package: package.to_owned(),
        path: path.to_owned(),
        source,
    };
    check_metadata(package, dir)?;
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
        let listed = Listed {
            path,
            path_type: entry.path_type,
            no_link: entry.no_link,
            placeholder: entry.prefix_placeholder.as_ref().map(|p| p.placeholder.len()),
        };
        let bytes = judge(package, listed, found, target.as_deref(), prefix_len)?;
        total = total.saturating_add(bytes);
    }
    Ok(total)
}

/// The files rattler reads from a package's `info/` (through any link) whenever its cache
/// or its linker looks at the package.
pub const METADATA: [&str; 8] = [
    "info/index.json",
    "info/paths.json",
    "info/files",
    "info/has_prefix",
    "info/no_link",
    "info/no_softlink",
    "info/link.json",
    "info/wheel.json",
];

/// The most bytes one metadata file may hold: read whole into memory by rattler (a
/// `paths.json` of 100,000 entries is some 20 MiB).
pub const MAX_METADATA_BYTES: u64 = 128 << 20;

/// The verdict on one metadata file, given what it is: absent, or a regular file within
/// [`MAX_METADATA_BYTES`]. Pure.
pub fn judge_metadata(package: &str, file: &'static str, found: Found) -> Result<(), PackageError> {
    match found {
        Found::Missing => Ok(()),
        Found::File(bytes) if bytes <= MAX_METADATA_BYTES => Ok(()),
        Found::File(bytes) => Err(PackageError::MetadataTooLarge {
            package: package.to_owned(),
            file,
            bytes,
            limit: MAX_METADATA_BYTES,
        }),
        _ => Err(PackageError::Metadata { package: package.to_owned(), file, found: found.describe() }),
    }
}

/// Checks the metadata files of the extracted package at `dir` ([`METADATA`]) without
/// following any link: run before anything (rattler's cache included) reads them.
pub fn check_metadata(package: &str, dir: &Path) -> Result<(), PackageError> {
    let read = |path: &str, source| PackageError::Read {
        package: package.to_owned(),
        path: path.to_owned(),
        source,
    };
    let root = open_dir(dir).map_err(|e| read(&dir.display().to_string(), e))?;
    for file in METADATA {
        let (found, _) = inspect(&root, Path::new(file)).map_err(|e| read(file, e))?;
        judge_metadata(package, file, found)?;
    }
    Ok(())
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

/// The package's directory, itself not followed if it is a link (the cache's own path above
/// it is the request's).
fn open_dir(dir: &Path) -> std::io::Result<OwnedFd> {
    let c = cstring(dir.as_os_str())?;
    // SAFETY: open(2) with a NUL-terminated path; the result is checked and owned once.
    let fd = common::sys::cvt(unsafe {
        libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
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
            let listed = Listed { path: p(path), path_type: kind, no_link, placeholder: None };
            let got = judge("evil", listed, found, target.map(p), 20).map_err(drop);
            assert_eq!(got, want, "{path} {kind:?} {found:?} {target:?}");
        }
    }

    /// rattler reads (following links) every entry with a placeholder before it asks what
    /// the entry is, and the replacement may grow the file: only regular files carry one,
    /// counted at their largest.
    #[test]
    fn only_a_regular_file_carries_a_prefix_placeholder_and_counts_at_its_largest() {
        let p = Path::new;
        let file = Found::File(100);
        for (kind, placeholder, found, target, prefix_len, want) in [
            (PathType::HardLink, Some(10), file, None, 10, Ok(100)),
            (PathType::HardLink, Some(10), file, None, 5, Ok(100)),
            // Ten occurrences of 10 bytes, each becoming 30.
            (PathType::HardLink, Some(10), file, None, 30, Ok(300)),
            // One-byte placeholder in a file of that byte: each byte becomes the prefix.
            (PathType::HardLink, Some(1), file, None, 40, Ok(4000)),
            (PathType::HardLink, Some(0), file, None, 40, Err("an empty prefix placeholder")),
            (PathType::SoftLink, Some(10), Found::Link, Some("y"), 10, Err("holds as a symbolic link")),
            (PathType::SoftLink, Some(0), Found::Link, Some("y"), 10, Err("an empty prefix placeholder")),
            (PathType::Directory, Some(10), Found::Dir, None, 10, Err("holds as a directory")),
            (PathType::HardLink, Some(10), Found::Link, None, 10, Err("holds a symbolic link there")),
            (PathType::HardLink, Some(10), Found::Special, None, 10, Err("FIFO")),
            (PathType::HardLink, Some(10), Found::LinkOnTheWay, None, 10, Err("through a symbolic link")),
        ] {
            let listed = Listed { path: p("lib/x"), path_type: kind, no_link: false, placeholder };
            let got = judge("evil", listed, found, target.map(p), prefix_len).map_err(|e| e.to_string());
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{kind:?} {placeholder:?} {found:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{kind:?} {found:?}: {got}"),
                (got, want) => panic!("{kind:?} {placeholder:?} {found:?}: {got:?}, wanted {want:?}"),
            }
        }
        assert_eq!(replaced_bound(u64::MAX, 1, 4096), u64::MAX);
        assert_eq!(replaced_bound(7, 10, 4096), 7, "shorter than its placeholder: no occurrence");
    }

    #[test]
    fn metadata_files_are_regular_files_of_a_bounded_size_or_absent() {
        for (found, want) in [
            (Found::Missing, Ok(())),
            (Found::File(0), Ok(())),
            (Found::File(MAX_METADATA_BYTES), Ok(())),
            (Found::File(MAX_METADATA_BYTES + 1), Err("more than the 134217728 a package's metadata file")),
            (Found::Link, Err("holds a symbolic link as its info/paths.json")),
            (Found::Special, Err("holds a FIFO, socket or device as its info/paths.json")),
            (Found::Dir, Err("holds a directory as its info/paths.json")),
            (Found::LinkOnTheWay, Err("holds a path through a symbolic link as its info/paths.json")),
        ] {
            let got = judge_metadata("evil", "info/paths.json", found).map_err(|e| e.to_string());
            match (got, want) {
                (Ok(()), Ok(())) => {}
                (Err(got), Err(want)) => assert!(got.contains(want) && got.contains("evil"), "{got}"),
                (got, want) => panic!("{found:?}: {got:?}, wanted {want:?}"),
            }
        }
    }

    #[test]
    fn the_errors_say_what_was_refused_and_that_nothing_was_installed() {
        let listed =
            |path, path_type| Listed { path: Path::new(path), path_type, no_link: false, placeholder: None };
        let e = judge("evil", listed("/etc/x", PathType::HardLink), Found::Missing, None, 10);
        assert_eq!(
            e.unwrap_err().to_string(),
            "Package evil lists \"/etc/x\" in its paths.json, which is not a relative path inside the prefix (absolute, empty, or climbing with '..'); the package is refused and nothing was installed"
        );
        let target = Some(Path::new("/proc/self/pagemap"));
        let e = judge("evil", listed("m", PathType::SoftLink), Found::Link, target, 10);
        assert!(
            e.unwrap_err().to_string().contains("links m to \"/proc/self/pagemap\", which leaves the prefix")
        );
        let e = within(11, 10).unwrap_err().to_string();
        assert!(
            e.contains("hold up to 11 bytes (their files, with each prefix placeholder counted as often as it could occur), more than the 10 bytes")
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
        assert_eq!(check("ok", pkg, 10).unwrap(), 5);
        for (entries, want) in [
            (serde_json::json!([hard("proc/pagemap")]), "a path through a symbolic link"),
            (serde_json::json!([hard("lib/pagemap")]), "holds a symbolic link there"),
            (serde_json::json!([soft("lib/pagemap")]), "which leaves the prefix"),
            (serde_json::json!([hard("/etc/passwd")]), "not a relative path inside the prefix"),
            (serde_json::json!([hard("../../etc/passwd")]), "not a relative path inside the prefix"),
            (serde_json::json!([hard("lib/absent")]), "holds nothing there"),
        ] {
            write_paths(entries.clone());
            let e = check("evil", pkg, 10).unwrap_err().to_string();
            assert!(e.contains(want), "{entries}: {e}");
        }
        // A link listed with a placeholder, into a link that leaves (rattler would read
        // through both); an old-style package's `has_prefix` naming a link is the same entry.
        std::os::unix::fs::symlink("pagemap", pkg.join("lib/chain")).unwrap();
        let placeholder = serde_json::json!({"_path": "lib/chain", "path_type": "softlink", "prefix_placeholder": "/opt/anaconda1anaconda2anaconda3", "file_mode": "text"});
        write_paths(serde_json::json!([placeholder]));
        let e = check("evil", pkg, 10).unwrap_err().to_string();
        assert!(
            e.contains(
                "lists a prefix placeholder for lib/chain, which its archive holds as a symbolic link"
            ),
            "{e}"
        );
        std::fs::remove_file(pkg.join("info/paths.json")).unwrap();
        std::fs::write(pkg.join("info/files"), "lib/real\nlib/chain\n").unwrap();
        std::fs::write(pkg.join("info/has_prefix"), "/opt/anaconda1anaconda2anaconda3 text lib/chain\n")
            .unwrap();
        let e = check("evil", pkg, 10).unwrap_err().to_string();
        assert!(e.contains("lists a prefix placeholder for lib/chain"), "{e}");
        // A placeholder in a regular file counts at its largest.
        std::fs::write(pkg.join("info/has_prefix"), "/p text lib/real\n").unwrap();
        std::fs::write(pkg.join("lib/real"), b"/p/p/p").unwrap();
        assert_eq!(check("ok", pkg, 12).unwrap(), 6 + 3 * 10);
    }

    /// What rattler's cache reads of a package (through any link) must be a regular file,
    /// reached through no link, of a bounded size.
    #[test]
    fn metadata_files_are_checked_without_following_anything() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("pkg");
        std::fs::create_dir_all(pkg.join("info")).unwrap();
        std::fs::write(pkg.join("info/index.json"), "{}").unwrap();
        check_metadata("ok", &pkg).unwrap();
        for (file, how) in
            [("info/paths.json", "link"), ("info/index.json", "fifo"), ("info/has_prefix", "link")]
        {
            let at = pkg.join(file);
            let _ = std::fs::remove_file(&at);
            match how {
                "link" => std::os::unix::fs::symlink("/proc/self/fd/1", &at).unwrap(),
                _ => {
                    let c = CString::new(at.as_os_str().as_bytes()).unwrap();
                    // SAFETY: mkfifo(3) with a NUL-terminated path.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                }
            }
            let e = check_metadata("evil", &pkg).unwrap_err().to_string();
            assert!(e.starts_with("Package evil holds a") && e.contains(&format!("as its {file}")), "{e}");
            std::fs::remove_file(&at).unwrap();
            std::fs::write(&at, "{}").unwrap();
        }
        // `info` itself a link, and the package's directory a link.
        std::fs::rename(pkg.join("info"), dir.path().join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), pkg.join("info")).unwrap();
        let e = check_metadata("evil", &pkg).unwrap_err().to_string();
        assert!(e.contains("a path through a symbolic link as its info/index.json"), "{e}");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), dir.path().join("linked")).unwrap();
        assert!(check_metadata("evil", &dir.path().join("linked")).is_err());
    }
}
