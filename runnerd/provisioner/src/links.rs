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

use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(
        "The prefix {prefix} holds a link that leaves it ({link} -> {target}); a package step put it there. Nothing was changed: delete the environment and create it again"
    )]
    Escapes { prefix: String, link: String, target: String },
    #[error(
        "The prefix {prefix} holds a package record for {package} that names a path outside it ({path}); a package step put it there. Nothing was changed: delete the environment and create it again"
    )]
    Record { prefix: String, package: String, path: String },
    #[error(
        "Package {package} is recorded from {url}, which is not one of the environment's channels; it is not installed"
    )]
    Foreign { package: String, url: String },
    #[error(
        "The prefix {prefix} holds {path}, which is not a file, a directory or a link (a FIFO, socket or device); a package step put it there. Nothing was changed: delete the environment and create it again"
    )]
    Special { prefix: String, path: String },
    #[error(
        "The prefix {prefix} holds more than {MAX_PREFIX_ENTRIES} entries; nothing was changed: delete the environment and create it again"
    )]
    TooMany { prefix: String },
    #[error("The prefix {prefix} could not be read")]
    Read {
        prefix: String,
        #[source]
        source: std::io::Error,
    },
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

/// The most entries a prefix may hold (the largest conda environments hold a few hundred
/// thousand): a step with the shared package cache locked walks it.
pub const MAX_PREFIX_ENTRIES: usize = 2_000_000;

/// Walks `prefix` without following links; the first link that leaves it is the error, and
/// so is anything but a file, a directory or a link (a FIFO planted where the provisioner
/// reads, such as `conda-meta/history`, would hang the step), or more than
/// [`MAX_PREFIX_ENTRIES`] entries.
pub fn check(prefix: &Path) -> Result<(), LinkError> {
    walk(prefix, true)
}

/// [`check`] without judging links: what a listing needs before it reads the records (a
/// link that leaves the prefix matters to the next change, which refuses it, not to a read).
pub fn check_readable(prefix: &Path) -> Result<(), LinkError> {
    walk(prefix, false)
}

fn walk(prefix: &Path, judge_links: bool) -> Result<(), LinkError> {
    let read = |source| LinkError::Read { prefix: prefix.display().to_string(), source };
    let real_prefix = match std::fs::canonicalize(prefix) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(read(e)),
    };
    let mut pending = vec![prefix.to_path_buf()];
    let mut seen = 0usize;
    while let Some(dir) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir == prefix => return Ok(()),
            Err(e) => return Err(read(e)),
        };
        for entry in entries {
            let entry = entry.map_err(read)?;
            let path = entry.path();
            let kind = entry.file_type().map_err(read)?;
            seen += 1;
            if seen > MAX_PREFIX_ENTRIES {
                return Err(LinkError::TooMany { prefix: prefix.display().to_string() });
            }
            if !(kind.is_symlink() || kind.is_dir() || kind.is_file()) {
                return Err(LinkError::Special {
                    prefix: prefix.display().to_string(),
                    path: path.strip_prefix(prefix).unwrap_or(&path).display().to_string(),
                });
            }
            if kind.is_symlink() && judge_links {
                let target = std::fs::read_link(&path).map_err(read)?;
                let inside = match std::fs::canonicalize(&path) {
                    Ok(real) => real.starts_with(&real_prefix),
                    Err(_) => stays_inside(prefix, &path, &target),
                };
                if !inside {
                    return Err(LinkError::Escapes {
                        prefix: prefix.display().to_string(),
                        link: path.strip_prefix(prefix).unwrap_or(&path).display().to_string(),
                        target: target.display().to_string(),
                    });
                }
            } else if kind.is_dir() {
                pending.push(path);
            }
        }
    }
    Ok(())
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
