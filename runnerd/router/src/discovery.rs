//! Membership and load. The nodes come from `--nodes` (static) or from Kubernetes: the
//! pools' headless Services' EndpointSlices, followed with kube-rs's watcher and reflector,
//! so that readiness is the kubelet's probe of each node's runnerd and no scheduler or
//! consensus of ours is involved. Each node's `GET /load` is then polled every few seconds;
//! a node that does not answer is not routable until it does again.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::{Value, json};

use crate::config::Membership;
use crate::fleet::{Fleet, Load, Member, Pool};
use crate::node::NodeClient;

/// The label the EndpointSlice controller puts on a Service's slices.
pub const SERVICE_LABEL: &str = "kubernetes.io/service-name";
/// The node port when a slice names none.
const DEFAULT_PORT: i32 = 4311;

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("no Kubernetes client configuration (in-cluster service account or KUBECONFIG)")]
    Client(#[source] kube::Error),
}

/// `/health`'s and `/fleet/nodes`' word on where the nodes come from.
pub fn describe(m: &Membership) -> Value {
    match m {
        Membership::Static(nodes) => json!({"source": "static", "nodes": nodes.len()}),
        Membership::Kube { services, namespace } => json!({
            "source": "kubernetes",
            "services": services.iter().map(|(p, s)| json!({"pool": p.name(), "service": s})).collect::<Vec<_>>(),
            "namespace": namespace,
        }),
    }
}

/// The static node list as members (ready: only their load polls can say otherwise).
pub fn static_members(nodes: &[(Pool, String)]) -> Vec<Member> {
    nodes
        .iter()
        .map(|(pool, url)| Member { url: url.clone(), pool: *pool, name: url.clone(), ready: true })
        .collect()
}

/// The members the EndpointSlices of the pools' Services list (pure).
pub fn members_of(slices: &[Arc<EndpointSlice>], services: &[(Pool, String)]) -> Vec<Member> {
    let mut out: Vec<Member> = Vec::new();
    for slice in slices {
        let service = slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_LABEL));
        let Some(pool) = services.iter().find(|(_, s)| Some(s) == service).map(|(p, _)| *p) else { continue };
        let ports = slice.ports.as_deref().unwrap_or_default();
        let port = ports
            .iter()
            .find(|p| p.name.as_deref() == Some("http"))
            .or_else(|| ports.first())
            .and_then(|p| p.port)
            .unwrap_or(DEFAULT_PORT);
        let v6 = slice.address_type == "IPv6";
        for endpoint in &slice.endpoints {
            let Some(address) = endpoint.addresses.first() else { continue };
            let conditions = endpoint.conditions.as_ref();
            // Kubernetes: an unknown readiness counts as ready; a terminating endpoint does not.
            let ready = conditions.and_then(|c| c.ready).unwrap_or(true)
                && !conditions.and_then(|c| c.terminating).unwrap_or(false);
            let host = if v6 { format!("[{address}]") } else { address.clone() };
            let url = format!("http://{host}:{port}");
            let name = endpoint
                .node_name
                .clone()
                .or_else(|| endpoint.target_ref.as_ref().and_then(|t| t.name.clone()))
                .unwrap_or_else(|| url.clone());
            out.retain(|m| m.url != url);
            out.push(Member { url, pool, name, ready });
        }
    }
    out
}

