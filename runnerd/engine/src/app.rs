//! Everything the HTTP handlers share, built once at start-up.

use std::path::PathBuf;

use crate::config::RunnerConfig;
use crate::egress::EgressClient;
use crate::exec::admission::Admission;
use crate::exec::dedupe::RecentIds;
use crate::exec::registry::Registry;
use crate::managed::Manager;
use crate::startup::SandboxRuntime;
use crate::writer::Versions;

#[derive(Debug)]
pub struct App {
    pub config: RunnerConfig,
    pub sandbox: SandboxRuntime,
    pub admission: Admission,
    pub recent_ids: RecentIds,
    pub registry: Registry,
    /// The data directory as given (paths in answers use it, like the original).
    pub data_dir: PathBuf,
    /// The user executions run as: the sandbox user's name (contract §4 `executionUser`; the
    /// original runs code as its own user, which is the same thing when runnerd is not root).
    pub execution_user: String,
    /// Turns `true` when runnerd is stopping: queued and running executions are aborted.
    pub shutdown: tokio::sync::watch::Sender<bool>,
    /// Workspace versions and writer coordination under the data directory.
    pub versions: std::sync::Arc<Versions>,
    /// Managed (background) shell executions.
    pub managed: std::sync::Arc<Manager>,
    /// egressd and the bridge, for domain-allowlist sandboxes.
    pub egress: EgressClient,
    /// Ascend NPUs and NVIDIA GPUs: configuration and the status views' caches.
    pub accel: crate::accel::select::Accelerators,
    /// How resource limits are enforced (decided at start-up).
    pub limits: crate::limits::Enforcement,
    /// npu-brokerd, for the `/npu/workloads` and `/npu/jobs…` routes.
    pub npu_broker: crate::npu_broker::BrokerClient,
    /// The server-wide ceiling on output held in memory (`max_buffered_output_bytes`).
    pub output_pool: std::sync::Arc<crate::launch::OutputPool>,
    /// What `GET /metrics` answers.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The scientific environments (`crate::envs`).
    pub envs: crate::envs::store::EnvStore,
    /// Sandbox slots for provisioning steps: as many as executions may run at once, and
    /// their own (an install holding its environment's write gate and waiting for a slot
    /// that runs waiting for that environment hold would never get one).
    pub provisioning_steps: tokio::sync::Semaphore,
    /// What runs changed, from file events (`crate::journal`).
    pub journal: crate::journal::Journal,
    /// The version history's retention and collector (issue #32).
    pub history: crate::history::History,
    /// The skill packages executions hold (`DELETE /skill-packages/:id` waits for none).
    pub skills_in_use: std::sync::Arc<crate::skills::in_use::InUse>,
    /// The workspace moves this node is sending (issue #34), for `where`'s progress.
    pub moves: crate::transfer::outgoing::Moves,
    /// Replication to the object store (issue #34); `None` when `replica_endpoint` is unset.
    pub replica: Option<std::sync::Arc<crate::replica::Replica>>,
}

impl App {
    /// The accelerator probes' view of this daemon: its sandboxes, data directory and chips.
    pub fn accel_prober(&self) -> crate::accel::probe::SandboxProber<'_> {
        crate::accel::probe::SandboxProber {
            sandbox: &self.sandbox,
            data_dir: &self.data_dir,
            config: &self.accel.config,
        }
    }

    pub fn new(
        config: RunnerConfig,
        sandbox: SandboxRuntime,
        versions: std::sync::Arc<Versions>,
        managed: std::sync::Arc<Manager>,
        limits: crate::limits::Enforcement,
        envs: crate::envs::store::EnvStore,
        replica: Option<crate::replica::Connection>,
    ) -> App {
        let admission = Admission::new(config.queue_capacity, config.max_concurrent);
        let config_max_concurrent = config.max_concurrent;
        let journal_settings = config.journal;
        let history_settings = config.history;
        let data_dir = config.data_dir.clone();
        let execution_user = sandbox.user.name.clone();
        let accel = crate::accel::select::Accelerators::new(config.accel.clone());
        let egress = EgressClient {
            control_socket: config.egress_socket.clone(),
            bridge: crate::egress::locate_bridge(config.egress_bridge.clone()),
        };
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let replica = replica.map(|connection| {
            std::sync::Arc::new(crate::replica::Replica::new(
                connection,
                versions.clone(),
                metrics.replication(),
            ))
        });
        App {
            replica,
            output_pool: crate::launch::OutputPool::new(config.max_buffered_output_bytes),
            sandbox,
            admission,
            recent_ids: RecentIds::default(),
            registry: Registry::default(),
            data_dir,
            execution_user,
            shutdown: tokio::sync::watch::Sender::new(false),
            versions,
            managed,
            npu_broker: crate::npu_broker::BrokerClient {
                enabled: config.npu_broker_enabled,
                socket: config.npu_broker_socket.clone(),
            },
            config,
            egress,
            accel,
            limits,
            metrics,
            envs,
            provisioning_steps: tokio::sync::Semaphore::new(config_max_concurrent),
            journal: crate::journal::Journal::new(journal_settings),
            history: crate::history::History::new(history_settings),
            skills_in_use: crate::skills::in_use::InUse::new(),
            moves: crate::transfer::outgoing::Moves::default(),
        }
    }
}

/// The build's version: 8 hex of the commit (`-dirty` when built from a modified tree), or
/// `unknown` (contract §4 `runnerVersion`).
pub fn runner_version() -> &'static str {
    let v = env!("RUNNER_VERSION");
    let hash = v.strip_suffix("-dirty").unwrap_or(v);
    if hash.len() == 8 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        v
    } else {
        "unknown"
    }
}
