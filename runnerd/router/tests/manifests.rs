//! The fleet's deployment manifests (`packaging/kubernetes/`, issue #35), checked offline.
//!
//! 1. Every document of every `*.yaml` there is a Kubernetes object this fleet ships, and it
//!    parses into its k8s-openapi type **without losing a field**: k8s-openapi's `Deserialize`
//!    ignores unknown fields, so a misspelt key (`hostNetwrok: true`) would vanish silently
//!    and the API server would drop it the same way. The typed value is therefore written back
//!    to JSON and compared with the document; a field that did not survive is named.
//! 2. Each document reads the same under YAML 1.1's rules (kubectl's reader: `0440` octal,
//!    `yes` a boolean) and YAML 1.2's (this test's), so the test checks what kubectl applies.
//! 3. The objects together hold the design written in the manifests' comments: presence pods
//!    on the host's network probing runnerd's `/health`, one headless Service per pool, all
//!    chips held on accelerator pools, a router that may only read EndpointSlices and names
//!    exactly the pools' Services, and a kustomization that lists every file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::Resource;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{
    Container, EnvVar, Namespace, PodSpec, PodTemplateSpec, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const NAMESPACE: &str = "sciencediscovery";
const POOL_LABEL: &str = "sciencediscovery.example.org/runner-pool";
const ROUTER: &str = "runner-router";
const TOKEN_SECRET: &str = "runner-token";
const KUSTOMIZATION: &str = "kustomization.yaml";
/// Accelerator resources a presence pod may hold; the cpu pool holds none of them.
const CHIP_RESOURCES: &[&str] = &["nvidia.com/gpu", "huawei.com/Ascend910"];

/// A node pool: its label value, its DaemonSet's and headless Service's name (the same), and
/// the device plugin's resource its presence pod must hold all of.
struct Pool {
    name: &'static str,
    service: &'static str,
    chips: Option<&'static str>,
}

const POOLS: &[Pool] = &[
    Pool { name: "cpu", service: "runner-node-cpu", chips: None },
    Pool { name: "nvidia", service: "runner-node-nvidia", chips: Some("nvidia.com/gpu") },
    Pool { name: "ascend", service: "runner-node-ascend", chips: Some("huawei.com/Ascend910") },
];

fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/kubernetes")
}

fn repo_file(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The `*.yaml` files of the manifests' folder, by name.
fn yaml_files() -> BTreeSet<String> {
    let dir = manifests_dir();
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").file_name().into_string().expect("a UTF-8 name"))
        .filter(|name| name.ends_with(".yaml"))
        .collect()
}

/// The documents of a YAML stream (empty ones, such as a leading comment block, skipped), as
/// YAML 1.2 reads them, or an error saying where YAML 1.1 (kubectl's reader) reads them
/// differently.
fn read_documents(text: &str) -> Result<Vec<Value>, String> {
    let yaml_1_2 = serde_saphyr::from_multiple::<Value>(text).map_err(|e| e.to_string())?;
    let yaml_1_1 = serde_saphyr::from_multiple_with_options::<Value>(
        text,
        serde_saphyr::options! { legacy_octal_numbers: true, strict_booleans: false },
    )
    .map_err(|e| e.to_string())?;
    let strict_booleans = serde_saphyr::from_multiple_with_options::<Value>(
        text,
        serde_saphyr::options! { strict_booleans: true },
    )
    .map_err(|e| e.to_string())?;
    let mut ambiguous = Vec::new();
    for other in [&yaml_1_1, &strict_booleans] {
        for (i, (document, read_otherwise)) in yaml_1_2.iter().zip(other.iter()).enumerate() {
            let mut paths = Vec::new();
            differences(document, read_otherwise, "", &mut paths);
            ambiguous.extend(paths.into_iter().map(|p| format!("document {}: {p}", i + 1)));
        }
    }
    if !ambiguous.is_empty() {
        return Err(format!(
            "values that read differently under YAML 1.2 and YAML 1.1, kubectl's reader ({}, YAML \
             1.2's reading first): write numbers without leading zeros, booleans as true/false, and \
             quote y, n, on, off, yes and no",
            ambiguous.join("; ")
        ));
    }
    Ok(yaml_1_2)
}

/// Where `typed` (the k8s-openapi value written back) differs from `original` (the document):
/// a field dropped is one the type does not know, usually a typo. A number where the type
/// holds a string of the same text is a `Quantity` written unquoted (`nvidia.com/gpu: 8`), as
/// the API server accepts it; an explicit `null` is the field left out.
fn differences(original: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    let at = |key: &str| if path.is_empty() { key.to_owned() } else { format!("{path}.{key}") };
    match (original, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (key, value) in o {
                match t.get(key) {
                    Some(back) => differences(value, back, &at(key), out),
                    None if value.is_null() => {}
                    None => out.push(format!("{} is not a field of the type (a typo?)", at(key))),
                }
            }
            for key in t.keys().filter(|key| !o.contains_key(*key)) {
                out.push(format!("{} was added by the type", at(key)));
            }
        }
        (Value::Array(o), Value::Array(t)) if o.len() == t.len() => {
            for (i, (value, back)) in o.iter().zip(t).enumerate() {
                differences(value, back, &format!("{path}[{i}]"), out);
            }
        }
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        _ if original == typed => {}
        _ => out.push(format!("{path}: {original} came back as {typed}")),
    }
}

