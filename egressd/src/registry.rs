//! One gateway per policy revision (R-NET-3, internals §3.2): a Unix socket named
//! `<runtime dir>/eg/<16 hex of sha256(revision)>`, created on first acquire, reused by every
//! sandbox with the same revision, and reaped when no lease and no connection has used it
//! for a while.
//!
//! The socket path is the policy's identity (a sandbox reaches exactly the gateway bound
//! into it), so a revision that comes back with a *different* policy is refused rather than
//! silently served by the old one. Only the uids that acquired a gateway may connect to it
//! (SO_PEERCRED), on top of the socket's file mode.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use common::egress::allowlist::Allowlist;
use common::egress::protocol::GatewayPolicy;
use common::egress::route::ProxySetting;
use sha2::{Digest, Sha256};
use tokio::net::UnixListener;
use tokio::sync::{Semaphore, watch};

use crate::proxy::decide::Policy;
use crate::proxy::{self, Shared, reply};

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
    #[error("the revision is empty; a domain-allowlist policy needs its content-derived revision")]
    EmptyRevision,
    #[error(
        "revision {revision:?} is already served with a different policy (allowed domains or private network access differ); a revision must identify one policy"
    )]
    PolicyMismatch { revision: String },
    #[error(
        "revision {revision:?} would use the same socket name as the live revision {other:?} (their sha256 share 64 bits); retry once that gateway is reaped"
    )]
    NameCollision { revision: String, other: String },
    #[error("could not create the gateway directory {path}")]
    Directory {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not listen on the gateway socket {path}")]
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

/// `<runtime dir>/eg/<first 16 hex of sha256(revision)>`, whatever the revision contains.
pub fn socket_path(runtime_dir: &Path, revision: &str) -> PathBuf {
    let digest = Sha256::digest(revision.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    runtime_dir.join("eg").join(hex)
}

/// Refuses a runtime directory whose gateway sockets could not be bound.
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

/// The most connections a gateway admits at once, whatever is configured (tokio's
/// semaphore has a hard ceiling far above; this is a sane one).
pub const MAX_TUNNELS: usize = 65_536;

/// How gateway sockets are made reachable by the sandbox user and nobody else.
#[derive(Debug, Clone, Copy)]
pub struct SocketAccess {
    /// `Some(gid)`: mode 0660 and this group (runnerd's user is a member); `None`: 0600.
    pub group: Option<u32>,
}

impl SocketAccess {
    /// Applies the mode (and group) to a socket or directory egressd created.
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
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)
    }
}

/// One revision's gateway.
#[derive(Debug)]
pub struct Gateway {
    pub revision: String,
    pub path: PathBuf,
    policy: Policy,
    normalized: (Vec<String>, bool),
    route: RwLock<ProxySetting>,
    allowed_uids: RwLock<HashSet<u32>>,
    leases: AtomicUsize,
    connections: AtomicUsize,
    last_used: Mutex<Instant>,
    tunnels: Arc<Semaphore>,
    max_tunnels: usize,
    /// Open connections per client process (a sandbox's bridge): one sandbox may hold at
    /// most half the gateway's connections, so it cannot lock the others of its revision out.
    per_peer: Mutex<HashMap<i32, usize>>,
    stop: watch::Sender<bool>,
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

/// Held while a sandbox may use the gateway (the control connection stays open meanwhile).
#[derive(Debug)]
pub struct Lease {
    gateway: Arc<Gateway>,
}

impl Lease {
    pub fn socket_path(&self) -> &Path {
        &self.gateway.path
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.gateway.leases.fetch_sub(1, Ordering::SeqCst);
        self.gateway.touch();
    }
}

#[derive(Debug)]
pub struct Registry {
    runtime_dir: PathBuf,
    access: SocketAccess,
    max_tunnels: usize,
    shared: Arc<Shared>,
    gateways: Mutex<HashMap<String, Arc<Gateway>>>,
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
        let max_tunnels = max_tunnels.clamp(1, MAX_TUNNELS);
        let dir = runtime_dir.join("eg");
        std::fs::create_dir_all(&dir)
            .map_err(|source| RegistryError::Directory { path: dir.clone(), source })?;
        access.apply(&dir, true)?;
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(Registry { runtime_dir, access, max_tunnels, shared, gateways: Mutex::default() })
    }

    pub fn gateway_dir(&self) -> PathBuf {
        self.runtime_dir.join("eg")
    }

    /// Counts for the status answer: gateways, open connections.
    pub fn counts(&self) -> (usize, usize) {
        let map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        (map.len(), map.values().map(|g| g.connections.load(Ordering::SeqCst)).sum())
    }

