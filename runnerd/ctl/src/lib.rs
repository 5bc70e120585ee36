//! `runnerctl`: a command-line client for people. It finds the token the way runnerd does
//! (plus the development token runnerd generated in the data directory), signs like the
//! original client, and turns a run into an exit status.
//!
//! A crate of its own (issue #33; it was `runnerd::ctl`), so runnerd cannot import it:
//! [`run`] is the whole command (`main.rs` only exits with its status), and [`client`] is
//! the HTTP client it is built on, which the integration tests and the benchmarks use too.
//! From runnerd it takes what must match the daemon: [`runnerd::client_settings`],
//! [`runnerd::token`] and [`runnerd::skill_bundle`] (and `runnerd::auth::sign` in
//! [`client`]).

use std::io::Write;
use std::path::PathBuf;

use runner_store::execution_state::ManagedState;
use runnerd::skill_bundle::{self, LocalSkill};
use runnerd::token::{self, Fallback};

use crate::client::{Endpoint, RunnerClient, encode, new_execution_id, permission_epoch};

pub mod client;
mod fleet;
mod workspace;

const USAGE: &str = "\
runnerctl: talk to a running runnerd.

Usage:
  runnerctl health                      print /health (no token needed)
  runnerctl status                      print /status
  runnerctl metrics                     print /metrics (Prometheus/OpenMetrics text)
  runnerctl exec [options] -- SCRIPT    run SCRIPT (bash; --python for Python) in a sandbox,
                                        print its stdout/stderr, exit with its exit code
  runnerctl run --detach [options] -- SCRIPT
                                        start a managed (background) shell execution and
                                        print its id; it outlives this command
  runnerctl logs [-f] ID                print a managed execution's logs; -f follows them
                                        until it ends, then exits with its exit code
  runnerctl show ID                     print a managed execution's record
  runnerctl cancel ID                   cancel a managed execution
  runnerctl ls                          list the workspace's files
  runnerctl put LOCAL PATH [--overwrite]
                                        upload a file (verified by size and SHA-256)
  runnerctl get PATH [LOCAL]            download a file (to stdout without LOCAL)
  runnerctl skills push DIR             publish DIR as a skill package (DIR holds SKILL.md:
                                        one skill named after DIR; else each subdirectory
                                        is a skill) and print {id, root}
  runnerctl skills show ID              print a published package ({id} when absent)
  runnerctl skills rm ID                delete a published package (refused while an
                                        execution, queued or running, mounts it)
  runnerctl repair WORKSPACE            make a workspace a storage failure left refusing
                                        writes writable again: verify, re-snapshot, commit,
                                        clear its .failed marker (audited)
  runnerctl history                     the version history's retention and what the last
                                        collection found, workspace by workspace
  runnerctl gc [--dry-run]              run the version collector now: prune history past
                                        the retention, delete what no version reaches;
                                        --dry-run only counts (prints the report)
  runnerctl env ls                      list the scientific environments
  runnerctl env setup [--confirm]       print the setup state; --confirm (re)starts setup
  runnerctl env create NAME [--language python|r] [--base ENV]
                                        a task environment cloned from its base (default:
                                        the language's starter); prints it
  runnerctl env install ENV PKG... [--pip|--cran|--bioconductor] [--channel C]...
                     [--index-url URL]  install into ENV (conda by default; local wheels
                                        with --pip are paths in --workspace); prints the
                                        new revision
  runnerctl env uninstall ENV PKG...    remove conda packages from ENV
  runnerctl env rm ENV                  delete a task environment (its revisions stay)
  runnerctl env revisions [ENV]         list revisions (of ENV)
  runnerctl workspace push KEY --to URL move a workspace to the runnerd at URL by object hash
                                        (only what it lacks is sent; progress on stderr);
                                        this copy is fenced: writes here answer 409 movedTo
  runnerctl workspace backup KEY        replicate the workspace's head to the object store now
  runnerctl workspace restore KEY [--version V] [--from-store]
                                        make version V (a head digest from this node's history)
                                        the workspace's files again; --from-store: the object
                                        store's latest (or V) on this node, fencing older copies
  runnerctl workspace where KEY         head, epoch, fenced or not and where to, replicated head
                                        (every workspace command takes --project PATH instead of
                                        KEY for a workspace under <data>/projects)
  runnerctl fleet ls                    the nodes behind a runner-router (--url): pool, state,
                                        slots and queue
  runnerctl fleet drain NODE            stop placing new workspaces on NODE (name or URL) and
                                        move each of its workspaces to another node of its pool,
                                        progress on stderr; exit 0 once it holds none (run it
                                        again to resume)
  runnerctl fleet undrain NODE          place on NODE again
Options:
  --workspace KEY        remote workspace key (default: runnerctl/default)
  --workspace-root PATH  exec, run: a workspace directory under <data>/projects instead
  --read-only-root PATH  exec, run: a parent of it, mounted read-only
  --timeout MS           executionTimeoutMs (exec)
  --python               run SCRIPT with /execute (Python) instead of /execute-shell
  --env ENV              run in scientific environment ENV (exec, run)
  --session ID, --agent ID   owner of the call (default: runnerctl / main)
Connection:
  --url URL              default $SCIENCE_AGENT_RUNNER_URL or http://127.0.0.1:4311
  --socket PATH          a Unix socket instead (default $SCIENCE_AGENT_RUNNER_SOCKET)
  --insecure-default-token   use the original's well-known token
The token: $CREDENTIALS_DIRECTORY/runner-token, SCIENCE_AGENT_RUNNER_TOKEN_FILE,
SCIENCE_AGENT_RUNNER_TOKEN, or the development token in <SCIENCE_AGENT_DATA_DIR>/runner-token.
";

/// Writes to stdout and flushes: a closed pipe comes back as an error, which [`run`] turns
/// into a quiet exit 0 (the reader chose to stop), never a panic in `println!`.
use common::out::print as out;

/// `println!` through [`out`], `?` included.
macro_rules! outln {
    ($($arg:tt)*) => {
        out(format!("{}\n", format_args!($($arg)*)).as_bytes())?
    };
}

/// Whether an error is stdout's reader going away.
fn reader_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(common::out::is_broken_pipe))
}

