//! `runnerd-bench metrics`: the cost of being scraped. One runnerd, sequential signed
//! `POST /execute-shell` of `true`, in interleaved rounds without and with a scraper asking
//! `GET /metrics` every second (as Prometheus would, at a shorter interval than its default),
//! so drift hits both alike. Prints p50/p95 of each, their ratio, and the scrape's own p50
//! and size. Figures only, never pass/fail.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;

use crate::{BENCH_TOKEN, Stats, http_once, start_runnerd_with, stats};
use runnerctl::client::RunnerClient;

const ROUNDS: usize = 10;

pub async fn bench(init: &std::path::Path, n: usize) -> anyhow::Result<()> {
    let daemon = start_runnerd_with(init, "metrics", &[])?;
    let client = Arc::new(RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN));
    for _ in 0..5 {
        http_once(&client, "bench/metrics").await?;
    }
    let per_round = (n / ROUNDS).max(2);
    println!(
        "runnerd-bench metrics: {} sequential executions per case in {ROUNDS} interleaved rounds; \
         scraper: GET /metrics every 1 s",
        per_round * ROUNDS
    );
    let (mut quiet, mut scraped) = (Vec::new(), Vec::new());
    let (mut quiet_wall, mut scraped_wall) = (Duration::ZERO, Duration::ZERO);
    let mut scrapes = Vec::new();
    let mut size = 0usize;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..per_round {
            quiet.push(http_once(&client, "bench/metrics").await?);
        }
        quiet_wall += start.elapsed();

        let stop = Arc::new(AtomicBool::new(false));
        let scraper = tokio::spawn(scrape_every_second(client.clone(), stop.clone()));
        let start = Instant::now();
        for _ in 0..per_round {
            scraped.push(http_once(&client, "bench/metrics").await?);
        }
        scraped_wall += start.elapsed();
        stop.store(true, Ordering::SeqCst);
        let (times, bytes) = scraper.await??;
        scrapes.extend(times);
        size = size.max(bytes);
    }
    let q: Stats = stats(quiet, quiet_wall);
    let s: Stats = stats(scraped, scraped_wall);
    println!("  without scraping   p50 {:7.2} ms   p95 {:7.2} ms   {:6.1} exec/s", q.p50, q.p95, q.per_sec);
    println!("  scraped every 1 s  p50 {:7.2} ms   p95 {:7.2} ms   {:6.1} exec/s", s.p50, s.p95, s.per_sec);
    println!("  ratio (scraped / without): p50 {:.3}, p95 {:.3}", s.p50 / q.p50, s.p95 / q.p95);
    if !scrapes.is_empty() {
        let wall: Duration = scrapes.iter().sum();
        let sc = stats(scrapes.clone(), wall);
        println!("  GET /metrics itself: {} scrapes, p50 {:.2} ms, {} bytes", scrapes.len(), sc.p50, size);
    }
    Ok(())
}

/// Scrapes at once and then every second until `stop`; the scrapes' durations and the
/// largest answer.
async fn scrape_every_second(
    client: Arc<RunnerClient>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Vec<Duration>, usize)> {
    let mut times = Vec::new();
    let mut size = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let start = Instant::now();
        let reply = client.get("/metrics").await?;
        if reply.status != 200 {
            bail!("GET /metrics answered {}", reply.status);
        }
        times.push(start.elapsed());
        size = size.max(reply.body.len());
    }
    Ok((times, size))
}
