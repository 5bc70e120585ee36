//! Writing a `WorkspaceTree` back out as files (issue #34): a workspace that arrives from
//! another node, or is restored from the object store, becomes a directory whose snapshot
//! is the very tree it came from.
//!
//! The tree may come from anywhere, so it is data, not a plan: every name is checked before
//! anything of its directory is written (a name must never climb out or collide), every
//! create is `O_EXCL | O_NOFOLLOW` relative to its parent's descriptor, and every file's
//! bytes are read through the verifying reader. The walk is iterative and holds at most
//! [`OPEN_LEVELS`] directory descriptors, however deep the tree.

use std::collections::HashSet;
use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use serde_json::Value;

use super::TransferError;
pub use super::nested::contains_nested;
use crate::fsat::{self, Stat};
use crate::versioning::names::b64url_decode;
use crate::versioning::sparse::SparseWriter;
use crate::versioning::{Ref, Store, VersionError};

/// What a materialize wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Materialized {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// The files' content bytes (holes included).
    pub bytes: u64,
}

/// Directory levels that keep their descriptor open; a deeper walk closes the farthest one
/// and reopens it through its child's `..` on the way back up.
const OPEN_LEVELS: usize = 64;

/// Read buffer for file contents.
const CHUNK: usize = 64 * 1024;

/// One entry of a `WorkspaceTree`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Entry {
    File { name: CString, content: Ref, exec: u32 },
    Dir { name: CString, tree: Ref },
    Symlink { name: CString, target: CString },
}

impl Entry {
    fn name(&self) -> &CStr {
        match self {
            Entry::File { name, .. } | Entry::Dir { name, .. } | Entry::Symlink { name, .. } => name,
        }
    }
}

/// Why a tree's entries were refused (the caller adds where).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refused {
    NotATree,
    BadName(Vec<u8>),
    BadEntry(&'static str),
}

/// Whether `name` is one plain directory entry: not empty, `.` or `..`, no `/` or NUL.
fn plain_name(name: &[u8]) -> bool {
    !name.is_empty() && name != b"." && name != b".." && !name.contains(&b'/') && !name.contains(&0)
}

/// Whether `name` is one runnerd keeps for itself ([`crate::workspace::RESERVED_NAMES`]): at
/// any depth a tree could otherwise plant lease files or a coordination directory that the
/// writer of a workspace beneath would trust.
fn reserved_name(name: &[u8]) -> bool {
    crate::workspace::RESERVED_NAMES.iter().any(|r| r.as_bytes() == name)
}

/// The checked entries of a tree record's value, pure: names decoded and refused unless
/// plain and distinct, kinds limited to file, directory and symlink, executable bits only.
fn parse_entries(value: &Value) -> Result<Vec<Entry>, Refused> {
    let items = value.get("entries").and_then(Value::as_array).ok_or(Refused::NotATree)?;
    let mut seen = HashSet::with_capacity(items.len());
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let field = |key: &str| item.get(key).ok_or(Refused::BadEntry("an entry lacks a field"));
        let text = |key: &str| field(key)?.as_str().ok_or(Refused::BadEntry("an entry field is not text"));
        let raw =
            b64url_decode(text("name")?).map_err(|_| Refused::BadEntry("an entry name is not base64url"))?;
        if !plain_name(&raw) || reserved_name(&raw) || !seen.insert(raw.clone()) {
            return Err(Refused::BadName(raw));
        }
        let name = CString::new(raw).map_err(|e| Refused::BadName(e.into_vec()))?;
        let as_ref = |key: &str| {
            Ref::from_value(field(key)?).map_err(|_| Refused::BadEntry("an entry's ref is invalid"))
        };
        out.push(match text("type")? {
            "file" => {
                let exec = field("executable")?
                    .as_u64()
                    .filter(|x| x & !0o111 == 0)
                    .ok_or(Refused::BadEntry("a file's executable is not a set of execute bits"))?;
                Entry::File { name, content: as_ref("content")?, exec: exec as u32 }
            }
            "directory" => {
                let tree = as_ref("tree")?;
                if !tree.is_record() {
                    return Err(Refused::BadEntry("a directory's tree is not a record"));
                }
                Entry::Dir { name, tree }
            }
            "symlink" => {
                let target = b64url_decode(text("target")?)
                    .map_err(|_| Refused::BadEntry("a symlink target is not base64url"))?;
                let target = CString::new(target)
                    .map_err(|_| Refused::BadEntry("a symlink target holds a NUL byte"))?;
                if target.as_bytes().is_empty() {
                    return Err(Refused::BadEntry("a symlink target is empty"));
                }
                Entry::Symlink { name, target }
            }
            _ => return Err(Refused::BadEntry("an entry is not a file, directory or symlink")),
        });
    }
    Ok(out)
}

