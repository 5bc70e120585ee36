//! Gateways and their leases (R-NET-3, internals §3.2, issue #14 holes 7 and 8).
//!
//! A *gateway* is one policy: keyed by its [`PolicyIdentity`] (the sha256 of the normalised
//! allowlist and private-network flag, never the caller's revision, which is only logged),
//! created on first acquire, shared by every sandbox with the same policy, and reaped when
//! no lease and no connection has used it for a while. So no caller can occupy another's
//! policy by naming its revision first.
//!
//! A *lease* is one sandbox: each acquire gets a Unix socket of its own,
//! `<runtime dir>/eg/<16 hex>`, which runnerd binds into exactly that sandbox. Every
//! connection on it is therefore that sandbox's, whatever process inside opened it, and the
//! connection caps ([`slots`]) count per lease, not per process id; the lease's socket
//! admits only the host uid the sandbox runs as (SO_PEERCRED), and its route (direct or the
//! deployment's proxy) is the lease's own. Dropping the lease (runnerd closes the control
//! connection, or dies) removes the socket and ends its connections.

mod slots;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::egress::PolicyIdentity;
use common::egress::allowlist::Allowlist;
use common::egress::protocol::{GatewayPolicy, Verdict};
use common::egress::route::ProxySetting;
use sha2::{Digest, Sha256};
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::proxy::decide::Policy;
use crate::proxy::{self, Shared, reply};
pub use slots::{Caps, Held, Refusal, Slot};