    /// The gateway of `policy.revision`, created on first use, for a sandbox of `uid`.
    pub fn acquire(
        &self,
        policy: &GatewayPolicy,
        route: ProxySetting,
        uid: u32,
    ) -> Result<Lease, RegistryError> {
        if policy.revision.is_empty() {
            return Err(RegistryError::EmptyRevision);
        }
        let (allowlist, rejected) = Allowlist::parse(&policy.allowed_domains);
        for e in &rejected {
            tracing::warn!(event = "allowlist_entry_skipped", revision = %policy.revision, reason = %e);
        }
        let normalized = (allowlist.normalized(), policy.allow_private_network);
        let mut map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        let gateway = match map.get(&policy.revision) {
            Some(g) if g.normalized != normalized => {
                return Err(RegistryError::PolicyMismatch { revision: policy.revision.clone() });
            }
            Some(g) => g.clone(),
            None => {
                // Two revisions whose names share the 64-bit prefix: never hand one's
                // sandboxes the other's socket (and policy).
                let path = socket_path(&self.runtime_dir, &policy.revision);
                if let Some(other) = map.values().find(|g| g.path == path) {
                    return Err(RegistryError::NameCollision {
                        revision: policy.revision.clone(),
                        other: other.revision.clone(),
                    });
                }
                let g = self.create(policy, allowlist, normalized, route.clone())?;
                map.insert(policy.revision.clone(), g.clone());
                g
            }
        };
        *gateway.route.write().unwrap_or_else(|p| p.into_inner()) = route;
        gateway.allowed_uids.write().unwrap_or_else(|p| p.into_inner()).insert(uid);
        gateway.leases.fetch_add(1, Ordering::SeqCst);
        gateway.touch();
        Ok(Lease { gateway })
    }

    fn create(
        &self,
        policy: &GatewayPolicy,
        allowlist: Allowlist,
        normalized: (Vec<String>, bool),
        route: ProxySetting,
    ) -> Result<Arc<Gateway>, RegistryError> {
        let path = socket_path(&self.runtime_dir, &policy.revision);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .map_err(|source| RegistryError::Listen { path: path.clone(), source })?;
        if let Err(e) = self.access.apply(&path, false) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        let (stop, stopped) = watch::channel(false);
        let gateway = Arc::new(Gateway {
            revision: policy.revision.clone(),
            path: path.clone(),
            policy: Policy {
                revision: policy.revision.clone(),
                allowlist,
                allow_private_network: policy.allow_private_network,
            },
            normalized,
            route: RwLock::new(route),
            allowed_uids: RwLock::default(),
            leases: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            last_used: Mutex::new(Instant::now()),
            tunnels: Arc::new(Semaphore::new(self.max_tunnels)),
            max_tunnels: self.max_tunnels,
            per_peer: Mutex::default(),
            stop,
        });
        tracing::info!(
            event = "gateway_created",
            revision = %policy.revision,
            socket = %path.display(),
            allowed_domains = %gateway.normalized.0.join(","),
            allow_private_network = policy.allow_private_network,
        );
        tokio::spawn(accept_loop(listener, gateway.clone(), self.shared.clone(), stopped));
        Ok(gateway)
    }

    /// Closes gateways idle (no lease, no connection) for at least `idle`.
    pub fn reap(&self, idle: Duration) -> usize {
        let mut map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        let stale: Vec<String> = map
            .iter()
            .filter(|(_, g)| g.idle_for().is_some_and(|d| d >= idle))
            .map(|(k, _)| k.clone())
            .collect();
        for revision in &stale {
            if let Some(g) = map.remove(revision) {
                let _ = g.stop.send(true);
                let _ = std::fs::remove_file(&g.path);
                tracing::info!(event = "gateway_reaped", revision = %revision, socket = %g.path.display());
            }
        }
        stale.len()
    }

    /// Closes every gateway (shutdown).
    pub fn close_all(&self) {
        let mut map = self.gateways.lock().unwrap_or_else(|p| p.into_inner());
        for (_, g) in map.drain() {
            let _ = g.stop.send(true);
            let _ = std::fs::remove_file(&g.path);
        }
    }
}

async fn accept_loop(
    listener: UnixListener,
    gateway: Arc<Gateway>,
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
                tracing::warn!(event = "gateway_accept_failed", revision = %gateway.revision, error = %e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        tokio::spawn(connection(stream, gateway.clone(), shared.clone(), stopped.clone()));
    }
}

/// One connection of one client process, counted while it lives.
struct PeerSlot<'a> {
    gateway: &'a Gateway,
    pid: i32,
}

impl<'a> PeerSlot<'a> {
    fn limit(gateway: &Gateway) -> usize {
        (gateway.max_tunnels / 2).max(1)
    }

