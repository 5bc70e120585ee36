//! A fleet behind one URL (issue #35): the real `runner-router` in front of real runnerd
//! processes on loopback addresses (127.0.0.2–4), each with its own data directory. Every
//! call of a workspace lands on one node and new ones spread; bad input gets runnerd's own
//! answers; managed runs and their logs go to the node that runs them (also through a router
//! that never saw them); `queue_full` sends a new workspace to the next node; a paused node's
//! workspaces answer 503 with `Retry-After` while new ones go elsewhere; a drain moves every
//! workspace away and the router follows; a lost node's workspace is restored from the object
//! store on another node.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};

use runner_tests::kube::KubeStandIn;
use runner_tests::router::{Router, node_url};
use runner_tests::server::{Server, ServerOptions, keyed_shell_request};
use runner_tests::{sandbox_or_skip, seaweed::Seaweed};

fn node_on(host: &str, env: &[(&str, &str)]) -> Server {
    let mut all: Vec<(String, String)> = vec![("SCIENCE_AGENT_RUNNER_HOST".into(), host.into())];
    all.extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    Server::start_with(ServerOptions { env: all, ..ServerOptions::default() })
}

fn nodes(n: usize, env: &[(&str, &str)]) -> Vec<Server> {
    (0..n).map(|i| node_on(&format!("127.0.0.{}", i + 2), env)).collect()
}

/// The nodes whose data directory holds the remote workspace `key`.
fn holders(nodes: &[Server], key: &str) -> Vec<usize> {
    (0..nodes.len()).filter(|i| nodes[*i].path(&format!("remote-workspaces/{key}")).is_dir()).collect()
}

async fn shell(router: &Router, key: &str, code: &str) -> (u16, Value) {
    let reply = router
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", key, code))
        .await
        .unwrap();
    (reply.status, reply.json())
}

async fn all_routable(router: &Router, n: usize) {
    router
        .until("every node routable", Duration::from_secs(20), |v| {
            // Routable, and each node's load read once (placement depends on it).
            v["nodes"].as_array().is_some_and(|a| {
                a.len() == n && a.iter().all(|x| x["routable"] == true && !x["load"].is_null())
            })
        })
        .await;
}

#[tokio::test]
async fn every_call_of_a_workspace_lands_on_one_node_and_new_ones_spread() {
    let test = "every_call_of_a_workspace_lands_on_one_node_and_new_ones_spread";
    if !sandbox_or_skip(test) {
        return;
    }
    let n = nodes(3, &[]);
    let router = Router::over(&[&n[0], &n[1], &n[2]], &[("SCIENCE_AGENT_ROUTER_SAMPLE", "3")]);
    all_routable(&router, 3).await;
    let mut used = BTreeSet::new();
    for i in 0..9 {
        let key = format!("team/w{i}");
        for round in 1..=2 {
            let (status, body) = shell(&router, &key, &format!("echo {i} >> f && cat f")).await;
            assert_eq!((status, body["exitCode"].as_i64()), (200, Some(0)), "{body}");
            assert_eq!(body["stdout"].as_str().unwrap().lines().count(), round, "{body}");
        }
        let held = holders(&n, &key);
        assert_eq!(held.len(), 1, "{key} lives on exactly one node: {held:?}");
        used.insert(held[0]);
    }
    assert!(used.len() >= 2, "nine new workspaces spread over more than one node: {used:?}");
    // A workspace inside another lives on its parent's node, in its directory.
    for child in ["team/w3/agents/child", "team/w5/sub"] {
        let (status, body) = shell(&router, child, "echo nested > n").await;
        assert_eq!(status, 200, "{body}");
        let parent = child.split('/').take(2).collect::<Vec<_>>().join("/");
        assert_eq!(holders(&n, child), holders(&n, &parent), "{child} beside {parent}");
    }
    // The router's own routes: /status and /resources combine the nodes', /health adds the fleet.
    let client = router.client();
    let resources = client.get("/resources").await.unwrap().json();
    let one = n[0].client().get("/resources").await.unwrap().json();
    assert_eq!(resources["cpuCores"].as_u64(), one["cpuCores"].as_u64().map(|c| c * 3), "{resources}");
    let status = client.get("/status").await.unwrap();
    assert_eq!((status.status, &status.json()["status"]), (200, &json!("ok")));
    // Without a token: counts only, never a node's address.
    let health = client.raw("GET", "/health", &[], Vec::new()).await.unwrap();
    let text = String::from_utf8_lossy(&health.body).into_owned();
    let health = health.json();
    assert_eq!((&health["status"], &health["fleet"]["routable"]), (&json!("ok"), &json!(3)), "{health}");
    assert!(!text.contains("127.0.0."), "no node address in the unauthenticated /health: {text}");
    let metrics = String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap();
    assert!(metrics.contains("runner_router_placements_total{outcome=\"placed\"} 9"), "{metrics}");
}

