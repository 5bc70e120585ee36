//! The stand-in Kubernetes API server (`runner_tests::kube`) answers as the real one does for
//! what kube-rs's watcher asks: LISTs with real resourceVersions, label selectors and pages,
//! and WATCHes that resume from a LIST's resourceVersion and stream each change. Spoken to
//! in raw HTTP/1.1, so that these tests check the wire, not a client's reading of it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use runner_tests::kube::{KubeStandIn, query_pairs};
use serde_json::Value;

const NS: &str = "runners";
const CPU: &str = "runner-node-cpu";
const NVIDIA: &str = "runner-node-nvidia";
const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/runners/endpointslices";
/// `kubernetes.io/service-name in (runner-node-cpu,runner-node-nvidia)` as kube-rs encodes it.
const BOTH: &str = "kubernetes.io%2Fservice-name+in+%28runner-node-cpu%2Crunner-node-nvidia%29";
/// How long a test waits for one event before giving up (a bound, not a target).
const WITHIN: Duration = Duration::from_secs(10);

fn connect(kube: &KubeStandIn, target: &str) -> BufReader<TcpStream> {
    let addr = kube.url().strip_prefix("http://").unwrap().to_owned();
    let mut stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(WITHIN)).unwrap();
    write!(
        stream,
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    BufReader::new(stream)
}

/// The status and the lowercased headers of a response.
fn head(reader: &mut BufReader<TcpStream>) -> (u16, String) {
    let mut text = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        text.push_str(&line.to_ascii_lowercase());
    }
    let code = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    (code, text)
}

/// A GET's status and JSON body.
fn get(kube: &KubeStandIn, target: &str) -> (u16, Value) {
    let mut reader = connect(kube, target);
    let (code, headers) = head(&mut reader);
    assert!(headers.contains("content-type: application/json"), "{headers}");
    let mut body = String::new();
    reader.read_to_string(&mut body).unwrap();
    (code, serde_json::from_str(&body).unwrap())
}

/// A LIST that must succeed.
fn list(kube: &KubeStandIn, query: &str) -> Value {
    let (code, body) = get(kube, &format!("{SLICES}?{query}"));
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["apiVersion"], "discovery.k8s.io/v1");
    assert_eq!(body["kind"], "EndpointSliceList");
    body
}

fn rv(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap()
}

fn services(list: &Value) -> Vec<String> {
    let mut names: Vec<String> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["metadata"]["labels"]["kubernetes.io/service-name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// `(node, ready)` of each endpoint of a slice.
fn endpoints(slice: &Value) -> Vec<(String, bool)> {
    slice["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["nodeName"].as_str().unwrap().to_owned(), e["conditions"]["ready"].as_bool().unwrap()))
        .collect()
}

/// An open WATCH: the chunked body read line by line.
struct Watch {
    reader: BufReader<TcpStream>,
    pending: Vec<u8>,
    ended: bool,
}

impl Watch {
    fn open(kube: &KubeStandIn, query: &str) -> Watch {
        let mut reader = connect(kube, &format!("{SLICES}?watch=true&{query}"));
        let (code, headers) = head(&mut reader);
        assert_eq!(code, 200, "{headers}");
        assert!(headers.contains("transfer-encoding: chunked"), "{headers}");
        assert!(headers.contains("content-type: application/json"), "{headers}");
        Watch { reader, pending: Vec::new(), ended: false }
    }

    /// The next event, bookmarks included; `None` once the server ended the stream.
    fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(at) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=at).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            if self.ended {
                assert!(self.pending.is_empty(), "a partial line at the end");
                return None;
            }
            let mut size = String::new();
            self.reader.read_line(&mut size).expect("a chunk within the bound");
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0; size + 2];
            self.reader.read_exact(&mut chunk).unwrap();
            assert_eq!(&chunk[size..], b"\r\n");
            self.ended = size == 0;
            self.pending.extend_from_slice(&chunk[..size]);
        }
    }

    /// The next event that is not a bookmark: `(type, object)`.
    fn change(&mut self) -> (String, Value) {
        loop {
            let event = self.next().expect("an event before the watch ends");
            if event["type"] != "BOOKMARK" {
                return (event["type"].as_str().unwrap().to_owned(), event["object"].clone());
            }
        }
    }
}

