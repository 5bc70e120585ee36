//! The file list of a snapshot, for `WorkspaceExport` records and file streaming (§3.4).

use serde_json::{Map, Value};

use super::names::b64url_decode;
use super::store::Store;
use super::{Pool, Ref, VersionError};

/// At most this many selected paths per export, as in the original.
pub const MAX_SELECTED_PATHS: usize = 50;

/// A regular file of a snapshot: its `/`-joined Workspace path, content and exec bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFile {
    pub path: String,
    pub content: Ref,
    pub executable: u32,
}

impl SnapshotFile {
    /// `{content, executable, path}` as in the `files` of a `WorkspaceExport`.
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert("content".into(), self.content.to_value());
        map.insert("executable".into(), Value::from(self.executable));
        map.insert("path".into(), Value::from(self.path.as_str()));
        Value::Object(map)
    }
}

/// The `WorkspaceExport` value: `{capturedAt, files, tree, workspace}`.
pub fn export_value(workspace_key: &str, tree: &Ref, files: &[SnapshotFile], captured_at_iso: &str) -> Value {
    let mut map = Map::new();
    map.insert("capturedAt".into(), Value::from(captured_at_iso));
    map.insert("files".into(), Value::Array(files.iter().map(SnapshotFile::to_value).collect()));
    map.insert("tree".into(), tree.to_value());
    map.insert("workspace".into(), Value::from(workspace_key));
    Value::Object(map)
}

impl Store {
    /// The regular files of the tree `tree`, depth-first in entry order; symlinks are skipped.
    /// With a selection, only files equal to or under a selected path are kept.
    pub fn snapshot_files(
        &self,
        tree: &Ref,
        selection: Option<&[String]>,
    ) -> Result<Vec<SnapshotFile>, VersionError> {
        if let Some(selection) = selection {
            if selection.len() > MAX_SELECTED_PATHS {
                return Err(VersionError::TooManyPaths(selection.len()));
            }
            for path in selection {
                validate_selected(path)?;
            }
        }
        let mut files = Vec::new();
        self.collect_files(tree, "", &mut files)?;
        if let Some(selection) = selection {
            files.retain(|f| selection.iter().any(|s| selected(&f.path, s)));
        }
        Ok(files)
    }

    fn collect_files(
        &self,
        tree: &Ref,
        prefix: &str,
        out: &mut Vec<SnapshotFile>,
    ) -> Result<(), VersionError> {
        let record = self.read_record(tree, Some("WorkspaceTree"))?;
        let entries = record.value.get("entries").and_then(Value::as_array).ok_or(VersionError::Schema)?;
        for entry in entries {
            let name = entry_name(entry)?;
            let path = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            match entry.get("type").and_then(Value::as_str) {
                Some("file") => {
                    let content = Ref::from_value(entry.get("content").ok_or(VersionError::Schema)?)?;
                    content.require_pool(Pool::Data)?;
                    let executable = entry
                        .get("executable")
                        .and_then(Value::as_u64)
                        .filter(|x| x & !0o111 == 0)
                        .ok_or(VersionError::Schema)? as u32;
                    out.push(SnapshotFile { path, content, executable });
                }
                Some("directory") => {
                    let child = Ref::from_value(entry.get("tree").ok_or(VersionError::Schema)?)?;
                    self.collect_files(&child, &path, out)?;
                }
                Some("symlink") => {}
                _ => return Err(VersionError::Schema),
            }
        }
        Ok(())
    }
}

/// A tree entry's name as a single UTF-8 path segment.
fn entry_name(entry: &Value) -> Result<String, VersionError> {
    let encoded = entry.get("name").and_then(Value::as_str).ok_or(VersionError::Schema)?;
    let name = String::from_utf8(b64url_decode(encoded)?).map_err(|_| VersionError::NonUtf8Name)?;
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(VersionError::InvalidSnapshotFilename);
    }
    Ok(name)
}

/// A selected path must be relative, without `\`, empty, `.` or `..` segments.
fn validate_selected(path: &str) -> Result<(), VersionError> {
    let bad = path.contains('\\') || path.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..");
    if bad { Err(VersionError::SelectionPath(path.to_string())) } else { Ok(()) }
}

