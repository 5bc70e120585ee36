//! Drives the real `sandbox-init` binary over a real socketpair. The exec'd program here is
//! a shell that reports what it inherited, so these tests see exactly what bwrap would.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};

use common::channel::{self, encode_frame};
use common::plan::{InitReport, InitStep, LaunchPlan, PROTOCOL_VERSION, Resource, Rlimit, SandboxUser};

const INIT: &str = env!("CARGO_BIN_EXE_sandbox-init");

struct Run {
    status: std::process::ExitStatus,
    /// `None`: `Executing` then end-of-file (bwrap — here a shell — is running).
    report: Option<InitReport>,
    stdout: String,
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the array with two new descriptors we then own.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are fresh and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Starts sandbox-init, sends `frame` and then stdin(/dev/null), stdout(pipe), stderr and
/// one extra descriptor at 3, collects what comes back.
fn launch_with_frame(frame: Vec<u8>, send_fds: bool) -> Run {
    launch_with(frame, send_fds, |_| {})
}

fn launch_with(frame: Vec<u8>, send_fds: bool, customize: impl FnOnce(&mut Command)) -> Run {
    launch_sending(frame, send_fds.then(|| tempfile::tempfile().unwrap()), customize)
}

/// Like [`launch_with`]; `fourth` is the descriptor sent after stdio (`None`: send nothing).
fn launch_sending(
    frame: Vec<u8>,
    fourth: Option<std::fs::File>,
    customize: impl FnOnce(&mut Command),
) -> Run {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let mut command = Command::new(INIT);
    command.stdin(Stdio::from(OwnedFd::from(theirs))).stdout(Stdio::null()).stderr(Stdio::inherit());
    customize(&mut command);
    let mut child = command.spawn().unwrap();
    drop(command); // it still holds our copy of sandbox-init's end of the channel
    std::io::Write::write_all(&mut &ours, &frame).unwrap();
    let (out_r, out_w) = pipe();
    if let Some(extra) = fourth {
        let null = std::fs::File::open("/dev/null").unwrap();
        let sent = [null.as_fd(), out_w.as_fd(), out_w.as_fd(), extra.as_fd()];
        let _ = channel::send_fds(ours.as_fd(), &sent);
    } else {
        // Nothing follows the frame: let sandbox-init see end-of-file where it waits for fds.
        ours.shutdown(std::net::Shutdown::Write).unwrap();
    }
    drop(out_w);
    let report = match channel::read_message::<InitReport>(&mut &ours) {
        Ok(InitReport::Executing) => match channel::read_message::<InitReport>(&mut &ours) {
            Err(channel::ChannelError::Closed) => None,
            Ok(after) => Some(after),
            Err(e) => panic!("unexpected channel error after Executing: {e}"),
        },
        Ok(failed) => Some(failed),
        Err(e) => panic!("sandbox-init closed the channel without a report: {e}"),
    };
    let mut stdout = String::new();
    std::fs::File::from(out_r).read_to_string(&mut stdout).unwrap();
    let status = child.wait().unwrap();
    Run { status, report, stdout }
}

fn plan(script: &str) -> LaunchPlan {
    LaunchPlan {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        fds: vec![0, 1, 2, 3],
        rlimits: vec![
            Rlimit::fixed(Resource::Core, 0),
            Rlimit::fixed(Resource::NoFile, 512),
            Rlimit { resource: Resource::FSize, soft: Some(1 << 20), hard: None },
        ],
        join_cgroups: 0,
        user: test_user(),
        idmaps: Vec::new(),
    }
}

/// Run as root, sandbox-init must be given an unprivileged user: `nobody`'s ids.
const NOBODY: SandboxUser = SandboxUser { uid: 65534, gid: 65534 };

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn test_user() -> Option<SandboxUser> {
    is_root().then_some(NOBODY)
}

fn launch(plan: &LaunchPlan) -> Run {
    launch_with_frame(encode_frame(PROTOCOL_VERSION, plan).unwrap(), true)
}

fn failed_step(run: &Run) -> InitStep {
    match &run.report {
        Some(InitReport::Failed(f)) => f.step,
        other => panic!("expected a failure report, got {other:?}"),
    }
}

#[test]
fn success_is_end_of_file_and_the_program_gets_exactly_the_placed_descriptors() {
    // Leak an inheritable descriptor into sandbox-init, as a careless parent might.
    // SAFETY: opening /dev/null without O_CLOEXEC; we close it below.
    let leaked = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY) };
    assert!(leaked >= 0);
    // `exec ls`: no shell pipeline whose own pipe descriptors could show up in the listing.
    let run = launch(&plan("exec ls -l /proc/self/fd"));
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(leaked) };
    assert!(run.report.is_none(), "exec should succeed: {:?}", run.report);
    assert!(run.status.success());
    // Every descriptor of ls except the one it opened to read the directory.
    let fds: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter(|(_, target)| !target.starts_with("/proc/"))
        .filter_map(|(left, _)| left.split_whitespace().last())
        .collect();
    assert_eq!(fds, ["0", "1", "2", "3"], "leaked fd was {leaked}: {}", run.stdout);
}