struct Options {
    command: String,
    url: Option<String>,
    socket: Option<PathBuf>,
    workspace: String,
    workspace_root: Option<String>,
    read_only_root: Option<String>,
    timeout: Option<u64>,
    python: bool,
    session: String,
    agent: String,
    well_known: bool,
    script: Option<String>,
    detach: bool,
    follow: bool,
    overwrite: bool,
    positional: Vec<String>,
    env: Option<String>,
    language: Option<String>,
    base: Option<String>,
    manager: Option<&'static str>,
    channels: Vec<String>,
    index_url: Option<String>,
    confirm: bool,
    dry_run: bool,
    to: Option<String>,
    version: Option<String>,
    from_store: bool,
    project: Option<String>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            command: String::new(),
            url: None,
            socket: None,
            workspace: "runnerctl/default".into(),
            workspace_root: None,
            read_only_root: None,
            timeout: None,
            python: false,
            session: "runnerctl".into(),
            agent: "main".into(),
            well_known: false,
            script: None,
            detach: false,
            follow: false,
            overwrite: false,
            positional: Vec::new(),
            env: None,
            language: None,
            base: None,
            manager: None,
            channels: Vec::new(),
            index_url: None,
            confirm: false,
            dry_run: false,
            to: None,
            version: None,
            from_store: false,
            project: None,
        }
    }
}

