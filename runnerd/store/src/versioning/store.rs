//! The two blob pools and the record envelope on top of them (§1, §2.3 of the format).
//!
//! Blobs are immutable: they are published by hard-linking a fully written and fsynced temp
//! file to the digest name, so an existing object is never replaced, only verified.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::names::{hex, new_uuid_v4};
use super::snapshot::FileCache;
use super::{MAX_RECORD_BYTES, OCTET_STREAM, Pool, RECORD_MEDIA_TYPE, Ref, VersionError, io_err, jcs};

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
    /// Blob files whose bytes this process hashed (while writing them, or verifying them),
    /// with their identity and times then. `validate_closure` does not re-hash a blob whose
    /// file is unchanged since: any write to it changes its ctime, which userspace cannot
    /// set back. This is what keeps a commit after a small change at the cost of a walk.
    verified: Mutex<HashMap<DigestKey, BlobStamp, DigestHasher>>,
    verified_hashes: AtomicU64,
    /// Blob directories with entries not yet fsynced. The original fsyncs the directory
    /// after every object; we fsync each directory once, before any ref that can reach its
    /// objects is committed ([`Store::sync_pending`]) — the same guarantee for everything
    /// reachable, without one flush per file (a 10,000-file commit paid 10,000). Each
    /// directory has a count of the entries deferred to it: see [`Store::sync_pending`].
    pending_dirs: Mutex<HashMap<PathBuf, u64>>,
    /// The dependencies of record blobs read (or written) by this process, valid while the
    /// blob's entry in `verified` matches its file: closure checks then walk the graph with
    /// one stat per record instead of a read, a parse and a re-canonicalisation.
    record_deps: Mutex<HashMap<DigestKey, Vec<Ref>, DigestHasher>>,
    /// Refs held in `record_deps` (an upper bound: replaced entries are not subtracted).
    deps_held: std::sync::atomic::AtomicUsize,
    /// Records whose whole closure a commit of this process validated (issue #31): the
    /// closure check of a commit that reused a workspace's unchanged directories stops at
    /// them, so it costs what changed, not one stat per file. The collector empties it
    /// whenever it deletes ([`Store::forget_objects`]); an object deleted behind runnerd's
    /// back is still found when it is read (every read verifies), and by every full check
    /// (other routes' commits, and these at least every [`FULL_CLOSURE_EVERY`]).
    closures: Mutex<HashSet<DigestKey, DigestHasher>>,
    /// Bumped by [`Store::forget_caches`]: a check that began before it adds nothing to
    /// `closures` (what it trusted may be what went missing).
    closures_generation: AtomicU64,
    /// When a check last stat'ed everything: a commit that trusts `closures` checks
    /// everything again past [`FULL_CLOSURE_EVERY`], so an object deleted behind runnerd's
    /// back is found (and restored by the retry's fresh snapshot) within that time.
    last_full_closure: Mutex<Option<std::time::Instant>>,
    /// `blobs/sha256` of each pool, opened once: objects are stat'ed relative to it.
    blob_dir_fds: [std::sync::OnceLock<std::os::fd::OwnedFd>; 2],
    /// Held shared by every commit attempt from its snapshot to its ref, and exclusively by
    /// the collector while it deletes ([`super::gc`]): nothing an attempt found stored is
    /// deleted before its ref roots it, and what was deleted is forgotten before the next.
    collecting: std::sync::RwLock<()>,
}

/// Validated closures remembered at most ([`Store::closures`]); past it they are forgotten
/// wholesale and the next commits check everything once more.
const CLOSURES_HELD: usize = 1_000_000;

/// How long a commit that trusts validated closures goes without checking everything.
const FULL_CLOSURE_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

/// (dev, ino, size, mtime ns, ctime ns) of a blob file.
type BlobStamp = (u64, u64, u64, i128, i128);

/// An object's identity in the in-memory caches: its pool and raw digest.
pub(crate) type DigestKey = (Pool, [u8; 32]);

pub(crate) fn digest_key(pool: Pool, hex: &str) -> DigestKey {
    let mut raw = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).take(32).enumerate() {
        let nib = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
        raw[i] = nib(pair[0]) << 4 | nib(pair.get(1).copied().unwrap_or(b'0'));
    }
    (pool, raw)
}

/// Hashes digest keys cheaply: SHA-256 output is already uniform, so 8 of its bytes, mixed
/// with a per-process secret (a crafted partial collision cannot target our buckets), do.
#[derive(Clone)]
struct DigestHasher {
    secret: u64,
}

impl Default for DigestHasher {
    fn default() -> Self {
        static SECRET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let secret = *SECRET.get_or_init(|| {
            let mut b = [0u8; 8];
            let _ = getrandom::fill(&mut b);
            u64::from_le_bytes(b) | 1
        });
        DigestHasher { secret }
    }
}

impl std::hash::BuildHasher for DigestHasher {
    type Hasher = DigestState;
    fn build_hasher(&self) -> DigestState {
        DigestState { secret: self.secret, h: 0 }
    }
}

struct DigestState {
    secret: u64,
    h: u64,
}

impl std::hash::Hasher for DigestState {
    fn write(&mut self, bytes: &[u8]) {
        let mut word = [0u8; 8];
        let n = bytes.len().min(8);
        word[..n].copy_from_slice(&bytes[..n]);
        self.h = (self.h ^ u64::from_le_bytes(word) ^ self.secret)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29);
    }
    fn finish(&self) -> u64 {
        self.h
    }
}

/// Beyond this many dependency refs in all (~75 MB), the dependency map starts over.
const DEPS_LIMIT: usize = 500_000;

/// Beyond this many entries the verified set starts over (memory stays bounded).
const VERIFIED_LIMIT: usize = 2_000_000;

fn blob_stamp(m: &fs::Metadata) -> BlobStamp {
    use std::os::unix::fs::MetadataExt;
    let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
    (m.dev(), m.ino(), m.len(), ns(m.mtime(), m.mtime_nsec()), ns(m.ctime(), m.ctime_nsec()))
}

fn raw_stamp(st: &libc::stat) -> BlobStamp {
    let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
    (
        st.st_dev,
        st.st_ino,
        st.st_size as u64,
        ns(st.st_mtime, st.st_mtime_nsec),
        ns(st.st_ctime, st.st_ctime_nsec),
    )
}

