//! The published packages on disk: `<dataDir>/projects/.skill-packages/<id>/` holds
//! `.manifest.json` (the bundle without its bytes) and one directory per skill with its
//! files. A package is written into a private staging directory by descriptor (`mkdirat`,
//! `O_CREAT|O_EXCL|O_NOFOLLOW`), then published with one `renameat2(RENAME_NOREPLACE)`:
//! readers see the whole package or none, and of two identical posts one rename wins and
//! the other finds the winner's package and verifies it. Every read is by descriptor with
//! no symlink followed, and a package is verified in full (no extra entry, no link, every
//! byte hashed, the manifest hashing to the directory's name) each time it is answered or
//! mounted.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::bundle::{self, Bundle, BundleError, Content};
use crate::fsat::{self, Stat};
use crate::versioning::names::{hex, new_uuid_v4};

pub use common::layout::SKILL_PACKAGES as PACKAGES_DIR;
pub const MANIFEST: &str = ".manifest.json";
const STAGING_PREFIX: &str = ".staging-";
/// Ours: a manifest is small (no bytes); anything larger is not one of ours.
const MAX_MANIFEST_BYTES: u64 = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("The skill package store is unavailable ({what})")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("Skill package integrity check failed: {0}")]
    Integrity(String),
    #[error("Skill package manifest is unreadable")]
    Manifest(#[source] BundleError),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let what = what.into();
    move |source| StoreError::Io { what, source }
}

fn integrity(m: impl Into<String>) -> StoreError {
    StoreError::Integrity(m.into())
}

fn cstr(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `<data>/projects/.skill-packages` by descriptor (`O_PATH`), created (0755) when `create`.
pub fn open_packages_dir(data_dir: &Path, create: bool) -> Result<Option<(PathBuf, OwnedFd)>, StoreError> {
    let real = std::fs::canonicalize(data_dir).map_err(io_err("the data directory"))?;
    let mut here = OwnedFd::from(std::fs::File::open(&real).map_err(io_err("the data directory"))?);
    let mut path = real;
    for name in [crate::workspace::PROJECTS, PACKAGES_DIR] {
        let c = cstr(name).map_err(io_err(name))?;
        let created = create
            && match fsat::mkdir_at(&here, &c, 0o755) {
                Ok(()) => true,
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
                Err(e) => return Err(io_err(name)(e)),
            };
        if created {
            // Whatever the umask: the sandbox user must reach the packages (bwrap resolves
            // even a descriptor bind by its path, as that user).
            let fd = fsat::open_dir_at(&here, &c).map_err(io_err(name))?;
            fchmod(&fd, 0o755).map_err(io_err(name))?;
        }
        match fsat::open_at(&here, &c, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
            Ok(fd) => here = fd,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                return Err(integrity(format!("{name} is not a directory (a symbolic link?)")));
            }
            Err(e) => return Err(io_err(name)(e)),
        }
        path.push(name);
    }
    Ok(Some((path, here)))
}

/// The published package `id` (already checked to be 64 hex), verified: `None` when absent.
/// Returns its canonical root and an `O_PATH` descriptor of exactly the directory verified.
pub fn lookup(data_dir: &Path, id: &str) -> Result<Option<(PathBuf, OwnedFd)>, StoreError> {
    let Some((dir_path, dir)) = open_packages_dir(data_dir, false)? else {
        return Ok(None);
    };
    let c = cstr(id).map_err(io_err("the package id"))?;
    let root = match fsat::open_at(&dir, &c, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            return Err(integrity("the package is not a directory (a symbolic link?)"));
        }
        Err(e) => return Err(io_err("the package")(e)),
    };
    verify(&root, id)?;
    Ok(Some((dir_path.join(id), root)))
}