/// One directory being written: its descriptor (closed beyond [`OPEN_LEVELS`]), its
/// entries (dropped while closed, read again when reopened) and how far they are done.
struct Level {
    name: Vec<u8>,
    tree: Ref,
    fd: Option<OwnedFd>,
    /// (dev, ino), to recognise the directory when it is reopened through `..`.
    id: (u64, u64),
    entries: Vec<Entry>,
    next: usize,
}

/// The workspace-relative path of `name` below the levels on `stack`, for errors.
fn shown(stack: &[Level], name: &[u8]) -> PathBuf {
    let mut path = PathBuf::new();
    for level in stack.iter().skip(1) {
        path.push(OsStr::from_bytes(&level.name));
    }
    if !name.is_empty() {
        path.push(OsStr::from_bytes(name));
    }
    path
}

/// The checked entries of the tree record `tree` (read verified), at `path`.
fn entries_of(store: &Store, tree: &Ref, path: PathBuf) -> Result<Vec<Entry>, TransferError> {
    entries_at(store, tree, || path)
}

/// [`entries_of`], with the path made only for an error (a walk that keeps no names).
pub(super) fn entries_at(
    store: &Store,
    tree: &Ref,
    path: impl FnOnce() -> PathBuf,
) -> Result<Vec<Entry>, TransferError> {
    let record = match store.read_record(tree, Some("WorkspaceTree")) {
        Err(VersionError::KindMismatch { .. }) => return Err(TransferError::NotATree { path: path() }),
        other => other?,
    };
    parse_entries(&record.value).map_err(|refused| match refused {
        Refused::NotATree => TransferError::NotATree { path: path() },
        Refused::BadName(name) => TransferError::BadName { name: shown_name(path(), &name) },
        Refused::BadEntry(detail) => TransferError::BadEntry { path: path(), detail },
    })
}

fn shown_name(mut dir: PathBuf, name: &[u8]) -> String {
    dir.push(OsStr::from_bytes(name));
    dir.to_string_lossy().into_owned()
}

/// Writes the tree record `tree` into the empty directory `dir` (descriptor-relative,
/// O_NOFOLLOW|O_EXCL creates): dirs 0755, files 0644 | the entry's executable bits, symlinks
/// with their raw target bytes; names decoded from base64url and refused when empty, ".",
/// "..", containing '/' or NUL, repeated in one directory, or reserved
/// ([`crate::workspace::RESERVED_NAMES`], at any depth) (TransferError::BadName); every blob read through the verifying reader; zero blocks written sparse;
/// `owner` (uid, gid): fchown every created entry (root only). Iterative. On an error `dir`
/// holds part of the tree: write into a staging directory and [`swap_in`] only on success.
pub fn materialize(
    store: &Store,
    tree: &Ref,
    dir: BorrowedFd<'_>,
    owner: Option<(u32, u32)>,
) -> Result<Materialized, TransferError> {
    let io = |what, path: PathBuf| move |source| TransferError::Io { what, path, source };
    let root = fsat::dup(&dir).map_err(io("open", PathBuf::from(".")))?;
    if !fsat::names(&root).map_err(io("list", PathBuf::from(".")))?.is_empty() {
        return Err(TransferError::NotEmpty);
    }
    let st = Stat::of_fd(&root).map_err(io("inspect", PathBuf::from(".")))?;
    let entries = entries_of(store, tree, PathBuf::new())?;
    let mut stack = vec![Level {
        name: Vec::new(),
        tree: tree.clone(),
        fd: Some(root),
        id: (st.dev, st.ino),
        entries,
        next: 0,
    }];
    let mut done = Materialized::default();
    while let Some(level) = stack.last_mut() {
        let Some(entry) = level.entries.get(level.next).cloned() else {
            let finished = stack.pop().expect("a level is open");
            if stack.last().is_some_and(|parent| parent.fd.is_none()) {
                let path = shown(&stack, b"");
                reopen(store, stack.last_mut().expect("checked above"), &finished, path)?;
            }
            continue;
        };
        level.next += 1;
        let path = shown(&stack, entry.name().to_bytes());
        let fd = stack.last().and_then(|level| level.fd.as_ref()).expect("the deepest level is open");
        match entry {
            Entry::File { name, content, exec } => {
                let fd = fsat::create_new_at(fd, &name, 0o600).map_err(io("create", path.clone()))?;
                let file = File::from(fd);
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                        .map_err(io("chown", path.clone()))?;
                }
                done.bytes += write_content(store, &content, exec, file, &path)?;
                done.files += 1;
            }
            Entry::Symlink { name, target } => {
                fsat::symlink_at(fd, &name, &target).map_err(io("create the symlink", path.clone()))?;
                if let Some((uid, gid)) = owner {
                    fsat::lchown_at(fd, &name, uid, gid).map_err(io("chown", path))?;
                }
                done.symlinks += 1;
            }
            Entry::Dir { name, tree } => {
                fsat::mkdir_at(fd, &name, 0o700).map_err(io("create the directory", path.clone()))?;
                let sub = fsat::open_dir_at(fd, &name).map_err(io("open", path.clone()))?;
                if let Some((uid, gid)) = owner {
                    std::os::unix::fs::fchown(&sub, Some(uid), Some(gid))
                        .map_err(io("chown", path.clone()))?;
                }
                fsat::fchmod(&sub, 0o755).map_err(io("set the mode of", path.clone()))?;
                let st = Stat::of_fd(&sub).map_err(io("inspect", path.clone()))?;
                let entries = entries_of(store, &tree, path)?;
                let name = name.into_bytes();
                stack.push(Level { name, tree, fd: Some(sub), id: (st.dev, st.ino), entries, next: 0 });
                if let Some(far) = stack.len().checked_sub(OPEN_LEVELS + 1) {
                    // Its entries go too (read again when reopened): memory stays bounded by
                    // the open levels, not by the depth.
                    stack[far].fd = None;
                    stack[far].entries = Vec::new();
                }
                done.dirs += 1;
            }
        }
    }
    Ok(done)
}

