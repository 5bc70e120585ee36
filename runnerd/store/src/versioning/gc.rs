//! The collector (issue #32): history retention, then a mark-and-sweep of the objects no
//! root reaches, with an account of what each workspace's history holds.
//!
//! The roots are the original's `roots()` — every live ref and every history row that the
//! retention keeps — and the versions a managed execution names. The retention prunes only
//! workspaces' histories ([`is_workspace_head`]). Objects are marked by digest alone: a
//! reader falls back to the other pool, so a marked digest keeps its blob in both. When a
//! kept version reaches a record that cannot be read, nothing is deleted (what it reaches
//! is unknown).
//!
//! Safe against concurrent commits in three ways:
//! * an object written less than [`Collection::grace`] ago, or read less than a day and the
//!   grace ago (`relatime` refreshes the access time once a day), is never deleted: a commit
//!   of the API process may be about to root it, and its reuse of a stored object only
//!   reads it (runnerd's own reads do not count: they are `O_NOATIME`);
//! * deletion happens under [`Store::sweep_guard`], held only while no commit attempt of
//!   this process is between its snapshot and its ref (polled for, then waited for, so a
//!   node whose commits never pause still gets collected): before each batch, the roots
//!   committed since the mark are marked too, so an old object a new commit reused is kept;
//! * what was deleted is forgotten by every cache ([`Store::forget_objects`]), so a commit
//!   that would reuse it stores it again (or finds it missing and retries).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::refs::HistoryRow;
use super::retention::{self, Retention};
use super::store::digest_key;
use super::{Pool, Ref, Refs, Store, VersionError};

/// Objects deleted per hold of the sweep guard: commits wait for at most one batch.
const BATCH: usize = 2048;
/// How long a batch polls for a moment with no commit attempt in flight before it waits
/// for one (and then takes [`FORCED_BATCH`] objects, so such waits are few).
const PATIENCE: Duration = Duration::from_secs(30);
const FORCED_BATCH: usize = 8 * BATCH;
/// Heads' histories a report lists at most (the largest on disk).
const HEADS_SHOWN: usize = 100;
/// Damaged records named in a report at most.
const NAMED: usize = 20;

/// What one collection does.
#[derive(Debug, Clone, Copy)]
pub struct Collection {
    pub retention: Retention,
    /// Objects written within this (or read within it and a day) are never deleted.
    pub grace: Duration,
    /// Account and list, delete nothing (`runnerctl gc --dry-run`).
    pub dry_run: bool,
}

/// What a collection found and did; `/versioning` and `runnerctl gc` show it.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub dry_run: bool,
    /// Seconds since the epoch when it started, and how long it took.
    pub started_at: u64,
    pub took_ms: u64,
    /// History rows the retention removed (or would remove, dry).
    pub versions_pruned: usize,
    pub versions_kept: usize,
    pub objects_stored: u64,
    /// Bytes the stored objects take on disk (allocated, so a sparse object is its data).
    pub disk_bytes_stored: u64,
    pub objects_reachable: u64,
    pub objects_deleted: u64,
    pub disk_bytes_deleted: u64,
    /// Unreachable objects kept because they were written or read within the grace.
    pub objects_kept_young: u64,
    /// Objects a kept version reaches that are in neither pool nor the legacy store: a
    /// store damaged behind runnerd's back (0 is what every collection should find;
    /// `runnerctl repair` restores a workspace's head from its files).
    pub objects_missing: u64,
    /// Why deletion stopped before the end, if it did.
    pub sweep_stopped: Option<String>,
    /// Batches for which commits never paused within 30 s, so new commit attempts waited
    /// for the ones in flight to end.
    pub sweeps_waited: u64,
    /// Records that could not be read (missing or damaged): what only they reach is not
    /// known, and is collected as unreachable. At most [`NAMED`], then a count.
    pub unreadable: Vec<String>,
    pub unreadable_count: usize,
    /// Each head's history, largest on disk first, at most [`HEADS_SHOWN`] of them.
    pub workspaces: Vec<HeadHistory>,
    /// How many heads there are in all.
    pub heads: usize,
}

/// One head's history: its retained versions and what they reach.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HeadHistory {
    pub name: String,
    /// The workspace directory, where the head is a workspace's that runnerd knows.
    pub workspace: Option<String>,
    pub versions: usize,
    pub objects: u64,
    /// The sum of the objects' sizes (what a restore would write).
    pub bytes: u64,
    /// What those objects take on disk, each counted in every history that reaches it.
    pub disk_bytes: u64,
}