#[test]
fn environment_is_empty_limits_apply_and_signals_are_default() {
    let script = "env | wc -l; ulimit -c; ulimit -n; ulimit -f; ulimit -Hf; \
                  grep -E '^Sig(Ign|Blk)' /proc/$$/status | tr -s '\\t' ' '";
    // A careless parent: SIGHUP and SIGINT ignored, SIGUSR1 blocked, a variable set. All of
    // it would survive exec without sandbox-init's resets.
    let run = launch_with(encode_frame(PROTOCOL_VERSION, &plan(script)).unwrap(), true, |c| {
        use std::os::unix::process::CommandExt;
        c.env("LEAKED_SECRET", "x");
        // SAFETY: signal(2) and sigprocmask(2) are async-signal-safe.
        unsafe {
            c.pre_exec(|| {
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGUSR1);
                libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
    });
    assert!(run.report.is_none(), "{:?}", run.report);
    let lines: Vec<&str> = run.stdout.lines().collect();
    // sh itself exports PWD (and nothing else); the parent's environment is gone.
    assert!(lines[0].trim().parse::<u32>().unwrap() <= 2, "env lines: {}", lines[0]);
    assert_eq!(lines[1], "0");
    assert_eq!(lines[2], "512");
    assert_eq!(lines[3], "2048"); // ulimit -f counts 512-byte blocks
    // The hard FSIZE limit was left as it was (None = unchanged), not raised or lowered.
    assert_eq!(lines[4], "unlimited");
    assert_eq!(lines[5], "SigBlk: 0000000000000000");
    assert_eq!(lines[6], "SigIgn: 0000000000000000");
}

#[test]
fn a_failed_exec_is_reported_with_its_errno() {
    let mut p = plan("true");
    p.program = "/nonexistent/bwrap".into();
    let run = launch(&p);
    let Some(InitReport::Failed(f)) = &run.report else { panic!("no report") };
    assert_eq!(f.step, InitStep::Exec);
    assert_eq!(f.errno, libc::ENOENT);
    assert!(f.to_string().contains("/nonexistent/bwrap"), "{f}");
    assert_eq!(run.status.code(), Some(sandbox_init::FAILED_STATUS));
}

#[test]
fn a_protocol_mismatch_is_reported_clearly() {
    let run = launch_with_frame(encode_frame(PROTOCOL_VERSION + 1, &plan("true")).unwrap(), false);
    assert_eq!(failed_step(&run), InitStep::ReadPlan);
    let Some(InitReport::Failed(f)) = &run.report else { unreachable!() };
    assert!(f.detail.contains("protocol version"), "{}", f.detail);
}

#[test]
fn invalid_plans_and_garbage_are_refused() {
    let mut relative = plan("true");
    relative.program = "bwrap".into();
    assert_eq!(
        failed_step(&launch_with_frame(encode_frame(PROTOCOL_VERSION, &relative).unwrap(), false)),
        InitStep::ValidatePlan
    );

    let garbage = vec![3, 0, 0, 0, 1, 0xff, 0xff];
    assert_eq!(failed_step(&launch_with_frame(garbage, false)), InitStep::ReadPlan);

    let huge = vec![0xff, 0xff, 0xff, 0x7f];
    assert_eq!(failed_step(&launch_with_frame(huge, false)), InitStep::ReadPlan);

    // The plan announces four descriptors but none follow: the channel just closes.
    let run = launch_with_frame(encode_frame(PROTOCOL_VERSION, &plan("true")).unwrap(), false);
    assert_eq!(failed_step(&run), InitStep::ReceiveFds);
}

#[test]
fn a_bad_rlimit_is_reported() {
    let mut p = plan("true");
    // Raising the hard limit of open files above the kernel's nr_open fails even for root.
    p.rlimits = vec![Rlimit::fixed(Resource::NoFile, u64::from(u32::MAX))];
    let run = launch(&p);
    assert_eq!(failed_step(&run), InitStep::Rlimits);
}

#[test]
fn run_by_hand_it_explains_itself() {
    let out = Command::new(INIT).stdin(Stdio::null()).output().unwrap();
    assert_eq!(out.status.code(), Some(sandbox_init::USAGE_STATUS));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the Unix socket runnerd passes"));
    let help = Command::new(INIT).arg("--help").output().unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("execs bubblewrap"));
    let version = Command::new(INIT).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&version.stdout).contains(&format!("protocol {PROTOCOL_VERSION}")));
}

