//! The runnerd ↔ npu-brokerd protocol (R-NPU-5): framed like every internal channel
//! ([`crate::channel`]), one request and one answer per connection, after npu-brokerd checked
//! the peer's uid with SO_PEERCRED.
//!
//! Job records travel as JSON text: npu-brokerd owns the `NpuJob` shape the HTTP routes
//! answer, and runnerd forwards it unchanged (postcard cannot carry free-form JSON values).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crate::confinement::Confinement;

/// A job submission, after runnerd resolved the workspace (`workspaceRoot` or
/// `runnerWorkspaceKey`) the way it does for executions. npu-brokerd checks it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submission {
    pub session_id: Option<String>,
    pub workload_id: Option<String>,
    pub config_path: Option<String>,
    pub environment_revision_id: Option<String>,
    pub workspace_root: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BrokerRequest {
    /// Liveness, the workload descriptors and the queue, for `/health`.
    Status,
    Submit(Submission),
    /// The session's jobs, as summaries.
    List {
        session_id: String,
    },
    Get {
        id: String,
        session_id: String,
    },
    Logs {
        id: String,
        session_id: String,
    },
    Result {
        id: String,
        session_id: String,
    },
    Cancel {
        id: String,
        session_id: String,
    },
    /// Queued and running jobs of every session, as summaries (for `/status`).
    Active,
}

/// Why a request failed, which runnerd maps to the original's status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Failure {
    /// 400: the request is wrong (and the message says how).
    Invalid,
    /// 404 `NPU job not found`.
    NotFound,
    /// 409 `NPU job is not terminal`.
    NotTerminal,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerStatus {
    pub version: String,
    /// `NpuWorkloadDescriptor[]` as JSON text.
    pub workloads: String,
    /// Where the whitelist came from (a file, or the built-in defaults).
    pub workload_config: String,
    pub queued: u32,
    pub running: u32,
    pub confinement: Confinement,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BrokerResponse {
    Status(BrokerStatus),
    /// The route's JSON body.
    Json(String),
    Failed {
        failure: Failure,
        message: String,
    },
    /// The connection itself was refused (wrong uid, unreadable request).
    Refused {
        reason: String,
    },
}

/// npu-brokerd's default control socket (its unit's RuntimeDirectory).
pub const DEFAULT_SOCKET: &str = "/run/npu-brokerd/control.sock";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{read_message, write_message};

    #[test]
    fn requests_and_answers_round_trip() {
        let sub = Submission {
            session_id: Some("s".into()),
            workload_id: Some("npu.smoke_test".into()),
            config_path: None,
            environment_revision_id: Some("rev-1".into()),
            workspace_root: "/w".into(),
        };
        for req in [BrokerRequest::Status, BrokerRequest::Submit(sub), BrokerRequest::Active] {
            let mut buf = Vec::new();
            write_message(&mut buf, &req).unwrap();
            assert_eq!(read_message::<BrokerRequest>(&mut buf.as_slice()).unwrap(), req);
        }
        let answer = BrokerResponse::Failed { failure: Failure::NotTerminal, message: "x".into() };
        let mut buf = Vec::new();
        write_message(&mut buf, &answer).unwrap();
        assert_eq!(read_message::<BrokerResponse>(&mut buf.as_slice()).unwrap(), answer);
    }
}
