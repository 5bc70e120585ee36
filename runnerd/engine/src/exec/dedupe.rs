//! `executionId` dedupe for the synchronous routes (contract §2A step 5): an in-memory map
//! of ids seen in the last 60 s, keyed by id alone, shared by `/execute` and
//! `/execute-shell`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct RecentIds {
    seen: Mutex<HashMap<String, Instant>>,
}

impl RecentIds {
    /// Records `id` at `now`; `false` if it was seen within the window.
    pub fn record(&self, id: &str, now: Instant) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, at| now.duration_since(*at) < WINDOW);
        if seen.contains_key(id) {
            return false;
        }
        seen.insert(id.to_owned(), now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixty_seconds_then_forgotten() {
        let ids = RecentIds::default();
        let t0 = Instant::now();
        assert!(ids.record("e1", t0));
        assert!(!ids.record("e1", t0 + Duration::from_secs(59)));
        assert!(ids.record("e2", t0 + Duration::from_secs(1)));
        assert!(ids.record("e1", t0 + Duration::from_secs(60)));
    }
}
