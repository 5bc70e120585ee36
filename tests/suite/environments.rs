//! Scientific environments (issue #16, R-ENV-1, R-SBX-5), end to end and offline: a conda
//! channel the test builds (`test-channel`: a `python` package holding a copy of the host
//! interpreter, tiny packages with dependencies, a corrupt one, a stub `r-base`), served as
//! `file://`; the real runnerd provisioning with the real `runner-provisioner` inside its
//! sandbox; executions that select the environments checked from inside their sandbox.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};
use serde_json::{Value, json};
use sha2::Digest;

/// A stub `r-base` whose `bin/R` writes what the sandbox it runs in can see into its
/// prefix (`probe.txt`): the CRAN step runs it in the provisioning sandbox.
const PROBE_R: &str = r#"#!/bin/sh
# A CRAN install of "slow" hangs, for a test to kill runnerd in the middle of an update.
case "$*" in *'"slow"'*) sleep 60; exit 1 ;; esac
prefix="$(cd "$(dirname "$0")/.." && pwd)"
# A CRAN install of "hog" holds 600 MB in one process (tail buffers the one long line), for
# a test to see the provisioning step's memory limit stop it.
# A CRAN install of "fifo" leaves a FIFO where the provisioner reads the conda history.
case "$*" in *'"fifo"'*) rm -f "$prefix/conda-meta/history"; mkfifo "$prefix/conda-meta/history"; exit 0 ;; esac
case "$*" in *'"hog"'*)
    head -c 600000000 /dev/zero | tail -n 1 > /dev/null && echo "hog=unlimited" > "$prefix/hog.txt" \
        || echo "hog=limited" > "$prefix/hog.txt"
    exit 1 ;;
esac
# A CRAN install of "deep" leaves a chain of 2,000 directories in the step's scratch
# workspace (hostile build code could leave 70,000), for a test to see it removed.
case "$*" in *'"deep"'*)
    cd /workspace || exit 1
    i=0
    while [ "$i" -lt 2000 ] && mkdir d && cd d; do i=$((i + 1)); done
    echo "$i" > "$prefix/deep.txt"
    exit 0 ;;
esac
# A CRAN install of "pause" takes a second, and says when it ran.
case "$*" in *'"pause"'*)
    date +%s.%N > "$prefix/pause.start"; sleep 1; date +%s.%N > "$prefix/pause.end"; exit 0 ;;
esac
# A CRAN install of "biginv" makes this R's inventory list 20,001 packages from then on.
case "$*" in *'"biginv"'*) touch "$prefix/biginv"; exit 0 ;; esac
case "$*" in *installed.packages*)
    [ -e "$prefix/biginv" ] && awk 'BEGIN { for (i = 0; i <= 20000; i++) printf "p%d\t1.0\tCRAN\n", i }'
    exit 0 ;;
esac
store="$(cd "$prefix/../../.." && pwd)"
data="$(cd "$store/.." && pwd)"
{
echo "args: $*"
[ -e "$store/catalog.json" ] && echo "catalog=visible" || echo "catalog=missing"
[ -e "$data/projects" ] && echo "projects=visible" || echo "projects=missing"
[ -e "$store/revisions/starter-python" ] && echo "starter=visible" || echo "starter=missing"
env | grep -q SCIENCE_AGENT && echo "runner-variables=set" || echo "runner-variables=unset"
touch /usr/probe 2>/dev/null && echo "writable-usr=yes" || echo "writable-usr=no"
} > "$prefix/probe.txt"
# Plants a link to where the package cache is (as hostile build code could), for the next
# conda step of this environment to refuse.
ln -s "$store/provisioner" "$prefix/lib-planted" 2>/dev/null
"#;

/// Builds the demo channel (`tinyutil` 1.0/2.0, `tinylib` → `tinyutil`, `broken`, a stub
/// `r-base`, `python` from the host) plus the probing `r-base` in `dir`; its `file://` URL.
fn demo_channel(dir: &Path) -> String {
    let mut channel = test_channel::demo(dir).expect("the test channel builds");
    channel
        .package(test_channel::Pkg::noarch("r-base", "4.4.1").file("bin/R", PROBE_R.as_bytes(), true))
        .expect("the probing r-base builds");
    channel.index().expect("the channel indexes");
    channel.url()
}

struct Envs {
    server: Server,
    _channel: tempfile::TempDir,
    channel_dir: PathBuf,
}

/// The environment every server of these tests runs with, for the channel at `url`.
fn base_env(url: String) -> Vec<(String, String)> {
    vec![
        ("SCIENTIFIC_ENVS".to_owned(), "1".to_owned()),
        ("SCIENCE_AGENT_SCIENTIFIC_CHANNELS".to_owned(), url),
        ("SCIENCE_AGENT_STARTER_PYTHON_SPECS".to_owned(), "python,tinyutil=1.0".to_owned()),
        ("SCIENCE_AGENT_STARTER_R_SPECS".to_owned(), "r-base".to_owned()),
        ("SCIENCE_AGENT_CRAN_REPO".to_owned(), "file:///nonexistent-cran".to_owned()),
    ]
}

fn start(extra: &[(&str, &str)]) -> Envs {
    let channel = runner_tests::scratch_dir();
    let channel_dir = channel.path().join("channel");
    let url = demo_channel(&channel_dir);
    runner_tests::hand_tree_to_sandbox(channel.path());
    let mut env = base_env(url);
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    Envs { server, _channel: channel, channel_dir }
}

/// Polls `GET /environment-setup` until it leaves `installing`.
pub(super) async fn setup_outcome(server: &Server) -> Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let reply = server.client().get("/environment-setup").await.unwrap();
        assert_eq!(reply.status, 200);
        let v = reply.json();
        if v["state"] != "installing" && v["state"] != "not-started" {
            return v;
        }
        assert!(Instant::now() < deadline, "setup still {v} (stderr: {})", server.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn ready(extra: &[(&str, &str)]) -> Envs {
    let envs = start(extra);
    let setup = setup_outcome(&envs.server).await;
    assert_eq!(setup["state"], "ready", "{setup}\n{}", envs.server.stderr());
    envs
}

/// Another runnerd on `envs`' data directory and channel, configured as [`start`] does
/// (the first one stopped or killed beforehand).
fn restart(envs: &Envs) -> Server {
    let mut env = base_env(format!("file://{}", envs.channel_dir.display()));
    env.push(("SCIENCE_AGENT_DATA_DIR".to_owned(), envs.server.data_dir.display().to_string()));
    Server::start_with(ServerOptions { env, ..Default::default() })
}

/// A task R environment named `name` (from the probing stub `r-base`): its id and record.
async fn r_environment(server: &Server, name: &str) -> (String, Value) {
    let (status, env) = post(server, "/environments", json!({"name": name, "language": "r"})).await;
    assert_eq!(status, 201, "{env}\n{}", server.stderr());
    (env["id"].as_str().unwrap().to_owned(), env)
}

pub(super) async fn get(server: &Server, path: &str) -> (u16, Value) {
    let reply = server.client().get(path).await.unwrap();
    (reply.status, reply.json())
}

pub(super) async fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    let reply = server.client().post_json(path, &body).await.unwrap();
    (reply.status, reply.json())
}

