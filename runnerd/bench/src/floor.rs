//! The durable floor of one execution's commit: what the original's on-disk format makes
//! every commit do (§4 and §5 of original-versioning-format.md), done directly, with
//! nothing of runnerd around it, on the filesystem runnerd's data directory is on. Each
//! execution's record is new (it names the execution), so each commit writes one object:
//! a temp file in the blob directory (O_EXCL, 0600), its bytes, `fsync`, a hard link under
//! its digest name, `fsync` of the directory, the temp unlinked; then the refs transaction
//! (live ref upsert and history insert) in `refs.sqlite` with WAL and `synchronous=FULL`.
//! What the commit phase costs above this is runnerd's; this much no implementation of the
//! format avoids.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::{Stats, stats};

/// What the floor measured: the commits' wall times and this thread's CPU.
#[derive(Default)]
pub(crate) struct Floor {
    pub(crate) samples: Vec<Duration>,
    pub(crate) cpu_ms: f64,
}

impl Floor {
    pub(crate) fn add(&mut self, other: Floor) {
        self.samples.extend(other.samples);
        self.cpu_ms += other.cpu_ms;
    }

    /// Mean wall time per commit, in ms (the phases are means too).
    pub(crate) fn mean_ms(&self) -> f64 {
        let total: Duration = self.samples.iter().sum();
        total.as_secs_f64() * 1000.0 / self.samples.len().max(1) as f64
    }

    pub(crate) fn cpu_per_commit_ms(&self) -> f64 {
        self.cpu_ms / self.samples.len().max(1) as f64
    }

    pub(crate) fn stats(&self) -> Stats {
        let wall = self.samples.iter().sum();
        stats(self.samples.clone(), wall)
    }
}

/// The size of the `WorkspaceMutation` record (`legacy-execution`) each benchmark execution
/// commits.
const RECORD_BYTES: usize = 532;

/// `n` commits in a fresh directory under `parent` (removed afterwards).
pub(crate) fn durable_commit_floor(parent: &Path, n: usize) -> anyhow::Result<Floor> {
    static ROUND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let round = ROUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let root = parent.join(format!("runnerd-bench-floor-{}-{round}", std::process::id()));
    let blobs = root.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
    let measured = measure(&root, &blobs, n);
    let _ = std::fs::remove_dir_all(&root);
    measured
}

fn measure(root: &Path, blobs: &Path, n: usize) -> anyhow::Result<Floor> {
    let db = rusqlite::Connection::open(root.join("refs.sqlite"))?;
    db.pragma_update(None, "journal_mode", "WAL")?;
    db.pragma_update(None, "synchronous", "FULL")?;
    db.execute_batch(
        "CREATE TABLE live_refs(name TEXT PRIMARY KEY, target TEXT NOT NULL);
         CREATE TABLE history_refs(id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL,
             target TEXT NOT NULL);
         CREATE INDEX history_by_name ON history_refs(name, id);",
    )?;
    let dir = std::fs::File::open(blobs)?;
    let mut record = vec![b'r'; RECORD_BYTES];
    let mut samples = Vec::with_capacity(n);
    let cpu_before = thread_cpu_ms();
    for i in 0..n {
        // Distinct content, as each execution's record is.
        record[..16].copy_from_slice(format!("{i:016}").as_bytes());
        let start = Instant::now();
        commit_once(&db, &dir, blobs, &record, i)?;
        samples.push(start.elapsed());
    }
    Ok(Floor { samples, cpu_ms: thread_cpu_ms() - cpu_before })
}

fn commit_once(
    db: &rusqlite::Connection,
    dir: &std::fs::File,
    blobs: &Path,
    record: &[u8],
    i: usize,
) -> anyhow::Result<()> {
    let temp = blobs.join(format!(".tmp-{i}"));
    let name = blobs.join(format!("{i:064x}"));
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp)?;
    file.write_all(record)?;
    file.sync_all()?;
    drop(file);
    std::fs::hard_link(&temp, &name)?;
    nix::unistd::fsync(dir.as_fd())?;
    std::fs::remove_file(&temp)?;
    let target = format!("{{\"digest\":\"sha256:{i:064x}\"}}");
    let tx = rusqlite::Transaction::new_unchecked(db, rusqlite::TransactionBehavior::Immediate)?;
    // Cached statements, as runnerd's (parsed once per connection).
    tx.prepare_cached(
        "INSERT INTO live_refs(name, target) VALUES('workspace', ?1) \
         ON CONFLICT(name) DO UPDATE SET target=excluded.target",
    )?
    .execute([&target])?;
    tx.prepare_cached("INSERT INTO history_refs(name, target) VALUES('workspace', ?1)")?
        .execute([&target])?;
    tx.commit()?;
    Ok(())
}

/// This thread's CPU time so far (user + system), in ms.
fn thread_cpu_ms() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_THREAD);
    usage.map_or(0.0, |u| {
        let ms = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1000.0 + t.tv_usec() as f64 / 1000.0;
        ms(u.user_time()) + ms(u.system_time())
    })
}