#[test]
fn list_shows_each_service_as_one_slice_with_increasing_resource_versions() {
    let kube = KubeStandIn::start(NS);
    kube.add_node(CPU, "cpu-0", "10.0.0.1", 4311, true);
    kube.add_node(CPU, "cpu-1", "10.0.0.2", 4311, false);
    kube.add_node(NVIDIA, "gpu-0", "10.0.1.1", 4311, true);

    let body = list(&kube, "limit=500");
    assert_eq!(rv(&body), 3);
    assert_eq!(kube.resource_version(), "3");
    let items = body["items"].as_array().unwrap();
    assert_eq!(services(&body), [CPU, NVIDIA]);
    let cpu = items.iter().find(|s| s["metadata"]["labels"]["kubernetes.io/service-name"] == CPU).unwrap();
    let gpu = items.iter().find(|s| s["metadata"]["labels"]["kubernetes.io/service-name"] == NVIDIA).unwrap();
    assert!(rv(cpu) < rv(gpu) && rv(gpu) <= rv(&body), "{body}");
    for slice in items {
        assert_eq!(slice["apiVersion"], "discovery.k8s.io/v1");
        assert_eq!(slice["kind"], "EndpointSlice");
        assert_eq!(slice["metadata"]["namespace"], NS);
        assert!(slice["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()));
        assert_eq!(slice["addressType"], "IPv4");
        assert_eq!(slice["ports"], serde_json::json!([{"name": "http", "port": 4311, "protocol": "TCP"}]));
    }
    assert_ne!(cpu["metadata"]["uid"], gpu["metadata"]["uid"]);
    assert!(cpu["metadata"]["name"].as_str().unwrap().starts_with("runner-node-cpu-"));
    assert_eq!(endpoints(cpu), [("cpu-0".to_owned(), true), ("cpu-1".to_owned(), false)]);
    assert_eq!(cpu["endpoints"][1]["addresses"], serde_json::json!(["10.0.0.2"]));
    assert_eq!(cpu["endpoints"][1]["conditions"]["serving"], false);
    assert_eq!(cpu["endpoints"][1]["conditions"]["terminating"], false);

    // Another namespace holds nothing; other resources are not served.
    let other = get(&kube, "/apis/discovery.k8s.io/v1/namespaces/elsewhere/endpointslices").1;
    assert_eq!(other["items"], serde_json::json!([]));
    assert_eq!(get(&kube, "/api/v1/namespaces/runners/pods").0, 404);

    let asked = kube.requests();
    assert_eq!(asked[0], format!("GET {SLICES}?limit=500"));
    assert_eq!(query_pairs(&asked[0]), [("limit".to_owned(), "500".to_owned())]);
}

#[test]
fn label_selectors_pick_services_by_equality_and_by_set() {
    let kube = KubeStandIn::start(NS);
    kube.add_node(CPU, "cpu-0", "10.0.0.1", 4311, true);
    kube.add_node(NVIDIA, "gpu-0", "10.0.1.1", 4311, true);
    kube.add_node("runner-node-npu", "npu-0", "10.0.2.1", 4311, true);

    assert_eq!(services(&list(&kube, "")).len(), 3);
    let one = list(&kube, "labelSelector=kubernetes.io%2Fservice-name%3Drunner-node-cpu&limit=500");
    assert_eq!(services(&one), [CPU]);
    assert_eq!(services(&list(&kube, &format!("labelSelector={BOTH}&limit=500"))), [CPU, NVIDIA]);
    // Spaces as %20 read the same as `+`.
    let spaced = "labelSelector=kubernetes.io/service-name%20in%20(runner-node-npu,%20runner-node-cpu)";
    assert_eq!(services(&list(&kube, spaced)), [CPU, "runner-node-npu"]);
    let notin = "labelSelector=kubernetes.io%2Fservice-name+notin+%28runner-node-cpu%29";
    assert_eq!(services(&list(&kube, notin)), ["runner-node-npu", NVIDIA]);

    let (code, status) = get(&kube, &format!("{SLICES}?labelSelector=a+b"));
    assert_eq!((code, status["kind"].as_str()), (400, Some("Status")), "{status}");
}

#[test]
fn pages_continue_from_the_resource_version_of_the_first() {
    let kube = KubeStandIn::start(NS);
    for service in ["pool-a", "pool-b", "pool-c"] {
        kube.add_node(service, "n", "10.0.0.1", 4311, true);
    }
    let first = list(&kube, "limit=2");
    assert_eq!(first["items"].as_array().unwrap().len(), 2);
    assert_eq!(first["metadata"]["remainingItemCount"], 1);
    let token = first["metadata"]["continue"].as_str().unwrap().to_owned();

    // A change between pages is not in them: every page is the first one's resourceVersion.
    kube.add_node("pool-d", "n", "10.0.0.1", 4311, true);
    let second = list(&kube, &format!("limit=2&continue={}", token.replace(':', "%3A")));
    assert_eq!(services(&second), ["pool-c"]);
    assert_eq!(second["metadata"]["resourceVersion"], first["metadata"]["resourceVersion"]);
    assert!(second["metadata"].get("continue").is_none(), "{second}");
}

#[test]
fn a_watch_from_the_list_sees_each_change_then_ends_at_its_timeout() {
    let kube = KubeStandIn::start(NS);
    kube.add_node(CPU, "cpu-0", "10.0.0.1", 4311, true);
    kube.add_node(CPU, "cpu-1", "10.0.0.2", 4311, true);
    kube.add_node(NVIDIA, "gpu-0", "10.0.1.1", 4311, true);
    kube.add_node("unwatched", "x", "10.0.2.1", 80, true);
    let listed = list(&kube, &format!("labelSelector={BOTH}&limit=500"));
    let from = rv(&listed);

    let mut watch = Watch::open(
        &kube,
        &format!("timeoutSeconds=3&labelSelector={BOTH}&allowWatchBookmarks=true&resourceVersion={from}"),
    );
    kube.set_ready(CPU, "cpu-1", false);
    let (kind, slice) = watch.change();
    assert_eq!(kind, "MODIFIED");
    assert_eq!(endpoints(&slice), [("cpu-0".to_owned(), true), ("cpu-1".to_owned(), false)]);
    assert_eq!(slice["endpoints"][1]["conditions"]["serving"], false);
    assert!(rv(&slice) > from);

    kube.set_ready(CPU, "cpu-1", false); // no change, no event
    kube.add_node("unwatched", "y", "10.0.2.2", 80, true); // not selected
    kube.set_terminating(NVIDIA, "gpu-0");
    let (kind, gpu) = watch.change();
    assert_eq!(kind, "MODIFIED");
    assert_eq!(
        gpu["endpoints"][0]["conditions"],
        serde_json::json!({"ready": false, "serving": true, "terminating": true})
    );
    assert!(rv(&gpu) > rv(&slice) + 1, "the unselected change took a resourceVersion too");

    kube.remove_node(CPU, "cpu-0");
    let (kind, after) = watch.change();
    assert_eq!((kind.as_str(), endpoints(&after)), ("MODIFIED", vec![("cpu-1".to_owned(), false)]));
    kube.remove_node(CPU, "cpu-1");
    let (kind, empty) = watch.change();
    assert_eq!((kind.as_str(), empty["endpoints"].clone()), ("MODIFIED", serde_json::json!([])));
    kube.remove_service(CPU);
    let (kind, deleted) = watch.change();
    assert_eq!(kind, "DELETED");
    assert_eq!(deleted["metadata"]["name"], empty["metadata"]["name"]);
    assert!(rv(&deleted) > rv(&empty));

    // The server ends the watch at timeoutSeconds; a later one from the LIST replays it all.
    let start = Instant::now();
    while watch.next().is_some() {}
    assert!(start.elapsed() < WITHIN);
    let mut replay =
        Watch::open(&kube, &format!("timeoutSeconds=1&labelSelector={BOTH}&resourceVersion={from}"));
    let kinds: Vec<String> = (0..5).map(|_| replay.change().0).collect();
    assert_eq!(kinds, ["MODIFIED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]);
    assert!(replay.next().is_none(), "nothing after the history, then the end");
}

#[test]
fn a_watch_without_a_resource_version_starts_with_the_objects_as_added() {
    let kube = KubeStandIn::start(NS);
    kube.add_node(CPU, "cpu-0", "10.0.0.1", 4311, true);
    let mut watch = Watch::open(&kube, "timeoutSeconds=5&sendInitialEvents=true&allowWatchBookmarks=true");
    let added = watch.next().unwrap();
    assert_eq!(added["type"], "ADDED");
    let end = watch.next().unwrap();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"], "true");
    assert_eq!(end["object"]["metadata"]["resourceVersion"], "1");
    kube.add_node(NVIDIA, "gpu-0", "10.0.1.1", 4311, true);
    assert_eq!(watch.change().0, "ADDED");
}

#[test]
fn a_watch_from_before_a_compaction_is_gone_and_a_restart_keeps_the_objects() {
    let kube = KubeStandIn::start(NS);
    kube.add_node(CPU, "cpu-0", "10.0.0.1", 4311, true);
    kube.set_ready(CPU, "cpu-0", false);
    kube.compact();
    let mut watch = Watch::open(&kube, "resourceVersion=1");
    let gone = watch.next().unwrap();
    assert_eq!(gone["type"], "ERROR");
    assert_eq!(gone["object"]["code"], 410);
    assert!(watch.next().is_none());

    let url = kube.url();
    kube.kill();
    assert!(TcpStream::connect(url.strip_prefix("http://").unwrap()).is_err(), "killed means refused");
    kube.revive();
    assert_eq!(kube.url(), url);
    let body = list(&kube, "");
    assert_eq!(rv(&body), 2);
    assert_eq!(endpoints(&body["items"][0]), [("cpu-0".to_owned(), false)]);
}