/// A stored blob: its raw digest, the pool directory it is in, its name and inode there,
/// disk bytes and when it was last written and read (ns since the epoch).
struct Stored {
    raw: [u8; 32],
    pool: Pool,
    name: std::ffi::CString,
    ino: u64,
    disk: u64,
    mtime_ns: i128,
    atime_ns: i128,
}

/// Each pool's `blobs/sha256`, opened once: listed, stat'ed and unlinked relative to it.
struct BlobDirs([std::os::fd::OwnedFd; 2]);

impl BlobDirs {
    fn open(store: &Store) -> Result<BlobDirs, VersionError> {
        let open = |pool: Pool| {
            let dir = store.blob_dir(pool);
            crate::fsat::open_path(&dir, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
                .map_err(super::io_err("open the objects of", dir))
        };
        Ok(BlobDirs([open(Pool::Data)?, open(Pool::AgentState)?]))
    }

    fn of(&self, pool: Pool) -> &std::os::fd::OwnedFd {
        &self.0[usize::from(pool == Pool::AgentState)]
    }
}

/// When an object counts as in use: written after `written`, or read after `read` (ns).
#[derive(Clone, Copy)]
struct InUseAfter {
    written: i128,
    read: i128,
}

impl InUseAfter {
    fn new(started: SystemTime, grace: Duration) -> InUseAfter {
        let ns = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128);
        let written = started.checked_sub(grace).unwrap_or(SystemTime::UNIX_EPOCH);
        let read = written.checked_sub(RELATIME_WINDOW).unwrap_or(SystemTime::UNIX_EPOCH);
        InUseAfter { written: ns(written), read: ns(read) }
    }

    /// Written or read lately: a writer (the API process's, whose reuse of an existing
    /// object only reads it) may be about to reference it.
    fn holds(&self, mtime_ns: i128, atime_ns: i128) -> bool {
        mtime_ns > self.written || atime_ns > self.read
    }
}

/// What one walk adds to a head's account.
#[derive(Default)]
struct Tally {
    objects: u64,
    bytes: u64,
    disk: u64,
}

/// A record's dependency as the mark remembers it: what a walk needs to go on.
struct Dep {
    raw: [u8; 32],
    pool: Pool,
    record: bool,
    size: u64,
}

impl Dep {
    fn of(r: &Ref) -> Dep {
        Dep { raw: digest_key(r.pool, r.hex()).1, pool: r.pool, record: r.is_record(), size: r.size }
    }

    /// The ref again (a leaf's mediaType is not kept: the mark only asks whether it is a
    /// record).
    fn to_ref(&self) -> Ref {
        let media = if self.record { super::RECORD_MEDIA_TYPE } else { super::OCTET_STREAM };
        Ref::new(self.pool, &super::names::hex(&self.raw), self.size, media)
    }
}

/// The mark: digests reached, and each record's dependencies read once.
#[derive(Default)]
struct Mark {
    reached: HashSet<[u8; 32]>,
    /// Compact (a `Ref` is two strings; a store of millions of objects would hold GBs).
    deps: HashMap<[u8; 32], Vec<Dep>>,
    unreadable: Vec<String>,
    unreadable_count: usize,
}

impl Mark {
    /// Marks everything `root` reaches, adding what is new to `seen` (a head's walks share
    /// it) to `tally`. A record is told from a file by its mediaType, not only its digest: a
    /// file holding a record's bytes must not hide the record's dependencies. A record that
    /// cannot be read is noted (and stops every deletion, see [`collect`]); an I/O failure
    /// stops the collection.
    fn walk(
        &mut self,
        store: &Store,
        root: &Ref,
        seen: &mut HashSet<([u8; 32], bool)>,
        tally: &mut Tally,
        disk_of: &HashMap<[u8; 32], u64>,
    ) -> Result<(), VersionError> {
        let mut queue = vec![root.clone()];
        while let Some(r) = queue.pop() {
            if r.validate().is_err() {
                continue;
            }
            let raw = digest_key(r.pool, r.hex()).1;
            if !seen.insert((raw, r.is_record())) {
                continue;
            }
            tally.objects += 1;
            tally.bytes += r.size;
            tally.disk += disk_of.get(&raw).copied().unwrap_or(0);
            self.reached.insert(raw);
            if !r.is_record() {
                continue;
            }
            if let Some(deps) = self.deps.get(&raw) {
                queue.extend(deps.iter().map(Dep::to_ref));
                continue;
            }
            match store.read_record(&r, None) {
                Ok(record) => {
                    queue.extend(record.dependencies.iter().cloned());
                    self.deps.insert(raw, record.dependencies.iter().map(Dep::of).collect());
                }
                Err(e @ (VersionError::Io { .. } | VersionError::Sqlite { .. })) => return Err(e),
                // Not memoised: a repair may store it again before the next batch's walk.
                Err(e) => {
                    self.unreadable_count += 1;
                    if self.unreadable.len() < NAMED {
                        self.unreadable.push(format!("{}: {}", r.digest, common::error_chain(&e)));
                    }
                }
            }
        }
        Ok(())
    }

