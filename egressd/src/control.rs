//! The control socket: runnerd (and only runnerd's uid, checked with SO_PEERCRED) asks
//! for status or for a lease on the gateway of a policy. An acquire's connection stays open
//! while the sandbox runs; its end releases the lease.
//!
//! Only that uid may name the `sandbox_uid` a lease's socket admits: every request of any
//! other peer is refused, whatever it asks.

use std::sync::Arc;
use std::time::Duration;

use common::channel::ChannelError;
use common::channel_async::{read_message, write_message};
use common::egress::protocol::{Confinement, ControlRequest, ControlResponse, EgressStatus};
use tokio::io::AsyncReadExt;
use tokio::net::{UnixListener, UnixStream};

use crate::registry::Registry;

/// A request must arrive this soon after connecting.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Control {
    pub registry: Arc<Registry>,
    pub runner_uid: u32,
    pub confinement: Confinement,
}

impl Control {
    pub fn status(&self) -> EgressStatus {
        let (gateways, open) = self.registry.counts();
        EgressStatus {
            version: crate::version(),
            gateways: gateways as u32,
            open_connections: open as u32,
            confinement: self.confinement.clone(),
            decisions: crate::registry::decisions(),
        }
    }
}

pub async fn serve(listener: UnixListener, control: Arc<Control>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, control.clone()));
            }
            Err(e) => {
                tracing::warn!(event = "control_accept_failed", error = %e);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn connection(mut stream: UnixStream, control: Arc<Control>) {
    let (uid, pid) = match stream.peer_cred() {
        Ok(c) => (c.uid(), c.pid().unwrap_or(0)),
        Err(_) => (u32::MAX, 0),
    };
    // The request is read before a refusal is written: a peer still writing would
    // otherwise see a broken pipe instead of the reason.
    let request = tokio::time::timeout(REQUEST_TIMEOUT, read_message::<ControlRequest>(&mut stream)).await;
    if uid != control.runner_uid {
        tracing::warn!(
            event = "control_peer_refused",
            client_uid = uid,
            client_pid = pid,
            expected_uid = control.runner_uid,
            "a process of another user tried the control socket"
        );
        let refusal = ControlResponse::Refused {
            reason: format!(
                "egressd serves only uid {} on its control socket, not uid {uid}",
                control.runner_uid
            ),
        };
        let _ = write_message(&mut stream, &refusal).await;
        return;
    }
    let request: ControlRequest = match request {
        Ok(Ok(r)) => r,
        Ok(Err(ChannelError::Closed)) => return,
        Ok(Err(e)) => {
            tracing::warn!(event = "control_request_invalid", client_pid = pid, error = %common::error_chain(&e));
            let reason = format!("egressd could not read the request: {}", common::error_chain(&e));
            let _ = write_message(&mut stream, &ControlResponse::Refused { reason }).await;
            return;
        }
        Err(_) => return,
    };
    match request {
        ControlRequest::Status => {
            let _ = write_message(&mut stream, &ControlResponse::Status(control.status())).await;
        }
        ControlRequest::Acquire { policy, route, identity, sandbox_uid } => {
            let lease = match control.registry.acquire(&policy, &identity, route, sandbox_uid) {
                Ok(lease) => lease,
                Err(e) => {
                    tracing::warn!(event = "gateway_refused", gateway = %identity.short(), revision = %policy.revision, reason = %common::error_chain(&e));
                    let _ =
                        write_message(&mut stream, &ControlResponse::Refused { reason: e.to_string() }).await;
                    return;
                }
            };
            let answer = ControlResponse::Gateway { socket_path: lease.socket_path().to_owned() };
            if write_message(&mut stream, &answer).await.is_err() {
                return;
            }
            // Held until runnerd closes (or dies); anything it sends meanwhile is ignored.
            let mut sink = [0u8; 64];
            while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            drop(lease);
        }
    }
}
