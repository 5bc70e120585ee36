//! `runnerd-bench limits` (issue #8): what a per-execution cgroup adds to a launch.
//!
//! Two cases, interleaved launch by launch so drift hits both alike, each N launches of
//! `/usr/bin/true` through sandbox-init and the launcher with the identical bwrap argv:
//! * (r) rlimits only (`RLIMIT_AS` and friends in the plan, no cgroup);
//! * (c) the cgroup path as runnerd runs it: create `exec-…` in every hierarchy, write and
//!   read back the limits, open each join file, launch (sandbox-init joins), then kill
//!   what is left and read the counters (the directories are removed in the background
//!   after that, as runnerd does once the answer is ready: that work still competes for
//!   the CPU with the next launches here);
//! * (k) the same cgroup work without the join (the sandbox runs outside it): what the
//!   files cost, as against the kernel's moving of a process between cgroups.
//!
//! Prints p50/p95 of each and the difference (target: ≤ 1 ms added per launch). Figures,
//! never pass/fail.

use std::time::{Duration, Instant};

use anyhow::bail;
use common::seccomp::Profile;

use crate::{Discard, Setup, setup, stats};
use runnerd::launch::{Filter, Launch, Termination, default_rlimits};
use runnerd::limits::{self, Enforcement, LimitSettings, Limits, Mode};

fn launch(setup: &Setup, mode: Mode, limits: &Limits) -> Launch {
    let mut rlimits = default_rlimits(None);
    rlimits.extend(limits::rlimits_for(mode, limits, 30_000));
    Launch {
        bwrap: setup.bwrap.clone(),
        options: setup.options.clone(),
        command: setup.command.clone(),
        filter: Some(Filter::Profile(Profile::Baseline)),
        rlimits,
        stdin: Vec::new(),
        timeout: Some(Duration::from_secs(30)),
        cancel: None,
        extra_fds: Default::default(),
        cgroup_procs: Vec::new(),
    }
}

async fn rlimits_once(setup: &Setup, limits: &Limits) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let outcome = setup.launcher.run(launch(setup, Mode::RlimitsOnly, limits), &mut Discard).await?;
    if outcome.termination != Termination::Exited(0) {
        bail!("rlimits-only launch failed: {:?}", outcome.termination);
    }
    Ok(start.elapsed())
}

async fn cgroup_once(
    setup: &Setup,
    e: &Enforcement,
    limits: &Limits,
    join: bool,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let group = e.create(limits)?;
    let mut l = launch(setup, e.mode, limits);
    if let Some(g) = &group {
        let fds = g.procs_fds()?;
        if join {
            l.cgroup_procs = fds;
        }
    }
    let outcome = setup.launcher.run(l, &mut Discard).await?;
    let usage = limits::finish(group).await;
    if outcome.termination != Termination::Exited(0) || usage.is_none() {
        bail!("cgroup launch failed: {:?} (usage {usage:?})", outcome.termination);
    }
    Ok(start.elapsed())
}

pub async fn bench(n: usize) -> anyhow::Result<()> {
    let settings = LimitSettings::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))?;
    let enforcement = Enforcement::detect(&settings)?;
    if enforcement.mode == Mode::RlimitsOnly {
        bail!(
            "no cgroup mode is available to this process ({}); run as root on a cgroup v1 host, or under a \
             delegated cgroup v2",
            enforcement.reasons.join("; ")
        );
    }
    let setup = setup().await?;
    let limits = settings.default;
    println!(
        "runnerd-bench limits: {n} launches of /usr/bin/true per case, interleaved; cgroupMode {} under {}",
        enforcement.mode.label(),
        enforcement.root.display()
    );
    println!(
        "limits: memory {} B, pids {}, cpu {} cores; identical bwrap argv and seccomp program\n",
        limits.memory_bytes,
        limits.pids,
        limits.cpu_millicores as f64 / 1000.0
    );
    for _ in 0..5 {
        rlimits_once(&setup, &limits).await?;
        cgroup_once(&setup, &enforcement, &limits, true).await?;
        cgroup_once(&setup, &enforcement, &limits, false).await?;
    }
    let mut samples = [Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n)];
    let mut walls = [Duration::ZERO; 3];
    for _ in 0..n {
        for (i, s) in samples.iter_mut().enumerate() {
            let d = match i {
                0 => rlimits_once(&setup, &limits).await?,
                1 => cgroup_once(&setup, &enforcement, &limits, true).await?,
                _ => cgroup_once(&setup, &enforcement, &limits, false).await?,
            };
            walls[i] += d;
            s.push(d);
        }
    }
    let [r, c, k] = samples;
    let (r, c, k) = (stats(r, walls[0]), stats(c, walls[1]), stats(k, walls[2]));
    println!("{:<44} {:>9} {:>9} {:>11}", "case", "p50 ms", "p95 ms", "launches/s");
    for (name, s) in [
        ("(r) rlimits only", &r),
        ("(c) per-execution cgroup", &c),
        ("(k) cgroup files only, not joined", &k),
    ] {
        println!("{name:<44} {:>9.2} {:>9.2} {:>11.1}", s.p50, s.p95, s.per_sec);
    }
    println!();
    println!("added by the cgroup path at p50: {:+.3} ms  (target <= 1 ms)", c.p50 - r.p50);
    println!("added by the cgroup path at p95: {:+.3} ms", c.p95 - r.p95);
    println!(
        "of which the cgroup files (mkdir, limits, read-back, counters) at p50: {:+.3} ms; \
         the rest is the kernel moving sandbox-init into the cgroups",
        k.p50 - r.p50
    );
    Ok(())
}