    /// Marks each head's roots ([`retained_by_head`]) and accounts for what its history
    /// holds: every object its roots reach (one shared with another head counts for both).
    fn heads(
        &mut self,
        store: &Store,
        by_head: HashMap<&str, (usize, Vec<&Ref>)>,
        disk_of: &HashMap<[u8; 32], u64>,
        workspace_of: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Vec<HeadHistory>, VersionError> {
        let mut accounts = Vec::new();
        for (name, (versions, roots)) in by_head {
            let (mut seen, mut tally) = (HashSet::new(), Tally::default());
            for root in roots {
                self.walk(store, root, &mut seen, &mut tally, disk_of)?;
            }
            accounts.push(HeadHistory {
                workspace: workspace_of(name),
                versions,
                objects: tally.objects,
                bytes: tally.bytes,
                disk_bytes: tally.disk,
                name: name.to_owned(),
            });
        }
        Ok(accounts)
    }
}

/// The heads whose history the retention prunes: workspaces' (`workspaces/<hex>/head`).
/// Every other name — the API process's agents, trajectories, exports — keeps its history
/// as the original does (its rows are never deleted there).
pub fn is_workspace_head(name: &str) -> bool {
    name.strip_prefix("workspaces/")
        .and_then(|rest| rest.strip_suffix("/head"))
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// History rows deleted per transaction: a large first pruning never holds the refs
/// database (which the API process writes too) for long.
const PRUNE_BATCH: usize = 1000;

/// How long after its last read an object still counts as in use: reads refresh the
/// access time at most once a day under `relatime` (the usual mount option), so a read
/// within the grace shows within a day and the grace.
const RELATIME_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// Runs one collection. `named`: the versions managed executions name (roots, and never
/// pruned); `workspace_of`: a head name's workspace directory, where known.
pub fn collect(
    store: &Store,
    refs: &Mutex<Refs>,
    named: &[Ref],
    workspace_of: &dyn Fn(&str) -> Option<String>,
    how: Collection,
) -> Result<Report, VersionError> {
    let started = SystemTime::now();
    let clock = std::time::Instant::now();
    let lock = || refs.lock().unwrap_or_else(|p| p.into_inner());
    // What is stored, listed first: an object stored after this is no candidate.
    let dirs = BlobDirs::open(store)?;
    let stored = list_stored(&dirs)?;
    let disk_of: HashMap<[u8; 32], u64> = stored.iter().map(|s| (s.raw, s.disk)).collect();
    let (rows, live) = {
        let r = lock();
        (r.history_rows(0)?, r.live_rows()?)
    };
    let last_id = rows.last().map_or(0, |r| r.id);
    let pruned = prune_history(refs, &rows, &live, named, &stored, how, started)?;

    // Mark, head by head (a head's account spans its retained versions and its target).
    let mut mark = Mark::default();
    let accounts = mark.heads(store, retained_by_head(&rows, &live, &pruned), &disk_of, workspace_of)?;
    for root in named {
        mark.walk(store, root, &mut HashSet::new(), &mut Tally::default(), &disk_of)?;
    }

    let objects_missing = mark
        .reached
        .iter()
        .filter(|raw| !disk_of.contains_key(*raw) && !store.in_legacy_store(&super::names::hex(&raw[..])))
        .count() as u64;
    let in_use = InUseAfter::new(started, how.grace);
    let mut report = Report {
        dry_run: how.dry_run,
        started_at: started.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        versions_pruned: pruned.len(),
        versions_kept: rows.len() - pruned.len(),
        objects_stored: stored.len() as u64,
        disk_bytes_stored: stored.iter().map(|s| s.disk).sum(),
        objects_reachable: mark.reached.len() as u64,
        objects_missing,
        ..Report::default()
    };
    let doomed = unreached(stored, &mark, in_use, &mut report);

    if !how.dry_run {
        let how = Sweep { store, dirs: &dirs, lock: &lock, disk_of: &disk_of, in_use };
        let outcome = sweep(&how, &mut mark, &doomed, last_id, &mut report);
        for pool in [Pool::Data, Pool::AgentState] {
            super::store::fsync_dir(&store.blob_dir(pool))?;
        }
        outcome?;
    }

    // The largest histories, at most [`HEADS_SHOWN`]: every export is a head of its own, and
    // the report stays in memory and goes out whole.
    report.workspaces = accounts;
    report.workspaces.sort_by(|a, b| b.disk_bytes.cmp(&a.disk_bytes).then_with(|| a.name.cmp(&b.name)));
    report.heads = report.workspaces.len();
    report.workspaces.truncate(HEADS_SHOWN);
    report.unreadable = mark.unreadable;
    report.unreadable_count = mark.unreadable_count;
    report.took_ms = clock.elapsed().as_millis() as u64;
    Ok(report)
}

/// Retention: which workspace history rows go (their ids), deleted unless `how` is a dry
/// run. A version's age is its record's write time in the listing (`stored`).
fn prune_history(
    refs: &Mutex<Refs>,
    rows: &[HistoryRow],
    live: &[(String, Ref)],
    named: &[Ref],
    stored: &[Stored],
    how: Collection,
    started: SystemTime,
) -> Result<HashSet<i64>, VersionError> {
    let written_at: HashMap<[u8; 32], i128> = stored.iter().map(|s| (s.raw, s.mtime_ns)).collect();
    let jcs: Vec<String> = rows.iter().map(|r| r.target.jcs()).collect();
    let live_jcs: Vec<(String, String)> = live.iter().map(|(n, t)| (n.clone(), t.jcs())).collect();
    let heads: HashMap<&str, &str> = live_jcs.iter().map(|(n, t)| (n.as_str(), t.as_str())).collect();
    let named_jcs: Vec<String> = named.iter().map(Ref::jcs).collect();
    let named_set: HashSet<&str> = named_jcs.iter().map(String::as_str).collect();
    let versions: Vec<retention::Version<'_>> = rows
        .iter()
        .zip(&jcs)
        .filter(|(row, _)| is_workspace_head(&row.name))
        .map(|(row, target)| retention::Version {
            id: row.id,
            name: &row.name,
            target,
            created: written_at
                .get(&digest_key(row.target.pool, row.target.hex()).1)
                .map(|&ns| SystemTime::UNIX_EPOCH + Duration::from_nanos(u64::try_from(ns).unwrap_or(0))),
        })
        .collect();
    let pruned: HashSet<i64> =
        retention::pruned(&versions, &heads, &named_set, how.retention, started).into_iter().collect();
    if !how.dry_run && !pruned.is_empty() {
        let mut ids: Vec<i64> = pruned.iter().copied().collect();
        ids.sort_unstable();
        for chunk in ids.chunks(PRUNE_BATCH) {
            refs.lock().unwrap_or_else(|p| p.into_inner()).delete_history(chunk)?;
        }
        tracing::info!(event = "history_pruned", versions = ids.len());
    }
    Ok(pruned)
}

/// Each head's roots: its history rows the retention kept (counted: its versions) and its
/// live target.
fn retained_by_head<'a>(
    rows: &'a [HistoryRow],
    live: &'a [(String, Ref)],
    pruned: &HashSet<i64>,
) -> HashMap<&'a str, (usize, Vec<&'a Ref>)> {
    let mut by_head: HashMap<&str, (usize, Vec<&Ref>)> = HashMap::new();
    for row in rows.iter().filter(|r| !pruned.contains(&r.id)) {
        let entry = by_head.entry(&row.name).or_default();
        entry.0 += 1;
        entry.1.push(&row.target);
    }
    for (name, target) in live {
        by_head.entry(name).or_default().1.push(target);
    }
    by_head
}