/// `document` as `T`, refused unless its apiVersion is `T`'s and every field survives the
/// round trip.
fn strictly<T: Resource + DeserializeOwned + Serialize>(document: &Value) -> Result<Box<T>, String> {
    let api_version = document.get("apiVersion").and_then(Value::as_str).unwrap_or_default();
    if api_version != T::API_VERSION {
        return Err(format!("a {} is apiVersion {}, not {api_version:?}", T::KIND, T::API_VERSION));
    }
    let value: T =
        serde_json::from_value(document.clone()).map_err(|e| format!("not a valid {}: {e}", T::KIND))?;
    let back = serde_json::to_value(&value).map_err(|e| format!("writing the {} back: {e}", T::KIND))?;
    let mut lost = Vec::new();
    differences(document, &back, "", &mut lost);
    if lost.is_empty() { Ok(Box::new(value)) } else { Err(format!("{}: {}", T::KIND, lost.join("; "))) }
}

/// The objects this fleet ships; any other kind is refused (no Secret with a value, no CRD,
/// no cluster-wide RBAC).
#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    DaemonSet(Box<DaemonSet>),
    Service(Box<Service>),
    ServiceAccount(Box<ServiceAccount>),
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    Deployment(Box<Deployment>),
    HorizontalPodAutoscaler(Box<HorizontalPodAutoscaler>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
}

fn parse_object(document: &Value) -> Result<Object, String> {
    let kind = document.get("kind").and_then(Value::as_str).ok_or("the document has no kind")?;
    Ok(match kind {
        "Namespace" => Object::Namespace(strictly(document)?),
        "DaemonSet" => Object::DaemonSet(strictly(document)?),
        "Service" => Object::Service(strictly(document)?),
        "ServiceAccount" => Object::ServiceAccount(strictly(document)?),
        "Role" => Object::Role(strictly(document)?),
        "RoleBinding" => Object::RoleBinding(strictly(document)?),
        "Deployment" => Object::Deployment(strictly(document)?),
        "HorizontalPodAutoscaler" => Object::HorizontalPodAutoscaler(strictly(document)?),
        "PodDisruptionBudget" => Object::PodDisruptionBudget(strictly(document)?),
        other => return Err(format!("kind {other:?} is not one the fleet ships")),
    })
}

impl Object {
    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::DaemonSet(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::ServiceAccount(o) => &o.metadata,
            Object::Role(o) => &o.metadata,
            Object::RoleBinding(o) => &o.metadata,
            Object::Deployment(o) => &o.metadata,
            Object::HorizontalPodAutoscaler(o) => &o.metadata,
            Object::PodDisruptionBudget(o) => &o.metadata,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => Namespace::KIND,
            Object::DaemonSet(_) => DaemonSet::KIND,
            Object::Service(_) => Service::KIND,
            Object::ServiceAccount(_) => ServiceAccount::KIND,
            Object::Role(_) => Role::KIND,
            Object::RoleBinding(_) => RoleBinding::KIND,
            Object::Deployment(_) => Deployment::KIND,
            Object::HorizontalPodAutoscaler(_) => HorizontalPodAutoscaler::KIND,
            Object::PodDisruptionBudget(_) => PodDisruptionBudget::KIND,
        }
    }

    fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or_default()
    }
}

/// Every object of every manifest; panics naming each document that fails (all of them, not
/// only the first).
struct Fleet {
    objects: Vec<(String, Object)>,
}

impl Fleet {
    fn load() -> Fleet {
        let mut objects = Vec::new();
        let mut errors = Vec::new();
        for file in yaml_files().into_iter().filter(|f| f != KUSTOMIZATION) {
            let text = std::fs::read_to_string(manifests_dir().join(&file)).expect("reading a manifest");
            let documents = match read_documents(&text) {
                Ok(documents) => documents,
                Err(e) => {
                    errors.push(format!("{file}: {e}"));
                    continue;
                }
            };
            for (index, document) in documents.iter().enumerate() {
                let place = format!("{file} document {} ({})", index + 1, name_of(document));
                match parse_object(document) {
                    Ok(object) => objects.push((place, object)),
                    Err(e) => errors.push(format!("{place}: {e}")),
                }
            }
        }
        assert!(errors.is_empty(), "manifests that do not parse strictly:\n{}", errors.join("\n"));
        assert!(!objects.is_empty(), "no manifests under {}", manifests_dir().display());
        Fleet { objects }
    }