/// Linux's `sun_path` holds 108 bytes including the terminating NUL.
pub const MAX_UNIX_SOCKET_PATH_BYTES: usize = 107;
/// `/eg/` + 16 hex: what the socket adds to the runtime directory (the original's 20 counts
/// the two separators and the name).
pub const EGRESS_SOCKET_RELATIVE_BYTES: usize = 2 + 16 + 2;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(
        "Sandbox network access (domain-allowlist) is unavailable: the egress socket path is {len} bytes, over this platform's {MAX_UNIX_SOCKET_PATH_BYTES}-byte Unix socket path limit — {path}. The socket has to stay inside egressd's runtime directory, so shorten that directory by at least {over} byte(s) (--runtime-dir / SCIENCE_AGENT_EGRESS_RUNTIME_DIR); it must leave {EGRESS_SOCKET_RELATIVE_BYTES} bytes for the socket itself."
    )]
    PathTooLong { len: usize, over: usize, path: String },
    #[error(
        "runnerd named the policy {sent} but egressd derives {derived} from it; install runnerd and egressd from the same release"
    )]
    IdentityMismatch { sent: String, derived: String },
    #[error("could not create the gateway directory {path}")]
    Directory {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not listen on the lease socket {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not set the owner group or mode of {path}")]
    Permissions {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `<runtime dir>/eg/<first 16 hex of sha256(seed)>`, whatever the seed contains.
pub fn socket_path(runtime_dir: &Path, seed: &str) -> PathBuf {
    let digest = Sha256::digest(seed.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    runtime_dir.join("eg").join(hex)
}

/// Refuses a runtime directory whose lease sockets could not be bound.
pub fn check_path_length(runtime_dir: &Path) -> Result<(), RegistryError> {
    let path = socket_path(runtime_dir, "");
    let len = path.as_os_str().len();
    if len > MAX_UNIX_SOCKET_PATH_BYTES {
        return Err(RegistryError::PathTooLong {
            len,
            over: len - MAX_UNIX_SOCKET_PATH_BYTES,
            path: path.display().to_string(),
        });
    }
    Ok(())
}

/// The most connections a gateway's pool admits, whatever is configured (a sane ceiling).
pub const MAX_TUNNELS: usize = 65_536;

/// The mode of a lease socket. connect(2) needs write permission on the socket and nothing
/// else; when the sandbox runs as another uid than egressd's, the group and "others" get
/// exactly that: the group because the package's runner user is a member of egressd's
/// socket group (and a member is judged by the group bits, never the others'). The
/// `eg` directory is searchable but not listable (0711): bwrap re-resolves even a socket
/// bound from a descriptor by its path, as the sandbox user, who may be neither egressd's
/// user nor in its group (a root runnerd's sandbox user). SO_PEERCRED admits only the
/// lease's uid on each socket, so reaching a path gives nobody else a gateway.
pub fn lease_socket_mode(sandbox_uid: u32, egressd_uid: u32) -> u32 {
    if sandbox_uid == egressd_uid { 0o600 } else { 0o622 }
}

/// How the control socket and the gateway directory are made reachable by runnerd's user
/// and nobody else.
#[derive(Debug, Clone, Copy)]
pub struct SocketAccess {
    /// `Some(gid)`: mode 0660 (0750 for the directory) and this group (runnerd's user is a
    /// member); `None`: 0600 (0700).
    pub group: Option<u32>,
}

impl SocketAccess {
    /// Applies the mode (and group) to the control socket or a directory egressd created.
    pub fn apply(&self, path: &Path, dir: bool) -> Result<(), RegistryError> {
        let err = |source| RegistryError::Permissions { path: path.to_owned(), source };
        if let Some(gid) = self.group {
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(err)?;
        }
        let mode = match (dir, self.group.is_some()) {
            (true, true) => 0o750,
            (true, false) => 0o700,
            (false, true) => 0o660,
            (false, false) => 0o600,
        };
        set_mode(path, mode)
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<(), RegistryError> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|source| RegistryError::Permissions { path: path.to_owned(), source })
}

/// One policy's gateway: what it enforces and its shared pool of connection slots.
#[derive(Debug)]
pub struct Gateway {
    pub identity: PolicyIdentity,
    policy: Policy,
    caps: Caps,
    leases: AtomicUsize,
    connections: AtomicUsize,
    last_used: Mutex<Instant>,
    /// Pool slots taken, by the connections of all its leases together.
    pool_in_use: Mutex<usize>,
}

impl Gateway {
    fn touch(&self) {
        *self.last_used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle_for(&self) -> Option<Duration> {
        if self.leases.load(Ordering::SeqCst) > 0 || self.connections.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(self.last_used.lock().unwrap_or_else(|p| p.into_inner()).elapsed())
    }
}

/// What a lease's connections share: its gateway, socket, uid, route and slot counts.
#[derive(Debug)]
struct LeaseState {
    gateway: Arc<Gateway>,
    path: PathBuf,
    /// The caller's revision, for the audit events only.
    revision: String,
    uid: u32,
    route: ProxySetting,
    held: Mutex<Held>,
}

/// Held while a sandbox may use the gateway (the control connection stays open meanwhile).
#[derive(Debug)]
pub struct Lease {
    state: Arc<LeaseState>,
    stop: watch::Sender<bool>,
}

impl Lease {
    pub fn socket_path(&self) -> &Path {
        &self.state.path
    }

    pub fn identity(&self) -> &PolicyIdentity {
        &self.state.gateway.identity
    }

    /// The connections this lease holds now.
    pub fn held(&self) -> Held {
        *self.state.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Ends the accept loop and every connection of this lease: the sandbox is gone.
        let _ = self.stop.send(true);
        let _ = std::fs::remove_file(&self.state.path);
        self.state.gateway.leases.fetch_sub(1, Ordering::SeqCst);
        self.state.gateway.touch();
        tracing::debug!(event = "lease_released", gateway = %self.state.gateway.identity.short(), socket = %self.state.path.display());
    }
}

#[derive(Debug)]
pub struct Registry {
    runtime_dir: PathBuf,
    caps: Caps,
    egressd_uid: u32,
    shared: Arc<Shared>,
    gateways: Mutex<HashMap<PolicyIdentity, Arc<Gateway>>>,
    /// Lease socket names are sha256(seed, counter): unique in this run, and telling
    /// nothing about other leases.
    seed: String,
    next_lease: AtomicU64,
}

impl Registry {
    /// Prepares `<runtime dir>/eg`, removing sockets a previous egressd left (running
    /// sandboxes keep their bind mounts of the old inodes; nothing can listen on them).
    pub fn new(
        runtime_dir: PathBuf,
        access: SocketAccess,
        max_tunnels: usize,
        shared: Arc<Shared>,
    ) -> Result<Registry, RegistryError> {
        check_path_length(&runtime_dir)?;
        let caps = Caps::from_max_tunnels(max_tunnels.clamp(1, MAX_TUNNELS));
        let dir = runtime_dir.join("eg");
        std::fs::create_dir_all(&dir)
            .map_err(|source| RegistryError::Directory { path: dir.clone(), source })?;
        access.apply(&dir, true)?;
        // See `lease_socket_mode`: searchable by the sandbox user, listable by nobody else.
        set_mode(&dir, 0o711)?;
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        Ok(Registry {
            runtime_dir,
            caps,
            egressd_uid: nix::unistd::geteuid().as_raw(),
            shared,
            gateways: Mutex::default(),
            seed: format!("{}:{started}", std::process::id()),
            next_lease: AtomicU64::new(0),
        })
    }

    pub fn gateway_dir(&self) -> PathBuf {
        self.runtime_dir.join("eg")
    }

    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// Counts for the status answer: gateways, open connections.
    pub fn counts(&self) -> (usize, usize) {
        let map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        (map.len(), map.values().map(|g| g.connections.load(Ordering::SeqCst)).sum())
    }

    /// A lease on the gateway of `policy` (created on first use) for a sandbox running as
    /// host uid `sandbox_uid`. `identity` is runnerd's derivation, checked against ours.
    pub fn acquire(
        &self,
        policy: &GatewayPolicy,
        identity: &PolicyIdentity,
        route: ProxySetting,
        sandbox_uid: u32,
    ) -> Result<Lease, RegistryError> {
        let gateway = self.gateway(policy, identity)?;
        // Counted before the socket exists, so the reaper never takes a gateway being leased.
        gateway.leases.fetch_add(1, Ordering::SeqCst);
        gateway.touch();
        let release = |gateway: &Gateway| {
            gateway.leases.fetch_sub(1, Ordering::SeqCst);
            gateway.touch();
        };
        let (path, listener) = match self.listen(sandbox_uid) {
            Ok(bound) => bound,
            Err(e) => {
                release(&gateway);
                return Err(e);
            }
        };
        let (stop, stopped) = watch::channel(false);
        let state = Arc::new(LeaseState {
            gateway,
            path,
            revision: policy.revision.clone(),
            uid: sandbox_uid,
            route,
            held: Mutex::default(),
        });
        tracing::info!(
            event = "lease_opened",
            gateway = %state.gateway.identity.short(),
            revision = %state.revision,
            socket = %state.path.display(),
            sandbox_uid,
        );
        tokio::spawn(accept_loop(listener, state.clone(), self.shared.clone(), stopped));
        Ok(Lease { state, stop })
    }

    /// The gateway of `policy` (created on first use), once `identity`, runnerd's derivation,
    /// matches ours.
    fn gateway(
        &self,
        policy: &GatewayPolicy,
        identity: &PolicyIdentity,
    ) -> Result<Arc<Gateway>, RegistryError> {
        let (allowlist, rejected) = Allowlist::parse(&policy.allowed_domains);
        let (pinned, rejected_origins) = common::egress::origin::parse_all(&policy.pinned_origins);
        let derived = PolicyIdentity::of_parts(&allowlist, &pinned, policy.allow_private_network);
        if &derived != identity {
            return Err(RegistryError::IdentityMismatch {
                sent: identity.to_string(),
                derived: derived.to_string(),
            });
        }
        let mut map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        let gateway = map
            .entry(derived)
            .or_insert_with_key(|identity| {
                for e in &rejected {
                    tracing::warn!(event = "allowlist_entry_skipped", gateway = %identity.short(), revision = %policy.revision, reason = %e);
                }
                for e in &rejected_origins {
                    tracing::warn!(event = "pinned_origin_skipped", gateway = %identity.short(), revision = %policy.revision, reason = %e);
                }
                let normalized = allowlist.normalized().join(",");
                let origins = pinned.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
                let gateway = Arc::new(Gateway {
                    identity: identity.clone(),
                    policy: Policy { allowlist, allow_private_network: policy.allow_private_network, pinned },
                    caps: self.caps,
                    leases: AtomicUsize::new(0),
                    connections: AtomicUsize::new(0),
                    last_used: Mutex::new(Instant::now()),
                    pool_in_use: Mutex::new(0),
                });
                tracing::info!(
                    event = "gateway_created",
                    gateway = %identity,
                    revision = %policy.revision,
                    allowed_domains = %normalized,
                    pinned_origins = %origins,
                    allow_private_network = policy.allow_private_network,
                );
                gateway
            })
            .clone();
        Ok(gateway)
    }

    /// Binds a fresh lease socket (never replacing one: a name in use is skipped).
    fn listen(&self, sandbox_uid: u32) -> Result<(PathBuf, UnixListener), RegistryError> {
        let mut tries = 0;
        loop {
            let n = self.next_lease.fetch_add(1, Ordering::SeqCst);
            let path = socket_path(&self.runtime_dir, &format!("{}:{n}", self.seed));
            match UnixListener::bind(&path) {
                Ok(listener) => {
                    if let Err(e) = set_mode(&path, lease_socket_mode(sandbox_uid, self.egressd_uid)) {
                        let _ = std::fs::remove_file(&path);
                        return Err(e);
                    }
                    return Ok((path, listener));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 8 => tries += 1,
                Err(source) => return Err(RegistryError::Listen { path, source }),
            }
        }
    }

    /// Forgets gateways idle (no lease, no connection) for at least `idle`.
    pub fn reap(&self, idle: Duration) -> usize {
        let mut map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        let before = map.len();
        map.retain(|identity, g| {
            let stale = g.idle_for().is_some_and(|d| d >= idle);
            if stale {
                tracing::info!(event = "gateway_reaped", gateway = %identity);
            }
            !stale
        });
        before - map.len()
    }

    /// Forgets every gateway (shutdown); the leases' sockets go with their control
    /// connections.
    pub fn close_all(&self) {
        self.gateways.lock().unwrap_or_else(|p| p.into_inner()).clear();
        if let Ok(entries) = std::fs::read_dir(self.gateway_dir()) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

async fn accept_loop(
    listener: UnixListener,
    lease: Arc<LeaseState>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.changed() => return,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(event = "gateway_accept_failed", gateway = %lease.gateway.identity.short(), error = %e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(connection(stream, lease.clone(), shared.clone(), stopped.clone()));
    }
}

/// One admitted connection's slot, given back when it ends.
struct Taken<'a> {
    lease: &'a LeaseState,
    slot: Slot,
}

impl<'a> Taken<'a> {
    fn take(lease: &'a LeaseState) -> Result<Taken<'a>, Refusal> {
        // Lock order: the lease's counts, then the gateway's pool.
        let mut held = lease.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut pool = lease.gateway.pool_in_use.lock().unwrap_or_else(|p| p.into_inner());
        let slot = slots::admit(&lease.gateway.caps, *held, *pool)?;
        held.open += 1;
        match slot {
            Slot::Reserved => held.reserved += 1,
            Slot::Pool => *pool += 1,
        }
        Ok(Taken { lease, slot })
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut held = self.lease.held.lock().unwrap_or_else(|p| p.into_inner());
        let mut pool = self.lease.gateway.pool_in_use.lock().unwrap_or_else(|p| p.into_inner());
        held.open -= 1;
        match self.slot {
            Slot::Reserved => held.reserved -= 1,
            Slot::Pool => *pool -= 1,
        }
    }
}

/// The 429 reason for a refusal.
fn refusal_reason(caps: &Caps, refusal: Refusal) -> String {
    match refusal {
        Refusal::LeaseFull => format!(
            "too many open connections from this sandbox through its egress gateway (limit {} per sandbox)",
            caps.per_lease
        ),
        Refusal::PoolFull => format!(
            "too many open connections through this policy's egress gateway (its {} shared connections are taken, and this sandbox's {} reserved ones)",
            caps.pool, caps.reserved
        ),
    }
}

/// Counts a connection for the reaper while it lives.
struct Open<'a>(&'a Gateway);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
        self.0.touch();
    }
}

/// Proxy decisions since start, by verdict: what the control socket's status answers (runnerd's
/// `GET /metrics`), keyed by the verdict's text.
static DECISIONS: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn count_decision(verdict: Verdict) {
    *DECISIONS.lock().unwrap_or_else(|p| p.into_inner()).entry(verdict.as_str()).or_default() += 1;
}

/// The counts [`count_decision`] kept.
pub fn decisions() -> Vec<(String, u64)> {
    DECISIONS.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

async fn connection(
    mut stream: tokio::net::UnixStream,
    lease: Arc<LeaseState>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    use tokio::io::AsyncWriteExt;
    let started = Instant::now();
    let gateway = &lease.gateway;
    gateway.connections.fetch_add(1, Ordering::SeqCst);
    let _open = Open(gateway);
    let (uid, pid) = match stream.peer_cred() {
        Ok(c) => (c.uid(), c.pid().unwrap_or(0)),
        Err(_) => (u32::MAX, 0),
    };
    if uid != lease.uid {
        count_decision(Verdict::Refused);
        tracing::warn!(event = "egress_peer_refused", gateway = %gateway.identity.short(), revision = %lease.revision, client_uid = uid, client_pid = pid, expected_uid = lease.uid);
        let reason =
            format!("this egress gateway serves only the sandbox it was acquired for, not uid {uid}");
        let _ = stream.write_all(&reply::connect(403, Some(&reason))).await;
        return;
    }
    let _slot = match Taken::take(&lease) {
        Ok(slot) => slot,
        Err(refusal) => {
            let reason = refusal_reason(&gateway.caps, refusal);
            let _ = stream.write_all(&reply::connect(429, Some(&reason))).await;
            count_decision(Verdict::Limited);
            tracing::warn!(event = "egress_decision", gateway = %gateway.identity.short(), revision = %lease.revision, client_pid = pid, decision = Verdict::Limited.as_str(), status = 429u16, reason = %reason);
            return;
        }
    };
    let rec = tokio::select! {
        rec = proxy::serve(stream, &gateway.policy, &lease.route, &shared) => rec,
        _ = stopped.changed() => proxy::Record { decision: Verdict::Failed, reason: "the sandbox's lease on the gateway ended".into(), ..Default::default() },
    };
    if rec.decision == Verdict::NoRequest && rec.status == 0 {
        tracing::debug!(event = "egress_no_request", gateway = %gateway.identity.short(), revision = %lease.revision, client_pid = pid);
        return;
    }
    count_decision(rec.decision);
    tracing::info!(
        event = "egress_decision",
        gateway = %gateway.identity.short(),
        revision = %lease.revision,
        client_pid = pid,
        client_uid = uid,
        method = %rec.method,
        host = %rec.host,
        port = rec.port,
        decision = rec.decision.as_str(),
        reason = %rec.reason,
        address = %rec.address.map(|a| a.to_string()).unwrap_or_default(),
        proxy = %rec.proxy.clone().unwrap_or_default(),
        status = rec.status,
        bytes_up = rec.up,
        bytes_down = rec.down,
        duration_ms = started.elapsed().as_millis() as u64,
    );
}

#[cfg(test)]
mod tests;
