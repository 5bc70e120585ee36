//! `runnerd-bench`: launch overhead, measured against bare bwrap in the same run.
//!
//! Cases (N launches of `/usr/bin/true` each, identical bwrap argv, seccomp program on
//! fd 3 from a sealed memfd, info pipe on fd 4):
//! * (a) bare bwrap, spawned directly by this process;
//! * (b) through `sandbox-init` and the [`Launcher`](runnerd::launch::Launcher), as runnerd does;
//!
//! each sequentially (a and b interleaved, so drift hits both alike) and with 2 parallel
//! launchers; then through a real runnerd: (c) sequential signed `POST /execute-shell` of
//! `true`, (d) 2, 4 and 8 concurrent clients of one agent over distinct workspaces (they
//! queue: one execution at a time per session-agent), (e) 2 agents side by side, and (f) the
//! commit the on-disk format requires, alone (its durable floor). It prints p50/p95
//! per case, executions per second, the ratios against bare bwrap, sandbox-init's peak RSS
//! and runnerd's RSS idle and through concurrency 8.
//! Figures, never pass/fail: tests do not time anything.

mod fleet;
mod floor;
mod history;
mod limits;
mod memory;
mod metrics;
mod microvm;
mod moves;
mod output;
mod perf;
mod prestart;
mod scale;
mod versions;

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use common::channel::{self, encode_frame};
use common::plan::{LaunchPlan, PROTOCOL_VERSION};
use common::seccomp::{self, Arch, Profile};

use runnerctl::client::{Endpoint, RunnerClient, new_execution_id, permission_epoch};
use runnerd::launch::{
    Filter, Launch, Launcher, OutputSink, Stream, Termination, bwrap_args, default_rlimits,
};
use runnerd::sandbox::{BwrapSpec, Language, WorkspaceLayout, argv};
use runnerd::startup;

const USAGE: &str = "\
runnerd-bench: figures in one run, never pass/fail (build with --release).

