//! Whether this node is being drained (issue #35): set by a fleet router's `drain`, read by
//! every router from `GET /load`, so that router replicas agree without talking to each other
//! (the node is the truth) and a restart of either side keeps it. A marker file beside the
//! placement database; the directory is runnerd's own, never a sandbox's.

use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use runner_store::transfer::placement::PLACEMENT_DIR;

const MARKER: &str = "draining";

fn marker(data_dir: &Path) -> PathBuf {
    data_dir.join(PLACEMENT_DIR).join(MARKER)
}

/// Whether the node is draining: a regular file (never a link) marks it.
pub fn get(data_dir: &Path) -> bool {
    std::fs::symlink_metadata(marker(data_dir)).is_ok_and(|m| m.file_type().is_file())
}

/// Marks the node draining or not.
pub fn set(data_dir: &Path, draining: bool) -> std::io::Result<()> {
    let path = marker(data_dir);
    if draining {
        std::fs::create_dir_all(path.parent().unwrap_or(data_dir))?;
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::AlreadyExists && get(data_dir) => Ok(()),
            Err(e) => Err(e),
        }
    } else {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_and_cleared_and_a_link_is_not_a_mark() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!get(dir.path()));
        set(dir.path(), true).unwrap();
        set(dir.path(), true).unwrap();
        assert!(get(dir.path()));
        set(dir.path(), false).unwrap();
        set(dir.path(), false).unwrap();
        assert!(!get(dir.path()));
        std::os::unix::fs::symlink("/etc/passwd", marker(dir.path())).unwrap();
        assert!(!get(dir.path()));
        assert!(set(dir.path(), true).is_err(), "a planted link is never written through");
    }
}
