//! The target's side of a move, and the install every restore shares: which objects this
//! node lacks, the object stream (each object verified by its digest before it is
//! published), and the install of a head (closure checked whole, tree materialized beside the
//! workspace, swapped in under the writer lease, head committed, epoch raised).

use std::io::BufRead;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::protocol::{self, MAX_HEADER};
use super::{Ident, TransferFailed, blocking};
use crate::app::App;
use crate::error::EngineError;
use crate::versioning::store::{StagedObject, Store};
use crate::versioning::{Ref, names::new_uuid_v4};
use crate::workspace;
use runner_store::transfer::{TransferError, budget, materialize, verify};

/// Where materialized trees wait before they are swapped into their workspace: under the data
/// directory, so the swap is a rename on one filesystem.
pub const STAGING: &str = ".runner-transfers";

/// The refs of `asked` this node has no object for.
pub fn missing(store: &Store, asked: &[Ref]) -> Vec<Ref> {
    asked.iter().filter(|r| !store.has(r)).cloned().collect()
}

/// What one object stream brought.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// Objects published now.
    pub stored: u64,
    /// Objects this node already had (the bytes were read and dropped).
    pub present: u64,
    pub bytes: u64,
}

/// Objects staged before one flush publishes them, and the bytes (bounded: each holds an
/// open temp file until then).
const BATCH_OBJECTS: usize = 256;
const BATCH_BYTES: u64 = 128 << 20;

/// Reads frames (`<pool> <hex> <size>\n` then the bytes) until the stream ends at a frame
/// boundary. Each object is checked against its digest as it arrives and staged; every
/// [`BATCH_OBJECTS`] objects or [`BATCH_BYTES`] bytes, one flush makes the batch durable and
/// it is published. The first object that does not match (or a stream cut inside a frame)
/// ends the stream with an error; the objects before it are published first (a resumed move
/// does not send them again), the bad one never is.
pub fn receive_objects(store: &Store, stream: &mut dyn BufRead) -> Result<Received, TransferFailed> {
    let mut got = Received::default();
    let mut batch: Vec<StagedObject> = Vec::new();
    let mut batch_bytes = 0u64;
    let publish = |batch: &mut Vec<StagedObject>, got: &mut Received| -> Result<(), TransferFailed> {
        let (stored, present) = store.publish_staged(std::mem::take(batch))?;
        got.stored += stored;
        got.present += present;
        Ok(())
    };
    let read = (|| -> Result<(), TransferFailed> {
        let mut line = Vec::with_capacity(MAX_HEADER);
        loop {
            line.clear();
            let n = BufRead::read_until(
                &mut std::io::Read::take(&mut *stream, MAX_HEADER as u64),
                b'\n',
                &mut line,
            )
            .map_err(|e| TransferFailed::Task(format!("the object stream could not be read: {e}")))?;
            if n == 0 {
                return Ok(());
            }
            let text = line.strip_suffix(b"\n").ok_or(protocol::ProtocolError::BadFrame)?;
            let text = std::str::from_utf8(text).map_err(|_| protocol::ProtocolError::BadFrame)?;
            let expected = protocol::parse_frame(text)?;
            // Objects that no head reaches yet are disk a sender can fill: never past what
            // the data directory's filesystem has free.
            if let Some(free) = free_bytes(store.root()).filter(|free| expected.size > *free) {
                return Err(TransferFailed::NoSpace { needed: expected.size, free });
            }
            let mut body = std::io::Read::take(&mut *stream, expected.size);
            let staged = store.stage_verified(&expected, &mut body)?;
            got.bytes += expected.size;
            batch_bytes += staged.size();
            batch.push(staged);
            if batch.len() >= BATCH_OBJECTS || batch_bytes >= BATCH_BYTES {
                publish(&mut batch, &mut got)?;
                batch_bytes = 0;
            }
        }
    })();
    // What arrived whole is published even when the stream broke after it.
    let published = publish(&mut batch, &mut got);
    read.and(published).map(|()| got)
}