fn parse(args: Vec<String>) -> Result<Options, String> {
    let mut o = Options::default();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--url" => o.url = Some(value("--url")?),
            "--socket" => o.socket = Some(PathBuf::from(value("--socket")?)),
            "--workspace" => o.workspace = value("--workspace")?,
            "--workspace-root" => o.workspace_root = Some(value("--workspace-root")?),
            "--read-only-root" => o.read_only_root = Some(value("--read-only-root")?),
            "--timeout" => {
                o.timeout =
                    Some(value("--timeout")?.parse().map_err(|_| "--timeout takes milliseconds".to_owned())?)
            }
            "--session" => o.session = value("--session")?,
            "--agent" => o.agent = value("--agent")?,
            "--python" => o.python = true,
            "--insecure-default-token" => o.well_known = true,
            "--detach" | "-d" => o.detach = true,
            "--follow" | "-f" => o.follow = true,
            "--overwrite" => o.overwrite = true,
            "--env" => o.env = Some(value("--env")?),
            "--language" => o.language = Some(value("--language")?),
            "--base" => o.base = Some(value("--base")?),
            "--channel" => o.channels.push(value("--channel")?),
            "--index-url" => o.index_url = Some(value("--index-url")?),
            "--pip" => o.manager = Some("pip"),
            "--cran" => o.manager = Some("cran"),
            "--bioconductor" => o.manager = Some("bioconductor"),
            "--confirm" => o.confirm = true,
            "--dry-run" => o.dry_run = true,
            "--to" => o.to = Some(value("--to")?),
            "--version" => o.version = Some(value("--version")?),
            "--from-store" => o.from_store = true,
            "--project" => o.project = Some(value("--project")?),
            "--" => {
                let rest: Vec<String> = it.by_ref().collect();
                o.script = Some(rest.join(" "));
            }
            "health" | "status" | "metrics" | "exec" | "run" | "logs" | "show" | "cancel" | "ls" | "put"
            | "get" | "repair" | "skills" | "env" | "history" | "gc" | "workspace" | "fleet"
                if o.command.is_empty() =>
            {
                o.command = if arg == "run" { "exec".into() } else { arg }
            }
            other if !other.starts_with('-') && !o.command.is_empty() => o.positional.push(arg),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    complete(o)
}

/// The command's own checks after every argument was read: one was named, `exec` has its
/// script, and the number of positional arguments.
fn complete(o: Options) -> Result<Options, String> {
    if o.command.is_empty() {
        return Err("no command".into());
    }
    if o.command == "exec" && o.script.as_deref().is_none_or(|s| s.trim().is_empty()) {
        return Err("exec needs a script after --".into());
    }
    let wanted = match o.command.as_str() {
        "logs" | "show" | "cancel" | "repair" => 1..=1,
        "put" | "skills" => 2..=2,
        "workspace" | "fleet" => 1..=2,
        "get" => 1..=2,
        "env" => env_arity(o.positional.first().map(String::as_str))?,
        _ => 0..=0,
    };
    if !wanted.contains(&o.positional.len()) {
        return Err(format!("{} takes {} argument(s), got {:?}", o.command, wanted.end(), o.positional));
    }
    Ok(o)
}

/// How many words `env SUBCOMMAND …` takes, the subcommand included.
fn env_arity(sub: Option<&str>) -> Result<std::ops::RangeInclusive<usize>, String> {
    Ok(match sub {
        Some("ls" | "setup") => 1..=1,
        Some("create" | "rm") => 2..=2,
        Some("revisions") => 1..=2,
        Some("install" | "uninstall") => 3..=usize::MAX,
        Some(other) => {
            return Err(format!(
                "unknown env command {other:?} (ls, setup, create, install, uninstall, rm, revisions)"
            ));
        }
        None => {
            return Err("env needs a command (ls, setup, create, install, uninstall, rm, revisions)".into());
        }
    })
}

/// Entry point of the `runnerctl` binary.
pub fn run() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") || args.is_empty() {
        return common::out::print_status(USAGE, if args.is_empty() { 2 } else { 0 });
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
        Err(e) if reader_gone(&e) => 0,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "runnerctl: {e:#}");
            1
        }
    }
}

