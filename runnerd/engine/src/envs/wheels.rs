//! Local wheels for pip installs (internals §5.1, §5.3, §5.7 "Local wheels", "Wheel
//! security"): a workspace-relative `.whl` path is opened beneath the workspace descriptor
//! one component at a time, never through a symlink, copied into the store as
//! `wheels/<sha256>/<filename>` (through `wheels/.incoming-<uuid>.whl`, `O_EXCL`) and
//! recorded as a [`LocalWheel`]. pip is then given the store's copy, never the workspace's:
//! the sandbox that owns the workspace can change it at any moment, and the revision's
//! wheels must outlive the workspace (later revisions carry them, re-verified).
//!
//! Stricter than the original: any symlink on the way is refused, also one that stays
//! inside the workspace (the original refused only those pointing outside it); a wheel
//! path resolves to exactly one file without resolving links.
//!
//! A copy outside every quota (up to 64 × 4 GiB per request) is kept only while something
//! names it (issue #32): an install copies only once it holds its environment's gate and
//! its request passed every check, holds what it copied in [`InUse`] until it ends, and a
//! failed one [`release`]s it, removing each copy no install holds and no revision of a
//! live environment names; [`sweep_unreferenced`] removes the rest at start-up.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::catalog::{ContentRef, LocalWheel, WheelManager};
use super::disk;
use crate::fsat;
use crate::versioning::names::hex;
use crate::versioning::new_uuid_v4;

/// The temporaries' prefix in `wheels/`.
const INCOMING_PREFIX: &str = ".incoming-";
/// The largest wheel persisted (the largest on PyPI, CUDA builds of torch, are under 3 GiB):
/// each is kept by content, so a caller must not be able to fill the store's disk with one.
pub const MAX_WHEEL_BYTES: u64 = 4 << 30;
/// The most local wheels one install may name.
pub const MAX_WHEELS_PER_INSTALL: usize = 64;
/// The most local wheels one revision may carry: each revision records every wheel its
/// environment got (earlier ones included), and every record stays in the catalog.
pub const MAX_WHEELS_PER_REVISION: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum WheelError {
    #[error("Local wheels require a workspace: give workspaceRoot or runnerWorkspaceKey")]
    NoWorkspace,
    #[error("Remote pip URLs are not allowed; upload the wheel into the workspace and name its path: {0}")]
    Remote(String),
    #[error("Local wheel path is empty")]
    Empty,
    #[error("Local wheel paths must be relative to the workspace: {0}")]
    Absolute(String),
    #[error("Local wheel path escapes the Session workspace: {0}")]
    Traversal(String),
    #[error("Local wheel must be a .whl file: {0}")]
    NotWheel(String),
    #[error("Local wheel file name is not a wheel name (distribution-version-python-abi-platform.whl): {0}")]
    BadName(String),
    #[error("Local wheel not found in the workspace (ENOENT): {0}")]
    Missing(String),
    #[error("Local wheel path contains a symbolic link: {0}")]
    Symlink(String),
    #[error("Local wheel is larger than {MAX_WHEEL_BYTES} bytes: {0}")]
    TooLarge(String),
    #[error("Local wheel is not a regular file: {0}")]
    NotRegular(String),
    #[error("Local wheel changed while it was copied: {0}")]
    Changed(String),
    /// A persisted wheel whose bytes are no longer its hash's (`<hash>/<filename>`).
    #[error("Persisted wheel is corrupt: {0}")]
    Corrupt(String),
    #[error("Could not {0} the local wheel")]
    Io(&'static str, #[source] io::Error),
}

/// A checked request: where the wheel is in the workspace and what its name says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The directories above the file, workspace-relative, no `.`/`..`/empty ones.
    pub dirs: Vec<String>,
    pub filename: String,
    /// PEP 503-normalised.
    pub distribution: String,
    pub version: String,
}

impl Request {
    /// `dir/…/file.whl`, the form recorded as `sourcePath`.
    pub fn source_path(&self) -> String {
        let mut parts: Vec<&str> = self.dirs.iter().map(String::as_str).collect();
        parts.push(&self.filename);
        parts.join("/")
    }
}

/// Whether a pip install's package names a wheel file (or a URL) rather than a
/// requirement: such entries go through [`persist`], the others through
/// [`super::ids::check_spec`].
pub fn is_wheel_request(package: &str) -> bool {
    package.ends_with(".whl") || package.contains("://") || package.contains('/')
}