/// The stored objects no root reached and no reader or writer may still be using (counted
/// in `report` otherwise); none at all when a kept version reaches an unreadable record.
fn unreached(stored: Vec<Stored>, mark: &Mark, in_use: InUseAfter, report: &mut Report) -> Vec<Stored> {
    let mut doomed = Vec::new();
    for s in stored {
        if mark.reached.contains(&s.raw) {
            continue;
        }
        if in_use.holds(s.mtime_ns, s.atime_ns) {
            report.objects_kept_young += 1;
        } else {
            doomed.push(s);
        }
    }
    if mark.unreadable_count > 0 && !doomed.is_empty() {
        // What only an unreadable record reaches is unknown: deleting nothing is the only
        // answer that cannot lose a kept version's objects.
        report.sweep_stopped = Some(format!(
            "{} record(s) a kept version reaches could not be read, so what they reach is unknown and \
             nothing was deleted; repair the workspaces they belong to (`runnerctl repair`) or wait for \
             the retention to prune them",
            mark.unreadable_count
        ));
        doomed.clear();
    }
    doomed
}

/// What the sweep works with besides the doomed objects.
struct Sweep<'a, 'r> {
    store: &'a Store,
    dirs: &'a BlobDirs,
    lock: &'a dyn Fn() -> std::sync::MutexGuard<'r, Refs>,
    disk_of: &'a HashMap<[u8; 32], u64>,
    in_use: InUseAfter,
}

