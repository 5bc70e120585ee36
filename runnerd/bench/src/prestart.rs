//! `runnerd-bench prestart` (issue #37): an agent calling `/execute-shell true` again and
//! again in one workspace, with sandboxes started ahead against without, and bare bwrap with
//! the same shell in the same interleaved rounds; the hit rate, the floor that remains (the
//! phases of a call served ahead), CPU per execution (runnerd's own and its sandboxes'),
//! a miss's cost (every call in a new workspace), the memory of a waiting sandbox, and the
//! throughput of 2, 4 and 8 clients. `RUNNERD_BENCH_ORIGINAL_URL` (and `_TOKEN`, `_PID`)
//! names the original runner to measure in the same rounds; without it, the original's
//! figures from the issue are shown as ratios to their own bare bwrap.

use std::time::{Duration, Instant};

use runnerctl::client::{Endpoint, RunnerClient};
use serde_json::Value;

use crate::{
    BENCH_TOKEN, Daemon, Setup, Stats, Until, bare_shell_runs, cpu_ms, http_once_as, in_pipeline_order,
    rss_kib, scrape, start_runnerd_with, stats,
};

/// Interleaved rounds of the sequential cases.
const ROUNDS: usize = 4;

/// The original runner's figures as issue #37 quotes them (one quiet run elsewhere, bare
/// bwrap `true` 4.15 ms there): sequential p50, CPU per execution (server + sandbox tree),
/// executions/s at 2, 4, 8 clients.
const ORIGINAL_ISSUE: (f64, f64, f64, [f64; 3]) = (8.44, 3.17 + 2.21, 4.15, [158.0, 165.0, 161.0]);

/// A runnerd measured, or the original.
struct Subject {
    name: &'static str,
    client: RunnerClient,
    endpoint: Endpoint,
    token: String,
    /// Its pid, for CPU (the original's only when given).
    pid: Option<u32>,
    _daemon: Option<Daemon>,
}

/// A sequential case's samples and the CPU it took.
#[derive(Default)]
struct Sequential {
    samples: Vec<Duration>,
    wall: Duration,
    /// runnerd's own CPU and its reaped children's (the sandboxes), ms.
    own_ms: f64,
    tree_ms: f64,
}

impl Sequential {
    fn per_exec(&self) -> (f64, f64) {
        let n = self.samples.len().max(1) as f64;
        (self.own_ms / n, self.tree_ms / n)
    }
}

/// `n` calls one after another in the workspace `key` (a new key per call when `fresh`),
/// `pause` between them (an agent's think time; not timed).
async fn sequential(
    s: &Subject,
    key: &str,
    n: usize,
    pause: Duration,
    fresh: bool,
) -> anyhow::Result<Sequential> {
    let mut out = Sequential::default();
    let before = s.pid.map(cpu_ms).transpose()?;
    for i in 0..n {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let key = if fresh {
            format!("{key}-{}-{i}", runnerctl::client::new_execution_id())
        } else {
            key.to_owned()
        };
        let start = Instant::now();
        let took = http_once_as(&s.client, &key, "bench").await?;
        out.wall += start.elapsed();
        out.samples.push(took);
    }
    if let (Some(pid), Some((own, tree))) = (s.pid, before) {
        let (own2, tree2) = cpu_ms(pid)?;
        (out.own_ms, out.tree_ms) = (own2 - own, tree2 - tree);
    }
    Ok(out)
}

impl std::ops::AddAssign for Sequential {
    fn add_assign(&mut self, o: Sequential) {
        self.samples.extend(o.samples);
        self.wall += o.wall;
        self.own_ms += o.own_ms;
        self.tree_ms += o.tree_ms;
    }
}

async fn pool(client: &RunnerClient) -> Value {
    match client.get("/health").await {
        Ok(r) => r.json()["sandboxProfile"]["prestartedSandboxes"].clone(),
        Err(_) => Value::Null,
    }
}

fn count(v: &Value, path: &[&str]) -> u64 {
    path.iter().fold(v, |v, k| &v[*k]).as_u64().unwrap_or(0)
}