/// Checks a request path without touching the disk.
pub fn parse_request(path: &str) -> Result<Request, WheelError> {
    if path.contains("://") {
        return Err(WheelError::Remote(path.to_owned()));
    }
    if path.is_empty() {
        return Err(WheelError::Empty);
    }
    if path.starts_with('/') {
        return Err(WheelError::Absolute(path.to_owned()));
    }
    if path.contains('\0') {
        return Err(WheelError::NotWheel(path.to_owned()));
    }
    let mut parts: Vec<String> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(WheelError::Traversal(path.to_owned())),
            p => parts.push(p.to_owned()),
        }
    }
    let Some(filename) = parts.pop().filter(|f| !path.ends_with('/') && f.ends_with(".whl")) else {
        return Err(WheelError::NotWheel(path.to_owned()));
    };
    let (distribution, version) = parse_wheel_name(&filename)?;
    Ok(Request { dirs: parts, filename, distribution, version })
}

/// PEP 427: `{distribution}-{version}(-{build tag})?-{python tag}-{abi tag}-{platform tag}.whl`.
/// Returns the distribution (PEP 503-normalised: lowercase, runs of `-_.` as one `-`) and
/// the version. The version is the first part after the distribution that starts with a
/// digit, so a name that kept its `-` (`example-pkg-1.0-…`: not PEP 427, but seen in the
/// wild) still parses.
pub fn parse_wheel_name(filename: &str) -> Result<(String, String), WheelError> {
    let Some(stem) = filename.strip_suffix(".whl") else {
        return Err(WheelError::NotWheel(filename.to_owned()));
    };
    let bad = || WheelError::BadName(filename.to_owned());
    if filename.starts_with('.') || filename.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(bad());
    }
    let parts: Vec<&str> = stem.split('-').collect();
    if parts.len() < 5 || parts.iter().any(|p| p.is_empty()) {
        return Err(bad());
    }
    let tags_at = parts.len() - 3;
    let starts_with_digit = |p: &str| p.as_bytes()[0].is_ascii_digit();
    let version_at = (1..tags_at).find(|&i| starts_with_digit(parts[i])).ok_or_else(bad)?;
    let build = &parts[version_at + 1..tags_at];
    if build.len() > 1 || build.iter().any(|b| !starts_with_digit(b)) {
        return Err(bad());
    }
    let name_ok = |p: &&str| p.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_'));
    let version = parts[version_at];
    let version_ok =
        version.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'!' | b'+' | b'_'));
    if !parts[..version_at].iter().all(name_ok) || !version_ok {
        return Err(bad());
    }
    Ok((normalize_distribution(&parts[..version_at].join("-")), version.to_owned()))
}

/// PEP 503: lowercase, every run of `-`, `_`, `.` as one `-`.
fn normalize_distribution(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut separator = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            separator = true;
            continue;
        }
        if separator && !out.is_empty() {
            out.push('-');
        }
        separator = false;
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// How many wheels a revision carries after an install of `new` on top of `kept`: a new
/// wheel replaces a kept one of the same file name.
pub fn carried_after(kept: &[LocalWheel], new: &[&str]) -> usize {
    kept.iter().filter(|k| !new.contains(&k.filename.as_str())).count() + new.len()
}

/// The stored wheels installs in flight hold, by `(hash, filename)`, with how many hold each:
/// one install's failure never removes a copy another is about to hand to pip. Publishing a
/// copy and releasing one happen under its lock.
#[derive(Debug, Default)]
pub struct InUse(std::sync::Mutex<HashMap<(String, String), usize>>);

impl InUse {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many stored wheels are held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.lock().len()
    }
}

fn key(wheel: &LocalWheel) -> (String, String) {
    (wheel.content.hash.clone(), wheel.filename.clone())
}

/// Copies the workspace wheel `path` into the store below `store` (the
/// `scientific-envs` directory) and returns its record, held in `in_use` until
/// [`release`]d. An identical wheel already stored is reused; a corrupt one is replaced.
pub fn persist(
    store: &impl AsRawFd,
    workspace: &impl AsRawFd,
    path: &str,
    in_use: &InUse,
) -> Result<LocalWheel, WheelError> {
    let request = parse_request(path)?;
    let source = open_source(workspace, &request, path)?;
    // Reachable by the sandbox user: the pip sandbox binds the stored wheels, and bwrap
    // resolves a bind's source as that user.
    let wheels = disk::ensure_dir(store, common::layout::ENV_WHEELS, 0o755)
        .map_err(|e| WheelError::Io("open the store of", e))?;
    let incoming = format!("{INCOMING_PREFIX}{}.whl", new_uuid_v4());
    let incoming_c = disk::cstr(&incoming).map_err(|e| WheelError::Io("name", e))?;
    let stored = copy_in(&source, &wheels, &incoming_c, path).and_then(|content| {
        let mut held = in_use.lock();
        publish(&wheels, &incoming_c, &content, &request.filename)?;
        *held.entry((content.hash.clone(), request.filename.clone())).or_default() += 1;
        Ok(content)
    });
    // Gone once published; removed after any failure.
    let _ = fsat::unlink_at(&wheels, &incoming_c);
    let content = stored?;
    Ok(LocalWheel {
        content,
        distribution: request.distribution.clone(),
        filename: request.filename.clone(),
        manager: WheelManager::Pip,
        source_path: request.source_path(),
        version: request.version,
    })
}