/// `path` equals `selected` or lies under it.
fn selected(path: &str, selected: &str) -> bool {
    path.strip_prefix(selected).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::ffi::OsStrExt;

    use super::*;
    use crate::versioning::testutil::{X_CSV_HEX, blob_text, example_workspace, temp_store};
    use crate::versioning::{OCTET_STREAM, RECORD_MEDIA_TYPE};

    const EXPORT: &str = r#"{"dependencies":[{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656},{"digest":"sha256:492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470","mediaType":"application/octet-stream","pool":"data","size":8}],"kind":"WorkspaceExport","schemaVersion":1,"value":{"capturedAt":"2026-09-01T12:00:00.000Z","files":[{"content":{"digest":"sha256:492d5ea496056f1a6a6592241032fab764c321596317930b4fa0e1e8bc3b7470","mediaType":"application/octet-stream","pool":"data","size":8},"executable":0,"path":"data/x.csv"}],"tree":{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656},"workspace":"project-1/session-1"}}"#;

    fn paths(files: &[SnapshotFile]) -> Vec<&str> {
        files.iter().map(|f| f.path.as_str()).collect()
    }

    fn sel(paths: &[&str]) -> Vec<String> {
        paths.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn export_vector_and_full_listing() {
        let (_dir, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        example_workspace(ws.path());
        let tree = store.snapshot(ws.path()).unwrap();
        let all = store.snapshot_files(&tree, None).unwrap();
        assert_eq!(paths(&all), ["README.md", "data/x.csv", "run.sh"]);
        assert_eq!(all[2].executable, 73);

        let files = store.snapshot_files(&tree, Some(&sel(&["data"]))).unwrap();
        assert_eq!(
            files,
            [SnapshotFile {
                path: "data/x.csv".into(),
                content: Ref::new(Pool::Data, X_CSV_HEX, 8, OCTET_STREAM),
                executable: 0
            }]
        );
        let value = export_value("project-1/session-1", &tree, &files, "2026-09-01T12:00:00.000Z");
        let r = store.put_record("WorkspaceExport", value).unwrap();
        assert_eq!(blob_text(&store, &r), EXPORT);
        assert_eq!(
            (r.hex(), r.size),
            ("cddb056cc06517cd8501b97060682e99abf13703bae9628e4ce5f5171cfb66f4", 863)
        );
        assert_eq!(r.media_type, RECORD_MEDIA_TYPE);
    }

    #[test]
    fn selection_keeps_files_under_selected_paths_and_skips_symlinks() {
        let (_dir, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        fs::create_dir(ws.path().join("data")).unwrap();
        fs::write(ws.path().join("data/file"), b"x").unwrap();
        fs::write(ws.path().join("database"), b"y").unwrap();
        std::os::unix::fs::symlink("data/file", ws.path().join("link")).unwrap();
        let tree = store.snapshot(ws.path()).unwrap();
        let selection = sel(&["data", "link"]);
        assert_eq!(paths(&store.snapshot_files(&tree, Some(&selection)).unwrap()), ["data/file"]);
        // The selection comes from the immutable tree, not the live files.
        fs::remove_dir_all(ws.path().join("data")).unwrap();
        assert_eq!(paths(&store.snapshot_files(&tree, Some(&selection)).unwrap()), ["data/file"]);
        assert_eq!(paths(&store.snapshot_files(&tree, Some(&sel(&["data/file"]))).unwrap()), ["data/file"]);
        assert!(store.snapshot_files(&tree, Some(&sel(&["dat"]))).unwrap().is_empty());
        assert!(store.snapshot_files(&tree, Some(&[])).unwrap().is_empty());
    }

    #[test]
    fn selected_paths_must_be_relative_workspace_paths() {
        let (_dir, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        let tree = store.snapshot(ws.path()).unwrap();
        for bad in ["../data", "/data", "data/../other", "data\\file", "data//file", "./data", "data/", ""] {
            let e = store.snapshot_files(&tree, Some(&sel(&[bad]))).unwrap_err();
            assert!(e.to_string().contains("relative Workspace"), "{bad:?}: {e}");
        }
        let many: Vec<String> = (0..51).map(|i| format!("p{i}")).collect();
        assert!(store.snapshot_files(&tree, Some(&many)).is_err());
        assert!(store.snapshot_files(&tree, Some(&many[..50])).is_ok());
    }

    #[test]
    fn non_utf8_names_round_trip_but_cannot_be_listed() {
        let (_dir, store) = temp_store();
        let ws = tempfile::TempDir::new().unwrap();
        let raw = std::ffi::OsStr::from_bytes(b"caf\xe9.txt");
        fs::write(ws.path().join(raw), b"latin-1").unwrap();
        let tree = store.snapshot(ws.path()).unwrap();
        let record = store.read_record(&tree, Some("WorkspaceTree")).unwrap();
        let name = record.value["entries"][0]["name"].as_str().unwrap();
        assert_eq!(b64url_decode(name).unwrap(), b"caf\xe9.txt");
        let e = store.snapshot_files(&tree, None).unwrap_err();
        assert_eq!(e.to_string(), "Snapshot filename cannot be represented by the Workspace path API");
    }

    #[test]
    fn entry_names_that_are_not_single_segments_are_refused() {
        let (_dir, store) = temp_store();
        let content = store.put(Pool::Data, b"x", OCTET_STREAM).unwrap();
        for name in ["..", ".", "a/b", ""] {
            let entry = serde_json::json!({
                "content": content.to_value(),
                "executable": 0,
                "name": crate::versioning::names::b64url_encode(name.as_bytes()),
                "type": "file",
            });
            let tree = store.put_record("WorkspaceTree", serde_json::json!({ "entries": [entry] })).unwrap();
            let e = store.snapshot_files(&tree, None).unwrap_err();
            assert_eq!(e.to_string(), "Invalid snapshot filename", "{name:?}");
        }
    }
}