#[test]
fn it_dies_with_the_thread_that_spawned_it() {
    // PR_SET_PDEATHSIG fires when the spawning *thread* exits. Spawn from a short-lived
    // thread, wait until sandbox-init sits in step 4 (receiving descriptors: step 0 is done),
    // let the thread end, and expect SIGKILL.
    let (ours, theirs) = UnixStream::pair().unwrap();
    let child = std::thread::spawn(move || {
        let child = Command::new(INIT)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut &ours, &encode_frame(PROTOCOL_VERSION, &plan("true")).unwrap())
            .unwrap();
        let syscall_file = format!("/proc/{}/syscall", child.id());
        let recvmsg = libc::SYS_recvmsg.to_string();
        while std::fs::read_to_string(&syscall_file).unwrap_or_default().split(' ').next() != Some(&recvmsg) {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        (child, ours)
    })
    .join()
    .unwrap();
    let (mut child, _ours) = child;
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

#[test]
fn it_refuses_a_channel_its_parent_did_not_make() {
    // The socketpair is ours, but the parent is a shell: the shape of "runnerd died before
    // sandbox-init armed its death signal".
    let (_ours, theirs) = UnixStream::pair().unwrap();
    let out = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("{INIT} <&3"))
        .stdin(Stdio::null())
        .spawn_with_fd3(theirs);
    assert_eq!(out.status.code(), Some(sandbox_init::USAGE_STATUS));
    assert!(String::from_utf8_lossy(&out.stderr).contains("runnerd has exited or did not start us"));
}

trait SpawnWithFd3 {
    fn spawn_with_fd3(&mut self, fd: UnixStream) -> std::process::Output;
}

