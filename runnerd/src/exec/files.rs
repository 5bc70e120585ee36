//! What the workspace holds, by `size:mtime` fingerprint (internals §2.5): for the quota
//! checks and for `createdFiles`/`modifiedFiles`. Regular files only; symlinks are never
//! followed; nothing is hashed (the content-addressed receipt is the versioning store's job).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Workspace-relative path (`/`-separated) → (size, mtime in ns).
pub type Fingerprints = BTreeMap<String, (u64, i128)>;

/// Walks `root` without following symlinks. Unreadable directories are skipped (a sandbox
/// can make a directory unreadable; that must not fail the run).
pub fn fingerprints(root: &Path) -> Fingerprints {
    let mut out = Fingerprints::new();
    let mut stack: Vec<(std::path::PathBuf, String)> = vec![(root.to_owned(), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else { continue };
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            if kind.is_dir() {
                stack.push((entry.path(), rel));
            } else if kind.is_file()
                && let Ok(meta) = entry.metadata()
            {
                let mtime = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
                out.insert(rel, (meta.len(), mtime));
            }
        }
    }
    out
}

/// Bytes of all regular files.
pub fn usage(prints: &Fingerprints) -> u64 {
    prints.values().map(|(size, _)| size).sum()
}

/// Sorted `(created, modified)`; deletions are not reported (as the original).
pub fn changes(before: &Fingerprints, after: &Fingerprints) -> (Vec<String>, Vec<String>) {
    let mut created = Vec::new();
    let mut modified = Vec::new();
    for (path, print) in after {
        match before.get(path) {
            None => created.push(path.clone()),
            Some(old) if old != print => modified.push(path.clone()),
            Some(_) => {}
        }
    }
    (created, modified)
}

const QUOTA_SUFFIX: &str =
    "(current limit from system quota settings / SCIENCE_AGENT_MAX_WORKSPACE_BYTES; set to 0 for unlimited)";

/// Before and after a run.
pub fn quota_exceeds_message(limit: u64) -> String {
    format!("Workspace exceeds the {limit} byte execution quota {QUOTA_SUFFIX}")
}

/// During a run, when the poll kills it.
pub fn quota_exceeded_message(limit: u64) -> String {
    format!("Workspace exceeded the {limit} byte execution quota {QUOTA_SUFFIX}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_skips_symlinks_and_reports_changes() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/one.txt"), "1").unwrap();
        fs::write(root.join("keep.txt"), "22").unwrap();
        fs::write(root.join("gone.txt"), "333").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("dirlink")).unwrap();
        let before = fingerprints(root);
        assert_eq!(before.keys().collect::<Vec<_>>(), ["a/b/one.txt", "gone.txt", "keep.txt"]);
        assert_eq!(usage(&before), 6);

        std::thread::sleep(std::time::Duration::from_millis(5));
        fs::write(root.join("a/b/one.txt"), "1111").unwrap();
        fs::write(root.join("new.txt"), "").unwrap();
        fs::remove_file(root.join("gone.txt")).unwrap();
        let after = fingerprints(root);
        let (created, modified) = changes(&before, &after);
        assert_eq!(created, ["new.txt"]);
        assert_eq!(modified, ["a/b/one.txt"]);
    }

    #[test]
    fn quota_messages_are_the_originals() {
        assert_eq!(
            quota_exceeds_message(1000),
            "Workspace exceeds the 1000 byte execution quota (current limit from system quota settings / SCIENCE_AGENT_MAX_WORKSPACE_BYTES; set to 0 for unlimited)"
        );
        assert!(quota_exceeded_message(5).starts_with("Workspace exceeded the 5 byte execution quota ("));
    }
}