async fn shell(server: &Server, env: Option<&str>, code: &str) -> Value {
    let ws = server.project_workspace("envs");
    let mut body = shell_request("main", "envs", &ws, code);
    if let Some(e) = env {
        body["environmentId"] = e.into();
    }
    let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    reply.json()
}

async fn python(server: &Server, revision: Option<&str>, code: &str) -> (u16, Value) {
    let ws = server.project_workspace("envs");
    let mut body = shell_request("main", "envs", &ws, code);
    if let Some(r) = revision {
        body["environmentRevisionId"] = r.into();
    }
    let reply = server.client().post_signed("/execute", &body).await.unwrap();
    (reply.status, reply.json())
}

pub(super) fn environment<'a>(list: &'a Value, id: &str) -> &'a Value {
    list.as_array().unwrap().iter().find(|e| e["id"] == id).unwrap_or_else(|| panic!("no {id} in {list}"))
}

const PYTHON_PROBE: &str = r#"
import os, sys, subprocess
print("prefix=" + sys.prefix)
print("executable=" + sys.executable)
print("tinyutil=" + subprocess.run(["tinyutil"], capture_output=True, text=True).stdout.strip())
try:
    open("/opt/science-env/planted", "w")
    print("write=allowed")
except OSError:
    print("write=refused")
try:
    r = subprocess.run(["/usr/bin/python3", "-c", "print('host')"], capture_output=True, text=True)
    print("host-python=" + (r.stdout.strip() or "masked"))
except OSError:
    print("host-python=masked")
print("host-python-size=%d" % os.path.getsize(os.path.realpath("/usr/bin/python3")))
print("path=" + os.environ["PATH"])
"#;

#[tokio::test]
async fn setup_creates_the_starter_and_python_runs_in_it_read_only_with_host_interpreters_masked() {
    if !sandbox_or_skip("setup_creates_the_starter_and_python_runs_in_it") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (_, health) = get(s, "/health").await;
    let sci = &health["scientificEnvs"];
    assert_eq!(sci["available"], true, "{sci}");
    assert_eq!((sci["enabled"].clone(), sci["startersReady"].clone()), (json!(true), json!(true)));
    assert_eq!(sci["languages"], json!(["python", "r"]));
    assert_eq!(sci["provisioner"], "runner-provisioner");

    let (status, list) = get(s, "/environments").await;
    assert_eq!(status, 200, "{list}");
    let starter = environment(&list, "starter-python");
    assert_eq!((starter["kind"].as_str(), starter["status"].as_str()), (Some("starter"), Some("ready")));
    let rev = starter["currentRevisionId"].as_str().unwrap().to_owned();
    assert!(rev.starts_with("rev-"), "{rev}");

    let (status, v) = python(s, None, PYTHON_PROBE).await;
    assert_eq!(status, 200, "{v}");
    let out = v["stdout"].as_str().unwrap();
    assert!(out.contains("prefix=/opt/science-env\n"), "{v}");
    assert!(out.contains("executable=/opt/science-env/bin/python"), "{out}");
    assert!(out.contains("tinyutil=tinyutil 1.0\n"), "{out}");
    assert!(out.contains("write=refused\n"), "the prefix is read-only: {out}");
    assert!(out.contains("host-python=masked\nhost-python-size=0\n"), "host interpreters are masked: {out}");
    assert!(out.contains("path=/opt/science-env/bin:/usr/bin\n"), "{out}");
    assert_eq!(v["environmentRevisionId"], rev.as_str());
    // The prefix is also at its own path (conda prefixes embed it).
    let prefix = s.path(&format!("scientific-envs/revisions/starter-python/{rev}"));
    let (_, v) =
        python(s, None, &format!("import os; print(os.path.isdir({:?}))", prefix.display().to_string()))
            .await;
    assert_eq!(v["stdout"], "True\n", "{v}");
}