/// The workspace directory of `ident` on this node, created when it does not exist yet (a
/// first move here), its canonical path and a descriptor pinning it.
pub fn ensure_workspace(app: &App, ident: &Ident) -> Result<(PathBuf, OwnedFd), EngineError> {
    let made = match ident {
        Ident::Remote(key) => workspace::ensure_remote_workspace(&app.data_dir, key, &app.sandbox.user)?,
        Ident::Project(path) => workspace::ensure_project_workspace(&app.data_dir, path, &app.sandbox.user)?,
    };
    let canonical = workspace::validated_workspace(&app.data_dir, &made)?;
    let fd = workspace::open_beneath(&app.data_dir, &canonical)?;
    Ok((canonical, fd))
}

/// The workspace of `ident` as it exists here (nothing is created).
pub fn existing_workspace(app: &App, ident: &Ident) -> Result<(PathBuf, OwnedFd), EngineError> {
    let data_real = std::fs::canonicalize(&app.data_dir)
        .map_err(|e| EngineError::from(workspace::WorkspaceError::DataDirUnavailable(e)))?;
    let canonical = workspace::validated_workspace(&app.data_dir, &ident.path_under(&data_real))?;
    let fd = workspace::open_beneath(&app.data_dir, &canonical)?;
    Ok((canonical, fd))
}

/// How the installed head is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// The same head ref as the copy it came from (a move, a restore from the object store),
    /// at this epoch. `replace_live`: whether a live copy here with files of its own may be
    /// replaced (an operator's restore: yes; a peer's move: no, it would silently drop this
    /// node's own history from the head).
    SameHead { epoch: u64, replace_live: bool },
    /// A new `workspace-restore` mutation whose tree is the version's (a restore from this
    /// node's own history: the history stays in order). A fenced copy refuses it.
    Restored,
}

/// What an install did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub canonical: PathBuf,
    pub head: Ref,
    pub tree: Ref,
    pub epoch: u64,
    pub materialized: materialize::Materialized,
}

/// The epoch this node holds for `canonical` (0: never set).
pub fn local_epoch(app: &App, canonical: &Path) -> Result<u64, TransferFailed> {
    Ok(app.versions.placement().get(canonical)?.map_or(0, |p| p.epoch))
}

fn refuse_stale(app: &App, ident: &Ident, canonical: &Path, offered: u64) -> Result<(), TransferFailed> {
    let local = local_epoch(app, canonical)?;
    if local >= offered {
        return Err(TransferFailed::Stale { ident: ident.to_string(), local, offered });
    }
    Ok(())
}

/// The tree a head record names, the head's whole closure checked first (every object
/// present, every blob's bytes matching its digest, every record canonical).
pub fn checked_tree(store: &Store, head: &Ref) -> Result<Ref, TransferFailed> {
    store.validate_closure(head)?;
    let record = store.read_record(head, None)?;
    if record.kind != "WorkspaceMutation" && record.kind != "WorkspaceExecution" {
        return Err(TransferFailed::NotAHead);
    }
    let tree = record.value.get("workspace").ok_or(TransferFailed::NotAHead)?;
    let tree = Ref::from_value(tree).map_err(|_| TransferFailed::NotAHead)?;
    store.read_record(&tree, Some("WorkspaceTree")).map_err(|_| TransferFailed::NotAHead)?;
    Ok(tree)
}

/// Makes `head` (whose closure is all here) the copy of `ident` on this node: refuses a
/// stale epoch, a workspace a managed run holds or this node is sending, materializes the
/// tree into a staging directory and checks it by structure against the tree, then under the
/// writer lease (the refusals checked again) empties the workspace, moves the tree in and
/// commits. A failure before the swap leaves the workspace and its head as they were.
pub async fn install(
    app: &Arc<App>,
    ident: &Ident,
    head: &Ref,
    how: Install,
) -> Result<Installed, TransferFailed> {
    let (canonical, pinned) = ensure_workspace(app, ident)?;
    let here = Here { ident, canonical: &canonical, pinned: &pinned };
    refusals(app, &here, head, how)?;
    let (tree, staged, materialized) = stage(app, head, &pinned).await?;
    let writer_pin = pinned.try_clone().map_err(|e| TransferFailed::Task(e.to_string()))?;
    let writer = match how {
        // A restore from this node's history writes into this copy: a fenced one refuses it.
        Install::Restored => app.versions.begin(&canonical, writer_pin, None).await,
        Install::SameHead { .. } => app.versions.begin_import(&canonical, writer_pin, None).await,
    };
    let checked = writer.map_err(TransferFailed::from).and_then(|w| {
        // Checked again under the lease: another install or a run may have won meanwhile.
        refusals(app, &here, head, how)?;
        Ok(w)
    });
    let writer = match checked {
        Ok(w) => w,
        Err(e) => {
            discard(staged).await;
            return Err(e);
        }
    };
    let root = pinned.try_clone().map_err(|e| TransferFailed::Task(e.to_string()))?;
    blocking(move || {
        materialize::swap_in(staged.dir.as_fd(), root.as_fd())?;
        drop(staged);
        Ok(())
    })
    .await?;
    let (head, epoch) = commit_head(app, &writer, &canonical, head, &tree, how).await?;
    // A sandbox started ahead for the files that were here would mount a tree now gone.
    app.sandbox.forget(
        crate::isolation::prestart::Scope::Beneath(&canonical),
        crate::isolation::prestart::Discard::Workspace,
    );
    drop(writer);
    Ok(Installed { canonical, head, tree, epoch, materialized })
}

