//! runnerd's side of npu-brokerd (R-NPU-5): one request per connection over the broker's
//! control socket, with a deadline. runnerd runs no NPU job itself; with the broker off
//! (`SCIENCE_AGENT_NPU_BROKER` unset) it answers as the original does without asking, and
//! with the broker down every NPU route fails with a sentence that says so.

use std::path::PathBuf;
use std::time::Duration;

use common::channel::ChannelError;
use common::channel_async::{read_message, write_message};
use common::npu::{BrokerRequest, BrokerResponse, BrokerStatus};
use tokio::net::UnixStream;

/// `/health` and `/status` wait this long for the broker.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(1);
/// Other requests (a cancel waits for the job's process group to end: up to ~5 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("npu-brokerd is not reachable at {path}")]
    Unreachable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("npu-brokerd at {path} did not answer within {after:?}")]
    Timeout { path: PathBuf, after: Duration },
    #[error("npu-brokerd at {path} answered with something else than the protocol")]
    Protocol {
        path: PathBuf,
        #[source]
        source: ChannelError,
    },
    #[error("npu-brokerd refused runnerd: {0}")]
    Refused(String),
    #[error("npu-brokerd answered an unexpected message")]
    Unexpected,
}

/// Where the broker is, and whether it is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerClient {
    pub enabled: bool,
    pub socket: PathBuf,
}

impl BrokerClient {
    /// One request, one answer, within `timeout`.
    pub async fn request(
        &self,
        req: &BrokerRequest,
        timeout: Duration,
    ) -> Result<BrokerResponse, BrokerError> {
        let path = self.socket.clone();
        let exchange = async {
            let mut stream = UnixStream::connect(&path)
                .await
                .map_err(|source| BrokerError::Unreachable { path: path.clone(), source })?;
            let protocol = |source| BrokerError::Protocol { path: path.clone(), source };
            write_message(&mut stream, req).await.map_err(protocol)?;
            let answer: BrokerResponse = read_message(&mut stream).await.map_err(protocol)?;
            match answer {
                BrokerResponse::Refused { reason } => Err(BrokerError::Refused(reason)),
                other => Ok(other),
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(BrokerError::Timeout { path: self.socket.clone(), after: timeout }))
    }

    /// The broker's status, for `/health`.
    pub async fn status(&self) -> Result<BrokerStatus, BrokerError> {
        match self.request(&BrokerRequest::Status, STATUS_TIMEOUT).await? {
            BrokerResponse::Status(s) => Ok(s),
            _ => Err(BrokerError::Unexpected),
        }
    }
}
