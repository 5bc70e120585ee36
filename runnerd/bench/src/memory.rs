//! `runnerd-bench memory`: does runnerd give memory back after load (issue #15 item 10)?
//!
//! Two runnerds run side by side under the same load: one with glibc's defaults
//! (`RUNNERD_UNTUNED_MALLOC=1`, as before the change) and one as shipped ([`runnerd::memory`]).
//! For each: RSS idle (after a warm-up), the peak (`VmHWM`) through N concurrent requests
//! (signed `POST /execute-shell` of `true` over distinct workspaces, together with
//! `GET /status`; a 503 `queue_full` counts as answered), RSS `settle` seconds later, then
//! RSS `settle` seconds after M sequential executions. Figures, never pass/fail.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::{BENCH_TOKEN, Daemon, http_once, rss_kib, start_runnerd_with};
use runnerctl::client::RunnerClient;

struct Row {
    idle: u64,
    peak_concurrent: u64,
    after_concurrent: u64,
    before_sequential: u64,
    after_sequential: u64,
    peak: u64,
    refused: usize,
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// N requests at once: half executions, half `/status`; answers that are not 200 (a full
/// queue's 503) are counted, not failures.
async fn concurrent(client: &Arc<RunnerClient>, n: usize) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                if i % 2 == 0 {
                    http_once(&client, &format!("bench/mem-{}", i % 64)).await.is_ok()
                } else {
                    client.get("/status").await.is_ok_and(|r| r.status == 200)
                }
            })
        })
        .collect();
    let mut refused = 0;
    for t in tasks {
        if !t.await.unwrap_or(false) {
            refused += 1;
        }
    }
    refused
}

async fn sequential(client: &RunnerClient, n: usize) -> anyhow::Result<()> {
    for _ in 0..n {
        http_once(client, "bench/mem-seq").await?;
    }
    Ok(())
}

fn pid(d: &Daemon) -> u32 {
    d.child.id()
}

pub async fn bench(n_concurrent: usize, n_sequential: usize, settle: Duration) -> anyhow::Result<()> {
    let setup = crate::setup().await?;
    let init: &Path = setup.launcher.init_path();
    let before = start_runnerd_with(init, "mem-untuned", &[("RUNNERD_UNTUNED_MALLOC", "1")])?;
    let after = start_runnerd_with(init, "mem-tuned", &[])?;
    let clients = [
        Arc::new(RunnerClient::new(before.endpoint.clone(), BENCH_TOKEN)),
        Arc::new(RunnerClient::new(after.endpoint.clone(), BENCH_TOKEN)),
    ];
    let pids = [pid(&before), pid(&after)];
    println!(
        "runnerd-bench memory: {n_concurrent} concurrent requests, {n_sequential} sequential executions, \
         settle {} s; glibc defaults (before) and runnerd's tuning (after), side by side\n",
        settle.as_secs()
    );
    for c in &clients {
        for _ in 0..5 {
            http_once(c, "bench/mem-warm").await?;
        }
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let idle = pids.map(|p| rss_kib(p, "VmRSS:"));

    let (r0, r1) = tokio::join!(concurrent(&clients[0], n_concurrent), concurrent(&clients[1], n_concurrent));
    let peak_concurrent = pids.map(|p| rss_kib(p, "VmHWM:"));
    tokio::time::sleep(settle).await;
    let after_concurrent = pids.map(|p| rss_kib(p, "VmRSS:"));

    let before_sequential = pids.map(|p| rss_kib(p, "VmRSS:"));
    let (s0, s1) = tokio::join!(sequential(&clients[0], n_sequential), sequential(&clients[1], n_sequential));
    s0?;
    s1?;
    let peak = pids.map(|p| rss_kib(p, "VmHWM:"));
    tokio::time::sleep(settle).await;
    let after_sequential = pids.map(|p| rss_kib(p, "VmRSS:"));

    let rows = [0, 1].map(|i| Row {
        idle: idle[i],
        peak_concurrent: peak_concurrent[i],
        after_concurrent: after_concurrent[i],
        before_sequential: before_sequential[i],
        after_sequential: after_sequential[i],
        peak: peak[i],
        refused: [r0, r1][i],
    });
    println!(
        "{:<26} {:>9} {:>16} {:>18} {:>18} {:>10} {:>9}",
        "MiB", "idle", "peak (conc.)", "settled (conc.)", "seq: start → end", "peak", "non-200"
    );
    for (name, r) in [("before (glibc defaults)", &rows[0]), ("after (runnerd tuning)", &rows[1])] {
        println!(
            "{name:<26} {:>9} {:>16} {:>18} {:>18} {:>10} {:>9}",
            mib(r.idle),
            mib(r.peak_concurrent),
            mib(r.after_concurrent),
            format!("{} → {}", mib(r.before_sequential), mib(r.after_sequential)),
            mib(r.peak),
            r.refused
        );
    }
    drop((before, after));
    Ok(())
}
