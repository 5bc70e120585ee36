//! The two blob pools and the record envelope on top of them (§1, §2.3 of the format).
//!
//! Blobs are immutable: they are published by hard-linking a fully written and fsynced temp
//! file to the digest name, so an existing object is never replaced, only verified.

use std::collections::HashSet;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::names::{hex, new_uuid_v4};
use super::snapshot::FileCache;
use super::{OCTET_STREAM, Pool, RECORD_MEDIA_TYPE, Ref, VersionError, io_err, jcs};

/// `oci-layout` of each pool, exactly (30 bytes, no newline).
pub const OCI_LAYOUT: &[u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;
/// `index.json` of each pool, exactly (34 bytes, unsorted keys, never updated).
pub const OCI_INDEX: &[u8] = br#"{"schemaVersion":2,"manifests":[]}"#;

const CHUNK: usize = 64 * 1024;

/// The version store under `<dataDir>/versioning`. Send + Sync: share it behind an `Arc`.
pub struct Store {
    data_dir: PathBuf,
    root: PathBuf,
    /// Snapshot's (dev, ino) → content cache; see [`crate::versioning::snapshot`].
    pub(crate) cache: FileCache,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("root", &self.root).finish_non_exhaustive()
    }
}

/// A decoded record: what `readRecord` returns after all its checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub kind: String,
    pub value: Value,
    pub dependencies: Vec<Ref>,
}

impl Store {
    /// Opens (and on first use initialises) `<data_dir>/versioning` exactly as the original:
    /// for data then agent-state, `mkdir -p blobs/sha256`, publish `oci-layout` and
    /// `index.json`, fsync `blobs/` and the pool root; then fsync `versioning/` and `data_dir`.
    /// Idempotent; fails with `Corrupt immutable object` if a layout file has other bytes.
    pub fn open(data_dir: &Path) -> Result<Store, VersionError> {
        // Lexical only (no realpath), like the original's path.join.
        let data_dir =
            std::path::absolute(data_dir).map_err(io_err("resolve the data directory", data_dir))?;
        let root = data_dir.join("versioning");
        let store = Store { data_dir, root, cache: FileCache::default() };
        for pool in [Pool::Data, Pool::AgentState] {
            let pool_dir = store.root.join(pool.as_str());
            let blobs = store.blob_dir(pool);
            fs::create_dir_all(&blobs).map_err(io_err("create the blob directory", &blobs))?;
            store.publish_bytes(&pool_dir.join("oci-layout"), OCI_LAYOUT)?;
            store.publish_bytes(&pool_dir.join("index.json"), OCI_INDEX)?;
            fsync_dir(&pool_dir.join("blobs"))?;
            fsync_dir(&pool_dir)?;
        }
        fsync_dir(&store.root)?;
        fsync_dir(&store.data_dir)?;
        Ok(store)
    }

    /// `<dataDir>/versioning`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The data directory the store was opened on (made absolute lexically).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// `<root>/<pool>/blobs/sha256`.
    pub fn blob_dir(&self, pool: Pool) -> PathBuf {
        self.root.join(pool.as_str()).join("blobs").join("sha256")
    }

    /// Where the blob with lowercase hex digest `hex` lives in `pool`.
    pub fn blob_path(&self, pool: Pool, hex: &str) -> PathBuf {
        self.blob_dir(pool).join(hex)
    }

    /// The read-only legacy `CasStore` location `<dataDir>/cas/sha256/<2 hex>/<hex>`.
    fn legacy_path(&self, hex: &str) -> PathBuf {
        self.data_dir.join("cas").join("sha256").join(&hex[..2]).join(hex)
    }

    /// Stores an in-memory buffer (the original's `put`).
    pub fn put(&self, pool: Pool, bytes: &[u8], media_type: &str) -> Result<Ref, VersionError> {
        if media_type.is_empty() {
            return Err(VersionError::InvalidRef);
        }
        let hex = hex(&Sha256::digest(bytes));
        self.publish_bytes(&self.blob_path(pool, &hex), bytes)?;
        Ok(Ref::new(pool, &hex, bytes.len() as u64, media_type))
    }