async fn execute(o: Options) -> anyhow::Result<i32> {
    let client = connect(&o)?;
    match o.command.as_str() {
        "health" => {
            let reply = tokio::time::timeout(
                crate::client::HEALTH_TIMEOUT,
                client.raw("GET", "/health", &[], Vec::new()),
            )
            .await
            .map_err(|_| anyhow::anyhow!("runnerd did not answer /health within 5 s"))??;
            outln!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(if reply.status == 200 { 0 } else { 1 })
        }
        "status" => {
            let reply = client.get("/status").await?;
            outln!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(if reply.status == 200 { 0 } else { 1 })
        }
        "metrics" => {
            let reply = client.get("/metrics").await?;
            if reply.status != 200 {
                outln!("{}", serde_json::to_string_pretty(&reply.json())?);
                return Ok(1);
            }
            out(&reply.body)?;
            Ok(0)
        }
        "logs" | "show" | "cancel" => managed(&client, &o).await,
        "ls" | "put" | "get" => files(&client, &o).await,
        "repair" => repair(&client, &o.positional[0]).await,
        "skills" => skills(&client, &o.positional[0], &o.positional[1]).await,
        "env" => environments(&client, &o).await,
        "workspace" => {
            let target = workspace::Target {
                key: o.positional.get(1).map(String::as_str),
                project: o.project.as_deref(),
            };
            let args = workspace::Args {
                to: o.to.as_deref(),
                version: o.version.as_deref(),
                from_store: o.from_store,
            };
            workspace::run(&client, &o.positional[0], target, args).await
        }
        "fleet" => fleet::run(&client, &o.positional[0], o.positional.get(1).map(String::as_str)).await,
        "history" => {
            let reply = client.get("/versioning").await?;
            outln!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(if reply.status == 200 { 0 } else { 1 })
        }
        "gc" => {
            let reply = client.post_json("/versioning/gc", &serde_json::json!({"dryRun": o.dry_run})).await?;
            if reply.status != 200 {
                return Ok(failed(reply.status, &reply.json()));
            }
            outln!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(0)
        }
        _ => exec(&client, o).await,
    }
}

/// A client of the runnerd the options (or runnerd's own settings) name, with its token
/// (none for `health`, which needs none).
fn connect(o: &Options) -> anyhow::Result<RunnerClient> {
    // Where runnerd listens and where its token is: the same settings it reads.
    let config = runnerd::client_settings(|k| std::env::var(k).ok())?;
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
    Ok(RunnerClient::new(endpoint, token))
}

/// The execution's body: the script, the ids, the workspace and the options that shape it.
async fn exec_body(client: &RunnerClient, o: &Options) -> anyhow::Result<serde_json::Value> {
    let mut body = serde_json::json!({
        "agentId": o.agent,
        "code": o.script.clone().unwrap_or_default(),
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(&o.session),
        "runnerWorkspaceKey": o.workspace,
    });
    // A caller-made workspace under projects/ instead of the remote workspace.
    if let Some(root) = &o.workspace_root {
        body.as_object_mut().expect("an object").remove("runnerWorkspaceKey");
        body["workspaceRoot"] = root.clone().into();
    }
    if let Some(root) = &o.read_only_root {
        body["readOnlyWorkspaceRoot"] = root.clone().into();
    }
    if let Some(ms) = o.timeout {
        body["executionTimeoutMs"] = ms.into();
    }
    if let Some(env) = &o.env {
        match o.python {
            // `/execute` names a revision: the environment's current one.
            true => body["environmentRevisionId"] = current_revision(client, env).await?.into(),
            false => body["environmentId"] = env.clone().into(),
        }
    }
    Ok(body)
}

/// `exec` (`run`): one execution, its output on ours and its exit code as ours; with
/// `--detach` a managed one, whose id is printed.
async fn exec(client: &RunnerClient, o: Options) -> anyhow::Result<i32> {
    let body = exec_body(client, &o).await?;
    let path = match (o.detach, o.python) {
        (true, true) => {
            anyhow::bail!("--detach runs shell scripts only (managed executions are shell)")
        }
        (true, false) => "/shell-executions",
        (false, true) => "/execute",
        (false, false) => "/execute-shell",
    };
    // The client has no clock offset yet: one cheap request learns it from `Date`.
    let _ = client.raw("GET", "/health", &[], Vec::new()).await;
    let reply = client.post_signed(path, &body).await?;
    if o.detach {
        return Ok(match reply.status {
            202 => {
                outln!("{}", reply.json()["id"].as_str().unwrap_or_default());
                0
            }
            status => failed(status, &reply.json()),
        });
    }
    let result = reply.json();
    if reply.status != 200 {
        eprintln!(
            "runnerctl: runnerd answered {}: {}",
            reply.status,
            result["error"].as_str().unwrap_or("(no error text)")
        );
        return Ok(1);
    }
    out(result["stdout"].as_str().unwrap_or("").as_bytes())?;
    std::io::stderr().write_all(result["stderr"].as_str().unwrap_or("").as_bytes())?;
    Ok(result["exitCode"].as_i64().map(|c| c as i32).unwrap_or(1))
}

