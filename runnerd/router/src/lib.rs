//! runner-router: one URL in front of many runnerd nodes (issue #35). It speaks runnerd's
//! HTTP API exactly — the API points `SCIENCE_AGENT_RUNNER_URL` at it and notices nothing —
//! and forwards each request, bytes unchanged, to the node that holds its workspace.
//!
//! * [`config`]: flags, variables and the configuration file, like the other daemons.
//! * [`server`]: runnerd's own checks, in runnerd's order (auth, body limits, signatures).
//! * [`classify`]: which requests name a workspace, an execution, a job, or the fleet (pure).
//! * [`route`]: the catalog, the nodes' answers and placement, and byte-for-byte forwarding.
//! * [`placement`]: best-of-K by a cheap load score, rendezvous-sampled (pure).
//! * [`fleet`]: the nodes, their readiness and load, and the catalog (a cache of the nodes).
//! * [`discovery`]: `--nodes`, or the pools' EndpointSlices from Kubernetes; load polls.
//! * [`recover`]: a lost node's workspaces restored from the object store after a grace.
//! * [`admin`]: `/fleet/nodes` and drain; [`own`]: `/health`, `/status`, `/resources`,
//!   `/metrics`; [`node`]: the client to the nodes; [`metrics`].
//!
//! The nodes are the truth: every router replica learns the same from them, and none needs
//! to talk to another.

pub mod admin;
pub mod classify;
pub mod config;
pub mod discovery;
pub mod fleet;
pub mod metrics;
pub mod node;
pub mod own;
pub mod placement;
pub mod recover;
pub mod route;
pub mod server;

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use common::audit::{LogSettings, Sink};
use common::daemon::{self, Args, Daemon};
use common::settings::{Row, render};
use config::{Loaded, Membership};

pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_owned()
}

/// Entry point of the `runner-router` binary; returns the exit status.
pub fn run() -> i32 {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    daemon::run::<RunnerRouter>(&argv)
}

/// runner-router in the daemons' start-up scaffold.
#[derive(Debug)]
pub struct RunnerRouter;

/// What start-up resolved before serving.
#[derive(Debug)]
pub struct Prepared {
    token: runnerd::token::Token,
    token_source: String,
}

impl Daemon for RunnerRouter {
    const NAME: &'static str = "runner-router";
    const USAGE: &'static str = config::USAGE;
    const GRAMMAR: daemon::Grammar = config::GRAMMAR;
    const FAILED_EVENT: Option<&'static str> = Some("runner_router_failed");
    type Loaded = Loaded;
    type ValueError = config::ConfigError;
    type Prepared = Prepared;
    type Error = anyhow::Error;

    fn version() -> String {
        version()
    }

    fn load(args: &Args) -> Result<Loaded, config::LoadError> {
        config::load(args.clone(), |k| std::env::var(k).ok())
    }

    fn log_settings(loaded: &Loaded) -> &LogSettings {
        &loaded.log
    }

    fn prepare(_: &Args, loaded: &Loaded) -> anyhow::Result<Prepared> {
        let c = &loaded.config;
        let (token, source) = runnerd::token::resolve(
            |k| loaded.settings.var(k).or_else(|| std::env::var(k).ok()),
            c.token_file.as_deref(),
            &c.data_dir,
            runnerd::token::Fallback::ReadGenerated,
        )
        .context(
            "the router needs the nodes' token (it checks callers with it and signs its own requests)",
        )?;
        Ok(Prepared { token, token_source: source.to_string() })
    }

    fn check(_: &Args, loaded: &Loaded, prepared: &Prepared) -> anyhow::Result<String> {
        let checks = [Row::new("token", prepared.token_source.clone(), "")];
        Ok(format!(
            "runner-router configuration is valid.\nconfiguration file: {}\nsettings (value, origin):\n{}checks:\n{}",
            loaded.settings.file_status(),
            render(&loaded.rows()),
            render(&checks)
        ))
    }

    fn serve(_: Args, loaded: Loaded, prepared: Prepared, sink: Option<Sink>) -> anyhow::Result<i32> {
        tracing::info!(event = "config_loaded", version = %version(), config_file = %loaded.settings.file_status(),
            token = %prepared.token_source, log_sink = %daemon::sink_name(sink));
        let runtime =
            tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
        runtime.block_on(serve(loaded, prepared))
    }
}

async fn serve(loaded: Loaded, prepared: Prepared) -> anyhow::Result<i32> {
    let config = loaded.config;
    let address = format!("{}:{}", config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .with_context(|| format!("could not listen on {address}"))?;
    let bound = listener.local_addr()?;
    let token = prepared.token.expose().to_owned();
    let client = node::NodeClient::new(token);
    let fleet = Arc::new(fleet::Fleet::default());
    let (stop_tx, stopping) = tokio::sync::watch::channel(false);
    match &config.membership {
        Membership::Static(nodes) => fleet.set_members(discovery::static_members(nodes)),
        Membership::Kube { services, namespace } => {
            let (fleet, services, namespace, stopping) =
                (fleet.clone(), services.clone(), namespace.clone(), stopping.clone());
            tokio::spawn(async move {
                if let Err(e) = discovery::watch_kube(fleet, services, namespace, stopping).await {
                    tracing::error!(event = "kube_unavailable", error = %common::error_chain(&e),
                        remedy = "run in a pod with a service account allowed to watch EndpointSlices, or set KUBECONFIG");
                }
            });
        }
    }
    tokio::spawn(discovery::poll_loads(
        fleet.clone(),
        client.clone(),
        config.load_interval,
        stopping.clone(),
    ));
    let gate = runnerd::auth::Gate::new(prepared.token);
    let router = route::Router::new(config, gate, fleet, client).into_shared();
    tokio::spawn(recover::watch_losses(router.clone(), stopping.clone()));
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "runner-router listening on http://{bound}")?;
        out.flush()?;
    }
    tracing::info!(event = "listening", address = %format!("http://{bound}"));
    let _ = common::systemd::notify(&format!("READY=1\nSTATUS=listening on http://{bound}"));
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!(event = "stopping");
        let _ = stop_tx.send(true);
    });
    // On a worker, not the thread that blocks on the runtime: a connection accepted there is
    // handed to a worker at every request (about 3 context switches a call, measured).
    tokio::spawn(server::serve(listener, router, stopping)).await.context("the HTTP server task failed")?;
    tracing::info!(event = "stopped");
    Ok(0)
}