    fn daemon_set(&self, name: &str) -> &DaemonSet {
        self.find(name, |o| if let Object::DaemonSet(d) = o { Some(&**d) } else { None })
    }

    fn service(&self, name: &str) -> &Service {
        self.find(name, |o| if let Object::Service(s) = o { Some(&**s) } else { None })
    }

    fn deployment(&self, name: &str) -> &Deployment {
        self.find(name, |o| if let Object::Deployment(d) = o { Some(&**d) } else { None })
    }

    fn all<'a, T: 'a>(&'a self, pick: impl Fn(&'a Object) -> Option<&'a T>) -> Vec<&'a T> {
        self.objects.iter().filter_map(|(_, o)| pick(o)).collect()
    }

    fn find<'a, T: Resource + 'a>(&'a self, name: &str, pick: impl Fn(&'a Object) -> Option<&'a T>) -> &'a T {
        let found: Vec<&T> =
            self.objects.iter().filter(|(_, o)| o.name() == name).filter_map(|(_, o)| pick(o)).collect();
        match found.as_slice() {
            [one] => one,
            [] => panic!("no {} named {name} in the manifests", T::KIND),
            _ => panic!("{} {} named {name} in the manifests", found.len(), T::KIND),
        }
    }
}

fn name_of(document: &Value) -> String {
    let kind = document.get("kind").and_then(Value::as_str).unwrap_or("?");
    let name = document.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("?");
    format!("{kind} {name}")
}

fn pod_template<'a>(
    template: &'a PodTemplateSpec,
    owner: &str,
) -> (&'a BTreeMap<String, String>, &'a PodSpec) {
    let labels = template.metadata.as_ref().and_then(|m| m.labels.as_ref());
    let labels = labels.unwrap_or_else(|| panic!("{owner}: its pods have no labels"));
    let spec = template.spec.as_ref().unwrap_or_else(|| panic!("{owner}: its pod template has no spec"));
    (labels, spec)
}

/// The labels a selector requires; only `matchLabels` is used in these manifests, so that
/// comparing selectors means comparing maps.
fn match_labels<'a>(selector: &'a LabelSelector, owner: &str) -> &'a BTreeMap<String, String> {
    assert!(selector.match_expressions.is_none(), "{owner}: use matchLabels only");
    selector.match_labels.as_ref().unwrap_or_else(|| panic!("{owner}: its selector has no matchLabels"))
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The port runnerd listens on in the package: `ListenStream=` of `systemd/runnerd.socket`.
fn runnerd_port() -> i32 {
    let socket = repo_file("systemd/runnerd.socket");
    let listen = socket.lines().find_map(|l| l.strip_prefix("ListenStream=")).expect("a ListenStream= line");
    listen.rsplit(':').next().and_then(|p| p.trim().parse().ok()).expect("a port in ListenStream=")
}

/// The data directory the package gives runnerd (`systemd/runnerd.service`).
fn runnerd_data_dir() -> String {
    let unit = repo_file("systemd/runnerd.service");
    let line = unit.lines().find_map(|l| l.strip_prefix("Environment=SCIENCE_AGENT_DATA_DIR="));
    line.expect("runnerd.service sets SCIENCE_AGENT_DATA_DIR").trim().to_owned()
}

/// The port a probe or a Service's targetPort names, resolved against the container's ports.
fn resolve_port(port: &IntOrString, container: &Container) -> Option<i32> {
    match port {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port),
    }
}

/// Why `probe` is not an HTTP GET of `/health` on `port` at the pod's own address, if it is not.
fn health_probe_problem(probe: Option<&Probe>, container: &Container, port: i32) -> Option<String> {
    let Some(get) = probe.and_then(|p| p.http_get.as_ref()) else {
        return Some("no httpGet probe".to_owned());
    };
    if get.path.as_deref() != Some("/health") {
        return Some(format!("probes {:?}, not /health", get.path));
    }
    if resolve_port(&get.port, container) != Some(port) {
        return Some(format!("probes port {:?}, not {port}", get.port));
    }
    if get.host.is_some() {
        return Some("names a host: it must probe the pod's own address".to_owned());
    }
    if get.scheme.as_deref().is_some_and(|s| s != "HTTP") {
        return Some(format!("probes with scheme {:?}", get.scheme));
    }
    None
}