/// The workspace file, opened beneath `workspace` without following anything, and checked
/// to be the regular file the name pointed at when it was looked at.
fn open_source(
    workspace: &impl AsRawFd,
    request: &Request,
    path: &str,
) -> Result<(File, fsat::Stat), WheelError> {
    let missing = || WheelError::Missing(path.to_owned());
    let dirs = request.dirs.iter().map(|d| std::path::Component::Normal(d.as_ref()));
    let parent = match fsat::walk_beneath(workspace, dirs) {
        Ok((fd, _)) => fd,
        Err(fsat::Stopped::Symlink) => return Err(WheelError::Symlink(path.to_owned())),
        Err(fsat::Stopped::NotDirectory) => return Err(missing()),
        Err(fsat::Stopped::Escapes) => return Err(WheelError::Traversal(path.to_owned())),
        Err(fsat::Stopped::Missing(e)) if e.raw_os_error() == Some(libc::ENOENT) => return Err(missing()),
        Err(fsat::Stopped::Missing(e)) => return Err(WheelError::Io("open", e)),
    };
    let name = disk::cstr(&request.filename).map_err(|e| WheelError::Io("name", e))?;
    let seen = match fsat::Stat::at(&parent, &name) {
        Ok(st) if st.kind() == libc::S_IFLNK => return Err(WheelError::Symlink(path.to_owned())),
        Ok(st) if st.kind() != libc::S_IFREG => return Err(WheelError::NotRegular(path.to_owned())),
        Ok(st) if st.size > MAX_WHEEL_BYTES => return Err(WheelError::TooLarge(path.to_owned())),
        Ok(st) => st,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(missing()),
        Err(e) => return Err(WheelError::Io("inspect", e)),
    };
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
    let fd = match fsat::open_at(&parent, &name, flags) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Err(missing()),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(WheelError::Symlink(path.to_owned())),
        Err(e) => return Err(WheelError::Io("open", e)),
    };
    let st = fsat::Stat::of_fd(&fd).map_err(|e| WheelError::Io("inspect", e))?;
    if (st.dev, st.ino) != (seen.dev, seen.ino) || st.kind() != libc::S_IFREG {
        return Err(WheelError::Changed(path.to_owned()));
    }
    Ok((File::from(fd), st))
}

/// Streams the source into `wheels/<incoming>` (0644, `O_EXCL`) hashing what is written,
/// fsyncs it, then re-reads the copy: its hash and size must be what was written, and the
/// source must not have changed meanwhile (size, mtime, ctime).
fn copy_in(
    source: &(File, fsat::Stat),
    wheels: &OwnedFd,
    incoming: &std::ffi::CStr,
    path: &str,
) -> Result<ContentRef, WheelError> {
    let (src, before) = (&source.0, source.1);
    let io = |what| move |e| WheelError::Io(what, e);
    let fd = fsat::create_new_at(wheels, incoming, 0o644).map_err(io("create"))?;
    disk::fchmod(&fd, 0o644).map_err(io("create"))?;
    let mut dst = File::from(fd);
    // Never more than the size it had (plus one byte, to notice growth): a file that grows
    // while it is copied is refused below, not copied without end.
    let content = hash_copy(std::io::Read::take(src, before.size + 1), &mut dst).map_err(io("copy"))?;
    dst.sync_all().map_err(io("sync"))?;
    let after = fsat::Stat::of_fd(src).map_err(io("inspect"))?;
    if (after.size, after.mtime_ns, after.ctime_ns) != (before.size, before.mtime_ns, before.ctime_ns)
        || content.size != before.size
    {
        return Err(WheelError::Changed(path.to_owned()));
    }
    let copy = fsat::open_at(wheels, incoming, libc::O_RDONLY | libc::O_NOFOLLOW).map_err(io("re-read"))?;
    if hash_file(File::from(copy)).map_err(io("re-read"))? != content {
        return Err(WheelError::Changed(path.to_owned()));
    }
    Ok(content)
}

