//! Refuses to change a prefix that holds what a hostile step could plant to reach outside it:
//! a symbolic link leading out of it, or a package record naming a path outside it.
//!
//! A pip or R step runs hostile build code with the prefix writable (and nothing else of the
//! data directory). It could plant `lib -> /<data>/scientific-envs/provisioner/pkgs/…`; the
//! next conda step sees the package cache writable at that same path, and the installer,
//! which creates files beneath the prefix's directories, would write through the link into
//! the cache every other environment is copied from. Links that packages bring are relative
//! and stay inside their prefix; one that leaves it is refused before anything is written.
//! Links are resolved by the kernel (`..` after a link climbs from the link's target), and
//! judged by their text only where they resolve to nothing. Likewise a forged
//! `conda-meta/*.json` whose paths climb out would make the installer delete cache files when
//! it unlinks that package.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

/// What a prefix holds that no step may build on, or an origin refused. The remedy is the
/// caller's to say: whether anything was changed depends on when the check ran.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(
        "The prefix {prefix} holds a link that leaves it ({link} -> {target}); a package step put it there"
    )]
    Escapes { prefix: String, link: String, target: String },
    #[error(
        "The prefix {prefix} holds a package record for {package} that names a path outside it ({path}); a package step put it there"
    )]
    Record { prefix: String, package: String, path: String },
    #[error(
        "Package {package} is recorded from {url}, which is not one of the environment's channels; it is not installed"
    )]
    Foreign { package: String, url: String },
    #[error(
        "The prefix {prefix} holds {path}, which is not a file, a directory or a link (a FIFO, socket or device); a package step put it there"
    )]
    Special { prefix: String, path: String },
    #[error("The prefix {prefix} holds more than {MAX_PREFIX_ENTRIES} entries")]
    TooMany { prefix: String },
    #[error("The prefix {prefix} holds more than {MAX_PREFIX_LINKS} symbolic links")]
    TooManyLinks { prefix: String },
    #[error("The prefix {prefix} nests directories more than {MAX_PREFIX_DEPTH} deep ({path})")]
    TooDeep { prefix: String, path: String },
    #[error(
        "The prefix {prefix} holds {path} in conda-meta, which is not a file (the package records are only ever files); a package step put it there"
    )]
    MetaNotFile { prefix: String, path: String },
    #[error("The prefix {prefix} holds more than {MAX_META_BYTES} bytes of package records (conda-meta)")]
    MetaTooLarge { prefix: String },
    #[error("The prefix {prefix} could not be read")]
    Read {
        prefix: String,
        #[source]
        source: std::io::Error,
    },
}

impl LinkError {
    /// Whether the prefix itself is damaged (only deleting the environment repairs it), not
    /// an origin refused or a prefix unreadable.
    pub fn damaged(&self) -> bool {
        !matches!(self, LinkError::Foreign { .. } | LinkError::Read { .. })
    }

    /// The remedy when the check ran before anything was written.
    pub fn unchanged_remedy(&self) -> &'static str {
        match self.damaged() {
            true => ". Nothing was changed: delete the environment and create it again",
            false => "",
        }
    }
}

