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
