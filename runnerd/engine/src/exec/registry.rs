//! The synchronous executions `/status` lists (`activeExecutions`): queued and running
//! `/execute` and `/execute-shell` calls; an entry leaves when its call ends for any reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

common::named_enum! {
    /// Where an active synchronous execution is (`activeExecutions[].status`).
    pub enum Status {
        /// Waiting for its place (queue, session and workspace slots, the writer lease).
        Queued => "queued",
        /// Its sandbox was started.
        Running => "running",
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ActiveExecution {
    pub agent_id: String,
    pub execution_id: String,
    pub kernel_mode: &'static str,
    pub language: &'static str,
    pub queued_at: String,
    pub session_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    pub status: Status,
}

#[derive(Debug, Default)]
pub struct Registry {
    entries: Arc<Mutex<Vec<(u64, ActiveExecution)>>>,
    next: AtomicU64,
}

/// Removes its entry when dropped.
#[derive(Debug)]
pub struct Registration {
    id: u64,
    entries: Arc<Mutex<Vec<(u64, ActiveExecution)>>>,
}

impl Registry {
    pub fn register(&self, entry: ActiveExecution) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).push((id, entry));
        Registration { id, entries: self.entries.clone() }
    }

    pub fn snapshot(&self) -> Vec<ActiveExecution> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(_, e)| e.clone()).collect()
    }
}

impl Registration {
    pub fn running(&self, started_at: String) {
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, e)) = entries.iter_mut().find(|(id, _)| *id == self.id) {
            e.status = Status::Running;
            e.started_at = Some(started_at);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_and_go() {
        let r = Registry::default();
        let entry = ActiveExecution {
            agent_id: "main".into(),
            execution_id: "e1".into(),
            kernel_mode: "ephemeral",
            language: "shell",
            queued_at: "t".into(),
            session_id: "s".into(),
            started_at: None,
            status: Status::Queued,
        };
        let reg = r.register(entry.clone());
        let json = serde_json::to_value(r.snapshot()).unwrap();
        assert_eq!(json[0]["status"], "queued");
        assert!(json[0].get("startedAt").is_none());
        reg.running("t2".into());
        assert_eq!(r.snapshot()[0].started_at.as_deref(), Some("t2"));
        assert_eq!(serde_json::to_value(r.snapshot()).unwrap()[0]["status"], "running");
        drop(reg);
        assert!(r.snapshot().is_empty());
    }
}
