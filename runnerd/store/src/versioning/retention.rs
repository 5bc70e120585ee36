//! Which versions a workspace's history keeps (issue #32): a pure rule over the history
//! rows, so the collector can be told it in a table.
//!
//! A version is removed only once it is **both** beyond the newest `keep_versions` of its
//! head **and** older than `keep_days` — a quiet workspace keeps its last versions however
//! old, a busy one keeps its recent days however many — and never while it is the head or
//! a managed execution names it (an export is a head of its own). `0` in either keeps
//! every version. Under disk pressure the days no longer keep anything: a version beyond
//! the newest `keep_versions` goes however recent (a tenant rewriting its quota every run
//! would otherwise fill the disk within the days).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

/// The operator's retention (`history_keep_versions`, `history_keep_days`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub keep_versions: u64,
    pub keep_days: u64,
    /// The disk is short: only the count keeps versions.
    pub pressed: bool,
}

impl Retention {
    /// Whether this retention ever removes a version.
    pub fn prunes(&self) -> bool {
        self.keep_versions > 0 && self.keep_days > 0
    }
}

/// One version as the rule sees it: its history row, head, target and when it was made
/// (`None` when its record cannot be found: it is as old as can be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version<'a> {
    pub id: i64,
    pub name: &'a str,
    /// The target's identity (its JCS text).
    pub target: &'a str,
    pub created: Option<SystemTime>,
}

/// The history rows to remove. `heads`: each head's current target; `named`: the targets
/// a managed execution names.
pub fn pruned(
    versions: &[Version<'_>],
    heads: &HashMap<&str, &str>,
    named: &HashSet<&str>,
    retention: Retention,
    now: SystemTime,
) -> Vec<i64> {
    if !retention.prunes() {
        return Vec::new();
    }
    let max_age = Duration::from_secs(retention.keep_days.saturating_mul(86_400));
    let mut by_name: HashMap<&str, Vec<&Version<'_>>> = HashMap::new();
    for v in versions {
        by_name.entry(v.name).or_default().push(v);
    }
    let mut out = Vec::new();
    for (name, mut rows) in by_name {
        // Newest first: the first `keep_versions` are kept by count.
        rows.sort_by_key(|v| std::cmp::Reverse(v.id));
        for (i, v) in rows.iter().enumerate() {
            let recent = !retention.pressed
                && v.created.is_some_and(|at| now.duration_since(at).unwrap_or_default() < max_age);
            let keep = (i as u64) < retention.keep_versions
                || recent
                || heads.get(name) == Some(&v.target)
                || named.contains(v.target);
            if !keep {
                out.push(v.id);
            }
        }
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 86_400;

    #[test]
    fn a_version_goes_only_when_beyond_the_count_and_older_than_the_days() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000 * DAY);
        let ago = |days: u64| Some(now - Duration::from_secs(days * DAY));
        // Head `a`: ids 1..=6, made 10, 9, … 5 days ago; its head is id 6's target.
        let targets: Vec<String> = (1..=8).map(|i| format!("t{i}")).collect();
        let mut versions: Vec<Version<'_>> = (1..=6)
            .map(|i| Version {
                id: i,
                name: "a",
                target: &targets[i as usize - 1],
                created: ago(11 - i as u64),
            })
            .collect();
        // Head `b`: a version whose record is gone, then its head, old.
        versions.push(Version { id: 7, name: "b", target: &targets[6], created: None });
        versions.push(Version { id: 8, name: "b", target: &targets[7], created: ago(50) });
        let heads: HashMap<&str, &str> = [("a", "t6"), ("b", "t8")].into();
        let none = HashSet::new();
        let named: HashSet<&str> = ["t1"].into();
        let r = |keep_versions, keep_days| Retention { keep_versions, keep_days, pressed: false };
        let pressed = |keep_versions, keep_days| Retention { keep_versions, keep_days, pressed: true };
        for (retention, named, want) in [
            // Off: either key 0 keeps everything.
            (r(0, 7), &none, vec![]),
            (r(2, 0), &none, vec![]),
            // Last 2 of each head by count (a: 5, 6; b: 7, 8); 8 days keeps a's 4 (7 days
            // old) too; a's 3 is 8 days old and third from the top: gone, as are 1 and 2.
            (r(2, 8), &none, vec![1, 2, 3]),
            // Exactly `keep_days` old is no longer recent.
            (r(2, 7), &none, vec![1, 2, 3, 4]),
            // b's old head stays; its recordless row, second by count, goes.
            (r(1, 1), &none, vec![1, 2, 3, 4, 5, 7]),
            // A version a managed execution names stays.
            (r(1, 1), &named, vec![2, 3, 4, 5, 7]),
            // Plenty kept by count: nothing goes.
            (r(100, 1), &none, vec![]),
            // Under pressure the days keep nothing: a's 4 goes although 7 days old.
            (pressed(2, 8), &none, vec![1, 2, 3, 4]),
            (pressed(2, 1000), &none, vec![1, 2, 3, 4]),
            // ... but off stays off.
            (pressed(0, 7), &none, vec![]),
        ] {
            assert_eq!(pruned(&versions, &heads, named, retention, now), want, "{retention:?}");
        }
    }
}
