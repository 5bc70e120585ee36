//! Workspace-relative paths of the remote workspace routes (contract §5.1), checked
//! without touching the filesystem.

/// Why a path was refused (the original's texts).
pub const NOT_RELATIVE: &str = "Workspace path must be a non-empty relative POSIX path";
pub const BAD_SEGMENT: &str = "Workspace path contains an invalid segment";
pub const MAX_PATH_CHARS: usize = 2000;
pub const COORDINATION_DIR: &str = common::layout::COORDINATION_DIR;
pub const COORDINATION: &str = "Workspace coordination files are not reachable through the file routes";

/// Splits a request path into its segments: trimmed, non-empty, at most 2000 characters,
/// no `\`, not absolute; no empty, `.` or `..` segment.
pub fn segments(path: &str) -> Result<Vec<&str>, &'static str> {
    let path = path.trim();
    if path.is_empty()
        || path.chars().count() > MAX_PATH_CHARS
        || path.contains('\\')
        || path.starts_with('/')
    {
        return Err(NOT_RELATIVE);
    }
    let parts: Vec<&str> = path.split('/').collect();
    if parts.iter().any(|s| s.is_empty() || *s == "." || *s == ".." || s.contains('\0')) {
        return Err(BAD_SEGMENT);
    }
    // A nested workspace's lease files live there; opening and closing one here would drop
    // the lease's POSIX lock held by this process, and writing one could forge a marker.
    if parts.contains(&COORDINATION_DIR) {
        return Err(COORDINATION);
    }
    Ok(parts)
}

/// The order of `localeCompare` for the paths we list, approximated without ICU: case
/// folded first; on a tie lowercase before uppercase, as ICU's root collation does
/// (`a.txt` < `b.txt` < `B.txt`).
pub fn locale_order(a: &str, b: &str) -> std::cmp::Ordering {
    a.to_lowercase().cmp(&b.to_lowercase()).then_with(|| b.cmp(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_table() {
        assert_eq!(segments("inputs/data.txt").unwrap(), vec!["inputs", "data.txt"]);
        assert_eq!(segments("  a/b ").unwrap(), vec!["a", "b"]);
        assert_eq!(segments(".hidden").unwrap(), vec![".hidden"]);
        for bad in ["", "   ", "/etc/passwd", "a\\b", &"x".repeat(2001)] {
            assert_eq!(segments(bad).unwrap_err(), NOT_RELATIVE, "{bad:?}");
        }
        for bad in ["a//b", "a/./b", "../x", "a/..", "a/", "."] {
            assert_eq!(segments(bad).unwrap_err(), BAD_SEGMENT, "{bad:?}");
        }
        assert!(segments(&"x".repeat(2000)).is_ok());
        assert_eq!(segments("agents/.workspace-coordination/x.sqlite").unwrap_err(), COORDINATION);
    }

    #[test]
    fn listing_order_folds_case() {
        let mut v = vec!["b.txt", "B.txt", "a.txt", "inputs/data.txt", "Zed"];
        v.sort_by(|a, b| locale_order(a, b));
        assert_eq!(v, vec!["a.txt", "b.txt", "B.txt", "inputs/data.txt", "Zed"]);
    }
}