Usage:
  runnerd-bench [--iterations N]        sandbox launch overhead against bare bwrap (default 200),
                                        then HTTP executions: p50s, ratios, runnerd's own CPU
                                        per execution, 2-client throughput, idle RSS and the
                                        per-phase breakdown (RUNNERD_BENCH_BASELINE=PATH: an
                                        older runnerd measured too, rounds interleaved)
  runnerd-bench versions [--files N] [--mib M] [--log-mb L]
                                        workspace commit cost against a stat walk and
                                        sha256sum of the same tree (default 10000 files,
                                        1024 MiB), and managed-run log throughput (100 MB)
  runnerd-bench limits [--iterations N]  launch time with a per-execution cgroup against
                                        rlimits only, interleaved (default 200)
  runnerd-bench output [--mib N]        runnerd's peak RSS during an N MiB output flood
                                        (default 64) against the output and answer sizes
  runnerd-bench metrics [--iterations N] signed executions without and with GET /metrics
                                        scraped every second, interleaved (default 200)
  runnerd-bench workspace-scale         `true` p50 and runnerd CPU per execution in remote
                                        workspaces of 0, 1k, 10k, 100k files, and runnerd CPU
                                        during `sleep 3` in 20k files, quota on and off
                                        (issue #31's baseline), bare bwrap in the same run
  runnerd-bench history                 the version store's growth from sparse files and a
                                        churning file, one collection's cost, and `true` p50
                                        with collections back to back against without
                                        (issue #32), bare bwrap in the same run
  runnerd-bench microvm [--iterations N] `true` in cold and pooled microvm guests (default
                                        10 each) against bare bwrap and runnerd's bwrap
                                        backend, the VMM's peak RSS, an idle pooled VM's
                                        memory, KVM or TCG (RUNNERD_BENCH_MICROVM_DIR: the
                                        guest from scripts/build-microvm-guest; issue #36)
  runnerd-bench memory [--concurrent N] [--sequential M] [--settle S]
                                        runnerd's RSS idle, at peak and S s after N
                                        concurrent requests and after M sequential
                                        executions, glibc defaults against runnerd's
                                        tuning, both in this run (default 500, 3000, 60)
  runnerd-bench move                    a remote workspace of 10,000 files / 200 MiB pushed
                                        between two runnerd on loopback against `tar | tar`
                                        of the same directories; a second move after one
                                        changed file (bytes sent), a move with nothing to
                                        send (issue #34; RUNNERD_BENCH_MOVE_PERF=FILE: perf
                                        record -g of the target during the first move)
  runnerd-bench prestart [--iterations N] [--pause-ms P] [--seconds S]
                                        sandboxes started ahead (issue #37): an agent's
                                        sequential `true` in one workspace, P ms apart
                                        (default 50), with and without them, bare bwrap in
                                        the same rounds; hit rate, the floor left, CPU per
                                        execution, a miss, a waiting sandbox's memory, and
                                        2/4/8 clients for S s each (default 5)
                                        (RUNNERD_BENCH_ORIGINAL_URL/_TOKEN/_PID: the original
                                        runner, measured alike)
  runnerd-bench fleet [--iterations N] [--seconds S]
                                        runner-router in front of runnerd nodes on loopback
                                        against the nodes directly (issue #35): the router's
                                        overhead at p50 over N sequential executions (default
                                        200) and its CPU per execution, a new workspace's
                                        first call and placement alone, and the throughput
                                        of 8 clients over 3 nodes against one node, S s per
                                        case (default 10); RUNNERD_BENCH_ROUTER=PATH: the
                                        router (else the one next to this binary);
                                        RUNNERD_BENCH_FLEET_PERF=ARGS: perf on the router
                                        during the sequential case (_CASE=d: throughput)
";

fn main() {
    std::process::exit(run());
}

fn run() -> i32 {
    let choice = match Choice::parse(std::env::args().skip(1)) {
        Ok(choice) => choice,
        Err(code) => return code,
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runnerd-bench: {e}");
            return 1;
        }
    };
    match rt.block_on(choice.measure()) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("runnerd-bench: {e:#}");
            1
        }
    }
}

/// The benchmark the command line chose, and its options.
struct Choice {
    iterations: usize,
    /// Files, MiB, log MB.
    versions: Option<(u64, u64, u64)>,
    limits: bool,
    /// MiB of output.
    output: Option<u64>,
    /// Concurrent, sequential, settle seconds.
    memory: Option<(u64, u64, u64)>,
    metrics: bool,
    scale: bool,
    history: bool,
    moves: bool,
    /// `microvm` (issue #36).
    microvm: bool,
    /// Seconds per throughput case.
    fleet: Option<u64>,
    /// `prestart`: (ms between calls, seconds per throughput case).
    prestart: Option<(u64, u64)>,
}

impl Choice {
    /// The arguments read; `Err` is the exit code once usage (or the complaint) is printed.
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Choice, i32> {
        let mut c = Choice {
            iterations: 200,
            versions: None,
            limits: false,
            output: None,
            memory: None,
            metrics: false,
            scale: false,
            history: false,
            moves: false,
            microvm: false,
            fleet: None,
            prestart: None,
        };
        while let Some(arg) = args.next() {
            let mut number = |name: &str| -> Option<u64> {
                let v = args.next().and_then(|v| v.parse().ok());
                if v.is_none() {
                    eprintln!("runnerd-bench: {name} needs a number\n\n{USAGE}");
                }
                v
            };
            match arg.as_str() {
                "versions" => c.versions = Some((10_000u64, 1024u64, 100u64)),
                "limits" => c.limits = true,
                "metrics" => c.metrics = true,
                "workspace-scale" => c.scale = true,
                "history" => c.history = true,
                "move" => c.moves = true,
                "microvm" => {
                    c.microvm = true;
                    c.iterations = 10;
                }
                "fleet" => c.fleet = Some(10),
                "prestart" => c.prestart = Some((50, 5)),
                "--pause-ms" | "--seconds" if c.prestart.is_some() => {
                    let Some(n) = number(&arg) else { return Err(2) };
                    let p = c.prestart.get_or_insert((50, 5));
                    if arg == "--pause-ms" { p.0 = n } else { p.1 = n.max(1) }
                }
                "--seconds" if c.fleet.is_some() => {
                    let Some(n) = number(&arg) else { return Err(2) };
                    c.fleet = Some(n.max(1));
                }
                "output" => c.output = Some(64u64),
                "--mib" if c.output.is_some() => {
                    let Some(n) = number(&arg) else { return Err(2) };
                    c.output = Some(n.max(1));
                }
                "memory" => c.memory = Some((500u64, 3000u64, 60u64)),
                "--concurrent" | "--sequential" | "--settle" if c.memory.is_some() => {
                    let Some(n) = number(&arg) else { return Err(2) };
                    let m = c.memory.as_mut().expect("checked");
                    match arg.as_str() {
                        "--concurrent" => m.0 = n.max(1),
                        "--sequential" => m.1 = n.max(1),
                        _ => m.2 = n,
                    }
                }
                "--files" | "--mib" | "--log-mb" if c.versions.is_some() => {
                    let Some(n) = number(&arg) else { return Err(2) };
                    let v = c.versions.as_mut().expect("checked");
                    match arg.as_str() {
                        "--files" => v.0 = n.max(100),
                        "--mib" => v.1 = n.max(1),
                        _ => v.2 = n.max(1),
                    }
                }
                "--iterations" | "-n" => match args.next().and_then(|v| v.parse().ok()) {
                    Some(n) if n >= 4 => c.iterations = n,
                    _ => {
                        eprintln!("runnerd-bench: --iterations needs a number ≥ 4\n\n{USAGE}");
                        return Err(2);
                    }
                },
                "--help" | "-h" => {
                    print!("{USAGE}");
                    return Err(0);
                }
                other => {
                    eprintln!("runnerd-bench: unknown argument {other:?}\n\n{USAGE}");
                    return Err(2);
                }
            }
        }
        Ok(c)
    }

    /// Runs the chosen benchmark.
    async fn measure(self) -> anyhow::Result<()> {
        let Choice {
            iterations,
            versions,
            limits,
            output,
            memory,
            metrics,
            scale,
            history,
            moves,
            microvm,
            fleet,
            prestart,
        } = self;
        match versions {
            Some((files, mib, log_mb)) => bench_versions(files as usize, mib, log_mb).await,
            None if memory.is_some() => {
                let (c, s, settle) = memory.expect("checked");
                crate::memory::bench(c as usize, s as usize, Duration::from_secs(settle)).await
            }
            None if limits => crate::limits::bench(iterations).await,
            None if metrics => bench_metrics(iterations).await,
            None if scale => bench_scale().await,
            None if microvm => {
                let setup = setup().await?;
                crate::microvm::bench(setup.launcher.init_path(), iterations).await
            }
            None if history => {
                let setup = setup().await?;
                crate::history::bench(setup.launcher.init_path()).await
            }
            None if moves => {
                let setup = setup().await?;
                crate::moves::bench(setup.launcher.init_path()).await
            }
            None if fleet.is_some() => {
                let setup = setup().await?;
                let seconds = Duration::from_secs(fleet.unwrap_or(10));
                crate::fleet::bench(setup.launcher.init_path(), iterations, seconds).await
            }
            None if prestart.is_some() => {
                let (pause, seconds) = prestart.expect("checked");
                let setup = setup().await?;
                let (pause, span) = (Duration::from_millis(pause), Duration::from_secs(seconds));
                crate::prestart::bench(&setup, iterations, pause, span).await
            }
            None if output.is_some() => bench_output(output.unwrap_or(64)).await,
            None => bench(iterations).await,
        }
    }
}

pub(crate) struct Discard;
impl OutputSink for Discard {
    fn write(&mut self, _: Stream, _: &[u8]) {}
}

pub(crate) struct Setup {
    /// bwrap's argv for the API's shell (`bash … -s`), for the baseline of (c).
    shell_args: Vec<String>,
    pub(crate) launcher: Arc<Launcher>,
    pub(crate) bwrap: PathBuf,
    /// What the launcher gets; `args` is what bare bwrap gets: the same argv.
    pub(crate) options: Vec<String>,
    pub(crate) command: Vec<String>,
    args: Vec<String>,
    program: Vec<u8>,
    _scratch: Scratch,
}

pub(crate) struct Scratch(pub(crate) PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) async fn setup() -> anyhow::Result<Setup> {
    let scratch = std::env::temp_dir().join(format!("runnerd-bench-{}", std::process::id()));
    let workspace = scratch.join("projects/bench");
    std::fs::create_dir_all(&workspace).with_context(|| format!("creating {}", workspace.display()))?;
    let scratch = Scratch(scratch);
    let mut config = runnerd::cli::sandbox_config_from_env(true)?;
    config.data_dir = scratch.0.join("data");
    // As runnerd does before start-up (and searchable by a root start's sandbox user).
    std::fs::create_dir_all(&config.data_dir)?;
    let runtime = startup::prepare(&config).await?;
    let Some(shape) = runtime.capability.shape() else {
        bail!("no usable sandbox on this host: {:?}", runtime.capability)
    };
    let layout = WorkspaceLayout::new(workspace.canonicalize()?, None);
    let cmd = argv::build(&BwrapSpec::new(shape, &runtime.host, &layout, Language::Shell));
    let options = cmd.options.clone();
    let shell_args = bwrap_args(&options, true, &cmd.command);
    let command = vec!["/usr/bin/true".to_owned()];
    let args = bwrap_args(&options, true, &command);
    let program = seccomp::compile(cmd.seccomp, Arch::host()?)?.bytes().to_vec();
    Ok(Setup {
        shell_args,
        launcher: runtime.launcher,
        bwrap: runtime.bwrap,
        options,
        command,
        args,
        program,
        _scratch: scratch,
    })
}

fn sealed_memfd(bytes: &[u8]) -> anyhow::Result<OwnedFd> {
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create("bench-seccomp", MFdFlags::MFD_CLOEXEC)?;
    let mut file = std::fs::File::from(fd);
    std::io::Write::write_all(&mut file, bytes)?;
    std::io::Seek::rewind(&mut file)?;
    Ok(OwnedFd::from(file))
}

fn pipe() -> anyhow::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((r, w))
}

/// (a): bwrap spawned directly, fds 3 and 4 placed in the child before exec.
pub(crate) fn bare_once(bwrap: &Path, args: &[String], program: &[u8]) -> anyhow::Result<Duration> {
    bare_with_stdin(bwrap, args, program, None, Until::BwrapExits)
}

/// When a bare launch counts as done.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// bwrap (its monitor) has exited, as a shell running it would see.
    BwrapExits,
    /// ... and its sandbox's init (PID 1 of the namespace) is gone too: what runnerd waits
    /// for before the snapshot (R-RUN-4), since the monitor may exit a moment before the
    /// init and the kernel's teardown of the namespace.
    NamespaceGone,
}