/// Deletes `doomed`, batch by batch under the sweep guard, each batch after marking the
/// roots committed since the mark (every commit appends a history row, so the rows after
/// `after` are all of them); each object is stat'ed again right before it is unlinked,
/// relative to its pool's directory, and kept if it is another file now or was written or
/// read meanwhile. What a batch deleted is forgotten by the store's caches before the
/// guard is released, whatever happens.
fn sweep(
    how: &Sweep<'_, '_>,
    mark: &mut Mark,
    doomed: &[Stored],
    mut after: i64,
    report: &mut Report,
) -> Result<(), VersionError> {
    let mut rest = doomed;
    while !rest.is_empty() {
        let (_guard, waited) = how.store.sweep_guard(PATIENCE);
        if waited {
            report.sweeps_waited += 1;
        }
        let (batch, after_batch) = rest.split_at(rest.len().min(if waited { FORCED_BATCH } else { BATCH }));
        rest = after_batch;
        let mut gone = HashSet::new();
        let deleted = (|| {
            // Roots committed since the mark (their commits are all done: we hold the
            // guard) may have reused an object the mark did not reach.
            let rows = (how.lock)().history_rows(after)?;
            after = rows.last().map_or(after, |r| r.id);
            let unreadable = mark.unreadable_count;
            for row in &rows {
                mark.walk(how.store, &row.target, &mut HashSet::new(), &mut Tally::default(), how.disk_of)?;
            }
            if mark.unreadable_count > unreadable {
                report.sweep_stopped = Some(
                    "a root committed meanwhile reaches a record that cannot be read; deletion stopped"
                        .into(),
                );
                return Ok(false);
            }
            for s in batch.iter().filter(|s| !mark.reached.contains(&s.raw)) {
                let dir = how.dirs.of(s.pool);
                match crate::fsat::Stat::at(dir, &s.name) {
                    Ok(now)
                        if now.kind() == libc::S_IFREG
                            && now.ino == s.ino
                            && !how.in_use.holds(now.mtime_ns, now.atime_ns) => {}
                    Ok(_) => {
                        report.objects_kept_young += 1;
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(super::io_err("stat an unreachable object", how.store.blob_dir(s.pool))(
                            e,
                        ));
                    }
                }
                match crate::fsat::unlink_at(dir, &s.name) {
                    Ok(()) => {
                        report.objects_deleted += 1;
                        report.disk_bytes_deleted += s.disk;
                        gone.insert(s.raw);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(super::io_err(
                            "delete an unreachable object",
                            how.store.blob_dir(s.pool),
                        )(e));
                    }
                }
            }
            Ok(true)
        })();
        how.store.forget_objects(&gone);
        if !deleted? {
            return Ok(());
        }
    }
    Ok(())
}

