//! `runnerd selftest` (R-PEER-4): proves on this host, with the real parts, that executions
//! will work — one sandbox running one line of shell under the baseline filter, and, when
//! egressd is configured, one allowlisted request from a network sandbox through the bridge
//! and egressd to a loopback server started here (plus one refused name). Prints each check;
//! the exit status says whether all passed. Install scripts and the boot test use it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use common::egress::protocol::GatewayPolicy;
use common::egress::route::ProxySetting;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::RunnerConfig;
use crate::egress::{EgressClient, locate_bridge};
use crate::error_chain;
use crate::isolation::{Egress, Job, SandboxSpec};
use crate::launch::{OutputBudget, Termination};
use crate::sandbox::{Language, WorkspaceLayout, argv};
use crate::startup::SandboxRuntime;

/// The answer the loopback server gives; the sandbox must print it.
const EGRESS_MARKER: &str = "selftest-egress-ok";
/// A name egressd answers itself with loopback (RFC 6761), so no DNS server is involved.
const ALLOWED_NAME: &str = "selftest.localhost";

/// One check's outcome, printed as `selftest: <name>: ok|FAILED|skipped: <detail>`.
#[derive(Debug)]
pub struct Check {
    pub name: &'static str,
    pub passed: Option<bool>,
    pub detail: String,
}

impl Check {
    fn print(&self) {
        match self.passed {
            Some(true) => println!("selftest: {}: ok ({})", self.name, self.detail),
            Some(false) => eprintln!("selftest: {}: FAILED: {}", self.name, self.detail),
            None => println!("selftest: {}: skipped ({})", self.name, self.detail),
        }
    }
}

/// A fresh workspace for one check, the sandbox user's (as a workspace runnerd makes is).
/// Its name under the shared temporary directory is guessable, so it must be new (never one
/// that already stands there, a directory or a planted symlink) and is handed over through
/// its own descriptor, never by path.
fn scratch_dir(runtime: &SandboxRuntime) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let base = std::env::temp_dir().join(format!("runnerd-selftest-{}", std::process::id()));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&base)
        .with_context(|| format!("creating {}", base.display()))?;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(&base)
        .with_context(|| format!("opening {}", base.display()))?;
    runtime
        .user
        .hand_over(std::os::fd::AsFd::as_fd(&dir))
        .with_context(|| format!("handing {} to the sandbox user", base.display()))?;
    Ok(base.canonicalize()?)
}

async fn sandbox(runtime: &SandboxRuntime) -> anyhow::Result<Check> {
    let scratch = scratch_dir(runtime)?;
    let layout = WorkspaceLayout::new(scratch.clone(), None);
    let script = "echo selftest-ok > /workspace/selftest.txt; cat /workspace/selftest.txt; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status";
    let mut job = Job::new(SandboxSpec::new(&runtime.host, &layout, Language::Shell));
    job.stdin = script.as_bytes().to_vec();
    job.timeout = Some(Duration::from_secs(30));
    let mut output = OutputBudget::new(64 * 1024);
    let outcome = runtime.isolation.run(job, &mut output).await.outcome;
    let _ = std::fs::remove_dir_all(&scratch);
    let outcome =
        outcome.map_err(|e| anyhow::anyhow!(error_chain(&e))).context("launching the selftest sandbox")?;
    let out = output.finish();
    let passed = outcome.termination == Termination::Exited(0)
        && out.stdout.starts_with("selftest-ok\n")
        && out.stdout.contains("Seccomp:\t2")
        && out.stdout.contains("NoNewPrivs:\t1");
    let detail = if passed {
        format!(
            "one line of shell in a real sandbox, seccomp filter and no_new_privs in place, {} ms, {:?}",
            outcome.elapsed.as_millis(),
            runtime.capability.reason
        )
    } else {
        format!("{:?}\nstdout: {}\nstderr: {}", outcome.termination, out.stdout, out.stderr)
    };
    Ok(Check { name: "sandbox", passed: Some(passed), detail })
}

/// A one-request-per-connection HTTP server on 127.0.0.1 answering [`EGRESS_MARKER`].
async fn loopback_server() -> anyhow::Result<(u16, tokio::task::JoinHandle<()>)> {
    let listener =
        tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding a loopback test server")?;
    let port = listener.local_addr()?.port();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{EGRESS_MARKER}",
                    EGRESS_MARKER.len()
                );
                let _ = s.write_all(reply.as_bytes()).await;
            });
        }
    });
    Ok((port, task))
}

/// Whether the operator configured egressd (variable or file key set), or the default
/// socket exists (a package installs egressd there).
fn egress_configured(config: &RunnerConfig, explicit: bool) -> bool {
    explicit || config.egress_socket.exists()
}