/// `n` bare launches of the API's `bash -s` with `true` on stdin (the baseline of (c)), one
/// after another: each one's time, and the wall time of all.
pub(crate) fn bare_shell_runs(
    setup: &Setup,
    n: usize,
    until: Until,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let start = Instant::now();
    let runs = (0..n)
        .map(|_| bare_with_stdin(&setup.bwrap, &setup.shell_args, &setup.program, Some(b"true"), until))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((runs, start.elapsed()))
}

/// (a) with `stdin` fed to the command (for the shell baseline of (c)).
fn bare_with_stdin(
    bwrap: &Path,
    args: &[String],
    program: &[u8],
    stdin: Option<&[u8]>,
    until: Until,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let memfd = sealed_memfd(program)?;
    let (info_r, info_w) = pipe()?;
    let (seccomp_raw, info_raw) = (memfd.as_raw_fd(), info_w.as_raw_fd());
    let mut cmd = Command::new(bwrap);
    let input = if stdin.is_some() { Stdio::piped() } else { Stdio::null() };
    cmd.args(args).env_clear().stdin(input).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: only dup2 (async-signal-safe) runs between fork and exec. This is the bench's
    // baseline; runnerd itself never runs code there (sandbox-init does this work).
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(seccomp_raw, 3) == -1 || libc::dup2(info_raw, 4) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("spawning bwrap")?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let _ = std::io::Write::write_all(&mut pipe, bytes);
    }
    drop(info_w);
    drop(memfd);
    let mut info = String::new();
    std::fs::File::from(info_r).read_to_string(&mut info)?;
    // An init already gone (ESRCH) needs no wait; the bench's own children are not reused
    // within one launch.
    let init = match until {
        Until::BwrapExits => None,
        Until::NamespaceGone => {
            let info: serde_json::Value = serde_json::from_str(&info).context("bwrap's --info-fd")?;
            let pid = info["child-pid"].as_i64().context("no child-pid in bwrap's info")?;
            common::sys::pidfd_open(i32::try_from(pid)?).ok()
        }
    };
    let status = child.wait()?;
    if !status.success() {
        bail!("bare bwrap failed: {status}");
    }
    if let Some(init) = init {
        let mut poll = libc::pollfd { fd: init.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll reads and writes one pollfd we own; -1 waits until the init's exit is
        // complete (a pidfd turns readable then). EINTR is retried.
        while common::sys::cvt(unsafe { libc::poll(&mut poll, 1, -1) })
            .is_err_and(|e| e.raw_os_error() == Some(libc::EINTR))
        {}
    }
    Ok(start.elapsed())
}

/// (b): through sandbox-init, as runnerd launches.
async fn init_once(setup: &Setup) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let launch = Launch {
        bwrap: setup.bwrap.clone(),
        options: setup.options.clone(),
        command: setup.command.clone(),
        filter: Some(Filter::Profile(Profile::Baseline)),
        rlimits: default_rlimits(None),
        stdin: Vec::new(),
        timeout: Some(Duration::from_secs(30)),
        cancel: None,
        extra_fds: Default::default(),
        cgroup_procs: Vec::new(),
    };
    let outcome = setup.launcher.run(launch, &mut Discard).await?;
    if outcome.termination != Termination::Exited(0) {
        bail!("launch through sandbox-init failed: {:?}", outcome.termination);
    }
    Ok(start.elapsed())
}

pub(crate) struct Stats {
    pub(crate) p50: f64,
    pub(crate) p95: f64,
    pub(crate) per_sec: f64,
}

/// `n` bare launches on two threads at once (`n / 2` each): the parallel baselines.
fn two_bare_launchers(
    setup: &Arc<Setup>,
    n: usize,
    launch: fn(&Setup) -> anyhow::Result<Duration>,
) -> anyhow::Result<Stats> {
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let s = setup.clone();
            std::thread::spawn(move || (0..n / 2).map(|_| launch(&s)).collect::<anyhow::Result<Vec<_>>>())
        })
        .collect();
    let mut samples = Vec::new();
    for h in handles {
        samples.extend(h.join().map_err(|_| anyhow::anyhow!("bench thread panicked"))??);
    }
    Ok(stats(samples, start.elapsed()))
}