#[tokio::test]
async fn task_environments_change_in_place_with_a_revision_and_a_verified_snapshot_per_change() {
    if !sandbox_or_skip("task_environments_change_in_place") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (status, env) = post(s, "/environments", json!({"name": "analysis", "language": "python"})).await;
    assert_eq!(status, 201, "{env}");
    let id = env["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("task-"), "{env}");
    assert_eq!(
        (env["kind"].as_str(), env["baseEnvironmentId"].as_str()),
        (Some("task"), Some("starter-python"))
    );
    let first = env["currentRevisionId"].as_str().unwrap().to_owned();
    let runtime = env["runtimeRevisionId"].as_str().unwrap().to_owned();
    assert_eq!(first, runtime);
    let (status, again) = post(s, "/environments", json!({"name": "ANALYSIS", "language": "python"})).await;
    assert_eq!(status, 400, "names are unique case-insensitively: {again}");

    // Upgrade in place: a new revision, the same prefix.
    let (status, rev) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["tinyutil=2.0"]})).await;
    assert_eq!(status, 201, "{rev}");
    let second = rev["id"].as_str().unwrap().to_owned();
    assert_ne!(second, first);
    assert_eq!(rev["environmentId"], id.as_str());
    assert!(
        rev["packages"].as_array().unwrap().iter().any(|p| p.as_str().unwrap().starts_with("tinyutil=2.0=")),
        "{rev}"
    );
    let (_, list) = get(s, "/environments").await;
    let e = environment(&list, &id);
    assert_eq!(
        (e["currentRevisionId"].as_str(), e["runtimeRevisionId"].as_str()),
        (Some(second.as_str()), Some(runtime.as_str()))
    );
    let v = shell(s, Some(&id), "tinyutil; echo \"$PATH\"").await;
    assert_eq!(v["stdout"], "tinyutil 2.0\n/opt/science-env/bin:/usr/bin:/bin\n", "{v}");
    assert_eq!(v["environmentRevisionId"], second.as_str());

    // The snapshot: raw bytes whose hash and size the revision records.
    let reply = s.client().get(&format!("/environment-revisions/{second}/snapshot")).await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json; charset=utf-8"));
    let hash: String = sha2::Sha256::digest(&reply.body).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(rev["snapshot"]["hash"], hash.as_str());
    assert_eq!(rev["snapshot"]["size"], reply.body.len());
    assert_eq!(rev["packageSpecHash"], hash.as_str());
    let snap: Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(snap["format"], "sciencediscovery-environment-revision-v2");
    assert_eq!(snap["requestedChanges"], json!(["conda:tinyutil=2.0"]));
    assert_eq!(snap["reconstruction"]["status"], "reference-only");
    assert!(
        reply.body.ends_with(b"}\n") && reply.body.starts_with(b"{\n  \""),
        "2-space pretty with a newline"
    );

    // Only the current revision runs.
    let (status, v) = python(s, Some(&first), "print(1)").await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("audit-only"), "{v}");
    let (status, v) = python(s, Some("rev-00000000-0000-4000-8000-000000000000"), "print(1)").await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], "Unknown environment revision; select a current environment");

    // A failed install keeps the revision, fails the environment, and a later one repairs it.
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["no-such-package"]})).await;
    assert_eq!(status, 400, "{v}");
    let (_, list) = get(s, "/environments").await;
    let e = environment(&list, &id);
    assert_eq!(e["status"], "failed");
    assert_eq!(e["currentRevisionId"], second.as_str());
    assert!(e["error"].as_str().unwrap().starts_with("In-place update failed"), "{e}");
    let ws = s.project_workspace("envs");
    let mut body = shell_request("main", "envs", &ws, "true");
    body["environmentId"] = id.clone().into();
    let reply = s.client().post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 400);
    assert!(reply.json()["error"].as_str().unwrap().contains("is failed"), "{}", reply.json());
    let (status, rev3) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{rev3}");
    let (_, list) = get(s, "/environments").await;
    assert_eq!(environment(&list, &id)["status"], "ready");

    // Uninstall.
    let (status, rev4) =
        post(s, &format!("/environments/{id}/uninstall"), json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{rev4}");
    assert!(
        !rev4["packages"].as_array().unwrap().iter().any(|p| p.as_str().unwrap().starts_with("tinylib="))
    );

    // Tampered snapshot bytes are refused.
    let file = s.path(&format!("scientific-envs/snapshots/{second}.json"));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[5] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let (status, v) = get(s, &format!("/environment-revisions/{second}/snapshot")).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"], format!("Environment revision snapshot is corrupt: {second}"));

    // Starters are read-only and undeletable; delete keeps revisions and snapshots.
    let (status, _) = post(s, "/environments/starter-python/install", json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 400);
    let reply =
        s.client().send_bytes("DELETE", "/environments/starter-python", &[], Vec::new()).await.unwrap();
    assert_eq!(reply.status, 400);
    let reply =
        s.client().send_bytes("DELETE", &format!("/environments/{id}"), &[], Vec::new()).await.unwrap();
    assert_eq!((reply.status, reply.json()), (200, json!({"deleted": id})));
    let (_, revisions) = get(s, "/environment-revisions").await;
    let kept = revisions.as_array().unwrap().iter().filter(|r| r["environmentId"] == id.as_str()).count();
    assert_eq!(kept, 4, "{revisions}");
    assert!(!s.path(&format!("scientific-envs/revisions/{id}")).exists());
    let rev4_id = rev4["id"].as_str().unwrap();
    assert_eq!(get(s, &format!("/environment-revisions/{rev4_id}/snapshot")).await.0, 200);
}

/// Issue #30: the original's behaviour and shapes — a ready store's setup is not redone, the
/// setup view's fields, starter names, the full language version, no invented requested
/// change on a first revision, and a source the manager does not use refused.
#[tokio::test]
async fn environments_answer_with_the_originals_shapes() {
    if !sandbox_or_skip("environments_answer_with_the_originals_shapes") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (_, setup) = get(s, "/environment-setup").await;
    assert_eq!(
        (setup["state"].as_str(), setup["phase"].as_str()),
        (Some("ready"), Some("complete")),
        "{setup}"
    );
    assert!(setup["completedAt"].is_string(), "{setup}");
    assert_eq!(setup["allowedChannels"], setup["channels"], "{setup}");
    let (_, before) = get(s, "/environments").await;
    let starter = environment(&before, "starter-python").clone();
    assert_eq!(starter["name"], "Starter Python", "{starter}");

    // A confirmed setup on a ready store answers `ready` and changes nothing.
    let (status, again) = post(s, "/environment-setup", json!({"confirmed": true})).await;
    assert_eq!((status, again["state"].as_str()), (202, Some("ready")), "{again}");
    assert_eq!(again["startedAt"], setup["startedAt"], "{again}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, after) = get(s, "/environments").await;
    assert_eq!(after, before);

    // The starter's and a clone's first revisions record no requested change, and the
    // language version is the full one.
    let (status, env) = post(s, "/environments", json!({"name": "shapes", "language": "python"})).await;
    assert_eq!(status, 201, "{env}");
    let id = env["id"].as_str().unwrap().to_owned();
    for rev in [starter["currentRevisionId"].as_str().unwrap(), env["currentRevisionId"].as_str().unwrap()] {
        let reply = s.client().get(&format!("/environment-revisions/{rev}/snapshot")).await.unwrap();
        let snap: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(snap["requestedChanges"], json!([]), "{snap}");
    }
    let (_, revisions) = get(s, "/environment-revisions").await;
    for r in revisions.as_array().unwrap() {
        let version = r["languageVersion"].as_str().unwrap_or_default();
        assert_eq!(version.matches('.').count(), 2, "a full X.Y.Z version: {r}");
    }

    // A source the manager does not use.
    let path = format!("/environments/{id}/install");
    let body = json!({"packages": ["tinyutil=2.0"], "indexUrl": "https://pypi.example/simple"});
    let (status, v) = post(s, &path, body).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("indexUrl is only supported for pip installs")),
        "{v}"
    );
    let body = json!({"packages": ["tinyutil"], "manager": "pip", "channels": ["conda-forge"]});
    let (status, v) = post(s, &path, body).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("channels are only supported for conda installs")),
        "{v}"
    );
}