/// Reopens a closed level (at `path`) through the `..` of its finished child, refusing
/// anything but the directory it was (by dev/ino), and reads its entries again.
fn reopen(store: &Store, level: &mut Level, child: &Level, path: PathBuf) -> Result<(), TransferError> {
    let io = |path: &PathBuf| {
        let path = path.clone();
        move |source| TransferError::Io { what: "reopen", path, source }
    };
    let from = child.fd.as_ref().expect("a finished level is the deepest, open");
    let fd = fsat::open_dir_at(from, c"..").map_err(io(&path))?;
    let st = Stat::of_fd(&fd).map_err(io(&path))?;
    if (st.dev, st.ino) != level.id {
        return Err(io(&path)(io::Error::other("a directory being written was moved meanwhile")));
    }
    level.entries = entries_of(store, &level.tree, path)?;
    level.fd = Some(fd);
    Ok(())
}

/// Streams the verified content `content` into the new file `file` (holes for zero blocks),
/// then gives it its mode, `0644 | exec` (0600 while written). Returns the bytes written.
fn write_content(
    store: &Store,
    content: &Ref,
    exec: u32,
    file: File,
    path: &std::path::Path,
) -> Result<u64, TransferError> {
    let blob =
        |source| TransferError::Blob { path: path.to_string_lossy().into_owned(), source: Box::new(source) };
    let io = |what| move |source| TransferError::Io { what, path: path.to_owned(), source };
    // Blobs this process hashed since their last change (what a move just received) are
    // not hashed again; any other is read through the verifying reader.
    let mut reader = store.open_trusted(content).map_err(blob)?;
    let mut sparse = SparseWriter::new(file);
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The verifying reader's only InvalidData: size or digest wrong.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => return Err(blob(VersionError::Integrity)),
            Err(e) => return Err(io("read the content of")(e)),
        };
        sparse.write(&buf[..n]).map_err(io("write"))?;
    }
    let file = sparse.finish().map_err(io("write"))?;
    fsat::fchmod(&file, 0o644 | exec).map_err(io("set the mode of"))?;
    Ok(content.size)
}

