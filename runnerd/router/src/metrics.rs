//! The router's own `GET /metrics` (Prometheus text, the Prometheus project's client like
//! runnerd's): requests by target and status class, forwarding latency, placements,
//! restores, moves, and at each scrape the nodes by pool and state and the catalog's size.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::fleet::Node;

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    forward_seconds: Histogram,
    placements: Family<Labels, Counter>,
    restores: Family<Labels, Counter>,
    moves: Family<Labels, Counter>,
    nodes: Family<Labels, Gauge>,
    catalog: Family<Labels, Gauge>,
    scrape: Mutex<()>,
}

fn registered<M: prometheus_client::registry::Metric + Clone>(
    r: &mut Registry,
    name: &str,
    help: &str,
    m: M,
) -> M {
    r.register(name, help, m.clone());
    m
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut r = Registry::with_prefix("runner_router");
        let requests = registered(
            &mut r,
            "requests",
            "Requests answered, by target (workspace, execution, npu_job, broadcast, any, own, fleet) and status class",
            Family::default(),
        );
        let buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];
        let forward_seconds = registered(
            &mut r,
            "forward_seconds",
            "From sending a request to a node to its answer's head",
            Histogram::new(buckets),
        );
        let placements = registered(
            &mut r,
            "placements",
            "New workspaces placed, by outcome (placed, spilled on queue_full, unreachable)",
            Family::default(),
        );
        let restores = registered(
            &mut r,
            "restores",
            "Lost nodes' workspaces restored from the object store, by outcome",
            Family::default(),
        );
        let moves =
            registered(&mut r, "moves", "Workspaces moved off draining nodes, by outcome", Family::default());
        let nodes = registered(
            &mut r,
            "nodes",
            "Nodes by pool and state (routable, draining, down)",
            Family::default(),
        );
        let catalog = registered(
            &mut r,
            "catalog_entries",
            "Entries of the router's catalog cache, by kind",
            Family::default(),
        );
        Metrics {
            registry: r,
            requests,
            forward_seconds,
            placements,
            restores,
            moves,
            nodes,
            catalog,
            scrape: Mutex::new(()),
        }
    }
}

impl Metrics {
    pub fn request(&self, target: &'static str, status: u16, _took: Duration) {
        let class = format!("{}xx", status / 100);
        self.requests.get_or_create(&vec![("target", target.to_owned()), ("status", class)]).inc();
    }

    pub fn forwarded(&self, took: Duration) {
        self.forward_seconds.observe(took.as_secs_f64());
    }

    pub fn placement(&self, outcome: &'static str) {
        self.placements.get_or_create(&vec![("outcome", outcome.to_owned())]).inc();
    }

    pub fn restore(&self, outcome: &'static str) {
        self.restores.get_or_create(&vec![("outcome", outcome.to_owned())]).inc();
    }

    pub fn moved(&self, outcome: &'static str) {
        self.moves.get_or_create(&vec![("outcome", outcome.to_owned())]).inc();
    }

    /// The text exposition, with the node and catalog gauges set from `nodes` and `catalog`.
    pub fn render(&self, nodes: &[Node], catalog: (usize, usize, usize)) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.nodes.clear();
        for n in nodes {
            let state = if !n.routable() {
                "down"
            } else if n.load.as_ref().is_some_and(|l| l.draining) {
                "draining"
            } else {
                "routable"
            };
            self.nodes
                .get_or_create(&vec![("pool", n.member.pool.name().to_owned()), ("state", state.to_owned())])
                .inc();
        }
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.catalog.get_or_create(&vec![("kind", "workspace".to_owned())]).set(count(catalog.0));
        self.catalog.get_or_create(&vec![("kind", "execution".to_owned())]).set(count(catalog.1));
        self.catalog.get_or_create(&vec![("kind", "npu_job".to_owned())]).set(count(catalog.2));
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Fleet, Member, Pool};

    #[test]
    fn render_counts_what_was_recorded() {
        let m = Metrics::default();
        m.request("workspace", 200, Duration::ZERO);
        m.request("workspace", 201, Duration::ZERO);
        m.request("any", 503, Duration::ZERO);
        m.placement("placed");
        m.forwarded(Duration::from_millis(2));
        let fleet = Fleet::default();
        fleet.set_members(vec![
            Member { url: "http://a:1".into(), pool: Pool::Cpu, name: "a".into(), ready: true },
            Member { url: "http://b:1".into(), pool: Pool::Nvidia, name: "b".into(), ready: false },
        ]);
        let text = m.render(&fleet.nodes(), (3, 1, 0));
        for line in [
            "runner_router_requests_total{target=\"workspace\",status=\"2xx\"} 2",
            "runner_router_requests_total{target=\"any\",status=\"5xx\"} 1",
            "runner_router_placements_total{outcome=\"placed\"} 1",
            "runner_router_nodes{pool=\"cpu\",state=\"routable\"} 1",
            "runner_router_nodes{pool=\"nvidia\",state=\"down\"} 1",
            "runner_router_catalog_entries{kind=\"workspace\"} 3",
            "runner_router_forward_seconds_count 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
        }
    }
}