/// Moves the verified copy to `wheels/<hash>/<filename>`, unless an identical file is
/// already there (then the copy is left to be removed).
fn publish(
    wheels: &OwnedFd,
    incoming: &std::ffi::CStr,
    content: &ContentRef,
    filename: &str,
) -> Result<(), WheelError> {
    let io = |what| move |e| WheelError::Io(what, e);
    let dir = disk::ensure_dir(wheels, &content.hash, 0o755).map_err(io("store"))?;
    let name = disk::cstr(filename).map_err(io("name"))?;
    if stored_matches(&dir, &name, content).map_err(io("check"))? {
        return Ok(());
    }
    fsat::rename_between(wheels, incoming, &dir, &name).map_err(io("store"))?;
    disk::sync_dir(&dir).map_err(io("sync"))?;
    disk::sync_dir(wheels).map_err(io("sync"))
}

/// Whether `dir/name` is a regular file with exactly `content`'s bytes.
fn stored_matches(dir: &OwnedFd, name: &std::ffi::CStr, content: &ContentRef) -> io::Result<bool> {
    match fsat::open_at(dir, name, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK) {
        Ok(fd) => {
            let st = fsat::Stat::of_fd(&fd)?;
            Ok(st.kind() == libc::S_IFREG
                && st.size == content.size
                && hash_file(File::from(fd))? == *content)
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reads `src` to its end, hashing every chunk and writing it to `sink`.
fn hash_copy(mut src: impl Read, mut sink: impl Write) -> io::Result<ContentRef> {
    let (mut hasher, mut size, mut buf) = (Sha256::new(), 0u64, vec![0u8; 1 << 16]);
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(ContentRef { hash: hex(&hasher.finalize()), size }),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        sink.write_all(&buf[..n])?;
        size += n as u64;
    }
}

fn hash_file(f: File) -> io::Result<ContentRef> {
    hash_copy(f, io::sink())
}

/// `wheels/<hash>/<filename>` of a record, relative to the store; the hash must be 64
/// lowercase hex and the file name a wheel name, since both come from the catalog.
pub fn stored_rel_path(wheel: &LocalWheel) -> Result<PathBuf, WheelError> {
    let hash = &wheel.content.hash;
    let hash_ok = hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !hash_ok || wheel.filename.contains('/') {
        return Err(WheelError::Corrupt(format!("{hash}/{}", wheel.filename)));
    }
    parse_wheel_name(&wheel.filename)?;
    Ok([common::layout::ENV_WHEELS, hash, &wheel.filename].iter().collect())
}

/// Re-checks a persisted wheel before a later revision hands it to pip again.
pub fn verify_persisted(store: &impl AsRawFd, wheel: &LocalWheel) -> Result<(), WheelError> {
    let corrupt = || WheelError::Corrupt(format!("{}/{}", wheel.content.hash, wheel.filename));
    stored_rel_path(wheel)?;
    let io = |e| WheelError::Io("check", e);
    let Some(wheels) = disk::open_dir(store, common::layout::ENV_WHEELS).map_err(io)? else {
        return Err(corrupt());
    };
    let Some(dir) = disk::open_dir(&wheels, &wheel.content.hash).map_err(io)? else {
        return Err(corrupt());
    };
    let name = disk::cstr(&wheel.filename).map_err(io)?;
    match stored_matches(&dir, &name, &wheel.content).map_err(io)? {
        true => Ok(()),
        false => Err(corrupt()),
    }
}

/// Lets go of `wheels` an install held ([`persist`]); each that no other install holds and
/// that `named` says no live revision names is removed (its hash directory too, once
/// empty). Best effort: what fails to go is logged and swept at the next start. Returns how
/// many went.
pub fn release(
    store: &impl AsRawFd,
    wheels: &[LocalWheel],
    in_use: &InUse,
    named: &dyn Fn(&LocalWheel) -> bool,
) -> usize {
    let mut held = in_use.lock();
    for wheel in wheels {
        let k = key(wheel);
        if let Some(n) = held.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                held.remove(&k);
            }
        }
    }
    remove_unheld(store, wheels, &held, named)
}

/// Removes each of `wheels` that no install holds and `named` does not name (a deleted
/// environment's); returns how many went.
pub fn forget(
    store: &impl AsRawFd,
    wheels: &[LocalWheel],
    in_use: &InUse,
    named: &dyn Fn(&LocalWheel) -> bool,
) -> usize {
    remove_unheld(store, wheels, &in_use.lock(), named)
}

fn remove_unheld(
    store: &impl AsRawFd,
    wheels: &[LocalWheel],
    held: &HashMap<(String, String), usize>,
    named: &dyn Fn(&LocalWheel) -> bool,
) -> usize {
    let mut removed = 0;
    for wheel in wheels {
        if held.contains_key(&key(wheel)) || named(wheel) {
            continue;
        }
        match remove_stored(store, wheel) {
            Ok(true) => removed += 1,
            Ok(false) => {}
            Err(e) => tracing::warn!(
                event = "environment_wheel_left",
                wheel = %wheel.filename,
                error = %e,
                "an unreferenced wheel could not be removed; the next start sweeps it"
            ),
        }
    }
    removed
}