/// Publishes a checked bundle under its id; idempotent. Returns the canonical root.
pub fn publish(data_dir: &Path, bundle: &Bundle) -> Result<PathBuf, StoreError> {
    let id = bundle::bundle_id(&bundle.skills);
    if let Some((root, _)) = lookup(data_dir, &id)? {
        return Ok(root);
    }
    let (dir_path, dir) = open_packages_dir(data_dir, true)?
        .ok_or_else(|| io_err("the packages directory")(io::Error::from_raw_os_error(libc::ENOENT)))?;
    let staging = format!("{STAGING_PREFIX}{}", new_uuid_v4());
    let staging_c = cstr(&staging).map_err(io_err("staging"))?;
    fsat::mkdir_at(&dir, &staging_c, 0o700).map_err(io_err("a staging directory"))?;
    let written = write_package(&dir, &staging_c, bundle);
    let published = written.and_then(|()| {
        let id_c = cstr(&id).map_err(io_err("the package id"))?;
        rename_noreplace(&dir, &staging_c, &id_c).map_err(io_err("publishing the package"))
    });
    match published {
        Ok(true) => {
            // The rename is durable once the directory holding both names is synced.
            let _ = fsat::sync_dir(&dir);
            tracing::info!(event = "skill_package_published", id = %id, skills = bundle.skills.len());
            Ok(dir_path.join(&id))
        }
        Ok(false) => {
            // Another post of the same bundle won: answer with its package, verified.
            let _ = remove_tree_at(&dir, &staging_c);
            lookup(data_dir, &id)?
                .map(|(root, _)| root)
                .ok_or_else(|| integrity("the package vanished while it was published"))
        }
        Err(e) => {
            let _ = remove_tree_at(&dir, &staging_c);
            Err(e)
        }
    }
}

/// A package withdrawn by [`withdraw`]: no longer under its id, not yet removed.
#[derive(Debug)]
pub struct Withdrawn {
    dir: OwnedFd,
    name: CString,
}

/// Withdraws the published package `id` (already checked to be 64 hex): one rename to a
/// staging name, so from then on no lookup finds it and no execution can mount it; `None`
/// when it is not published. [`discard`] removes what was withdrawn (and an interrupted
/// removal is swept at the next start, as an interrupted publication is).
pub fn withdraw(data_dir: &Path, id: &str) -> Result<Option<Withdrawn>, StoreError> {
    let Some((_, dir)) = open_packages_dir(data_dir, false)? else {
        return Ok(None);
    };
    let from = cstr(id).map_err(io_err("the package id"))?;
    let name = cstr(&format!("{STAGING_PREFIX}{}", new_uuid_v4())).map_err(io_err("staging"))?;
    match fsat::rename_noreplace_at(&dir, &from, &name) {
        Ok(()) => Ok(Some(Withdrawn { dir, name })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(io_err("withdrawing the package")(e)),
    }
}

/// Removes a withdrawn package, by descriptor, nothing followed; the removal is durable
/// once the packages directory is synced.
pub fn discard(withdrawn: Withdrawn) -> Result<(), StoreError> {
    remove_tree_at(&withdrawn.dir, &withdrawn.name).map_err(io_err("removing the package"))?;
    let _ = fsat::sync_dir(&withdrawn.dir);
    Ok(())
}

/// `true` when renamed, `false` when `to` already exists.
fn rename_noreplace(dir: &OwnedFd, from: &CStr, to: &CStr) -> io::Result<bool> {
    match fsat::rename_noreplace_at(dir, from, to) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

fn write_package(dir: &OwnedFd, staging: &CStr, bundle: &Bundle) -> Result<(), StoreError> {
    let root = fsat::open_dir_at(dir, staging).map_err(io_err("the staging directory"))?;
    for skill in &bundle.skills {
        let c = cstr(&skill.id).map_err(io_err("a skill id"))?;
        fsat::mkdir_at(&root, &c, 0o755).map_err(io_err(format!("skill {}", skill.id)))?;
        let skill_dir = fsat::open_dir_at(&root, &c).map_err(io_err(format!("skill {}", skill.id)))?;
        fchmod(&skill_dir, 0o755).map_err(io_err(format!("skill {}", skill.id)))?;
        for f in &skill.files {
            write_file(&skill_dir, &f.path, f.content.as_deref().unwrap_or_default())
                .map_err(io_err(format!("{}/{}", skill.id, f.path)))?;
        }
    }
    let manifest = bundle::manifest(bundle).to_string();
    let m = fsat::create_new_at(&root, &cstr(MANIFEST).map_err(io_err("the manifest"))?, 0o644)
        .map_err(io_err("the manifest"))?;
    fchmod(&m, 0o644).map_err(io_err("the manifest"))?;
    let mut m = std::fs::File::from(m);
    m.write_all(manifest.as_bytes()).and_then(|()| m.sync_all()).map_err(io_err("the manifest"))?;
    fchmod(&root, 0o755).map_err(io_err("the staging directory"))?;
    std::fs::File::from(root).sync_all().map_err(io_err("the staging directory"))
}

/// Writes `rel` (checked by [`bundle::path_segments`]) below `dir`, creating its
/// directories; nothing is followed and nothing existing is reused as a file.
fn write_file(dir: &OwnedFd, rel: &str, bytes: &[u8]) -> io::Result<()> {
    let segments = bundle::path_segments(rel).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let (last, parents) = segments.split_last().ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut here = fsat::dup(dir)?;
    for p in parents {
        let c = cstr(p)?;
        let created = match fsat::mkdir_at(&here, &c, 0o755) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
            Err(e) => return Err(e),
        };
        here = fsat::open_dir_at(&here, &c)?;
        if created {
            fchmod(&here, 0o755)?;
        }
    }
    // Modes set explicitly (never the umask's): readable by the sandbox user, writable by
    // no one else.
    let fd = fsat::create_new_at(&here, &cstr(last)?, 0o644)?;
    fchmod(&fd, 0o644)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes)?;
    f.sync_all()
}