/// Follows the pools' EndpointSlices until `stopping`; every change replaces the membership.
pub async fn watch_kube(
    fleet: Arc<Fleet>,
    services: Vec<(Pool, String)>,
    namespace: Option<String>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> Result<(), DiscoveryError> {
    let client = kube::Client::try_default().await.map_err(DiscoveryError::Client)?;
    let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    let names: Vec<&str> = services.iter().map(|(_, s)| s.as_str()).collect();
    let selector = format!("{SERVICE_LABEL} in ({})", names.join(","));
    tracing::info!(event = "kube_watch", namespace = %namespace, selector = %selector);
    let (reader, writer) = reflector::store();
    let stream =
        reflector(writer, watcher(api, watcher::Config::default().labels(&selector))).default_backoff();
    let mut stream = std::pin::pin!(stream);
    loop {
        let event = tokio::select! {
            e = stream.next() => e,
            _ = stopping.changed() => return Ok(()),
        };
        match event {
            None => return Ok(()),
            Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
            Some(Ok(_)) => {
                let members = members_of(&reader.state(), &services);
                tracing::info!(
                    event = "kube_members",
                    nodes = members.len(),
                    ready = members.iter().filter(|m| m.ready).count()
                );
                fleet.set_members(members);
            }
            Some(Err(e)) => {
                tracing::warn!(event = "kube_watch_error", error = %e, remedy = "retrying with backoff")
            }
        }
    }
}

/// Polls every node's `GET /load` every `interval` until `stopping`.
pub async fn poll_loads(
    fleet: Arc<Fleet>,
    client: NodeClient,
    interval: Duration,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let timeout = interval.min(Duration::from_millis(1500));
    loop {
        let nodes = fleet.nodes();
        let polls = nodes.iter().filter(|n| n.listed).map(|n| {
            let (client, url) = (&client, n.member.url.clone());
            async move {
                let outcome = match client.json("GET", &url, "/load", None, timeout).await {
                    Ok((200, v)) => {
                        Load::from_json(&v).ok_or_else(|| format!("an unexpected /load answer: {v}"))
                    }
                    Ok((status, v)) => Err(format!("/load answered {status}: {v}")),
                    Err(e) => Err(e.to_string()),
                };
                (url, outcome)
            }
        });
        for (url, outcome) in futures::future::join_all(polls).await {
            let was = fleet.node(&url).is_some_and(|n| n.reachable);
            if let Err(e) = &outcome
                && was
            {
                tracing::warn!(event = "node_unreachable", node = %url, error = %e);
            } else if outcome.is_ok() && !was {
                tracing::info!(event = "node_reachable", node = %url);
            }
            fleet.polled(&url, outcome);
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stopping.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(v: Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn endpoint_slices_become_members() {
        let services =
            vec![(Pool::Cpu, "runner-node-cpu".to_owned()), (Pool::Nvidia, "runner-node-nvidia".to_owned())];
        let slices = vec![
            slice(json!({
                "metadata": {"name": "a", "labels": {SERVICE_LABEL: "runner-node-cpu"}},
                "addressType": "IPv4",
                "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 4311}],
                "endpoints": [
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": true}, "nodeName": "n2"},
                    {"addresses": ["10.0.0.3"], "conditions": {"ready": false}, "nodeName": "n3"},
                    {"addresses": ["10.0.0.4"], "conditions": {"ready": true, "terminating": true}},
                    {"addresses": ["10.0.0.5"]},
                    {"addresses": []}
                ]
            })),
            slice(json!({
                "metadata": {"name": "b", "labels": {SERVICE_LABEL: "runner-node-nvidia"}},
                "addressType": "IPv6",
                "endpoints": [{"addresses": ["fd00::9"], "conditions": {"ready": true}, "targetRef": {"name": "pod-9"}}]
            })),
            slice(json!({
                "metadata": {"name": "c", "labels": {SERVICE_LABEL: "other"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.9.9.9"]}]
            })),
        ];
        let got: Vec<(String, Pool, String, bool)> =
            members_of(&slices, &services).into_iter().map(|m| (m.url, m.pool, m.name, m.ready)).collect();
        assert_eq!(
            got,
            vec![
                ("http://10.0.0.2:4311".into(), Pool::Cpu, "n2".into(), true),
                ("http://10.0.0.3:4311".into(), Pool::Cpu, "n3".into(), false),
                ("http://10.0.0.4:4311".into(), Pool::Cpu, "http://10.0.0.4:4311".into(), false),
                ("http://10.0.0.5:4311".into(), Pool::Cpu, "http://10.0.0.5:4311".into(), true),
                ("http://[fd00::9]:4311".into(), Pool::Nvidia, "pod-9".into(), true),
            ]
        );
    }
}