/// Empties `root` and moves every entry of `staging` into it (renameat). Used after a full
/// materialize so a failure before it leaves the live copy as it was. The two must be on one
/// filesystem, checked before `root` is touched ([`TransferError::NotSameFilesystem`]):
/// otherwise every rename would fail after the clear, leaving the workspace empty.
pub fn swap_in(staging: BorrowedFd<'_>, root: BorrowedFd<'_>) -> Result<(), TransferError> {
    let io = |what| move |source| TransferError::Io { what, path: PathBuf::from("."), source };
    let (staging, root) = (fsat::dup(&staging).map_err(io("open"))?, fsat::dup(&root).map_err(io("open"))?);
    let staging_dev = Stat::of_fd(&staging).map_err(io("inspect the staging directory"))?.dev;
    let root_dev = Stat::of_fd(&root).map_err(io("inspect the workspace directory"))?.dev;
    if staging_dev != root_dev {
        return Err(TransferError::NotSameFilesystem {
            staging: device(staging_dev),
            root: device(root_dev),
        });
    }
    crate::remote::files::clear(&root).map_err(TransferError::Clear)?;
    for (name, cname) in fsat::names(&staging).map_err(io("list the staging directory"))? {
        fsat::rename_between(&staging, &cname, &root, &cname).map_err(|source| TransferError::Io {
            what: "move into place",
            path: PathBuf::from(name),
            source,
        })?;
    }
    fsat::sync_dir(&root).map_err(io("fsync the workspace directory"))?;
    fsat::sync_dir(&staging).map_err(io("fsync the staging directory"))
}