/// An environment's current revision, from `GET /environments`.
async fn current_revision(client: &RunnerClient, env: &str) -> anyhow::Result<String> {
    let reply = client.get("/environments").await?;
    if reply.status != 200 {
        anyhow::bail!("runnerd answered {}: {}", reply.status, reply.json()["error"].as_str().unwrap_or(""));
    }
    let list = reply.json();
    let found = list.as_array().into_iter().flatten().find(|e| e["id"] == env || e["name"] == env);
    match found.and_then(|e| e["currentRevisionId"].as_str()) {
        Some(rev) => Ok(rev.to_owned()),
        None => anyhow::bail!("no environment {env:?} (runnerctl env ls lists them)"),
    }
}

/// `env …`: the environment routes, printed as JSON.
async fn environments(client: &RunnerClient, o: &Options) -> anyhow::Result<i32> {
    let args = &o.positional;
    let (reply, ok) = match args[0].as_str() {
        "ls" => (client.get("/environments").await?, 200),
        "setup" if o.confirm => {
            (client.post_json("/environment-setup", &serde_json::json!({"confirmed": true})).await?, 202)
        }
        "setup" => (client.get("/environment-setup").await?, 200),
        "create" => {
            let mut body =
                serde_json::json!({"name": args[1], "language": o.language.as_deref().unwrap_or("python")});
            if let Some(base) = &o.base {
                body["baseEnvironmentId"] = base.clone().into();
            }
            (client.post_json("/environments", &body).await?, 201)
        }
        "install" => {
            let mut body = serde_json::json!({
                "packages": args[2..],
                "manager": o.manager.unwrap_or("conda"),
                "runnerWorkspaceKey": o.workspace,
            });
            if !o.channels.is_empty() {
                body["channels"] = o.channels.clone().into();
            }
            if let Some(url) = &o.index_url {
                body["indexUrl"] = url.clone().into();
            }
            (client.post_json(&format!("/environments/{}/install", encode(&args[1])), &body).await?, 201)
        }
        "uninstall" => {
            let body = serde_json::json!({"packages": args[2..]});
            (client.post_json(&format!("/environments/{}/uninstall", encode(&args[1])), &body).await?, 201)
        }
        "rm" => (
            client
                .send_bytes("DELETE", &format!("/environments/{}", encode(&args[1])), &[], Vec::new())
                .await?,
            200,
        ),
        _ => {
            let reply = client.get("/environment-revisions").await?;
            if reply.status != 200 {
                return Ok(failed(reply.status, &reply.json()));
            }
            let mut list = reply.json();
            if let (Some(env), Some(items)) = (args.get(1), list.as_array_mut()) {
                items.retain(|r| r["environmentId"] == env.as_str());
            }
            outln!("{}", serde_json::to_string_pretty(&list)?);
            return Ok(0);
        }
    };
    if reply.status != ok {
        return Ok(failed(reply.status, &reply.json()));
    }
    outln!("{}", serde_json::to_string_pretty(&reply.json())?);
    Ok(0)
}

fn failed(status: u16, body: &serde_json::Value) -> i32 {
    eprintln!(
        "runnerctl: runnerd answered {status}: {}",
        body["error"].as_str().unwrap_or("(no error text)")
    );
    1
}

/// `repair WORKSPACE`: the signed repair route; prints its answer.
async fn repair(client: &RunnerClient, key: &str) -> anyhow::Result<i32> {
    let body = serde_json::json!({"workspace": key, "repairId": runner_store::versioning::new_uuid_v4()});
    // The client has no clock offset yet: one cheap request learns it from `Date`.
    let _ = client.raw("GET", "/health", &[], Vec::new()).await;
    let reply = client.post_signed("/remote-workspace/repair", &body).await?;
    if reply.status != 200 {
        return Ok(failed(reply.status, &reply.json()));
    }
    println!("{}", serde_json::to_string_pretty(&reply.json())?);
    Ok(0)
}