/// Whether a stamp's last change (ctime) is old enough (2 s) that a later write would move it.
fn stamp_settled(stamp: &BlobStamp) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    stamp.4 + 2_000_000_000 < now
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
        let root = data_dir.join(common::layout::VERSIONING);
        let store = Store {
            data_dir,
            root,
            cache: FileCache::default(),
            verified: Mutex::default(),
            verified_hashes: AtomicU64::new(0),
            pending_dirs: Mutex::default(),
            record_deps: Mutex::default(),
            deps_held: std::sync::atomic::AtomicUsize::new(0),
            closures: Mutex::default(),
            closures_generation: AtomicU64::new(0),
            last_full_closure: Mutex::default(),
            blob_dir_fds: Default::default(),
            collecting: std::sync::RwLock::new(()),
        };
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

    /// Start-up: removes the temporaries a crashed commit left in each pool's `blobs/sha256`
    /// and pool directory (see [`super::sweep`] for which).
    pub fn sweep_temporaries(&self) -> usize {
        [Pool::Data, Pool::AgentState]
            .iter()
            .map(|&pool| {
                super::sweep::sweep_dir(&self.blob_dir(pool))
                    + super::sweep::sweep_dir(&self.root.join(pool.as_str()))
            })
            .sum()
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

    /// Whether the read-only legacy store holds `hex` (a regular file, not followed).
    pub(crate) fn in_legacy_store(&self, hex: &str) -> bool {
        hex.len() == 64 && fs::symlink_metadata(self.legacy_path(hex)).is_ok_and(|m| m.is_file())
    }

    /// Stores an in-memory buffer (the original's `put`).
    pub fn put(&self, pool: Pool, bytes: &[u8], media_type: &str) -> Result<Ref, VersionError> {
        if media_type.is_empty() {
            return Err(VersionError::InvalidRef);
        }
        let hex = hex(&Sha256::digest(bytes));
        if let Some(stamp) = self.publish_bytes(&self.blob_path(pool, &hex), bytes)? {
            // These are the bytes we computed, in our own 0600 file.
            self.remember_verified(pool, &hex, stamp);
        }
        Ok(Ref::new(pool, &hex, bytes.len() as u64, media_type))
    }

    /// Atomic no-clobber write of a buffer: temp `<final>.<uuid>.tmp` (0600, O_EXCL), fsync,
    /// hard link, verify on EEXIST, fsync the directory, always remove the temp.
    /// Returns the stamp of the object this call created ([`fresh_stamp`]), `None` if it
    /// was there already.
    fn publish_bytes(&self, final_path: &Path, bytes: &[u8]) -> Result<Option<BlobStamp>, VersionError> {
        let dir = final_path.parent().expect("object paths have a parent directory");
        // Already stored (the common case for unchanged directories' records): compare and
        // stop, without the temp file and its fsync. Same outcome as the link's EEXIST path.
        if let Some(existing) = read_existing(final_path)? {
            if existing != bytes {
                return Err(VersionError::Corrupt { path: final_path.to_path_buf() });
            }
            self.defer_dir_sync(dir);
            return Ok(None);
        }
        fs::create_dir_all(dir).map_err(io_err("create the directory", dir))?;
        let mut tmp = final_path.as_os_str().to_owned();
        tmp.push(format!(".{}{}", new_uuid_v4(), super::sweep::own_suffix()));
        let tmp = TempFile(PathBuf::from(tmp));
        let mut file = create_exclusive(&tmp.0)?;
        file.write_all(bytes).map_err(io_err("write the temporary object", &tmp.0))?;
        file.sync_all().map_err(io_err("fsync the temporary object", &tmp.0))?;
        let mut fresh = false;
        match fs::hard_link(&tmp.0, final_path) {
            Ok(()) => fresh = true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let existing = read_existing(final_path)?.ok_or_else(|| {
                    io_err("read the existing object", final_path)(io::ErrorKind::NotFound.into())
                })?;
                if existing != bytes {
                    return Err(VersionError::Corrupt { path: final_path.to_path_buf() });
                }
            }
            Err(e) => return Err(io_err("publish the object", final_path)(e)),
        }
        self.defer_dir_sync(dir);
        Ok(fresh.then(|| fresh_stamp(tmp, &file)).flatten())
    }

    /// Streams content into `pool` without buffering it whole (the original's `putStream`);
    /// the ref's mediaType is always `application/octet-stream`.
    pub fn put_stream(&self, pool: Pool, reader: &mut dyn Read) -> Result<Ref, VersionError> {
        let streamed = self.stream_temp(pool, reader)?;
        let r = Ref::new(pool, &streamed.hex, streamed.size, OCTET_STREAM);
        self.link_streamed(pool, streamed)?;
        Ok(r)
    }

    /// Stores the bytes of `reader` as the object `expected` names (its pool), published only
    /// when size and SHA-256 match: Ok(true) stored now, Ok(false) already present (and
    /// re-hashed). Reads at most `expected.size + 1` bytes, so a sender cannot stream without
    /// bound. A mismatch publishes nothing and says what arrived. For objects copied from
    /// another node, whose bytes are only trusted once they hash to the ref. A record over
    /// [`MAX_RECORD_BYTES`] is refused before anything is read: it could never be read back.
    pub fn put_verified(&self, expected: &Ref, reader: &mut dyn Read) -> Result<bool, VersionError> {
        let staged = self.stage_verified(expected, reader)?;
        self.link_streamed(staged.pool, staged.streamed)
    }

    /// [`Store::put_verified`] without its fsync and link: the object is checked and left in
    /// its temp file, to be published with others by [`Store::publish_staged`] after one
    /// `syncfs` (an object stream of many small files pays one flush, not one per object).
    /// A mismatch publishes nothing, as there.
    pub fn stage_verified(
        &self,
        expected: &Ref,
        reader: &mut dyn Read,
    ) -> Result<StagedObject, VersionError> {
        expected.validate()?;
        if expected.is_record() && expected.pool != Pool::AgentState {
            return Err(VersionError::InvalidRef);
        }
        if expected.is_record() {
            record_within_bound(expected)?;
        }
        let mut bounded = reader.take(expected.size.saturating_add(1));
        let streamed = self.stream_temp(expected.pool, &mut bounded)?;
        if streamed.size != expected.size || streamed.hex != expected.hex() {
            let arrived = if streamed.size > expected.size {
                format!("more than {} bytes", expected.size)
            } else {
                format!("{} bytes with digest sha256:{}", streamed.size, streamed.hex)
            };
            // The temp file goes with `streamed`.
            return Err(VersionError::Mismatch {
                digest: expected.digest.clone(),
                size: expected.size,
                arrived,
            });
        }
        Ok(StagedObject { pool: expected.pool, streamed })
    }

    /// Publishes staged objects: one `syncfs` of the store's filesystem makes all their bytes
    /// durable, then each is hard-linked to its digest name (an object already there is
    /// re-hashed, as in [`Store::put_verified`]). A linked object is durable, as after a
    /// single put. Answers (published now, already present).
    pub fn publish_staged(&self, staged: Vec<StagedObject>) -> Result<(u64, u64), VersionError> {
        let Some(first) = staged.first() else { return Ok((0, 0)) };
        // SAFETY: syncfs takes a descriptor this function borrows for the call; it writes nothing
        // through it.
        if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&first.streamed.file)) } != 0 {
            let path = first.streamed.tmp.0.clone();
            return Err(io_err("flush the staged objects (syncfs)", &path)(io::Error::last_os_error()));
        }
        let (mut stored, mut present) = (0, 0);
        for object in staged {
            if self.link_synced(object.pool, object.streamed)? {
                stored += 1;
            } else {
                present += 1;
            }
        }
        Ok((stored, present))
    }

    /// Writes `reader` into a new temp file of `pool`'s blob directory, hashing as it goes,
    /// with holes where the content has whole blocks of zeros: a sparse workspace file costs
    /// the store what it costs the workspace (issue #32). Not yet fsynced nor published.
    fn stream_temp(&self, pool: Pool, reader: &mut dyn Read) -> Result<Streamed, VersionError> {
        let dir = self.blob_dir(pool);
        let tmp = TempFile(dir.join(format!("{}{}", new_uuid_v4(), super::sweep::own_suffix())));
        let mut sparse = super::sparse::SparseWriter::new(create_exclusive(&tmp.0)?);
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
            sparse.write(&buf[..n]).map_err(io_err("write the temporary object", &tmp.0))?;
            size += n as u64;
        }
        let file = sparse.finish().map_err(io_err("write the temporary object", &tmp.0))?;
        Ok(Streamed { tmp, file, hex: hex(&hasher.finalize()), size })
    }

    /// Fsyncs a streamed temp file and hard-links it to its digest name; an object already
    /// there is re-hashed (a mismatch is `Object integrity failure`). Whether this call
    /// published it.
    fn link_streamed(&self, pool: Pool, streamed: Streamed) -> Result<bool, VersionError> {
        streamed.file.sync_all().map_err(io_err("fsync the temporary object", &streamed.tmp.0))?;
        self.link_synced(pool, streamed)
    }

    /// [`Store::link_streamed`] for a temp file whose bytes are durable already.
    fn link_synced(&self, pool: Pool, streamed: Streamed) -> Result<bool, VersionError> {
        let Streamed { tmp, file, hex, size } = streamed;
        let dir = self.blob_dir(pool);
        let final_path = dir.join(&hex);
        let mut fresh = false;
        match fs::hard_link(&tmp.0, &final_path) {
            Ok(()) => fresh = true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let file = open_regular(&final_path).map_err(|e| match planted(&e) {
                    true => VersionError::Corrupt { path: final_path.clone() },
                    false => io_err("open the existing object", &final_path)(e),
                })?;
                let mut check = VerifiedReader::new(file, &final_path, size, &hex);
                io::copy(&mut check, &mut io::sink()).map_err(|e| integrity_or_io(e, &final_path))?;
            }
            Err(e) => return Err(io_err("publish the object", &final_path)(e)),
        }
        self.defer_dir_sync(&dir);
        if let Some(stamp) = fresh.then(|| fresh_stamp(tmp, &file)).flatten() {
            // We hashed these bytes as we wrote them into our own 0600 file.
            self.remember_verified(pool, &hex, stamp);
        }
        Ok(fresh)
    }

    /// Opens the blob of `r`: its own pool, then the other pool, then the legacy store.
    fn locate(&self, r: &Ref) -> Result<(File, PathBuf), VersionError> {
        r.validate()?;
        let hex = r.hex();
        for path in [self.blob_path(r.pool, hex), self.blob_path(r.pool.other(), hex), self.legacy_path(hex)]
        {
            match open_regular(&path) {
                Ok(file) => return Ok((file, path)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                // Something other than a file of ours holds the object's name.
                Err(e) if planted(&e) => return Err(VersionError::Integrity),
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

    /// The bytes of `r`, read without hashing them again when this process hashed this very
    /// object since its last change (its stamp is the one remembered: a write moves ctime,
    /// which userspace cannot set back); through the verifying reader otherwise. For copies
    /// out of the store of what was just received or written.
    pub fn open_trusted(&self, r: &Ref) -> Result<Box<dyn Read + Send>, VersionError> {
        let (file, path) = self.locate(r)?;
        let meta = file.metadata().map_err(io_err("stat the object", &path))?;
        if meta.len() != r.size {
            return Err(VersionError::Integrity);
        }
        if self.is_verified(r.pool, r.hex(), &blob_stamp(&meta)) {
            return Ok(Box::new(file));
        }
        Ok(Box::new(VerifiedReader::new(file, &path, r.size, r.hex())))
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
        let r = self.put(Pool::AgentState, text.as_bytes(), RECORD_MEDIA_TYPE)?;
        let key = digest_key(Pool::AgentState, r.hex());
        if self.verified.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key) {
            self.remember_deps(key, deps.into_iter().map(|(_, d)| d).collect());
        }
        Ok(r)
    }

    /// Forgets every cached fact about files and objects (after an object went missing):
    /// the next snapshot re-reads and re-stores everything.
    pub fn forget_caches(&self) {
        self.cache.clear();
        self.verified.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.record_deps.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.deps_held.store(0, AtomicOrdering::Relaxed);
        self.closures.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.closures_generation.fetch_add(1, AtomicOrdering::SeqCst);
    }

    /// Held by a commit attempt from its snapshot until its ref is written
    /// ([`Store::collecting`]).
    pub(crate) fn commit_guard(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.collecting.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Held by the collector while it deletes: no commit attempt is in flight. Taken by
    /// polling for up to `patience` (a waiting writer would make every new commit wait
    /// behind the longest snapshot in flight); past it, waited for, so commits that never
    /// pause cannot keep the collector from ever deleting: new attempts then wait for the
    /// ones in flight to end. The flag says whether it had to wait.
    pub(crate) fn sweep_guard(
        &self,
        patience: std::time::Duration,
    ) -> (std::sync::RwLockWriteGuard<'_, ()>, bool) {
        let until = std::time::Instant::now() + patience;
        loop {
            match self.collecting.try_write() {
                Ok(guard) => return (guard, false),
                Err(std::sync::TryLockError::Poisoned(p)) => return (p.into_inner(), false),
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return (self.collecting.write().unwrap_or_else(|p| p.into_inner()), true);
                }
            }
        }
    }

    /// Forgets every cached fact about the objects the collector deleted (by raw digest,
    /// either pool): a snapshot that would have reused one stores it again, and the next
    /// closure check trusts no earlier one (what it trusted may be what went).
    pub(crate) fn forget_objects(&self, gone: &HashSet<[u8; 32]>) {
        if gone.is_empty() {
            return;
        }
        self.cache.forget(|r| gone.contains(&digest_key(r.pool, r.hex()).1));
        self.verified.lock().unwrap_or_else(|p| p.into_inner()).retain(|(_, raw), _| !gone.contains(raw));
        self.record_deps.lock().unwrap_or_else(|p| p.into_inner()).retain(|(_, raw), _| !gone.contains(raw));
        self.closures.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.closures_generation.fetch_add(1, AtomicOrdering::SeqCst);
    }

    /// Reads a record with every check the original's `readRecord` makes, so whatever passes
    /// here passes in the API too; a ref declaring more than [`MAX_RECORD_BYTES`] is refused
    /// before its size is allocated.
    pub fn read_record(&self, r: &Ref, expected_kind: Option<&str>) -> Result<Record, VersionError> {
        if r.pool != Pool::AgentState || !r.is_record() {
            return Err(VersionError::InvalidRef);
        }
        record_within_bound(r)?;
        let bytes = self.read(r)?;
        let parsed: Value = serde_json::from_slice(&bytes).map_err(json_error)?;
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
        self.validate_closure_within(root, false)
    }

    /// [`Store::validate_closure`], stopping at records whose whole closure a commit of this
    /// process validated ([`Store::closures`]): for a commit whose snapshot reused
    /// unchanged directories (issue #31). Returns the objects checked.
    pub fn validate_closure_since_validated(&self, root: &Ref) -> Result<usize, VersionError> {
        let due = self
            .last_full_closure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none_or(|at| at.elapsed() >= FULL_CLOSURE_EVERY);
        self.validate_closure_within(root, !due)
    }

    fn validate_closure_within(&self, root: &Ref, trust_validated: bool) -> Result<usize, VersionError> {
        let generation = self.closures_generation.load(AtomicOrdering::SeqCst);
        let started = std::time::Instant::now();
        let mut seen: HashSet<Ref> = HashSet::new();
        let mut leaves = Vec::new();
        let mut queue = vec![root.clone()];
        while let Some(r) = queue.pop() {
            if seen.contains(&r) {
                continue;
            }
            seen.insert(r.clone());
            r.validate()?;
            if !r.is_record() {
                leaves.push(r);
                continue;
            }
            if r.pool != Pool::AgentState {
                return Err(VersionError::InvalidRef);
            }
            if trust_validated
                && self
                    .closures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&digest_key(r.pool, r.hex()))
            {
                continue;
            }
            // One stat when the record is where it belongs and unchanged since we read it.
            let stamp = self.stat_blob(r.pool, r.hex());
            let trusted =
                stamp.as_ref().is_some_and(|st| st.2 == r.size && self.is_verified(r.pool, r.hex(), st));
            let cached = trusted
                .then(|| {
                    self.record_deps
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(&digest_key(Pool::AgentState, r.hex()))
                        .cloned()
                })
                .flatten();
            if let Some(deps) = cached {
                queue.extend(deps);
                continue;
            }
            let deps = self.read_record(&r, None)?.dependencies;
            // Remember only objects whose last change is well in the past: a write within
            // the same timestamp tick as this stat could otherwise go unnoticed.
            if let Some(st) = stamp.filter(stamp_settled) {
                self.remember_verified(r.pool, r.hex(), st);
                self.remember_deps(digest_key(Pool::AgentState, r.hex()), deps.clone());
            }
            queue.extend(deps);
        }
        // The leaves (file contents, logs, code): one stat each, spread over the cores — on a
        // large workspace this is most of a commit's cost once nothing needs hashing.
        for r in self.untrusted_leaves(&leaves) {
            self.verify_leaf(r)?;
        }
        if !trust_validated {
            *self.last_full_closure.lock().unwrap_or_else(|p| p.into_inner()) = Some(started);
        }
        let mut closures = self.closures.lock().unwrap_or_else(|p| p.into_inner());
        if self.closures_generation.load(AtomicOrdering::SeqCst) != generation {
            return Ok(seen.len());
        }
        if closures.len() > CLOSURES_HELD {
            closures.clear();
        }
        closures.extend(seen.iter().filter(|r| r.is_record()).map(|r| digest_key(r.pool, r.hex())));
        Ok(seen.len())
    }

    /// The leaves whose blob is not where it belongs, unchanged since this process hashed it.
    fn untrusted_leaves<'a>(&self, refs: &'a [Ref]) -> Vec<&'a Ref> {
        let check = |chunk: &'a [Ref]| -> Vec<&'a Ref> {
            chunk
                .iter()
                .filter(|r| {
                    !self
                        .stat_blob(r.pool, r.hex())
                        .is_some_and(|st| st.2 == r.size && self.is_verified(r.pool, r.hex(), &st))
                })
                .collect()
        };
        let workers = if refs.len() < 1024 { 1 } else { super::cores().min(4) };
        if workers < 2 {
            return check(refs);
        }
        let size = refs.len().div_ceil(workers);
        std::thread::scope(|scope| {
            let handles: Vec<_> = refs.chunks(size).map(|chunk| scope.spawn(move || check(chunk))).collect();
            // A panicked checker trusts nothing: everything it had is re-hashed.
            let mut out = Vec::new();
            for (handle, chunk) in handles.into_iter().zip(refs.chunks(size)) {
                out.extend(handle.join().unwrap_or_else(|_| chunk.iter().collect()));
            }
            out
        })
    }

    /// Re-hashes one leaf object (found in its pool, the other pool or the legacy store).
    fn verify_leaf(&self, r: &Ref) -> Result<(), VersionError> {
        let (file, path) = self.locate(r)?;
        let meta = file.metadata().map_err(io_err("stat the object", &path))?;
        if meta.len() != r.size {
            return Err(VersionError::Integrity);
        }
        self.verified_hashes.fetch_add(1, AtomicOrdering::Relaxed);
        let mut reader = VerifiedReader::new(file, &path, r.size, r.hex());
        io::copy(&mut reader, &mut io::sink()).map_err(|e| integrity_or_io(e, &reader.path))?;
        let st = blob_stamp(&meta);
        if path == self.blob_path(r.pool, r.hex()) && stamp_settled(&st) {
            self.remember_verified(r.pool, r.hex(), st);
        }
        Ok(())
    }

    /// `fstatat` of an object in its pool's blob directory (no path walk from `/`).
    fn stat_blob(&self, pool: Pool, hex: &str) -> Option<BlobStamp> {
        use std::os::fd::AsRawFd;
        let slot = &self.blob_dir_fds[usize::from(pool == Pool::AgentState)];
        let dir = match slot.get() {
            Some(fd) => fd,
            None => {
                let fd =
                    crate::fsat::open_path(&self.blob_dir(pool), libc::O_PATH | libc::O_DIRECTORY).ok()?;
                let _ = slot.set(fd);
                slot.get()?
            }
        };
        let name = std::ffi::CString::new(hex).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstatat fills the buffer on success (checked); the name is NUL-terminated.
        common::sys::cvt(unsafe {
            libc::fstatat(dir.as_raw_fd(), name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW)
        })
        .ok()?;
        // SAFETY: initialised by the successful call above.
        let st = unsafe { st.assume_init() };
        ((st.st_mode & libc::S_IFMT) == libc::S_IFREG).then(|| raw_stamp(&st))
    }

    fn defer_dir_sync(&self, dir: &Path) {
        let mut pending = self.pending_dirs.lock().unwrap_or_else(|p| p.into_inner());
        match pending.get_mut(dir) {
            Some(deferred) => *deferred += 1,
            None => drop(pending.insert(dir.to_owned(), 1)),
        }
    }

    /// Makes every object published so far durable by name: fsyncs the blob directories
    /// that gained (or were relied on for) entries. Call before committing a ref.
    pub fn sync_pending(&self) -> Result<(), VersionError> {
        // A directory leaves the set only once its fsync has returned, and only if nothing
        // was deferred to it since this call read the set: an entry linked while that fsync
        // was in flight may not be covered by it, so its writer (which found the directory
        // already pending) syncs it again rather than trusting this sync.
        let dirs: Vec<(PathBuf, u64)> = self
            .pending_dirs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(dir, deferred)| (dir.clone(), *deferred))
            .collect();
        for (dir, deferred) in dirs {
            fsync_dir(&dir)?;
            self.synced(&dir, deferred);
        }
        Ok(())
    }

    /// Marks `dir` durable up to its first `deferred` entries: it leaves the pending set
    /// unless more were deferred meanwhile.
    fn synced(&self, dir: &Path, deferred: u64) {
        let mut pending = self.pending_dirs.lock().unwrap_or_else(|p| p.into_inner());
        if pending.get(dir) == Some(&deferred) {
            pending.remove(dir);
        }
    }

    /// How many blobs `validate_closure` has re-hashed (for tests and the benchmark).
    pub fn blobs_reverified(&self) -> u64 {
        self.verified_hashes.load(AtomicOrdering::Relaxed)
    }

    fn is_verified(&self, pool: Pool, hex: &str, stamp: &BlobStamp) -> bool {
        let verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        verified.get(&digest_key(pool, hex)) == Some(stamp)
    }

    fn remember_verified(&self, pool: Pool, hex: &str, stamp: BlobStamp) {
        let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        if verified.len() >= VERIFIED_LIMIT {
            // Dependencies are only trusted with a verified entry: they go together.
            verified.clear();
            self.record_deps.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
        verified.insert(digest_key(pool, hex), stamp);
    }

    /// Keeps a record's dependencies; the map starts over beyond [`DEPS_LIMIT`] refs in all.
    fn remember_deps(&self, key: DigestKey, deps: Vec<Ref>) {
        let mut map = self.record_deps.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.deps_held.fetch_add(deps.len(), AtomicOrdering::Relaxed) + deps.len();
        if held > DEPS_LIMIT {
            map.clear();
            self.deps_held.store(deps.len(), AtomicOrdering::Relaxed);
        }
        map.insert(key, deps);
    }
}

