//! The built `egress-bridge`, driven from outside: a free loopback port per test, a Unix
//! listener in a temporary directory standing in for egressd.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

const BRIDGE: &str = env!("CARGO_BIN_EXE_egress-bridge");
/// No test should come near this; it only keeps a broken bridge from hanging the suite.
const DEADLINE: Duration = Duration::from_secs(30);

const BAD_GATEWAY: &str = "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\
    X-Sandbox-Network: the sandbox egress gateway is unreachable (egressd is not running or has restarted); \
    if egressd restarted, this sandbox's gateway is gone for good: run the execution again\r\n\r\n";

/// A port that was free a moment ago (the kernel's pick, so parallel tests do not collide).
fn free_port() -> u16 {
    let probe = TcpListener::bind("127.0.0.1:0").expect("bind a probe port");
    probe.local_addr().expect("probe address").port()
}

/// A running bridge whose stdout and stderr are being collected.
struct Bridge {
    child: Child,
    port: u16,
    stdout: JoinHandle<Vec<u8>>,
    stderr: JoinHandle<Vec<u8>>,
}

/// What a finished bridge left behind.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Bridge {
    fn start(socket: &Path, workload: &[&str]) -> Bridge {
        Bridge::start_with(socket, &[], workload, |_| {})
    }

    fn start_with(
        socket: &Path,
        options: &[&str],
        workload: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> Bridge {
        let port = free_port();
        let mut command = Command::new(BRIDGE);
        command
            .arg("--socket")
            .arg(socket)
            .args(["--port", &port.to_string()])
            .args(options)
            .arg("--")
            .args(workload)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        adjust(&mut command);
        let mut child = command.spawn().expect("start egress-bridge");
        let stdout = collect(child.stdout.take().expect("stdout pipe"));
        let stderr = collect(child.stderr.take().expect("stderr pipe"));
        Bridge { child, port, stdout, stderr }
    }

    /// Connects to the bridge, waiting for it to listen.
    fn connect(&self) -> TcpStream {
        let start = Instant::now();
        loop {
            match TcpStream::connect(("127.0.0.1", self.port)) {
                Ok(stream) => {
                    stream.set_read_timeout(Some(DEADLINE)).expect("read timeout");
                    return stream;
                }
                Err(e) if start.elapsed() < DEADLINE => {
                    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "connect: {e}");
                    thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("the bridge never listened on port {}: {e}", self.port),
            }
        }
    }

    fn stdin(&mut self) -> ChildStdin {
        self.child.stdin.take().expect("stdin pipe")
    }

    fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        signal::kill(pid, sig).expect("signal the bridge");
    }

    /// Closes the bridge's stdin (ending a `cat` workload) and waits for it to exit.
    fn finish(mut self) -> Finished {
        drop(self.child.stdin.take());
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for the bridge") {
                break status;
            }
            if start.elapsed() > DEADLINE {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("the bridge did not exit within {DEADLINE:?}");
            }
            thread::sleep(Duration::from_millis(10));
        };
        let text =
            |h: JoinHandle<Vec<u8>>| String::from_utf8(h.join().expect("collector")).expect("UTF-8 output");
        Finished { status, stdout: text(self.stdout), stderr: text(self.stderr) }
    }
}

fn collect(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut all = Vec::new();
        let _ = pipe.read_to_end(&mut all);
        all
    })
}

/// A stand-in for egressd: a Unix listener whose connections are each served on a thread.
fn gateway(path: &Path, serve: fn(UnixStream)) -> PathBuf {
    let listener = UnixListener::bind(path).expect("bind the gateway socket");
    thread::spawn(move || {
        for stream in listener.incoming() {
            let stream = stream.expect("gateway accept");
            thread::spawn(move || serve(stream));
        }
    });
    path.to_owned()
}

/// Echoes everything, then, once the client has half-closed, reports how much it received.
fn echo_then_count(mut stream: UnixStream) {
    let mut buffer = vec![0u8; 50_000];
    let mut total = 0usize;
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                stream.write_all(&buffer[..n]).expect("gateway echo");
                total += n;
            }
            Err(e) => panic!("gateway read: {e}"),
        }
    }
    stream.write_all(format!("received {total} bytes").as_bytes()).expect("gateway trailer");
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

/// Sends one request and reads the whole answer.
fn exchange(mut client: TcpStream, request: &[u8]) -> Vec<u8> {
    client.write_all(request).expect("send the request");
    client.shutdown(Shutdown::Write).expect("half-close");
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).expect("read the answer");
    answer
}