/// Every blob of both pools: regular files named by a digest (temporaries, planted links
/// and anything else are not objects and are left alone), listed and stat'ed relative to
/// the pools' directories.
fn list_stored(dirs: &BlobDirs) -> Result<Vec<Stored>, VersionError> {
    let mut out = Vec::new();
    for pool in [Pool::Data, Pool::AgentState] {
        let dir = dirs.of(pool);
        let failed = |action| move |e| super::io_err(action, format!("the {pool} pool's blobs"))(e);
        for (name, cname) in crate::fsat::names(dir).map_err(failed("list the objects of"))? {
            let Some(name) = name.to_str().filter(|n| is_digest_name(n)) else { continue };
            let Ok(st) = crate::fsat::Stat::at(dir, &cname) else { continue };
            if st.kind() != libc::S_IFREG {
                continue;
            }
            out.push(Stored {
                raw: digest_key(pool, name).1,
                pool,
                ino: st.ino,
                disk: st.blocks.saturating_mul(512),
                mtime_ns: st.mtime_ns,
                atime_ns: st.atime_ns,
                name: cname,
            });
        }
    }
    Ok(out)
}

fn is_digest_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The head names of workspace directories: `workspace_of`'s table for [`collect`].
pub fn head_names<'a>(roots: impl IntoIterator<Item = &'a Path>) -> HashMap<String, String> {
    roots
        .into_iter()
        .map(|root| (super::workspace_head_name(root), root.to_string_lossy().into_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::versioning::testutil::temp_store;
    use crate::versioning::{OCTET_STREAM, mutation_value};

    const NOW: Duration = Duration::ZERO;
    const HEAD: &str = "workspaces/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/head";
    const HEAD_B: &str = "workspaces/bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb/head";

    fn how(keep_versions: u64, keep_days: u64, dry_run: bool) -> Collection {
        Collection { retention: Retention { keep_versions, keep_days, pressed: false }, grace: NOW, dry_run }
    }

    /// A version of a one-file workspace: the file's content, its tree, the mutation.
    fn version(store: &Store, content: &[u8]) -> (Ref, Ref) {
        let file = store.put_stream(Pool::Data, &mut &content[..]).unwrap();
        let tree =
            store.put_record("WorkspaceTree", json!({"entries": [{"content": file.to_value()}]})).unwrap();
        let id = crate::versioning::new_uuid_v4();
        (file, store.put_record("WorkspaceMutation", mutation_value(Some(&id), "t", true, &tree)).unwrap())
    }

    fn commit(store: &Store, refs: &Mutex<Refs>, name: &str, record: &Ref) {
        let mut r = refs.lock().unwrap();
        let head = r.head(name).unwrap();
        r.commit(store, name, head.as_ref(), record).unwrap();
    }

    /// Makes every blob as old as `age`, written and read (the grace is about both).
    fn age_all(store: &Store, age: Duration) {
        let when = SystemTime::now() - age;
        for pool in [Pool::Data, Pool::AgentState] {
            for entry in std::fs::read_dir(store.blob_dir(pool)).unwrap().flatten() {
                // Never through a planted link (as root it would age /etc/passwd).
                if !entry.file_type().unwrap().is_file() {
                    continue;
                }
                let f = std::fs::File::options().write(true).open(entry.path()).unwrap();
                f.set_times(std::fs::FileTimes::new().set_modified(when).set_accessed(when)).unwrap();
            }
        }
    }

    #[test]
    fn unreachable_objects_go_and_every_reachable_one_stays() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let (old_file, v1) = version(&store, b"first");
        commit(&store, &refs, HEAD, &v1);
        let (new_file, v2) = version(&store, b"second");
        commit(&store, &refs, HEAD, &v2);
        // An orphan a failed snapshot left, and a record only a managed execution names.
        let orphan = store.put(Pool::Data, b"orphan", OCTET_STREAM).unwrap();
        let (managed_file, managed) = version(&store, b"managed");
        age_all(&store, Duration::from_secs(40 * 86_400));
        let names = |_: &str| None;

        // Dry: counts, deletes nothing.
        let dry = collect(&store, &refs, std::slice::from_ref(&managed), &names, how(1, 1, true)).unwrap();
        assert_eq!((dry.versions_pruned, dry.objects_deleted), (1, 0));
        assert!(store.has(&orphan) && store.has(&old_file));

        let report =
            collect(&store, &refs, std::slice::from_ref(&managed), &names, how(1, 1, false)).unwrap();
        assert_eq!(report.versions_pruned, 1, "{report:?}");
        // v1's mutation, tree and file, and the orphan.
        assert_eq!((report.objects_deleted, report.objects_missing), (4, 0), "{report:?}");
        assert!(!store.has(&orphan) && !store.has(&old_file) && !store.has(&v1));
        for kept in [&v2, &new_file, &managed, &managed_file] {
            assert!(store.has(kept), "{kept:?}");
            store.validate_closure(kept).unwrap();
        }
        assert_eq!(refs.lock().unwrap().history(HEAD).unwrap(), vec![v2.clone()]);
        let account = report.workspaces.iter().find(|w| w.name == HEAD).unwrap();
        assert_eq!((account.versions, account.objects), (1, 3));
        assert_eq!(
            account.bytes,
            v2.size + new_file.size + store.read_record(&v2, None).unwrap().dependencies[0].size
        );

        // Nothing left to do: a second collection deletes nothing.
        let again = collect(&store, &refs, &[managed], &names, how(1, 1, false)).unwrap();
        assert_eq!((again.versions_pruned, again.objects_deleted), (0, 0));
    }

    #[test]
    fn young_objects_and_retained_history_stay() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let (_, v1) = version(&store, b"one");
        commit(&store, &refs, HEAD, &v1);
        let (_, v2) = version(&store, b"two");
        commit(&store, &refs, HEAD, &v2);
        let orphan = store.put(Pool::Data, b"young orphan", OCTET_STREAM).unwrap();
        let names = |_: &str| None;
        // Everything is new: the days keep v1, the grace keeps the orphan.
        let grace = Collection { grace: Duration::from_secs(3600), ..how(1, 30, false) };
        let report = collect(&store, &refs, &[], &names, grace).unwrap();
        assert_eq!((report.versions_pruned, report.objects_deleted, report.objects_kept_young), (0, 0, 1));
        assert!(store.has(&orphan) && store.has(&v1));
        // Retention off (0 days): nothing pruned however old.
        age_all(&store, Duration::from_secs(400 * 86_400));
        let off = collect(&store, &refs, &[], &names, how(1, 0, false)).unwrap();
        assert_eq!((off.versions_pruned, off.objects_deleted), (0, 1));
        assert!(store.has(&v1) && !store.has(&orphan));
    }

    #[test]
    fn an_object_another_head_still_reaches_stays() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let (file, v1) = version(&store, b"content");
        commit(&store, &refs, HEAD, &v1);
        let (_, v2) = version(&store, b"other");
        commit(&store, &refs, HEAD, &v2);
        age_all(&store, Duration::from_secs(40 * 86_400));
        // Another head reuses v1's file: pruning a's history leaves it reachable.
        let tree =
            store.put_record("WorkspaceTree", json!({"entries": [{"content": file.to_value()}]})).unwrap();
        commit(&store, &refs, HEAD_B, &tree);
        let names = |_: &str| None;
        let report = collect(&store, &refs, &[], &names, how(1, 1, false)).unwrap();
        assert_eq!(report.versions_pruned, 1);
        assert!(store.has(&file) && !store.has(&v1));
        store.validate_closure(&tree).unwrap();
    }

    #[test]
    fn damaged_records_are_named_and_planted_names_left_alone() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let (_, v1) = version(&store, b"x");
        commit(&store, &refs, HEAD, &v1);
        std::fs::remove_file(store.blob_path(Pool::AgentState, v1.hex())).unwrap();
        let planted = store.blob_dir(Pool::Data).join("f".repeat(64));
        std::os::unix::fs::symlink("/etc/passwd", &planted).unwrap();
        std::fs::write(store.blob_dir(Pool::Data).join("notes.txt"), b"x").unwrap();
        age_all(&store, Duration::from_secs(40 * 86_400));
        let report = collect(&store, &refs, &[], &|_| None, how(1, 1, false)).unwrap();
        assert_eq!((report.unreadable_count, report.objects_missing), (1, 1), "{report:?}");
        // What the missing record reached is unknown: nothing is deleted.
        assert_eq!(report.objects_deleted, 0, "{report:?}");
        assert!(
            report.sweep_stopped.as_deref().unwrap_or_default().contains("could not be read"),
            "{report:?}"
        );
        assert!(report.unreadable[0].contains(&v1.digest), "{:?}", report.unreadable);
        assert!(std::fs::symlink_metadata(&planted).is_ok());
        assert!(store.blob_dir(Pool::Data).join("notes.txt").exists());
    }

    #[test]
    fn a_file_holding_a_records_bytes_does_not_hide_the_records_children() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let child = store.put_stream(Pool::Data, &mut &b"the child"[..]).unwrap();
        let tree =
            store.put_record("WorkspaceTree", json!({"entries": [{"content": child.to_value()}]})).unwrap();
        // The same bytes as a file in the data pool, reached from the same version.
        let bytes = store.read(&tree).unwrap();
        let twin = store.put_stream(Pool::Data, &mut bytes.as_slice()).unwrap();
        assert_eq!(twin.hex(), tree.hex());
        let version = store.put_record("Test", json!({"a": twin.to_value(), "b": tree.to_value()})).unwrap();
        commit(&store, &refs, HEAD, &version);
        age_all(&store, Duration::from_secs(40 * 86_400));
        let report = collect(&store, &refs, &[], &|_| None, how(1, 1, false)).unwrap();
        assert_eq!((report.objects_deleted, report.objects_missing), (0, 0), "{report:?}");
        assert!(store.has(&child));
    }

    #[test]
    fn a_record_that_cannot_be_read_stops_every_deletion() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let leaf = store.put(Pool::Data, b"reached only through a deep record", OCTET_STREAM).unwrap();
        // Deeper than serde_json reads (the API process's JSON.parse reads it).
        let mut deep = json!({"leaf": leaf.to_value()});
        for _ in 0..200 {
            deep = json!([deep]);
        }
        let record = store.put_record("AgentState", deep).unwrap();
        commit(&store, &refs, "agents/x/head", &record);
        let orphan = store.put(Pool::Data, b"an orphan", OCTET_STREAM).unwrap();
        age_all(&store, Duration::from_secs(40 * 86_400));
        let report = collect(&store, &refs, &[], &|_| None, how(1, 1, false)).unwrap();
        assert_eq!((report.unreadable_count, report.objects_deleted), (1, 0), "{report:?}");
        assert!(store.has(&leaf) && store.has(&orphan));
    }

    #[test]
    fn only_workspace_histories_are_pruned() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        for name in ["agents/x/head", "workspace-exports/e", "workspaces/not-a-digest/head"] {
            let (_, v1) = version(&store, format!("{name} 1").as_bytes());
            commit(&store, &refs, name, &v1);
            if !name.starts_with("workspace-exports") {
                let (_, v2) = version(&store, format!("{name} 2").as_bytes());
                commit(&store, &refs, name, &v2);
            }
        }
        let (_, w1) = version(&store, b"w1");
        commit(&store, &refs, HEAD, &w1);
        let (_, w2) = version(&store, b"w2");
        commit(&store, &refs, HEAD, &w2);
        age_all(&store, Duration::from_secs(40 * 86_400));
        let report = collect(&store, &refs, &[], &|_| None, how(1, 1, false)).unwrap();
        assert_eq!(report.versions_pruned, 1, "only the workspace head's old version: {report:?}");
        assert!(!store.has(&w1) && store.has(&w2));
        assert!(is_workspace_head(HEAD) && !is_workspace_head("workspaces/x/head"));
    }

    #[test]
    fn an_object_read_lately_by_another_process_is_kept() {
        let (_dir, store) = temp_store();
        let refs = Mutex::new(Refs::open(&store).unwrap());
        let orphan = store.put(Pool::Data, b"read an hour ago", OCTET_STREAM).unwrap();
        let path = store.blob_path(Pool::Data, orphan.hex());
        let hour = SystemTime::now() - Duration::from_secs(3600);
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        let old = SystemTime::now() - Duration::from_secs(40 * 86_400);
        f.set_times(std::fs::FileTimes::new().set_modified(old).set_accessed(hour)).unwrap();
        let grace = Collection { grace: Duration::from_secs(600), ..how(1, 1, false) };
        let report = collect(&store, &refs, &[], &|_| None, grace).unwrap();
        assert_eq!((report.objects_deleted, report.objects_kept_young), (0, 1), "{report:?}");
        // runnerd's own reads do not refresh it (O_NOATIME): aged again, it goes.
        f.set_times(std::fs::FileTimes::new().set_modified(old).set_accessed(old)).unwrap();
        store.read(&orphan).unwrap();
        let report = collect(&store, &refs, &[], &|_| None, grace).unwrap();
        assert_eq!(report.objects_deleted, 1, "{report:?}");
    }
}
