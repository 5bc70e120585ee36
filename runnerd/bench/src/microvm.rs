//! `runnerd-bench microvm` (issue #36): what a microvm execution costs against bwrap, in one
//! run. Sequential signed `POST /execute-shell` of `true`: bare bwrap, runnerd's bwrap
//! backend, and runnerd's microvm backend (a cold VM each: no pool yet); the VMM's peak RSS
//! during a `sleep 2` run; and whether the VMs ran on KVM or TCG (`/health`). The guest comes
//! from `RUNNERD_BENCH_MICROVM_DIR` (`scripts/build-microvm-guest`'s output). Figures only.
//! First output byte is not measured: the synchronous API answers at the end.

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
    let env = [
        ("SCIENCE_AGENT_MICROVM_KERNEL", kernel.to_str().context("kernel path")?),
        ("SCIENCE_AGENT_MICROVM_INITRAMFS", initramfs.to_str().context("initramfs path")?),
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

    println!("runnerd-bench microvm: `true` through POST /execute-shell, accel {}", vm["accel"]);
    println!("  bare bwrap true:             p50 {:9.2} ms  p95 {:9.2} ms", bare.p50, bare.p95);
    println!("  runnerd, bwrap backend:      p50 {:9.2} ms  p95 {:9.2} ms", bwrap.p50, bwrap.p95);
    println!(
        "  runnerd, microvm cold (n={n}): p50 {:9.2} ms  p95 {:9.2} ms  ({:.0}x the bwrap backend)",
        cold.p50,
        cold.p95,
        cold.p50 / bwrap.p50
    );
    println!("  microvm pooled:              not measured (no pool yet)");
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
