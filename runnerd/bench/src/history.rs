//! `runnerd-bench history` (issue #32): what the version store costs and what bounding it
//! costs. One runnerd (retention: the newest 10 versions, after a day; no grace), figures
//! only, bare bwrap `true` in the same run:
//! * the red team's case: two runs that each leave a distinct 256 MiB sparse file — the
//!   store's growth on disk against the files' length (what a dense store wrote);
//! * 200 runs that each rewrite a 256 KiB file: the store on disk, then one collection
//!   (its time, what it deleted) after the versions are made to look 40 days old;
//! * `true` p50 in a 1k-file workspace while collections run back to back, against
//!   without, interleaved rounds.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use runnerctl::client::{RunnerClient, new_execution_id, permission_epoch};

use crate::{BENCH_TOKEN, bare_once, http_once, setup, start_runnerd_with, stats};

/// Bytes allocated under `dir`.
fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.path().symlink_metadata() else { continue };
        total += m.blocks() * 512;
        if m.is_dir() {
            total += allocated(&e.path());
        }
    }
    total
}

async fn shell(client: &RunnerClient, key: &str, code: &str) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "agentId": "bench",
        "code": code,
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(key),
        "runnerWorkspaceKey": key,
        "maxWorkspaceBytes": 1u64 << 30,
    });
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 200 || reply.json()["exitCode"] != 0 {
        bail!("runnerd answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(())
}

async fn collect(client: &RunnerClient) -> anyhow::Result<serde_json::Value> {
    let reply = client.post_json("/versioning/gc", &serde_json::json!({})).await?;
    if reply.status != 200 {
        bail!("collection answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(reply.json())
}

/// Every stored object made to look written and read `age` ago.
fn age_objects(data: &Path, age: Duration) -> anyhow::Result<()> {
    let when = SystemTime::now() - age;
    for pool in ["data", "agent-state"] {
        for e in std::fs::read_dir(data.join("versioning").join(pool).join("blobs/sha256"))?.flatten() {
            let f = std::fs::File::options().write(true).open(e.path())?;
            f.set_times(std::fs::FileTimes::new().set_modified(when).set_accessed(when))?;
        }
    }
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;

pub async fn bench(init: &Path) -> anyhow::Result<()> {
    let setup = setup().await?;
    let env = [
        ("SCIENCE_AGENT_HISTORY_KEEP_VERSIONS", "10"),
        ("SCIENCE_AGENT_HISTORY_KEEP_DAYS", "1"),
        ("SCIENCE_AGENT_HISTORY_GC_GRACE_SECS", "0"),
        ("SCIENCE_AGENT_HISTORY_GC_INTERVAL_SECS", "0"),
        ("SCIENCE_AGENT_HISTORY_GC_FREE_PERCENT", "0"),
    ];
    let daemon = start_runnerd_with(init, "history", &env)?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    let data = daemon.data_dir();
    let store = data.join("versioning");

    let mut bare = Vec::new();
    let start = Instant::now();
    for _ in 0..50 {
        bare.push(bare_once(&setup.bwrap, &setup.args, &setup.program)?);
    }
    let bare = stats(bare, start.elapsed());
    println!("runnerd-bench history: the version store's growth and the collector's cost");
    println!("  bare bwrap true: p50 {:7.2} ms", bare.p50);

    sparse_growth(&client, &store).await?;
    churn_and_collect(&client, &data, &store).await?;
    with_collections(&client, &daemon, bare.p50).await?;
    Ok(())
}

/// The red team's case: two runs that each leave a distinct 256 MiB sparse file, and the
/// store's growth on disk.
async fn sparse_growth(client: &RunnerClient, store: &Path) -> anyhow::Result<()> {
    shell(client, "bench/sparse", "true").await?;
    let before = allocated(store);
    for i in 1..=2 {
        let code = format!("rm -f big; printf 'run {i}' > big; truncate -s 256M big");
        shell(client, "bench/sparse", &code).await?;
    }
    let grew = allocated(store) - before;
    println!(
        "  two runs leaving distinct 256 MiB sparse files: store grew {:.3} MiB on disk (the files' \
         length, what a dense store wrote: 512 MiB; {:.0}x less)",
        grew as f64 / MIB,
        512.0 * MIB / grew.max(1) as f64
    );
    Ok(())
}

/// 200 runs rewriting a 256 KiB file, then one collection once its versions look 40 days old.
async fn churn_and_collect(client: &RunnerClient, data: &Path, store: &Path) -> anyhow::Result<()> {
    let key = "bench/churn";
    shell(client, key, "true").await?;
    let before = allocated(store);
    for i in 0..200 {
        let code = format!("head -c 262144 /dev/urandom > f; echo {i} > n");
        shell(client, key, &code).await?;
    }
    let churned = allocated(store) - before;
    let total = allocated(store);
    age_objects(data, Duration::from_secs(40 * 86_400))?;
    let report = collect(client).await?;
    let after = allocated(store);
    println!(
        "  200 runs rewriting a 256 KiB file: store +{:.1} MiB; one collection (keep 10 versions): \
         {} ms, {} versions pruned, {} objects deleted ({:.1} MiB), store {:.1} -> {:.1} MiB",
        churned as f64 / MIB,
        report["tookMs"],
        report["versionsPruned"],
        report["objectsDeleted"],
        report["diskBytesDeleted"].as_u64().unwrap_or(0) as f64 / MIB,
        total as f64 / MIB,
        after as f64 / MIB,
    );
    Ok(())
}

/// `true` p50 in a 1k-file workspace, rounds without collections interleaved with rounds
/// while they run back to back (`bare_p50`: bare bwrap's, for the ratio).
async fn with_collections(
    client: &RunnerClient,
    daemon: &crate::Daemon,
    bare_p50: f64,
) -> anyhow::Result<()> {
    let key = "bench/busy";
    shell(client, key, "mkdir -p d; for i in $(seq 1 1000); do echo $i > d/$i; done").await?;
    http_once(client, key).await?;
    let rounds = 5;
    let per_round = 20;
    let (mut quiet, mut busy) = (Vec::new(), Vec::new());
    let (mut quiet_wall, mut busy_wall) = (Duration::ZERO, Duration::ZERO);
    let mut collections = 0u64;
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..per_round {
            quiet.push(http_once(client, key).await?);
        }
        quiet_wall += start.elapsed();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let collector = {
            let (client, stop) = (RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    collect(&client).await.context("a collection during the round")?;
                    n += 1;
                }
                anyhow::Ok(n)
            })
        };
        let start = Instant::now();
        for _ in 0..per_round {
            busy.push(http_once(client, key).await?);
        }
        busy_wall += start.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        collections += collector.await??;
    }
    let (quiet, busy) = (stats(quiet, quiet_wall), stats(busy, busy_wall));
    println!(
        "  true in a 1k-file workspace: p50 {:.2} ms without collections, {:.2} ms with {} back to back \
         ({:.2}x; {:.2}x bare bwrap), p95 {:.2} / {:.2} ms",
        quiet.p50,
        busy.p50,
        collections,
        busy.p50 / quiet.p50,
        busy.p50 / bare_p50,
        quiet.p95,
        busy.p95
    );
    Ok(())
}
