//! The processes the bench runs: the real `egressd` (the binary next to this one) and
//! tinyproxy with a generated configuration, each stopped when dropped; and reading a
//! process's memory from `/proc`.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use common::channel::{read_message, write_message};
use common::egress::protocol::{ControlRequest, ControlResponse, GatewayPolicy};
use common::egress::route::ProxySetting;

/// A scratch directory under /var/tmp (short, so socket paths fit), removed when dropped.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new() -> anyhow::Result<Scratch> {
        let dir = PathBuf::from(format!("/var/tmp/egb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process stopped (SIGTERM, then SIGKILL after a second) when dropped.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The end of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or_default().to_owned()
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits until `ready` holds, or fails with the log when the process exits or time runs out.
    fn wait_until(&mut self, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if ready() {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                bail!("{what} exited ({status}) before it was ready:\n{}", self.log_tail());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("{what} was not ready within 20 s:\n{}", self.log_tail())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(program: &Path, args: &[String], log: &Path) -> anyhow::Result<Child> {
    let stderr = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let stdout = stderr.try_clone()?;
    Command::new(program)
        .args(args)
        .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))
}

/// egressd as deployed (confined, default log level, logging to a file), with one gateway
/// acquired for the bench's policy; the lease's control connection stays open.
#[derive(Debug)]
pub struct Egressd {
    pub daemon: Daemon,
    pub gateway: PathBuf,
    _lease: UnixStream,
    /// VmRSS right after start, before the gateway existed.
    pub rss_started_kib: u64,
}

impl Egressd {
    pub fn start(scratch: &Path, dns: SocketAddr, max_tunnels: usize) -> anyhow::Result<Egressd> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let program = exe.with_file_name("egressd");
        if !program.is_file() {
            bail!("{} is missing: build the workspace's egressd in the same profile", program.display());
        }
        let control = scratch.join("c.sock");
        let args: Vec<String> = vec![
            "--control-socket".into(),
            control.display().to_string(),
            "--runtime-dir".into(),
            scratch.join("rt").display().to_string(),
            "--nameserver".into(),
            dns.to_string(),
            "--max-tunnels".into(),
            max_tunnels.to_string(),
        ];
        let log = scratch.join("egressd.log");
        let mut daemon = Daemon { child: spawn(&program, &args, &log)?, log };
        daemon.wait_until("egressd", || UnixStream::connect(&control).is_ok())?;
        // Let start-up settle (confinement, runtime threads) before reading its memory.
        std::thread::sleep(Duration::from_millis(200));
        let rss_started_kib = memory(daemon.pid())?.rss_kib;

        let mut lease = UnixStream::connect(&control).context("connecting to egressd's control socket")?;
        let policy = GatewayPolicy {
            revision: "bench".into(),
            allowed_domains: vec![super::BENCH_NAME.into()],
            allow_private_network: true,
            pinned_origins: Vec::new(),
        };
        let request = ControlRequest::Acquire {
            identity: policy.identity(),
            policy,
            route: ProxySetting::Direct,
            sandbox_uid: nix::unistd::geteuid().as_raw(),
        };
        write_message(&mut lease, &request).context("asking egressd for a gateway")?;
        let gateway = match read_message(&mut lease).context("reading egressd's answer")? {
            ControlResponse::Gateway { socket_path } => socket_path,
            other => bail!("egressd refused the gateway: {other:?}"),
        };
        Ok(Egressd { daemon, gateway, _lease: lease, rss_started_kib })
    }
}

/// tinyproxy's configuration for the bench: loopback only, CONNECT to the upstream's port
/// only, every host but `localhost` filtered out.
pub fn tinyproxy_config(port: u16, upstream_port: u16, filter: &Path, log: &Path) -> String {
    format!(
        "Listen 127.0.0.1\n\
         Port {port}\n\
         Timeout 600\n\
         MaxClients 200\n\
         Allow 127.0.0.1\n\
         ConnectPort {upstream_port}\n\
         FilterDefaultDeny Yes\n\
         Filter \"{}\"\n\
         LogLevel Error\n\
         LogFile \"{}\"\n",
        filter.display(),
        log.display(),
    )
}

/// The filter file: one pattern, `localhost`, anchored.
pub const TINYPROXY_FILTER: &str = "^localhost$\n";

/// Where tinyproxy is, if anywhere: `PATH`, then the Debian locations.
pub fn find_tinyproxy() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("tinyproxy"))
        .find(|p| p.is_file())
}

/// `tinyproxy -v`'s answer, trimmed.
pub fn tinyproxy_version(program: &Path) -> String {
    Command::new(program)
        .arg("-v")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

#[derive(Debug)]
pub struct Tinyproxy {
    pub daemon: Daemon,
    pub port: u16,
}

impl Tinyproxy {
    pub fn start(program: &Path, scratch: &Path, upstream_port: u16) -> anyhow::Result<Tinyproxy> {
        // A free port: bind, read it, release it (nothing else here races for it).
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let filter = scratch.join("tinyproxy.filter");
        std::fs::write(&filter, TINYPROXY_FILTER)?;
        let log = scratch.join("tinyproxy.log");
        let config = scratch.join("tinyproxy.conf");
        std::fs::write(&config, tinyproxy_config(port, upstream_port, &filter, &log))?;
        let args = vec!["-d".to_owned(), "-c".to_owned(), config.display().to_string()];
        let stdio_log = scratch.join("tinyproxy.stderr");
        let mut daemon = Daemon { child: spawn(program, &args, &stdio_log)?, log };
        daemon.wait_until("tinyproxy", || TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok())?;
        Ok(Tinyproxy { daemon, port })
    }
}

/// A process's resident memory now and at its peak, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    pub rss_kib: u64,
    pub hwm_kib: u64,
}

/// `VmRSS` and `VmHWM` from the text of `/proc/<pid>/status`.
pub fn parse_status(text: &str) -> Option<Memory> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some(Memory { rss_kib: field("VmRSS:")?, hwm_kib: field("VmHWM:")? })
}

pub fn memory(pid: u32) -> anyhow::Result<Memory> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    parse_status(&text).with_context(|| format!("no VmRSS/VmHWM in {path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tinyproxy_config_allows_only_the_upstream() {
        let text =
            tinyproxy_config(8888, 4242, Path::new("/var/tmp/x/f"), Path::new("/var/tmp/x/tinyproxy.log"));
        let lines: Vec<&str> = text.lines().collect();
        for want in [
            "Listen 127.0.0.1",
            "Port 8888",
            "ConnectPort 4242",
            "Allow 127.0.0.1",
            "FilterDefaultDeny Yes",
            "Filter \"/var/tmp/x/f\"",
            "MaxClients 200",
            "LogLevel Error",
        ] {
            assert!(lines.contains(&want), "{want:?} missing from:\n{text}");
        }
        assert_eq!(lines.iter().filter(|l| l.starts_with("ConnectPort")).count(), 1);
        assert_eq!(TINYPROXY_FILTER.trim(), "^localhost$");
    }

    #[test]
    fn proc_status_memory() {
        let text = "Name:\tegressd\nVmHWM:\t   12345 kB\nVmRSS:\t    6789 kB\nThreads:\t3\n";
        assert_eq!(parse_status(text), Some(Memory { rss_kib: 6789, hwm_kib: 12345 }));
        assert_eq!(parse_status("Name:\tx\n"), None);
    }
}
