//! PID 1 of the microVM. In this order:
//!
//! 1. mount `/proc`, `/sys`, `/dev` of the initramfs;
//! 2. load the modules `/lib/modules/load.list` names (virtio-mmio, virtio-serial, 9p);
//! 3. open the virtio-serial port named [`wire::PORT_NAME`] and say `Ready`;
//! 4. read the one [`wire::RunRequest`];
//! 5. build `/newroot`: the 9p shares (`/usr` read-only, the workspace writable, the
//!    environment prefix read-only at `/opt/science-env`, skills at `/skills` and
//!    `/skill-extensions`), `/proc`, `/dev`, a sized `/tmp`, `/etc/passwd` and `/etc/group`,
//!    the interpreter masks; bring `lo` up;
//!    with egress, open the port named [`wire::EGRESS_PORT_NAME`] and listen on
//!    `127.0.0.1:<egress_port>` ([`crate::egress`]) — still no NIC, no resolver;
//! 6. start the command chrooted there as the request's unprivileged uid, in its own
//!    session, with the request's environment and cwd; stdin comes from `Stdin` frames;
//! 7. stream its stdout and stderr as frames until it exits, then SIGKILL every other
//!    process of the guest and drain the pipes (R-RUN-4 inside the VM);
//! 8. report the exit (code or signal; an OOM kill from `/proc/vmstat`'s counter), sync,
//!    and reboot — with `-no-reboot` QEMU then exits.
//!
//! Any failure is reported as `Failed` when the port is open, then the VM ends the same way.
//! The agent is single-threaded except for the stdin feeder and the egress bridge's threads,
//! all started after the fork (the bridge's listener is bound before it).

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::wire::{self, Decoder, ExitRecord, GuestMsg, HostMsg, RunRequest};

const NEWROOT: &str = "/newroot";
/// 9p options: the 9p2000.L dialect and 256 KiB messages (the research's fastest).
const NINEP: &str = "trans=virtio,version=9p2000.L,msize=262144";
/// How long the modules' devices may take to appear.
const PORT_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("could not {what}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("no virtio-serial port named {0} appeared")]
    NoPort(&'static str),
    #[error("the host closed the channel before sending a command")]
    NoRequest,
    #[error("the host's message was refused")]
    Wire(#[source] wire::WireError),
    #[error("the host's first message was not a run request")]
    NotARun,
    #[error("the egress bridge could not start")]
    Egress(#[source] crate::egress::EgressError),
}

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> AgentError {
    let what = what.into();
    move |source| AgentError::Sys { what, source }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 { Err(io::Error::last_os_error()) } else { Ok(ret) }
}

fn cstr(s: &str) -> CString {
    CString::new(s).unwrap_or_else(|_| CString::from(c"/nonexistent"))
}

/// Runs the agent and powers the VM off; never returns.
pub fn run() -> ! {
    let mut port = None;
    if let Err(e) = serve(&mut port) {
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        eprintln!("runner-guest-agent: {text}");
        if let Some(port) = port.as_mut() {
            let _ = send(port, &GuestMsg::Failed(text));
        }
    }
    power_off()
}

fn power_off() -> ! {
    // SAFETY: sync and reboot take no pointers; as PID 1 the reboot ends the VM (QEMU runs
    // with -no-reboot, so a restart is an exit).
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    // Only reached if reboot failed: a panicking PID 1 panics the kernel, which with
    // `panic=-1` also ends the VM.
    std::process::abort()
}

fn serve(port_slot: &mut Option<File>) -> Result<(), AgentError> {
    // 1.
    mount(Some("proc"), "/proc", Some("proc"), 0, None)?;
    mount(Some("sys"), "/sys", Some("sysfs"), 0, None)?;
    mount(Some("dev"), "/dev", Some("devtmpfs"), 0, None)?;
    // 2.
    load_modules()?;
    // 3.
    let port = open_port(wire::PORT_NAME)?;
    let port = port_slot.insert(port);
    send(port, &GuestMsg::Ready { protocol: wire::PROTOCOL })?;
    // 4.
    let mut decoder = Decoder::default();
    let request = match read_msg(port, &mut decoder)? {
        Some(HostMsg::Run(r)) => r,
        Some(_) => return Err(AgentError::NotARun),
        None => return Err(AgentError::NoRequest),
    };
    // 5.
    build_root(&request)?;
    loopback_up()?;
    let bridge = match request.egress_port {
        Some(tcp_port) => {
            let egress = open_port(wire::EGRESS_PORT_NAME)?;
            Some(crate::egress::prepare(egress, tcp_port).map_err(AgentError::Egress)?)
        }
        None => None,
    };
    // 6. – 8.
    let record = run_command(&request, port, decoder, bridge)?;
    send(port, &GuestMsg::Exit(record))
}

fn mount(
    source: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: u64,
    data: Option<&str>,
) -> Result<(), AgentError> {
    let (src, tgt) = (source.map(cstr), cstr(target));
    let (fs, data) = (fstype.map(cstr), data.map(cstr));
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a NUL-terminated string that outlives the call, or null.
    cvt(unsafe { libc::mount(ptr(&src), tgt.as_ptr(), ptr(&fs), flags, ptr(&data).cast()) })
        .map_err(sys(format!("mount {} at {target}", source.unwrap_or("-"))))?;
    Ok(())
}

fn load_modules() -> Result<(), AgentError> {
    let list = std::fs::read_to_string("/lib/modules/load.list").map_err(sys("read the module list"))?;
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = format!("/lib/modules/{name}.ko");
        let file = File::open(&path).map_err(sys(format!("open {path}")))?;
        // SAFETY: finit_module reads the open module file and an empty parameter string.
        let r = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), c"".as_ptr(), 0) };
        if r == -1 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(sys(format!("load module {name}"))(e));
            }
        }
    }
    Ok(())
}