#[tokio::test]
async fn bad_input_gets_the_answers_runnerd_gives() {
    let test = "bad_input_gets_the_answers_runnerd_gives";
    if !sandbox_or_skip(test) {
        return;
    }
    let n = nodes(2, &[]);
    let router = Router::over(&[&n[0], &n[1]], &[]);
    all_routable(&router, 2).await;
    let (direct, routed) = (n[0].client(), router.client());
    let json_type = ("content-type", "application/json".to_owned());
    // A fresh body for each request where the case allows one.
    let shell_body = |key: &str| keyed_shell_request("a", "s", key, "true").to_string().into_bytes();
    let naming_a_node = node_url(&n[1]);
    // The body: a fresh execution request for the key given, else these bytes.
    type Case<'a> = (&'a str, &'a str, &'a str, bool, bool, Option<&'a str>, Vec<u8>);
    let cases: Vec<Case> = vec![
        ("unsigned", "POST", "/execute-shell", true, false, Some("bad/w"), Vec::new()),
        ("no token", "GET", "/status", false, false, None, Vec::new()),
        ("no token, unknown path", "GET", "/nowhere", false, false, None, Vec::new()),
        ("unknown path", "GET", "/nowhere", true, false, None, Vec::new()),
        ("oversized", "POST", "/execute-shell", true, true, None, vec![b' '; 2_000_001]),
        ("not json", "POST", "/execute-shell", true, true, None, b"{".to_vec()),
        ("a key naming a node", "POST", "/execute-shell", true, true, Some(&naming_a_node), Vec::new()),
        ("no workspace", "POST", "/remote-workspace/files", true, false, None, b"{}".to_vec()),
    ];
    // Each case once to the node, once to the router: the same status, text and code.
    // The same body signed with the same timestamp is the same signature: the node would
    // refuse the router's copy as a replay of the direct one. Each copy gets its own.
    let mut last_timestamp = String::new();
    for (what, method, path, with_token, signed, key, raw) in cases {
        let mut answers = Vec::new();
        for client in [&direct, &routed] {
            let body = key.map_or_else(|| raw.clone(), shell_body);
            let mut headers = vec![json_type.clone()];
            if with_token {
                headers.push(client.bearer());
            }
            if signed {
                let signature = loop {
                    let signature = client.signature_headers(&body);
                    if signature[0].1 != last_timestamp {
                        break signature;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                };
                last_timestamp = signature[0].1.clone();
                headers.extend(signature);
            }
            let reply = client.raw(method, path, &headers, body).await.unwrap();
            answers.push((reply.status, reply.json()));
        }
        assert_eq!(answers[0], answers[1], "{what}: node, then router");
        assert!(answers[0].0 >= 400, "{what}: {answers:?}");
    }
    let bytes = shell_body("bad/w");
    // A replay of a request the router accepted is refused by the router itself.
    let headers: Vec<(&str, String)> =
        [vec![routed.bearer(), json_type], routed.signature_headers(&bytes).to_vec()].concat();
    let first = routed.raw("POST", "/execute-shell", &headers, bytes.clone()).await.unwrap();
    assert_eq!(first.status, 200, "{}", first.json());
    let again = routed.raw("POST", "/execute-shell", &headers, bytes).await.unwrap();
    assert_eq!((again.status, &again.json()["code"]), (401, &json!("replayed_request")), "{}", again.json());
    // Routes between nodes are not the caller's: a move to an address of the caller's choosing
    // is refused before any node sees it.
    let push = json!({"workspace": "bad/w", "to": "http://203.0.113.1:4311"});
    let reply = routed.post_signed("/workspace-transfer/push", &push).await.unwrap();
    assert_eq!((reply.status, &reply.json()["code"]), (403, &json!("node_internal")), "{}", reply.json());
    let reply = routed.post_json("/environments", &json!({"name": "x"})).await.unwrap();
    assert_eq!((reply.status, &reply.json()["code"]), (400, &json!("fleet_unsupported")), "{}", reply.json());
    // The fleet's own changes are signed.
    let reply = routed.post_json("/fleet/drain", &json!({"node": node_url(&n[0])})).await.unwrap();
    assert_eq!(reply.status, 401, "{}", reply.json());
}

#[tokio::test]
async fn managed_runs_and_their_logs_go_to_the_node_that_runs_them() {
    let test = "managed_runs_and_their_logs_go_to_the_node_that_runs_them";
    if !sandbox_or_skip(test) {
        return;
    }
    let n = nodes(2, &[]);
    let router = Router::over(&[&n[0], &n[1]], &[]);
    all_routable(&router, 2).await;
    let request = keyed_shell_request("a", "s", "managed/w", "echo out-line; echo err-line >&2");
    let id = request["executionId"].as_str().unwrap().to_owned();
    let reply = router.client().post_signed("/shell-executions", &request).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let q = "sessionId=s&agentId=a";
    // A second router has never seen the run: it asks the nodes.
    let other = Router::over(&[&n[0], &n[1]], &[]);
    all_routable(&other, 2).await;
    for r in [&router, &other] {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let record = loop {
            let reply = r.client().get(&format!("/shell-executions/{id}?{q}")).await.unwrap();
            assert_eq!(reply.status, 200, "{}", reply.json());
            let record = reply.json();
            if matches!(record["state"].as_str(), Some("completed" | "failed" | "cancelled" | "unknown")) {
                break record;
            }
            assert!(std::time::Instant::now() < deadline, "{record}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(record["id"].as_str().or(record["executionId"].as_str()), Some(id.as_str()), "{record}");
        assert_eq!(record["state"], "completed", "{record}");
        let logs = r.client().get(&format!("/shell-executions/{id}/logs?{q}&cursor=0")).await.unwrap();
        assert_eq!(logs.status, 200, "{}", logs.json());
        let text = logs.json().to_string();
        assert!(text.contains("out-line") && text.contains("err-line"), "{text}");
    }
    let missing = router.client().get(&format!("/shell-executions/nope?{q}")).await.unwrap();
    let direct = n[0].client().get(&format!("/shell-executions/nope?{q}")).await.unwrap();
    assert_eq!((missing.status, missing.json()), (direct.status, direct.json()));
}

#[tokio::test]
async fn a_full_queue_sends_a_new_workspace_to_the_next_node() {
    let test = "a_full_queue_sends_a_new_workspace_to_the_next_node";
    if !sandbox_or_skip(test) {
        return;
    }
    let n =
        nodes(2, &[("SCIENCE_AGENT_QUEUE_CAPACITY", "1"), ("SCIENCE_AGENT_MAX_CONCURRENT_EXECUTIONS", "1")]);
    // Load read rarely: the router places by the hash and learns the queue from the 503.
    let router = Router::over(
        &[&n[0], &n[1]],
        &[("SCIENCE_AGENT_ROUTER_SAMPLE", "1"), ("SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS", "600000")],
    );
    all_routable(&router, 2).await;
    let busy = node_url(&n[0]);
    // A new workspace whose first choice is the busy node.
    let key = (0..)
        .map(|i| format!("spill/w{i}"))
        .find(|k| {
            let ws = format!("workspace {k}");
            runner_router::placement::rendezvous(&ws, &busy)
                > runner_router::placement::rendezvous(&ws, &node_url(&n[1]))
        })
        .unwrap();
    let client = n[0].client();
    let hold = tokio::spawn(async move {
        client
            .post_signed("/execute-shell", &keyed_shell_request("b", "t", "hold/w", "sleep 4"))
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, body) = shell(&router, &key, "echo placed > f && cat f").await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("placed\n")), "{body}");
    // The full node refused it before running anything (its empty directory may remain).
    assert!(n[1].path(&format!("remote-workspaces/{key}/f")).is_file(), "spilled to the node with room");
    assert!(!n[0].path(&format!("remote-workspaces/{key}/f")).exists());
    assert_eq!(hold.await.unwrap().status, 200);
    let metrics = String::from_utf8(router.client().get("/metrics").await.unwrap().body).unwrap();
    assert!(
        metrics.contains("runner_router_placements_total{outcome=\"spilled\"} 1"),
        "{metrics}\n{}",
        router.stderr()
    );
}

fn signal(server: &Server, sig: i32) {
    // SAFETY: kill(2) on the test's own child.
    unsafe { libc::kill(server.pid().unwrap() as i32, sig) };
}

#[tokio::test]
async fn a_paused_node_answers_503_for_its_workspaces_and_new_ones_go_elsewhere() {
    let test = "a_paused_node_answers_503_for_its_workspaces_and_new_ones_go_elsewhere";
    if !sandbox_or_skip(test) {
        return;
    }
    // With an object store the router can tell a new workspace from one on the paused node.
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let store: Vec<(String, String)> = weed.runnerd_env("paused/");
    let env: Vec<(&str, &str)> = store.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let n = nodes(2, &env);
    let router = Router::over(&[&n[0], &n[1]], &[("SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS", "0")]);
    all_routable(&router, 2).await;
    let (status, body) = shell(&router, "paused/w", "echo kept > f").await;
    assert_eq!(status, 200, "{body}");
    let on = holders(&n, "paused/w")[0];
    let paused_url = node_url(&n[on]);
    signal(&n[on], libc::SIGSTOP);
    router
        .until("the paused node not routable", Duration::from_secs(20), |v| {
            v["nodes"].as_array().unwrap().iter().any(|x| x["url"] == paused_url && x["routable"] == false)
        })
        .await;
    let reply = router
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", "paused/w", "cat f"))
        .await
        .unwrap();
    assert_eq!((reply.status, &reply.json()["code"]), (503, &json!("node_unavailable")), "{}", reply.json());
    assert_eq!(reply.header("retry-after"), Some("5"));
    assert!(reply.json()["error"].as_str().unwrap().contains("not ready"), "{}", reply.json());
    // A new workspace goes to the other node.
    let (status, body) = shell(&router, "paused/new", "echo elsewhere").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(holders(&n, "paused/new"), vec![1 - on]);
    signal(&n[on], libc::SIGCONT);
    router
        .until("the node back", Duration::from_secs(20), |v| {
            v["nodes"].as_array().unwrap().iter().all(|x| x["routable"] == true)
        })
        .await;
    let (status, body) = shell(&router, "paused/w", "cat f").await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("kept\n")), "{body}");
}