/// What in `container` (in `pod`) is not locked down: non-root, no privilege, no escalation,
/// read-only root, every capability dropped, RuntimeDefault seccomp.
fn lock_down_problems(pod: &PodSpec, container: &Container) -> Vec<String> {
    let pod_sc = pod.security_context.as_ref();
    let sc = container.security_context.as_ref();
    let mut problems = Vec::new();
    let non_root = sc.and_then(|s| s.run_as_non_root).or(pod_sc.and_then(|s| s.run_as_non_root));
    if non_root != Some(true) {
        problems.push("runAsNonRoot is not true".to_owned());
    }
    let user = sc.and_then(|s| s.run_as_user).or(pod_sc.and_then(|s| s.run_as_user));
    if user == Some(0) {
        problems.push("runs as user 0".to_owned());
    }
    if sc.and_then(|s| s.privileged) == Some(true) {
        problems.push("privileged".to_owned());
    }
    if sc.and_then(|s| s.allow_privilege_escalation) != Some(false) {
        problems.push("allowPrivilegeEscalation is not false".to_owned());
    }
    if sc.and_then(|s| s.read_only_root_filesystem) != Some(true) {
        problems.push("readOnlyRootFilesystem is not true".to_owned());
    }
    let caps = sc.and_then(|s| s.capabilities.as_ref());
    if !caps.and_then(|c| c.drop.as_ref()).is_some_and(|d| d.iter().any(|c| c == "ALL")) {
        problems.push("capabilities do not drop ALL".to_owned());
    }
    if caps.and_then(|c| c.add.as_ref()).is_some_and(|a| !a.is_empty()) {
        problems.push("adds capabilities".to_owned());
    }
    let seccomp =
        sc.and_then(|s| s.seccomp_profile.as_ref()).or(pod_sc.and_then(|s| s.seccomp_profile.as_ref()));
    if seccomp.map(|p| p.type_.as_str()) != Some("RuntimeDefault") {
        problems.push("seccomp profile is not RuntimeDefault".to_owned());
    }
    if pod.host_pid == Some(true) || pod.host_ipc == Some(true) {
        problems.push("shares the host's PID or IPC namespace".to_owned());
    }
    if pod.volumes.iter().flatten().any(|v| v.host_path.is_some()) {
        problems.push("mounts a hostPath".to_owned());
    }
    problems
}

fn env_of(container: &Container) -> BTreeMap<&str, &EnvVar> {
    container.env.iter().flatten().map(|e| (e.name.as_str(), e)).collect()
}

fn env_value<'a>(env: &BTreeMap<&str, &'a EnvVar>, name: &str) -> &'a str {
    env.get(name)
        .and_then(|e| e.value.as_deref())
        .unwrap_or_else(|| panic!("the router sets no value for {name}"))
}

fn quantity<'a>(
    map: Option<&'a BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
    resource: &str,
) -> Option<&'a str> {
    map.and_then(|m| m.get(resource)).map(|q| q.0.as_str())
}