/// The workspace an install writes: its name, canonical path and pinned directory.
struct Here<'a> {
    ident: &'a Ident,
    canonical: &'a Path,
    pinned: &'a OwnedFd,
}

/// Why an install must not go ahead (checked before staging and again under the lease).
fn refusals(app: &App, here: &Here<'_>, head: &Ref, how: Install) -> Result<(), TransferFailed> {
    let ident = || here.ident.to_string();
    if app.moves.get(here.canonical).is_some() {
        return Err(TransferFailed::Sending { ident: ident() });
    }
    if app.managed.holds(here.canonical) {
        return Err(TransferFailed::Busy { ident: ident() });
    }
    if let Install::SameHead { epoch, replace_live } = how {
        refuse_stale(app, here.ident, here.canonical, epoch)?;
        if !replace_live && live_copy(app, here.canonical, here.pinned, head)? {
            return Err(TransferFailed::Exists { ident: ident() });
        }
    }
    Ok(())
}

/// The head's tree checked and written into a staging directory of its own, and checked
/// there by structure, off the async threads.
async fn stage(
    app: &Arc<App>,
    head: &Ref,
    pinned: &OwnedFd,
) -> Result<(Ref, Staged, materialize::Materialized), TransferFailed> {
    let versions = app.versions.clone();
    let (head, owner) = (head.clone(), owner_of(pinned));
    let (staging_parent, quota) = (app.data_dir.clone(), app.config.max_workspace_bytes);
    let live = pinned.try_clone().map_err(|e| TransferFailed::Task(e.to_string()))?;
    blocking(move || {
        let store = versions.store();
        let tree = checked_tree(store, &head)?;
        // Workspaces nested in this one keep their files and leases inside it: emptying it
        // would take theirs too.
        if materialize::contains_nested(live.as_fd())? {
            return Err(TransferFailed::Nested);
        }
        fits(store, &tree, quota, &staging_parent)?;
        let staged = Staged::make(&staging_parent)?;
        let made = materialize::materialize(store, &tree, staged.dir.as_fd(), owner)?;
        // What the workspace will hold must be what a snapshot records as the tree itself (a
        // tree whose entries are out of order would not be), before the live copy is touched.
        verify::matches_tree(store, &tree, staged.dir.as_fd())?;
        Ok((tree, staged, made))
    })
    .await
}

/// Commits the installed files: the same head at its epoch, or a `workspace-restore`.
async fn commit_head(
    app: &Arc<App>,
    writer: &crate::writer::Writer,
    canonical: &Path,
    head: &Ref,
    tree: &Ref,
    how: Install,
) -> Result<(Ref, u64), TransferFailed> {
    match how {
        Install::SameHead { epoch, .. } => {
            // The epoch first: the commit wakes the replicator, which must find this copy at
            // its new epoch (at the old one, the bucket's document would look newer and the
            // replicator would fence the copy that just arrived). Put back if the commit fails.
            let placement = app.versions.placement();
            let before = placement.get(canonical)?;
            placement.set_epoch(canonical, epoch)?;
            if let Err(e) = app.versions.commit_imported(writer, head, tree).await {
                if let Err(again) = placement.put_back(canonical, before.as_ref()) {
                    tracing::error!(event = "placement_not_restored", workspace = %canonical.display(), error = %crate::error_chain(&again));
                }
                return Err(e.into());
            }
            Ok((head.clone(), epoch))
        }
        Install::Restored => {
            app.versions.commit_mutation(writer, "workspace-restore", None, true).await?;
            let head = app.versions.head(canonical)?.ok_or(TransferFailed::NotAHead)?;
            Ok((head, local_epoch(app, canonical)?))
        }
    }
}

