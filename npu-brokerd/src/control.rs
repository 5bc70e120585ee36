//! The control socket: runnerd (and only runnerd's uid, checked with SO_PEERCRED) sends one
//! request per connection and reads one answer.

use std::sync::Arc;
use std::time::Duration;

use common::channel::ChannelError;
use common::channel_async::{read_message, write_message};
use common::npu::{BrokerRequest, BrokerResponse};
use tokio::net::{UnixListener, UnixStream};

use crate::broker::{Broker, Refusal};

/// A request must arrive this soon after connecting.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve(listener: UnixListener, broker: Arc<Broker>, runner_uid: u32) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(stream, broker.clone(), runner_uid));
            }
            Err(e) => {
                tracing::warn!(event = "control_accept_failed", error = %e);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn answer(r: Result<String, Refusal>) -> BrokerResponse {
    match r {
        Ok(body) => BrokerResponse::Json(body),
        Err((failure, message)) => BrokerResponse::Failed { failure, message },
    }
}

async fn connection(mut stream: UnixStream, broker: Arc<Broker>, runner_uid: u32) {
    let (uid, pid) = match stream.peer_cred() {
        Ok(c) => (c.uid(), c.pid().unwrap_or(0)),
        Err(_) => (u32::MAX, 0),
    };
    // Read before refusing: a peer still writing would otherwise see a broken pipe.
    let request = tokio::time::timeout(REQUEST_TIMEOUT, read_message::<BrokerRequest>(&mut stream)).await;
    if uid != runner_uid {
        tracing::warn!(
            event = "control_peer_refused",
            client_uid = uid,
            client_pid = pid,
            expected_uid = runner_uid,
            "a process of another user tried the control socket"
        );
        let reason = format!("npu-brokerd serves only uid {runner_uid} on its control socket, not uid {uid}");
        let _ = write_message(&mut stream, &BrokerResponse::Refused { reason }).await;
        return;
    }
    let request = match request {
        Ok(Ok(r)) => r,
        Ok(Err(ChannelError::Closed)) | Err(_) => return,
        Ok(Err(e)) => {
            let reason = format!("npu-brokerd could not read the request: {}", common::error_chain(&e));
            tracing::warn!(event = "control_request_invalid", client_pid = pid, error = %reason);
            let _ = write_message(&mut stream, &BrokerResponse::Refused { reason }).await;
            return;
        }
    };
    let response = match request {
        BrokerRequest::Status => BrokerResponse::Status(broker.status()),
        BrokerRequest::Submit(s) => answer(broker.submit(s)),
        BrokerRequest::List { session_id } => BrokerResponse::Json(broker.list(&session_id)),
        BrokerRequest::Active => BrokerResponse::Json(broker.active()),
        BrokerRequest::Get { id, session_id } => answer(broker.get(&id, &session_id)),
        BrokerRequest::Logs { id, session_id } => answer(broker.logs(&id, &session_id)),
        BrokerRequest::Result { id, session_id } => answer(broker.result(&id, &session_id)),
        BrokerRequest::Cancel { id, session_id } => answer(broker.cancel(&id, &session_id).await),
    };
    let _ = write_message(&mut stream, &response).await;
}