#[tokio::test]
async fn concurrent_installs_into_one_environment_both_land() {
    if !sandbox_or_skip("concurrent_installs_into_one_environment_both_land") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (_, env) = post(s, "/environments", json!({"name": "both", "language": "python"})).await;
    let id = env["id"].as_str().unwrap().to_owned();
    let path = format!("/environments/{id}/install");
    let (a, b) = tokio::join!(
        post(s, &path, json!({"packages": ["tinyutil=2.0"]})),
        post(s, &path, json!({"packages": ["tinylib"]}))
    );
    assert_eq!((a.0, b.0), (201, 201), "{a:?} {b:?}");
    let v = shell(s, Some(&id), "tinyutil; ls /opt/science-env/share").await;
    assert!(v["stdout"].as_str().unwrap().starts_with("tinyutil 2.0\n"), "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("tinylib"), "{v}");
}

#[tokio::test]
async fn the_catalog_survives_a_restart_and_an_interrupted_update_becomes_failed() {
    if !sandbox_or_skip("the_catalog_survives_a_restart") {
        return;
    }
    let mut envs = ready(&[]).await;
    let (_, env) = post(&envs.server, "/environments", json!({"name": "kept", "language": "python"})).await;
    let id = env["id"].as_str().unwrap().to_owned();
    envs.server.stop();
    // As a crash in the middle of an update leaves it.
    let catalog_path = envs.server.path("scientific-envs/catalog.json");
    let mut catalog: Value = serde_json::from_slice(&std::fs::read(&catalog_path).unwrap()).unwrap();
    for e in catalog["environments"].as_array_mut().unwrap() {
        if e["id"] == id.as_str() {
            e["status"] = "updating".into();
        }
    }
    std::fs::write(&catalog_path, serde_json::to_vec_pretty(&catalog).unwrap()).unwrap();
    // And as a crash in the middle of a create leaves it: a prefix no environment names.
    let orphan = envs.server.path("scientific-envs/revisions/task-0000/rev-0000");
    std::fs::create_dir_all(orphan.join("bin")).unwrap();
    let restarted = restart(&envs);
    assert_eq!(setup_outcome(&restarted).await["state"], "ready");
    let (_, list) = get(&restarted, "/environments").await;
    let e = environment(&list, &id);
    assert_eq!(e["status"], "failed");
    assert_eq!(
        e["error"],
        "Environment update was interrupted; repair through environment management before execution."
    );
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&catalog_path).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn the_provisioning_sandbox_sees_only_its_prefix_and_never_the_token() {
    if !sandbox_or_skip("the_provisioning_sandbox_sees_only_its_prefix") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    // An R environment from the stub r-base: its `bin/R` is a script of the test channel that
    // writes what it can see into its prefix when the CRAN step runs it.
    let (id, env) = r_environment(s, "r-probe").await;
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["survival"], "manager": "cran"}))
            .await;
    assert_eq!(status, 201, "{v}\n{}", s.stderr());
    let probe = s.path(&format!(
        "scientific-envs/revisions/{id}/{}/probe.txt",
        env["runtimeRevisionId"].as_str().unwrap()
    ));
    let seen = std::fs::read_to_string(&probe).unwrap();
    for line in [
        "catalog=missing",
        "projects=missing",
        "starter=missing",
        "runner-variables=unset",
        "writable-usr=no",
    ] {
        assert!(seen.contains(line), "{line:?} not in:\n{seen}");
    }
    assert!(
        seen.contains("args: --vanilla --slave -e options(warn = 1); pkgs <- c(\"survival\");"),
        "{seen}"
    );
    assert!(
        seen.contains("install.packages(pkgs, repos = \"file:///nonexistent-cran\", Ncpus = 1)"),
        "{seen}"
    );

    // The link the R step planted (to the package cache's path) stops the next conda step
    // before it writes anything.
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["tinyutil"]})).await;
    assert_eq!(status, 400, "{v}");
    let error = v["error"].as_str().unwrap();
    assert!(error.contains("holds a link that leaves it (lib-planted -> "), "{error}");
}

#[tokio::test]
async fn setup_and_routes_refuse_clearly() {
    if !sandbox_or_skip("setup_and_routes_refuse_clearly") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let cases: &[(&str, Value, &str)] = &[
        ("/environment-setup", json!({}), "Scientific environment setup requires explicit confirmation"),
        (
            "/environment-setup",
            json!({"confirmed": "yes"}),
            "Scientific environment setup requires explicit confirmation",
        ),
        ("/environments", json!({"name": "", "language": "python"}), "Environment name"),
        ("/environments", json!({"name": "-bad", "language": "python"}), "Environment name"),
        (
            "/environments",
            json!({"name": "x", "language": "julia"}),
            "Unsupported environment language: julia",
        ),
        ("/environments/starter-python/install", json!({"packages": ["x"]}), "read-only"),
        ("/environments/task-0000/install", json!({"packages": ["x"]}), "Environment not found: task-0000"),
    ];
    for (path, body, want) in cases {
        let (status, v) = post(s, path, body.clone()).await;
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(want), "{path} {body}: {v}");
    }
    let (_, env) = post(s, "/environments", json!({"name": "refusals", "language": "python"})).await;
    let id = env["id"].as_str().unwrap().to_owned();
    let install = format!("/environments/{id}/install");
    let cases: &[(Value, &str)] = &[
        (json!({"packages": []}), "At least one package is required"),
        (json!({"packages": ["--extra-index-url=https://x"], "manager": "pip"}), ""),
        (json!({"packages": ["a b"]}), ""),
        (
            json!({"packages": ["x"], "channels": ["https://attacker.example/conda"]}),
            "Package channels are not allowed",
        ),
        (json!({"packages": ["x"], "manager": "pip", "indexUrl": "http://pypi.example/simple"}), "HTTPS"),
        (
            json!({"packages": ["x"], "manager": "npm"}),
            "Package manager must be conda, pip, cran or bioconductor: npm",
        ),
        (json!({"packages": ["../escape.whl"], "manager": "pip", "runnerWorkspaceKey": "w"}), ""),
        (json!({"packages": ["/etc/passwd.whl"], "manager": "pip", "runnerWorkspaceKey": "w"}), ""),
        (json!({"packages": ["x.whl"], "manager": "pip", "runnerWorkspaceKey": "../escape"}), ""),
        (
            json!({"packages": ["https://example.org/x-1.0-py3-none-any.whl"], "manager": "pip", "runnerWorkspaceKey": "w"}),
            "",
        ),
        (json!({"packages": ["survival"], "manager": "cran"}), "not an R environment"),
    ];
    for (body, want) in cases {
        let (status, v) = post(s, &install, body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v["error"].as_str().unwrap().contains(want), "{body}: {v}");
    }
    // None of them touched the environment.
    let (_, list) = get(s, "/environments").await;
    assert_eq!(environment(&list, &id)["status"], "ready");
    assert_eq!(environment(&list, &id)["currentRevisionId"], env["currentRevisionId"]);
}