    /// Atomic no-clobber write of a buffer: temp `<final>.<uuid>.tmp` (0600, O_EXCL), fsync,
    /// hard link, verify on EEXIST, fsync the directory, always remove the temp.
    fn publish_bytes(&self, final_path: &Path, bytes: &[u8]) -> Result<(), VersionError> {
        let dir = final_path.parent().expect("object paths have a parent directory");
        fs::create_dir_all(dir).map_err(io_err("create the directory", dir))?;
        let mut tmp = final_path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", new_uuid_v4()));
        let tmp = TempFile(PathBuf::from(tmp));
        let mut file = create_exclusive(&tmp.0)?;
        file.write_all(bytes).map_err(io_err("write the temporary object", &tmp.0))?;
        file.sync_all().map_err(io_err("fsync the temporary object", &tmp.0))?;
        drop(file);
        match fs::hard_link(&tmp.0, final_path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let existing =
                    fs::read(final_path).map_err(io_err("read the existing object", final_path))?;
                if existing != bytes {
                    return Err(VersionError::Corrupt { path: final_path.to_path_buf() });
                }
            }
            Err(e) => return Err(io_err("publish the object", final_path)(e)),
        }
        fsync_dir(dir)
    }

    /// Streams content into `pool` without buffering it whole (the original's `putStream`);
    /// the ref's mediaType is always `application/octet-stream`.
    pub fn put_stream(&self, pool: Pool, reader: &mut dyn Read) -> Result<Ref, VersionError> {
        let dir = self.blob_dir(pool);
        let tmp = TempFile(dir.join(format!("{}.tmp", new_uuid_v4())));
        let mut file = create_exclusive(&tmp.0)?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err("read the content being stored into", &tmp.0)(e)),
            };
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n]).map_err(io_err("write the temporary object", &tmp.0))?;
            size += n as u64;
        }
        file.sync_all().map_err(io_err("fsync the temporary object", &tmp.0))?;
        drop(file);
        let hex = hex(&hasher.finalize());
        let final_path = dir.join(&hex);
        match fs::hard_link(&tmp.0, &final_path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let file =
                    File::open(&final_path).map_err(io_err("open the existing object", &final_path))?;
                let mut check = VerifiedReader::new(file, &final_path, size, &hex);
                io::copy(&mut check, &mut io::sink()).map_err(|e| integrity_or_io(e, &final_path))?;
            }
            Err(e) => return Err(io_err("publish the object", &final_path)(e)),
        }
        fsync_dir(&dir)?;
        Ok(Ref::new(pool, &hex, size, OCTET_STREAM))
    }

    /// Opens the blob of `r`: its own pool, then the other pool, then the legacy store.
    fn locate(&self, r: &Ref) -> Result<(File, PathBuf), VersionError> {
        r.validate()?;
        let hex = r.hex();
        for path in [self.blob_path(r.pool, hex), self.blob_path(r.pool.other(), hex), self.legacy_path(hex)]
        {
            match File::open(&path) {
                Ok(file) => return Ok((file, path)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("open the object", &path)(e)),
            }
        }
        Err(VersionError::Missing { digest: r.digest.clone(), pool: r.pool.as_str() })
    }

    /// The verified content of `r` (size and digest checked, else `Object integrity failure`).
    pub fn read(&self, r: &Ref) -> Result<Vec<u8>, VersionError> {
        let mut reader = self.open_reader(r)?;
        let mut bytes = Vec::with_capacity(r.size as usize);
        reader.read_to_end(&mut bytes).map_err(|e| integrity_or_io(e, &reader.path))?;
        Ok(bytes)
    }

    /// A streaming reader of `r` that fails with `InvalidData` ("Object integrity failure") at
    /// EOF, before reporting the end, if the size or digest is wrong. A size mismatch on disk
    /// is reported here already.
    pub fn open_reader(&self, r: &Ref) -> Result<VerifiedReader, VersionError> {
        let (file, path) = self.locate(r)?;
        let len = file.metadata().map_err(io_err("stat the object", &path))?.len();
        if len != r.size {
            return Err(VersionError::Integrity);
        }
        Ok(VerifiedReader::new(file, &path, r.size, r.hex()))
    }

    /// Cheap presence check: a file of the right size in the ref's own pool (content is not
    /// re-hashed; reads verify).
    pub fn has(&self, r: &Ref) -> bool {
        r.validate().is_ok()
            && fs::symlink_metadata(self.blob_path(r.pool, r.hex()))
                .is_ok_and(|m| m.is_file() && m.len() == r.size)
    }

    /// Stores `{schemaVersion:1, kind, value, dependencies}` as JCS in agent-state, with the
    /// refs embedded in `value` as its de-duplicated, sorted dependencies.
    pub fn put_record(&self, kind: &str, value: Value) -> Result<Ref, VersionError> {
        let mut found = Vec::new();
        collect_refs(&value, &mut found)?;
        let mut deps: Vec<(String, Ref)> = found.into_iter().map(|r| (r.jcs(), r)).collect();
        deps.sort_by(|a, b| jcs::cmp_utf16(&a.0, &b.0));
        deps.dedup_by(|a, b| a.0 == b.0);
        let mut envelope = Map::new();
        envelope.insert("schemaVersion".into(), Value::from(1));
        envelope.insert("kind".into(), Value::from(kind));
        envelope.insert("value".into(), value);
        envelope
            .insert("dependencies".into(), Value::Array(deps.iter().map(|(_, r)| r.to_value()).collect()));
        let text = jcs::canonicalize(&Value::Object(envelope))?;
        self.put(Pool::AgentState, text.as_bytes(), RECORD_MEDIA_TYPE)
    }

    /// Reads a record with every check the original's `readRecord` makes, so whatever passes
    /// here passes in the API too.
    pub fn read_record(&self, r: &Ref, expected_kind: Option<&str>) -> Result<Record, VersionError> {
        if r.pool != Pool::AgentState || !r.is_record() {
            return Err(VersionError::InvalidRef);
        }
        let bytes = self.read(r)?;
        let parsed: Value = serde_json::from_slice(&bytes).map_err(|e| {
            if e.to_string().contains("surrogate") {
                VersionError::LoneSurrogate
            } else {
                VersionError::Schema
            }
        })?;
        let obj = parsed.as_object().ok_or(VersionError::Schema)?;
        if obj.get("schemaVersion") != Some(&Value::from(1)) {
            return Err(VersionError::Schema);
        }
        let kind = obj.get("kind").and_then(Value::as_str).ok_or(VersionError::Schema)?;
        let deps = obj.get("dependencies").and_then(Value::as_array).ok_or(VersionError::Schema)?;
        if let Some(expected) = expected_kind.filter(|expected| *expected != kind) {
            return Err(VersionError::KindMismatch {
                expected: expected.to_string(),
                found: kind.to_string(),
            });
        }
        if jcs::canonicalize(&parsed)?.as_bytes() != bytes.as_slice() {
            return Err(VersionError::Schema);
        }
        let dependencies = deps.iter().map(Ref::from_value).collect::<Result<Vec<_>, _>>()?;
        let declared: HashSet<String> = dependencies.iter().map(Ref::jcs).collect();
        let value = obj.get("value").cloned().unwrap_or(Value::Null);
        let mut embedded = Vec::new();
        collect_refs(&value, &mut embedded)?;
        if embedded.iter().any(|r| !declared.contains(&r.jcs())) {
            return Err(VersionError::UndeclaredDependency);
        }
        Ok(Record { kind: kind.to_string(), value, dependencies })
    }

    /// Verifies everything reachable from `root` (records with all reader checks, other blobs
    /// re-hashed) and returns the number of distinct objects. Runs before every ref commit.
    pub fn validate_closure(&self, root: &Ref) -> Result<usize, VersionError> {
        let mut seen = HashSet::new();
        let mut queue = vec![root.clone()];
        while let Some(r) = queue.pop() {
            if !seen.insert(r.jcs()) {
                continue;
            }
            if r.is_record() {
                if r.pool != Pool::AgentState {
                    return Err(VersionError::InvalidRef);
                }
                queue.extend(self.read_record(&r, None)?.dependencies);
            } else {
                let mut reader = self.open_reader(&r)?;
                io::copy(&mut reader, &mut io::sink()).map_err(|e| integrity_or_io(e, &reader.path))?;
            }
        }
        Ok(seen.len())
    }
}