/// Misses of every reason.
fn misses(p: &Value) -> u64 {
    p["misses"].as_object().map(|m| m.values().filter_map(Value::as_u64).sum()).unwrap_or(0)
}

/// `clients` clients, each in its own workspace as its own agent, back to back for `span`:
/// executions per second, failures, and CPU per execution.
async fn throughput(s: &Subject, clients: usize, span: Duration) -> (f64, u64, Option<f64>) {
    let before = s.pid.and_then(|p| cpu_ms(p).ok());
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let client = RunnerClient::new(s.endpoint.clone(), s.token.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u64, 0u64);
                while start.elapsed() < span {
                    match http_once_as(&client, &format!("bench/tp{clients}-{i}"), &format!("tp-{i}")).await {
                        Ok(_) => ok += 1,
                        Err(_) => failed += 1,
                    }
                }
                (ok, failed)
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let (o, f) = t.await.unwrap_or((0, 1));
        ok += o;
        failed += f;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = match (s.pid, before) {
        (Some(pid), Some((o, t))) => {
            cpu_ms(pid).ok().map(|(o2, t2)| ((o2 - o) + (t2 - t)) / (ok.max(1) as f64))
        }
        _ => None,
    };
    (ok as f64 / wall, failed, cpu)
}

fn start(init: &std::path::Path, name: &'static str, env: &[(&str, &str)]) -> anyhow::Result<Subject> {
    let daemon = start_runnerd_with(init, name, env)?;
    let (endpoint, token) = (daemon.endpoint.clone(), BENCH_TOKEN.to_owned());
    let client = RunnerClient::new(endpoint.clone(), token.clone());
    Ok(Subject { name, client, endpoint, token, pid: Some(daemon.child.id()), _daemon: Some(daemon) })
}

/// The original runner, when `RUNNERD_BENCH_ORIGINAL_URL` names it.
fn original() -> Option<Subject> {
    let url = std::env::var("RUNNERD_BENCH_ORIGINAL_URL").ok()?;
    let token = std::env::var("RUNNERD_BENCH_ORIGINAL_TOKEN").unwrap_or_default();
    let pid = std::env::var("RUNNERD_BENCH_ORIGINAL_PID").ok().and_then(|p| p.parse().ok());
    let address = url.trim_start_matches("http://").trim_end_matches('/');
    let endpoint = Endpoint::parse(address);
    let client = RunnerClient::new(endpoint.clone(), token.clone());
    Some(Subject { name: "original", client, endpoint, token, pid, _daemon: None })
}

fn row(label: &str, r: &Stats) {
    println!("{label:<52} {:>9.2} {:>9.2} {:>11.1}", r.p50, r.p95, r.per_sec);
}

