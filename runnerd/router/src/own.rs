//! The routes the router answers itself, in runnerd's shapes (a caller reads every key it
//! knows) with the fleet added: `/health` (a ready node's health plus `fleet`), `/status`
//! and `/resources` (every ready node's, combined, plus `nodes`), `/metrics` (its own).

use hyper::Response;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use serde_json::{Value, json};

use crate::fleet::{Node, Pool};
use crate::node::{Body, full};
use crate::route::{ASK_TIMEOUT, Router};

/// How long `/health` waits for a node's.
const HEALTH_ASK: std::time::Duration = std::time::Duration::from_secs(1);
use crate::server::json;

impl Router {
    pub async fn own(&self, own: crate::classify::Own) -> Response<Body> {
        use crate::classify::Own;
        match own {
            Own::Health => self.health().await,
            Own::Status => self.combined("/status", combine_status).await,
            Own::Resources => self.combined("/resources", combine_resources).await,
            Own::Metrics => {
                let text = self.metrics.render(&self.fleet.nodes(), self.fleet.catalog_sizes());
                let mut response = Response::new(full(text));
                let headers = response.headers_mut();
                headers.insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
                response
            }
        }
    }

    /// `/health`'s `fleet` (answered without a token: counts, never names or addresses,
    /// which `GET /fleet/nodes` shows to callers with the token).
    fn fleet_summary(&self) -> Value {
        let nodes = self.fleet.nodes();
        let pools: serde_json::Map<String, Value> = Pool::ALL
            .iter()
            .filter_map(|p| {
                let of: Vec<&Node> = nodes.iter().filter(|n| n.member.pool == *p).collect();
                (!of.is_empty()).then(|| {
                    let routable = of.iter().filter(|n| n.routable()).count();
                    (p.name().to_owned(), json!({"nodes": of.len(), "routable": routable}))
                })
            })
            .collect();
        let source = match self.config.membership {
            crate::config::Membership::Static(_) => "static",
            crate::config::Membership::Kube { .. } => "kubernetes",
        };
        json!({
            "role": "router",
            "routerVersion": env!("CARGO_PKG_VERSION"),
            "membership": source,
            "nodes": nodes.len(),
            "routable": nodes.iter().filter(|n| n.routable()).count(),
            "pools": pools,
        })
    }

    /// `GET /health`: a ready node's own health (every key a caller of runnerd reads), with
    /// `fleet` added; 503 when no node is ready.
    pub async fn health(&self) -> Response<Body> {
        // At most two nodes, briefly: an unauthenticated route must stay cheap.
        for node in self.fleet.nodes().into_iter().filter(Node::routable).take(2) {
            if let Ok((200, mut health)) =
                self.client.json("GET", &node.member.url, "/health", None, HEALTH_ASK).await
                && health.is_object()
            {
                health["fleet"] = self.fleet_summary();
                return json(200, &health);
            }
        }
        json(
            503,
            &json!({"status": "unavailable", "error": "No runner node is ready", "code": "no_nodes", "fleet": self.fleet_summary()}),
        )
    }

    /// Asks every routable node `path` and combines their answers.
    async fn combined(&self, path: &str, combine: fn(&[(Node, Value)]) -> Value) -> Response<Body> {
        let nodes: Vec<Node> = self.fleet.nodes().into_iter().filter(Node::routable).collect();
        let asks = nodes.iter().map(|n| async move {
            (n.clone(), self.client.json("GET", &n.member.url, path, None, ASK_TIMEOUT).await)
        });
        let answers = futures::future::join_all(asks).await;
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for (node, answer) in answers {
            match answer {
                Ok((200, v)) => ok.push((node, v)),
                Ok((status, _)) => {
                    failed.push(json!({"node": node.member.name, "error": format!("answered {status}")}))
                }
                Err(e) => failed.push(json!({"node": node.member.name, "error": e.to_string()})),
            }
        }
        if ok.is_empty() {
            let e = crate::route::unavailable("no_nodes", "No runner node is ready; retry later");
            return crate::server::error(&e);
        }
        let mut out = combine(&ok);
        out["nodes"] = Value::Array(
            ok.iter()
                .map(|(n, v)| json!({"node": n.member.name, "url": n.member.url, "answer": v}))
                .chain(failed)
                .collect(),
        );
        json(200, &out)
    }
}