async fn network(runtime: &SandboxRuntime, config: &RunnerConfig, explicit: bool) -> anyhow::Result<Check> {
    let name = "network";
    let client = EgressClient {
        control_socket: config.egress_socket.clone(),
        bridge: locate_bridge(config.egress_bridge.clone()),
    };
    if !egress_configured(config, explicit) {
        let detail = format!(
            "egressd is not configured (no SCIENCE_AGENT_EGRESS_SOCKET or egress_socket, nothing at {}); domain-allowlist runs will be refused",
            config.egress_socket.display()
        );
        return Ok(Check { name, passed: None, detail });
    }
    let status = match client.status().await {
        Ok(status) => status,
        Err(e) => return Ok(Check { name, passed: Some(false), detail: error_chain(&e) }),
    };
    let (port, server) = loopback_server().await?;
    let policy = GatewayPolicy {
        revision: "runnerd-selftest-v1".into(),
        allowed_domains: vec![ALLOWED_NAME.into()],
        allow_private_network: true,
        pinned_origins: Vec::new(),
    };
    let lease = match client.acquire(policy, ProxySetting::Direct, runtime.user.uid).await {
        Ok(lease) => lease,
        Err(e) => {
            server.abort();
            return Ok(Check { name, passed: Some(false), detail: error_chain(&e) });
        }
    };
    let scratch = scratch_dir(runtime)?;
    let layout = WorkspaceLayout::new(scratch.clone(), None);
    let mut spec = SandboxSpec::new(&runtime.host, &layout, Language::Shell);
    spec.egress = Some(Egress { bridge: &client.bridge, gateway_socket: &lease.socket, gateway: None });
    spec.profile = argv::profile(true, false);
    // bash's /dev/tcp: no curl needed on the host.
    let request = |host: &str| {
        format!(
            "exec 3<>/dev/tcp/127.0.0.1/18118; printf 'GET http://{host}:{port}/ HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n' >&3; head -c 300 <&3 | head -1; exec 3>&-"
        )
    };
    let script =
        format!("{}\n{}\n{}\n", request(ALLOWED_NAME), request("refused.localhost"), full_body(port));
    let mut job = Job::new(spec);
    job.stdin = script.into_bytes();
    job.timeout = Some(Duration::from_secs(30));
    let mut output = OutputBudget::new(64 * 1024);
    let outcome = runtime.isolation.run(job, &mut output).await.outcome;
    let _ = std::fs::remove_dir_all(&scratch);
    drop(lease);
    server.abort();
    let outcome =
        outcome.map_err(|e| anyhow::anyhow!(error_chain(&e))).context("launching the network sandbox")?;
    let out = output.finish();
    let lines: Vec<&str> = out.stdout.lines().collect();
    let passed = outcome.termination == Termination::Exited(0)
        && lines.first().is_some_and(|l| l.starts_with("HTTP/1.1 200"))
        && lines.get(1).is_some_and(|l| l.starts_with("HTTP/1.1 403"))
        && out.stdout.contains(EGRESS_MARKER);
    let detail = if passed {
        format!(
            "{ALLOWED_NAME} reached a loopback server through the bridge and egressd {} (landlock {}, seccomp {}); an unlisted name got 403",
            status.version, status.confinement.landlock, status.confinement.seccomp
        )
    } else {
        format!("{:?}\nstdout: {}\nstderr: {}", outcome.termination, out.stdout, out.stderr)
    };
    Ok(Check { name, passed: Some(passed), detail })
}

/// The allowed request once more, printing the whole answer (the body carries the marker).
fn full_body(port: u16) -> String {
    format!(
        "exec 3<>/dev/tcp/127.0.0.1/18118; printf 'GET http://{ALLOWED_NAME}:{port}/ HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n' >&3; cat <&3; echo; exec 3>&-"
    )
}

/// Runs every check; 0 when all that ran passed.
pub async fn run(runtime: &SandboxRuntime) -> anyhow::Result<i32> {
    let loaded = crate::cli::load_config()?;
    let explicit =
        !matches!(loaded.settings.origin("SCIENCE_AGENT_EGRESS_SOCKET"), common::settings::Origin::Default);
    let config = loaded.config;
    if runtime.isolation.unavailable().is_some() {
        eprintln!("selftest: sandbox: FAILED: no sandbox can be built on this host (see the warning above)");
        return Ok(1);
    }
    let checks = [sandbox(runtime).await?, network(runtime, &config, explicit).await?];
    for c in &checks {
        c.print();
    }
    let failed = checks.iter().filter(|c| c.passed == Some(false)).count();
    if failed == 0 {
        println!("selftest: ok");
        Ok(0)
    } else {
        eprintln!("selftest: {failed} check(s) FAILED");
        Ok(1)
    }
}
