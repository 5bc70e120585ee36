//! runnerd's side of egressd (R-NET-2, R-NET-3): asks for a lease on the gateway of a
//! request's policy over egressd's control socket and holds it while the sandbox runs.
//! runnerd never proxies a byte itself; a domain-allowlist run without a reachable egressd
//! or bridge fails closed before anything starts.
//!
//! The gateway is named by the policy's content ([`PolicyIdentity`], R-NET-4), derived here
//! from the normalised allowlist: the caller's `networkAccess.revision` is echoed in the
//! result and logged, but selects nothing, so no tenant can occupy another's revision. The
//! lease's socket is this sandbox's alone, and admits only the uid it runs as.

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::channel::ChannelError;
use common::channel_async::{read_message, write_message};
use common::egress::PolicyIdentity;
use common::egress::protocol::{ControlRequest, ControlResponse, EgressStatus, GatewayPolicy};
use common::egress::route::ProxySetting;
use tokio::net::UnixStream;

/// `/health` waits this long for egressd.
const STATUS_TIMEOUT: Duration = Duration::from_secs(1);
/// An acquire (which may create the gateway) waits this long.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The default control socket, the same as egressd's own default.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/egressd/control.sock";

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("egressd is not reachable at {path}")]
    Unreachable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("egressd at {path} did not answer within {after:?}")]
    Timeout { path: PathBuf, after: Duration },
    #[error("egressd at {path} answered with something else than the protocol")]
    Protocol {
        path: PathBuf,
        #[source]
        source: ChannelError,
    },
    #[error("egressd refused: {0}")]
    Refused(String),
    #[error("egressd answered an unexpected message")]
    Unexpected,
    #[error("egressd named {path} as the gateway, which runnerd refuses to mount: {why}")]
    BadGateway { path: PathBuf, why: String },
    #[error(
        "the egress bridge was not found at {0}; install it next to runnerd or set SCIENCE_AGENT_EGRESS_BRIDGE_PATH"
    )]
    BridgeMissing(PathBuf),
}

/// Where egressd and the bridge are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressClient {
    pub control_socket: PathBuf,
    pub bridge: PathBuf,
}

/// A gateway lease held for one sandbox: bind `socket_fd` (the socket at `socket`, opened
/// and checked by runnerd) into it; dropping this releases it.
#[derive(Debug)]
pub struct EgressLease {
    pub socket: PathBuf,
    pub socket_fd: std::os::fd::OwnedFd,
    /// The gateway's identity: the normalised policy's, whatever revision the caller named.
    pub identity: PolicyIdentity,
    _connection: UnixStream,
}

/// A lease socket's name: 16 lowercase hex digits (internals §3.2's shape).
fn is_lease_socket_name(name: &str) -> bool {
    name.len() == 16 && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Opens what egressd named, without following a symlink, and checks it is a socket with a
/// lease socket's name. egressd runs as another user; if it were compromised, an unchecked
/// path would let it choose what runnerd mounts into a sandbox (its data directory, say).
pub fn open_gateway(path: &Path) -> Result<std::os::fd::OwnedFd, EgressError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let bad = |why: &str| EgressError::BadGateway { path: path.to_owned(), why: why.to_owned() };
    if !path.file_name().and_then(|n| n.to_str()).is_some_and(is_lease_socket_name) {
        return Err(bad("its name is not a lease socket's (16 lowercase hex digits)"));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| bad(&format!("it cannot be opened ({e})")))?;
    let meta = file.metadata().map_err(|e| bad(&format!("it cannot be inspected ({e})")))?;
    if !meta.file_type().is_socket() {
        return Err(bad("it is not a socket"));
    }
    Ok(file.into())
}

/// The bridge next to the running executable (a cargo build, or the package's libexec
/// directory), unless configured.
pub fn locate_bridge(configured: Option<PathBuf>) -> PathBuf {
    crate::startup::locate_helper(configured, "egress-bridge")
}

impl EgressClient {
    async fn ask(
        &self,
        request: &ControlRequest,
        timeout: Duration,
    ) -> Result<(ControlResponse, UnixStream), EgressError> {
        let path = &self.control_socket;
        let exchange = async {
            let mut stream = UnixStream::connect(path)
                .await
                .map_err(|source| EgressError::Unreachable { path: path.clone(), source })?;
            let protocol = |source| EgressError::Protocol { path: path.clone(), source };
            write_message(&mut stream, request).await.map_err(protocol)?;
            let answer: ControlResponse = read_message(&mut stream).await.map_err(protocol)?;
            Ok((answer, stream))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| EgressError::Timeout { path: path.clone(), after: timeout })?
    }

    /// egressd's self-description, or why it cannot be reached.
    pub async fn status(&self) -> Result<EgressStatus, EgressError> {
        match self.ask(&ControlRequest::Status, STATUS_TIMEOUT).await?.0 {
            ControlResponse::Status(s) => Ok(s),
            ControlResponse::Refused { reason } => Err(EgressError::Refused(reason)),
            ControlResponse::Gateway { .. } => Err(EgressError::Unexpected),
        }
    }

    /// The bridge exists and is a file.
    pub fn bridge_ready(&self) -> Result<&Path, EgressError> {
        match std::fs::metadata(&self.bridge) {
            Ok(m) if m.is_file() => Ok(&self.bridge),
            _ => Err(EgressError::BridgeMissing(self.bridge.clone())),
        }
    }

