//! `runnerd-bench microvm` (issue #36): what a microvm execution costs against bwrap, in one
//! run. Sequential signed `POST /execute-shell` of `true`: bare bwrap, runnerd's bwrap
//! backend, and runnerd's microvm backend — cold (a runnerd with its pool off: a VM booted per
//! call) and pooled (a runnerd with a pool of 1: each call waits, untimed, until its
//! workspace's VM has booted, then is timed from the request to the answer); the VMM's peak
//! RSS during a `sleep 2` run, the host memory of one idle pooled VM (`/health`), and whether
//! the VMs ran on KVM or TCG. The guest comes from `RUNNERD_BENCH_MICROVM_DIR`
//! (`scripts/build-microvm-guest`'s output). Figures only. First output byte is not measured
//! apart: the synchronous API answers at the end, so a pooled `echo` stands for it.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use runnerctl::client::RunnerClient;

use crate::{BENCH_TOKEN, bare_once, http_once, rss_kib, setup, start_runnerd_with, stats, true_request};

pub async fn bench(init: &Path, n: usize) -> anyhow::Result<()> {
    let guest =
        std::env::var_os("RUNNERD_BENCH_MICROVM_DIR").context("RUNNERD_BENCH_MICROVM_DIR is not set")?;
    let guest = Path::new(&guest);
    let (kernel, initramfs) = (guest.join("vmlinux"), guest.join("initramfs.cpio.gz"));
    let mut env = vec![
        ("SCIENCE_AGENT_MICROVM_KERNEL", kernel.to_str().context("kernel path")?),
        ("SCIENCE_AGENT_MICROVM_INITRAMFS", initramfs.to_str().context("initramfs path")?),
        ("SCIENCE_AGENT_MICROVM_POOL", "0"),
    ];
    let setup = setup().await?;
    let daemon = start_runnerd_with(init, "microvm", &env)?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    let health = client.get("/health").await?.json();
    let vm = &health["isolation"]["backends"]["microvm"];
    if vm["available"] != true {
        bail!("the microvm backend is unavailable: {}", vm["reason"]);
    }

    let mut bare = Vec::new();
    let start = Instant::now();
    for _ in 0..n.max(20) {
        bare.push(bare_once(&setup.bwrap, &setup.args, &setup.program)?);
    }
    let bare = stats(bare, start.elapsed());
    http_once(&client, "bench/bwrap").await?;
    let mut bwrap = Vec::new();
    let start = Instant::now();
    for _ in 0..n.max(20) {
        bwrap.push(http_once(&client, "bench/bwrap").await?);
    }
    let bwrap = stats(bwrap, start.elapsed());
    let mut cold = Vec::new();
    let start = Instant::now();
    for _ in 0..n {
        cold.push(vm_once(&client, "true").await?);
    }
    let cold = stats(cold, start.elapsed());
    let rss = vmm_peak_rss_kib(&client, daemon.child.id()).await?;
    drop(daemon);

    // Pooled: a runnerd whose pool holds one VM, for the bench's one workspace.
    env.retain(|(k, _)| *k != "SCIENCE_AGENT_MICROVM_POOL");
    env.push(("SCIENCE_AGENT_MICROVM_POOL", "1"));
    let daemon = start_runnerd_with(init, "microvm-pool", &env)?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    vm_once(&client, "true").await?;
    let (mut pooled, mut echo, mut idle) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..2 * n {
        idle.push(booted(&client).await?);
        let took = vm_once(&client, if i % 2 == 0 { "true" } else { "echo x" }).await?;
        if i % 2 == 0 { pooled.push(took) } else { echo.push(took) }
    }
    let pool = client.get("/health").await?.json()["isolation"]["backends"]["microvm"]["pool"].clone();
    let wall: Duration = pooled.iter().sum();
    let pooled = stats(pooled, wall);
    let echo = stats(echo.clone(), echo.iter().sum());
    idle.sort_unstable();
    let idle_mib = idle[idle.len() / 2] as f64 / (1 << 20) as f64;

    println!("runnerd-bench microvm: `true` through POST /execute-shell, accel {}", vm["accel"]);
    println!("  bare bwrap true:             p50 {:9.2} ms  p95 {:9.2} ms", bare.p50, bare.p95);
    println!("  runnerd, bwrap backend:      p50 {:9.2} ms  p95 {:9.2} ms", bwrap.p50, bwrap.p95);
    println!(
        "  runnerd, microvm cold (n={n}): p50 {:9.2} ms  p95 {:9.2} ms  ({:.0}x the bwrap backend)",
        cold.p50,
        cold.p95,
        cold.p50 / bwrap.p50
    );
    println!(
        "  runnerd, microvm pooled (n={n}): p50 {:9.2} ms  p95 {:9.2} ms  ({:.1}x the bwrap backend, {:.1}x faster than cold)",
        pooled.p50,
        pooled.p95,
        pooled.p50 / bwrap.p50,
        cold.p50 / pooled.p50
    );
    println!(
        "  runnerd, microvm pooled `echo x` (the answer, with its output): p50 {:9.2} ms  p95 {:9.2} ms",
        echo.p50, echo.p95
    );
    println!(
        "  pool: {} hits, misses {}, one idle pooled VM's host memory (bwrap + QEMU RSS, median): {idle_mib:.1} MiB",
        pool["hits"], pool["misses"]
    );
    println!(
        "  VMM (QEMU) peak RSS during `sleep 2` (guest RAM: the default memoryBytes, {} MiB): {:.1} MiB; load average {:.2}",
        health["resourceLimits"]["defaults"]["memoryBytes"].as_u64().unwrap_or(0) >> 20,
        rss as f64 / 1024.0,
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0),
    );
    Ok(())
}

/// Waits (untimed) until the pool holds a booted VM; the pool's memory then.
async fn booted(client: &RunnerClient) -> anyhow::Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pool = client.get("/health").await?.json()["isolation"]["backends"]["microvm"]["pool"].clone();
        if pool["waiting"] == 1 {
            return Ok(pool["memoryBytes"].as_u64().unwrap_or(0));
        }
        if Instant::now() > deadline {
            bail!("no VM booted ahead within 120 s: {pool}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One microvm execution of `code`; its wall time.
async fn vm_once(client: &RunnerClient, code: &str) -> anyhow::Result<Duration> {
    let mut body = true_request("bench/microvm", "bench");
    body["code"] = code.into();
    body["isolation"] = "microvm".into();
    let start = Instant::now();
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 200 || reply.json()["exitCode"] != 0 {
        bail!("runnerd answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(start.elapsed())
}

/// The highest `VmHWM` of a QEMU under runnerd `runnerd` while a VM runs `sleep 2`.
async fn vmm_peak_rss_kib(client: &RunnerClient, runnerd: u32) -> anyhow::Result<u64> {
    let run = vm_once(client, "sleep 2");
    tokio::pin!(run);
    let mut peak = 0;
    loop {
        tokio::select! {
            r = &mut run => { r?; return Ok(peak) }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                for pid in qemu_under(runnerd) {
                    peak = peak.max(rss_kib(pid, "VmHWM:"));
                }
            }
        }
    }
}

/// QEMU processes descended from `ancestor`.
fn qemu_under(ancestor: u32) -> Vec<u32> {
    let parent = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
    };
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.starts_with("qemu-system"))
        })
        .filter(|pid| {
            let mut p = *pid;
            while let Some(up) = parent(p).filter(|u| *u > 1) {
                if up == ancestor {
                    return true;
                }
                p = up;
            }
            false
        })
        .collect()
}
