//! The real egress path's other parts for tests: a DNS server answering from a table (so an
//! allowlisted name can resolve to a loopback upstream), a small HTTP upstream, and the real
//! `egressd` binary.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egressd::dns::wire;

use crate::{bin, scratch_dir};

/// A UDP DNS server on 127.0.0.1 answering A/AAAA from a table (NXDOMAIN otherwise), and
/// recording every question.
#[derive(Debug)]
pub struct FakeDns {
    pub addr: SocketAddr,
    pub queries: Arc<Mutex<Vec<String>>>,
}

impl FakeDns {
    pub fn start(table: &[(&str, &[&str])]) -> FakeDns {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        let table: HashMap<String, Vec<IpAddr>> = table
            .iter()
            .map(|(name, ips)| (name.to_string(), ips.iter().map(|ip| ip.parse().unwrap()).collect()))
            .collect();
        let queries: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = queries.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf) else { return };
                let Ok(q) = wire::parse_query(&buf[..n]) else { continue };
                seen.lock().unwrap().push(q.name.clone());
                let answer = match table.get(&q.name.to_ascii_lowercase()) {
                    Some(ips) => wire::encode_answer(&q, ips, 0, 0),
                    None => wire::encode_answer(&q, &[], 0, 3),
                };
                let _ = socket.send_to(&answer, from);
            }
        });
        FakeDns { addr, queries }
    }
}

/// An HTTP/1.1 server on 127.0.0.1 that answers every request with `ok <path>` and the
/// `Host` it saw (`X-Seen-Host`), then closes. Requests it saw are recorded (head text).
#[derive(Debug)]
pub struct Upstream {
    pub port: u16,
    pub requests: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    pub fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let seen = seen.clone();
                std::thread::spawn(move || serve_one(stream, &seen));
            }
        });
        Upstream { port, requests }
    }
}

fn serve_one(stream: TcpStream, seen: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        head.push_str(&line);
        if line == "\r\n" || line == "\n" {
            break;
        }
    }
    let path = head.split_whitespace().nth(1).unwrap_or("?").to_owned();
    let host = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(n, _)| n.eq_ignore_ascii_case("host"))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_default();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .map(|(_, v)| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    let _ = reader.read_exact(&mut body);
    seen.lock().unwrap().push(head);
    let text =
        format!("ok {path}{}", if body.is_empty() { String::new() } else { format!(" body={}", body.len()) });
    let mut stream = stream;
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nX-Seen-Host: {host}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
}

/// A running egressd; killed on drop.
#[derive(Debug)]
pub struct Egressd {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub control_socket: PathBuf,
    pub runtime_dir: PathBuf,
    pub stderr_log: PathBuf,
    args: Vec<String>,
    how: Spawn,
}

/// How egressd is started besides its arguments.
#[derive(Debug, Clone, Default)]
pub struct Spawn {
    /// A command prefix (e.g. [`crate::journal::Journal::wrapper`]; it must end the daemon
    /// when it is killed, as `bwrap --die-with-parent` does).
    pub wrapper: Vec<String>,
    /// Variables over the defaults (`SCIENCE_AGENT_LOG_TARGET=stderr`).
    pub env: Vec<(String, String)>,
}

impl Egressd {
    /// Starts egressd with its sockets in a fresh scratch directory, resolving through `dns`.
    pub fn start(dns: SocketAddr, extra: &[&str]) -> Egressd {
        Egressd::start_with(dns, extra, Spawn::default())
    }

    /// [`Egressd::start`], under a wrapper or with other variables.
    pub fn start_with(dns: SocketAddr, extra: &[&str], how: Spawn) -> Egressd {
        let dir = scratch_dir();
        let control_socket = dir.path().join("control.sock");
        let runtime_dir = dir.path().join("rt");
        let mut args: Vec<String> = vec![
            "--control-socket".into(),
            control_socket.display().to_string(),
            "--runtime-dir".into(),
            runtime_dir.display().to_string(),
            "--nameserver".into(),
            dns.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let stderr_log = dir.path().join("egressd.stderr");
        let child = spawn(&args, &stderr_log, &how);
        let e = Egressd { child, dir, control_socket, runtime_dir, stderr_log, args, how };
        e.wait_ready();
        e
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.control_socket).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("egressd did not start:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again with the same settings (appending to the same log).
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(&self.args, &self.stderr_log, &self.how);
        self.wait_ready();
    }

    /// The environment runnerd needs to use this egressd.
    pub fn runner_env(&self) -> Vec<(String, String)> {
        vec![("SCIENCE_AGENT_EGRESS_SOCKET".into(), self.control_socket.display().to_string())]
    }

    pub fn gateway_sockets(&self) -> Vec<PathBuf> {
        let dir: &Path = &self.runtime_dir.join("eg");
        std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
    }

    /// SIGTERM to egressd itself (not its wrapper), then its exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let pid = if self.how.wrapper.is_empty() {
            Some(self.child.id())
        } else {
            crate::wrapped_pid(self.child.id())
        };
        if let Some(pid) = pid {
            // SAFETY: kill(2) on our own child (or its wrapper's child).
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }
}

fn spawn(args: &[String], log: &Path, how: &Spawn) -> Child {
    let stderr = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = match how.wrapper.split_first() {
        Some((program, prefix)) => {
            let mut cmd = Command::new(program);
            cmd.args(prefix).arg(bin("egressd"));
            cmd
        }
        None => Command::new(bin("egressd")),
    };
    cmd.args(args)
        .env_clear()
        .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
        // An empty configuration file: never the host's /etc/sciencediscovery/egressd.toml.
        .env("SCIENCE_AGENT_EGRESS_CONFIG", "/dev/null")
        .envs(how.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start egressd")
}

impl Drop for Egressd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One raw HTTP exchange over a gateway socket (what the bridge would relay): sends
/// `request`, returns everything received until the gateway closes (or `timeout`).
pub fn exchange(socket: &Path, request: &[u8], timeout: Duration) -> String {
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `body` with a domain-allowlist permission epoch: these domains, private network on or
/// off, and the caller's `revision` (which runnerd echoes but never uses to pick a gateway).
pub fn with_network(
    mut body: serde_json::Value,
    domains: &[&str],
    private: bool,
    revision: &str,
) -> serde_json::Value {
    body["permissionEpoch"]["networkPolicy"] = serde_json::json!("domain-allowlist");
    body["permissionEpoch"]["networkAccess"] = serde_json::json!({
        "mode": "domain-allowlist",
        "allowedDomains": domains,
        "allowPrivateNetwork": private,
        "revision": revision,
    });
    body
}

/// How many gateways (policies) egressd has created so far, from its log.
pub fn gateways_created(egressd: &Egressd) -> usize {
    egressd.log().lines().filter(|l| l.contains("gateway_created")).count()
}