#[test]
fn the_strict_reading_refuses_a_misspelt_field_an_unknown_kind_and_an_ambiguous_number() {
    let misspelt = read_documents(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  clusterIP: None\n  publishNotReadyAdresses: false\n",
    )
    .expect("YAML");
    let error = parse_object(&misspelt[0]).expect_err("a misspelt field is refused");
    assert!(error.contains("spec.publishNotReadyAdresses is not a field"), "{error}");

    let unknown =
        read_documents("apiVersion: v1\nkind: Secret\nmetadata: {name: runner-token}\n").expect("YAML");
    let error = parse_object(&unknown[0]).expect_err("a Secret is not shipped");
    assert!(error.contains("\"Secret\""), "{error}");

    let wrong_group =
        read_documents("apiVersion: extensions/v1beta1\nkind: DaemonSet\nmetadata: {name: d}\n");
    let error = parse_object(&wrong_group.expect("YAML")[0]).expect_err("an old apiVersion is refused");
    assert!(error.contains("apps/v1"), "{error}");

    let error = read_documents("mode: 0440\n").expect_err("0440 is octal to kubectl, decimal in YAML 1.2");
    assert!(error.contains("YAML 1.1"), "{error}");
    read_documents("enabled: on\n").expect_err("on is a boolean to kubectl, a string in YAML 1.2");
    read_documents("name: n\n").expect_err("n is false to kubectl's YAML 1.1 reader");

    // A Quantity written as a number survives (the type holds its text); an explicit null is a
    // field left out.
    let quantity = read_documents(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: ns, labels: null}\n---\n\
         apiVersion: policy/v1\nkind: PodDisruptionBudget\nmetadata: {name: p}\nspec: {minAvailable: 1}\n",
    )
    .expect("YAML");
    for document in &quantity {
        parse_object(document).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn every_document_is_a_shipped_kind_in_the_namespace_and_loses_no_field() {
    let fleet = Fleet::load();
    let mut seen = BTreeSet::new();
    for (place, object) in &fleet.objects {
        assert!(!object.name().is_empty(), "{place}: no name");
        assert!(
            seen.insert((object.kind(), object.name())),
            "{place}: a second {} of that name",
            object.kind()
        );
        match object {
            Object::Namespace(_) => {
                assert_eq!(object.name(), NAMESPACE, "{place}");
                assert!(object.metadata().namespace.is_none(), "{place}: a Namespace has no namespace");
            }
            _ => {
                assert_eq!(object.metadata().namespace.as_deref(), Some(NAMESPACE), "{place}: its namespace")
            }
        }
    }
    assert!(seen.contains(&(Namespace::KIND, NAMESPACE)), "the Namespace {NAMESPACE} is not shipped");
    // What is shipped, in all: the pools' pairs and the router's seven objects.
    let expected = 1 + 2 * POOLS.len() + 7;
    assert_eq!(fleet.objects.len(), expected, "objects: {seen:?}");
}

#[test]
fn every_pool_has_a_presence_daemon_set_on_the_host_network_probing_runnerd() {
    let fleet = Fleet::load();
    let port = runnerd_port();
    assert_eq!(fleet.all(|o| if let Object::DaemonSet(d) = o { Some(d) } else { None }).len(), POOLS.len());
    for pool in POOLS {
        let owner = format!("DaemonSet {}", pool.service);
        let spec = fleet.daemon_set(pool.service).spec.as_ref().unwrap_or_else(|| panic!("{owner}: no spec"));
        let (labels, pod) = pod_template(&spec.template, &owner);
        assert!(
            selects(match_labels(&spec.selector, &owner), labels),
            "{owner}: its selector misses its pods"
        );
        assert_eq!(
            labels.get(POOL_LABEL).map(String::as_str),
            Some(pool.name),
            "{owner}: pod label {POOL_LABEL}"
        );
        let node_selector = pod.node_selector.as_ref();
        assert_eq!(
            node_selector.and_then(|s| s.get(POOL_LABEL)).map(String::as_str),
            Some(pool.name),
            "{owner}: it must run on the nodes labelled {POOL_LABEL}={}",
            pool.name
        );
        assert_eq!(pod.host_network, Some(true), "{owner}: hostNetwork (the pod's IP is the node's)");
        assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"), "{owner}: dnsPolicy");
        assert_eq!(pod.automount_service_account_token, Some(false), "{owner}: it needs no API token");
        assert!(
            pod.tolerations.iter().flatten().any(|t| t.key.as_deref() == Some(POOL_LABEL)),
            "{owner}: it must tolerate the pool's taint {POOL_LABEL}"
        );
        if let Some(chips) = pool.chips {
            assert!(
                pod.tolerations.iter().flatten().any(|t| t.key.as_deref() == Some(chips)),
                "{owner}: it must tolerate the accelerator nodes' taint {chips}"
            );
        }
        assert!(!pod.containers.is_empty(), "{owner}: no container");
        for container in &pod.containers {
            let who = format!("{owner} container {}", container.name);
            if let Some(problem) = health_probe_problem(container.readiness_probe.as_ref(), container, port) {
                panic!("{who}: its readinessProbe must be runnerd's GET /health on {port}: {problem}");
            }
            let http = container.ports.iter().flatten().find(|p| p.name.as_deref() == Some("http"));
            assert_eq!(http.map(|p| p.container_port), Some(port), "{who}: a port named http, {port}");
            let problems = lock_down_problems(pod, container);
            assert!(problems.is_empty(), "{who}: {}", problems.join(", "));
            let requests = container.resources.as_ref().and_then(|r| r.requests.as_ref());
            assert!(
                requests.is_some_and(|r| r.contains_key("cpu") && r.contains_key("memory")),
                "{who}: small cpu and memory requests"
            );
        }
        assert!(pod.init_containers.is_none(), "{owner}: init containers");
    }
}

#[test]
fn accelerator_pools_hold_all_their_chips_and_the_cpu_pool_none() {
    let fleet = Fleet::load();
    for pool in POOLS {
        let owner = format!("DaemonSet {}", pool.service);
        let spec = fleet.daemon_set(pool.service).spec.as_ref().expect("a spec");
        let (_, pod) = pod_template(&spec.template, &owner);
        for resource in CHIP_RESOURCES {
            let held: Vec<(Option<&str>, Option<&str>)> = pod
                .containers
                .iter()
                .filter_map(|c| c.resources.as_ref())
                .map(|r| (quantity(r.limits.as_ref(), resource), quantity(r.requests.as_ref(), resource)))
                .filter(|(limit, request)| limit.is_some() || request.is_some())
                .collect();
            if pool.chips != Some(*resource) {
                assert!(held.is_empty(), "{owner}: holds {resource}, which is not its pool's");
                continue;
            }
            let [(Some(limit), request)] = held.as_slice() else {
                panic!("{owner}: one container must hold {resource} in its limits, not {held:?}");
            };
            let count: u32 = limit.parse().unwrap_or_else(|_| panic!("{owner}: {resource} {limit:?}"));
            assert!(count > 0, "{owner}: {resource} must be the node's whole chip count");
            // Extended resources cannot be overcommitted: a request, if written, equals the limit.
            assert!(
                request.is_none_or(|r| r == *limit),
                "{owner}: {resource} requests {request:?}, limits {limit}"
            );
        }
    }
}

#[test]
fn every_pool_has_a_headless_service_selecting_exactly_its_presence_pods() {
    let fleet = Fleet::load();
    let port = runnerd_port();
    let router = fleet.deployment(ROUTER).spec.as_ref().expect("the router's spec");
    let (router_labels, _) = pod_template(&router.template, ROUTER);
    for pool in POOLS {
        let owner = format!("Service {}", pool.service);
        let daemon_set = fleet.daemon_set(pool.service).spec.as_ref().expect("a spec");
        let (labels, pod) = pod_template(&daemon_set.template, pool.service);
        let spec = fleet.service(pool.service).spec.as_ref().unwrap_or_else(|| panic!("{owner}: no spec"));
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "{owner}: headless (clusterIP: None)");
        assert_eq!(spec.publish_not_ready_addresses, Some(false), "{owner}: publishNotReadyAddresses: false");
        let selector = spec.selector.as_ref().unwrap_or_else(|| panic!("{owner}: no selector"));
        assert_eq!(
            selector,
            match_labels(&daemon_set.selector, pool.service),
            "{owner}: the same selector as its DaemonSet"
        );
        assert!(selects(selector, labels), "{owner}: misses its DaemonSet's pods");
        for other in POOLS.iter().filter(|o| o.name != pool.name) {
            let other_spec = fleet.daemon_set(other.service).spec.as_ref().expect("a spec");
            let (other_labels, _) = pod_template(&other_spec.template, other.service);
            assert!(!selects(selector, other_labels), "{owner}: also selects pool {}'s pods", other.name);
        }
        assert!(!selects(selector, router_labels), "{owner}: also selects the router's pods");
        let ports = spec.ports.as_deref().unwrap_or_default();
        let [service_port] = ports else { panic!("{owner}: one port, not {ports:?}") };
        assert_eq!(service_port.name.as_deref(), Some("http"), "{owner}: the port's name");
        assert_eq!(service_port.port, port, "{owner}: the port");
        let target = service_port.target_port.clone().unwrap_or(IntOrString::Int(service_port.port));
        assert!(
            pod.containers.iter().any(|c| resolve_port(&target, c) == Some(port)),
            "{owner}: targetPort {target:?} is not runnerd's {port} in the pods"
        );
    }
}

