//! `runnerctl`: a command-line client for people. It finds the token the way runnerd does
//! (plus the development token runnerd generated in the data directory), signs like the
//! original client, and turns a run into an exit status.

use std::io::Write;
use std::path::PathBuf;

use crate::client::{Endpoint, RunnerClient, new_execution_id, permission_epoch};
use crate::config::RunnerConfig;
use crate::token::{self, Fallback};

const USAGE: &str = "\
runnerctl: talk to a running runnerd.

Usage:
  runnerctl health                      print /health (no token needed)
  runnerctl status                      print /status
  runnerctl exec [options] -- SCRIPT    run SCRIPT (bash; --python for Python) in a sandbox,
                                        print its stdout/stderr, exit with its exit code
Options for exec:
  --workspace KEY        remote workspace key (default: runnerctl/default)
  --timeout MS           executionTimeoutMs
  --python               run SCRIPT with /execute (Python) instead of /execute-shell
  --session ID, --agent ID   owner of the call (default: runnerctl / main)
Connection:
  --url URL              default $SCIENCE_AGENT_RUNNER_URL or http://127.0.0.1:4311
  --socket PATH          a Unix socket instead (default $SCIENCE_AGENT_RUNNER_SOCKET)
  --insecure-default-token   use the original's well-known token
The token: $CREDENTIALS_DIRECTORY/runner-token, SCIENCE_AGENT_RUNNER_TOKEN_FILE,
SCIENCE_AGENT_RUNNER_TOKEN, or the development token in <SCIENCE_AGENT_DATA_DIR>/runner-token.
";

struct Options {
    command: String,
    url: Option<String>,
    socket: Option<PathBuf>,
    workspace: String,
    timeout: Option<u64>,
    python: bool,
    session: String,
    agent: String,
    well_known: bool,
    script: Option<String>,
}

fn parse(args: Vec<String>) -> Result<Options, String> {
    let mut o = Options {
        command: String::new(),
        url: None,
        socket: None,
        workspace: "runnerctl/default".into(),
        timeout: None,
        python: false,
        session: "runnerctl".into(),
        agent: "main".into(),
        well_known: false,
        script: None,
    };
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--url" => o.url = Some(value("--url")?),
            "--socket" => o.socket = Some(PathBuf::from(value("--socket")?)),
            "--workspace" => o.workspace = value("--workspace")?,
            "--timeout" => {
                o.timeout =
                    Some(value("--timeout")?.parse().map_err(|_| "--timeout takes milliseconds".to_owned())?)
            }
            "--session" => o.session = value("--session")?,
            "--agent" => o.agent = value("--agent")?,
            "--python" => o.python = true,
            "--insecure-default-token" => o.well_known = true,
            "--" => {
                let rest: Vec<String> = it.by_ref().collect();
                o.script = Some(rest.join(" "));
            }
            "health" | "status" | "exec" if o.command.is_empty() => o.command = arg,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.command.is_empty() {
        return Err("no command".into());
    }
    if o.command == "exec" && o.script.as_deref().is_none_or(|s| s.trim().is_empty()) {
        return Err("exec needs a script after --".into());
    }
    Ok(o)
}

/// Entry point of the `runnerctl` binary.
pub fn run() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") || args.is_empty() {
        print!("{USAGE}");
        return if args.is_empty() { 2 } else { 0 };
    }
    let options = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("runnerctl: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runnerctl: {e}");
            return 1;
        }
    };
    match runtime.block_on(execute(options)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("runnerctl: {e:#}");
            1
        }
    }
}

async fn execute(o: Options) -> anyhow::Result<i32> {
    let config = RunnerConfig::from_env()?;
    let endpoint = match (&o.socket, &o.url) {
        (Some(path), _) => Endpoint::Unix(path.clone()),
        (None, Some(url)) => Endpoint::parse(url),
        (None, None) => match (&config.socket_path, std::env::var("SCIENCE_AGENT_RUNNER_URL").ok()) {
            (Some(path), _) => Endpoint::Unix(path.clone()),
            (None, Some(url)) => Endpoint::parse(&url),
            (None, None) => Endpoint::Tcp(format!("{}:{}", config.host, config.port)),
        },
    };
    let fallback = if o.well_known { Fallback::WellKnown } else { Fallback::ReadGenerated };
    let token = if o.command == "health" {
        String::new()
    } else {
        let (t, _) = token::resolve(
            |k| std::env::var(k).ok(),
            config.token_file.as_deref(),
            &config.data_dir,
            fallback,
        )?;
        t.expose().to_owned()
    };
    let client = RunnerClient::new(endpoint, token);
    match o.command.as_str() {
        "health" => {
            let reply = tokio::time::timeout(
                crate::client::HEALTH_TIMEOUT,
                client.raw("GET", "/health", &[], Vec::new()),
            )
            .await
            .map_err(|_| anyhow::anyhow!("runnerd did not answer /health within 5 s"))??;
            println!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(if reply.status == 200 { 0 } else { 1 })
        }
        "status" => {
            let reply = client.get("/status").await?;
            println!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(if reply.status == 200 { 0 } else { 1 })
        }
        _ => {
            let mut body = serde_json::json!({
                "agentId": o.agent,
                "code": o.script.unwrap_or_default(),
                "executionId": new_execution_id(),
                "permissionEpoch": permission_epoch(&o.session),
                "runnerWorkspaceKey": o.workspace,
            });
            if let Some(ms) = o.timeout {
                body["executionTimeoutMs"] = ms.into();
            }
            let path = if o.python { "/execute" } else { "/execute-shell" };
            // The client has no clock offset yet: one cheap request learns it from `Date`.
            let _ = client.raw("GET", "/health", &[], Vec::new()).await;
            let reply = client.post_signed(path, &body).await?;
            let result = reply.json();
            if reply.status != 200 {
                eprintln!(
                    "runnerctl: runnerd answered {}: {}",
                    reply.status,
                    result["error"].as_str().unwrap_or("(no error text)")
                );
                return Ok(1);
            }
            std::io::stdout().write_all(result["stdout"].as_str().unwrap_or("").as_bytes())?;
            std::io::stderr().write_all(result["stderr"].as_str().unwrap_or("").as_bytes())?;
            Ok(result["exitCode"].as_i64().map(|c| c as i32).unwrap_or(1))
        }
    }
}