    /// A lease on the gateway of `policy` for a sandbox that runs as host uid `sandbox_uid`
    /// (the only uid its socket admits), held until the lease is dropped.
    pub async fn acquire(
        &self,
        policy: GatewayPolicy,
        route: ProxySetting,
        sandbox_uid: u32,
    ) -> Result<EgressLease, EgressError> {
        self.bridge_ready()?;
        let identity = policy.identity();
        let request = ControlRequest::Acquire { policy, route, identity: identity.clone(), sandbox_uid };
        let (answer, stream) = self.ask(&request, ACQUIRE_TIMEOUT).await?;
        match answer {
            ControlResponse::Gateway { socket_path } => {
                let socket_fd = open_gateway(&socket_path)?;
                Ok(EgressLease { socket: socket_path, socket_fd, identity, _connection: stream })
            }
            ControlResponse::Refused { reason } => Err(EgressError::Refused(reason)),
            ControlResponse::Status(_) => Err(EgressError::Unexpected),
        }
    }
}

/// The request's `sandboxEgressProxy` (`{mode:"direct"|"environment"|"url", url?}`); absent
/// means direct. `environment` means the runner's own proxy variables, as in the original:
/// they are captured here and sent along, since egressd runs with an environment of its own.
pub fn proxy_setting(value: Option<&serde_json::Value>) -> Result<ProxySetting, String> {
    let Some(v) = value.filter(|v| !v.is_null()) else { return Ok(ProxySetting::Direct) };
    match v.get("mode").and_then(serde_json::Value::as_str) {
        Some("direct") => Ok(ProxySetting::Direct),
        Some("environment") => Ok(ProxySetting::capture_environment(|k| std::env::var(k).ok())),
        Some("url") => match v.get("url").and_then(serde_json::Value::as_str) {
            Some(url) if !url.trim().is_empty() => Ok(ProxySetting::Url(url.to_owned())),
            _ => Err("sandboxEgressProxy mode \"url\" needs a url".into()),
        },
        _ => Err("sandboxEgressProxy.mode must be \"direct\", \"environment\" or \"url\"".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn proxy_settings_from_requests() {
        assert_eq!(proxy_setting(None), Ok(ProxySetting::Direct));
        assert_eq!(proxy_setting(Some(&json!(null))), Ok(ProxySetting::Direct));
        assert_eq!(proxy_setting(Some(&json!({"mode": "direct"}))), Ok(ProxySetting::Direct));
        assert_eq!(
            proxy_setting(Some(&json!({"mode": "url", "url": "http://proxy:3128"}))),
            Ok(ProxySetting::Url("http://proxy:3128".into()))
        );
        assert!(matches!(
            proxy_setting(Some(&json!({"mode": "environment"}))),
            Ok(ProxySetting::Environment(_))
        ));
        assert!(proxy_setting(Some(&json!({"mode": "url"}))).is_err());
        assert!(proxy_setting(Some(&json!({"mode": "socks"}))).is_err());
    }

    #[test]
    fn lease_socket_names() {
        for (name, ok) in [
            ("0123456789abcdef", true),
            ("fedcba9876543210", true),
            ("0123456789ABCDEF", false),
            ("0123456789abcde", false),
            ("0123456789abcdef0", false),
            ("0123456789abcdeg", false),
            ("..", false),
            ("", false),
        ] {
            assert_eq!(is_lease_socket_name(name), ok, "{name:?}");
        }
    }

    #[test]
    fn only_a_lease_socket_is_accepted_as_a_gateway() {
        let dir = tempfile::tempdir().unwrap();
        let name = "0123456789abcdef";
        let socket = dir.path().join(name);
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert!(open_gateway(&socket).is_ok());
        // A socket under another name, a directory, a symlink to a socket, a regular file.
        let other = dir.path().join("control.sock");
        let _other = std::os::unix::net::UnixListener::bind(&other).unwrap();
        assert!(open_gateway(&other).unwrap_err().to_string().contains("not a lease socket's"));
        let dir_named = dir.path().join("d");
        std::fs::create_dir(&dir_named).unwrap();
        let as_dir = dir_named.join(name);
        std::fs::create_dir(&as_dir).unwrap();
        assert!(open_gateway(&as_dir).unwrap_err().to_string().contains("not a socket"));
        let link_dir = dir.path().join("l");
        std::fs::create_dir(&link_dir).unwrap();
        std::os::unix::fs::symlink(&socket, link_dir.join(name)).unwrap();
        // O_PATH|O_NOFOLLOW opens the link itself, which is not a socket.
        assert!(open_gateway(&link_dir.join(name)).unwrap_err().to_string().contains("not a socket"));
        let file_dir = dir.path().join("f");
        std::fs::create_dir(&file_dir).unwrap();
        std::fs::write(file_dir.join(name), b"x").unwrap();
        assert!(open_gateway(&file_dir.join(name)).unwrap_err().to_string().contains("not a socket"));
    }

    #[tokio::test]
    async fn an_absent_egressd_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let client =
            EgressClient { control_socket: dir.path().join("none.sock"), bridge: dir.path().join("bridge") };
        let err = client.status().await.unwrap_err().to_string();
        assert!(err.contains("egressd is not reachable at") && err.contains("none.sock"), "{err}");
        let policy = GatewayPolicy {
            revision: "r".into(),
            allowed_domains: vec![],
            allow_private_network: false,
            pinned_origins: vec![],
        };
        let err = client.acquire(policy, ProxySetting::Direct, 1000).await.unwrap_err().to_string();
        assert!(err.contains("egress bridge was not found"), "{err}");
    }
}