#[test]
fn the_router_may_only_read_endpoint_slices_in_its_namespace() {
    let fleet = Fleet::load();
    let roles = fleet.all(|o| if let Object::Role(r) = o { Some(r) } else { None });
    let [role] = roles.as_slice() else { panic!("one Role, not {}", roles.len()) };
    assert_eq!(role.metadata.name.as_deref(), Some(ROUTER));
    let rules = role.rules.as_deref().unwrap_or_default();
    let [rule] = rules else { panic!("the Role must have exactly one rule, not {rules:?}") };
    assert_eq!(
        rule.api_groups.as_deref(),
        Some(&["discovery.k8s.io".to_owned()][..]),
        "the rule's apiGroups"
    );
    assert_eq!(rule.resources.as_deref(), Some(&["endpointslices".to_owned()][..]), "the rule's resources");
    let verbs: BTreeSet<&str> = rule.verbs.iter().map(String::as_str).collect();
    assert_eq!(verbs, BTreeSet::from(["get", "list", "watch"]), "the rule's verbs");
    assert_eq!(rule.verbs.len(), 3, "the rule's verbs, each once");
    assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none(), "{rule:?}");

    let bindings = fleet.all(|o| if let Object::RoleBinding(b) = o { Some(b) } else { None });
    let [binding] = bindings.as_slice() else { panic!("one RoleBinding, not {}", bindings.len()) };
    assert_eq!(
        (binding.role_ref.api_group.as_str(), binding.role_ref.kind.as_str(), binding.role_ref.name.as_str()),
        ("rbac.authorization.k8s.io", "Role", ROUTER),
        "the RoleBinding's roleRef"
    );
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    let [subject] = subjects else { panic!("the RoleBinding must bind one subject, not {subjects:?}") };
    assert_eq!(
        (subject.kind.as_str(), subject.name.as_str(), subject.namespace.as_deref()),
        ("ServiceAccount", ROUTER, Some(NAMESPACE)),
        "the RoleBinding's subject"
    );
    let accounts = fleet.all(|o| if let Object::ServiceAccount(a) = o { Some(a) } else { None });
    let [account] = accounts.as_slice() else { panic!("one ServiceAccount, not {}", accounts.len()) };
    assert_eq!(account.metadata.name.as_deref(), Some(ROUTER));
    assert_eq!(account.automount_service_account_token, Some(true), "the router watches the API with it");
}