/// `base.join(target)` with `.` and `..` resolved lexically; `None` when `..` would climb
/// above the root.
fn lexical(base: &Path, target: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in base.join(target).components() {
        match c {
            Component::RootDir => out.push("/"),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(n) => out.push(n),
            Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Whether a link at `link` (inside `prefix`) with `target` stays inside `prefix`, judged
/// lexically: every directory it passes through must be the prefix's own (a link through
/// another link is checked when that one is).
pub fn stays_inside(prefix: &Path, link: &Path, target: &Path) -> bool {
    let parent = link.parent().unwrap_or(prefix);
    lexical(parent, target).is_some_and(|resolved| resolved.starts_with(prefix))
}

/// The most entries a prefix may hold ([`common::provision::MAX_PREFIX_ENTRIES`]): a step
/// with the shared package cache locked walks it.
pub const MAX_PREFIX_ENTRIES: usize = common::provision::MAX_PREFIX_ENTRIES as usize;
/// The most symbolic links a prefix may hold (real environments hold a few thousand): each
/// is resolved by the kernel, at a cost that grows with its depth.
pub const MAX_PREFIX_LINKS: usize = 200_000;
/// The deepest a prefix's directories may nest (packages stay far below): a link deep in a
/// chain of 1,900 one-letter directories costs millions of lookups to resolve by path.
pub const MAX_PREFIX_DEPTH: usize = 128;
/// The most bytes `conda-meta/` may hold, records and history together (a large
/// environment's take tens of megabytes): the provisioner reads and parses all of it, with
/// the package cache locked, and one file hard-linked 8,000 times would be read 8,000 times.
pub const MAX_META_BYTES: u64 = 512 << 20;

/// Walks `prefix` without following links; the first link that leaves it is the error, and
/// so is anything but a file, a directory or a link (a FIFO planted where the provisioner
/// reads, such as `conda-meta/history`, would hang the step), anything but a file in
/// `conda-meta/`, or more than [`MAX_PREFIX_ENTRIES`] entries, [`MAX_PREFIX_LINKS`] links,
/// [`MAX_PREFIX_DEPTH`] levels or [`MAX_META_BYTES`] of records: the walk, and what the
/// step reads after it, stay bounded whatever a package step left.
pub fn check(prefix: &Path) -> Result<(), LinkError> {
    walk(prefix, true)
}

/// [`check`] without judging links: what a listing needs before it reads the records (a
/// link that leaves the prefix matters to the next change, which refuses it, not to a read).
pub fn check_readable(prefix: &Path) -> Result<(), LinkError> {
    walk(prefix, false)
}

fn walk(prefix: &Path, judge_links: bool) -> Result<(), LinkError> {
    let shown = || prefix.display().to_string();
    let read = |source| LinkError::Read { prefix: shown(), source };
    let real_prefix = match std::fs::canonicalize(prefix) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(read(e)),
    };
    let beneath = Beneath::open(prefix).map_err(read)?;
    let meta = prefix.join("conda-meta");
    let (mut entries_seen, mut links_seen, mut meta_bytes) = (0usize, 0usize, 0u64);
    let mut pending = vec![(prefix.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir == prefix => return Ok(()),
            Err(e) => return Err(read(e)),
        };
        let in_meta = dir == meta;
        for entry in entries {
            let entry = entry.map_err(read)?;
            let path = entry.path();
            let relative = || path.strip_prefix(prefix).unwrap_or(&path).display().to_string();
            let kind = entry.file_type().map_err(read)?;
            entries_seen += 1;
            if entries_seen > MAX_PREFIX_ENTRIES {
                return Err(LinkError::TooMany { prefix: shown() });
            }
            if !(kind.is_symlink() || kind.is_dir() || kind.is_file()) {
                return Err(LinkError::Special { prefix: shown(), path: relative() });
            }
            if in_meta {
                if !kind.is_file() {
                    return Err(LinkError::MetaNotFile { prefix: shown(), path: relative() });
                }
                meta_bytes = meta_bytes.saturating_add(entry.metadata().map_err(read)?.len());
                if meta_bytes > MAX_META_BYTES {
                    return Err(LinkError::MetaTooLarge { prefix: shown() });
                }
            }
            if kind.is_symlink() {
                links_seen += 1;
                if links_seen > MAX_PREFIX_LINKS {
                    return Err(LinkError::TooManyLinks { prefix: shown() });
                }
                if judge_links && !link_stays_inside(&beneath, prefix, &real_prefix, &path).map_err(read)? {
                    let target = std::fs::read_link(&path).map_err(read)?;
                    return Err(LinkError::Escapes {
                        prefix: shown(),
                        link: relative(),
                        target: target.display().to_string(),
                    });
                }
            } else if kind.is_dir() {
                if depth + 1 > MAX_PREFIX_DEPTH {
                    return Err(LinkError::TooDeep { prefix: shown(), path: relative() });
                }
                pending.push((path, depth + 1));
            }
        }
    }
    Ok(())
}

/// Whether the link at `path` resolves inside the prefix, as the kernel resolves it.
///
/// `openat2(RESOLVE_BENEATH)` from the prefix resolves the link's whole path in one call and
/// fails with `EXDEV` the moment anything climbs out or is absolute. An absolute link is then
/// judged by its target: inside when that names a path under the prefix which itself
/// resolves beneath it. A link that resolves to nothing (dangling, a loop) is judged by its
/// text ([`stays_inside`]). Where the kernel has no `openat2`, `realpath` decides, as before.
fn link_stays_inside(
    beneath: &Beneath,
    prefix: &Path,
    real_prefix: &Path,
    path: &Path,
) -> std::io::Result<bool> {
    let relative = path.strip_prefix(prefix).unwrap_or(path);
    match beneath.resolve(relative) {
        Resolved::Inside => Ok(true),
        Resolved::Unsupported => {
            let target = std::fs::read_link(path)?;
            Ok(match std::fs::canonicalize(path) {
                Ok(real) => real.starts_with(real_prefix),
                Err(_) => stays_inside(prefix, path, &target),
            })
        }
        Resolved::Nothing => Ok(stays_inside(prefix, path, &std::fs::read_link(path)?)),
        Resolved::Outside => {
            let target = std::fs::read_link(path)?;
            let under = [prefix, real_prefix].into_iter().find_map(|p| target.strip_prefix(p).ok());
            Ok(match under {
                Some(rest) => match beneath.resolve(rest) {
                    Resolved::Inside => true,
                    Resolved::Nothing => stays_inside(prefix, path, &target),
                    Resolved::Outside | Resolved::Unsupported => false,
                },
                None => false,
            })
        }
    }
}

/// The prefix's directory, for resolving paths beneath it.
struct Beneath(std::os::fd::OwnedFd);

/// What resolving a path beneath the prefix gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolved {
    Inside,
    /// It climbed out, or passed an absolute link (`EXDEV`).
    Outside,
    /// It names nothing (dangling, a loop, a file used as a directory).
    Nothing,
    /// No `openat2` here (kernel before 5.6, or a filter refusing it).
    Unsupported,
}

impl Beneath {
    fn open(prefix: &Path) -> std::io::Result<Beneath> {
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(prefix)?;
        Ok(Beneath(dir.into()))
    }

    fn resolve(&self, relative: &Path) -> Resolved {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(relative.as_os_str()))
        else {
            return Resolved::Nothing;
        };
        // SAFETY: open_how is plain integers, for which all zeroes is a valid value.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: openat2(2) with a live directory descriptor, a NUL-terminated path and a
        // fully initialised open_how of the size passed; the result is checked.
        let ret = common::sys::cvt(unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.0.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        });
        match ret {
            Ok(fd) => {
                // SAFETY: the kernel just returned this descriptor; nothing else owns it.
                drop(unsafe { OwnedFd::from_raw_fd(fd as i32) });
                Resolved::Inside
            }
            Err(e) => match e.raw_os_error() {
                Some(libc::EXDEV) => Resolved::Outside,
                Some(libc::ENOSYS | libc::EPERM | libc::E2BIG) => Resolved::Unsupported,
                _ => Resolved::Nothing,
            },
        }
    }
}

