//! The real `runnerd` binary, started on an ephemeral port (or a Unix socket) with its own
//! data directory and token, and a client that signs like the original `RunnerClient`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use runnerctl::client::{Endpoint, RunnerClient};

use crate::{bin, scratch_dir};

pub const TEST_TOKEN: &str = "runner-test-token";

/// A running runnerd; SIGTERM and reaped on drop.
#[derive(Debug)]
pub struct Server {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub data_dir: PathBuf,
    pub endpoint: Endpoint,
    pub stderr_log: PathBuf,
    /// The second line runnerd printed (sandbox and quotas).
    pub banner: String,
    /// Started under a wrapper: signals go to the wrapper's child.
    wrapped: bool,
}

/// How to start it.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    pub env: Vec<(String, String)>,
    pub args: Vec<String>,
    /// Listen on `<dir>/run/runner.sock` instead of TCP.
    pub unix_socket: bool,
    /// Leave `SCIENCE_AGENT_RUNNER_TOKEN` unset.
    pub no_token: bool,
    /// A command prefix runnerd runs under (e.g. [`crate::journal::Journal::wrapper`]).
    pub wrapper: Vec<String>,
    /// (uid, gid) to run runnerd as (a root test starting it as the unprivileged test
    /// user); the scratch directory is handed to that user first.
    pub run_as: Option<(u32, u32)>,
}

impl Server {
    pub fn start() -> Server {
        Server::start_with(ServerOptions::default())
    }