/// `JSON.parse` accepts escaped lone surrogates and the original's re-canonicalisation then
/// rejects them; serde_json already refuses to parse them (only in surrogate escapes does it
/// report these two errors), so keep the original's message for that case.
/// [`VersionError::RecordTooLarge`] for a record ref declaring more than
/// [`MAX_RECORD_BYTES`].
fn record_within_bound(r: &Ref) -> Result<(), VersionError> {
    if r.size > MAX_RECORD_BYTES {
        return Err(VersionError::RecordTooLarge { digest: r.digest.clone(), size: r.size });
    }
    Ok(())
}

fn json_error(e: serde_json::Error) -> VersionError {
    let text = e.to_string();
    if text.contains("lone leading surrogate") || text.contains("unexpected end of hex escape") {
        VersionError::LoneSurrogate
    } else {
        VersionError::Schema
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

/// Content written into a temp file of a pool by [`Store::stream_temp`], not yet published.
struct Streamed {
    tmp: TempFile,
    file: File,
    hex: String,
    size: u64,
}

/// An object checked against its ref and waiting, unpublished, in its temp file
/// ([`Store::stage_verified`]); dropped unpublished, its temp file goes.
pub struct StagedObject {
    pool: Pool,
    streamed: Streamed,
}

impl StagedObject {
    pub fn size(&self) -> u64 {
        self.streamed.size
    }
}

impl fmt::Debug for StagedObject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagedObject").field("pool", &self.pool).field("hex", &self.streamed.hex).finish()
    }
}