#[test]
fn the_router_names_the_pools_services_reads_the_token_from_the_secret_and_is_locked_down() {
    let fleet = Fleet::load();
    let port = runnerd_port();
    let spec = fleet.deployment(ROUTER).spec.as_ref().expect("the router's spec");
    assert_eq!(spec.replicas, Some(2), "two routers from the start");
    let (labels, pod) = pod_template(&spec.template, ROUTER);
    assert!(
        selects(match_labels(&spec.selector, ROUTER), labels),
        "the Deployment's selector misses its pods"
    );
    assert_eq!(pod.service_account_name.as_deref(), Some(ROUTER));
    assert_ne!(pod.automount_service_account_token, Some(false), "the router needs its account's token");
    let [container] = pod.containers.as_slice() else { panic!("one container in the router's pod") };
    let binary = Path::new(env!("CARGO_BIN_EXE_runner-router")).file_name().expect("a name");
    assert_eq!(container.command.as_deref(), Some(&[binary.to_string_lossy().into_owned()][..]), "command");
    assert!(container.image.as_deref().is_some_and(|i| i.contains("runner-router:")), "a tagged image");

    let env = env_of(container);
    assert_eq!(env.len(), container.env.as_ref().map_or(0, Vec::len), "a variable set twice");
    assert_eq!(env_value(&env, "SCIENCE_AGENT_RUNNER_HOST"), "0.0.0.0");
    assert_eq!(env_value(&env, "SCIENCE_AGENT_RUNNER_PORT"), port.to_string());
    let services: BTreeMap<&str, &str> = env_value(&env, "SCIENCE_AGENT_ROUTER_KUBE_SERVICES")
        .split(',')
        .map(|pair| pair.split_once('=').unwrap_or_else(|| panic!("{pair:?} is not pool=service")))
        .collect();
    let pools: BTreeMap<&str, &str> = POOLS.iter().map(|p| (p.name, p.service)).collect();
    assert_eq!(services, pools, "SCIENCE_AGENT_ROUTER_KUBE_SERVICES must name every pool's Service");
    for service in services.values() {
        let spec = fleet.service(service).spec.as_ref().expect("a spec");
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "{service} is not headless");
    }
    let namespace = env.get("SCIENCE_AGENT_ROUTER_KUBE_NAMESPACE").and_then(|e| e.value_from.as_ref());
    let field = namespace.and_then(|v| v.field_ref.as_ref()).map(|f| f.field_path.as_str());
    assert_eq!(field, Some("metadata.namespace"), "the namespace from the downward API");
    let grace: u64 = env_value(&env, "SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS").parse().expect("seconds");
    assert!(grace > 0, "a lost-node grace of 0 would restore on the first missed probe");
    assert_eq!(env_value(&env, "SCIENCE_AGENT_DATA_DIR"), runnerd_data_dir(), "the nodes' data directory");

    // The token only ever as a file of the Secret, mounted read-only; never a value.
    assert!(!env.contains_key("SCIENCE_AGENT_RUNNER_TOKEN"), "the token as a variable");
    let token_file = Path::new(env_value(&env, "SCIENCE_AGENT_RUNNER_TOKEN_FILE"));
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| token_file.parent() == Some(Path::new(&m.mount_path)))
        .unwrap_or_else(|| panic!("nothing is mounted at {}", token_file.display()));
    assert_eq!(mount.read_only, Some(true), "the token's mount is read-only");
    let volume = pod.volumes.iter().flatten().find(|v| v.name == mount.name).expect("the mount's volume");
    let secret = volume.secret.as_ref().expect("the token's volume is a Secret");
    assert_eq!(secret.secret_name.as_deref(), Some(TOKEN_SECRET));
    assert!(secret.items.is_none(), "the Secret's keys are its file names");
    assert_eq!(token_file.file_name().and_then(|n| n.to_str()), Some(TOKEN_SECRET), "the Secret's key");
    assert!(secret.default_mode.is_some_and(|m| m & 0o007 == 0), "the token is not world-readable");

    if let Some(problem) = health_probe_problem(container.readiness_probe.as_ref(), container, port) {
        panic!("the router's readiness probe must be GET /health on {port}: {problem}");
    }
    // The router's /health answers 503 while no node is ready: that takes it out of its
    // Service, and must never make the kubelet restart it. Liveness is the port.
    let liveness = container.liveness_probe.as_ref().expect("the router has a liveness probe");
    let tcp =
        liveness.tcp_socket.as_ref().expect("the router's liveness probe is a TCP connect, not /health");
    assert_eq!(tcp.port, IntOrString::Int(port), "the liveness probe connects to the router's port");
    let problems = lock_down_problems(pod, container);
    assert!(problems.is_empty(), "the router: {}", problems.join(", "));
    let resources = container.resources.as_ref().expect("the router's resources");
    for (map, which) in [(&resources.requests, "requests"), (&resources.limits, "limits")] {
        let map = map.as_ref().unwrap_or_else(|| panic!("the router has no {which}"));
        assert!(
            map.contains_key("cpu") && map.contains_key("memory"),
            "the router's {which}: cpu and memory"
        );
    }
}