fn fchmod(fd: &OwnedFd, mode: libc::mode_t) -> io::Result<()> {
    // SAFETY: fchmod on a descriptor we own.
    common::sys::cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode) }).map(drop)
}

/// Removes a staging directory tree below `dir` by descriptor; best effort.
fn remove_tree_at(dir: &OwnedFd, name: &CStr) -> io::Result<()> {
    fsat::remove_tree_at(dir, name)
}

/// Removes staging directories an interrupted post left (called once at start-up).
pub fn sweep_staging(data_dir: &Path) {
    let Ok(Some((_, dir))) = open_packages_dir(data_dir, false) else { return };
    let Ok(names) = fsat::names(&dir) else { return };
    for (name, c) in names {
        if name.as_bytes().starts_with(STAGING_PREFIX.as_bytes()) {
            let removed = remove_tree_at(&dir, &c);
            tracing::info!(event = "skill_staging_swept", name = %name.to_string_lossy(), ok = removed.is_ok());
        }
    }
}

fn read_regular(dir: &OwnedFd, name: &CStr, limit: u64) -> Result<Vec<u8>, StoreError> {
    let shown = name.to_string_lossy().into_owned();
    let fd = match fsat::open_at(dir, name, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(integrity(format!("{shown:?} is a symbolic link")));
        }
        Err(e) => return Err(io_err(shown)(e)),
    };
    let st = Stat::of_fd(&fd).map_err(io_err(shown.clone()))?;
    if st.kind() != libc::S_IFREG {
        return Err(integrity(format!("{shown:?} is not a regular file")));
    }
    if st.mode & 0o022 != 0 {
        return Err(integrity(format!("{shown:?} is writable by others")));
    }
    if st.size > limit {
        return Err(integrity(format!("{shown:?} is larger than recorded")));
    }
    let mut bytes = Vec::with_capacity(st.size as usize);
    std::fs::File::from(fd).take(limit + 1).read_to_end(&mut bytes).map_err(io_err(shown))?;
    Ok(bytes)
}

/// Lists every regular file below `dir` as `rel path -> size`; anything else (a link, a
/// device, a FIFO) is an integrity failure, and so is a directory others may write.
fn list(dir: &OwnedFd, prefix: &str, out: &mut BTreeMap<String, u64>) -> Result<(), StoreError> {
    let st = Stat::of_fd(dir).map_err(io_err(prefix.to_owned()))?;
    if st.mode & 0o022 != 0 {
        return Err(integrity(format!("{prefix:?} is writable by others")));
    }
    for (name, c) in fsat::names(dir).map_err(io_err(prefix.to_owned()))? {
        let name =
            name.to_str().ok_or_else(|| integrity(format!("{prefix:?} holds a name that is not UTF-8")))?;
        let rel = if prefix.is_empty() { name.to_owned() } else { format!("{prefix}/{name}") };
        let st = Stat::at(dir, &c).map_err(io_err(rel.clone()))?;
        match st.kind() {
            libc::S_IFDIR => {
                let sub = fsat::open_dir_at(dir, &c).map_err(io_err(rel.clone()))?;
                list(&sub, &rel, out)?;
            }
            libc::S_IFREG => {
                out.insert(rel, st.size);
            }
            libc::S_IFLNK => return Err(integrity(format!("{rel:?} is a symbolic link"))),
            _ => return Err(integrity(format!("{rel:?} is not a regular file"))),
        }
    }
    Ok(())
}