/// A record path that stays inside its prefix: relative, and only names (no `..`, no root).
fn plain_relative(path: &Path) -> bool {
    path.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The installed records runnerd's next step will trust: every path they name relative and
/// inside, no system menus (whose removal deletes outside the prefix).
pub fn check_records(prefix: &Path, records: &[rattler_conda_types::PrefixRecord]) -> Result<(), LinkError> {
    for r in records {
        let package = r.repodata_record.package_record.name.as_normalized().to_owned();
        let bad = r
            .files
            .iter()
            .chain(r.paths_data.paths.iter().map(|p| &p.relative_path))
            .find(|p| !plain_relative(p))
            .map(|p| p.display().to_string())
            .or_else(|| (!r.installed_system_menus.is_empty()).then(|| "(system menus)".to_owned()));
        if let Some(path) = bad {
            return Err(LinkError::Record { prefix: prefix.display().to_string(), package, path });
        }
    }
    Ok(())
}

/// Every package a step fetches or links must come from one of `channels`: the records may
/// have been read from a prefix a hostile step wrote (an installed record the solver kept),
/// and are not trusted to name an archive anywhere else, such as one that step planted
/// itself. Judged on the parsed URL, never its text alone: a `%2F` in a segment passes a
/// text prefix check and becomes a `/` (and `..%2F` a climb) when a `file:` URL is turned
/// into a path, so any encoded separator or dot is refused outright.
pub fn check_origins<'a>(
    records: impl IntoIterator<Item = &'a rattler_conda_types::RepoDataRecord>,
    channels: &[String],
) -> Result<(), LinkError> {
    for r in records {
        if !served_by(&r.url, channels) {
            return Err(LinkError::Foreign {
                package: r.package_record.name.as_normalized().to_owned(),
                url: r.url.to_string(),
            });
        }
    }
    Ok(())
}