pub(crate) async fn bench(setup: &Setup, n: usize, pause: Duration, span: Duration) -> anyhow::Result<()> {
    let init = setup.launcher.init_path().to_owned();
    let ahead = start(&init, "prestart-on", &[])?;
    let ahead_b2b = start(&init, "prestart-b2b", &[])?;
    let launch = start(&init, "prestart-off", &[("SCIENCE_AGENT_PRESTART_SANDBOXES", "0")])?;
    let orig = original();
    let mut subjects: Vec<&Subject> = vec![&ahead, &launch];
    subjects.extend(orig.as_ref());
    for s in [&ahead, &ahead_b2b, &launch].into_iter().chain(orig.as_ref()) {
        for _ in 0..5 {
            http_once_as(&s.client, "bench/warm", "bench").await?;
        }
    }
    // Idle RSS as the default bench reads it: warmed, then a moment of quiet.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle_rss: Vec<(&str, f64)> = [&ahead, &launch]
        .iter()
        .filter_map(|s| s.pid.map(|pid| (s.name, rss_kib(pid, "VmRSS:") as f64 / 1024.0)))
        .collect();
    println!(
        "runnerd-bench prestart: `/execute-shell true`, one agent in one workspace, {n} calls per case in {ROUNDS} \
         interleaved rounds, {} ms between calls (an agent's think time, not timed); release build",
        pause.as_millis()
    );
    let per = n.div_ceil(ROUNDS);
    let (mut bare, mut bare_wall) = (Vec::new(), Duration::ZERO);
    let mut seq: Vec<Sequential> = subjects.iter().map(|_| Sequential::default()).collect();
    let (mut b2b_ahead, mut b2b_launch) = (Sequential::default(), Sequential::default());
    let (mut miss_ahead, mut miss_launch) = (Sequential::default(), Sequential::default());
    let health0 = pool(&ahead.client).await;
    let ahead_phases0 = scrape(&ahead.client).await;
    for _ in 0..ROUNDS {
        let (runs, took) = bare_shell_runs(setup, per, Until::BwrapExits)?;
        bare.extend(runs);
        bare_wall += took;
        for (s, acc) in subjects.iter().zip(seq.iter_mut()) {
            *acc += sequential(s, "bench/agent", per, pause, false).await?;
        }
        b2b_ahead += sequential(&ahead_b2b, "bench/b2b", per, Duration::ZERO, false).await?;
        b2b_launch += sequential(&launch, "bench/b2b", per, Duration::ZERO, false).await?;
    }
    let health1 = pool(&ahead.client).await;
    let phases = phase_delta(&ahead_phases0, &scrape(&ahead.client).await);
    // A miss: every call in a workspace never used (always cold), with and without the pool.
    let cold_n = (n / 2).max(8);
    for _ in 0..ROUNDS {
        miss_ahead += sequential(&ahead_b2b, "bench/cold", cold_n / ROUNDS, pause, true).await?;
        miss_launch += sequential(&launch, "bench/cold", cold_n / ROUNDS, pause, true).await?;
    }
    // A waiting sandbox's memory, once one waits.
    tokio::time::sleep(pause.max(Duration::from_millis(200))).await;
    let waiting = pool(&ahead.client).await;

    let a = stats(bare, bare_wall);
    println!("\n{:<52} {:>9} {:>9} {:>11}", "case", "p50 ms", "p95 ms", "execs/s");
    row("(a') bare bwrap `bash -s` with `true` on stdin", &a);
    let seq_stats: Vec<Stats> = seq.iter().map(|s| stats(s.samples.clone(), s.wall)).collect();
    for (s, st) in subjects.iter().zip(&seq_stats) {
        row(&format!("(p) agent, sequential [{}]", s.name), st);
    }
    let (b_on, b_off) = (
        stats(b2b_ahead.samples.clone(), b2b_ahead.wall),
        stats(b2b_launch.samples.clone(), b2b_launch.wall),
    );
    row("(p0) back to back, no pause [prestart-on]", &b_on);
    row("(p0) back to back, no pause [prestart-off]", &b_off);
    let (m_on, m_off) = (
        stats(miss_ahead.samples.clone(), miss_ahead.wall),
        stats(miss_launch.samples.clone(), miss_launch.wall),
    );
    row("(m) a miss: every call a new workspace [prestart-on]", &m_on);
    row("(m) a miss: every call a new workspace [prestart-off]", &m_off);

    let on = &seq_stats[0];
    println!("\n  (p) served ahead / bare bwrap at p50: {:.3}  (target <= 0.9; stretch 0.7)", on.p50 / a.p50);
    println!("  (p) without the pool / bare bwrap at p50: {:.3}", seq_stats[1].p50 / a.p50);
    println!("  (p) served ahead / without at p50: {:.3}", on.p50 / seq_stats[1].p50);
    let hits = count(&health1, &["hits"]) - count(&health0, &["hits"]);
    let missed = misses(&health1) - misses(&health0);
    println!(
        "  hit rate of (p) [prestart-on]: {hits} of {} calls = {:.1} %  (target >= 95 %)",
        hits + missed,
        100.0 * hits as f64 / (hits + missed).max(1) as f64
    );
    println!(
        "  (p0) back to back: {:.3} of bare bwrap (the next sandbox is still being started when the call comes)",
        b_on.p50 / a.p50
    );
    println!(
        "  (m) a miss with the pool / without at p50: {:.3}  (target: no slower, <= 1.0 within noise)",
        m_on.p50 / m_off.p50
    );
    println!("  the floor that remains in (p) [prestart-on], mean ms per call, server-side:");
    for (phase, ms) in &phases {
        println!("    {phase:<10} {ms:>7.3}");
    }
    for (s, q) in subjects.iter().zip(&seq) {
        if s.pid.is_some() {
            let (own, tree) = q.per_exec();
            println!(
                "  CPU per execution of (p) [{}]: runnerd {own:.2} ms + sandbox tree {tree:.2} ms = {:.2} ms",
                s.name,
                own + tree
            );
        }
    }
    let per_sandbox = count(&waiting, &["memoryBytes"]) / count(&waiting, &["waiting"]).max(1);
    println!(
        "  a waiting sandbox's resident memory (bwrap, its init, bash; RSS summed): {:.1} MiB ({} waiting)",
        per_sandbox as f64 / (1 << 20) as f64,
        count(&waiting, &["waiting"])
    );
    for (name, mib) in &idle_rss {
        println!("  runnerd idle RSS after warm-up [{name}]: {mib:.1} MiB (target <= 15 MiB)");
    }

    println!(
        "\n(t) throughput: N clients, each its own workspace and agent, back to back, {} s per case",
        span.as_secs()
    );
    println!("{:<28} {:>10} {:>10} {:>14}", "case", "execs/s", "failures", "CPU ms/exec");
    let mut tp: Vec<Vec<f64>> = vec![Vec::new(); subjects.len()];
    for clients in [2usize, 4, 8] {
        for (i, s) in subjects.iter().enumerate() {
            let (rate, failed, cpu) = throughput(s, clients, span).await;
            tp[i].push(rate);
            let cpu = cpu.map_or_else(|| "-".to_owned(), |c| format!("{c:.2}"));
            println!("{:<28} {rate:>10.1} {failed:>10} {cpu:>14}", format!("{clients} clients [{}]", s.name));
        }
    }
    println!(
        "  prestart-on / prestart-off: {}",
        tp[0].iter().zip(&tp[1]).map(|(a, b)| format!("{:.3}", a / b)).collect::<Vec<_>>().join(" / ")
    );

    println!();
    match orig.as_ref() {
        Some(_) => {
            let o = &seq_stats[2];
            println!("  (p) served ahead / the original at p50: {:.3}  (target <= 0.6)", on.p50 / o.p50);
            println!(
                "  throughput / the original at 2, 4, 8 clients: {}  (target >= 1.15)",
                tp[0]
                    .iter()
                    .zip(&tp[2])
                    .map(|(a, b)| format!("{:.3}", a / b))
                    .collect::<Vec<_>>()
                    .join(" / ")
            );
        }
        None => {
            let (p50, cpu, bare_there, rates) = ORIGINAL_ISSUE;
            println!(
                "  the original was not measured here (set RUNNERD_BENCH_ORIGINAL_URL, _TOKEN, _PID); issue #37's own run \
                 measured it at p50 {p50} ms against bare bwrap {bare_there} ms there ({:.3}×), {cpu:.2} ms CPU per \
                 execution, {rates:?} execs/s at 2/4/8 clients",
                p50 / bare_there
            );
            println!(
                "  as ratios to each run's bare bwrap: (p) served ahead {:.3}× against the original's {:.3}× → {:.3} of \
                 the original (target <= 0.6)",
                on.p50 / a.p50,
                p50 / bare_there,
                (on.p50 / a.p50) / (p50 / bare_there)
            );
        }
    }
    Ok(())
}

/// Mean ms per call by phase between two scrapes.
fn phase_delta(before: &[(String, f64, f64)], after: &[(String, f64, f64)]) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for (phase, sum, count) in in_pipeline_order(after) {
        let (s0, c0) = before.iter().find(|(p, ..)| p == phase).map_or((0.0, 0.0), |(_, s, c)| (*s, *c));
        if count > c0 {
            out.push((phase.to_owned(), (sum - s0) * 1000.0 / (count - c0)));
        }
    }
    out
}