#[tokio::test]
async fn disabled_by_configuration_answers_as_the_original() {
    let s = Server::start_with(ServerOptions {
        env: vec![("SCIENTIFIC_ENVS".into(), "0".into())],
        ..Default::default()
    });
    let (_, health) = get(&s, "/health").await;
    assert_eq!(
        health["scientificEnvs"],
        json!({"available": false, "enabled": false, "languages": [], "provisioner": null, "startersReady": false,
               "unavailableReason": "Scientific environments are disabled by configuration"})
    );
    let (status, v) = get(&s, "/environments").await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("Scientific environments are disabled by configuration"))
    );
    assert!(!s.path("scientific-envs").exists(), "nothing is created when disabled");
}

#[tokio::test]
async fn a_setup_that_cannot_reach_its_channel_fails_with_an_action() {
    if !sandbox_or_skip("a_setup_that_cannot_reach_its_channel_fails_with_an_action") {
        return;
    }
    let envs = start(&[("SCIENCE_AGENT_SCIENTIFIC_CHANNELS", "file:///nonexistent-channel")]);
    let setup = setup_outcome(&envs.server).await;
    assert_eq!(setup["state"], "failed", "{setup}");
    assert_eq!(setup["components"]["micromamba"]["state"], "ready");
    assert_eq!(setup["components"]["conda"]["state"], "failed");
    assert!(setup["components"]["conda"]["action"].as_str().unwrap().contains("Conda channels"), "{setup}");
    let (_, health) = get(&envs.server, "/health").await;
    assert_eq!(health["scientificEnvs"]["available"], false);
    // Python still runs on the host interpreter, as without the capability.
    let (status, v) = python(&envs.server, None, "import sys; print(sys.prefix)").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["environmentRevisionId"], "system-python3-bwrap-v1");
    // POST /environment-setup retries (202).
    let (status, v) = post(&envs.server, "/environment-setup", json!({"confirmed": true})).await;
    assert_eq!(status, 202, "{v}");
}

/// A wheel the test builds with the host's zipfile: one module, METADATA, WHEEL, RECORD.
fn build_wheel(path: &Path, name: &str, version: &str, value: &str) {
    wheel(path, name, version, value, &[]);
}

/// A wheel of module `name` that also installs `zeros`: `(file name, size)`, each that many
/// zero bytes (compressed in the wheel).
pub(super) fn build_wheel_with(path: &Path, name: &str, version: &str, zeros: &[(&str, usize)]) {
    wheel(path, name, version, "with-data", zeros);
}

fn wheel(path: &Path, name: &str, version: &str, value: &str, zeros: &[(&str, usize)]) {
    let script = r#"
import sys, zipfile
path, name, version, value = sys.argv[1:5]
info = f"{name}-{version}.dist-info"
files = {
    f"{name}.py": f"VALUE = {value!r}\n",
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
for extra in sys.argv[5:]:
    file, size = extra.split("=")
    files[file] = b"\0" * int(size)
files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
    for k, v in files.items():
        z.writestr(k, v)
"#;
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let status = std::process::Command::new("/usr/bin/python3")
        .args(["-I", "-c", script])
        .arg(path)
        .args([name, version, value])
        .args(zeros.iter().map(|(file, size)| format!("{file}={size}")))
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test]
async fn a_workspace_wheel_installs_with_pip_and_is_kept_by_content() {
    if !sandbox_or_skip("a_workspace_wheel_installs_with_pip_and_is_kept_by_content") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (_, env) = post(s, "/environments", json!({"name": "wheels", "language": "python"})).await;
    let id = env["id"].as_str().unwrap().to_owned();
    let ws = s.path("remote-workspaces/wheel-ws");
    let wheel = ws.join("dist/tinywheel-1.0-py3-none-any.whl");
    build_wheel(&wheel, "tinywheel", "1.0", "from-the-wheel");
    runner_tests::hand_tree_to_sandbox(&ws);
    let body = json!({"manager": "pip", "packages": ["dist/tinywheel-1.0-py3-none-any.whl"], "runnerWorkspaceKey": "wheel-ws"});
    let (status, rev) = post(s, &format!("/environments/{id}/install"), body).await;
    assert_eq!(status, 201, "{rev}\n{}", s.stderr());
    let wheels = &rev["localWheels"];
    assert_eq!(wheels[0]["distribution"], "tinywheel", "{rev}");
    assert_eq!((wheels[0]["version"].as_str(), wheels[0]["manager"].as_str()), (Some("1.0"), Some("pip")));
    assert_eq!(wheels[0]["sourcePath"], "dist/tinywheel-1.0-py3-none-any.whl");
    assert!(rev["packages"].as_array().unwrap().contains(&json!("python:tinywheel==1.0")), "{rev}");
    let hash = wheels[0]["content"]["hash"].as_str().unwrap();
    let kept = s.path(&format!("scientific-envs/wheels/{hash}/tinywheel-1.0-py3-none-any.whl"));
    std::fs::remove_dir_all(&ws).unwrap();
    assert!(kept.is_file(), "the wheel outlives the workspace");

    let rev_id = rev["id"].as_str().unwrap();
    let (status, v) =
        python(s, Some(rev_id), "import tinywheel, sys; print(tinywheel.VALUE); print(tinywheel.__file__)")
            .await;
    assert_eq!(status, 200, "{v}");
    let out = v["stdout"].as_str().unwrap();
    assert!(out.starts_with("from-the-wheel\n/opt/science-env/lib/python3"), "{v}");
    // Outside the environment the module does not exist.
    let v = shell(s, None, "/usr/bin/python3 -c 'import tinywheel' 2>&1 || echo absent").await;
    assert!(v["stdout"].as_str().unwrap().ends_with("absent\n"), "{v}");
}

#[tokio::test]
async fn a_managed_run_uses_the_environment_it_names() {
    if !sandbox_or_skip("a_managed_run_uses_the_environment_it_names") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let ws = s.project_workspace("managed");
    let mut body = shell_request("main", "managed", &ws, "tinyutil; echo \"$PATH\"");
    body["environmentId"] = "starter-python".into();
    let reply = s.client().post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", String::from_utf8_lossy(&reply.body));
    let id = reply.json()["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    let record = loop {
        let (_, rec) = get(s, &format!("/shell-executions/{id}?sessionId=managed&agentId=main")).await;
        if matches!(rec["state"].as_str(), Some("completed" | "failed" | "cancelled" | "unknown")) {
            break rec;
        }
        assert!(Instant::now() < deadline, "{rec}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(record["state"], "completed", "{record}");
    let (_, logs) =
        get(s, &format!("/shell-executions/{id}/logs?sessionId=managed&agentId=main&cursor=0")).await;
    let text: String = logs["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["stream"] == "stdout")
        .map(|e| e["text"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(text, "tinyutil 1.0\n/opt/science-env/bin:/usr/bin:/bin\n", "{logs}");
}

/// Serves `dir` over plain HTTP on loopback (GET only), as an offline site's mirror would.
pub(super) fn serve_channel(dir: PathBuf) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let dir = dir.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    return;
                }
                // The rest of the head.
                let mut header = String::new();
                while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                    header.clear();
                }
                let target = line.split_whitespace().nth(1).unwrap_or("/");
                // Absolute-form through a proxy (`http://host:port/path`) or origin-form.
                let path = target
                    .strip_prefix("http://")
                    .map_or(target, |rest| rest.find('/').map_or("/", |i| &rest[i..]));
                let file = dir.join(path.trim_start_matches('/'));
                let mut out = stream;
                let safe = !path.contains("..");
                match std::fs::read(&file).ok().filter(|_| safe && file.is_file()) {
                    Some(body) => {
                        let _ = write!(
                            out,
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            body.len()
                        );
                        let _ = out.write_all(&body);
                    }
                    None => {
                        let _ = out.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                        );
                    }
                }
            });
        }
    });
    (port, requests)
}