/// The original's dependency scan: depth-first through objects and arrays; an object with both
/// `pool` and `digest` is a ref (validated, not descended into).
pub(crate) fn collect_refs(v: &Value, out: &mut Vec<Ref>) -> Result<(), VersionError> {
    match v {
        Value::Object(map) if map.contains_key("pool") && map.contains_key("digest") => {
            out.push(Ref::from_value(v)?);
        }
        Value::Object(map) => {
            for item in map.values() {
                collect_refs(item, out)?;
            }
        }
        Value::Array(items) => {
            for item in items {
                collect_refs(item, out)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// A blob reader that checks size and digest as it streams; see [`Store::open_reader`].
pub struct VerifiedReader {
    file: File,
    path: PathBuf,
    hasher: Sha256,
    expected_size: u64,
    expected_hex: String,
    seen: u64,
    state: ReaderState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReaderState {
    Reading,
    Verified,
    Failed,
}

impl fmt::Debug for VerifiedReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerifiedReader")
            .field("path", &self.path)
            .field("expected_size", &self.expected_size)
            .field("seen", &self.seen)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl VerifiedReader {
    fn new(file: File, path: &Path, expected_size: u64, expected_hex: &str) -> VerifiedReader {
        VerifiedReader {
            file,
            path: path.to_path_buf(),
            hasher: Sha256::new(),
            expected_size,
            expected_hex: expected_hex.to_string(),
            seen: 0,
            state: ReaderState::Reading,
        }
    }

    /// The content length the ref promises (e.g. for `Content-Length`).
    pub fn size(&self) -> u64 {
        self.expected_size
    }

    fn fail(&mut self) -> io::Error {
        self.state = ReaderState::Failed;
        io::Error::new(io::ErrorKind::InvalidData, VersionError::Integrity)
    }
}

impl Read for VerifiedReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.state {
            ReaderState::Verified => return Ok(0),
            ReaderState::Failed => return Err(self.fail()),
            ReaderState::Reading if buf.is_empty() => return Ok(0),
            ReaderState::Reading => {}
        }
        let n = self.file.read(buf)?;
        if n > 0 {
            self.seen += n as u64;
            if self.seen > self.expected_size {
                return Err(self.fail());
            }
            self.hasher.update(&buf[..n]);
            return Ok(n);
        }
        let digest = hex(&self.hasher.finalize_reset());
        if self.seen != self.expected_size || digest != self.expected_hex {
            return Err(self.fail());
        }
        self.state = ReaderState::Verified;
        Ok(0)
    }
}

/// Turns a [`VerifiedReader`] error back into `Object integrity failure` or an I/O error.
fn integrity_or_io(e: io::Error, path: &Path) -> VersionError {
    if e.get_ref().is_some_and(|inner| matches!(inner.downcast_ref(), Some(VersionError::Integrity))) {
        VersionError::Integrity
    } else {
        io_err("read the object", path)(e)
    }
}

/// A temp file that is always removed when dropped (the original's `finally`), ENOENT ignored.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// `open(path, O_CREAT|O_EXCL|O_WRONLY, 0600)`.
fn create_exclusive(path: &Path) -> Result<File, VersionError> {
    OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io_err("create", path))
}

/// `open(dir, O_RDONLY|O_DIRECTORY)` + `fsync`, so new names survive a crash.
pub(crate) fn fsync_dir(dir: &Path) -> Result<(), VersionError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(dir)
        .map_err(io_err("open the directory for fsync", dir))?;
    file.sync_all().map_err(io_err("fsync the directory", dir))
}
