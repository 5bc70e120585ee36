//! The real `npu-brokerd` binary for the NPU broker tests: its control socket, state and
//! whitelist in a scratch directory, serving a given runnerd data directory. Workloads are
//! ordinary python3 scripts (no Ascend hardware here): the same spawn path a real one takes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{bin, scratch_dir};

/// A running npu-brokerd; SIGTERM on drop.
#[derive(Debug)]
pub struct Broker {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub repo: PathBuf,
    pub log: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// A command prefix it runs under ([`crate::journal::Journal::wrapper`]).
    pub wrapper: Vec<String>,
}

impl Broker {
    /// Serves `data_dir` (runnerd's) on `socket` (default: in its scratch directory), with `whitelist` (JSON text; `None`: the built-in
    /// defaults), the scripts `repo_files` under its repository root, and `env` over a bare
    /// environment.
    pub fn start(
        data_dir: &Path,
        socket: Option<&Path>,
        whitelist: Option<&str>,
        repo_files: &[(&str, &str)],
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Broker {
        let dir = scratch_dir();
        let socket = socket.map_or_else(|| dir.path().join("run/control.sock"), Path::to_owned);
        let repo = dir.path().join("repo");
        for (rel, text) in repo_files {
            let path = repo.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        std::fs::create_dir_all(&repo).unwrap();
        let mut args: Vec<String> = vec![
            "--control-socket".into(),
            socket.display().to_string(),
            "--state-dir".into(),
            data_dir.display().to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--repo-root".into(),
            repo.display().to_string(),
        ];
        if let Some(text) = whitelist {
            let file = dir.path().join("workloads.json");
            std::fs::write(&file, text).unwrap();
            args.extend(["--workload-config".into(), file.display().to_string()]);
        }
        args.extend(extra_args.iter().map(|s| s.to_string()));
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let log = dir.path().join("npu-brokerd.stderr");
        let wrapper: Vec<String> = Vec::new();
        let child = spawn(&args, &env, &log, &wrapper);
        let mut b = Broker { child, dir, socket, repo, log, args, env, wrapper };
        b.wait_ready();
        b
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("npu-brokerd exited with {status}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("npu-brokerd did not start:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What runnerd needs to use this broker.
    pub fn runner_env(&self) -> Vec<(String, String)> {
        vec![
            ("SCIENCE_AGENT_NPU_BROKER".into(), "1".into()),
            ("SCIENCE_AGENT_NPU_BROKER_SOCKET".into(), self.socket.display().to_string()),
        ]
    }

    /// Stops it and starts it again under `wrapper` (a journal, say).
    pub fn rewrap(&mut self, wrapper: Vec<String>, env: &[(&str, &str)]) {
        self.stop();
        self.wrapper = wrapper;
        self.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self.child = spawn(&self.args, &self.env, &self.log, &self.wrapper);
        self.wait_ready();
    }

    /// SIGTERM (to the broker, not its wrapper) and wait.
    pub fn stop(&mut self) {
        let pid =
            if self.wrapper.is_empty() { Some(self.child.id()) } else { crate::wrapped_pid(self.child.id()) };
        if let Some(pid) = pid {
            // SAFETY: kill(2) on our own child's pid (or its wrapper's child).
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops it and starts it again with the same settings (the log is appended to).
    pub fn restart(&mut self) {
        self.stop();
        self.child = spawn(&self.args, &self.env, &self.log, &self.wrapper);
        self.wait_ready();
    }
}

fn spawn(args: &[String], env: &[(String, String)], log: &Path, wrapper: &[String]) -> Child {
    let stderr = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = match wrapper.split_first() {
        Some((program, prefix)) => {
            let mut cmd = Command::new(program);
            cmd.args(prefix).arg(bin("npu-brokerd"));
            cmd
        }
        None => Command::new(bin("npu-brokerd")),
    };
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
        .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
        // Never the host's /etc/sciencediscovery/npu-brokerd.toml.
        .env("SCIENCE_AGENT_NPU_BROKER_CONFIG", "/dev/null")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start npu-brokerd")
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// A managed environment revision whose interpreter is the host's python3 (what
/// `${managedPython}` resolves), under runnerd's data directory.
pub fn fake_managed_env(data_dir: &Path, revision: &str) {
    let bin_dir = data_dir.join("scientific-envs/revisions/starter-python").join(revision).join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    let python = ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("python3 is installed");
    std::os::unix::fs::symlink(python, bin_dir.join("python")).unwrap();
}
