//! The host interpreters an environment run hides (internals §2.4).

use std::path::{Path, PathBuf};

/// Host interpreters in `/usr/bin` (`python`, `python3`, `python3.N`, `R`, `Rscript`),
/// resolved to their targets, deduplicated and sorted; dangling links dropped.
pub fn host_interpreters(bin: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(bin) else { return Vec::new() };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| is_interpreter_name(&e.file_name().to_string_lossy()))
        .filter_map(|e| std::fs::canonicalize(e.path()).ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `^(?:python(?:3(?:\.\d+)?)?|R|Rscript)$`.
pub fn is_interpreter_name(name: &str) -> bool {
    if name == "R" || name == "Rscript" || name == "python" || name == "python3" {
        return true;
    }
    name.strip_prefix("python3.").is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpreter_names_are_the_originals_pattern() {
        for (name, yes) in [
            ("python", true),
            ("python3", true),
            ("python3.11", true),
            ("R", true),
            ("Rscript", true),
            ("python3.", false),
            ("python3.11-config", false),
            ("pythonic-tool", false),
            ("python2", false),
            ("Rscript2", false),
        ] {
            assert_eq!(is_interpreter_name(name), yes, "{name}");
        }
    }

    #[test]
    fn masks_are_resolved_deduplicated_and_skip_dangling_links() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path();
        std::fs::write(bin.join("python3.11"), b"elf").unwrap();
        for link in ["python", "python3"] {
            std::os::unix::fs::symlink("python3.11", bin.join(link)).unwrap();
        }
        std::os::unix::fs::symlink("/nonexistent/Rscript", bin.join("Rscript")).unwrap();
        std::fs::write(bin.join("pythonic-tool"), b"x").unwrap();
        let real = std::fs::canonicalize(bin.join("python3.11")).unwrap();
        assert_eq!(host_interpreters(bin), [real]);
    }
}