fn concat(answers: &[(Node, Value)], key: &str) -> Value {
    Value::Array(answers.iter().flat_map(|(_, v)| v[key].as_array().cloned().unwrap_or_default()).collect())
}

/// `/status`: the active executions and NPU jobs of every node.
fn combine_status(answers: &[(Node, Value)]) -> Value {
    json!({
        "activeExecutions": concat(answers, "activeExecutions"),
        "capturedAt": common::timefmt::now_iso(),
        "kernels": [],
        "npuJobs": concat(answers, "npuJobs"),
        "runnerVersion": answers[0].1["runnerVersion"],
        "status": "ok",
    })
}

fn sum(answers: &[(Node, Value)], f: impl Fn(&Value) -> Option<u64>) -> u64 {
    answers.iter().filter_map(|(_, v)| f(v)).sum()
}

/// `/resources`: the fleet's capacity, summed (load averaged, uptime the shortest).
fn combine_resources(answers: &[(Node, Value)]) -> Value {
    let n = answers.len() as f64;
    let load = answers.iter().filter_map(|(_, v)| v["loadAverage1m"].as_f64()).sum::<f64>() / n;
    let uptime =
        answers.iter().filter_map(|(_, v)| v["uptimeSeconds"].as_f64()).fold(f64::INFINITY, f64::min);
    let disks: Vec<&Value> =
        answers.iter().map(|(_, v)| &v["workspaceDisk"]).filter(|d| d.is_object()).collect();
    let disk = (!disks.is_empty()).then(|| {
        json!({
            "path": disks[0]["path"],
            "totalBytes": disks.iter().filter_map(|d| d["totalBytes"].as_u64()).sum::<u64>(),
            "availableBytes": disks.iter().filter_map(|d| d["availableBytes"].as_u64()).sum::<u64>(),
        })
    });
    json!({
        "capturedAt": common::timefmt::now_iso(),
        "cpuCores": sum(answers, |v| v["cpuCores"].as_u64()),
        "loadAverage1m": load,
        "memoryTotalBytes": sum(answers, |v| v["memoryTotalBytes"].as_u64()),
        "memoryFreeBytes": sum(answers, |v| v["memoryFreeBytes"].as_u64()),
        "uptimeSeconds": if uptime.is_finite() { uptime } else { 0.0 },
        "workspaceDisk": disk.unwrap_or(Value::Null),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Fleet, Member};

    fn node(url: &str) -> Node {
        let f = Fleet::default();
        f.set_members(vec![Member { url: url.into(), pool: Pool::Cpu, name: url.into(), ready: true }]);
        f.nodes().remove(0)
    }

    #[test]
    fn status_and_resources_combine() {
        let a = json!({"activeExecutions": [{"executionId": "1"}], "npuJobs": [], "runnerVersion": "abcdef12",
                       "cpuCores": 2, "memoryTotalBytes": 10, "memoryFreeBytes": 4, "loadAverage1m": 1.0,
                       "uptimeSeconds": 50.0, "workspaceDisk": {"path": "/d", "totalBytes": 100, "availableBytes": 40}});
        let b = json!({"activeExecutions": [{"executionId": "2"}], "npuJobs": [{"id": "j"}], "runnerVersion": "abcdef12",
                       "cpuCores": 4, "memoryTotalBytes": 20, "memoryFreeBytes": 6, "loadAverage1m": 3.0,
                       "uptimeSeconds": 20.0, "workspaceDisk": null});
        let answers = vec![(node("http://a:1"), a), (node("http://b:1"), b)];
        let s = combine_status(&answers);
        assert_eq!(s["activeExecutions"], json!([{"executionId": "1"}, {"executionId": "2"}]));
        assert_eq!(
            (&s["npuJobs"], &s["kernels"], &s["status"]),
            (&json!([{"id": "j"}]), &json!([]), &json!("ok"))
        );
        let r = combine_resources(&answers);
        assert_eq!(
            (r["cpuCores"].as_u64(), r["memoryTotalBytes"].as_u64(), r["memoryFreeBytes"].as_u64()),
            (Some(6), Some(30), Some(10))
        );
        assert_eq!((r["loadAverage1m"].as_f64(), r["uptimeSeconds"].as_f64()), (Some(2.0), Some(20.0)));
        assert_eq!(r["workspaceDisk"], json!({"path": "/d", "totalBytes": 100, "availableBytes": 40}));
    }
}