#[tokio::test]
async fn a_drain_moves_every_workspace_away_and_the_router_follows() {
    let test = "a_drain_moves_every_workspace_away_and_the_router_follows";
    if !sandbox_or_skip(test) {
        return;
    }
    let n = nodes(2, &[]);
    // Made on the first node directly: the router learns where they are from the nodes.
    for i in 0..3 {
        let reply = n[0]
            .client()
            .post_signed(
                "/execute-shell",
                &keyed_shell_request("a", "s", &format!("drain/w{i}"), &format!("echo {i} > f")),
            )
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{}", reply.json());
    }
    let router = Router::over(&[&n[0], &n[1]], &[]);
    all_routable(&router, 2).await;
    let (status, body) = shell(&router, "drain/w0", "cat f").await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("0\n")), "{body}");
    let from = node_url(&n[0]);
    let (code, listed, _) = router.runnerctl(&["fleet", "ls"]);
    assert_eq!((code, listed.lines().count()), (0, 3), "{listed}");
    assert!(listed.lines().nth(1).unwrap().contains("ready"), "{listed}");
    // `runnerctl fleet drain` follows the drain to its end, its progress on stderr.
    let ctl = {
        let (url, from) = (router.url(), from.clone());
        tokio::task::spawn_blocking(move || {
            let out = std::process::Command::new(runner_tests::bin("runnerctl"))
                .args(["--url", &url, "fleet", "drain", &from])
                .env_clear()
                .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
                .output()
                .unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.code(), text(&out.stdout), text(&out.stderr))
        })
    };
    let (code, stdout, stderr) = tokio::time::timeout(Duration::from_secs(120), ctl).await.unwrap().unwrap();
    assert_eq!(code, Some(0), "{stdout}\n{stderr}\n{}", router.stderr());
    let p: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (&p["remaining"], &p["drain"]["moved"], &p["drain"]["failed"], &p["draining"]),
        (&json!(0), &json!(3), &json!(0), &json!(true)),
        "{p}"
    );
    assert!(stderr.contains("3 moved, 0 failed, 0 left"), "{stderr}");
    let (_, listed, _) = router.runnerctl(&["fleet", "ls"]);
    assert!(listed.contains("draining"), "{listed}");
    for i in 0..3 {
        let (status, body) = shell(&router, &format!("drain/w{i}"), "cat f").await;
        assert_eq!((status, body["stdout"].as_str()), (200, Some(format!("{i}\n").as_str())), "{body}");
    }
    // The source refuses with where it went; a new workspace avoids the draining node.
    let direct = n[0]
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", "drain/w1", "true"))
        .await
        .unwrap();
    assert_eq!(
        (direct.status, &direct.json()["movedTo"]),
        (409, &json!(node_url(&n[1]))),
        "{}",
        direct.json()
    );
    let (status, _) = shell(&router, "drain/new", "true").await;
    assert_eq!((status, holders(&n, "drain/new")), (200, vec![1]));
    // Another replica, which never saw the drain, reads it from the node and agrees.
    let other = Router::over(&[&n[0], &n[1]], &[]);
    other
        .until("the other router sees the drain", Duration::from_secs(20), |v| {
            v["nodes"].as_array().unwrap().iter().any(|x| x["url"] == from.as_str() && x["draining"] == true)
        })
        .await;
    let (status, _) = shell(&other, "drain/other", "true").await;
    assert_eq!((status, holders(&n, "drain/other")), (200, vec![1]));
    let (status, body) = shell(&other, "drain/w2", "cat f").await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("2\n")), "it finds a moved workspace: {body}");
    let (code, stdout, stderr) = router.runnerctl(&["fleet", "undrain", &from]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["draining"], json!(false), "{stdout}");
    let (code, _, stderr) = router.runnerctl(&["fleet", "drain", "no-such-node"]);
    assert!(code == 1 && stderr.contains("No node named"), "{stderr}");
}