/// The most entries a tree may bring (files, directories, links): beyond any real workspace,
/// short of what a tree whose subtrees are shared could expand to.
pub const MAX_ENTRIES: u64 = 10_000_000;

/// Refuses, before anything is written, a tree that would expand beyond [`MAX_ENTRIES`],
/// the workspace quota (0: none) or the data directory's free space.
fn fits(store: &Store, tree: &Ref, quota: u64, data_dir: &Path) -> Result<(), TransferFailed> {
    let totals = budget::tree_totals(store, tree, MAX_ENTRIES)?;
    let too_large = || TransferError::TooLarge { entries: totals.entries, bytes: totals.bytes };
    if quota > 0 && totals.bytes > quota {
        return Err(too_large().into());
    }
    if let Some(free) = free_bytes(data_dir).filter(|free| totals.bytes > *free) {
        return Err(TransferFailed::NoSpace { needed: totals.bytes, free });
    }
    Ok(())
}

/// The bytes an unprivileged writer may still put on `path`'s filesystem (unknown: `None`).
fn free_bytes(path: &Path) -> Option<u64> {
    let fs = nix::sys::statvfs::statvfs(path).ok()?;
    Some(fs.blocks_available().saturating_mul(fs.fragment_size()))
}

/// Removes a staged tree off the async threads (it may be large).
async fn discard(staged: Staged) {
    let _ = tokio::task::spawn_blocking(move || drop(staged)).await;
}

/// Whether this node holds a live copy of its own that an arriving head would replace: not
/// fenced, and either a committed tree with entries (other than the offered head's) or
/// files in its directory. An empty or fenced copy, or one already at the offered head, is
/// not.
fn live_copy(app: &App, canonical: &Path, pinned: &OwnedFd, offered: &Ref) -> Result<bool, TransferFailed> {
    if app.versions.placement().get(canonical)?.is_some_and(|p| p.moved_to.is_some()) {
        return Ok(false);
    }
    if let Some(head) = app.versions.head(canonical)? {
        if head == *offered {
            return Ok(false);
        }
        if let Some(tree) = app.versions.head_tree(canonical)? {
            let record = app.versions.store().read_record(&tree, Some("WorkspaceTree"))?;
            if record
                .value
                .get("entries")
                .and_then(serde_json::Value::as_array)
                .is_some_and(|e| !e.is_empty())
            {
                return Ok(true);
            }
        }
    }
    let dir = crate::fsat::open_dir_at(pinned, c".")
        .map_err(|e| TransferFailed::Task(format!("read the workspace directory: {e}")))?;
    let names = crate::fsat::names(&dir)
        .map_err(|e| TransferFailed::Task(format!("read the workspace directory: {e}")))?;
    Ok(!names.is_empty())
}

/// Who the materialized entries belong to: the workspace directory's owner, when runnerd is
/// root (the sandbox user for runnerd's workspaces, the caller for theirs), so the tree is
/// owned as the files a run would have written; nobody to change otherwise.
fn owner_of(dir: &OwnedFd) -> Option<(u32, u32)> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let st = crate::fsat::Stat::of_fd(dir).ok()?;
    Some((st.uid, st.gid))
}

/// Removes the staged trees a previous process left (a crash or a kill mid-install): nothing
/// reads them, and each may be a whole workspace. Returns how many.
pub fn sweep_staging(data_dir: &Path) -> usize {
    let top = std::ffi::CString::new(STAGING).expect("no NUL");
    let Ok(data) = crate::fsat::open_path(data_dir, libc::O_PATH | libc::O_DIRECTORY) else { return 0 };
    let Ok(parent) = crate::fsat::open_dir_at(&data, &top) else { return 0 };
    let names = crate::fsat::names(&parent).unwrap_or_default();
    names.iter().filter(|(_, c)| crate::fsat::remove_tree_at(&parent, c).is_ok()).count()
}

