//! The `runnerd` command line.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::launch::{Launch, OutputBudget, Termination};
use crate::sandbox::{Language, SandboxSpec, WorkspaceLayout, argv};
use crate::startup::{self, SandboxConfig, SandboxRuntime};

const USAGE: &str = "\
runnerd: the ScienceDiscovery code runner (bubblewrap + seccomp sandboxes for agents).

Usage:
  runnerd preflight    check bubblewrap, probe the sandbox form this host allows, publish
                       the seccomp programs, and print the conclusions as JSON
  runnerd selftest     preflight, then run one real sandbox and check what it printed
                       (for deploy scripts: exit status 0 means executions will work)
  runnerd --help | --version

Environment:
  SCIENCE_AGENT_BWRAP_PATH          bubblewrap binary (default: bwrap, searched in PATH)
  SCIENCE_AGENT_DATA_DIR            data directory (default: .sciencediscovery-data)
  SCIENCE_AGENT_SANDBOX_INIT_PATH   sandbox-init binary (default: next to runnerd)
";

/// Entry point of the `runnerd` binary; returns the process exit status.
pub fn run() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match args.first().map(String::as_str) {
        Some("--help" | "-h" | "help") => {
            print!("{USAGE}");
            return 0;
        }
        Some("--version" | "-V") => {
            println!("runnerd {}", env!("CARGO_PKG_VERSION"));
            return 0;
        }
        Some(c @ ("preflight" | "selftest")) => c.to_owned(),
        Some(other) => {
            eprintln!("runnerd: unknown command {other:?}\n\n{USAGE}");
            return 2;
        }
        None => {
            eprint!("{USAGE}");
            return 2;
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runnerd: cannot start the async runtime: {e}");
            return 1;
        }
    };
    let result = runtime.block_on(async {
        match command.as_str() {
            "preflight" => preflight().await,
            _ => selftest().await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("runnerd: {e:#}");
            1
        }
    }
}

/// The sandbox configuration from `SCIENCE_AGENT_*` variables.
pub fn sandbox_config_from_env() -> SandboxConfig {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    SandboxConfig {
        bwrap: var("SCIENCE_AGENT_BWRAP_PATH")
            .map(|v| v.to_string_lossy().into_owned())
            .unwrap_or("bwrap".into()),
        data_dir: var("SCIENCE_AGENT_DATA_DIR").map(PathBuf::from).unwrap_or(".sciencediscovery-data".into()),
        sandbox_init: startup::locate_sandbox_init(var("SCIENCE_AGENT_SANDBOX_INIT_PATH").map(PathBuf::from)),
    }
}

async fn prepare() -> anyhow::Result<SandboxRuntime> {
    let config = sandbox_config_from_env();
    let runtime = startup::prepare(&config).await?;
    for w in &runtime.warnings {
        eprintln!("WARNING: {}", w.text);
    }
    Ok(runtime)
}

async fn preflight() -> anyhow::Result<i32> {
    let runtime = prepare().await?;
    let report = serde_json::json!({
        "bwrap": runtime.bwrap,
        "sandboxInit": runtime.launcher.init_path(),
        "sandboxProfile": runtime.capability,
        "seccompFiles": runtime.seccomp_files,
        "warnings": runtime.warnings.iter().map(|w| w.event).collect::<Vec<_>>(),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(if runtime.capability.sandbox_usable { 0 } else { 1 })
}

async fn selftest() -> anyhow::Result<i32> {
    let runtime = prepare().await?;
    let Some(shape) = runtime.capability.shape() else {
        eprintln!("selftest: FAILED: no sandbox can be built on this host (see the warning above)");
        return Ok(1);
    };
    let scratch = tempfile_dir()?;
    let layout = WorkspaceLayout::new(scratch.clone(), None);
    let cmd = argv::build(&SandboxSpec {
        shape,
        host: &runtime.host,
        workspace: &layout,
        cwd: None,
        language: Language::Shell,
        interpreter_masks: &[],
        python: "/usr/bin/python3",
        science_env: None,
    });
    let script = "echo selftest-ok > /workspace/selftest.txt; cat /workspace/selftest.txt; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status";
    let mut launch = Launch::sandboxed(runtime.bwrap.clone(), cmd);
    launch.stdin = script.as_bytes().to_vec();
    launch.timeout = Some(Duration::from_secs(30));
    let mut output = OutputBudget::new(64 * 1024);
    let outcome =
        runtime.launcher.run(launch, &mut output).await.context("launching the selftest sandbox")?;
    let out = output.finish();
    let _ = std::fs::remove_dir_all(&scratch);
    let ok = outcome.termination == Termination::Exited(0)
        && out.stdout.starts_with("selftest-ok\n")
        && out.stdout.contains("Seccomp:\t2")
        && out.stdout.contains("NoNewPrivs:\t1");
    if ok {
        println!("selftest: ok ({} ms, {:?})", outcome.elapsed.as_millis(), runtime.capability.reason);
        Ok(0)
    } else {
        eprintln!(
            "selftest: FAILED: {:?}\nstdout: {}\nstderr: {}",
            outcome.termination, out.stdout, out.stderr
        );
        Ok(1)
    }
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let base = std::env::temp_dir().join(format!("runnerd-selftest-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok(base.canonicalize()?)
}
