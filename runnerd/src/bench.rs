//! `runnerd-bench`: launch overhead, measured against bare bwrap in the same run.
//!
//! Cases (N launches of `/usr/bin/true` each, identical bwrap argv, seccomp program on
//! fd 3 from a sealed memfd, info pipe on fd 4):
//! * (a) bare bwrap, spawned directly by this process;
//! * (b) through `sandbox-init` and the [`Launcher`](crate::launch::Launcher), as runnerd does;
//!
//! each sequentially (a and b interleaved, so drift hits both alike) and with 2 parallel
//! launchers. It prints p50/p95 per case, the ratio (b)/(a), and sandbox-init's peak RSS.
//! Figures, never pass/fail: tests do not time anything.

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

use crate::launch::{Filter, Launch, Launcher, OutputSink, Stream, Termination, bwrap_args, default_rlimits};
use crate::sandbox::{Language, SandboxSpec, WorkspaceLayout, argv};
use crate::startup;

const USAGE: &str = "\
runnerd-bench: sandbox launch overhead against bare bwrap, in one run.

Usage: runnerd-bench [--iterations N]   (default 200; build with --release)
";

pub fn run() -> i32 {
    let mut iterations = 200usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--iterations" | "-n" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) if n >= 4 => iterations = n,
                _ => {
                    eprintln!("runnerd-bench: --iterations needs a number ≥ 4\n\n{USAGE}");
                    return 2;
                }
            },
            "--help" | "-h" => {
                print!("{USAGE}");
                return 0;
            }
            other => {
                eprintln!("runnerd-bench: unknown argument {other:?}\n\n{USAGE}");
                return 2;
            }
        }
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runnerd-bench: {e}");
            return 1;
        }
    };
    match rt.block_on(bench(iterations)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("runnerd-bench: {e:#}");
            1
        }
    }
}

struct Discard;
impl OutputSink for Discard {
    fn write(&mut self, _: Stream, _: &[u8]) {}
}

struct Setup {
    launcher: Arc<Launcher>,
    bwrap: PathBuf,
    /// What the launcher gets; `args` is what bare bwrap gets: the same argv.
    options: Vec<String>,
    command: Vec<String>,
    args: Vec<String>,
    program: Vec<u8>,
    _scratch: Scratch,
}

struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn setup() -> anyhow::Result<Setup> {
    let scratch = std::env::temp_dir().join(format!("runnerd-bench-{}", std::process::id()));
    let workspace = scratch.join("projects/bench");
    std::fs::create_dir_all(&workspace).with_context(|| format!("creating {}", workspace.display()))?;
    let scratch = Scratch(scratch);
    let mut config = crate::cli::sandbox_config_from_env()?;
    config.data_dir = scratch.0.join("data");
    let runtime = startup::prepare(&config).await?;
    let Some(shape) = runtime.capability.shape() else {
        bail!("no usable sandbox on this host: {:?}", runtime.capability)
    };
    let layout = WorkspaceLayout::new(workspace.canonicalize()?, None);
    let cmd = argv::build(&SandboxSpec {
        shape,
        host: &runtime.host,
        workspace: &layout,
        cwd: None,
        language: Language::Shell,
        interpreter_masks: &[],
        python: "/usr/bin/python3",
        science_env: None,
    });
    let options = cmd.options.clone();
    let command = vec!["/usr/bin/true".to_owned()];
    let args = bwrap_args(&options, true, &command);
    let program = seccomp::compile(cmd.seccomp, Arch::host()?)?.bytes().to_vec();
    Ok(Setup {
        launcher: Arc::new(runtime.launcher),
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
fn bare_once(bwrap: &Path, args: &[String], program: &[u8]) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let memfd = sealed_memfd(program)?;
    let (info_r, info_w) = pipe()?;
    let (seccomp_raw, info_raw) = (memfd.as_raw_fd(), info_w.as_raw_fd());
    let mut cmd = Command::new(bwrap);
    cmd.args(args).env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
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
    drop(info_w);
    drop(memfd);
    let mut info = String::new();
    std::fs::File::from(info_r).read_to_string(&mut info)?;
    let status = child.wait()?;
    if !status.success() {
        bail!("bare bwrap failed: {status}");
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
    };
    let outcome = setup.launcher.run(launch, &mut Discard).await?;
    if outcome.termination != Termination::Exited(0) {
        bail!("launch through sandbox-init failed: {:?}", outcome.termination);
    }
    Ok(start.elapsed())
}

struct Stats {
    p50: f64,
    p95: f64,
    per_sec: f64,
}

fn stats(mut samples: Vec<Duration>, wall: Duration) -> Stats {
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

    // Sequential, interleaved.
    let (mut bare, mut init) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut bare_wall, mut init_wall) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..n {
        let d = bare_once(&setup.bwrap, &setup.args, &setup.program)?;
        bare_wall += d;
        bare.push(d);
        let d = init_once(&setup).await?;
        init_wall += d;
        init.push(d);
    }
    let a_seq = stats(bare, bare_wall);
    let b_seq = stats(init, init_wall);

    // Two parallel launchers each.
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let s = setup.clone();
            std::thread::spawn(move || {
                (0..n / 2)
                    .map(|_| bare_once(&s.bwrap, &s.args, &s.program))
                    .collect::<anyhow::Result<Vec<_>>>()
            })
        })
        .collect();
    let mut bare = Vec::new();
    for h in handles {
        bare.extend(h.join().map_err(|_| anyhow::anyhow!("bench thread panicked"))??);
    }
    let a_par = stats(bare, start.elapsed());

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
    Ok(())
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