/// How often `logs -f` polls.
const FOLLOW_POLL: std::time::Duration = std::time::Duration::from_millis(250);

fn owner(o: &Options) -> String {
    format!("sessionId={}&agentId={}", encode(&o.session), encode(&o.agent))
}

/// `logs`, `show` and `cancel` of a managed execution.
async fn managed(client: &RunnerClient, o: &Options) -> anyhow::Result<i32> {
    let id = encode(&o.positional[0]);
    let owner = owner(o);
    match o.command.as_str() {
        "show" => {
            let reply = client.get(&format!("/shell-executions/{id}?{owner}")).await?;
            if reply.status != 200 {
                return Ok(failed(reply.status, &reply.json()));
            }
            outln!("{}", serde_json::to_string_pretty(&reply.json())?);
            Ok(0)
        }
        "cancel" => {
            let reply = client
                .send_bytes("POST", &format!("/shell-executions/{id}/cancel?{owner}"), &[], Vec::new())
                .await?;
            if reply.status != 202 {
                return Ok(failed(reply.status, &reply.json()));
            }
            outln!("{}: {}", o.positional[0], reply.json()["state"].as_str().unwrap_or("?"));
            Ok(0)
        }
        _ => {
            let mut cursor = 0u64;
            loop {
                // Read the state before the page: once terminal, the next pages are final.
                let rec = client.get(&format!("/shell-executions/{id}?{owner}")).await?;
                if rec.status != 200 {
                    return Ok(failed(rec.status, &rec.json()));
                }
                let rec = rec.json();
                let terminal = rec["state"]
                    .as_str()
                    .and_then(ManagedState::parse)
                    .is_some_and(ManagedState::is_terminal);
                loop {
                    let page =
                        client.get(&format!("/shell-executions/{id}/logs?{owner}&cursor={cursor}")).await?;
                    if page.status != 200 {
                        return Ok(failed(page.status, &page.json()));
                    }
                    let page = page.json();
                    for chunk in page["chunks"].as_array().into_iter().flatten() {
                        let text = chunk["text"].as_str().unwrap_or_default();
                        if chunk["stream"] == "stderr" {
                            std::io::stderr().write_all(text.as_bytes())?;
                        } else {
                            out(text.as_bytes())?;
                        }
                    }
                    cursor = page["nextCursor"].as_u64().unwrap_or(cursor);
                    if page["truncated"] != true {
                        break;
                    }
                }
                if !o.follow {
                    return Ok(0);
                }
                if terminal {
                    if let Some(error) = rec["error"].as_str() {
                        eprintln!(
                            "runnerctl: {} {}: {error}",
                            o.positional[0],
                            rec["state"].as_str().unwrap_or("")
                        );
                    }
                    return Ok(rec["result"]["exitCode"].as_i64().map(|c| c as i32).unwrap_or(1));
                }
                tokio::time::sleep(FOLLOW_POLL).await;
            }
        }
    }
}