/// A staging directory of its own under `<data>/.runner-transfers`, removed when dropped.
struct Staged {
    parent: OwnedFd,
    name: std::ffi::CString,
    dir: OwnedFd,
}

impl Staged {
    fn make(data_dir: &Path) -> Result<Staged, TransferFailed> {
        let io = |what: &str, e: std::io::Error| TransferFailed::Task(format!("{what}: {e}"));
        let data = crate::fsat::open_path(data_dir, libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| io("open the data directory", e))?;
        let top = std::ffi::CString::new(STAGING).expect("no NUL");
        match crate::fsat::mkdir_at(&data, &top, 0o700) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create the staging directory", e)),
        }
        let parent =
            crate::fsat::open_dir_at(&data, &top).map_err(|e| io("open the staging directory", e))?;
        let name = std::ffi::CString::new(new_uuid_v4()).expect("no NUL");
        crate::fsat::mkdir_at(&parent, &name, 0o700).map_err(|e| io("create a staging directory", e))?;
        let dir = crate::fsat::open_dir_at(&parent, &name).map_err(|e| io("open a staging directory", e))?;
        Ok(Staged { parent, name, dir })
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if let Err(e) = crate::fsat::remove_tree_at(&self.parent, &self.name) {
            tracing::warn!(event = "transfer_staging_left", fd = self.parent.as_raw_fd(), error = %e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trees a killed install left staged go at start-up; a link planted in their place is
    /// removed as a name, never followed.
    #[test]
    fn staged_trees_left_behind_are_swept_without_following_links() {
        let data = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"k").unwrap();
        let staging = data.path().join(STAGING);
        std::fs::create_dir_all(staging.join("a/b/c")).unwrap();
        std::fs::write(staging.join("a/b/c/f"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path(), staging.join("link")).unwrap();
        assert_eq!(sweep_staging(data.path()), 2);
        assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
        assert!(outside.path().join("keep").exists(), "nothing reached through the link");
        assert_eq!(
            sweep_staging(tempfile::tempdir().unwrap().path()),
            0,
            "no staging directory: nothing to do"
        );
    }

    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        (dir, store)
    }

    fn framed(objects: &[(&Ref, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (r, bytes) in objects {
            out.extend_from_slice(protocol::frame_header(r).as_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    #[test]
    fn a_stream_stores_what_matches_and_stops_at_the_first_mismatch() {
        let (_src_dir, src) = store();
        let a = src.put(crate::versioning::Pool::Data, b"alpha", crate::versioning::OCTET_STREAM).unwrap();
        let b = src.put(crate::versioning::Pool::Data, b"beta", crate::versioning::OCTET_STREAM).unwrap();
        let (_dir, target) = store();
        let got = receive_objects(&target, &mut &framed(&[(&a, b"alpha"), (&b, b"beta")])[..]).unwrap();
        assert_eq!(got, Received { stored: 2, present: 0, bytes: 9 });
        assert_eq!(missing(&target, &[a.clone(), b.clone()]), Vec::<Ref>::new());
        let again = receive_objects(&target, &mut &framed(&[(&a, b"alpha")])[..]).unwrap();
        assert_eq!(again, Received { stored: 0, present: 1, bytes: 5 });

        let (_dir2, fresh) = store();
        let lying = framed(&[(&a, b"alpha"), (&b, b"BETA")]);
        assert!(receive_objects(&fresh, &mut &lying[..]).is_err());
        assert_eq!(
            missing(&fresh, &[a.clone(), b.clone()]),
            vec![b.clone()],
            "the good one stays, the bad one is not published"
        );

        let (_dir3, cut) = store();
        let whole = framed(&[(&a, b"alpha"), (&b, b"beta")]);
        assert!(
            receive_objects(&cut, &mut &whole[..whole.len() - 2]).is_err(),
            "a stream cut inside a frame fails"
        );
        assert_eq!(missing(&cut, &[a, b.clone()]), vec![b]);

        let (_dir4, junk) = store();
        assert!(receive_objects(&junk, &mut &b"data ../x 1\nx"[..]).is_err());
        assert!(receive_objects(&junk, &mut &[b'a'; 4096][..]).is_err(), "an endless header is refused");
    }
}