/// The stamp of an object this call just linked from `tmp`, taken from the descriptor its
/// bytes were written through (not by name: whatever holds the name then is not what was
/// hashed), after the temp name is removed (which changes the inode's ctime). `None` if the
/// descriptor cannot be read: the object is then verified when it is next read.
fn fresh_stamp(tmp: TempFile, written: &File) -> Option<BlobStamp> {
    drop(tmp);
    written.metadata().ok().map(|m| blob_stamp(&m))
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// `open(path, O_CREAT|O_EXCL|O_WRONLY, 0600)`.
/// Opens an object or layout file for reading without following a symbolic link or blocking
/// on a FIFO that holds its name, and refuses anything but a regular file (errors
/// [`planted`] tells apart). Only runnerd writes these directories, so such an entry is
/// damage, never content.
fn open_regular(path: &Path) -> io::Result<File> {
    // O_NOATIME: runnerd's reads must not make an object look in use to the collector, whose
    // access-time test is there for the API process's reads ([`super::gc`]). Only the
    // file's owner may ask for it; for another's file, a plain open.
    let open = |extra: libc::c_int| {
        OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | extra).open(path)
    };
    let file = match open(libc::O_NOATIME) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => open(0)?,
        other => other?,
    };
    if !file.metadata()?.file_type().is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
    }
    Ok(file)
}