#[test]
fn relays_several_mebibytes_both_ways_with_half_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = gateway(&dir.path().join("egress.sock"), echo_then_count);
    let bridge = Bridge::start(&socket, &["cat"]);
    let payload = pattern(6 << 20);

    let client = bridge.connect();
    let writer = {
        let mut upstream = client.try_clone().expect("clone the client socket");
        let payload = payload.clone();
        // Written while the echo is read: both directions are busy at once.
        thread::spawn(move || {
            upstream.write_all(&payload).expect("send the payload");
            upstream.shutdown(Shutdown::Write).expect("half-close");
        })
    };
    let mut answer = Vec::new();
    (&client).read_to_end(&mut answer).expect("read the echo");
    writer.join().expect("writer");

    let trailer = format!("received {} bytes", payload.len());
    assert_eq!(answer.len(), payload.len() + trailer.len(), "echo and trailer lengths");
    assert!(answer[..payload.len()] == payload[..], "the echo differs from the payload");
    // Only after the client's half-close reached the gateway can it have sent this.
    assert_eq!(std::str::from_utf8(&answer[payload.len()..]).expect("trailer"), trailer);

    let done = bridge.finish();
    assert!(done.status.success(), "{:?}: {}", done.status, done.stderr);
    assert_eq!(done.stderr, "");
}

#[test]
fn exit_status_is_the_workload_s() {
    let table =
        [("exit 0", 0), ("exit 7", 7), ("exit 255", 255), ("kill -TERM $$", 143), ("kill -KILL $$", 137)];
    for (script, expected) in table {
        let done = Bridge::start(Path::new("/nonexistent/egress.sock"), &["sh", "-c", script]).finish();
        assert_eq!(done.status.code(), Some(expected), "{script}: {}", done.stderr);
    }
}

#[test]
fn signals_to_the_bridge_reach_the_workload() {
    // SIGINT takes the same path; it is left out because a test run in a background job
    // starts with SIGINT ignored, which the workload would inherit.
    for (sig, expected) in [(Signal::SIGTERM, 143), (Signal::SIGHUP, 129)] {
        let bridge = Bridge::start(Path::new("/nonexistent/egress.sock"), &["sleep", "30"]);
        // Listening means the signals are already blocked for forwarding.
        drop(bridge.connect());
        let start = Instant::now();
        bridge.signal(sig);
        let done = bridge.finish();
        assert_eq!(done.status.code(), Some(expected), "{sig}: {:?}", done.status);
        assert!(start.elapsed() < Duration::from_secs(10), "{sig} was not forwarded");
    }
}

#[test]
fn workload_does_not_inherit_the_listener() {
    let script = "ls -l /proc/$$/fd; echo ---; cat /proc/net/tcp";
    let bridge = Bridge::start(Path::new("/nonexistent/egress.sock"), &["sh", "-c", script]);
    let port = bridge.port;
    let done = bridge.finish();
    assert!(done.status.success(), "{:?}: {}", done.status, done.stderr);
    let (fds, tcp) = done.stdout.split_once("---\n").expect("both listings");

    // The listening socket on our port: state 0A, inode in the tenth column.
    let local = format!(":{port:04X}");
    let inode = tcp
        .lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 9 && f[1].ends_with(&local) && f[3] == "0A")
        .map(|f| f[9].to_owned())
        .unwrap_or_else(|| panic!("nothing listened on port {port} while the workload ran:\n{tcp}"));
    let sockets: Vec<&str> = fds.lines().filter(|l| l.contains("socket:")).collect();
    assert!(sockets.is_empty(), "the workload holds sockets (the listener is socket:[{inode}]): {sockets:?}");
}

#[test]
fn unreachable_gateway_gets_502_and_at_most_a_line_a_second() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("egress.sock");
    let bridge = Bridge::start(&socket, &["sh", "-c", "cat >/dev/null"]);
    let request = b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n";

    let start = Instant::now();
    let attempts = 5;
    for _ in 0..attempts {
        let answer = exchange(bridge.connect(), request);
        assert_eq!(String::from_utf8_lossy(&answer), BAD_GATEWAY);
    }
    let elapsed = start.elapsed();

    // egressd comes (back): the same bridge relays again.
    gateway(&socket, echo_then_count);
    let answer = exchange(bridge.connect(), b"hello");
    assert_eq!(answer, b"helloreceived 5 bytes");

    let done = bridge.finish();
    assert!(done.status.success(), "{:?}: {}", done.status, done.stderr);
    assert_eq!(done.stdout, "", "the bridge wrote to stdout");
    let expected =
        format!("egress bridge: gateway unreachable: {}: No such file or directory", socket.display());
    let lines: Vec<&str> = done.stderr.lines().collect();
    assert!(!lines.is_empty(), "no report of the unreachable gateway");
    assert!(lines.iter().all(|l| l.starts_with(&expected)), "{lines:?}");
    let allowed = usize::try_from(elapsed.as_secs()).expect("seconds") + 1;
    assert!(lines.len() <= allowed, "{} lines in {elapsed:?}: {lines:?}", lines.len());
}

