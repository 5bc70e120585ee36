//! One stop token per execution: whoever ends a run early (the caller gone or cancelling,
//! runnerd stopping, the workspace over its quota) stops it here, and everything that
//! waits (the queues, the writer lease, the launcher) waits on it. The first reason wins.

use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::measure::Breach;

/// Why a run was stopped from outside the sandbox.
#[derive(Debug)]
pub enum StopReason {
    /// The caller: a disconnected client, the cancel route, or runnerd shutting down.
    Caller,
    /// The workspace outgrew its quota during the run.
    Quota(Breach),
}

#[derive(Debug, Clone)]
pub struct StopToken {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    stopped: watch::Sender<bool>,
    reason: Mutex<Option<StopReason>>,
}

impl Default for StopToken {
    fn default() -> Self {
        StopToken::new()
    }
}

impl StopToken {
    pub fn new() -> StopToken {
        StopToken { inner: Arc::new(Inner { stopped: watch::Sender::new(false), reason: Mutex::new(None) }) }
    }

    /// Stops the run; `false` when it was stopped already (the first reason is kept).
    pub fn stop(&self, why: StopReason) -> bool {
        {
            let mut reason = self.inner.reason.lock().unwrap_or_else(|p| p.into_inner());
            if reason.is_some() {
                return false;
            }
            *reason = Some(why);
        }
        self.inner.stopped.send_replace(true);
        true
    }

    pub fn is_stopped(&self) -> bool {
        *self.inner.stopped.borrow()
    }

    /// Whether the caller (not the quota) stopped the run.
    pub fn stopped_by_caller(&self) -> bool {
        matches!(*self.inner.reason.lock().unwrap_or_else(|p| p.into_inner()), Some(StopReason::Caller))
    }

    /// The quota breach that stopped the run, if that was the reason (taken once).
    pub fn take_breach(&self) -> Option<Breach> {
        let mut reason = self.inner.reason.lock().unwrap_or_else(|p| p.into_inner());
        match reason.take() {
            Some(StopReason::Quota(b)) => Some(b),
            other => {
                *reason = other;
                None
            }
        }
    }

    /// A receiver that turns `true` when the run is stopped, for the waits below the engine
    /// (the writer lease, the launcher) that take a `watch` receiver.
    pub fn watch(&self) -> watch::Receiver<bool> {
        self.inner.stopped.subscribe()
    }

    /// Completes once the run is stopped.
    pub async fn stopped(&self) {
        let mut rx = self.inner.stopped.subscribe();
        // The sender lives as long as `self`: `wait_for` cannot fail while we wait.
        let _ = rx.wait_for(|s| *s).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn first_reason_wins_and_waiters_wake() {
        let token = StopToken::new();
        assert!(!token.is_stopped());
        let waiter = tokio::spawn({
            let t = token.clone();
            async move { t.stopped().await }
        });
        assert!(token.stop(StopReason::Quota(Breach::Over { bytes: 9 })));
        assert!(!token.stop(StopReason::Caller), "a second stop keeps the first reason");
        waiter.await.unwrap();
        assert!(token.is_stopped() && !token.stopped_by_caller());
        assert!(matches!(token.take_breach(), Some(Breach::Over { bytes: 9 })));
        // Stopped already: `stopped` completes at once.
        token.stopped().await;

        let caller = StopToken::new();
        caller.stop(StopReason::Caller);
        assert!(caller.stopped_by_caller());
        assert!(caller.take_breach().is_none());
        assert!(caller.stopped_by_caller(), "taking a breach leaves another reason in place");
    }
}