#[test]
fn the_router_is_served_autoscaled_and_kept_available() {
    let fleet = Fleet::load();
    let port = runnerd_port();
    let deployment = fleet.deployment(ROUTER).spec.as_ref().expect("the router's spec");
    let (labels, pod) = pod_template(&deployment.template, ROUTER);
    let selector = match_labels(&deployment.selector, ROUTER);

    let spec = fleet.service(ROUTER).spec.as_ref().expect("the router's Service");
    assert!(spec.type_.as_deref().is_none_or(|t| t == "ClusterIP"), "a ClusterIP Service");
    assert_ne!(spec.cluster_ip.as_deref(), Some("None"), "the router's Service is not headless");
    let service_selector = spec.selector.as_ref().expect("the Service's selector");
    assert!(selects(service_selector, labels), "the Service misses the router's pods");
    for pool in POOLS {
        let pool_spec = fleet.daemon_set(pool.service).spec.as_ref().expect("a spec");
        let (pool_labels, _) = pod_template(&pool_spec.template, pool.service);
        assert!(!selects(service_selector, pool_labels), "the router's Service selects pool {}", pool.name);
    }
    let ports = spec.ports.as_deref().unwrap_or_default();
    let [service_port] = ports else { panic!("the router's Service: one port, not {ports:?}") };
    assert_eq!((service_port.name.as_deref(), service_port.port), (Some("http"), port));
    let target = service_port.target_port.clone().unwrap_or(IntOrString::Int(port));
    assert_eq!(resolve_port(&target, &pod.containers[0]), Some(port), "the Service's targetPort");

    let autoscalers = fleet.all(|o| if let Object::HorizontalPodAutoscaler(h) = o { Some(h) } else { None });
    let [hpa] = autoscalers.as_slice() else { panic!("one HorizontalPodAutoscaler") };
    let hpa = hpa.spec.as_ref().expect("the autoscaler's spec");
    let target = &hpa.scale_target_ref;
    assert_eq!(
        (target.api_version.as_deref(), target.kind.as_str(), target.name.as_str()),
        (Some("apps/v1"), "Deployment", ROUTER),
        "the autoscaler scales the router"
    );
    assert_eq!((hpa.min_replicas, hpa.max_replicas), (Some(2), 10), "2..10 routers");
    let metrics = hpa.metrics.as_deref().unwrap_or_default();
    let [metric] = metrics else { panic!("one metric, not {metrics:?}") };
    let resource =
        metric.resource.as_ref().filter(|_| metric.type_ == "Resource").expect("a Resource metric");
    assert_eq!(resource.name, "cpu");
    assert_eq!(
        (resource.target.type_.as_str(), resource.target.average_utilization),
        ("Utilization", Some(70)),
        "70 % CPU"
    );

    let budgets = fleet.all(|o| if let Object::PodDisruptionBudget(p) = o { Some(p) } else { None });
    let [pdb] = budgets.as_slice() else { panic!("one PodDisruptionBudget") };
    let pdb = pdb.spec.as_ref().expect("the budget's spec");
    assert_eq!(pdb.min_available, Some(IntOrString::Int(1)), "at least one router stays");
    assert!(pdb.max_unavailable.is_none(), "minAvailable only");
    let pdb_selector =
        match_labels(pdb.selector.as_ref().expect("the budget's selector"), "PodDisruptionBudget");
    assert_eq!(pdb_selector, selector, "the budget covers the router's pods");
}

#[test]
fn the_kustomization_lists_every_manifest() {
    let text =
        std::fs::read_to_string(manifests_dir().join(KUSTOMIZATION)).expect("reading the kustomization");
    let documents = read_documents(&text).unwrap_or_else(|e| panic!("{KUSTOMIZATION}: {e}"));
    let [kustomization] = documents.as_slice() else { panic!("{KUSTOMIZATION}: one document") };
    assert_eq!(kustomization.get("kind").and_then(Value::as_str), Some("Kustomization"));
    let resources = kustomization.get("resources").and_then(Value::as_array).expect("a resources list");
    let listed: Vec<&str> =
        resources.iter().map(|r| r.as_str().unwrap_or_else(|| panic!("{r} is not a file name"))).collect();
    let unique: BTreeSet<String> = listed.iter().map(|r| (*r).to_owned()).collect();
    assert_eq!(unique.len(), listed.len(), "a file listed twice: {listed:?}");
    let files: BTreeSet<String> = yaml_files().into_iter().filter(|f| f != KUSTOMIZATION).collect();
    assert_eq!(unique, files, "{KUSTOMIZATION} must list exactly the manifests beside it");
}
