//! The state of a managed execution (contract §3): the record's `state`, stored and
//! answered as its text, the `state` of its `WorkspaceExecution` version, and, once it
//! ended, its audit outcome.

common::named_enum! {
    /// A managed execution's `state`.
    pub enum ManagedState {
        /// Accepted (202), waiting for its workspace and a slot.
        Queued => "queued",
        /// Its sandbox was started.
        Running => "running",
        /// The command exited 0.
        Completed => "completed",
        /// The command exited non-zero, or the run could not start or be recorded.
        Failed => "failed",
        /// The caller (or shutdown) cancelled it.
        Cancelled => "cancelled",
        /// The runner restarted before its end was recorded, or its record is unreadable.
        Unknown => "unknown",
    }
}

impl ManagedState {
    /// Whether the execution has ended: nothing changes its record any more.
    pub fn is_terminal(self) -> bool {
        !matches!(self, ManagedState::Queued | ManagedState::Running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_their_texts_and_only_two_are_live() {
        let texts: Vec<&str> = ManagedState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(texts, ["queued", "running", "completed", "failed", "cancelled", "unknown"]);
        let live: Vec<ManagedState> =
            ManagedState::ALL.iter().copied().filter(|s| !s.is_terminal()).collect();
        assert_eq!(live, [ManagedState::Queued, ManagedState::Running]);
        assert_eq!(serde_json::to_string(&ManagedState::Cancelled).unwrap(), r#""cancelled""#);
        assert_eq!(serde_json::from_str::<ManagedState>(r#""unknown""#).unwrap(), ManagedState::Unknown);
        assert!(serde_json::from_str::<ManagedState>(r#""paused""#).is_err());
    }
}