pub(crate) fn stats(mut samples: Vec<Duration>, wall: Duration) -> Stats {
    if samples.is_empty() {
        return Stats { p50: 0.0, p95: 0.0, per_sec: 0.0 };
    }
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| ms(samples[((samples.len() - 1) as f64 * q).round() as usize]);
    Stats { p50: at(0.50), p95: at(0.95), per_sec: samples.len() as f64 / wall.as_secs_f64() }
}

async fn bench(n: usize) -> anyhow::Result<()> {
    let setup = Arc::new(setup().await?);
    println!("runnerd-bench: {n} launches of /usr/bin/true per case; bwrap {}", setup.bwrap.display());
    println!(
        "bwrap argv ({} args) and seccomp program ({} bytes) identical in every case\n",
        setup.args.len(),
        setup.program.len()
    );

    for _ in 0..5 {
        bare_once(&setup.bwrap, &setup.args, &setup.program)?;
        init_once(&setup).await?;
    }

    let (a_seq, b_seq) = sequential_launches(&setup, n).await?;
    let (a_par, b_par) = parallel_launches(&setup, n).await?;

    println!("{:<44} {:>9} {:>9} {:>11}", "case", "p50 ms", "p95 ms", "launches/s");
    for (name, s) in [
        ("(a) bare bwrap, sequential", &a_seq),
        ("(b) sandbox-init + launcher, sequential", &b_seq),
        ("(a) bare bwrap, 2 parallel", &a_par),
        ("(b) sandbox-init + launcher, 2 parallel", &b_par),
    ] {
        println!("{name:<44} {:>9.2} {:>9.2} {:>11.1}", s.p50, s.p95, s.per_sec);
    }
    println!();
    println!("ratio (b)/(a) at p50, sequential: {:.3}  (target <= 1.10)", b_seq.p50 / a_seq.p50);
    println!("ratio (b)/(a) at p50, 2 parallel: {:.3}", b_par.p50 / a_par.p50);
    println!("ratio (b)/(a) throughput, 2 parallel: {:.3}", b_par.per_sec / a_par.per_sec);

    let init = setup.launcher.init_path();
    let rss = sandbox_init_peak_rss_kib(init, &setup.args)?;
    println!("sandbox-init: {}", init.display());
    println!(
        "sandbox-init peak RSS before exec (VmHWM): {rss} KiB ({:.2} MiB, target <= 2 MiB)",
        rss as f64 / 1024.0
    );
    println!();
    // The API runs `bash -s` with the code on stdin: its bare-bwrap baseline, same argv.
    let (shell, wall) = bare_shell_runs(&setup, n, Until::BwrapExits)?;
    let a_shell = stats(shell, wall);
    println!(
        "(a') bare bwrap, `bash -s` with `true` on stdin: p50 {:.2} ms, p95 {:.2} ms",
        a_shell.p50, a_shell.p95
    );
    let a_shell_par = two_bare_launchers(&setup, n, |s| {
        bare_with_stdin(&s.bwrap, &s.shell_args, &s.program, Some(b"true"), Until::BwrapExits)
    })?;
    println!(
        "(a') bare bwrap, `bash -s`, 2 parallel launchers: p50 {:.2} ms, {:.1} launches/s\n",
        a_shell_par.p50, a_shell_par.per_sec
    );
    let launcher_extra_ms = b_seq.p50 - a_seq.p50;
    let base =
        Baselines { seq: a_seq, shell: a_shell, par: a_par, shell_par: a_shell_par, launcher_extra_ms };
    http_cases(n, &setup, init, &base).await
}

/// (a) bare bwrap and (b) sandbox-init + launcher, `n` launches each, interleaved.
async fn sequential_launches(setup: &Setup, n: usize) -> anyhow::Result<(Stats, Stats)> {
    let (mut bare, mut init) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut bare_wall, mut init_wall) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..n {
        let d = bare_once(&setup.bwrap, &setup.args, &setup.program)?;
        bare_wall += d;
        bare.push(d);
        let d = init_once(setup).await?;
        init_wall += d;
        init.push(d);
    }
    Ok((stats(bare, bare_wall), stats(init, init_wall)))
}

/// (a) and (b) again, from two parallel launchers each.
async fn parallel_launches(setup: &Arc<Setup>, n: usize) -> anyhow::Result<(Stats, Stats)> {
    let a_par = two_bare_launchers(setup, n, |s| bare_once(&s.bwrap, &s.args, &s.program))?;
    let start = Instant::now();
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let s = setup.clone();
            tokio::spawn(async move {
                let mut v = Vec::new();
                for _ in 0..n / 2 {
                    v.push(init_once(&s).await?);
                }
                Ok::<_, anyhow::Error>(v)
            })
        })
        .collect();
    let mut init = Vec::new();
    for t in tasks {
        init.extend(t.await??);
    }
    let b_par = stats(init, start.elapsed());
    Ok((a_par, b_par))
}