/// Removes `wheels/<hash>/<filename>` and then the hash directory if it is empty; whether
/// the file was there.
fn remove_stored(store: &impl AsRawFd, wheel: &LocalWheel) -> io::Result<bool> {
    if stored_rel_path(wheel).is_err() {
        return Ok(false);
    }
    let Some(wheels) = disk::open_dir(store, common::layout::ENV_WHEELS)? else { return Ok(false) };
    let Some(dir) = disk::open_dir(&wheels, &wheel.content.hash)? else { return Ok(false) };
    let gone = match fsat::unlink_at(&dir, &disk::cstr(&wheel.filename)?) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => false,
        Err(e) => return Err(e),
    };
    // Still holding another file name of the same bytes: kept.
    let _ = fsat::rmdir_at(&wheels, &disk::cstr(&wheel.content.hash)?);
    Ok(gone)
}

/// Removes every stored wheel `named` does not name (at start-up, before any install runs:
/// what a crash between copy and record, or an older release, left), and any hash directory
/// left empty. Only `<64 hex>/<wheel name>` entries are considered; anything else is left.
/// Returns how many went.
pub fn sweep_unreferenced(store: &impl AsRawFd, named: &dyn Fn(&str, &str) -> bool) -> usize {
    let Ok(Some(wheels)) = disk::open_dir(store, common::layout::ENV_WHEELS) else { return 0 };
    let Ok(hashes) = fsat::names(&wheels) else { return 0 };
    let mut removed = 0;
    for (hash, hash_c) in hashes {
        let Some(hash) = hash
            .to_str()
            .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        else {
            continue;
        };
        let Ok(dir) = fsat::open_dir_at(&wheels, &hash_c) else { continue };
        for (name, name_c) in fsat::names(&dir).unwrap_or_default() {
            let Some(name) = name.to_str() else { continue };
            if parse_wheel_name(name).is_ok() && !named(hash, name) && fsat::unlink_at(&dir, &name_c).is_ok()
            {
                removed += 1;
            }
        }
        let _ = fsat::rmdir_at(&wheels, &hash_c);
    }
    removed
}