    fn take(gateway: &'a Gateway, pid: i32) -> Option<PeerSlot<'a>> {
        let mut map = gateway.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        let count = map.entry(pid).or_insert(0);
        if *count >= Self::limit(gateway) {
            return None;
        }
        *count += 1;
        Some(PeerSlot { gateway, pid })
    }
}

impl Drop for PeerSlot<'_> {
    fn drop(&mut self) {
        let mut map = self.gateway.per_peer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = map.get_mut(&self.pid) {
            *count -= 1;
            if *count == 0 {
                map.remove(&self.pid);
            }
        }
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

async fn connection(
    mut stream: tokio::net::UnixStream,
    gateway: Arc<Gateway>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    use tokio::io::AsyncWriteExt;
    let started = Instant::now();
    gateway.connections.fetch_add(1, Ordering::SeqCst);
    let _open = Open(&gateway);
    let (uid, pid) = match stream.peer_cred() {
        Ok(c) => (c.uid(), c.pid().unwrap_or(0)),
        Err(_) => (u32::MAX, 0),
    };
    let permitted = gateway.allowed_uids.read().unwrap_or_else(|p| p.into_inner()).contains(&uid);
    if !permitted {
        tracing::warn!(event = "egress_peer_refused", revision = %gateway.revision, client_uid = uid, client_pid = pid);
        let reason =
            format!("this egress gateway serves only the sandboxes it was acquired for, not uid {uid}");
        let _ = stream.write_all(&reply::connect(403, Some(&reason))).await;
        return;
    }
    let Some(_peer_slot) = PeerSlot::take(&gateway, pid) else {
        let reason = format!(
            "too many open connections from this sandbox through its egress gateway (limit {} per sandbox)",
            PeerSlot::limit(&gateway)
        );
        let _ = stream.write_all(&reply::connect(429, Some(&reason))).await;
        tracing::warn!(event = "egress_decision", revision = %gateway.revision, client_pid = pid, decision = "limited", status = 429u16, reason = %reason);
        return;
    };
    let Ok(_permit) = gateway.tunnels.clone().try_acquire_owned() else {
        let reason = format!(
            "too many open connections through this sandbox's egress gateway (limit {})",
            gateway.max_tunnels
        );
        let _ = stream.write_all(&reply::connect(429, Some(&reason))).await;
        tracing::warn!(event = "egress_decision", revision = %gateway.revision, client_pid = pid, decision = "limited", status = 429u16, reason = %reason);
        return;
    };
    let setting = gateway.route.read().unwrap_or_else(|p| p.into_inner()).clone();
    let rec = tokio::select! {
        rec = proxy::serve(stream, &gateway.policy, &setting, &shared) => rec,
        _ = stopped.changed() => proxy::Record { decision: "failed", reason: "egressd closed the gateway".into(), ..Default::default() },
    };
    if rec.decision == "no_request" && rec.status == 0 {
        tracing::debug!(event = "egress_no_request", revision = %gateway.revision, client_pid = pid);
        return;
    }
    tracing::info!(
        event = "egress_decision",
        revision = %gateway.revision,
        client_pid = pid,
        client_uid = uid,
        method = %rec.method,
        host = %rec.host,
        port = rec.port,
        decision = rec.decision,
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
mod tests {
    use super::*;

    #[test]
    fn socket_names_are_16_hex_under_eg_whatever_the_revision() {
        let dir = Path::new("/run/egressd");
        for revision in ["test-revision", "../../escape", &"x".repeat(4000), ""] {
            let p = socket_path(dir, revision);
            assert_eq!(p.parent(), Some(Path::new("/run/egressd/eg")));
            let name = p.file_name().unwrap().to_str().unwrap();
            assert!(
                name.len() == 16 && name.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                "{name}"
            );
        }
        assert_ne!(socket_path(dir, "a"), socket_path(dir, "b"));
    }

    #[test]
    fn the_longest_runtime_dir_fits_exactly_and_one_byte_more_is_refused() {
        let fits = format!("/{}", "d".repeat(MAX_UNIX_SOCKET_PATH_BYTES - EGRESS_SOCKET_RELATIVE_BYTES - 1));
        let fits = Path::new(&fits);
        assert_eq!(socket_path(fits, "r").as_os_str().len(), MAX_UNIX_SOCKET_PATH_BYTES);
        check_path_length(fits).unwrap();
        let over = format!("{}d", fits.display());
        let err = check_path_length(Path::new(&over)).unwrap_err().to_string();
        assert!(err.contains("108 bytes"), "{err}");
        assert!(err.contains("107-byte Unix socket path limit"), "{err}");
        assert!(err.contains("shorten that directory by at least 1 byte"), "{err}");
    }

    fn shared() -> Arc<Shared> {
        #[derive(Debug)]
        struct Nowhere;
        impl crate::dns::Resolve for Nowhere {
            fn lookup<'a>(&'a self, name: &'a str) -> crate::dns::LookupFuture<'a> {
                Box::pin(async move { Err(crate::dns::ResolveError::NoSuchName(name.to_owned())) })
            }
        }
        Arc::new(Shared {
            resolver: Arc::new(Nowhere),
            own: crate::own::OwnAddresses::fixed(Vec::new()),
            header_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
            dns_timeout: Duration::from_secs(1),
            tunnel_idle: Duration::from_secs(5),
        })
    }

    fn policy(revision: &str, domains: &[&str]) -> GatewayPolicy {
        GatewayPolicy {
            revision: revision.into(),
            allowed_domains: domains.iter().map(|d| d.to_string()).collect(),
            allow_private_network: false,
        }
    }

    async fn answer(path: &Path, request: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
        let _ = s.write_all(request).await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn gateways_are_reused_per_revision_private_to_their_users_capped_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(dir.path().to_owned(), SocketAccess { group: None }, 2, shared()).unwrap();
        let me = nix::unistd::getuid().as_raw();
        let a = reg.acquire(&policy("r1", &["a.example"]), ProxySetting::Direct, me).unwrap();
        let b = reg.acquire(&policy("r1", &["A.example."]), ProxySetting::Direct, me).unwrap();
        assert_eq!(a.socket_path(), b.socket_path(), "same revision, same normalised policy: one gateway");
        let mode = std::fs::metadata(a.socket_path()).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let err = reg.acquire(&policy("r1", &["b.example"]), ProxySetting::Direct, me).unwrap_err();
        assert!(err.to_string().contains("already served with a different policy"), "{err}");
        assert!(matches!(
            reg.acquire(&policy("", &[]), ProxySetting::Direct, me),
            Err(RegistryError::EmptyRevision)
        ));

        // The gateway answers its users.
        let text = answer(a.socket_path(), b"CONNECT other.example:443 HTTP/1.1\r\n\r\n").await;
        assert!(text.starts_with("HTTP/1.1 403 Forbidden"), "{text}");

        // Cap 2, so 1 per sandbox: our second connection gets 429 while the first is open,
        // and another process (another sandbox's bridge) still gets through.
        let held = tokio::net::UnixStream::connect(a.socket_path()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let text = answer(a.socket_path(), b"CONNECT a.example:443 HTTP/1.1\r\n\r\n").await;
        assert!(
            text.starts_with("HTTP/1.1 429 Too Many Requests") && text.contains("Retry-After: 1"),
            "{text}"
        );
        assert!(text.contains("limit 1 per sandbox"), "{text}");
        let other = tokio::process::Command::new("python3")
            .args(["-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'CONNECT other.example:443 HTTP/1.1\\r\\n\\r\\n'); print(s.recv(200).decode().splitlines()[0])"])
            .arg(a.socket_path())
            .output()
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&other.stdout).trim(), "HTTP/1.1 403 Forbidden", "{other:?}");
        drop(held);

        // Leased: not reaped, however idle.
        assert_eq!(reg.reap(Duration::ZERO), 0);
        drop((a, b));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(reg.reap(Duration::from_secs(3600)), 0, "not idle long enough");
        assert_eq!(reg.reap(Duration::ZERO), 1);
        assert_eq!(std::fs::read_dir(reg.gateway_dir()).unwrap().count(), 0, "the socket is removed");
        assert_eq!(reg.counts(), (0, 0));
    }

    #[tokio::test]
    async fn a_gateway_refuses_uids_that_did_not_acquire_it() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(dir.path().to_owned(), SocketAccess { group: None }, 8, shared()).unwrap();
        let stranger = nix::unistd::getuid().as_raw().wrapping_add(1);
        let lease = reg.acquire(&policy("r2", &["a.example"]), ProxySetting::Direct, stranger).unwrap();
        let text = answer(lease.socket_path(), b"CONNECT a.example:443 HTTP/1.1\r\n\r\n").await;
        assert!(
            text.starts_with("HTTP/1.1 403")
                && text.contains("serves only the sandboxes it was acquired for"),
            "a peer of another uid is refused, even for an allowed name: {text}"
        );
    }

    #[tokio::test]
    async fn stale_sockets_of_a_previous_run_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("eg")).unwrap();
        let stale = dir.path().join("eg/0123456789abcdef");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let _reg = Registry::new(dir.path().to_owned(), SocketAccess { group: None }, 8, shared()).unwrap();
        assert!(!stale.exists());
    }
}