/// Whether [`open_regular`] met a symbolic link or a non-regular file at the name.
fn planted(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ELOOP) || e.kind() == io::ErrorKind::InvalidData
}

/// The bytes already stored under `path`, `None` if nothing is; anything but a regular file
/// there is `Corrupt`.
fn read_existing(path: &Path) -> Result<Option<Vec<u8>>, VersionError> {
    let mut file = match open_regular(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if planted(&e) => return Err(VersionError::Corrupt { path: path.to_path_buf() }),
        Err(e) => return Err(io_err("read the existing object", path)(e)),
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io_err("read the existing object", path))?;
    Ok(Some(bytes))
}

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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::versioning::names::sha256_hex;
    use crate::versioning::testutil::temp_store;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_sweep_guard_polls_then_waits_for_commits_in_flight() {
        let (_dir, store) = temp_store();
        let store = Arc::new(store);
        let (free, waited) = store.sweep_guard(std::time::Duration::from_millis(50));
        assert!(!waited, "nothing in flight: taken at once");
        drop(free);
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (held, release) = std::sync::mpsc::channel();
        let reader = {
            let (store, ended) = (store.clone(), ended.clone());
            std::thread::spawn(move || {
                let attempt = store.commit_guard();
                held.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(300));
                ended.store(true, AtomicOrdering::SeqCst);
                drop(attempt);
            })
        };
        release.recv().unwrap();
        let (guard, waited) = store.sweep_guard(std::time::Duration::from_millis(50));
        assert!(waited, "an attempt in flight past the patience: waited for");
        assert!(ended.load(AtomicOrdering::SeqCst), "held only once the attempt in flight ended");
        drop(guard);
        reader.join().unwrap();
    }

    #[test]
    fn shared_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Store>();
        send_sync::<Ref>();
        fn send<T: Send>() {}
        send::<VerifiedReader>();
    }

    #[test]
    fn layout_files_are_exact_and_reopening_is_idempotent() {
        let (dir, store) = temp_store();
        for pool in ["data", "agent-state"] {
            let layout = dir.path().join("versioning").join(pool).join("oci-layout");
            let index = dir.path().join("versioning").join(pool).join("index.json");
            assert_eq!(fs::read(&layout).unwrap(), OCI_LAYOUT);
            assert_eq!(fs::read(&index).unwrap(), OCI_INDEX);
            assert_eq!(OCI_LAYOUT.len(), 30);
            assert_eq!(OCI_INDEX.len(), 34);
            assert!(sha256_hex(OCI_LAYOUT).starts_with("18f0797e"));
            assert!(sha256_hex(OCI_INDEX).starts_with("bc5857ac"));
            let v: Value = serde_json::from_slice(&fs::read(&layout).unwrap()).unwrap();
            assert_eq!(v["imageLayoutVersion"], "1.0.0");
            assert_eq!(mode(&layout), 0o600);
            assert!(dir.path().join("versioning").join(pool).join("blobs/sha256").is_dir());
        }
        assert_eq!(store.root(), dir.path().join("versioning"));
        assert_eq!(store.data_dir(), dir.path());
        drop(store);
        Store::open(dir.path()).unwrap();
        let leftovers: Vec<_> = fs::read_dir(dir.path().join("versioning/data"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_layout_file_with_other_bytes_is_corrupt() {
        let (dir, store) = temp_store();
        drop(store);
        let index = dir.path().join("versioning/agent-state/index.json");
        fs::remove_file(&index).unwrap();
        fs::write(&index, br#"{"schemaVersion":2,"manifests":[{}]}"#).unwrap();
        let e = Store::open(dir.path()).unwrap_err();
        assert_eq!(e.to_string(), format!("Corrupt immutable object: {}", index.display()));
    }

    #[test]
    fn pools_are_separate_and_cross_pool_reads_are_refused() {
        let (_dir, store) = temp_store();
        let data = store.put(Pool::Data, b"same", OCTET_STREAM).unwrap();
        let state = store.put(Pool::AgentState, b"same", OCTET_STREAM).unwrap();
        assert_eq!(data.digest, state.digest);
        assert_ne!(store.blob_path(data.pool, data.hex()), store.blob_path(state.pool, state.hex()));
        assert!(store.blob_path(Pool::Data, data.hex()).is_file());
        assert!(store.blob_path(Pool::AgentState, data.hex()).is_file());
        assert_eq!(mode(&store.blob_path(Pool::Data, data.hex())), 0o600);
        assert!(state.require_pool(Pool::Data).unwrap_err().to_string().contains("cross-pool"));
        assert_eq!(store.read(&data).unwrap(), b"same");
        assert!(store.has(&data) && store.has(&state));
        assert!(store.put(Pool::Data, b"x", "").is_err());
    }

    #[test]
    fn concurrent_puts_of_the_same_bytes_agree() {
        let (_dir, store) = temp_store();
        let store = Arc::new(store);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || store.put(Pool::Data, b"same", OCTET_STREAM).unwrap())
            })
            .collect();
        let refs: Vec<Ref> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(refs.iter().all(|r| *r == refs[0]));
        let names: Vec<_> =
            fs::read_dir(store.blob_dir(Pool::Data)).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from(refs[0].hex())], "no temp files left");
    }

    #[test]
    fn an_entry_deferred_while_its_directory_syncs_keeps_the_directory_pending() {
        let (_dir, store) = temp_store();
        let r = store.put(Pool::Data, b"first", OCTET_STREAM).unwrap();
        let dir = store.blob_path(Pool::Data, r.hex()).parent().unwrap().to_owned();
        let pending = |store: &Store| store.pending_dirs.lock().unwrap().get(&dir).copied();
        // What a sync_pending in flight read before a second writer linked its object:
        let read = pending(&store).expect("the first object's directory is pending");
        store.put(Pool::Data, b"second", OCTET_STREAM).unwrap();
        // That sync returns: it may not cover the second link, so the directory stays.
        store.synced(&dir, read);
        assert!(pending(&store).is_some(), "a directory left the set with a link its fsync may have missed");
        store.sync_pending().unwrap();
        assert_eq!(pending(&store), None);
    }

    /// Staged objects are checked as they arrive, published together after one flush, and
    /// read back without a second hash (their stamps are this process's); one that does not
    /// match is never staged, and one dropped unpublished leaves no temp file.
    #[test]
    fn staged_objects_are_checked_then_published_together() {
        let (_dir, store) = temp_store();
        let blob = |b: &[u8]| Ref::new(Pool::Data, &sha256_hex(b), b.len() as u64, OCTET_STREAM);
        let (a, b, c) = (blob(b"alpha"), blob(b"beta"), blob(b"gamma"));
        let staged = vec![
            store.stage_verified(&a, &mut &b"alpha"[..]).unwrap(),
            store.stage_verified(&b, &mut &b"beta"[..]).unwrap(),
        ];
        assert!(!store.has(&a) && !store.has(&b), "nothing is published before the flush");
        assert!(matches!(store.stage_verified(&c, &mut &b"GAMMA"[..]), Err(VersionError::Mismatch { .. })));
        let dropped = store.stage_verified(&c, &mut &b"gamma"[..]).unwrap();
        drop(dropped);
        assert_eq!(store.publish_staged(staged).unwrap(), (2, 0));
        assert!(store.has(&a) && store.has(&b) && !store.has(&c));
        let again = vec![store.stage_verified(&a, &mut &b"alpha"[..]).unwrap()];
        assert_eq!(store.publish_staged(again).unwrap(), (0, 1), "already present");
        let names: Vec<String> = fs::read_dir(store.blob_dir(Pool::Data))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "no temp file is left: {names:?}");
        let mut read = Vec::new();
        store.open_trusted(&a).unwrap().read_to_end(&mut read).unwrap();
        assert_eq!(read, b"alpha");
        let before = store.blobs_reverified();
        store.validate_closure(&a).unwrap();
        assert_eq!(store.blobs_reverified(), before, "an object this process hashed is trusted");
    }

    /// Objects copied from another node are published only when they are what their ref
    /// says; anything else leaves neither the object nor a temp file behind.
    #[test]
    fn put_verified_publishes_only_the_bytes_the_ref_names() {
        let (_dir, store) = temp_store();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
        let r = Ref::new(Pool::Data, &sha256_hex(&bytes), bytes.len() as u64, OCTET_STREAM);
        let path = store.blob_path(Pool::Data, r.hex());
        let only_blobs = |store: &Store, want: &[&str]| {
            let mut names: Vec<String> = fs::read_dir(store.blob_dir(Pool::Data))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            names.sort();
            assert_eq!(names, want, "no temp file is left");
        };
        let mut wrong = bytes.clone();
        wrong[5] ^= 1;
        let mut longer = bytes.clone();
        longer.push(0);
        let cases: [(&[u8], &str); 3] = [
            (&wrong, "100000 bytes with digest sha256:"),
            (&longer, "more than 100000 bytes"),
            (&bytes[..99_999], "99999 bytes with digest sha256:"),
        ];
        for (sent, arrived) in cases {
            let e = store.put_verified(&r, &mut &sent[..]).unwrap_err();
            assert!(matches!(e, VersionError::Mismatch { .. }), "{e}");
            let text = e.to_string();
            assert!(text.contains(arrived) && text.contains(&r.digest), "{text}");
            assert!(!path.exists(), "nothing published for {arrived}");
            only_blobs(&store, &[]);
        }
        // A sender that never stops is read no further than one byte past the size.
        let mut endless = io::repeat(7);
        let e = store.put_verified(&r, &mut endless).unwrap_err();
        assert!(e.to_string().contains("more than 100000 bytes"), "{e}");
        assert!(store.put_verified(&r, &mut bytes.as_slice()).unwrap(), "stored now");
        assert_eq!(store.read(&r).unwrap(), bytes);
        assert!(!store.put_verified(&r, &mut bytes.as_slice()).unwrap(), "already present");
        only_blobs(&store, &[r.hex()]);
        // A record ref must name the agent-state pool.
        let record = Ref { pool: Pool::Data, media_type: RECORD_MEDIA_TYPE.into(), ..r.clone() };
        assert!(matches!(store.put_verified(&record, &mut bytes.as_slice()), Err(VersionError::InvalidRef)));
    }

    /// A peer names a record's size itself: one over [`MAX_RECORD_BYTES`] is refused before
    /// a byte of it is read (intake) or its size is allocated (read), saying which and why.
    #[test]
    fn records_over_the_bound_are_refused_before_anything_is_read() {
        let (_dir, store) = temp_store();
        let huge = Ref::new(Pool::AgentState, &"ab".repeat(32), MAX_RECORD_BYTES + 1, RECORD_MEDIA_TYPE);
        let read = std::cell::Cell::new(0u64);
        let mut zeros = io::repeat(0);
        let mut counting = ReadCounter { inner: &mut zeros, read: &read };
        let e = store.put_verified(&huge, &mut counting).unwrap_err();
        assert!(
            matches!(&e, VersionError::RecordTooLarge { size, .. } if *size == MAX_RECORD_BYTES + 1),
            "{e}"
        );
        assert_eq!(read.get(), 0, "nothing was read from the sender");
        assert!(e.to_string().contains(&huge.digest) && e.to_string().contains("67108864"), "{e}");
        assert!(fs::read_dir(store.blob_dir(Pool::AgentState)).unwrap().next().is_none(), "no temp file");

        // Even with a file of that size at the digest's name, it is never opened.
        let planted = File::create(store.blob_path(Pool::AgentState, huge.hex())).unwrap();
        planted.set_len(MAX_RECORD_BYTES + 1).unwrap();
        let e = store.read_record(&huge, None).unwrap_err();
        assert!(matches!(e, VersionError::RecordTooLarge { .. }), "{e}");

        // The bound is the record's, inclusive; other agent-state objects (logs) stream.
        let at = Ref { size: MAX_RECORD_BYTES, ..huge.clone() };
        assert!(record_within_bound(&at).is_ok());
        let log = Ref { media_type: OCTET_STREAM.into(), ..huge.clone() };
        let e = store.put_verified(&log, &mut &b"short"[..]).unwrap_err();
        assert!(matches!(e, VersionError::Mismatch { .. }), "read and compared, not refused: {e}");
    }

    /// A reader that counts the bytes it hands out.
    struct ReadCounter<'a> {
        inner: &'a mut dyn Read,
        read: &'a std::cell::Cell<u64>,
    }

    impl Read for ReadCounter<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read.set(self.read.get() + n as u64);
            Ok(n)
        }
    }

    #[test]
    fn record_key_order_is_irrelevant() {
        let (_dir, store) = temp_store();
        let a = store.put_record("Test", json!({"b": 2, "a": 1})).unwrap();
        let b = store.put_record("Test", json!({"a": 1, "b": 2})).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            String::from_utf8(store.read(&a).unwrap()).unwrap(),
            r#"{"dependencies":[],"kind":"Test","schemaVersion":1,"value":{"a":1,"b":2}}"#
        );
        let record = store.read_record(&a, Some("Test")).unwrap();
        assert_eq!(
            record,
            Record { kind: "Test".into(), value: json!({"a": 1, "b": 2}), dependencies: vec![] }
        );
        let e = store.read_record(&a, Some("Other")).unwrap_err();
        assert!(matches!(e, VersionError::KindMismatch { .. }), "{e}");
    }

    #[test]
    fn a_symlink_or_fifo_at_an_objects_name_is_damage_and_never_followed_or_waited_on() {
        let (_dir, store) = temp_store();
        let outside = tempfile::TempDir::new().unwrap();
        let target = outside.path().join("same");
        fs::write(&target, b"same").unwrap();
        let hex = hex(&Sha256::digest(b"same"));
        let path = store.blob_path(Pool::Data, &hex);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        // A link to a file with exactly the object's bytes is still not the object.
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let e = store.put(Pool::Data, b"same", OCTET_STREAM).unwrap_err();
        assert!(matches!(e, VersionError::Corrupt { .. }), "{e}");
        let e = store.put_stream(Pool::Data, &mut &b"same"[..]).unwrap_err();
        assert!(matches!(e, VersionError::Corrupt { .. }), "{e}");
        let r = Ref::new(Pool::Data, &hex, 4, OCTET_STREAM);
        assert!(matches!(store.read(&r), Err(VersionError::Integrity)));
        // A FIFO would block a plain open for ever: refused at once.
        fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = store.put(Pool::Data, b"same", OCTET_STREAM).unwrap_err();
        assert!(matches!(e, VersionError::Corrupt { .. }), "{e}");
        assert!(matches!(store.read(&r), Err(VersionError::Integrity)));
        assert_eq!(fs::read(&target).unwrap(), b"same", "the link's target is untouched");
    }

    #[test]
    fn overwritten_blobs_are_caught_on_put_and_read() {
        let (_dir, store) = temp_store();
        let r = store.put(Pool::Data, b"same", OCTET_STREAM).unwrap();
        let path = store.blob_path(Pool::Data, r.hex());
        fs::write(&path, b"evil").unwrap();
        let e = store.put(Pool::Data, b"same", OCTET_STREAM).unwrap_err();
        assert!(e.to_string().starts_with("Corrupt immutable object: "), "{e}");
        assert_eq!(store.read(&r).unwrap_err().to_string(), "Object integrity failure");
        // Streaming: same size, so only the digest at EOF can tell.
        let mut reader = store.open_reader(&r).unwrap();
        let e = io::copy(&mut reader, &mut io::sink()).unwrap_err();
        assert_eq!(
            (e.kind(), e.to_string()),
            (io::ErrorKind::InvalidData, "Object integrity failure".into())
        );
        let e = store.put_stream(Pool::Data, &mut &b"same"[..]).unwrap_err();
        assert_eq!(e.to_string(), "Object integrity failure");
        assert_eq!(store.validate_closure(&r).unwrap_err().to_string(), "Object integrity failure");
    }

    #[test]
    fn closure_validation_trusts_only_unchanged_blobs_it_hashed() {
        let (dir, store) = temp_store();
        let ws = dir.path().join("ws");
        fs::create_dir(&ws).unwrap();
        crate::versioning::testutil::example_workspace(&ws);
        let root = store.snapshot(&ws).unwrap();
        // Streamed just now: hashed while written, so not hashed again.
        assert_eq!(store.validate_closure(&root).unwrap(), 6);
        assert_eq!(store.blobs_reverified(), 0);
        // A tampered blob (same size) changes its ctime and is re-hashed, and caught.
        let x = store.blob_path(Pool::Data, crate::versioning::testutil::X_CSV_HEX);
        fs::set_permissions(&x, fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(&x, b"a,b\n1,3\n").unwrap();
        assert_eq!(store.validate_closure(&root).unwrap_err().to_string(), "Object integrity failure");
        assert_eq!(store.blobs_reverified(), 1);
    }

    #[test]
    fn a_fresh_objects_stamp_is_of_the_file_written_not_of_what_holds_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let (tmp_path, name) = (dir.path().join("obj.tmp"), dir.path().join("obj"));
        let mut written = create_exclusive(&tmp_path).unwrap();
        written.write_all(b"hashed bytes").unwrap();
        fs::hard_link(&tmp_path, &name).unwrap();
        // Something else takes the name before the stamp is taken.
        let other = dir.path().join("other");
        fs::write(&other, b"other bytes!").unwrap();
        fs::rename(&other, &name).unwrap();
        let stamp = fresh_stamp(TempFile(tmp_path.clone()), &written).unwrap();
        assert!(!tmp_path.exists(), "the temp name is removed first");
        let held = blob_stamp(&fs::symlink_metadata(&name).unwrap());
        assert_ne!(stamp.1, held.1, "stamped the file now at the name");
        assert_eq!(stamp, blob_stamp(&written.metadata().unwrap()));
    }

    #[test]
    fn truncated_or_wrongly_sized_blobs_fail_integrity() {
        let (_dir, store) = temp_store();
        let r = store.put(Pool::Data, b"0123456789", OCTET_STREAM).unwrap();
        fs::write(store.blob_path(Pool::Data, r.hex()), b"01234").unwrap();
        assert_eq!(store.read(&r).unwrap_err().to_string(), "Object integrity failure");
        assert_eq!(store.open_reader(&r).unwrap_err().to_string(), "Object integrity failure");
        let good = store.put(Pool::Data, b"abc", OCTET_STREAM).unwrap();
        let wrong = Ref { size: 4, ..good.clone() };
        assert_eq!(store.read(&wrong).unwrap_err().to_string(), "Object integrity failure");
        assert!(!store.has(&wrong));
        let missing = Ref::new(Pool::Data, &sha256_hex(b"never stored"), 12, OCTET_STREAM);
        assert!(matches!(store.read(&missing).unwrap_err(), VersionError::Missing { .. }));
        assert!(!store.has(&missing));
    }

    #[test]
    fn verified_reader_streams_good_content() {
        let (_dir, store) = temp_store();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let r = store.put_stream(Pool::Data, &mut big.as_slice()).unwrap();
        assert_eq!(r, Ref::new(Pool::Data, &sha256_hex(&big), big.len() as u64, OCTET_STREAM));
        let mut reader = store.open_reader(&r).unwrap();
        assert_eq!(reader.size(), 300_000);
        let mut out = Vec::new();
        reader.read_to_end(&mut out).unwrap();
        assert_eq!(out, big);
        assert_eq!(reader.read(&mut [0u8; 8]).unwrap(), 0);
        // The same content again de-duplicates through the verified no-clobber link.
        assert_eq!(store.put_stream(Pool::Data, &mut big.as_slice()).unwrap(), r);
    }

    #[test]
    fn reads_fall_back_to_the_other_pool_and_the_legacy_store() {
        let (dir, store) = temp_store();
        let bytes = b"legacy content";
        let hex = sha256_hex(bytes);
        let legacy = dir.path().join("cas/sha256").join(&hex[..2]).join(&hex);
        fs::create_dir_all(legacy.parent().unwrap()).unwrap();
        fs::write(&legacy, bytes).unwrap();
        let r = Ref::new(Pool::Data, &hex, bytes.len() as u64, OCTET_STREAM);
        assert_eq!(store.read(&r).unwrap(), bytes);
        assert!(!store.has(&r), "has() looks in the ref's own pool only");
        // A new write goes to the pool and leaves the legacy file alone.
        assert_eq!(store.put(Pool::Data, bytes, OCTET_STREAM).unwrap(), r);
        assert_eq!(fs::read(&legacy).unwrap(), bytes);
        assert!(store.blob_path(Pool::Data, &hex).is_file());
        let state = store.put(Pool::AgentState, b"only in state", OCTET_STREAM).unwrap();
        assert_eq!(store.read(&Ref { pool: Pool::Data, ..state }).unwrap(), b"only in state");
    }

    #[test]
    fn dependencies_are_scanned_deduplicated_and_sorted() {
        let (_dir, store) = temp_store();
        let leaf = store.put(Pool::Data, b"leaf", OCTET_STREAM).unwrap();
        let other = store.put(Pool::AgentState, b"other", OCTET_STREAM).unwrap();
        let value = json!({
            "z": [leaf.to_value(), {"nested": other.to_value()}],
            "a": leaf.to_value(),
            "same-digest-other-pool": Ref { pool: Pool::AgentState, ..leaf.clone() }.to_value(),
        });
        let rec = store.put_record("Test", value).unwrap();
        let deps = store.read_record(&rec, None).unwrap().dependencies;
        let mut expected = vec![leaf.clone(), other.clone(), Ref { pool: Pool::AgentState, ..leaf.clone() }];
        expected.sort_by_key(Ref::jcs);
        assert_eq!(deps, expected);
        assert_eq!(store.validate_closure(&rec).unwrap(), 4);
        let bad = json!({"r": {"pool": "data", "digest": "sha256:00"}});
        assert_eq!(store.put_record("Test", bad).unwrap_err().to_string(), "Invalid or cross-pool reference");
    }

    /// Issue #31: a journaled commit trusts what was validated, but checks everything again
    /// once FULL_CLOSURE_EVERY has passed, so a blob deleted behind runnerd's back is found
    /// (and the writer's retry restores it) within that time.
    #[test]
    fn a_trusting_closure_check_checks_everything_now_and_then() {
        let (_dir, store) = temp_store();
        let leaf = store.put(Pool::Data, b"leaf", OCTET_STREAM).unwrap();
        let root = store.put_record("Test", json!({"leaf": leaf.to_value()})).unwrap();
        assert_eq!(store.validate_closure(&root).unwrap(), 2);
        fs::remove_file(store.blob_path(Pool::Data, leaf.hex())).unwrap();
        assert_eq!(store.validate_closure_since_validated(&root).unwrap(), 1, "trusted within the period");
        *store.last_full_closure.lock().unwrap() = Some(std::time::Instant::now() - FULL_CLOSURE_EVERY);
        assert!(matches!(store.validate_closure_since_validated(&root), Err(VersionError::Missing { .. })));
        // A check that began before the caches were forgotten adds nothing to trust.
        store.forget_caches();
        assert!(store.closures.lock().unwrap().is_empty());
    }

    #[test]
    fn closure_of_a_record_and_one_leaf_is_two() {
        let (_dir, store) = temp_store();
        let leaf = store.put(Pool::Data, b"leaf", OCTET_STREAM).unwrap();
        let root = store.put_record("Test", json!({"leaf": leaf.to_value()})).unwrap();
        assert_eq!(store.validate_closure(&root).unwrap(), 2);
        fs::remove_file(store.blob_path(Pool::Data, leaf.hex())).unwrap();
        assert!(matches!(store.validate_closure(&root).unwrap_err(), VersionError::Missing { .. }));
    }

    #[test]
    fn reader_checks_table() {
        let (_dir, store) = temp_store();
        let leaf = store.put(Pool::Data, b"leaf", OCTET_STREAM).unwrap();
        let leaf_json = leaf.jcs();
        let cases: Vec<(String, &str)> = vec![
            (
                format!(r#"{{"dependencies":[],"kind":"T","schemaVersion":1,"value":{{"x":{leaf_json}}}}}"#),
                "Undeclared record dependency",
            ),
            (
                r#"{"dependencies":[],"kind":"T","schemaVersion":2,"value":1}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"dependencies":[],"kind":"T","schemaVersion":1.0,"value":1}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"kind":"T","schemaVersion":1,"value":1,"dependencies":[]}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"dependencies":[], "kind":"T","schemaVersion":1,"value":1}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"dependencies":{},"kind":"T","schemaVersion":1,"value":1}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"dependencies":[],"kind":7,"schemaVersion":1,"value":1}"#.into(),
                "Unsupported or invalid record schema",
            ),
            (
                r#"{"dependencies":[],"kind":"T","schemaVersion":1,"value":"\ud800"}"#.into(),
                "JCS rejects lone surrogates",
            ),
            (
                r#"{"dependencies":[],"kind":"T","schemaVersion":1,"value":"\udc00x"}"#.into(),
                "JCS rejects lone surrogates",
            ),
            (
                r#"{"dependencies":[],"kind":"T","schemaVersion":1,"value":"\ud800\u0041"}"#.into(),
                "JCS rejects lone surrogates",
            ),
            ("not json".into(), "Unsupported or invalid record schema"),
            (
                r#"{"dependencies":[{"pool":"data"}],"kind":"T","schemaVersion":1,"value":1}"#.into(),
                "Invalid or cross-pool reference",
            ),
        ];
        for (text, message) in cases {
            let r = store.put(Pool::AgentState, text.as_bytes(), RECORD_MEDIA_TYPE).unwrap();
            assert_eq!(store.read_record(&r, None).unwrap_err().to_string(), message, "{text}");
        }
        // Extra declared dependencies are tolerated on read.
        let text = format!(r#"{{"dependencies":[{leaf_json}],"kind":"T","schemaVersion":1,"value":1}}"#);
        let r = store.put(Pool::AgentState, text.as_bytes(), RECORD_MEDIA_TYPE).unwrap();
        assert_eq!(store.read_record(&r, Some("T")).unwrap().dependencies, vec![leaf]);
        // Only agent-state refs of the record type are records.
        let wrong_type = store.put(Pool::AgentState, text.as_bytes(), OCTET_STREAM).unwrap();
        assert_eq!(
            store.read_record(&wrong_type, None).unwrap_err().to_string(),
            "Invalid or cross-pool reference"
        );
        let wrong_pool = Ref { pool: Pool::Data, ..r };
        assert_eq!(
            store.read_record(&wrong_pool, None).unwrap_err().to_string(),
            "Invalid or cross-pool reference"
        );
    }
}
