//! `runnerd-bench versions`: the cost of committing a workspace version, against the two
//! limits of the same tree in the same run: a stat walk (`find -type f -printf '%s'`) and
//! hashing every byte (`sha256sum`). Cases: (1) the first commit of a fresh workspace,
//! (2) a commit after one file changed, (3) a commit with nothing changed. Then the live-log
//! throughput of a managed run printing 100 MB through a real runnerd.
//! Figures only, never pass/fail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use runnerctl::client::{RunnerClient, new_execution_id, permission_epoch};
use runnerd::writer::Versions;

/// What to build: `files` files over 100 directories, `bytes` in total.
#[derive(Debug, Clone, Copy)]
pub struct TreeSize {
    pub files: usize,
    pub bytes: u64,
}

/// Deterministic, incompressible, distinct content per file (xorshift64*).
pub(crate) fn fill(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn build_tree(root: &Path, size: TreeSize) -> anyhow::Result<Vec<PathBuf>> {
    let per_file = (size.bytes / size.files as u64) as usize;
    let mut buf = vec![0u8; per_file];
    let mut paths = Vec::with_capacity(size.files);
    for i in 0..size.files {
        let dir = root.join(format!("d{:03}", i % 100));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join(format!("f{i:05}.bin"));
        fill(i as u64 + 1, &mut buf);
        std::fs::write(&path, &buf)?;
        paths.push(path);
    }
    Ok(paths)
}

fn timed_shell(script: &str) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let status = Command::new("/bin/sh").args(["-c", script]).status()?;
    if !status.success() {
        bail!("`{script}` failed: {status}");
    }
    Ok(start.elapsed())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The commit benchmark; `dir` is scratch space (removed afterwards).
pub async fn commit_cost(dir: &Path, size: TreeSize) -> anyhow::Result<()> {
    let data = dir.join("data");
    let ws = data.join("remote-workspaces/bench/ws");
    std::fs::create_dir_all(&ws)?;
    let ws = ws.canonicalize()?;
    let paths = write_tree(&ws, size).await?;
    let (walk, hash) = walk_and_hash(&ws)?;
    let commits = measure_commits(&data, &ws, &paths, size).await?;
    print_commit_cost(walk, hash, &commits);
    Ok(())
}

/// The workspace's tree, written, synced and old enough for snapshots to trust their cache.
async fn write_tree(ws: &Path, size: TreeSize) -> anyhow::Result<Vec<PathBuf>> {
    println!(
        "workspace: {} files in 100 directories, {:.2} GiB, under {}",
        size.files,
        size.bytes as f64 / (1u64 << 30) as f64,
        ws.display()
    );
    let start = Instant::now();
    let paths = build_tree(ws, size)?;
    timed_shell("sync")?;
    println!("(tree written and synced in {:.1} s)", start.elapsed().as_secs_f64());
    // Snapshots trust their cache only for files changed more than 2 s ago.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    Ok(paths)
}

/// The yardsticks, from a warm page cache: the quickest of three stat walks of the tree,
/// and one sha256sum of every byte.
fn walk_and_hash(ws: &Path) -> anyhow::Result<(Duration, Duration)> {
    let quoted = format!("'{}'", ws.display());
    let walk_cmd = format!("find {quoted} -type f -printf '%s\\n' > /dev/null");
    let hash_cmd = format!("find {quoted} -type f -print0 | xargs -0 sha256sum > /dev/null");
    // Warm the page cache once, so every case reads from memory.
    timed_shell(&hash_cmd)?;
    let walk = (0..3).map(|_| timed_shell(&walk_cmd)).collect::<Result<Vec<_>, _>>()?;
    let walk = *walk.iter().min().context("three walks")?;
    let hash = timed_shell(&hash_cmd)?;

    Ok((walk, hash))
}

/// What the commits cost, and which files they hashed.
struct Commits {
    first: Duration,
    /// Medians: of the unchanged commits (three unless `RUNNER_BENCH_REPEAT`), of the three
    /// one-file ones.
    unchanged: Duration,
    one_changed: Duration,
    /// Of an unchanged commit: the snapshot alone, the closure check alone.
    snapshot_only: Duration,
    closure_only: Duration,
    hashed_first: u64,
    hashed_unchanged: u64,
    hashed_changed: u64,
    blobs_reverified: u64,
}

/// (1) the first commit, (3) commits with nothing changed, (2) commits after one file
/// changed, then an unchanged commit's snapshot and closure check alone.
async fn measure_commits(
    data: &Path,
    ws: &Path,
    paths: &[PathBuf],
    size: TreeSize,
) -> anyhow::Result<Commits> {
    let versions = Arc::new(Versions::open(data)?);
    let pinned = || runnerd::workspace::open_beneath(data, ws).map_err(|e| anyhow::anyhow!(e.to_string()));
    // (1) The first commit: the baseline a workspace's first writer commits.
    let start = Instant::now();
    let writer = versions.begin(ws, pinned()?, None).await?;
    let first = start.elapsed();
    let hashed_first = versions.store().files_hashed();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    // (3) Nothing changed.
    let mut unchanged = Vec::new();
    // RUNNER_BENCH_REPEAT: more unchanged commits, to profile that case alone.
    let repeat = std::env::var("RUNNER_BENCH_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    for _ in 0..repeat {
        let start = Instant::now();
        versions.commit_mutation(&writer, "bench-unchanged", None, true).await?;
        unchanged.push(start.elapsed());
    }
    let hashed_unchanged = versions.store().files_hashed() - hashed_first;
    // (2) One file changed (a different one each time).
    let mut one_changed = Vec::new();
    let per_file = (size.bytes / size.files as u64) as usize;
    let mut buf = vec![0u8; per_file];
    for round in 0..3u64 {
        fill(1_000_000 + round, &mut buf);
        std::fs::write(&paths[(round as usize * 997) % paths.len()], &buf)?;
        let start = Instant::now();
        versions.commit_mutation(&writer, "bench-one-file", None, true).await?;
        one_changed.push(start.elapsed());
    }
    let hashed_changed = versions.store().files_hashed() - hashed_first - hashed_unchanged;
    drop(writer);
    // Where an unchanged commit's time goes: the snapshot alone, the closure check alone.
    let start = Instant::now();
    let tree = versions.store().snapshot(ws)?;
    let snapshot_only = start.elapsed();
    let start = Instant::now();
    versions.store().validate_closure(&tree)?;
    let closure_only = start.elapsed();
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (unchanged, one_changed) = (median(&mut unchanged), median(&mut one_changed));
    Ok(Commits {
        first,
        unchanged,
        one_changed,
        snapshot_only,
        closure_only,
        hashed_first,
        hashed_unchanged,
        hashed_changed,
        blobs_reverified: versions.store().blobs_reverified(),
    })
}

/// The table: each commit against the walk and against sha256sum.
fn print_commit_cost(walk: Duration, hash: Duration, c: &Commits) {
    println!("{:<52} {:>10} {:>10} {:>10}", "case", "ms", "/ walk", "/ sha256");
    let row = |name: &str, d: Duration| {
        println!(
            "{name:<52} {:>10.1} {:>10.2} {:>10.3}",
            ms(d),
            d.as_secs_f64() / walk.as_secs_f64(),
            d.as_secs_f64() / hash.as_secs_f64()
        );
    };
    row("stat walk: find -type f -printf '%s'", walk);
    row("hash every byte: sha256sum", hash);
    row("(1) first commit (target <= 1.2x sha256sum)", c.first);
    row("(2) commit after one file changed (target <= 2x walk)", c.one_changed);
    row("(3) commit with nothing changed (target <= 2x walk)", c.unchanged);
    println!(
        "of an unchanged commit: snapshot {:.1} ms, closure check {:.1} ms, the rest (records, refs, fsyncs) the remainder",
        ms(c.snapshot_only),
        ms(c.closure_only)
    );
    println!(
        "files hashed: (1) {}, (3) {} over 3 commits, (2) {} over 3 commits; blobs re-verified by closure checks: {}",
        c.hashed_first, c.hashed_unchanged, c.hashed_changed, c.blobs_reverified
    );
}

/// Live-log throughput: a managed run printing `megabytes` MB, from 202 to `completed`,
/// against the same command run synchronously in the same runnerd.
pub async fn log_throughput(client: &RunnerClient, megabytes: u64) -> anyhow::Result<()> {
    let bytes = megabytes * 1_000_000;
    let code = format!("head -c {bytes} /dev/zero | tr '\\0' 'x' | fold -w 99");
    let body = |id: String| {
        serde_json::json!({
            "agentId": "bench",
            "code": code,
            "executionId": id,
            "permissionEpoch": permission_epoch("bench-logs"),
            "runnerWorkspaceKey": "bench/logs",
            "maxOutputBytes": 0,
        })
    };
    let start = Instant::now();
    let reply = client.post_signed("/execute-shell", &body(new_execution_id())).await?;
    if reply.status != 200 {
        bail!("sync run failed: {}", String::from_utf8_lossy(&reply.body));
    }
    let sync = start.elapsed();
    drop(reply);

    let id = new_execution_id();
    let start = Instant::now();
    let reply = client.post_signed("/shell-executions", &body(id.clone())).await?;
    if reply.status != 202 {
        bail!("managed start failed: {}", String::from_utf8_lossy(&reply.body));
    }
    let query = "sessionId=bench-logs&agentId=bench";
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let rec = client.get(&format!("/shell-executions/{id}?{query}")).await?;
        let state = rec.json()["state"].as_str().unwrap_or("").to_owned();
        match state.as_str() {
            "completed" => break,
            "queued" | "running" => {}
            other => bail!("managed run ended {other}: {}", rec.json()["error"]),
        }
    }
    let managed = start.elapsed();
    let mb = |d: Duration| bytes as f64 / 1e6 / d.as_secs_f64();
    println!("{:<52} {:>10} {:>10}", "log throughput", "s", "MB/s");
    println!(
        "{:<52} {:>10.2} {:>10.1}",
        format!("sync /execute-shell printing {megabytes} MB"),
        sync.as_secs_f64(),
        mb(sync)
    );
    println!(
        "{:<52} {:>10.2} {:>10.1}",
        format!("managed run printing {megabytes} MB (202 -> completed)"),
        managed.as_secs_f64(),
        mb(managed)
    );
    std::io::stdout().flush()?;
    Ok(())
}