#[tokio::test]
async fn a_channel_over_plain_http_is_reached_through_egressd_only() {
    if !sandbox_or_skip("a_channel_over_plain_http_is_reached_through_egressd_only") {
        return;
    }
    // egressd allowlists names only: the mirror is a name on a private (loopback) address,
    // allowed because the operator configured it.
    let served = ServedChannel::ready(&[("channel.test", &["127.0.0.1"])], |port| {
        format!("http://channel.test:{port}")
    })
    .await;
    let (server, egressd) = (&served.server, &served.egressd);
    // The provisioning sandbox reached it through a gateway of its own policy.
    let log = egressd.log();
    assert!(log.contains("host=channel.test") && log.contains("decision=\"allowed\""), "{log}");
    let v = shell(server, Some("starter-python"), "tinyutil").await;
    assert_eq!(v["stdout"], "tinyutil 1.0\n", "{v}");
}

/// runnerd whose only channel is the demo channel served over HTTP at `url(port)`, with
/// egressd on a fake DNS of `names`; setup ready, and the channel read over HTTP.
struct ServedChannel {
    server: Server,
    egressd: runner_tests::egress::Egressd,
    port: u16,
    _dns: runner_tests::egress::FakeDns,
    _channel: tempfile::TempDir,
}

impl ServedChannel {
    async fn ready(names: &[(&str, &[&str])], url: impl Fn(u16) -> String) -> ServedChannel {
        let channel = runner_tests::scratch_dir();
        let dir = channel.path().join("channel");
        demo_channel(&dir);
        let (port, requests) = serve_channel(dir.clone());
        let dns = runner_tests::egress::FakeDns::start(names);
        let egressd = runner_tests::egress::Egressd::start(dns.addr, &[]);
        let mut env: Vec<(String, String)> = egressd.runner_env();
        env.extend([
            ("SCIENTIFIC_ENVS".to_owned(), "1".to_owned()),
            ("SCIENCE_AGENT_SCIENTIFIC_CHANNELS".to_owned(), url(port)),
            ("SCIENCE_AGENT_STARTER_PYTHON_SPECS".to_owned(), "python,tinyutil=1.0".to_owned()),
        ]);
        let server = Server::start_with(ServerOptions { env, ..Default::default() });
        let setup = setup_outcome(&server).await;
        assert_eq!(setup["state"], "ready", "{setup}\n{}\n{}", server.stderr(), egressd.log());
        assert!(requests.load(std::sync::atomic::Ordering::SeqCst) > 0, "the channel was read over HTTP");
        ServedChannel { server, egressd, port, _dns: dns, _channel: channel }
    }
}