/// The `/dev/vportNpM` whose sysfs name is `name`, once it appears.
fn open_port(name: &'static str) -> Result<File, AgentError> {
    let deadline = Instant::now() + PORT_WAIT;
    loop {
        if let Ok(entries) = std::fs::read_dir("/sys/class/virtio-ports") {
            for entry in entries.flatten() {
                let named = std::fs::read(entry.path().join("name")).unwrap_or_default();
                if named.strip_suffix(b"\n").unwrap_or(&named) == name.as_bytes() {
                    let dev = Path::new("/dev").join(entry.file_name());
                    return std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&dev)
                        .map_err(sys(format!("open {}", dev.display())));
                }
            }
        }
        if Instant::now() > deadline {
            return Err(AgentError::NoPort(name));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn send(port: &mut File, msg: &GuestMsg) -> Result<(), AgentError> {
    let frame = wire::encode(msg).map_err(AgentError::Wire)?;
    port.write_all(&frame).map_err(sys("write to the host"))
}

/// The next host message; `None` once the host has closed the channel. A virtio-serial read
/// returns 0 while no host end is connected yet, so a 0 before any byte is retried briefly.
fn read_msg(port: &mut File, decoder: &mut Decoder) -> Result<Option<HostMsg>, AgentError> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut empty_reads = 0;
    loop {
        if let Some(msg) = decoder.next_msg().map_err(AgentError::Wire)? {
            return Ok(Some(msg));
        }
        match port.read(&mut buf) {
            Ok(0) if empty_reads < 2000 => {
                empty_reads += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            Ok(0) => return Ok(None),
            Ok(n) => decoder.feed(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(sys("read from the host")(e)),
        }
    }
}

fn build_root(r: &RunRequest) -> Result<(), AgentError> {
    let at = |p: &str| format!("{NEWROOT}{p}");
    let mkdir = |p: &str| std::fs::create_dir_all(at(p)).map_err(sys(format!("create {p}")));
    let ro = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    let rw = libc::MS_NOSUID | libc::MS_NODEV;
    mkdir("/usr")?;
    mount(Some("usr"), &at("/usr"), Some("9p"), ro, Some(NINEP))?;
    for (link, to) in
        [("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin")]
    {
        std::os::unix::fs::symlink(to, at(link)).map_err(sys(format!("link {link}")))?;
    }
    if let Some(parent) = &r.workspace_parent {
        mkdir(parent)?;
        mount(Some("wsparent"), &at(parent), Some("9p"), ro, Some(NINEP))?;
    }
    mkdir(&r.workspace)?;
    mount(Some("ws"), &at(&r.workspace), Some("9p"), rw, Some(NINEP))?;
    if r.science_env {
        mkdir("/opt/science-env")?;
        mount(Some("env"), &at("/opt/science-env"), Some("9p"), ro, Some(NINEP))?;
    }
    if let Some(packages) = &r.python_packages {
        mkdir(packages)?;
        mount(Some("pypkg"), &at(packages), Some("9p"), ro, Some(NINEP))?;
    }
    if r.skills {
        mkdir("/skills")?;
        mount(Some("skills"), &at("/skills"), Some("9p"), ro, Some(NINEP))?;
        mkdir("/skill-extensions")?;
        mount(Some("skillext"), &at("/skill-extensions"), Some("9p"), rw, Some(NINEP))?;
    }
    mkdir("/proc")?;
    mount(Some("proc"), &at("/proc"), Some("proc"), rw | libc::MS_NOEXEC, None)?;
    mkdir("/dev")?;
    mount(Some("dev"), &at("/dev"), Some("devtmpfs"), libc::MS_NOSUID | libc::MS_NOEXEC, None)?;
    mkdir("/tmp")?;
    let size = format!("size={},mode=1777", r.tmp_bytes.max(1 << 20));
    mount(Some("tmp"), &at("/tmp"), Some("tmpfs"), rw, Some(&size))?;
    mkdir("/etc")?;
    std::fs::write(at("/etc/passwd"), &r.passwd).map_err(sys("write /etc/passwd"))?;
    std::fs::write(at("/etc/group"), &r.group).map_err(sys("write /etc/group"))?;
    for mask in &r.masks {
        let target = at(mask);
        if Path::new(&target).exists() {
            mount(Some("/dev/null"), &target, None, libc::MS_BIND, None)?;
        }
    }
    Ok(())
}

/// Brings `lo` up, as bwrap's network namespace has it: the guest's only interface (no NIC),
/// so `127.0.0.1` works inside and nothing leaves.
fn loopback_up() -> Result<(), AgentError> {
    // SAFETY: a new socket, checked; owned below.
    let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })
        .map_err(sys("open a socket for lo"))?;
    // SAFETY: the descriptor was just created and is owned by nobody else.
    let sock = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we pass, which outlives the calls.
    unsafe {
        cvt(libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr)).map_err(sys("read lo's flags"))?;
        ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        cvt(libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr)).map_err(sys("bring lo up"))?;
    }
    Ok(())
}