#[test]
fn connections_beyond_the_cap_get_503() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = gateway(&dir.path().join("egress.sock"), echo_then_count);
    let bridge = Bridge::start_with(&socket, &["--max-connections", "2"], &["cat"], |_| {});
    let ping = |client: &mut TcpStream| {
        client.write_all(b"ping").expect("ping");
        let mut pong = [0u8; 4];
        client.read_exact(&mut pong).map(|()| pong)
    };

    let mut held: Vec<TcpStream> = (0..2).map(|_| bridge.connect()).collect();
    for client in &mut held {
        assert_eq!(&ping(client).expect("relayed"), b"ping");
    }
    let mut third = bridge.connect();
    let mut answer = String::new();
    third.read_to_string(&mut answer).expect("read the refusal");
    assert!(answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{answer:?}");
    assert!(answer.contains("X-Sandbox-Network: the sandbox already has 2 connections open"), "{answer:?}");

    // Closing one gives its slot back, once both of its directions have ended.
    drop(held.pop());
    let start = Instant::now();
    loop {
        let mut client = bridge.connect();
        // Until then the answer is the 503's first four bytes, or a reset.
        if let Ok(b"ping") = ping(&mut client).as_ref() {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "the slot never came back");
        thread::sleep(Duration::from_millis(20));
    }

    drop(held);
    let done = bridge.finish();
    assert!(done.status.success(), "{:?}: {}", done.status, done.stderr);
}

#[test]
fn stdin_reaches_the_workload() {
    let mut bridge = Bridge::start(Path::new("/nonexistent/egress.sock"), &["cat"]);
    let input = pattern(1 << 20).iter().map(|b| b'a' + b % 26).collect::<Vec<u8>>();
    let mut stdin = bridge.stdin();
    stdin.write_all(b"print('hello')\n").expect("write stdin");
    stdin.write_all(&input).expect("write stdin");
    drop(stdin);
    let done = bridge.finish();
    assert!(done.status.success(), "{:?}: {}", done.status, done.stderr);
    assert_eq!(done.stdout.len(), input.len() + 15);
    assert!(done.stdout.starts_with("print('hello')\n"));
    assert!(done.stdout.as_bytes()[15..] == input[..], "stdin arrived altered");
}

#[test]
fn environment_and_working_directory_are_inherited() {
    let dir = tempfile::tempdir().expect("tempdir");
    let workload = ["sh", "-c", "echo \"$BRIDGE_TEST_VALUE\"; pwd -P"];
    let bridge = Bridge::start_with(Path::new("/nonexistent/egress.sock"), &[], &workload, |command| {
        command.env("BRIDGE_TEST_VALUE", "from the runner").current_dir(dir.path());
    });
    let done = bridge.finish();
    let cwd = dir.path().canonicalize().expect("canonical tempdir");
    assert_eq!(done.stdout, format!("from the runner\n{}\n", cwd.display()));
}

#[test]
fn bridge_failures_go_to_stderr_with_shell_statuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_executable = dir.path().join("script");
    std::fs::write(&not_executable, "#!/bin/sh\n").expect("write script");
    let port = free_port().to_string();
    let script = not_executable.to_str().expect("UTF-8 path");
    let run = |program: &'static str| -> Vec<String> {
        ["--socket", "/run/s.sock", "--port", &port, "--", program].map(String::from).to_vec()
    };
    let table: Vec<(Vec<String>, i32, String)> = vec![
        (
            vec![],
            2,
            "egress bridge: missing `--` and the program to run after it (see egress-bridge --help)\n".into(),
        ),
        (
            ["--socket", "/s", "--port", "x", "--", "true"].map(String::from).to_vec(),
            2,
            "egress bridge: --port must be a number from 1 to 65535, not \"x\" (see egress-bridge --help)\n"
                .into(),
        ),
        (vec!["--help".into()], 0, String::new()),
        (
            run("/nonexistent/program"),
            127,
            "egress bridge: cannot start /nonexistent/program: No such file or directory (os error 2)\n"
                .into(),
        ),
        (
            ["--socket", "/run/s.sock", "--port", &port, "--", script].map(String::from).to_vec(),
            126,
            format!("egress bridge: cannot start {script}: Permission denied (os error 13)\n"),
        ),
    ];
    for (args, code, stderr) in table {
        let out = Command::new(BRIDGE).args(&args).stdin(Stdio::null()).output().expect("run egress-bridge");
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        assert!(
            out.stdout.is_empty(),
            "{args:?} wrote to stdout: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        let text = String::from_utf8(out.stderr).expect("UTF-8 stderr");
        if args == ["--help"] {
            assert!(text.contains("Usage:\n  egress-bridge --socket PATH"), "{text}");
        } else {
            assert_eq!(text, stderr, "{args:?}");
        }
    }
}

#[test]
fn a_taken_port_fails_before_the_workload_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = TcpListener::bind("127.0.0.1:0").expect("take a port");
    let port = taken.local_addr().expect("address").port().to_string();
    let marker = dir.path().join("ran");
    let out = Command::new(BRIDGE)
        .args(["--socket", "/run/s.sock", "--port", &port, "--", "touch"])
        .arg(&marker)
        .output()
        .expect("run egress-bridge");
    assert_eq!(out.status.code(), Some(125));
    assert!(!marker.exists(), "the workload ran without its proxy");
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        text,
        format!(
            "egress bridge: cannot listen on 127.0.0.1:{port} for the sandbox's proxy clients: Address already in use (os error 98)\n"
        )
    );
    assert!(out.status.signal().is_none());
}
