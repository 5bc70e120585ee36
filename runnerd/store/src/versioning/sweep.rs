//! Start-up removal of the temporary objects a crashed commit left (`*.tmp` beside the
//! blobs and layout files), only those no live writer owns.
//!
//! Ownership, two rules. runnerd names its own temporaries `….runnerd-<pid>.tmp`: one whose
//! process is gone, or that carries our own pid (the sweep runs before this process writes;
//! a container reuses pids), is removed at once (a pid reused by another live process keeps
//! it, until the second rule). Any other temporary (the API process writes the same store, with names of
//! its own) is removed only once unmodified for [`STALE_TEMPORARY`]: a live writer writes
//! its temporary chunk by chunk, fsyncs it and links it at once, so it is never that old.

use std::path::Path;
use std::time::Duration;

/// How long a temporary runnerd cannot attribute must stand unmodified before it is removed.
pub const STALE_TEMPORARY: Duration = Duration::from_secs(3600);

/// The tag runnerd puts before `.tmp` in its own temporaries' names.
pub fn own_suffix() -> String {
    format!(".runnerd-{}.tmp", std::process::id())
}

/// What the sweep does with one directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not a temporary, or one a live writer may own.
    Keep,
    Remove,
}

/// The rule, pure: `alive(pid)` says whether a process exists; `age` is how long the
/// entry stands unmodified.
pub fn verdict(name: &str, age: Duration, alive: impl Fn(u32) -> bool) -> Verdict {
    let Some(stem) = name.strip_suffix(".tmp") else { return Verdict::Keep };
    let owner = stem.rsplit_once(".runnerd-").and_then(|(_, pid)| pid.parse::<u32>().ok());
    match owner {
        // The sweep runs at start-up, before this process writes anything: an entry named
        // with our own pid is a previous instance's (a container reuses pids).
        Some(pid) if pid == std::process::id() || !alive(pid) => Verdict::Remove,
        _ if age >= STALE_TEMPORARY => Verdict::Remove,
        _ => Verdict::Keep,
    }
}

/// Whether a process with this pid exists (as this process sees them).
fn alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes the temporaries in `dir` that [`verdict`] gives up (regular files only; the
/// name itself is unlinked, never followed). Returns how many.
pub fn sweep_dir(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.ends_with(".tmp") {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.file_type().is_file() {
            continue;
        }
        let age = meta.modified().ok().and_then(|m| m.elapsed().ok()).unwrap_or_default();
        if verdict(name, age, alive) == Verdict::Remove && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(event = "temporary_removed", path = %entry.path().display());
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_temporaries_no_live_writer_owns_are_removed() {
        let me = std::process::id();
        let young = Duration::from_secs(5);
        let old = STALE_TEMPORARY;
        let dead = |pid| pid != 42;
        for (name, age, want) in [
            ("abc.tmp", young, Verdict::Keep),
            ("abc.tmp", old, Verdict::Remove),
            ("abc", old, Verdict::Keep),
            ("abc.tmp.x", old, Verdict::Keep),
            ("abc.runnerd-7.tmp", young, Verdict::Remove),
            ("abc.runnerd-42.tmp", young, Verdict::Keep),
            ("abc.runnerd-42.tmp", old, Verdict::Remove),
            ("abc.runnerd-x.tmp", young, Verdict::Keep),
            (&format!("abc.runnerd-{me}.tmp"), young, Verdict::Remove),
        ] {
            assert_eq!(verdict(name, age, |p| !dead(p)), want, "{name} {age:?}");
        }
        assert!(own_suffix().ends_with(".tmp") && own_suffix().contains(&me.to_string()));
    }
}