/// The version benchmark: commit cost on a scratch tree, then log throughput through a
/// real runnerd (sandbox-init from `SCIENCE_AGENT_SANDBOX_INIT_PATH` or next to us).
async fn bench_versions(files: usize, mib: u64, log_mb: u64) -> anyhow::Result<()> {
    let base = std::env::var_os("RUNNER_BENCH_DIR").map(PathBuf::from).unwrap_or_else(|| "/var/tmp".into());
    let scratch = Scratch(base.join(format!("runnerd-bench-versions-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0)?;
    let size = crate::versions::TreeSize { files, bytes: mib << 20 };
    crate::versions::commit_cost(&scratch.0, size).await?;
    drop(scratch);
    println!();
    let setup = setup().await?;
    let daemon = start_runnerd_with(setup.launcher.init_path(), "versions", &[])?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    let _ = client.raw("GET", "/health", &[], Vec::new()).await;
    crate::versions::log_throughput(&client, log_mb).await
}

/// runnerd's peak RSS during output floods (sandbox-init as for `versions`).
async fn bench_output(mib: u64) -> anyhow::Result<()> {
    let setup = setup().await?;
    crate::output::bench(setup.launcher.init_path(), mib).await
}

/// The cost of `GET /metrics` scrapes on execution latency (sandbox-init as for `versions`).
async fn bench_scale() -> anyhow::Result<()> {
    let setup = setup().await?;
    crate::scale::bench(setup.launcher.init_path()).await
}

async fn bench_metrics(n: usize) -> anyhow::Result<()> {
    let setup = setup().await?;
    crate::metrics::bench(setup.launcher.init_path(), n).await
}

/// A runnerd started from the binary next to this one, on an ephemeral port.
pub(crate) struct Daemon {
    pub(crate) child: std::process::Child,
    pub(crate) endpoint: Endpoint,
    exe: PathBuf,
    _scratch: Scratch,
}

impl Daemon {
    /// Its `SCIENCE_AGENT_DATA_DIR`.
    pub(crate) fn data_dir(&self) -> PathBuf {
        self._scratch.0.join("data")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) const BENCH_TOKEN: &str = "bench-token";

/// The runnerd next to this binary (`RUNNERD_BENCH_RUNNERD` names another).
fn runnerd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("RUNNERD_BENCH_RUNNERD") {
        return PathBuf::from(p);
    }
    std::env::current_exe().map(|e| e.with_file_name("runnerd")).unwrap_or_else(|_| "runnerd".into())
}

/// A runnerd in a scratch directory named after `tag`, with `env` added.
pub(crate) fn start_runnerd_with(init: &Path, tag: &str, env: &[(&str, &str)]) -> anyhow::Result<Daemon> {
    start_runnerd_at(&runnerd_binary(), init, tag, env)
}

/// [`start_runnerd_with`] for the runnerd binary `runnerd`.
fn start_runnerd_at(runnerd: &Path, init: &Path, tag: &str, env: &[(&str, &str)]) -> anyhow::Result<Daemon> {
    let scratch = std::env::temp_dir().join(format!("runnerd-bench-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let scratch = Scratch(scratch);
    // `--dev`: as root, sandboxes run as nobody (the token still comes from the variable).
    let mut child = Command::new(runnerd)
        .arg("--dev")
        .env("SCIENCE_AGENT_DATA_DIR", scratch.0.join("data"))
        .env("SCIENCE_AGENT_RUNNER_PORT", "0")
        .env("SCIENCE_AGENT_RUNNER_TOKEN", BENCH_TOKEN)
        .env("SCIENCE_AGENT_SANDBOX_INIT_PATH", init)
        .env("SCIENCE_AGENT_LOG_LEVEL", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", runnerd.display()))?;
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().context("stdout")?));
    let first = lines.next().context("runnerd printed nothing")??;
    let address =
        first.strip_prefix("ScienceDiscovery runner listening on ").context("unexpected start-up line")?;
    let endpoint = Endpoint::parse(address);
    std::thread::spawn(move || for _ in lines {});
    Ok(Daemon { child, endpoint, exe: runnerd.to_owned(), _scratch: scratch })
}

pub(crate) fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One signed `POST /execute-shell` of `true` in the remote workspace `key`, as agent `bench`.
pub(crate) async fn http_once(client: &RunnerClient, key: &str) -> anyhow::Result<Duration> {
    http_once_as(client, key, "bench").await
}

/// A signed-route body running `true` in the remote workspace `key`, as `agent`, with a
/// fresh execution id.
pub(crate) fn true_request(key: &str, agent: &str) -> serde_json::Value {
    serde_json::json!({
        "agentId": agent,
        "code": "true",
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(key),
        "runnerWorkspaceKey": key,
    })
}

/// The same, as `agent`: one session-agent runs one execution at a time (contract §2A), so
/// only distinct agents can run side by side.
pub(crate) async fn http_once_as(client: &RunnerClient, key: &str, agent: &str) -> anyhow::Result<Duration> {
    let body = true_request(key, agent);
    let start = Instant::now();
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 200 || reply.json()["exitCode"] != 0 {
        bail!("runnerd answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(start.elapsed())
}

/// The runnerd binaries measured: the one next to this bench, and the baseline named by
/// `RUNNERD_BENCH_BASELINE` (a runnerd built from another commit), both in this run.
fn runnerds_measured() -> Vec<(String, PathBuf)> {
    let mut out = vec![("this".to_owned(), runnerd_binary())];
    if let Some(base) = std::env::var_os("RUNNERD_BENCH_BASELINE") {
        out.push(("baseline".to_owned(), PathBuf::from(base)));
    }
    out
}

/// A process's own CPU time so far (utime + stime, fields 14 and 15 of `/proc/PID/stat`)
/// and its reaped children's (cutime + cstime, 16 and 17), in ms.
pub(crate) fn cpu_ms(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces; the fields after its `)` start at 3.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("no ')' in /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields.get(i - 3).and_then(|f| f.parse().ok()).context("short /proc/PID/stat")
    };
    // SAFETY: sysconf reads a constant of the running system; no memory is passed.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz <= 0 {
        bail!("sysconf(_SC_CLK_TCK) failed");
    }
    let ms = |a: u64, b: u64| (a + b) as f64 * 1000.0 / hz as f64;
    Ok((ms(ticks(14)?, ticks(15)?), ms(ticks(16)?, ticks(17)?)))
}

/// runnerd's own CPU time so far in ms ([`cpu_ms`]; its children's are not counted).
pub(crate) fn own_cpu_ms(pid: u32) -> anyhow::Result<f64> {
    Ok(cpu_ms(pid)?.0)
}

/// runnerd's threads' CPU time so far in ms, to the nanosecond (the first field of each
/// `/proc/PID/task/TID/schedstat`): finer than [`own_cpu_ms`]'s clock ticks (10 ms) for
/// spans that cost a few ms, but blind to threads that ended in between (so measure across
/// spans shorter than tokio's 10 s blocking-thread keep-alive).
pub(crate) fn live_threads_cpu_ms(pid: u32) -> anyhow::Result<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(text) = std::fs::read_to_string(task?.path().join("schedstat")) else { continue };
        ns += text.split_whitespace().next().and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok(ns as f64 / 1e6)
}

/// The least (c)/(a') possible: the bare run (`run`: (a') or (a'')), plus what sandbox-init
/// and the launcher add to it, plus the commit the format requires, over (a') (each at p50,
/// in ms).
fn floor_ratio(run: f64, launcher_extra: f64, durable_commit: f64, bare_shell: f64) -> f64 {
    (run + launcher_extra.max(0.0) + durable_commit) / bare_shell
}

/// The phases in the order an execution passes them (a phase this list does not know
/// comes last, as scraped), so that two runs' breakdowns read side by side.
pub(crate) fn in_pipeline_order(phases: &[(String, f64, f64)]) -> Vec<(&str, f64, f64)> {
    const ORDER: [&str; 8] = ["parse", "admit", "lease", "launch", "wait", "snapshot", "commit", "answer"];
    let rank = |p: &str| ORDER.iter().position(|o| *o == p).unwrap_or(ORDER.len());
    let mut out: Vec<(&str, f64, f64)> = phases.iter().map(|(p, s, c)| (p.as_str(), *s, *c)).collect();
    out.sort_by_key(|(p, ..)| rank(p));
    out
}

/// `runner_execution_phase_seconds` sums and counts by phase, from a scrape.
pub(crate) fn phase_totals(text: &str) -> Vec<(String, f64, f64)> {
    let mut out: Vec<(String, f64, f64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("runner_execution_phase_seconds_") else { continue };
        // Only the sums and counts: a bucket line carries an `le` label after the phase.
        let Some((which @ ("sum" | "count"), rest)) = rest.split_once("{phase=\"") else { continue };
        let Some((phase, value)) = rest.split_once("\"} ") else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let at = match out.iter().position(|(p, ..)| p == phase) {
            Some(i) => i,
            None => {
                out.push((phase.to_owned(), 0.0, 0.0));
                out.len() - 1
            }
        };
        if which == "sum" {
            out[at].1 = value;
        } else {
            out[at].2 = value;
        }
    }
    out
}

pub(crate) async fn scrape(client: &RunnerClient) -> Vec<(String, f64, f64)> {
    match client.get("/metrics").await {
        Ok(r) if r.status == 200 => phase_totals(&String::from_utf8_lossy(&r.body)),
        _ => Vec::new(),
    }
}

/// One runnerd under test and what was measured of it.
struct Subject {
    name: String,
    daemon: Daemon,
    client: Arc<RunnerClient>,
    samples: Vec<Duration>,
    wall: Duration,
    cpu_ms: f64,
    idle_rss: u64,
    phases: Vec<(String, f64, f64)>,
}

/// Interleaved rounds of the sequential case, so that drift hits every runnerd alike.
const ROUNDS: usize = 4;

/// (c) sequential signed executions through runnerd, with runnerd's own CPU per execution
/// and the per-phase breakdown its metrics give; (d) 2, 4 and 8 concurrent clients of one
/// agent over distinct workspaces, (e) 2 agents; (f) the format's durable commit alone, in
/// the sequential rounds; runnerd's RSS idle and at concurrency 8. With a baseline runnerd,
/// every case runs against both, sequential rounds interleaved; `base` holds the bare
/// launchers' numbers they are compared with.
async fn http_cases(n: usize, setup: &Setup, init: &Path, base: &Baselines) -> anyhow::Result<()> {
    let mut subjects = start_subjects(init, n).await?;
    let rounds = sequential_rounds(setup, &mut subjects, n).await?;
    let concurrent = concurrent_cases(&subjects, n).await?;
    print_http_cases(&subjects, &concurrent, &rounds, base);
    for (s, rows) in subjects.iter().zip(&concurrent) {
        s.print_summary(rows, base, &rounds);
    }
    Ok(())
}

/// The bare launchers' numbers the HTTP cases are compared with: (a) sequential and with
/// two parallel launchers, (a') `bash -s` the same, and what sandbox-init and the launcher
/// add to bare bwrap at p50 ((b) − (a)), for the floor of (c).
struct Baselines {
    seq: Stats,
    shell: Stats,
    par: Stats,
    shell_par: Stats,
    launcher_extra_ms: f64,
}

/// What the sequential rounds measured beside the runnerds: bare bwrap with the same shell,
/// the same until its PID namespace is gone, and the format's durable commit alone.
struct Rounds {
    shell: Stats,
    gone: Stats,
    floor: floor::Floor,
}

/// Every runnerd measured, started and warmed, its idle RSS read.
async fn start_subjects(init: &Path, n: usize) -> anyhow::Result<Vec<Subject>> {
    let mut subjects = Vec::new();
    for (name, exe) in runnerds_measured() {
        let daemon = start_runnerd_at(&exe, init, &format!("http-{name}"), &[])?;
        let client = Arc::new(RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN));
        for _ in 0..5 {
            http_once(&client, "bench/warm").await?;
        }
        subjects.push(Subject {
            name,
            daemon,
            client,
            samples: Vec::with_capacity(n),
            wall: Duration::ZERO,
            cpu_ms: 0.0,
            idle_rss: 0,
            phases: Vec::new(),
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for s in &mut subjects {
        s.idle_rss = rss_kib(s.daemon.child.id(), "VmRSS:");
    }
    Ok(subjects)
}

/// (c) and (f): [`ROUNDS`] rounds, each bare bwrap, the commit floor, then every runnerd.
async fn sequential_rounds(setup: &Setup, subjects: &mut [Subject], n: usize) -> anyhow::Result<Rounds> {
    let per_round = n.div_ceil(ROUNDS);
    // Bare bwrap with the same shell, in the same rounds: the ratio the target names, with
    // the machine's drift shared.
    let (mut shell_rounds, mut shell_wall) = (Vec::with_capacity(n), Duration::ZERO);
    // The same, done only once the sandbox's PID namespace is gone (R-RUN-4's wait).
    let (mut gone_rounds, mut gone_wall) = (Vec::with_capacity(n), Duration::ZERO);
    // The format's durable commit alone, in the same rounds (see `floor`).
    let mut floor = floor::Floor::default();
    for _ in 0..ROUNDS {
        for (until, runs, wall) in [
            (Until::BwrapExits, &mut shell_rounds, &mut shell_wall),
            (Until::NamespaceGone, &mut gone_rounds, &mut gone_wall),
        ] {
            let (round, took) = bare_shell_runs(setup, per_round, until)?;
            runs.extend(round);
            *wall += took;
        }
        floor.add(floor::durable_commit_floor(&std::env::temp_dir(), per_round)?);
        for s in subjects.iter_mut() {
            s.round(per_round).await?;
        }
    }
    Ok(Rounds { shell: stats(shell_rounds, shell_wall), gone: stats(gone_rounds, gone_wall), floor })
}

/// (d) one agent from several clients (its executions queue, contract §2A), then (e) two
/// agents side by side: the case two parallel bare launchers compare with. One row per
/// runnerd: 2, 4 and 8 clients, then 2 agents.
async fn concurrent_cases(subjects: &[Subject], n: usize) -> anyhow::Result<Vec<Vec<Stats>>> {
    let mut concurrent: Vec<Vec<Stats>> = Vec::new();
    for s in subjects {
        let mut rows = Vec::new();
        for (clients, agents) in [(2usize, false), (4, false), (8, false), (2, true)] {
            let start = Instant::now();
            let tasks: Vec<_> = (0..clients)
                .map(|i| {
                    let client = s.client.clone();
                    let per = (n / clients).max(1);
                    let agent = if agents { format!("bench-{i}") } else { "bench".to_owned() };
                    tokio::spawn(async move {
                        let key = format!("bench/c{clients}-{i}{}", if agents { "-agent" } else { "" });
                        let mut v = Vec::with_capacity(per);
                        for _ in 0..per {
                            v.push(http_once_as(&client, &key, &agent).await?);
                        }
                        Ok::<_, anyhow::Error>(v)
                    })
                })
                .collect();
            let mut samples = Vec::new();
            for t in tasks {
                samples.extend(t.await??);
            }
            rows.push(stats(samples, start.elapsed()));
        }
        concurrent.push(rows);
    }
    Ok(concurrent)
}

/// The table of every case, and the floor of (c) the launcher and the format allow.
fn print_http_cases(subjects: &[Subject], concurrent: &[Vec<Stats>], rounds: &Rounds, base: &Baselines) {
    let (a_shell_rounds, a_gone, floor) = (&rounds.shell, &rounds.gone, &rounds.floor);
    println!("{:<44} {:>9} {:>9} {:>11}", "case", "p50 ms", "p95 ms", "execs/s");
    for (label, r) in [
        ("(a') bare bwrap `bash -s`, in (c)'s rounds", a_shell_rounds),
        ("(a'') the same, until its namespace is gone", a_gone),
    ] {
        println!("{label:<44} {:>9.2} {:>9.2} {:>11.1}", r.p50, r.p95, r.per_sec);
    }
    for (s, rows) in subjects.iter().zip(concurrent) {
        let seq = stats(s.samples.clone(), s.wall);
        println!(
            "{:<44} {:>9.2} {:>9.2} {:>11.1}",
            format!("(c) runnerd HTTP, sequential [{}]", s.name),
            seq.p50,
            seq.p95,
            seq.per_sec
        );
        for (label, r) in [
            "(d) runnerd HTTP, 2 clients",
            "(d) runnerd HTTP, 4 clients",
            "(d) runnerd HTTP, 8 clients",
            "(e) runnerd HTTP, 2 agents",
        ]
        .iter()
        .zip(rows)
        {
            println!(
                "{:<44} {:>9.2} {:>9.2} {:>11.1}",
                format!("{label} [{}]", s.name),
                r.p50,
                r.p95,
                r.per_sec
            );
        }
    }
    let floor_stats = floor.stats();
    println!(
        "{:<44} {:>9.2} {:>9.2} {:>11.1}",
        "(f) the format's durable commit alone", floor_stats.p50, floor_stats.p95, floor_stats.per_sec
    );
    println!(
        "    (f): temp, fsync, link, directory fsync, refs transaction (WAL, synchronous=FULL); mean {:.3} ms, {:.3} ms CPU per commit",
        floor.mean_ms(),
        floor.cpu_per_commit_ms()
    );
    println!(
        "    the least (c)/(a') the launcher and the format allow here, before HTTP, the lease, cgroups and the workspace walks: ((a') + ((b)-(a)) + (f)) / (a') = ({:.2} + {:.2} + {:.2}) / {:.2} = {:.3}",
        a_shell_rounds.p50,
        base.launcher_extra_ms,
        floor_stats.p50,
        a_shell_rounds.p50,
        floor_ratio(a_shell_rounds.p50, base.launcher_extra_ms, floor_stats.p50, a_shell_rounds.p50)
    );
    println!(
        "    the same with R-RUN-4's wait for the PID namespace's end, (a'') for (a') on top: ({:.2} + {:.2} + {:.2}) / {:.2} = {:.3}",
        a_gone.p50,
        base.launcher_extra_ms,
        floor_stats.p50,
        a_shell_rounds.p50,
        floor_ratio(a_gone.p50, base.launcher_extra_ms, floor_stats.p50, a_shell_rounds.p50)
    );
}

impl Subject {
    /// One sequential round of `per_round` executions: their times, runnerd's own CPU and
    /// the phases its metrics add up.
    async fn round(&mut self, per_round: usize) -> anyhow::Result<()> {
        let pid = self.daemon.child.id();
        let before = scrape(&self.client).await;
        let cpu = own_cpu_ms(pid)?;
        let start = Instant::now();
        for _ in 0..per_round {
            self.samples.push(http_once(&self.client, "bench/seq").await?);
        }
        self.wall += start.elapsed();
        self.cpu_ms += own_cpu_ms(pid)? - cpu;
        let after = scrape(&self.client).await;
        for (phase, sum, count) in after {
            let (b_sum, b_count) =
                before.iter().find(|(p, ..)| *p == phase).map(|(_, s, c)| (*s, *c)).unwrap_or((0.0, 0.0));
            match self.phases.iter_mut().find(|(p, ..)| *p == phase) {
                Some(acc) => {
                    acc.1 += sum - b_sum;
                    acc.2 += count - b_count;
                }
                None => self.phases.push((phase, sum - b_sum, count - b_count)),
            }
        }
        Ok(())
    }

    /// This runnerd's ratios against the bare launchers, its CPU and RSS, and its phases.
    fn print_summary(&self, rows: &[Stats], base: &Baselines, rounds: &Rounds) {
        let (a_shell_rounds, floor) = (&rounds.shell, &rounds.floor);
        let seq = stats(self.samples.clone(), self.wall);
        let pid = self.daemon.child.id();
        println!("\n[{}] runnerd {}", self.name, self.daemon.exe.display());
        println!("  ratio (c)/(a) at p50: {:.3}", seq.p50 / base.seq.p50);
        println!(
            "  ratio (c)/(a') at p50 (same `bash -s`, bare bwrap, same rounds): {:.3}  (target <= 1.25; {:.3} against the earlier (a') run)",
            seq.p50 / a_shell_rounds.p50,
            seq.p50 / base.shell.p50
        );
        println!(
            "  runnerd's own CPU per sequential execution (utime+stime, children excluded): {:.3} ms over {} executions  (target <= 1 ms)",
            self.cpu_ms / self.samples.len() as f64,
            self.samples.len()
        );
        println!(
            "  throughput at 2 agents (e) / 2 parallel bare launchers: {:.3} against `true`, {:.3} against `bash -s`  (target >= 0.8)",
            rows[3].per_sec / base.par.per_sec,
            rows[3].per_sec / base.shell_par.per_sec
        );
        println!(
            "  throughput at 2 clients of one agent (d), whose executions queue: {:.3} against `true`, {:.3} against `bash -s`",
            rows[0].per_sec / base.par.per_sec,
            rows[0].per_sec / base.shell_par.per_sec
        );
        println!(
            "  runnerd RSS idle: {} KiB ({:.1} MiB, target <= 15 MiB); peak through the concurrent cases: {} KiB",
            self.idle_rss,
            self.idle_rss as f64 / 1024.0,
            rss_kib(pid, "VmHWM:")
        );
        if self.phases.is_empty() {
            println!("  phases: this runnerd exports no runner_execution_phase_seconds");
        } else {
            let total: f64 =
                self.phases.iter().map(|(_, sum, count)| if *count > 0.0 { sum / count } else { 0.0 }).sum();
            println!("  one execution by phase (mean ms, server-side; {:.2} ms in all):", total * 1000.0);
            for (phase, sum, count) in in_pipeline_order(&self.phases) {
                let mean = if count > 0.0 { sum / count * 1000.0 } else { 0.0 };
                if phase == "commit" {
                    println!(
                        "    {phase:<10} {mean:>8.3}  ((f), the format's durable floor: {:.3})",
                        floor.mean_ms()
                    );
                } else {
                    println!("    {phase:<10} {mean:>8.3}");
                }
            }
        }
    }
}

/// sandbox-init's own peak RSS (`VmHWM`), read while it waits for the last of its
/// descriptors: the realistic plan (this run's argv) is decoded and every other descriptor
/// received; what remains before exec allocates only the C argv. (`wait4`'s `ru_maxrss`
/// would not do: it also counts the spawning process's memory, shared until the exec.)
fn sandbox_init_peak_rss_kib(init: &Path, args: &[String]) -> anyhow::Result<u64> {
    let mut worst = 0;
    for _ in 0..5 {
        let (ours, theirs) = UnixStream::pair()?;
        let mut child = Command::new(init)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_clear()
            .spawn()?;
        let plan = LaunchPlan {
            program: "/nonexistent/bwrap-for-rss".into(),
            args: args.to_vec(),
            fds: vec![0, 1, 2, 3, 4],
            rlimits: default_rlimits(Some(1 << 30)),
            join_cgroups: 0,
            user: None,
            idmaps: Vec::new(),
        };
        std::io::Write::write_all(&mut &ours, &encode_frame(PROTOCOL_VERSION, &plan)?)?;
        let null = std::fs::File::open("/dev/null")?;
        let fds = [&null; 4].map(std::os::fd::AsFd::as_fd);
        channel::send_fds(std::os::fd::AsFd::as_fd(&ours), &fds)?;
        let proc_dir = format!("/proc/{}", child.id());
        let recvmsg = libc::SYS_recvmsg.to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let syscall = std::fs::read_to_string(format!("{proc_dir}/syscall")).unwrap_or_default();
            let status = std::fs::read_to_string(format!("{proc_dir}/status")).unwrap_or_default();
            // Blocked in recvmsg with four descriptors already placed at 3..=6.
            if syscall.split(' ').next() == Some(recvmsg.as_str())
                && std::path::Path::new(&format!("{proc_dir}/fd/6")).exists()
            {
                let hwm = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                    .context("no VmHWM in /proc/<pid>/status")?;
                worst = worst.max(hwm);
                break;
            }
            if Instant::now() > deadline {
                bail!("sandbox-init never reached its last recvmsg");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(ours);
        child.wait()?;
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_of_c_adds_the_launcher_and_the_commit_to_bare_bwrap() {
        // (bare run, launcher's excess, durable commit, (a')) -> least (c)/(a')
        for (run, extra, commit, bare, want) in [
            (8.0, 0.5, 1.0, 8.0, 1.1875),
            (10.0, 0.0, 0.0, 10.0, 1.0),
            // A launcher that came out faster than bare bwrap (noise) adds nothing.
            (8.0, -0.3, 2.0, 8.0, 1.25),
            // (a''): the run until the namespace is gone, over the plain (a').
            (9.0, 0.5, 0.5, 8.0, 1.25),
        ] {
            let got = floor_ratio(run, extra, commit, bare);
            assert!((got - want).abs() < 1e-9, "{run} {extra} {commit} {bare}: {got} != {want}");
        }
    }

    #[test]
    fn phases_print_in_the_order_an_execution_passes_them() {
        let scraped: Vec<(String, f64, f64)> = ["commit", "zzz-new", "wait", "parse", "answer", "lease"]
            .iter()
            .map(|p| ((*p).to_owned(), 1.0, 1.0))
            .collect();
        let order: Vec<&str> = in_pipeline_order(&scraped).iter().map(|(p, ..)| *p).collect();
        assert_eq!(order, ["parse", "lease", "wait", "commit", "answer", "zzz-new"]);
    }

    #[test]
    fn phase_totals_reads_sums_and_counts_by_phase() {
        let text = "runner_execution_phase_seconds_sum{phase=\"lease\"} 0.5\n\
                    runner_execution_phase_seconds_count{phase=\"lease\"} 2\n\
                    runner_execution_phase_seconds_bucket{phase=\"lease\",le=\"0.1\"} 1\n\
                    runner_other_total 3\n";
        assert_eq!(phase_totals(text), vec![("lease".to_owned(), 0.5, 2.0)]);
    }
}