/// A device number as `major:minor`, as `stat` and `/proc/self/mountinfo` show it.
fn device(dev: u64) -> String {
    format!("{}:{}", libc::major(dev), libc::minor(dev))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::fd::AsFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
    use std::path::{Path, PathBuf};

    use serde_json::json;

    use super::*;
    use crate::versioning::names::b64url_encode;
    use crate::versioning::testutil::{temp_store, write_mode};
    use crate::versioning::{OCTET_STREAM, Pool};

    fn open(path: &Path) -> File {
        File::open(path).unwrap()
    }

    /// A fresh empty directory under `base`.
    fn empty_dir(base: &Path, name: &str) -> std::path::PathBuf {
        let dir = base.join(name);
        fs::create_dir(&dir).unwrap();
        dir
    }

    fn tree_of(store: &Store, entries: Value) -> Ref {
        store.put_record("WorkspaceTree", json!({ "entries": entries })).unwrap()
    }

    fn b64(bytes: &[u8]) -> String {
        b64url_encode(bytes)
    }

    #[test]
    fn a_materialized_tree_snapshots_to_the_same_tree() {
        let (data, store) = temp_store();
        let ws = empty_dir(data.path(), "ws");
        write_mode(&ws.join("README.md"), b"hello\n", 0o644);
        write_mode(&ws.join("run.sh"), b"#!/bin/sh\necho hi\n", 0o755);
        write_mode(&ws.join("owner-only-x"), b"x", 0o744);
        fs::create_dir_all(ws.join("a/b/c")).unwrap();
        write_mode(&ws.join("a/b/c/deep.txt"), b"deep", 0o600);
        fs::create_dir(ws.join("empty")).unwrap();
        symlink("nowhere/at/all", ws.join("dangling")).unwrap();
        symlink("/etc/passwd", ws.join("a/outside")).unwrap();
        symlink(OsStr::from_bytes(b"\xfftarget"), ws.join("raw-target")).unwrap();
        fs::write(ws.join(OsStr::from_bytes(b"caf\xe9-\xff")), b"latin-1 name").unwrap();
        fs::write(ws.join("a/empty-file"), b"").unwrap();
        let sparse = File::create(ws.join("sparse.bin")).unwrap();
        sparse.set_len(16 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&sparse, b"tail", (16 << 20) - 4).unwrap();
        drop(sparse);
        let tree = store.snapshot(&ws).unwrap();

        let out = empty_dir(data.path(), "out");
        let done = materialize(&store, &tree, open(&out).as_fd(), None).unwrap();
        assert_eq!(store.snapshot(&out).unwrap(), tree, "the same tree, digest for digest");
        assert_eq!((done.files, done.dirs, done.symlinks), (7, 4, 3));
        assert_eq!(done.bytes, 6 + 18 + 1 + 4 + 12 + (16 << 20));
        let mode = |p: &str| fs::symlink_metadata(out.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!((mode("README.md"), mode("run.sh"), mode("owner-only-x")), (0o644, 0o755, 0o744));
        assert_eq!(
            (mode("a"), mode("a/b/c"), mode("empty"), mode("a/b/c/deep.txt")),
            (0o755, 0o755, 0o755, 0o644)
        );
        assert_eq!(fs::read_link(out.join("a/outside")).unwrap(), Path::new("/etc/passwd"));
        assert_eq!(fs::read_link(out.join("raw-target")).unwrap().as_os_str().as_bytes(), b"\xfftarget");
        let sparse = fs::metadata(out.join("sparse.bin")).unwrap();
        assert_eq!(sparse.len(), 16 << 20);
        assert!(sparse.blocks() * 512 < 1 << 20, "zero blocks are holes: {} blocks", sparse.blocks());
        assert!(
            materialize(&store, &tree, open(&out).as_fd(), None)
                .is_err_and(|e| matches!(e, TransferError::NotEmpty))
        );

        // The structural check agrees with the snapshot, and finds each kind of difference.
        let verify = |store: &Store| super::super::verify::matches_tree(store, &tree, open(&out).as_fd());
        verify(&store).unwrap();
        let differs = |what: &str, change: &dyn Fn(), undo: &dyn Fn()| {
            change();
            assert!(
                matches!(verify(&store), Err(TransferError::TreeMismatch { .. })),
                "{what} went unnoticed"
            );
            undo();
            verify(&store).unwrap();
        };
        let chmod =
            |p: &str, m: u32| fs::set_permissions(out.join(p), fs::Permissions::from_mode(m)).unwrap();
        differs("an execute bit", &|| chmod("README.md", 0o755), &|| chmod("README.md", 0o644));
        differs("a size", &|| fs::write(out.join("a/b/c/deep.txt"), b"deeper").unwrap(), &|| {
            fs::write(out.join("a/b/c/deep.txt"), b"deep").unwrap()
        });
        differs("an extra file", &|| fs::write(out.join("empty/new"), b"").unwrap(), &|| {
            fs::remove_file(out.join("empty/new")).unwrap()
        });
        let relink = |to: &str| {
            fs::remove_file(out.join("dangling")).unwrap();
            symlink(to, out.join("dangling")).unwrap();
        };
        differs("a link target", &|| relink("elsewhere"), &|| relink("nowhere/at/all"));
        differs(
            "a kind",
            &|| {
                fs::remove_dir(out.join("empty")).unwrap();
                fs::write(out.join("empty"), b"").unwrap();
            },
            &|| {
                fs::remove_file(out.join("empty")).unwrap();
                fs::create_dir(out.join("empty")).unwrap();
            },
        );
    }

    #[test]
    fn every_created_entry_goes_to_the_owner() {
        let (data, store) = temp_store();
        let leaf = store.put(Pool::Data, b"x", OCTET_STREAM).unwrap();
        let sub = tree_of(&store, json!([]));
        let tree = tree_of(
            &store,
            json!([
                {"content": leaf.to_value(), "executable": 0, "name": b64(b"f"), "type": "file"},
                {"name": b64(b"d"), "tree": sub.to_value(), "type": "directory"},
                {"name": b64(b"l"), "target": b64(b"f"), "type": "symlink"},
            ]),
        );
        // Root may give entries away; anyone else may give them to themselves only.
        let (uid, gid) = if nix::unistd::geteuid().is_root() {
            (4242, 4343)
        } else {
            (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw())
        };
        let out = empty_dir(data.path(), "out");
        materialize(&store, &tree, open(&out).as_fd(), Some((uid, gid))).unwrap();
        for name in ["f", "d", "l"] {
            let m = fs::symlink_metadata(out.join(name)).unwrap();
            assert_eq!((m.uid(), m.gid()), (uid, gid), "{name}");
        }
    }

    #[test]
    fn names_that_escape_or_collide_are_refused_before_anything_of_their_directory_is_written() {
        let (data, store) = temp_store();
        let link = |name: &[u8]| json!({"name": b64(name), "target": b64(b"x"), "type": "symlink"});
        let cases: Vec<(Value, &str)> = vec![
            (json!([link(b"..")]), ".."),
            (json!([link(b".")]), "."),
            (json!([link(b"")]), ""),
            (json!([link(b"a/b")]), "a/b"),
            (json!([link(b"a\0b")]), "a\u{0}b"),
            (json!([link(b"ok"), link(b"a"), link(b"a")]), "a"),
        ];
        for (i, (entries, name)) in cases.into_iter().enumerate() {
            let tree = tree_of(&store, entries);
            let out = empty_dir(data.path(), &format!("out{i}"));
            let e = materialize(&store, &tree, open(&out).as_fd(), None).unwrap_err();
            assert!(matches!(&e, TransferError::BadName { name: n } if n == name), "{name:?}: {e}");
            assert!(e.to_string().contains("a path that escapes"), "{e}");
            assert_eq!(fs::read_dir(&out).unwrap().count(), 0, "{name:?}: nothing written");
        }
        // One level down, the error names where.
        let bad = tree_of(&store, json!([link(b"..")]));
        let tree =
            tree_of(&store, json!([{"name": b64(b"sub"), "tree": bad.to_value(), "type": "directory"}]));
        let out = empty_dir(data.path(), "nested");
        let e = materialize(&store, &tree, open(&out).as_fd(), None).unwrap_err();
        assert!(matches!(&e, TransferError::BadName { name } if name == "sub/.."), "{e}");
        assert_eq!(fs::read_dir(out.join("sub")).unwrap().count(), 0);
    }

    /// A lease file or coordination directory planted by a tree would be trusted by the
    /// writer of a workspace beneath: each reserved name is refused, at the top and deep down,
    /// whatever kind of entry carries it, before anything of its directory is written.
    #[test]
    fn reserved_names_are_refused_at_any_depth() {
        let (data, store) = temp_store();
        let empty = tree_of(&store, json!([]));
        let leaf = store.put(Pool::Data, b"x", OCTET_STREAM).unwrap();
        for (i, reserved) in crate::workspace::RESERVED_NAMES.into_iter().enumerate() {
            let name = reserved.as_bytes();
            for k in 0..3 {
                let planted = entry_named(&empty, &leaf, name, k);
                let ok = json!({"name": b64(b"ok"), "target": b64(b"x"), "type": "symlink"});
                let deep = tree_of(&store, json!([ok, planted]));
                let mid = tree_of(
                    &store,
                    json!([{"name": b64(b"b"), "tree": deep.to_value(), "type": "directory"}]),
                );
                let top = tree_of(
                    &store,
                    json!([{"name": b64(b"a"), "tree": mid.to_value(), "type": "directory"}]),
                );
                let out = empty_dir(data.path(), &format!("deep{i}-{k}"));
                let e = materialize(&store, &top, open(&out).as_fd(), None).unwrap_err();
                let want = format!("a/b/{reserved}");
                assert!(matches!(&e, TransferError::BadName { name } if *name == want), "{want}: {e}");
                assert!(e.to_string().contains("reserved"), "{e}");
                assert_eq!(fs::read_dir(out.join("a/b")).unwrap().count(), 0, "{want}: nothing written");

                let top = tree_of(&store, json!([entry_named(&empty, &leaf, name, k)]));
                let out = empty_dir(data.path(), &format!("top{i}-{k}"));
                let e = materialize(&store, &top, open(&out).as_fd(), None).unwrap_err();
                assert!(matches!(&e, TransferError::BadName { name } if name == reserved), "{e}");
                assert_eq!(fs::read_dir(&out).unwrap().count(), 0);
            }
        }
        // Names that only resemble them are plain names.
        let near = tree_of(
            &store,
            json!([
                {"name": b64(b".workspace-coordination2"), "target": b64(b"x"), "type": "symlink"},
                {"name": b64(b"workspace-coordination"), "target": b64(b"x"), "type": "symlink"},
            ]),
        );
        let out = empty_dir(data.path(), "near");
        materialize(&store, &near, open(&out).as_fd(), None).unwrap();
    }

    /// The `k`th kind of entry (directory, file, symlink) named `name`.
    fn entry_named(empty: &Ref, leaf: &Ref, name: &[u8], k: usize) -> Value {
        match k {
            0 => json!({"name": b64(name), "tree": empty.to_value(), "type": "directory"}),
            1 => json!({"content": leaf.to_value(), "executable": 0, "name": b64(name), "type": "file"}),
            _ => json!({"name": b64(name), "target": b64(b"x"), "type": "symlink"}),
        }
    }

    #[test]
    fn entry_table() {
        let leaf = Ref::new(Pool::Data, &"ab".repeat(32), 1, OCTET_STREAM);
        let tree = Ref::new(Pool::AgentState, &"cd".repeat(32), 9, crate::versioning::RECORD_MEDIA_TYPE);
        let file = |exec: Value| json!({"content": leaf.to_value(), "executable": exec, "name": "Zg", "type": "file"});
        let ok = |v: Value| parse_entries(&json!({ "entries": [v] }));
        assert_eq!(
            ok(file(json!(73))),
            Ok(vec![Entry::File { name: c"f".into(), content: leaf.clone(), exec: 73 }])
        );
        assert_eq!(
            ok(json!({"name": "ZA", "tree": tree.to_value(), "type": "directory"})),
            Ok(vec![Entry::Dir { name: c"d".into(), tree: tree.clone() }])
        );
        let refused: Vec<(Value, Refused)> = vec![
            (file(json!(0o4755)), Refused::BadEntry("a file's executable is not a set of execute bits")),
            (file(json!(-1)), Refused::BadEntry("a file's executable is not a set of execute bits")),
            (file(json!(true)), Refused::BadEntry("a file's executable is not a set of execute bits")),
            (
                json!({"name": "cA", "type": "fifo"}),
                Refused::BadEntry("an entry is not a file, directory or symlink"),
            ),
            (
                json!({"name": "cA", "type": "hardlink", "target": "eA"}),
                Refused::BadEntry("an entry is not a file, directory or symlink"),
            ),
            (
                json!({"name": "ZA", "tree": leaf.to_value(), "type": "directory"}),
                Refused::BadEntry("a directory's tree is not a record"),
            ),
            (
                json!({"name": "bA", "target": "", "type": "symlink"}),
                Refused::BadEntry("a symlink target is empty"),
            ),
            (
                json!({"name": "bA", "target": "eAB5", "type": "symlink"}),
                Refused::BadEntry("a symlink target holds a NUL byte"),
            ),
            (
                json!({"name": "bA=", "target": "eA", "type": "symlink"}),
                Refused::BadEntry("an entry name is not base64url"),
            ),
            (json!({"target": "eA", "type": "symlink"}), Refused::BadEntry("an entry lacks a field")),
            (json!({"name": "Li4", "target": "eA", "type": "symlink"}), Refused::BadName(b"..".to_vec())),
        ];
        for (entry, want) in refused {
            assert_eq!(ok(entry.clone()), Err(want), "{entry}");
        }
        assert_eq!(parse_entries(&json!({"files": []})), Err(Refused::NotATree));
    }

    #[test]
    fn a_missing_or_damaged_blob_fails_the_materialize_and_says_which() {
        let (data, store) = temp_store();
        let absent = Ref::new(Pool::Data, &"ab".repeat(32), 3, OCTET_STREAM);
        let file = |r: &Ref| json!({"content": r.to_value(), "executable": 0, "name": b64(b"f.txt"), "type": "file"});
        let tree = tree_of(&store, json!([file(&absent)]));
        let out = empty_dir(data.path(), "missing");
        let e = materialize(&store, &tree, open(&out).as_fd(), None).unwrap_err();
        assert!(
            matches!(&e, TransferError::Blob { path, source } if path == "f.txt" && matches!(**source, VersionError::Missing { .. })),
            "{e}"
        );
        let chain = common::error_chain(&e);
        assert!(chain.contains("f.txt") && chain.contains(&absent.digest), "{chain}");

        // Same size, other bytes: only the digest at the end can tell.
        let stored = store.put(Pool::Data, b"good bytes", OCTET_STREAM).unwrap();
        fs::write(store.blob_path(Pool::Data, stored.hex()), b"evil bytes").unwrap();
        let tree = tree_of(&store, json!([file(&stored)]));
        let out = empty_dir(data.path(), "damaged");
        let e = materialize(&store, &tree, open(&out).as_fd(), None).unwrap_err();
        assert!(
            matches!(&e, TransferError::Blob { source, .. } if matches!(**source, VersionError::Integrity)),
            "{e}"
        );

        // A directory entry whose tree is another kind of record.
        let other = store.put_record("WorkspaceMutation", json!({"x": 1})).unwrap();
        let tree =
            tree_of(&store, json!([{"name": b64(b"d"), "tree": other.to_value(), "type": "directory"}]));
        let out = empty_dir(data.path(), "kind");
        let e = materialize(&store, &tree, open(&out).as_fd(), None).unwrap_err();
        assert!(matches!(&e, TransferError::NotATree { path } if path == Path::new("d")), "{e}");
    }

    const DEPTH: usize = 1000;

    /// A chain of `DEPTH` directories named `d`, with a file at the bottom.
    fn deep_tree(store: &Store) -> Ref {
        let leaf = store.put(Pool::Data, b"bottom", OCTET_STREAM).unwrap();
        let mut tree = tree_of(
            store,
            json!([{"content": leaf.to_value(), "executable": 0, "name": b64(b"f"), "type": "file"}]),
        );
        for _ in 0..DEPTH {
            tree = tree_of(store, json!([{"name": b64(b"d"), "tree": tree.to_value(), "type": "directory"}]));
        }
        tree
    }

    /// Deeper than any recursion would like, with descriptors capped far below the depth
    /// (in a child process, whose limit is its own).
    #[test]
    fn a_thousand_levels_are_written_with_few_descriptors() {
        const CHILD: &str = "MATERIALIZE_DEEP_CHILD_DATA";
        if let Some(data) = std::env::var_os(CHILD) {
            let cap = (OPEN_LEVELS + 40) as libc::rlim_t;
            let limit = libc::rlimit { rlim_cur: cap, rlim_max: cap };
            // SAFETY: setrlimit reads the struct; lowering our own limit is always allowed.
            common::sys::cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }).unwrap();
            let store = Store::open(Path::new(&data)).unwrap();
            let tree = deep_tree(&store);
            let done = materialize(&store, &tree, open(&Path::new(&data).join("out")).as_fd(), None).unwrap();
            assert_eq!((done.dirs, done.files), (DEPTH as u64, 1));
            return;
        }
        let data = tempfile::tempdir().unwrap();
        let out = empty_dir(data.path(), "out");
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transfer::materialize::tests::a_thousand_levels_are_written_with_few_descriptors",
            ])
            .args(["--test-threads=1"])
            .env(CHILD, data.path())
            .status()
            .unwrap();
        assert!(status.success(), "the materialize ran out of descriptors or failed");
        let bottom = (0..DEPTH).fold(out.clone(), |p, _| p.join("d")).join("f");
        assert_eq!(fs::read(bottom).unwrap(), b"bottom");
    }

    #[test]
    fn swap_in_replaces_the_live_copy_and_never_follows_a_link() {
        let base = tempfile::tempdir().unwrap();
        let (root, staging, outside) = (
            empty_dir(base.path(), "root"),
            empty_dir(base.path(), "staging"),
            empty_dir(base.path(), "outside"),
        );
        fs::write(outside.join("keep"), b"k").unwrap();
        fs::create_dir_all(root.join("old/deeper")).unwrap();
        fs::write(root.join("old/deeper/f"), b"old").unwrap();
        fs::write(root.join("same-name"), b"old").unwrap();
        symlink(&outside, root.join("escape")).unwrap();
        fs::create_dir(staging.join("new")).unwrap();
        fs::write(staging.join("new/f"), b"new").unwrap();
        fs::write(staging.join("same-name"), b"new").unwrap();
        swap_in(open(&staging).as_fd(), open(&root).as_fd()).unwrap();
        let mut names: Vec<_> = fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, ["new", "same-name"]);
        assert_eq!(fs::read(root.join("same-name")).unwrap(), b"new");
        assert_eq!(fs::read(root.join("new/f")).unwrap(), b"new");
        assert_eq!(fs::read_dir(&staging).unwrap().count(), 0);
        assert_eq!(fs::read(outside.join("keep")).unwrap(), b"k", "a link's target is untouched");
    }

    /// A directory on another filesystem than `near` (tmpfs where there is one), or `None`.
    fn elsewhere(near: &Path) -> Option<tempfile::TempDir> {
        let dev = fs::metadata(near).unwrap().dev();
        let uid = nix::unistd::geteuid().as_raw();
        [PathBuf::from("/dev/shm"), PathBuf::from(format!("/run/user/{uid}"))]
            .into_iter()
            .filter(|p| fs::metadata(p).is_ok_and(|m| m.dev() != dev))
            .find_map(|p| tempfile::tempdir_in(p).ok())
    }

    /// A rename cannot cross filesystems: swap_in must refuse before it empties the live copy.
    #[test]
    fn swap_in_across_filesystems_is_refused_before_the_live_copy_is_touched() {
        let base = tempfile::tempdir().unwrap();
        let Some(other) = elsewhere(base.path()) else {
            eprintln!("SKIPPED swap_in_across_filesystems: no writable directory on another filesystem");
            return;
        };
        let root = empty_dir(base.path(), "root");
        fs::write(root.join("live"), b"still here").unwrap();
        let staging = empty_dir(other.path(), "staging");
        fs::write(staging.join("new"), b"new").unwrap();
        let e = swap_in(open(&staging).as_fd(), open(&root).as_fd()).unwrap_err();
        let (sdev, rdev) = (fs::metadata(&staging).unwrap().dev(), fs::metadata(&root).unwrap().dev());
        assert!(
            matches!(&e, TransferError::NotSameFilesystem { staging, root }
                if *staging == device(sdev) && *root == device(rdev)),
            "{e}"
        );
        assert!(e.to_string().contains("left as it was"), "{e}");
        assert_eq!(fs::read(root.join("live")).unwrap(), b"still here", "the live copy was not cleared");
        assert_eq!(fs::read(staging.join("new")).unwrap(), b"new");
    }
}