/// Runs the command to its end and reports how it ended.
fn run_command(
    r: &RunRequest,
    port: &mut File,
    decoder: Decoder,
    bridge: Option<crate::egress::Bridge>,
) -> Result<ExitRecord, AgentError> {
    let oom_before = oom_kills();
    let mut cmd = Command::new(r.argv.first().map(String::as_str).unwrap_or("/bin/false"));
    cmd.args(r.argv.iter().skip(1))
        .env_clear()
        .envs(r.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (root, cwd) = (cstr(NEWROOT), cstr(&r.cwd));
    let (uid, gid, pids, fsize) = (r.uid, r.gid, r.pids, r.fsize);
    // SAFETY: the closure runs in the forked child of this single-threaded process and only
    // makes async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            cvt(libc::chroot(root.as_ptr()))?;
            cvt(libc::chdir(cwd.as_ptr()))?;
            cvt(libc::setsid())?;
            cvt(libc::setgroups(0, std::ptr::null()))?;
            cvt(libc::setgid(gid))?;
            if pids > 0 {
                let lim = libc::rlimit { rlim_cur: pids, rlim_max: pids };
                cvt(libc::setrlimit(libc::RLIMIT_NPROC, &lim))?;
            }
            let core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            cvt(libc::setrlimit(libc::RLIMIT_CORE, &core))?;
            if fsize > 0 {
                let lim = libc::rlimit { rlim_cur: fsize, rlim_max: fsize };
                cvt(libc::setrlimit(libc::RLIMIT_FSIZE, &lim))?;
            }
            cvt(libc::setuid(uid))?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(sys(format!("start {}", r.argv.first().map_or("", |s| s))))?;
    let pid = child.id() as libc::pid_t;
    // The bridge's listener was bound before the fork; its connections are served from now.
    if let Some(bridge) = bridge
        && let Err(e) = bridge.start()
    {
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        return Err(AgentError::Egress(e));
    }
    let stdin = child.stdin.take().map(OwnedFd::from);
    let stdout = child.stdout.take().map(OwnedFd::from);
    let stderr = child.stderr.take().map(OwnedFd::from);
    // The stdin feeder reads the host's Stdin frames on a dup of the port.
    let reader = port.try_clone().map_err(sys("duplicate the port"))?;
    std::thread::spawn(move || feed_stdin(reader, decoder, stdin));
    let mut status = None;
    let mut streams: Vec<(OwnedFd, bool)> =
        [stdout.map(|f| (f, true)), stderr.map(|f| (f, false))].into_iter().flatten().collect();
    let mut buf = vec![0u8; wire::MAX_CHUNK];
    while !streams.is_empty() || status.is_none() {
        let mut fds: Vec<libc::pollfd> = streams
            .iter()
            .map(|(fd, _)| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        // SAFETY: fds is a live array of the stated length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
        if n > 0 {
            let mut closed = Vec::new();
            for (i, p) in fds.iter().enumerate() {
                if p.revents == 0 {
                    continue;
                }
                // SAFETY: reads into our buffer from a pipe we own.
                let got = unsafe { libc::read(p.fd, buf.as_mut_ptr().cast(), buf.len()) };
                if got > 0 {
                    let chunk = buf[..got as usize].to_vec();
                    let msg = if streams[i].1 { GuestMsg::Stdout(chunk) } else { GuestMsg::Stderr(chunk) };
                    send(port, &msg)?;
                } else if got == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                    closed.push(i);
                }
            }
            for i in closed.into_iter().rev() {
                streams.remove(i);
            }
        }
        if status.is_none() {
            let mut raw = 0;
            // SAFETY: waits for our own child without blocking.
            if unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) } == pid {
                status = Some(raw);
                // The command is done: everything it left behind goes now, so the pipes
                // close and nothing writes to the workspace after the report.
                // SAFETY: kill(-1) from PID 1 signals every process but itself.
                unsafe { libc::kill(-1, libc::SIGKILL) };
            }
        }
        if status.is_some() {
            reap_all();
        }
    }
    std::mem::forget(child);
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    let raw = status.unwrap_or(0);
    let oom = oom_kills() > oom_before;
    Ok(if libc::WIFSIGNALED(raw) {
        ExitRecord { code: None, signal: Some(libc::WTERMSIG(raw)), oom_killed: oom }
    } else {
        ExitRecord { code: Some(libc::WEXITSTATUS(raw)), signal: None, oom_killed: oom }
    })
}

/// Reaps every exited process (orphans are PID 1's children); called once the command
/// itself was reaped, so this never takes its status.
fn reap_all() {
    loop {
        let mut raw = 0;
        // SAFETY: waitpid on any child without blocking.
        if unsafe { libc::waitpid(-1, &mut raw, libc::WNOHANG | libc::__WALL) } <= 0 {
            break;
        }
    }
}

fn feed_stdin(mut port: File, mut decoder: Decoder, stdin: Option<OwnedFd>) {
    let Some(stdin) = stdin else { return };
    let mut stdin = File::from(stdin);
    while let Ok(Some(msg)) = read_msg(&mut port, &mut decoder) {
        match msg {
            HostMsg::Stdin(bytes) => {
                if stdin.write_all(&bytes).is_err() {
                    return;
                }
            }
            HostMsg::StdinEnd | HostMsg::Run(_) => return,
        }
    }
}

/// The guest kernel's count of OOM kills so far.
fn oom_kills() -> u64 {
    let vmstat = std::fs::read("/proc/vmstat").unwrap_or_default();
    vmstat
        .split(|b| *b == b'\n')
        .find_map(|l| l.strip_prefix(b"oom_kill "))
        .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse().ok())
        .unwrap_or(0)
}
