//! `runnerd-bench workspace-scale` (issue #31, deliverable 4): what one execution costs as
//! the workspace grows. One runnerd; for remote workspaces of 0, 1k, 10k and 100k files of
//! 1 KiB in 100 directories, sequential signed `POST /execute-shell` of `true` (after one
//! warm-up run that commits the tree): p50 and runnerd's own CPU per execution; then
//! runnerd's CPU during `sleep 3` in a 20k-file workspace with the quota on (the default
//! 10 GiB) and off (`maxWorkspaceBytes: 0`), interleaved; bare bwrap `true` in the same run.
//! Figures only, never pass/fail.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use runnerctl::client::{RunnerClient, new_execution_id, permission_epoch};

use crate::{
    BENCH_TOKEN, bare_once, http_once, live_threads_cpu_ms, own_cpu_ms, setup, start_runnerd_with, stats,
};

/// The workspace sizes measured, and how many executions each (fewer where each is long).
const SIZES: [(usize, usize); 4] = [(0, 100), (1_000, 100), (10_000, 30), (100_000, 8)];
/// Files in the `sleep 3` case.
const SLEEP_FILES: usize = 20_000;

pub async fn bench(init: &Path) -> anyhow::Result<()> {
    let setup = setup().await?;
    let daemon = start_runnerd_with(init, "scale", &[])?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    let pid = daemon.child.id();
    let data = daemon.data_dir();

    let mut bare = Vec::new();
    let start = Instant::now();
    for _ in 0..50 {
        bare.push(bare_once(&setup.bwrap, &setup.args, &setup.program)?);
    }
    let bare = stats(bare, start.elapsed());
    println!("runnerd-bench workspace-scale: remote workspaces of N files of 1 KiB in 100 directories");
    println!("  bare bwrap true: p50 {:7.2} ms", bare.p50);

    let mut empty_p50 = None;
    for (files, n) in SIZES {
        let key = format!("bench/scale-{files}");
        http_once(&client, &key).await?;
        populate(&data.join("remote-workspaces").join(&key), files)?;
        // The first run after the files appear commits them (each hashed once).
        let first = http_once(&client, &key).await?;
        let cpu_before = own_cpu_ms(pid)?;
        let mut samples = Vec::with_capacity(n);
        let start = Instant::now();
        for _ in 0..n {
            samples.push(http_once(&client, &key).await?);
        }
        let wall = start.elapsed();
        let cpu = (own_cpu_ms(pid)? - cpu_before) / n as f64;
        let s = stats(samples, wall);
        let empty = *empty_p50.get_or_insert(s.p50);
        println!(
            "  {files:>7} files: true p50 {:8.2} ms ({:6.2}x empty, {:6.2}x bare bwrap), runnerd CPU {:8.2} ms/exec, \
             first run after the files appeared {:9.2} ms (n={n})",
            s.p50,
            s.p50 / empty,
            s.p50 / bare.p50,
            cpu,
            first.as_secs_f64() * 1000.0,
        );
    }

    let key = format!("bench/sleep-{SLEEP_FILES}");
    http_once(&client, &key).await?;
    populate(&data.join("remote-workspaces").join(&key), SLEEP_FILES)?;
    http_once(&client, &key).await?;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        on.push(sleep_cpu(&client, pid, &key, None).await?);
        off.push(sleep_cpu(&client, pid, &key, Some(0)).await?);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "  sleep 3 in {SLEEP_FILES} files: runnerd CPU (its threads' schedstat) quota on {:7.2} ms, quota off {:7.2} ms ({:5.2}x), runs {on:.2?} / {off:.2?}",
        mean(&on),
        mean(&off),
        mean(&on) / mean(&off).max(0.001),
    );

    // The overshoot: how far past the quota a run writing at full speed gets before it is
    // stopped, kept from the journal here and by the 25 ms walk in a runnerd without one.
    let walking = start_runnerd_with(init, "scale-walk", &[("SCIENCE_AGENT_JOURNAL_WORKSPACES", "0")])?;
    let walking_client = RunnerClient::new(walking.endpoint.clone(), BENCH_TOKEN);
    let mut over = (Vec::new(), Vec::new());
    for round in 0..3 {
        over.0.push(overshoot(&client, &data, &format!("bench/over-j{round}")).await?);
        over.1.push(overshoot(&walking_client, &walking.data_dir(), &format!("bench/over-w{round}")).await?);
    }
    let mib =
        |v: &[u64]| v.iter().map(|b| format!("{:.1}", *b as f64 / 1048576.0)).collect::<Vec<_>>().join(", ");
    println!(
        "  past a {} MiB quota, dd of {OVER_FILES} x {OVER_FILE_MIB} MiB files: journal {} MiB over, 25 ms walk {} MiB over",
        OVER_QUOTA >> 20,
        mib(&over.0),
        mib(&over.1),
    );
    Ok(())
}

const OVER_QUOTA: u64 = 64 << 20;
const OVER_FILES: usize = 64;
const OVER_FILE_MIB: usize = 16;

/// Bytes left in `key` past [`OVER_QUOTA`] after a run that writes files of 16 MiB (each
/// under the quota, so `RLIMIT_FSIZE` stops none of them) until it is stopped.
async fn overshoot(client: &RunnerClient, data: &Path, key: &str) -> anyhow::Result<u64> {
    let body = serde_json::json!({
        "agentId": "bench",
        "code": format!("for i in $(seq {OVER_FILES}); do dd if=/dev/zero of=f$i bs=1M count={OVER_FILE_MIB} 2>/dev/null; done"),
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(key),
        "runnerWorkspaceKey": key,
        "maxWorkspaceBytes": OVER_QUOTA,
    });
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 400 {
        bail!("the quota did not stop the run: {} {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    let mut total = 0;
    for entry in std::fs::read_dir(data.join("remote-workspaces").join(key))? {
        total += entry?.metadata()?.len();
    }
    Ok(total.saturating_sub(OVER_QUOTA))
}

/// `files` files of 1 KiB (distinct contents) spread over 100 directories under `dir`.
fn populate(dir: &Path, files: usize) -> anyhow::Result<()> {
    if files == 0 {
        return Ok(());
    }
    for d in 0..100 {
        std::fs::create_dir_all(dir.join(format!("d{d:02}")))?;
    }
    let mut block = vec![b'x'; 1024];
    for i in 0..files {
        let tag = format!("{i:>16}");
        block[..16].copy_from_slice(tag.as_bytes());
        std::fs::write(dir.join(format!("d{:02}/f{i}", i % 100)), &block)?;
    }
    Ok(())
}

/// runnerd's CPU during one `sleep 3` in `key` (`quota`: `maxWorkspaceBytes`, the default
/// when `None`), in ms, from its threads' schedstat ([`live_threads_cpu_ms`]).
async fn sleep_cpu(client: &RunnerClient, pid: u32, key: &str, quota: Option<u64>) -> anyhow::Result<f64> {
    let mut body = serde_json::json!({
        "agentId": "bench",
        "code": "sleep 3",
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(key),
        "runnerWorkspaceKey": key,
    });
    if let Some(q) = quota {
        body["maxWorkspaceBytes"] = q.into();
    }
    let before = live_threads_cpu_ms(pid)?;
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 200 {
        bail!("runnerd answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    let spent = live_threads_cpu_ms(pid)? - before;
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok(spent)
}