impl SpawnWithFd3 for Command {
    /// Runs the command with `fd` inherited as descriptor 3.
    fn spawn_with_fd3(&mut self, fd: UnixStream) -> std::process::Output {
        use std::os::unix::process::CommandExt;
        let raw = fd.as_raw_fd();
        // SAFETY: dup2 in the child between fork and exec is async-signal-safe.
        unsafe {
            self.pre_exec(move || {
                if libc::dup2(raw, 3) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = self.output().unwrap();
        drop(fd);
        out
    }
}

#[test]
fn a_cgroup_descriptor_is_written_then_closed_never_placed() {
    // The fourth descriptor stands for a cgroup.procs file: sandbox-init writes "0" (itself)
    // into it and closes it, so the program inherits only 0–2.
    let mut p = plan("exec ls -l /proc/self/fd");
    p.fds = vec![0, 1, 2];
    p.join_cgroups = 1;
    let procs = tempfile::NamedTempFile::new().unwrap();
    let run =
        launch_sending(encode_frame(PROTOCOL_VERSION, &p).unwrap(), Some(procs.reopen().unwrap()), |_| {});
    assert!(run.report.is_none(), "{:?}", run.report);
    assert_eq!(std::fs::read_to_string(procs.path()).unwrap(), "0");
    let fds: Vec<&str> = run
        .stdout
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter(|(_, target)| !target.starts_with("/proc/"))
        .filter_map(|(left, _)| left.split_whitespace().last())
        .collect();
    assert_eq!(fds, ["0", "1", "2"], "{}", run.stdout);
}

#[test]
fn a_refused_cgroup_join_is_a_typed_failure_and_nothing_runs() {
    let mut p = plan("echo ran");
    p.fds = vec![0, 1, 2];
    p.join_cgroups = 1;
    // /dev/full refuses every write (ENOSPC), as a cgroup would refuse a move.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let run = launch_sending(encode_frame(PROTOCOL_VERSION, &p).unwrap(), Some(full), |_| {});
    let Some(InitReport::Failed(f)) = &run.report else { panic!("expected a failure: {:?}", run.report) };
    assert_eq!((f.step, f.errno), (InitStep::JoinCgroups, libc::ENOSPC));
    assert!(f.to_string().contains("joining the execution's cgroups"), "{f}");
    assert_eq!(run.stdout, "");
}

#[test]
fn the_program_runs_as_the_plan_s_user_with_no_capabilities_and_never_as_root() {
    let script =
        "id -u; id -g; id -G; grep -E '^Cap(Eff|Prm|Inh|Bnd|Amb)' /proc/self/status | tr -s '\\t' ' '";
    let run = launch(&plan(script));
    assert!(run.report.is_none(), "{:?}", run.report);
    let lines: Vec<&str> = run.stdout.lines().collect();
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let expected = match test_user() {
        Some(u) => (u.uid, u.gid),
        None => (uid, gid),
    };
    assert_eq!(lines[..2], [expected.0.to_string(), expected.1.to_string()], "{}", run.stdout);
    assert_ne!(lines[0], "0");
    if is_root() {
        // Supplementary groups: only the primary one; root's are gone.
        assert_eq!(lines[2], expected.1.to_string(), "{}", run.stdout);
        for cap in ["CapEff: 0000000000000000", "CapPrm: 0000000000000000", "CapAmb: 0000000000000000"] {
            assert!(lines.contains(&cap), "{cap}: {}", run.stdout);
        }
    }

    // No user named: as root that is refused before anything runs; unprivileged, it runs
    // as the caller.
    let mut p = plan("id -u");
    p.user = None;
    let run = launch(&p);
    if is_root() {
        let Some(InitReport::Failed(f)) = &run.report else { panic!("expected a refusal: {:?}", run.report) };
        assert_eq!((f.step, f.errno), (InitStep::SwitchUser, libc::EPERM), "{f}");
        assert!(f.to_string().contains("refusing to execute bubblewrap as host root"), "{f}");
        assert_eq!(run.stdout, "");
    } else {
        assert!(run.report.is_none(), "{:?}", run.report);
        assert_eq!(run.stdout.trim(), uid.to_string());
    }
}

#[test]
fn an_unprivileged_caller_cannot_switch_and_says_so() {
    if is_root() {
        eprintln!("skipped: root can switch (the switch itself is tested above)");
        return;
    }
    let mut p = plan("echo ran");
    p.user = Some(NOBODY);
    let run = launch(&p);
    let Some(InitReport::Failed(f)) = &run.report else { panic!("expected a failure: {:?}", run.report) };
    assert_eq!((f.step, f.errno), (InitStep::SwitchUser, libc::EPERM), "{f}");
    assert!(f.to_string().contains("setgroups"), "{f}");
    assert_eq!(run.stdout, "");
}

#[test]
fn a_root_user_in_the_plan_is_refused_by_validation() {
    let mut p = plan("echo ran");
    p.user = Some(SandboxUser { uid: 0, gid: 0 });
    let run = launch(&p);
    assert_eq!(failed_step(&run), InitStep::ValidatePlan);
    assert_eq!(run.stdout, "");
}

#[test]
fn after_the_user_switch_it_still_dies_with_the_thread_that_spawned_it() {
    // A credential change clears PR_SET_PDEATHSIG; step 9 arms it again. Spawn from a
    // short-lived thread, let the exec'd program (already the sandbox user) start, end the
    // thread, and expect SIGKILL.
    if !is_root() {
        eprintln!("skipped: only root switches users (unprivileged, step 9 changes no credential)");
        return;
    }
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (child, _ours, _out) = std::thread::spawn(move || {
        let child = Command::new(INIT)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        std::io::Write::write_all(
            &mut &ours,
            &encode_frame(PROTOCOL_VERSION, &plan("exec sleep 30")).unwrap(),
        )
        .unwrap();
        let (out_r, out_w) = pipe();
        let null = std::fs::File::open("/dev/null").unwrap();
        let extra = tempfile::tempfile().unwrap();
        channel::send_fds(ours.as_fd(), &[null.as_fd(), out_w.as_fd(), out_w.as_fd(), extra.as_fd()])
            .unwrap();
        // Executing, then the program runs as the sandbox user.
        assert!(matches!(channel::read_message::<InitReport>(&mut &ours), Ok(InitReport::Executing)));
        let status = format!("/proc/{}/status", child.id());
        let uid_line = format!("Uid:\t{0}\t{0}\t{0}", NOBODY.uid);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read_to_string(&status).unwrap_or_default().contains(&uid_line) {
            assert!(std::time::Instant::now() < deadline, "the program never ran as the sandbox user");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        (child, ours, out_r)
    })
    .join()
    .unwrap();
    let mut child = child;
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}