/// Issue #30: a channel the operator configured by IP literal (`http://127.0.0.1:<port>`) is
/// reached by the provisioning step as configured — a pinned origin of its gateway — and the
/// same gateway refuses another port of the same host, the same host over a tunnel, and any
/// other IP literal.
#[tokio::test]
async fn a_channel_configured_by_ip_literal_is_reached_exactly_as_configured() {
    if !sandbox_or_skip("a_channel_configured_by_ip_literal_is_reached_exactly_as_configured") {
        return;
    }
    let served = ServedChannel::ready(&[], |port| format!("http://127.0.0.1:{port}")).await;
    let (server, egressd, port) = (&served.server, &served.egressd, served.port);
    let configured = format!("http://127.0.0.1:{port}");
    let log = egressd.log();
    assert!(log.contains(&format!("pinned_origins={configured}")), "{log}");
    assert!(log.contains("host=127.0.0.1") && log.contains("decision=\"allowed\""), "{log}");
    let v = shell(server, Some("starter-python"), "tinyutil").await;
    assert_eq!(v["stdout"], "tinyutil 1.0\n", "{v}");

    // The same policy's gateway, asked directly: exactly that origin, nothing beside it.
    use common::egress::protocol::{ControlRequest, ControlResponse, GatewayPolicy};
    let policy = GatewayPolicy {
        revision: "pinned-test".into(),
        allowed_domains: Vec::new(),
        allow_private_network: false,
        pinned_origins: vec![configured.clone()],
    };
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let request = ControlRequest::Acquire {
        identity: policy.identity(),
        policy,
        route: common::egress::ProxySetting::Direct,
        sandbox_uid: uid,
    };
    // The lease lives as long as this connection.
    let mut control = std::os::unix::net::UnixStream::connect(&egressd.control_socket).unwrap();
    common::channel::write_message(&mut control, &request).unwrap();
    let socket = match common::channel::read_message::<ControlResponse>(&mut control).unwrap() {
        ControlResponse::Gateway { socket_path } => socket_path,
        other => panic!("{other:?}"),
    };
    let ask = |request: String| {
        runner_tests::egress::exchange(&socket, request.as_bytes(), Duration::from_secs(10))
    };
    let allowed = ask(format!(
        "GET http://127.0.0.1:{port}/noarch/repodata.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ));
    assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
    let other_port = port.checked_add(1).unwrap_or(port - 1);
    for request in [
        format!("GET http://127.0.0.1:{other_port}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\n\r\n"),
        format!("GET http://127.0.0.2:{port}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    ] {
        let refused = ask(request.clone());
        assert!(refused.starts_with("HTTP/1.1 403"), "{request:?} -> {refused}");
    }
}

#[tokio::test]
async fn runnerd_killed_during_an_install_restarts_with_the_environment_failed_and_repairable() {
    if !sandbox_or_skip("runnerd_killed_during_an_install_restarts_with_the_environment_failed") {
        return;
    }
    let mut envs = ready(&[]).await;
    let (id, env) = r_environment(&envs.server, "killed").await;
    let before = env["currentRevisionId"].as_str().unwrap().to_owned();
    let client = envs.server.client();
    let path = format!("/environments/{id}/install");
    let hung = tokio::spawn(async move {
        client.post_json(&path, &json!({"packages": ["slow"], "manager": "cran"})).await.map(|r| r.status)
    });
    // `updating` is on disk before the step runs.
    let catalog_path = envs.server.path("scientific-envs/catalog.json");
    let status_on_disk = || -> String {
        let c: Value = serde_json::from_slice(&std::fs::read(&catalog_path).unwrap()).unwrap();
        c["environments"].as_array().unwrap().iter().find(|e| e["id"] == id.as_str()).unwrap()["status"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while status_on_disk() != "updating" {
        assert!(Instant::now() < deadline, "never updating");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    envs.server.child.kill().unwrap();
    envs.server.child.wait().unwrap();
    assert!(hung.await.unwrap().is_err(), "the request died with runnerd");

    let restarted = restart(&envs);
    assert_eq!(setup_outcome(&restarted).await["state"], "ready");
    let (_, list) = get(&restarted, "/environments").await;
    let e = environment(&list, &id);
    assert_eq!(e["status"], "failed", "{e}");
    assert_eq!(e["currentRevisionId"], before.as_str(), "the last good revision stays current");
    assert!(e["error"].as_str().unwrap().contains("interrupted"), "{e}");
    // Runs are refused until a change repairs it (the workspace is in the data directory the
    // restarted runnerd serves, the first server's).
    let ws = envs.server.project_workspace("envs");
    let run = |code: &str| {
        let mut body = shell_request("main", "envs", &ws, code);
        body["environmentId"] = id.clone().into();
        body
    };
    let reply = restarted.client().post_signed("/execute-shell", &run("true")).await.unwrap();
    assert_eq!(reply.status, 400, "{}", String::from_utf8_lossy(&reply.body));
    assert!(reply.json()["error"].as_str().unwrap().contains("is failed; repair it"), "{}", reply.json());
    let (status, rev) =
        post(&restarted, &format!("/environments/{id}/install"), json!({"packages": ["tinyutil"]})).await;
    assert_eq!(status, 201, "{rev}");
    let (_, list) = get(&restarted, "/environments").await;
    assert_eq!(environment(&list, &id)["status"], "ready");
    let reply = restarted.client().post_signed("/execute-shell", &run("tinyutil")).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert!(reply.json()["stdout"].as_str().unwrap().starts_with("tinyutil "), "{}", reply.json());
}

/// The whole tree's (relative path, length, mode) list, without following links.
fn tree(dir: &Path) -> Vec<(PathBuf, u64, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                pending.push(path.clone());
            }
            let rel = path.strip_prefix(dir).unwrap().to_path_buf();
            out.push((rel, meta.len(), meta.permissions().mode()));
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn offline_mode_serves_conda_from_an_operators_read_only_cache_in_condas_layout() {
    if !sandbox_or_skip("offline_mode_from_a_read_only_cache") {
        return;
    }
    // Online once, to fill a cache: the starter, and tinylib in a task environment.
    let mut first = ready(&[]).await;
    let (status, env) =
        post(&first.server, "/environments", json!({"name": "fill", "language": "python"})).await;
    assert_eq!(status, 201, "{env}");
    let id = env["id"].as_str().unwrap().to_owned();
    let (status, rev) =
        post(&first.server, &format!("/environments/{id}/install"), json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{rev}");
    first.server.stop();

    // The operator's cache: extracted packages directly in it (micromamba's CONDA_PKGS_DIRS),
    // every write bit removed; the channel keeps its repodata but loses every archive.
    let operator = runner_tests::scratch_dir();
    let cache = operator.path().join("conda-pkgs");
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(first.server.path("scientific-envs/provisioner/pkgs"))
        .arg(&cache)
        .status()
        .unwrap();
    assert!(copied.success());
    assert!(cache.join("tinylib-1.0-0/info/index.json").exists(), "the cache holds tinylib");
    let chmod = std::process::Command::new("chmod").args(["-R", "a-w,a+rX"]).arg(&cache).status().unwrap();
    assert!(chmod.success());
    for subdir in ["noarch", "linux-64"] {
        for entry in std::fs::read_dir(first.channel_dir.join(subdir)).unwrap() {
            let path = entry.unwrap().path();
            if path.file_name().unwrap() != "repodata.json" {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }
    let before = tree(&cache);

    let url = format!("file://{}", first.channel_dir.display());
    let mut env = vec![
        ("SCIENTIFIC_ENVS".to_owned(), "1".to_owned()),
        ("SCIENCE_AGENT_SCIENTIFIC_CHANNELS".to_owned(), url),
        ("SCIENCE_AGENT_STARTER_PYTHON_SPECS".to_owned(), "python,tinyutil=1.0".to_owned()),
        ("SCIENCE_AGENT_PACKAGE_CACHE_DIR".to_owned(), cache.display().to_string()),
    ];
    env.push(("SCIENCE_AGENT_CRAN_REPO".to_owned(), "file:///nonexistent-cran".to_owned()));
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let setup = setup_outcome(&server).await;
    assert_eq!(setup["state"], "ready", "the starter is created offline: {setup}\n{}", server.stderr());
    let (status, env) =
        post(&server, "/environments", json!({"name": "offline", "language": "python"})).await;
    assert_eq!(status, 201, "{env}");
    let id = env["id"].as_str().unwrap().to_owned();
    let (status, rev) =
        post(&server, &format!("/environments/{id}/install"), json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "tinylib from the operator's cache: {rev}\n{}", server.stderr());
    let v = shell(&server, Some(&id), "cat /opt/science-env/share/tinylib/data.txt; tinyutil").await;
    assert_eq!(v["stdout"], "tinylib data\ntinyutil 1.0\n", "{v}");
    // A package neither the cache nor the channel holds fails, and says so.
    let (status, failed) =
        post(&server, &format!("/environments/{id}/install"), json!({"packages": ["tinyutil=2.0"]})).await;
    assert_eq!(status, 400, "{failed}");
    let text = failed["error"].as_str().unwrap_or_default();
    assert!(text.contains("tinyutil-2.0-0.tar.bz2") && text.contains("could not be read"), "{failed}");
    assert_eq!(tree(&cache), before, "the operator's cache is never written");
    let own = server.path("scientific-envs/provisioner/pkgs");
    assert!(!own.join("tinylib-1.0-0").exists(), "nothing was copied into the store's own cache");
    let chmod = std::process::Command::new("chmod").args(["-R", "u+w"]).arg(&cache).status().unwrap();
    assert!(chmod.success());
}

#[tokio::test]
async fn a_provisioning_step_runs_under_the_execution_memory_limit() {
    if !sandbox_or_skip("a_provisioning_step_runs_under_the_execution_memory_limit") {
        return;
    }
    let envs = ready(&[
        ("SCIENCE_AGENT_LIMIT_MAX_MEMORY_BYTES", "268435456"),
        ("SCIENCE_AGENT_LIMIT_MEMORY_BYTES", "268435456"),
    ])
    .await;
    let s = &envs.server;
    let (id, env) = r_environment(s, "r-hog").await;
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["hog"], "manager": "cran"}))
            .await;
    assert_eq!(status, 400, "{v}");
    let hog = s.path(&format!(
        "scientific-envs/revisions/{id}/{}/hog.txt",
        env["runtimeRevisionId"].as_str().unwrap()
    ));
    // Killed by the cgroup's OOM killer (the file is never written), or refused its memory
    // by the address-space rlimit where there is no cgroup: never 600 MB granted.
    let seen = std::fs::read_to_string(&hog).unwrap_or_else(|_| "hog=killed".into());
    assert!(seen.trim() == "hog=limited" || seen.trim() == "hog=killed", "{seen} ({v})");
    let text = v["error"].as_str().unwrap_or_default();
    assert!(text.contains("cran step"), "{v}");
}

#[tokio::test]
async fn a_fifo_a_package_step_plants_in_a_prefix_is_refused_not_waited_on() {
    if !sandbox_or_skip("a_fifo_a_package_step_plants_in_a_prefix_is_refused_not_waited_on") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let (id, _) = r_environment(s, "r-fifo").await;
    // The listing after the R step would block on the FIFO (and a conda fetch holding the
    // package cache for every tenant would): both refuse it at once instead.
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["fifo"], "manager": "cran"}))
            .await;
    assert_eq!(status, 400, "{v}");
    let text = v["error"].as_str().unwrap_or_default();
    assert!(text.contains("holds conda-meta/history, which is not a file, a directory or a link"), "{v}");
    let (status, v) =
        post(s, &format!("/environments/{id}/install"), json!({"packages": ["tinyutil"]})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap_or_default().contains("which is not a file"), "{v}");
    // Another tenant's conda change goes on.
    let (status, other) = post(s, "/environments", json!({"name": "other", "language": "python"})).await;
    assert_eq!(status, 201, "{other}");
    let other_id = other["id"].as_str().unwrap();
    let (status, v) =
        post(s, &format!("/environments/{other_id}/install"), json!({"packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{v}");
}

/// Entries of a directory (none when it is absent).
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// Waits up to 60 s for `dir` to hold no entry.
async fn emptied(dir: &Path) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = entries(dir);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_package_steps_scratch_is_removed_however_deep_and_an_oversized_inventory_fails_the_change() {
    if !sandbox_or_skip("a_package_steps_scratch_is_removed_however_deep") {
        return;
    }
    let mut envs = ready(&[]).await;
    let s = &envs.server;
    let (id, env) = r_environment(s, "r-scratch").await;
    let install = format!("/environments/{id}/install");
    let (status, v) = post(s, &install, json!({"packages": ["deep"], "manager": "cran"})).await;
    assert_eq!(status, 201, "{v}\n{}", s.stderr());
    let prefix =
        s.path(&format!("scientific-envs/revisions/{id}/{}", env["runtimeRevisionId"].as_str().unwrap()));
    assert_eq!(std::fs::read_to_string(prefix.join("deep.txt")).unwrap().trim(), "2000");
    // The chain the step left in its scratch workspace goes with it (by descriptor, with
    // bounded descriptors and memory, off runnerd's workers).
    let scratch = s.path("runner-runtime/provision");
    assert!(scratch.is_dir(), "{}", scratch.display());
    assert_eq!(emptied(&scratch).await, Vec::<String>::new(), "{}", s.stderr());

    // An inventory of 20,001 packages (this R prints it) fails the change: the catalog,
    // which keeps every revision's list, does not grow by it.
    let catalog = s.path("scientific-envs/catalog.json");
    let before = std::fs::metadata(&catalog).unwrap().len();
    let (status, v) = post(s, &install, json!({"packages": ["biginv"], "manager": "cran"})).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().contains("inventory lists more than 20000 packages"),
        "{v}"
    );
    let after = std::fs::metadata(&catalog).unwrap().len();
    assert!(after < before + 64 * 1024, "the catalog grew from {before} to {after} bytes");

    // A scratch an earlier process left (killed in the middle of a step) is swept by the
    // next process's first step.
    envs.server.stop();
    let stale = scratch.join("0f0e-stale-7/d/d/d");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("left.txt"), "x").unwrap();
    let restarted = restart(&envs);
    assert_eq!(setup_outcome(&restarted).await["state"], "ready");
    let (status, other) =
        post(&restarted, "/environments", json!({"name": "after", "language": "python"})).await;
    assert_eq!(status, 201, "{other}\n{}", restarted.stderr());
    assert_eq!(emptied(&scratch).await, Vec::<String>::new(), "{}", restarted.stderr());
}

#[tokio::test]
async fn provisioning_steps_take_sandbox_slots_as_executions_do() {
    if !sandbox_or_skip("provisioning_steps_take_sandbox_slots_as_executions_do") {
        return;
    }
    let envs = ready(&[("SCIENCE_AGENT_MAX_CONCURRENT_EXECUTIONS", "1")]).await;
    let s = &envs.server;
    let mut prefixes = Vec::new();
    let mut installs = Vec::new();
    for name in ["r-slot-a", "r-slot-b"] {
        let (id, env) = r_environment(s, name).await;
        let runtime = env["runtimeRevisionId"].as_str().unwrap();
        prefixes.push(s.path(&format!("scientific-envs/revisions/{id}/{runtime}")));
        installs.push(format!("/environments/{id}/install"));
    }
    let body = json!({"packages": ["pause"], "manager": "cran"});
    let (a, b) = tokio::join!(post(s, &installs[0], body.clone()), post(s, &installs[1], body.clone()));
    assert_eq!((a.0, b.0), (201, 201), "{a:?} {b:?}");
    let when = |prefix: &Path, end: &str| -> f64 {
        std::fs::read_to_string(prefix.join(format!("pause.{end}"))).unwrap().trim().parse().unwrap()
    };
    let (a, b) = (
        (when(&prefixes[0], "start"), when(&prefixes[0], "end")),
        (when(&prefixes[1], "start"), when(&prefixes[1], "end")),
    );
    // One slot: two environments' steps ran one after the other, never side by side.
    assert!(a.1 <= b.0 || b.1 <= a.0, "the steps overlapped: {a:?} and {b:?}");
}