#[tokio::test]
async fn a_lost_nodes_workspace_is_restored_from_the_store_elsewhere() {
    let test = "a_lost_nodes_workspace_is_restored_from_the_store_elsewhere";
    if !sandbox_or_skip(test) {
        return;
    }
    let Some(weed) = Seaweed::start_or_skip(test) else { return };
    let store: Vec<(String, String)> = weed.runnerd_env("fleet/");
    let env: Vec<(&str, &str)> = store.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut n = nodes(2, &env);
    let router = Router::over(&[&n[0], &n[1]], &[("SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS", "1")]);
    all_routable(&router, 2).await;
    let (status, body) = shell(&router, "lost/w", "echo survived > f").await;
    assert_eq!(status, 200, "{body}");
    let on = holders(&n, "lost/w")[0];
    // Replicated before the node is lost.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let w = n[on].client().get("/workspace-transfer/where?workspace=lost/w").await.unwrap().json();
        if w["replicatedUpToDate"] == true {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{w}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(&n[on], libc::SIGKILL);
    let _ = n[on].child.wait();
    std::fs::remove_dir_all(&n[on].data_dir).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let body = loop {
        let (status, body) = shell(&router, "lost/w", "cat f").await;
        if status == 200 {
            break body;
        }
        assert_eq!(status, 503, "{body}");
        assert!(matches!(body["code"].as_str(), Some("node_unavailable" | "workspace_restoring")), "{body}");
        assert!(std::time::Instant::now() < deadline, "{body}\n{}", router.stderr());
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(body["stdout"].as_str(), Some("survived\n"), "{body}");
    assert_eq!(holders(&n, "lost/w"), vec![1 - on]);
    let w = n[1 - on].client().get("/workspace-transfer/where?workspace=lost/w").await.unwrap().json();
    assert!(w["epoch"].as_u64().unwrap() >= 1, "a restore raises the epoch: {w}");
    let metrics = String::from_utf8(router.client().get("/metrics").await.unwrap().body).unwrap();
    assert!(metrics.contains("runner_router_restores_total{outcome=\"restored\"} 1"), "{metrics}");
    drop(n.remove(on));
}

/// A port free on each of `hosts` (nodes of one Service share a port, on their own addresses).
fn common_port(hosts: &[&str]) -> u16 {
    for _ in 0..50 {
        let first = std::net::TcpListener::bind((hosts[0], 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        let rest: Vec<_> = hosts[1..].iter().map(|h| std::net::TcpListener::bind((*h, port))).collect();
        if rest.iter().all(Result::is_ok) {
            return port;
        }
    }
    panic!("no port free on all of {hosts:?}");
}

#[tokio::test]
async fn kubernetes_endpoint_slices_say_which_nodes_are_ready() {
    let test = "kubernetes_endpoint_slices_say_which_nodes_are_ready";
    if !sandbox_or_skip(test) {
        return;
    }
    let hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let port = common_port(&hosts);
    let port_text = port.to_string();
    let n: Vec<Server> =
        hosts.iter().map(|h| node_on(h, &[("SCIENCE_AGENT_RUNNER_PORT", port_text.as_str())])).collect();
    let kube = KubeStandIn::start("runners");
    let service = "runner-node-cpu";
    kube.add_node(service, "node-a", hosts[0], port, true);
    kube.add_node(service, "node-b", hosts[1], port, true);
    let dir = runner_tests::scratch_dir();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: {}\n\
             contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: nobody\n    namespace: runners\n\
             current-context: stand-in\nusers:\n- name: nobody\n  user: {{}}\n",
            kube.url()
        ),
    )
    .unwrap();
    let router = Router::start(&[
        ("SCIENCE_AGENT_ROUTER_KUBE_SERVICES".into(), format!("cpu={service}")),
        ("SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS".into(), "0".into()),
        ("KUBECONFIG".into(), kubeconfig.display().to_string()),
    ]);
    let names = |v: &Value, routable: bool| -> BTreeSet<String> {
        v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|x| x["routable"] == routable)
            .map(|x| x["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let set = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<BTreeSet<_>>();
    router
        .until("node-a and node-b routable", Duration::from_secs(20), |v| {
            names(v, true) == set(&["node-a", "node-b"])
        })
        .await;
    let asked = kube.requests();
    assert!(
        asked
            .iter()
            .any(|r| r.contains("watch=true") && r.contains("labelSelector=kubernetes.io%2Fservice-name")),
        "the router watches the pool's slices: {asked:?}"
    );
    let (status, body) = shell(&router, "kube/w", "echo here > f").await;
    assert_eq!(status, 200, "{body}");
    let on = holders(&n, "kube/w")[0];
    let (on_name, other) = if on == 0 { ("node-a", 1) } else { ("node-b", 0) };
    // The kubelet's probe fails: the endpoint is not ready; its workspace waits, a new one goes elsewhere.
    kube.set_ready(service, on_name, false);
    router.until("the node not ready", Duration::from_secs(20), |v| !names(v, true).contains(on_name)).await;
    let reply = router
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", "kube/w", "cat f"))
        .await
        .unwrap();
    assert_eq!((reply.status, reply.header("retry-after")), (503, Some("5")), "{}", reply.json());
    let direct = n[other]
        .client()
        .post_signed("/execute-shell", &keyed_shell_request("a", "s", "kube/seen", "true"))
        .await
        .unwrap();
    assert_eq!(direct.status, 200);
    let (status, body) = shell(&router, "kube/seen", "true").await;
    assert_eq!(status, 200, "a workspace a ready node holds is found there: {body}");
    // A node joins; the one that was not ready comes back.
    kube.add_node(service, "node-c", hosts[2], port, true);
    kube.set_ready(service, on_name, true);
    router
        .until("three nodes routable", Duration::from_secs(20), |v| {
            names(v, true) == set(&["node-a", "node-b", "node-c"])
        })
        .await;
    let (status, body) = shell(&router, "kube/w", "cat f").await;
    assert_eq!((status, body["stdout"].as_str()), (200, Some("here\n")), "{body}");
    // A node removed from the Service is kept, not routable: its workspaces are not made anew.
    kube.remove_node(service, "node-c");
    router
        .until("node-c gone from the Service", Duration::from_secs(20), |v| {
            names(v, false).contains("node-c")
        })
        .await;
}

#[tokio::test]
async fn uploads_stream_to_the_holder_and_skill_packages_reach_every_node() {
    let test = "uploads_stream_to_the_holder_and_skill_packages_reach_every_node";
    if !sandbox_or_skip(test) {
        return;
    }
    let n = nodes(2, &[]);
    let router = Router::over(&[&n[0], &n[1]], &[]);
    all_routable(&router, 2).await;
    let local = runner_tests::scratch_dir();
    // A file upload (streamed through, never held whole) and its download, by runnerctl.
    let big: Vec<u8> = (0..6u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let input = local.path().join("big.bin");
    std::fs::write(&input, &big).unwrap();
    let (code, _, stderr) =
        router.runnerctl(&["--workspace", "up/w", "put", input.to_str().unwrap(), "data/big.bin"]);
    assert_eq!(code, 0, "{stderr}");
    let held = holders(&n, "up/w");
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(std::fs::read(n[held[0]].path("remote-workspaces/up/w/data/big.bin")).unwrap(), big);
    let back = local.path().join("back.bin");
    let (code, _, stderr) =
        router.runnerctl(&["--workspace", "up/w", "get", "data/big.bin", back.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(std::fs::read(&back).unwrap() == big, "the download is the upload");
    // A skill package (a large body: read whole, as runnerd reads it) is published on every node.
    let skill = local.path().join("demo");
    std::fs::create_dir_all(&skill).unwrap();
    std::fs::write(skill.join("SKILL.md"), "# demo\n").unwrap();
    std::fs::write(skill.join("data.bin"), &big).unwrap();
    let (code, stdout, stderr) = router.runnerctl(&["skills", "push", skill.to_str().unwrap()]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let id = serde_json::from_str::<Value>(&stdout).unwrap()["id"].as_str().unwrap().to_owned();
    for node in &n {
        let reply = node.client().get(&format!("/skill-packages/{id}")).await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.json());
    }
    let reply = router.client().get(&format!("/skill-packages/{id}")).await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.json());
}