/// Streams the file `rel` below `dir` (no link followed on the way) into `package`, and
/// returns its sha256 and length. Memory stays constant whatever the package's size.
fn hash_file(dir: &OwnedFd, rel: &str, package: &mut Sha256) -> Result<(String, u64), StoreError> {
    let segments =
        bundle::path_segments(rel).map_err(|_| integrity(format!("{rel:?} is not a valid path")))?;
    let (last, parents) = segments.split_last().ok_or_else(|| integrity("an empty path"))?;
    let mut here = fsat::dup(dir).map_err(io_err(rel.to_owned()))?;
    for p in parents {
        let c = cstr(p).map_err(io_err(rel.to_owned()))?;
        here = fsat::open_dir_at(&here, &c)
            .map_err(|_| integrity(format!("{rel:?} changed while it was verified")))?;
    }
    let c = cstr(last).map_err(io_err(rel.to_owned()))?;
    let fd = match fsat::open_at(&here, &c, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(integrity(format!("{rel:?} is a symbolic link")));
        }
        Err(e) => return Err(io_err(rel.to_owned())(e)),
    };
    let st = Stat::of_fd(&fd).map_err(io_err(rel.to_owned()))?;
    if st.kind() != libc::S_IFREG {
        return Err(integrity(format!("{rel:?} is not a regular file")));
    }
    if st.mode & 0o022 != 0 {
        return Err(integrity(format!("{rel:?} is writable by others")));
    }
    let mut file = std::fs::File::from(fd);
    let mut own = Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_err(rel.to_owned()))?;
        if n == 0 {
            break;
        }
        own.update(&buf[..n]);
        package.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hex(&own.finalize()), total))
}

/// Verifies the package under `root` (`O_PATH` or readable) against its id in full: the
/// manifest hashes to the id, the entries are exactly the manifest's (no extra file, no
/// link), and every byte hashes to the manifest's file and package hashes.
pub fn verify(root: &OwnedFd, id: &str) -> Result<(), StoreError> {
    let root =
        fsat::open_at(root, c".", libc::O_RDONLY | libc::O_DIRECTORY).map_err(io_err("the package"))?;
    let st = Stat::of_fd(&root).map_err(io_err("the package"))?;
    if st.mode & 0o022 != 0 {
        return Err(integrity("the package directory is writable by others"));
    }
    let text = read_regular(&root, &cstr(MANIFEST).map_err(io_err("the manifest"))?, MAX_MANIFEST_BYTES)?;
    let value: Value = serde_json::from_slice(&text).map_err(|_| integrity("the manifest is not JSON"))?;
    let manifest = bundle::parse(&value, Content::OnDisk).map_err(StoreError::Manifest)?;
    if bundle::bundle_id(&manifest.skills) != id {
        return Err(integrity("the manifest does not hash to the package id"));
    }
    let mut expected: Vec<String> = manifest.skills.iter().map(|s| s.id.clone()).collect();
    expected.push(MANIFEST.to_owned());
    let mut present: Vec<String> = fsat::names(&root)
        .map_err(io_err("the package"))?
        .into_iter()
        .map(|(n, _)| n.to_string_lossy().into_owned())
        .collect();
    expected.sort();
    present.sort();
    if expected != present {
        return Err(integrity("the package holds entries its manifest does not list, or lacks some"));
    }
    for skill in &manifest.skills {
        let c = cstr(&skill.id).map_err(io_err("a skill id"))?;
        let dir = match fsat::open_dir_at(&root, &c) {
            Ok(d) => d,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
                return Err(integrity(format!("skill {:?} is not a directory", skill.id)));
            }
            Err(e) => return Err(io_err(skill.id.clone())(e)),
        };
        let mut found = BTreeMap::new();
        list(&dir, "", &mut found)?;
        let listed = found.len() == skill.files.len()
            && skill.files.iter().all(|f| found.get(&f.path) == Some(&f.size));
        if !listed {
            return Err(integrity(format!(
                "skill {:?} holds files its manifest does not list, lacks some, or one changed size",
                skill.id
            )));
        }
        // `skill.files` is in the package hash's order (JavaScript's, by path).
        let mut package = Sha256::new();
        for f in &skill.files {
            package.update(bundle::frame(&f.path, f.size).as_bytes());
            let (hash, size) = hash_file(&dir, &f.path, &mut package)?;
            if size != f.size || hash != f.hash {
                return Err(integrity(format!(
                    "skill {:?}: {:?} changed after publication",
                    skill.id, f.path
                )));
            }
        }
        if hex(&package.finalize()) != skill.hash {
            return Err(integrity(format!(
                "skill {:?}: the package hash does not match its files",
                skill.id
            )));
        }
    }
    Ok(())
}