    pub fn start_with(options: ServerOptions) -> Server {
        let dir = scratch_dir();
        let data_dir = dir.path().join("data");
        std::fs::create_dir_all(&data_dir).unwrap();
        let stderr_log = dir.path().join("runnerd.stderr");
        if let Some((uid, gid)) = options.run_as {
            for path in [dir.path(), data_dir.as_path()] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
            }
        }
        let mut cmd = match options.wrapper.split_first() {
            Some((program, prefix)) => {
                let mut cmd = Command::new(program);
                cmd.args(prefix).arg(bin("runnerd"));
                cmd
            }
            None => Command::new(bin("runnerd")),
        };
        cmd.args(&options.args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("SCIENCE_AGENT_DATA_DIR", &data_dir)
            .env("SCIENCE_AGENT_RUNNER_PORT", "0")
            .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
            // An empty configuration file: never the host's /etc/sciencediscovery/runnerd.toml.
            .env("SCIENCE_AGENT_CONFIG", "/dev/null")
            // No egressd unless a test starts one (never a system egressd by accident).
            .env("SCIENCE_AGENT_EGRESS_SOCKET", dir.path().join("no-egressd/control.sock"))
            // No scientific-environment setup unless a test asks for it (tests/suite/
            // environments.rs): with a test's egressd it would try conda-forge through it.
            .env("SCIENTIFIC_ENVS", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap());
        if !options.no_token {
            cmd.env("SCIENCE_AGENT_RUNNER_TOKEN", TEST_TOKEN);
        }
        let socket = dir.path().join("run/runner.sock");
        if options.unix_socket {
            cmd.env("SCIENCE_AGENT_RUNNER_SOCKET", &socket);
        }
        if crate::is_root() && options.run_as.is_none() {
            // A root runnerd needs an unprivileged user for its sandboxes.
            let (name, value) = crate::sandbox_user_env();
            cmd.env(name, value);
        }
        for (k, v) in &options.env {
            cmd.env(k, v);
        }
        if let Some((uid, gid)) = options.run_as {
            use std::os::unix::process::CommandExt;
            // std also clears root's supplementary groups (setgroups(0)) before the switch.
            cmd.uid(uid).gid(gid);
        }
        let mut child = cmd.spawn().expect("start runnerd");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = match lines.next() {
            Some(Ok(line)) => line,
            _ => {
                let _ = child.wait();
                panic!(
                    "runnerd did not start:\n{}",
                    std::fs::read_to_string(&stderr_log).unwrap_or_default()
                );
            }
        };
        let address = first
            .strip_prefix("ScienceDiscovery runner listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_owned();
        let banner = lines.next().and_then(Result::ok).unwrap_or_default();
        // Keep draining stdout so runnerd never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let wrapped = !options.wrapper.is_empty();
        Server { child, dir, data_dir, endpoint: Endpoint::parse(&address), stderr_log, banner, wrapped }
    }

    /// runnerd's pid (not its wrapper's).
    pub fn pid(&self) -> Option<u32> {
        if self.wrapped { crate::wrapped_pid(self.child.id()) } else { Some(self.child.id()) }
    }

    pub fn client(&self) -> RunnerClient {
        RunnerClient::new(self.endpoint.clone(), TEST_TOKEN)
    }

    pub fn client_with_token(&self, token: &str) -> RunnerClient {
        RunnerClient::new(self.endpoint.clone(), token)
    }

    /// `host:port` of a TCP server.
    pub fn address(&self) -> String {
        match &self.endpoint {
            Endpoint::Tcp(a) => a.clone(),
            Endpoint::Unix(p) => panic!("unix server at {}", p.display()),
        }
    }

    /// A project workspace under the data directory (created).
    /// A workspace under `projects/` made as the API makes it: by the caller (this process),
    /// not handed to the sandbox user; a root runnerd mounts it idmapped (issue #30). Only
    /// where it cannot (a shared sandbox user such as `nobody`) is it handed over, as before.
    /// Its directories are 0755, as an API with the usual umask makes them, whatever this
    /// process's umask.
    pub fn project_workspace(&self, name: &str) -> PathBuf {
        use std::os::unix::fs::DirBuilderExt;
        let mut ws = self.data_dir.clone();
        for part in ["projects", "project", "sessions", name, "workspace"] {
            ws.push(part);
            match std::fs::DirBuilder::new().mode(0o755).create(&ws) {
                Ok(()) => std::fs::set_permissions(&ws, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                    .unwrap(),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => panic!("{}: {e}", ws.display()),
            }
        }
        if !crate::idmapped_workspaces() {
            crate::hand_to_sandbox(&ws);
        }
        ws
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.data_dir.join(rel)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on our own child's pid (or its wrapper's child).
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        for _ in 0..600 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// Polls `GET /shell-executions/:id` until the record is terminal (`completed`, `failed`,
/// `cancelled` or `unknown`) and returns it; panics after 60 s (a liveness guard only).
pub async fn finished_record(
    client: &RunnerClient,
    id: &str,
    session: &str,
    agent: &str,
) -> serde_json::Value {
    let path = format!("/shell-executions/{id}?sessionId={session}&agentId={agent}");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let record = client.get(&path).await.unwrap().json();
        if matches!(record["state"].as_str(), Some("completed" | "failed" | "cancelled" | "unknown")) {
            return record;
        }
        assert!(std::time::Instant::now() < deadline, "{id} did not finish: {record}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A body for `/execute-shell` in `workspace_root` (or by key when it starts with `key:`).
pub fn shell_request(agent: &str, session: &str, workspace: &Path, code: &str) -> serde_json::Value {
    serde_json::json!({
        "agentId": agent,
        "code": code,
        "executionId": runnerctl::client::new_execution_id(),
        "permissionEpoch": runnerctl::client::permission_epoch(session),
        "workspaceRoot": workspace,
    })
}

/// A body for `/execute-shell` in the remote workspace `key`.
pub fn keyed_shell_request(agent: &str, session: &str, key: &str, code: &str) -> serde_json::Value {
    serde_json::json!({
        "agentId": agent,
        "code": code,
        "executionId": runnerctl::client::new_execution_id(),
        "permissionEpoch": runnerctl::client::permission_epoch(session),
        "runnerWorkspaceKey": key,
        "workspaceRoot": "/nonexistent/control/workspace",
    })
}