/// Removes `.incoming-*` temporaries a crash left in `wheels/` (at start-up).
pub fn sweep_incoming(store: &impl AsRawFd) -> usize {
    match disk::open_dir(store, common::layout::ENV_WHEELS) {
        Ok(Some(wheels)) => disk::sweep(&wheels, |name| name.starts_with(INCOMING_PREFIX)),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    const WHEEL: &str = "example_pkg-1.2.3-py3-none-any.whl";

    struct Fixture {
        tmp: tempfile::TempDir,
        store: OwnedFd,
        workspace: OwnedFd,
        in_use: InUse,
    }

    impl Fixture {
        fn new() -> Fixture {
            let tmp = tempfile::tempdir().unwrap();
            for d in ["store", "ws/wheels", "outside"] {
                std::fs::create_dir_all(tmp.path().join(d)).unwrap();
            }
            std::fs::write(tmp.path().join("ws/wheels").join(WHEEL), b"PK\x03\x04 wheel bytes").unwrap();
            let open =
                |d: &str| fsat::open_path(&tmp.path().join(d), libc::O_PATH | libc::O_DIRECTORY).unwrap();
            let (store, workspace) = (open("store"), open("ws"));
            Fixture { tmp, store, workspace, in_use: InUse::default() }
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.tmp.path().join(rel)
        }

        fn persist(&self, request: &str) -> Result<LocalWheel, WheelError> {
            persist(&self.store, &self.workspace, request, &self.in_use)
        }

        fn store_entries(&self) -> Vec<String> {
            let mut out = Vec::new();
            for entry in std::fs::read_dir(self.path("store/wheels")).unwrap() {
                let entry = entry.unwrap();
                let name = entry.file_name().into_string().unwrap();
                match entry.file_type().unwrap().is_dir() {
                    true => {
                        for f in std::fs::read_dir(entry.path()).unwrap() {
                            out.push(format!("{name}/{}", f.unwrap().file_name().into_string().unwrap()));
                        }
                    }
                    false => out.push(name),
                }
            }
            out.sort();
            out
        }
    }

    #[test]
    fn a_wheel_larger_than_the_store_keeps_is_refused_before_a_byte_is_copied() {
        let f = Fixture::new();
        let big = "huge_pkg-1.0-py3-none-any.whl";
        // Sparse: the size is what is judged, before anything is read.
        let file = std::fs::File::create(f.path("ws/wheels").join(big)).unwrap();
        file.set_len(MAX_WHEEL_BYTES + 1).unwrap();
        let err = f.persist(&format!("wheels/{big}")).unwrap_err();
        assert!(matches!(err, WheelError::TooLarge(_)), "{err}");
        assert_eq!(
            err.to_string(),
            format!("Local wheel is larger than {MAX_WHEEL_BYTES} bytes: wheels/{big}")
        );
    }

    #[test]
    fn a_wheel_is_persisted_by_hash_and_outlives_the_workspace() {
        let fx = Fixture::new();
        let bytes = std::fs::read(fx.path("ws/wheels").join(WHEEL)).unwrap();
        let wheel = fx.persist(&format!("./wheels/{WHEEL}")).unwrap();
        let want = LocalWheel {
            content: ContentRef::of(&bytes),
            distribution: "example-pkg".into(),
            filename: WHEEL.into(),
            manager: WheelManager::Pip,
            source_path: format!("wheels/{WHEEL}"),
            version: "1.2.3".into(),
        };
        assert_eq!(wheel, want);
        let rel = stored_rel_path(&wheel).unwrap();
        assert_eq!(rel, PathBuf::from(format!("wheels/{}/{WHEEL}", wheel.content.hash)));
        let stored = fx.path("store").join(&rel);
        assert_eq!(std::fs::read(&stored).unwrap(), bytes);
        assert_eq!(std::fs::metadata(&stored).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(fx.store_entries(), [format!("{}/{WHEEL}", wheel.content.hash)], "no temporary is left");

        // The same bytes again (from another path): the stored one is reused.
        std::fs::create_dir(fx.path("ws/again")).unwrap();
        std::fs::copy(fx.path("ws/wheels").join(WHEEL), fx.path("ws/again").join(WHEEL)).unwrap();
        let again = fx.persist(&format!("again/{WHEEL}")).unwrap();
        assert_eq!(
            (again.content.clone(), again.source_path.as_str()),
            (wheel.content.clone(), "again/example_pkg-1.2.3-py3-none-any.whl")
        );
        assert_eq!(fx.store_entries().len(), 1);

        // The workspace goes; the wheel stays, verifiable for later revisions.
        std::fs::remove_dir_all(fx.path("ws/wheels")).unwrap();
        std::fs::remove_dir_all(fx.path("ws/again")).unwrap();
        verify_persisted(&fx.store, &wheel).unwrap();

        // A stored copy that no longer matches its hash is refused, and replaced by the next
        // persist of the real bytes.
        std::fs::write(&stored, b"tampered").unwrap();
        let corrupt = format!("Persisted wheel is corrupt: {}/{WHEEL}", wheel.content.hash);
        assert_eq!(verify_persisted(&fx.store, &wheel).unwrap_err().to_string(), corrupt);
        std::fs::create_dir(fx.path("ws/wheels")).unwrap();
        std::fs::write(fx.path("ws/wheels").join(WHEEL), &bytes).unwrap();
        fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        verify_persisted(&fx.store, &wheel).unwrap();
        std::fs::remove_file(&stored).unwrap();
        assert_eq!(verify_persisted(&fx.store, &wheel).unwrap_err().to_string(), corrupt);
    }

    #[test]
    fn every_unsafe_request_is_refused() {
        let fx = Fixture::new();
        std::fs::write(fx.path("outside").join(WHEEL), b"secret").unwrap();
        symlink(fx.path("outside").join(WHEEL), fx.path("ws/escape-1.0-py3-none-any.whl")).unwrap();
        symlink(fx.path("outside"), fx.path("ws/linked")).unwrap();
        symlink(fx.path("ws/wheels").join(WHEEL), fx.path("ws/inside-1.0-py3-none-any.whl")).unwrap();
        std::fs::create_dir(fx.path("ws/dir-1.0-py3-none-any.whl")).unwrap();
        std::fs::write(fx.path("ws/notes.txt"), b"x").unwrap();
        std::fs::write(fx.path("ws/bad.whl"), b"x").unwrap();
        std::fs::write(fx.path("ws/file"), b"x").unwrap();
        nix::unistd::mkfifo(
            &fx.path("ws/fifo-1.0-py3-none-any.whl"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let cases: &[(&str, &str)] = &[
            ("", "Local wheel path is empty"),
            (
                "/etc/example_pkg-1.2.3-py3-none-any.whl",
                "Local wheel paths must be relative to the workspace: /etc/example_pkg-1.2.3-py3-none-any.whl",
            ),
            (
                "../outside/example_pkg-1.2.3-py3-none-any.whl",
                "Local wheel path escapes the Session workspace: ../outside/example_pkg-1.2.3-py3-none-any.whl",
            ),
            (
                "wheels/../../x-1.0-py3-none-any.whl",
                "Local wheel path escapes the Session workspace: wheels/../../x-1.0-py3-none-any.whl",
            ),
            (
                "https://files.example/example_pkg-1.2.3-py3-none-any.whl",
                "Remote pip URLs are not allowed; upload the wheel into the workspace and name its path: https://files.example/example_pkg-1.2.3-py3-none-any.whl",
            ),
            (
                "http://x/y.whl",
                "Remote pip URLs are not allowed; upload the wheel into the workspace and name its path: http://x/y.whl",
            ),
            (
                "wheels/absent-1.0-py3-none-any.whl",
                "Local wheel not found in the workspace (ENOENT): wheels/absent-1.0-py3-none-any.whl",
            ),
            (
                "file/x-1.0-py3-none-any.whl",
                "Local wheel not found in the workspace (ENOENT): file/x-1.0-py3-none-any.whl",
            ),
            (
                "escape-1.0-py3-none-any.whl",
                "Local wheel path contains a symbolic link: escape-1.0-py3-none-any.whl",
            ),
            (
                "linked/example_pkg-1.2.3-py3-none-any.whl",
                "Local wheel path contains a symbolic link: linked/example_pkg-1.2.3-py3-none-any.whl",
            ),
            (
                "inside-1.0-py3-none-any.whl",
                "Local wheel path contains a symbolic link: inside-1.0-py3-none-any.whl",
            ),
            ("dir-1.0-py3-none-any.whl", "Local wheel is not a regular file: dir-1.0-py3-none-any.whl"),
            ("fifo-1.0-py3-none-any.whl", "Local wheel is not a regular file: fifo-1.0-py3-none-any.whl"),
            ("notes.txt", "Local wheel must be a .whl file: notes.txt"),
            ("wheels/", "Local wheel must be a .whl file: wheels/"),
            ("docs/notes.txt", "Local wheel must be a .whl file: docs/notes.txt"),
            (
                "bad.whl",
                "Local wheel file name is not a wheel name (distribution-version-python-abi-platform.whl): bad.whl",
            ),
        ];
        for (request, want) in cases {
            let got = fx.persist(request).unwrap_err().to_string();
            assert_eq!(got, *want, "{request:?}");
        }
        assert!(!fx.path("store/wheels").exists() || fx.store_entries().is_empty(), "nothing was stored");
        assert!(WheelError::NoWorkspace.to_string().contains("workspaceRoot"));
    }

    #[test]
    fn wheel_names() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("example_pkg-1.2.3-py3-none-any.whl", Some(("example-pkg", "1.2.3"))),
            ("Example.Pkg-1.2.3-py3-none-any.whl", Some(("example-pkg", "1.2.3"))),
            ("example-pkg-1.2.3-py3-none-any.whl", Some(("example-pkg", "1.2.3"))),
            (
                "numpy-2.0.2-1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                Some(("numpy", "2.0.2")),
            ),
            ("torch-2.4.0+cpu-cp312-cp312-linux_x86_64.whl", Some(("torch", "2.4.0+cpu"))),
            ("a__b-0.1-py3-none-any.whl", Some(("a-b", "0.1"))),
            ("pkg-1.0-py3-none.whl", None),
            ("pkg-1.0-x-y-py3-none-any.whl", None),
            ("pkg-1.0-1-2-py3-none-any.whl", None),
            ("-1.0-py3-none-any.whl", None),
            ("pkg-one-py3-none-any.whl", None),
            ("pkg--1.0-py3-none-any.whl", None),
            (".pkg-1.0-py3-none-any.whl", None),
            ("pkg 1-1.0-py3-none-any.whl", None),
            ("pkg-1.0-py3-none-any.zip", None),
            ("pkg-1.0-py3-none-any.WHL", None),
        ];
        for (name, want) in cases {
            let got = parse_wheel_name(name).ok();
            assert_eq!(got.as_ref().map(|(d, v)| (d.as_str(), v.as_str())), *want, "{name}");
        }
    }

    #[test]
    fn which_pip_packages_are_wheels() {
        let cases: &[(&str, bool)] = &[
            ("numpy", false),
            ("numpy==2.0", false),
            ("pkg.whl", true),
            ("wheels/pkg-1.0-py3-none-any.whl", true),
            ("https://x/p.tar.gz", true),
            ("git+https://x/repo", true),
        ];
        for (package, want) in cases {
            assert_eq!(is_wheel_request(package), *want, "{package}");
        }
    }

    #[test]
    fn a_new_wheel_replaces_a_carried_one_of_its_name() {
        let wheel = |name: &str| LocalWheel {
            content: ContentRef { hash: "ab".repeat(32), size: 1 },
            distribution: name.into(),
            filename: format!("{name}-1.0-py3-none-any.whl"),
            manager: WheelManager::Pip,
            source_path: format!("{name}-1.0-py3-none-any.whl"),
            version: "1.0".into(),
        };
        let kept = [wheel("a"), wheel("b")];
        let name = |w: &LocalWheel| w.filename.clone();
        let (b, c) = (name(&wheel("b")), name(&wheel("c")));
        assert_eq!(carried_after(&kept, &[]), 2);
        assert_eq!(carried_after(&kept, &[&b]), 2);
        assert_eq!(carried_after(&kept, &[&b, &c]), 3);
        assert_eq!(carried_after(&[], &[&c]), 1);
    }

    #[test]
    fn records_from_the_catalog_are_checked_before_use() {
        let good = LocalWheel {
            content: ContentRef { hash: "ab".repeat(32), size: 1 },
            distribution: "p".into(),
            filename: "p-1.0-py3-none-any.whl".into(),
            manager: WheelManager::Pip,
            source_path: "p-1.0-py3-none-any.whl".into(),
            version: "1.0".into(),
        };
        stored_rel_path(&good).unwrap();
        let bad_hash =
            LocalWheel { content: ContentRef { hash: "../../etc".into(), size: 1 }, ..good.clone() };
        assert!(matches!(stored_rel_path(&bad_hash), Err(WheelError::Corrupt(_))));
        let bad_name = LocalWheel { filename: "../p-1.0-py3-none-any.whl".into(), ..good.clone() };
        assert!(stored_rel_path(&bad_name).is_err());
        let not_wheel = LocalWheel { filename: "passwd".into(), ..good };
        assert!(stored_rel_path(&not_wheel).is_err());
    }

    #[test]
    fn a_released_wheel_goes_unless_another_install_holds_it_or_a_revision_names_it() {
        let fx = Fixture::new();
        let first = fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        let second = fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        assert_eq!((fx.in_use.held(), fx.store_entries().len()), (1, 1), "one copy, held twice");
        assert_eq!(release(&fx.store, std::slice::from_ref(&first), &fx.in_use, &|_| false), 0, "still held");
        assert_eq!(fx.store_entries().len(), 1);
        // Named by a revision: kept, and no longer held.
        assert_eq!(release(&fx.store, std::slice::from_ref(&second), &fx.in_use, &|_| true), 0);
        assert_eq!((fx.in_use.held(), fx.store_entries().len()), (0, 1));
        // Held by nothing and named by nothing: gone, its hash directory with it.
        let third = fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        assert_eq!(release(&fx.store, &[third], &fx.in_use, &|_| false), 1);
        assert!(fx.store_entries().is_empty(), "{:?}", fx.store_entries());
        assert_eq!(std::fs::read_dir(fx.path("store/wheels")).unwrap().count(), 0);
        // Releasing what is already gone is no error.
        assert_eq!(release(&fx.store, &[first], &fx.in_use, &|_| false), 0);
    }

    #[test]
    fn unreferenced_wheels_are_swept_and_named_ones_kept() {
        let fx = Fixture::new();
        let kept = fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        let other = "other_pkg-2.0-py3-none-any.whl";
        std::fs::write(fx.path("ws/wheels").join(other), b"PK other bytes").unwrap();
        let dropped = fx.persist(&format!("wheels/{other}")).unwrap();
        std::fs::write(fx.path("store/wheels/notes.txt"), b"not ours").unwrap();
        let named = |hash: &str, name: &str| hash == kept.content.hash && name == kept.filename;
        assert_eq!(sweep_unreferenced(&fx.store, &named), 1);
        assert_eq!(fx.store_entries(), [format!("{}/{WHEEL}", kept.content.hash), "notes.txt".to_owned()]);
        assert!(!fx.path("store/wheels").join(&dropped.content.hash).exists(), "its directory went too");
        verify_persisted(&fx.store, &kept).unwrap();
    }

    #[test]
    fn interrupted_copies_are_swept() {
        let fx = Fixture::new();
        let wheel = fx.persist(&format!("wheels/{WHEEL}")).unwrap();
        std::fs::write(fx.path("store/wheels/.incoming-0000.whl"), b"partial").unwrap();
        assert_eq!(sweep_incoming(&fx.store), 1);
        assert_eq!(fx.store_entries(), [format!("{}/{WHEEL}", wheel.content.hash)]);
    }
}
