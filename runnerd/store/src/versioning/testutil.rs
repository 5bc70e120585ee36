//! Fixtures shared by the module's tests: a temporary store and the §8 example workspace.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;

use tempfile::TempDir;

use super::store::Store;
use super::{Pool, RECORD_MEDIA_TYPE, Ref};

/// Root `WorkspaceTree` of the example workspace (§8).
pub const ROOT_TREE_HEX: &str = "3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653";
pub const ROOT_TREE_SIZE: u64 = 1656;
/// `a,b\n1,2\n`.
pub const X_CSV_HEX: &str = "492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470";

/// A fresh store in its own temporary data directory.
pub fn temp_store() -> (TempDir, Store) {
    let dir = TempDir::new().unwrap();
    let store = Store::open(dir.path()).unwrap();
    (dir, store)
}

/// The example workspace of §8 under `root` (which must exist).
pub fn example_workspace(root: &Path) {
    write_mode(&root.join("README.md"), b"hello\n", 0o644);
    fs::create_dir(root.join("data")).unwrap();
    write_mode(&root.join("data/x.csv"), b"a,b\n1,2\n", 0o644);
    fs::create_dir(root.join("empty")).unwrap();
    symlink("README.md", root.join("link")).unwrap();
    write_mode(&root.join("run.sh"), b"#!/bin/sh\necho hi\n", 0o755);
}

pub fn write_mode(path: &Path, bytes: &[u8], mode: u32) {
    fs::write(path, bytes).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// The ref of the example's root tree, as the vectors state it.
pub fn root_tree_ref() -> Ref {
    Ref::new(Pool::AgentState, ROOT_TREE_HEX, ROOT_TREE_SIZE, RECORD_MEDIA_TYPE)
}

/// The raw bytes of a blob as stored (no verification), to compare against the vectors.
pub fn blob_text(store: &Store, r: &Ref) -> String {
    String::from_utf8(fs::read(store.blob_path(r.pool, r.hex())).unwrap()).unwrap()
}