/// `ls`, `put` and `get` on the remote workspace.
async fn files(client: &RunnerClient, o: &Options) -> anyhow::Result<i32> {
    use sha2::{Digest, Sha256};
    let ws = format!("workspace={}", encode(&o.workspace));
    match o.command.as_str() {
        "ls" => {
            let reply = client.get(&format!("/remote-workspace/files?{ws}")).await?;
            if reply.status != 200 {
                return Ok(failed(reply.status, &reply.json()));
            }
            for f in reply.json().as_array().into_iter().flatten() {
                outln!(
                    "{:>12}  {}  {}",
                    f["size"],
                    f["modifiedAt"].as_str().unwrap_or(""),
                    f["path"].as_str().unwrap_or("")
                );
            }
            Ok(0)
        }
        "put" => {
            let bytes = std::fs::read(&o.positional[0])
                .map_err(|e| anyhow::anyhow!("reading {}: {e}", o.positional[0]))?;
            let size = bytes.len() as u64;
            let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            let exec = std::fs::metadata(&o.positional[0]).map(|m| {
                use std::os::unix::fs::PermissionsExt;
                m.permissions().mode() & 0o111
            })?;
            let headers = [
                ("x-workspace-size", bytes.len().to_string()),
                ("x-workspace-sha256", sha.clone()),
                ("x-workspace-executable", exec.to_string()),
            ];
            let conflict = if o.overwrite { "overwrite" } else { "reject" };
            let path = encode(&o.positional[1]);
            let url = format!("/remote-workspace/transfer-file?{ws}&path={path}&conflict={conflict}");
            let reply = client.send_bytes("PUT", &url, &headers, bytes).await?;
            if reply.status != 201 {
                return Ok(failed(reply.status, &reply.json()));
            }
            let receipt = reply.json();
            if receipt["sha256"] != sha.as_str() || receipt["size"].as_u64() != Some(size) {
                anyhow::bail!("runnerd's receipt does not match what was sent: {receipt}");
            }
            outln!("{} ({} bytes, sha256 {sha})", receipt["path"].as_str().unwrap_or(""), receipt["size"]);
            Ok(0)
        }
        _ => {
            let path = encode(&o.positional[0]);
            let reply = client.get(&format!("/remote-workspace/file?{ws}&path={path}")).await?;
            if reply.status != 200 {
                return Ok(failed(reply.status, &reply.json()));
            }
            match o.positional.get(1) {
                Some(local) => {
                    std::fs::write(local, &reply.body).map_err(|e| anyhow::anyhow!("writing {local}: {e}"))?
                }
                None => out(&reply.body)?,
            }
            Ok(0)
        }
    }
}

/// `runnerctl skills push DIR` / `skills show ID` / `skills rm ID`.
async fn skills(client: &RunnerClient, action: &str, arg: &str) -> anyhow::Result<i32> {
    let reply = match action {
        "push" => {
            let bundle = skill_bundle::bundle_of(&read_skills(std::path::Path::new(arg))?, 1, "local");
            client.post_json("/skill-packages", &bundle).await?
        }
        "show" => client.get(&format!("/skill-packages/{}", encode(arg))).await?,
        "rm" => {
            let path = format!("/skill-packages/{}", encode(arg));
            client.send_bytes("DELETE", &path, &[], Vec::new()).await?
        }
        other => anyhow::bail!("skills takes push DIR, show ID or rm ID, not {other:?}"),
    };
    if reply.status != 200 {
        return Ok(failed(reply.status, &reply.json()));
    }
    outln!("{}", serde_json::to_string_pretty(&reply.json())?);
    Ok(0)
}

/// The skills under `dir`: `dir` itself when it holds `SKILL.md`, else each subdirectory.
/// Regular files only (a symlink is refused, never followed).
fn read_skills(dir: &std::path::Path) -> anyhow::Result<Vec<LocalSkill>> {
    let name =
        |p: &std::path::Path| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let roots: Vec<PathBuf> = if dir.join(skill_bundle::SKILL_MD).is_file() {
        vec![dir.to_owned()]
    } else {
        let mut subs: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
            .collect();
        subs.sort();
        subs
    };
    let mut skills = Vec::new();
    for root in roots {
        let mut files = Vec::new();
        collect_files(&root, "", &mut files)?;
        skills.push((name(&root), files));
    }
    Ok(skills)
}

fn collect_files(
    dir: &std::path::Path,
    prefix: &str,
    out: &mut Vec<(String, Vec<u8>)>,
) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| anyhow::anyhow!("reading {}: {e}", dir.display()))? {
        let entry = entry?;
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() { file_name } else { format!("{prefix}/{file_name}") };
        let kind = entry.file_type()?;
        if kind.is_dir() {
            collect_files(&entry.path(), &rel, out)?;
        } else if kind.is_file() {
            out.push((rel, std::fs::read(entry.path())?));
        } else {
            anyhow::bail!(
                "{} is not a regular file or directory (symlinks are not packaged)",
                entry.path().display()
            );
        }
    }
    Ok(())
}
