//! The real `runner-router` binary in front of real runnerd nodes (issue #35), on an
//! ephemeral port, with the suite's token, and a client that signs like the original's.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use runnerctl::client::{Endpoint, RunnerClient};
use serde_json::Value;

use crate::server::{Server, TEST_TOKEN};
use crate::{bin, scratch_dir};

/// A running router; SIGTERM and reaped on drop.
#[derive(Debug)]
pub struct Router {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub endpoint: Endpoint,
    pub stderr_log: PathBuf,
}

/// A node's URL as the router and its peers name it.
pub fn node_url(server: &Server) -> String {
    format!("http://{}", server.address().trim_start_matches("http://"))
}

impl Router {
    /// In front of `nodes` (static mode), with extra variables.
    pub fn over(nodes: &[&Server], env: &[(&str, &str)]) -> Router {
        let list: Vec<String> = nodes.iter().map(|n| node_url(n)).collect();
        let mut all = vec![("SCIENCE_AGENT_ROUTER_NODES".to_owned(), list.join(","))];
        all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        Router::start(&all)
    }

    /// With exactly these variables (besides the token, the port and the log target).
    pub fn start(env: &[(String, String)]) -> Router {
        let dir = scratch_dir();
        let stderr_log = dir.path().join("runner-router.stderr");
        let mut cmd = Command::new(bin("runner-router"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("SCIENCE_AGENT_RUNNER_TOKEN", TEST_TOKEN)
            .env("SCIENCE_AGENT_RUNNER_PORT", "0")
            .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
            .env("SCIENCE_AGENT_ROUTER_CONFIG", "/dev/null")
            .env("SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS", "200")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start runner-router");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let Some(Ok(first)) = lines.next() else {
            let _ = child.wait();
            panic!(
                "runner-router did not start:\n{}",
                std::fs::read_to_string(&stderr_log).unwrap_or_default()
            );
        };
        let address = first
            .strip_prefix("runner-router listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_owned();
        std::thread::spawn(move || for _ in lines {});
        Router { child, dir, endpoint: Endpoint::parse(&address), stderr_log }
    }

    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        match &self.endpoint {
            Endpoint::Tcp(a) => format!("http://{}", a.trim_start_matches("http://")),
            Endpoint::Unix(p) => panic!("unix router at {}", p.display()),
        }
    }

    /// `runnerctl --url <this router> ARGS…`: (exit status, stdout, stderr).
    pub fn runnerctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(bin("runnerctl"))
            .args(["--url", &self.url()])
            .args(args)
            .env_clear()
            .env("SCIENCE_AGENT_RUNNER_TOKEN", TEST_TOKEN)
            .output()
            .expect("run runnerctl");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
    }

    pub fn client(&self) -> RunnerClient {
        RunnerClient::new(self.endpoint.clone(), TEST_TOKEN)
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// `GET /fleet/nodes`.
    pub async fn nodes(&self) -> Value {
        let reply = self.client().get("/fleet/nodes").await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.json());
        reply.json()
    }

    /// Waits until `/fleet/nodes` satisfies `ok` (the router learns from polls and watches).
    pub async fn until(&self, what: &str, within: Duration, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let nodes = self.nodes().await;
            if ok(&nodes) {
                return nodes;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}:\n{nodes:#}\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the router counts `url` routable now.
    pub async fn routable(&self, url: &str) -> bool {
        let nodes = self.nodes().await;
        nodes["nodes"].as_array().into_iter().flatten().any(|n| n["url"] == url && n["routable"] == true)
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
