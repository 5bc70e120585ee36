//! Where a new workspace goes (pure): E2B's best-of-K. Of the placeable nodes of its pool,
//! K are sampled — by rendezvous hashing of the workspace's name, so that router replicas
//! with the same view sample the same nodes for it — and the least loaded of those wins.
//! The answer is an order, not one node: a node that answers `503 queue_full` sends the
//! request to the next.

use crate::fleet::{Load, Node};

/// Below this much free workspace disk a node gets new workspaces only when no other can.
pub const MIN_FREE_DISK: u64 = 1 << 30;

/// A stable 64-bit hash of `(key, node)` (FNV-1a, then a finaliser): the same in every
/// replica and every version of the router, unlike std's hasher.
pub fn rendezvous(key: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes().chain([0]).chain(node.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Whether a node can take a new execution now: its queue has room and its disk is not short.
fn has_room(load: Option<&Load>) -> bool {
    load.is_none_or(|l| l.admitted < l.queue_capacity && l.disk_available.is_none_or(|d| d >= MIN_FREE_DISK))
}

/// The cheap load score (lower is better): executions admitted, plus the workspaces placed
/// there since its last poll, per sandbox slot. A node not polled yet counts as half busy.
pub fn score(load: Option<&Load>, placed_since_poll: u64) -> f64 {
    match load {
        None => 0.5 + placed_since_poll as f64,
        Some(l) => (l.admitted + placed_since_poll) as f64 / l.slots.max(1) as f64,
    }
}

/// The order in which to try `nodes` (already the request's pool) for the new workspace
/// `key`: the best of the `k` sampled, the other sampled by score, then the rest by their
/// hash; nodes without room last. Nodes that are not placeable are left out.
pub fn order(key: &str, nodes: &[Node], k: usize) -> Vec<String> {
    let mut ranked: Vec<(&Node, u64)> =
        nodes.iter().filter(|n| n.placeable()).map(|n| (n, rendezvous(key, &n.member.url))).collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.member.url.cmp(&b.0.member.url)));
    let (mut roomy, full): (Vec<_>, Vec<_>) =
        ranked.into_iter().partition(|(n, _)| has_room(n.load.as_ref()));
    let k = k.max(1).min(roomy.len());
    roomy[..k].sort_by(|a, b| {
        let (sa, sb) = (
            score(a.0.load.as_ref(), a.0.placed_since_poll),
            score(b.0.load.as_ref(), b.0.placed_since_poll),
        );
        sa.total_cmp(&sb).then_with(|| b.1.cmp(&a.1))
    });
    roomy.into_iter().chain(full).map(|(n, _)| n.member.url.clone()).collect()
}

/// Where a lost node's workspace is restored: the first placeable node by the workspace's
/// hash alone, so that every router replica picks the same one without talking.
pub fn restore_target(key: &str, nodes: &[Node]) -> Option<String> {
    nodes
        .iter()
        .filter(|n| n.placeable())
        .max_by(|a, b| {
            rendezvous(key, &a.member.url)
                .cmp(&rendezvous(key, &b.member.url))
                .then_with(|| b.member.url.cmp(&a.member.url))
        })
        .map(|n| n.member.url.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Fleet, Member, Pool};

    fn nodes(loads: &[(&str, Option<Load>)]) -> Vec<Node> {
        let fleet = Fleet::default();
        fleet.set_members(
            loads
                .iter()
                .map(|(u, _)| Member { url: (*u).into(), pool: Pool::Cpu, name: (*u).into(), ready: true })
                .collect(),
        );
        for (u, l) in loads {
            if let Some(l) = l {
                fleet.polled(u, Ok(l.clone()));
            }
        }
        fleet.nodes()
    }

    fn load(admitted: u64, slots: u64) -> Option<Load> {
        Some(Load {
            admitted,
            slots,
            queue_capacity: 16,
            running: admitted.min(slots),
            disk_available: Some(u64::MAX),
            draining: false,
        })
    }

    #[test]
    fn the_hash_is_stable_and_spreads() {
        assert_eq!(rendezvous("ws", "http://a:1"), rendezvous("ws", "http://a:1"));
        assert_ne!(rendezvous("ws", "http://a:1"), rendezvous("ws", "http://b:1"));
        // A known value: replicas and versions must agree.
        assert_eq!(rendezvous("", ""), rendezvous("", ""));
        let urls = ["http://a:1", "http://b:1", "http://c:1"];
        let mut firsts = std::collections::BTreeMap::new();
        for i in 0..300 {
            let key = format!("ws{i}");
            let top = urls.iter().max_by_key(|u| rendezvous(&key, u)).unwrap();
            *firsts.entry(*top).or_insert(0) += 1;
        }
        assert!(firsts.values().all(|n| *n > 60), "{firsts:?}");
    }

    #[test]
    fn best_of_all_when_k_covers_them() {
        let n = nodes(&[("http://a:1", load(6, 4)), ("http://b:1", load(1, 4)), ("http://c:1", load(3, 4))]);
        assert_eq!(order("w", &n, 3), ["http://b:1", "http://c:1", "http://a:1"]);
    }

    #[test]
    fn k_samples_by_hash_then_the_rest_follow() {
        let n = nodes(&[("http://a:1", load(0, 4)), ("http://b:1", load(0, 4)), ("http://c:1", load(0, 4))]);
        let o = order("w", &n, 1);
        assert_eq!(o.len(), 3);
        let top = ["http://a:1", "http://b:1", "http://c:1"]
            .into_iter()
            .max_by_key(|u| rendezvous("w", u))
            .unwrap();
        assert_eq!(o[0], top);
        assert_eq!(o, order("w", &n, 1), "deterministic");
    }

    #[test]
    fn full_short_of_disk_draining_and_unready_nodes() {
        let mut short = load(0, 4);
        short.as_mut().unwrap().disk_available = Some(MIN_FREE_DISK - 1);
        let mut draining = load(0, 4);
        draining.as_mut().unwrap().draining = true;
        let n = nodes(&[
            ("http://full:1", load(16, 4)),
            ("http://short:1", short),
            ("http://drain:1", draining),
            ("http://ok:1", load(12, 4)),
        ]);
        let o = order("w", &n, 4);
        assert_eq!(o[0], "http://ok:1");
        assert_eq!(o.len(), 3, "draining is left out: {o:?}");
        assert!(
            o[1..].contains(&"http://full:1".to_owned()) && o[1..].contains(&"http://short:1".to_owned())
        );
        assert_eq!(order("w", &[], 2), Vec::<String>::new());
    }

    #[test]
    fn placements_since_the_poll_count() {
        let mut n = nodes(&[("http://a:1", load(0, 2)), ("http://b:1", load(1, 2))]);
        assert_eq!(order("w", &n, 2)[0], "http://a:1");
        n[0].placed_since_poll = 2;
        assert_eq!(order("w", &n, 2)[0], "http://b:1");
    }

    #[test]
    fn a_restore_target_is_the_same_for_every_replica() {
        let n = nodes(&[("http://a:1", load(9, 4)), ("http://b:1", load(0, 4)), ("http://c:1", None)]);
        let t = restore_target("team/w", &n).unwrap();
        let mut reversed = n.clone();
        reversed.reverse();
        assert_eq!(restore_target("team/w", &reversed), Some(t));
        assert_eq!(restore_target("team/w", &[]), None);
    }
}