/// Whether `url` names a file beneath one of `channels` (same scheme, host and port, a path
/// under the channel's path), with no encoded separator, backslash or dot anywhere in it.
pub fn served_by(url: &url::Url, channels: &[String]) -> bool {
    let path = url.path();
    let lowered = path.to_ascii_lowercase();
    if ["%2f", "%5c", "%2e", "%00", "\\"].iter().any(|bad| lowered.contains(bad))
        || url.query().is_some()
        || url.fragment().is_some()
        || !url.username().is_empty()
        || url.password().is_some()
        || path.split('/').any(|segment| segment == "." || segment == "..")
    {
        return false;
    }
    channels.iter().filter_map(|c| url::Url::parse(c).ok()).any(|channel| {
        let base = channel.path().trim_end_matches('/');
        channel.scheme() == url.scheme()
            && channel.host_str() == url.host_str()
            && channel.port_or_known_default() == url.port_or_known_default()
            && path.strip_prefix(base).is_some_and(|rest| rest.starts_with('/') && rest.len() > 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_files_beneath_a_channel_are_served_by_it() {
        let channels = ["file:///srv/ch".to_owned(), "https://mirror.example/conda-forge/".to_owned()];
        for (url, served) in [
            ("file:///srv/ch/noarch/a-1-0.conda", true),
            ("https://mirror.example/conda-forge/linux-64/a-1-0.tar.bz2", true),
            ("file:///srv/ch/..%2F..%2Fdata%2Fevil.conda", false),
            ("file:///srv/ch/noarch/..%2fevil.conda", false),
            ("file:///srv/ch/noarch/%2e%2e/%2e%2e/evil.conda", false),
            // The url crate folds dot segments when it parses: this one stays inside.
            ("file:///srv/ch/noarch/%2e%2e/evil.conda", true),
            ("file:///srv/ch/noarch/a%5C..%5Cb.conda", false),
            ("file:///srv/channel-other/noarch/a-1-0.conda", false),
            ("file:///srv/ch", false),
            ("file:///srv/ch/", false),
            ("https://mirror.example/conda-forge-evil/noarch/a.conda", false),
            ("https://mirror.example:8443/conda-forge/noarch/a.conda", false),
            ("http://mirror.example/conda-forge/noarch/a.conda", false),
            ("https://user@mirror.example/conda-forge/noarch/a.conda", false),
            ("https://mirror.example/conda-forge/noarch/a.conda?x=1", false),
            ("https://other.example/conda-forge/noarch/a.conda", false),
        ] {
            let parsed = url::Url::parse(url).unwrap();
            assert_eq!(served_by(&parsed, &channels), served, "{url}");
        }
    }

    #[test]
    fn links_inside_are_kept_and_links_out_are_refused() {
        let p = Path::new("/d/envs/e/rev");
        for (link, target, inside) in [
            ("/d/envs/e/rev/bin/python3", "python3.11", true),
            ("/d/envs/e/rev/lib/libz.so", "libz.so.1", true),
            ("/d/envs/e/rev/lib/a/b", "../../share/x", true),
            ("/d/envs/e/rev/bin/x", "/d/envs/e/rev/lib/x", true),
            ("/d/envs/e/rev/lib", "/d/provisioner/pkgs", false),
            ("/d/envs/e/rev/lib/x", "../../other", false),
            ("/d/envs/e/rev/x", "../rev2", false),
            ("/d/envs/e/rev/x", "../../../../../../..", false),
            ("/d/envs/e/rev/x", "/etc/passwd", false),
        ] {
            assert_eq!(stays_inside(p, Path::new(link), Path::new(target)), inside, "{link} -> {target}");
        }
    }

    #[test]
    fn a_planted_directory_link_is_found_anywhere_in_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        std::fs::create_dir_all(prefix.join("lib/python3.11/site-packages")).unwrap();
        std::os::unix::fs::symlink("python3.11", prefix.join("lib/python3")).unwrap();
        check(&prefix).unwrap();
        std::os::unix::fs::symlink(dir.path(), prefix.join("lib/python3.11/site-packages/evil")).unwrap();
        let e = check(&prefix).unwrap_err().to_string();
        assert!(e.contains("lib/python3.11/site-packages/evil -> "), "{e}");
        assert!(check(&dir.path().join("absent")).is_ok(), "an absent prefix has no links");
    }

    #[test]
    fn a_planted_fifo_is_refused_before_anything_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        std::fs::create_dir_all(prefix.join("conda-meta")).unwrap();
        std::fs::write(prefix.join("conda-meta/a-1-0.json"), "{}").unwrap();
        check(&prefix).unwrap();
        let fifo =
            std::ffi::CString::new(prefix.join("conda-meta/history").into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = check(&prefix).unwrap_err().to_string();
        assert!(e.contains("holds conda-meta/history, which is not a file"), "{e}");
    }

    /// `..` after a link climbs from the link's target: `l -> ..` makes `l/b/l/../..` read
    /// inside lexically while the kernel lands outside.
    #[test]
    fn a_link_that_escapes_only_through_another_link_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        std::fs::create_dir_all(prefix.join("a/b")).unwrap();
        std::fs::create_dir_all(dir.path().join("cache/pkgs")).unwrap();
        std::os::unix::fs::symlink("..", prefix.join("a/b/l")).unwrap();
        check(&prefix).unwrap();
        std::os::unix::fs::symlink("l/b/l/../../cache/pkgs", prefix.join("a/b/x")).unwrap();
        let lexically = stays_inside(&prefix, &prefix.join("a/b/x"), Path::new("l/b/l/../../cache/pkgs"));
        assert!(lexically, "reads as inside");
        let e = check(&prefix).unwrap_err().to_string();
        assert!(e.contains("a/b/x -> "), "{e}");
    }

    #[test]
    fn links_are_judged_by_where_the_kernel_resolves_them() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        std::fs::create_dir_all(prefix.join("lib/deep/er")).unwrap();
        std::fs::create_dir_all(dir.path().join("cache")).unwrap();
        let real = std::fs::canonicalize(&prefix).unwrap();
        for (link, target, inside) in [
            ("lib/libz.so", "libz.so.1".to_owned(), true),
            ("lib/deep/er/up", "../../../lib".to_owned(), true),
            ("bin", format!("{}/lib", prefix.display()), true),
            ("bin2", format!("{}/lib/deep", real.display()), true),
            ("gone", format!("{}/nothing/here", prefix.display()), true),
            ("out", format!("{}/cache", dir.path().display()), false),
            ("climb", "../cache".to_owned(), false),
            ("abs-through", format!("{}/bin/../../cache", prefix.display()), false),
            ("etc", "/etc".to_owned(), false),
        ] {
            let at = prefix.join(link);
            std::os::unix::fs::symlink(&target, &at).unwrap();
            let result = check(&prefix);
            assert_eq!(result.is_ok(), inside, "{link} -> {target}: {result:?}");
            std::fs::remove_file(&at).unwrap();
        }
    }

    #[test]
    fn a_prefix_nested_deeper_than_the_most_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        let mut deepest = prefix.clone();
        for _ in 0..MAX_PREFIX_DEPTH {
            deepest.push("d");
        }
        std::fs::create_dir_all(&deepest).unwrap();
        std::os::unix::fs::symlink(".", deepest.join("l")).unwrap();
        check(&prefix).unwrap();
        std::fs::create_dir(deepest.join("d")).unwrap();
        let e = check(&prefix).unwrap_err();
        assert!(matches!(e, LinkError::TooDeep { .. }), "{e}");
        assert!(matches!(check_readable(&prefix), Err(LinkError::TooDeep { .. })));
    }

    #[test]
    fn conda_meta_holds_only_files_and_at_most_the_most_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("rev");
        let meta = prefix.join("conda-meta");
        std::fs::create_dir_all(&meta).unwrap();
        std::fs::write(meta.join("a-1-0.json"), "{}").unwrap();
        check_readable(&prefix).unwrap();
        // A link there (to a record elsewhere, read once per link) is no record.
        std::os::unix::fs::symlink("a-1-0.json", meta.join("b-1-0.json")).unwrap();
        assert!(matches!(check_readable(&prefix), Err(LinkError::MetaNotFile { .. })));
        std::fs::remove_file(meta.join("b-1-0.json")).unwrap();
        std::fs::create_dir(meta.join("sub")).unwrap();
        assert!(matches!(check(&prefix), Err(LinkError::MetaNotFile { .. })));
        std::fs::remove_dir(meta.join("sub")).unwrap();
        // Sparse: the size counts, not the blocks.
        let big = std::fs::File::create(meta.join("big-1-0.json")).unwrap();
        big.set_len(MAX_META_BYTES - 2).unwrap();
        check_readable(&prefix).unwrap();
        std::fs::hard_link(meta.join("a-1-0.json"), meta.join("c-1-0.json")).unwrap();
        let e = check(&prefix).unwrap_err();
        assert!(matches!(e, LinkError::MetaTooLarge { .. }), "{e}");
    }

    #[test]
    fn record_paths_must_be_plain_relative() {
        for (p, ok) in [
            ("lib/x.so", true),
            ("./bin/a", true),
            ("../pkgs/x", false),
            ("/etc/x", false),
            ("a/../../b", false),
        ] {
            assert_eq!(plain_relative(Path::new(p)), ok, "{p}");
        }
    }
}
