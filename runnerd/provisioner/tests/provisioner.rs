//! The built `runner-provisioner` driven as runnerd drives it: a JSON request on stdin, a JSON
//! response on stdout, an empty environment, against channels `test-channel` builds.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use test_channel::{Channel, Format, Pkg};

const BIN: &str = env!("CARGO_BIN_EXE_runner-provisioner");

struct Run {
    code: i32,
    response: Value,
}

impl Run {
    fn ok(self) -> Value {
        assert_eq!(self.code, 0, "provisioner failed: {}", self.response);
        assert!(self.response["error"].is_null());
        self.response
    }

    fn error(&self) -> String {
        assert_eq!(self.code, 1, "expected a failure: {}", self.response);
        self.response["error"].as_str().expect("error text").to_string()
    }
}

fn provision(stdin: &[u8]) -> Run {
    let mut child = Command::new(BIN)
        .env_clear()
        .env("HOME", "/tmp")
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the provisioner");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write request");
    let output = child.wait_with_output().expect("wait");
    let response = serde_json::from_slice(&output.stdout).expect("one JSON response on stdout");
    Run { code: output.status.code().expect("exit code"), response }
}

struct Env {
    _dir: tempfile::TempDir,
    root: PathBuf,
    channel: String,
}

impl Env {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let channel = demo_channel(&root.join("channel")).url();
        Env { _dir: dir, root, channel }
    }

    fn prefix(&self, name: &str) -> PathBuf {
        self.root.join("envs").join(name)
    }

    fn run(&self, prefix: &Path, op: Value) -> Run {
        self.run_with(prefix, op, &[self.channel.as_str()], false)
    }

    fn request(&self, prefix: &Path, op: &Value, channels: &[&str], offline: bool, stage: Value) -> Value {
        json!({
            "op": op,
            "prefix": prefix,
            "channels": channels,
            "cacheDir": self.root.join("cache"),
            "offline": offline,
            "stage": stage,
        })
    }

    /// A change as runnerd makes it: the fetch step, then (if it succeeded) the link step
    /// with its solution; the link step's answer, with the fetch step's solve time.
    fn run_with(&self, prefix: &Path, op: Value, channels: &[&str], offline: bool) -> Run {
        let fetch = self.request(prefix, &op, channels, offline, json!({"kind": "fetch"}));
        let fetched = provision(fetch.to_string().as_bytes());
        if fetched.code != 0 || op["kind"] == "list" {
            return fetched;
        }
        let solution = fetched.response["solution"].as_str().expect("a fetch step's solution").to_owned();
        let link =
            self.request(prefix, &op, channels, offline, json!({"kind": "link", "solution": solution}));
        let mut linked = provision(link.to_string().as_bytes());
        linked.response["solveMicros"] = fetched.response["solveMicros"].clone();
        linked
    }
}

fn demo_channel(dir: &Path) -> Channel {
    let mut channel = Channel::new(dir);
    for version in ["1.0", "2.0"] {
        let script = format!("#!/bin/sh\necho tinyutil {version}\n");
        channel
            .package(Pkg::noarch("tinyutil", version).file("bin/tinyutil", script.as_bytes(), true))
            .expect("tinyutil");
    }
    channel
        .package(Pkg::noarch("tinylib", "1.0").depends("tinyutil >=1.0").format(Format::Conda).file(
            "share/tinylib/data.txt",
            b"tinylib data\n",
            false,
        ))
        .expect("tinylib");
    channel.corrupt("broken", "1.0").expect("broken");
    channel.index().expect("index");
    channel
}

fn names(response: &Value) -> Vec<String> {
    response["installed"]
        .as_array()
        .expect("installed")
        .iter()
        .map(|p| format!("{}-{}", p["name"].as_str().unwrap_or(""), p["version"].as_str().unwrap_or("")))
        .collect()
}

fn changes(response: &Value) -> Vec<String> {
    response["operations"]
        .as_array()
        .expect("operations")
        .iter()
        .map(|op| {
            let package = &op["package"];
            format!(
                "{} {}-{}",
                op["change"].as_str().unwrap_or(""),
                package["name"].as_str().unwrap_or(""),
                package["version"].as_str().unwrap_or("")
            )
        })
        .collect()
}

fn history(prefix: &Path) -> String {
    std::fs::read_to_string(prefix.join("conda-meta/history")).expect("history")
}

#[test]
fn create_with_dependencies_installs_both_formats_and_writes_history() {
    let env = Env::new();
    let prefix = env.prefix("a");
    let response = env.run(&prefix, json!({"kind": "create", "specs": ["tinylib"]})).ok();
    assert_eq!(names(&response), ["tinylib-1.0", "tinyutil-2.0"]);
    let mut ops = changes(&response);
    ops.sort();
    assert_eq!(ops, ["install tinylib-1.0", "install tinyutil-2.0"]);
    assert!(response["peakRssKib"].as_u64().expect("rss") > 0);
    assert_eq!(std::fs::read(prefix.join("share/tinylib/data.txt")).expect(".conda file"), b"tinylib data\n");
    let out = Command::new(prefix.join("bin/tinyutil")).output().expect("run tinyutil from .tar.bz2");
    assert_eq!(out.stdout, b"tinyutil 2.0\n");
    let history = history(&prefix);
    assert!(history.starts_with("==> "), "{history}");
    assert!(history.contains("# cmd: runner-provisioner create\n"), "{history}");
    assert!(history.contains(&format!("+{}::tinylib-1.0-0\n", env.channel)), "{history}");
    assert!(history.contains(&format!("+{}::tinyutil-2.0-0\n", env.channel)), "{history}");
    assert!(history.ends_with("# update specs: ['tinylib']\n"), "{history}");
    let listed = env.run(&prefix, json!({"kind": "list"})).ok();
    assert_eq!(listed["installed"], response["installed"]);
    assert_eq!(listed["operations"], json!([]));
}

#[test]
fn install_upgrades_in_place_and_an_unchanged_request_is_empty() {
    let env = Env::new();
    let prefix = env.prefix("a");
    env.run(&prefix, json!({"kind": "create", "specs": ["tinyutil=1.0"]})).ok();
    let added = env.run(&prefix, json!({"kind": "install", "specs": ["tinylib"]})).ok();
    assert_eq!(changes(&added), ["install tinylib-1.0"], "the earlier spec keeps tinyutil 1.0");
    let upgraded = env.run(&prefix, json!({"kind": "install", "specs": ["tinyutil>=2"]})).ok();
    assert_eq!(changes(&upgraded), ["change tinyutil-2.0"]);
    assert_eq!(upgraded["operations"][0]["previous"]["version"], "1.0");
    assert_eq!(names(&upgraded), ["tinylib-1.0", "tinyutil-2.0"]);
    let again = env.run(&prefix, json!({"kind": "install", "specs": ["tinyutil>=2"]})).ok();
    assert_eq!(again["operations"], json!([]));
    let history = history(&prefix);
    assert!(
        history.contains(&format!(
            "-{}::tinyutil-1.0-0\n+{}::tinyutil-2.0-0\n# update specs: ['tinyutil>=2']\n",
            env.channel, env.channel
        )),
        "{history}"
    );
    assert_eq!(history.matches("==> ").count(), 3, "no entry for the empty transaction: {history}");
}

#[test]
fn remove_takes_dependents_and_refuses_a_missing_name() {
    let env = Env::new();
    let prefix = env.prefix("a");
    env.run(&prefix, json!({"kind": "create", "specs": ["tinylib"]})).ok();
    let missing = env.run(&prefix, json!({"kind": "remove", "names": ["nothere"]}));
    assert_eq!(missing.error(), "Package is not installed: nothere");
    assert_eq!(names(&missing.response), ["tinylib-1.0", "tinyutil-2.0"]);
    let removed = env.run(&prefix, json!({"kind": "remove", "names": ["tinylib"]})).ok();
    assert_eq!(changes(&removed), ["remove tinylib-1.0"]);
    assert_eq!(names(&removed), ["tinyutil-2.0"], "a dependency stays installed (no pruning)");
    assert!(!prefix.join("share/tinylib/data.txt").exists());
    assert!(history(&prefix).ends_with("# remove specs: ['tinylib']\n"));
    let env2 = Env::new();
    let prefix2 = env2.prefix("b");
    env2.run(&prefix2, json!({"kind": "create", "specs": ["tinylib"]})).ok();
    let both = env2.run(&prefix2, json!({"kind": "remove", "names": ["tinyutil"]})).ok();
    assert_eq!(names(&both), Vec::<String>::new(), "tinylib needs tinyutil: both go");
}

#[test]
fn unsolvable_request_names_the_solver_text() {
    let env = Env::new();
    let run = env.run(&env.prefix("a"), json!({"kind": "create", "specs": ["tinyutil>=9"]}));
    let error = run.error();
    assert!(error.starts_with("Could not solve for the requested packages: "), "{error}");
    assert!(error.contains("tinyutil"), "{error}");
    let invalid = env.run(&env.prefix("b"), json!({"kind": "create", "specs": ["="]})).error();
    assert!(invalid.starts_with("Package spec = is not a valid match spec: "), "{invalid}");
}

#[test]
fn corrupt_package_fails_and_keeps_the_earlier_packages() {
    let env = Env::new();
    let prefix = env.prefix("a");
    env.run(&prefix, json!({"kind": "create", "specs": ["tinyutil=1.0"]})).ok();
    let run = env.run(&prefix, json!({"kind": "install", "specs": ["broken", "tinyutil>=2"]}));
    let error = run.error();
    assert!(
        error.starts_with(&format!("Package broken-1.0-0.tar.bz2 from {} is corrupt: ", env.channel)),
        "{error}"
    );
    assert_eq!(names(&run.response), ["tinyutil-1.0"], "nothing was unlinked");
    let out = Command::new(prefix.join("bin/tinyutil")).output().expect("tinyutil still runs");
    assert_eq!(out.stdout, b"tinyutil 1.0\n");
}

#[test]
fn clone_copies_the_records_and_specs() {
    let env = Env::new();
    let base = env.prefix("base");
    env.run(&base, json!({"kind": "create", "specs": ["tinylib", "tinyutil=1.0"]})).ok();
    let task = env.prefix("task");
    let cloned = env.run(&task, json!({"kind": "clone", "source": base})).ok();
    assert_eq!(names(&cloned), ["tinylib-1.0", "tinyutil-1.0"]);
    assert_eq!(cloned["solveMicros"], 0);
    assert!(history(&task).ends_with("# update specs: ['tinylib', 'tinyutil=1.0']\n"), "{}", history(&task));
    let not_empty = env.run(&task, json!({"kind": "clone", "source": base}));
    // A clone copies only what its channels serve: a record naming another origin (as a
    // hostile step could forge in the source) is refused.
    let foreign = env.run_with(
        &env.prefix("foreign"),
        json!({"kind": "clone", "source": base}),
        &["file:///elsewhere"],
        true,
    );
    assert!(
        foreign.error().contains("which is not one of the environment's channels"),
        "{}",
        foreign.error()
    );
    assert!(not_empty.error().ends_with("already exists and is not empty"));
    // The base's archives gone (only the channel's index left): the cache serves them.
    remove_archives(&env.root.join("channel"));
    let offline = env.prefix("offline");
    let again =
        env.run_with(&offline, json!({"kind": "clone", "source": base}), &[env.channel.as_str()], true).ok();
    assert_eq!(names(&again), ["tinylib-1.0", "tinyutil-1.0"]);
    std::fs::remove_dir_all(env.root.join("cache")).expect("remove the cache");
    let neither = env.run_with(
        &env.prefix("neither"),
        json!({"kind": "clone", "source": base}),
        &[env.channel.as_str()],
        true,
    );
    assert!(neither.error().contains("could not be read: No such file"), "{}", neither.error());
}

/// Removes a channel's package archives, keeping its index (`repodata.json`).
fn remove_archives(channel: &Path) {
    for subdir in std::fs::read_dir(channel).expect("channel") {
        let subdir = subdir.expect("entry").path();
        for file in std::fs::read_dir(&subdir).expect("subdir") {
            let file = file.expect("entry").path();
            if file.file_name().is_some_and(|n| n != "repodata.json") {
                std::fs::remove_file(&file).expect("remove an archive");
            }
        }
    }
}

/// Rewrites one field of the `conda-meta` record of `package` in `prefix`, as a hostile
/// pip or R step with the prefix writable could.
fn forge_record(prefix: &Path, package: &str, field: &str, value: Value) {
    for entry in std::fs::read_dir(prefix.join("conda-meta")).expect("conda-meta") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_owned();
        if name.starts_with(&format!("{package}-")) && name.ends_with(".json") {
            let mut record: Value =
                serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("JSON");
            record[field] = value;
            std::fs::write(&path, record.to_string()).expect("write");
            return;
        }
    }
    panic!("no record of {package} in {}", prefix.display());
}

#[test]
fn a_clone_takes_url_hash_and_name_from_the_channel_never_from_the_source_records() {
    let env = Env::new();
    let base = env.prefix("base");
    env.run(&base, json!({"kind": "create", "specs": ["tinylib"]})).ok();
    // The record of tinyutil 2.0 forged to name the 1.0 archive and its hash: without the
    // channel's own record, the fetch would file 1.0's files under the shared cache key
    // `tinyutil-2.0-0`, for every environment that installs 2.0 later.
    let index: Value = serde_json::from_slice(
        &std::fs::read(env.root.join("channel/noarch/repodata.json")).expect("repodata"),
    )
    .expect("JSON");
    let old = &index["packages"]["tinyutil-1.0-0.tar.bz2"];
    forge_record(&base, "tinyutil", "url", json!(format!("{}/noarch/tinyutil-1.0-0.tar.bz2", env.channel)));
    forge_record(&base, "tinyutil", "sha256", old["sha256"].clone());
    forge_record(&base, "tinyutil", "md5", old["md5"].clone());
    let task = env.prefix("task");
    env.run(&task, json!({"kind": "clone", "source": base})).ok();
    let out = Command::new(task.join("bin/tinyutil")).output().expect("run tinyutil");
    assert_eq!(out.stdout, b"tinyutil 2.0\n", "the channel's 2.0 was copied");
    let cached =
        std::fs::read_to_string(env.root.join("cache/pkgs/tinyutil-2.0-0/bin/tinyutil")).expect("cache");
    assert!(cached.contains("tinyutil 2.0"), "the cache key holds what it names: {cached}");
    // A URL that climbs out of the channel through an encoded separator (it passes a text
    // prefix check) is refused, and so is an archive the channel does not serve.
    forge_record(
        &base,
        "tinyutil",
        "url",
        json!(format!("{}/..%2F..%2Fenvs%2Fbase%2Fevil.conda", env.channel)),
    );
    let refused = env.run(&env.prefix("other"), json!({"kind": "clone", "source": base}));
    assert!(
        refused.error().contains("which is not one of the environment's channels"),
        "{}",
        refused.error()
    );
    forge_record(&base, "tinyutil", "url", json!(format!("{}/noarch/tinyutil-2.0-0.tar.bz2", env.channel)));
    // An archive name the channel does not list: only the cache's own copy of that build (its
    // hash checked) can be copied, and nothing is fetched for it.
    forge_record(&base, "tinylib", "fn", json!("evil-1.0-0.conda"));
    let before = tree(&env.root.join("cache/pkgs"));
    let copied = env.run(&env.prefix("other2"), json!({"kind": "clone", "source": base})).ok();
    assert_eq!(names(&copied), ["tinylib-1.0", "tinyutil-2.0"]);
    assert_eq!(tree(&env.root.join("cache/pkgs")), before, "nothing was fetched into the cache");
}

#[test]
fn a_clone_of_a_package_the_channel_no_longer_lists_comes_from_the_cache_or_not_at_all() {
    let env = Env::new();
    let base = env.prefix("base");
    env.run(&base, json!({"kind": "create", "specs": ["tinylib"]})).ok();
    // tinyutil 2.0 leaves the channel's index (as a build moved to conda-forge's `broken`).
    let index_path = env.root.join("channel/noarch/repodata.json");
    let mut index: Value =
        serde_json::from_slice(&std::fs::read(&index_path).expect("repodata")).expect("JSON");
    index["packages"].as_object_mut().expect("packages").remove("tinyutil-2.0-0.tar.bz2");
    std::fs::write(&index_path, index.to_string()).expect("write repodata");
    let task = env.prefix("task");
    let cloned = env.run(&task, json!({"kind": "clone", "source": base})).ok();
    assert_eq!(names(&cloned), ["tinylib-1.0", "tinyutil-2.0"], "copied from the cache");
    std::fs::remove_dir_all(env.root.join("cache")).expect("remove the cache");
    let refused = env.run(&env.prefix("other"), json!({"kind": "clone", "source": base})).error();
    assert!(
        refused.starts_with("Package tinyutil-2.0-0 is no longer served by ")
            && refused.ends_with("and the package cache does not hold it: it cannot be copied"),
        "{refused}"
    );
}

#[test]
fn a_prefix_that_cannot_be_made_is_named() {
    let env = Env::new();
    let file = env.root.join("a-file");
    std::fs::write(&file, b"").expect("file");
    let prefix = file.join("env");
    let error = env.run(&prefix, json!({"kind": "create", "specs": ["tinyutil"]})).error();
    assert!(error.starts_with(&format!("Prefix {} is not writable: ", prefix.display())), "{error}");
}

#[test]
fn bad_request_exits_2_with_a_response() {
    let run = provision(b"{not json");
    assert_eq!(run.code, 2);
    assert!(
        run.response["error"]
            .as_str()
            .expect("error")
            .starts_with("the request is not a valid provisioning request")
    );
}

/// Serves `dir` over plain HTTP/1.1 on loopback (one request per connection) and counts
/// the requests; the thread ends with the test process.
fn serve(dir: PathBuf) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let count = Arc::new(AtomicUsize::new(0));
    let counter = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            counter.fetch_add(1, Ordering::SeqCst);
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).map_or(true, |n| n == 0) || header == "\r\n" {
                    break;
                }
            }
            let mut parts = line.split_whitespace();
            let method = parts.next().unwrap_or("");
            let path = parts.next().unwrap_or("/").trim_start_matches('/');
            let file = dir.join(path);
            let body = if path.contains("..") { None } else { std::fs::read(&file).ok() };
            let head = match &body {
                Some(body) => {
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())
                }
                None => {
                    "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
                }
            };
            let _ = stream.write_all(head.as_bytes());
            if let (Some(body), false) = (body, method == "HEAD") {
                let _ = stream.write_all(&body);
            }
            let _ = stream.flush();
            let mut rest = Vec::new();
            let _ = stream.set_read_timeout(Some(std::time::Duration::from_millis(10)));
            let _ = stream.read_to_end(&mut rest);
        }
    });
    (url, count)
}

#[test]
fn http_channel_then_offline_from_the_cache_alone() {
    let env = Env::new();
    let (url, requests) = serve(env.root.join("channel"));
    let online = env.prefix("online");
    let created = env.run_with(&online, json!({"kind": "create", "specs": ["tinylib"]}), &[&url], false).ok();
    assert_eq!(names(&created), ["tinylib-1.0", "tinyutil-2.0"]);
    assert_eq!(created["installed"][0]["channel"], url.as_str());
    let served = requests.load(Ordering::SeqCst);
    assert!(served > 0);
    // The channel's own directory goes away: only the package and repodata caches remain.
    std::fs::remove_dir_all(env.root.join("channel")).expect("remove the channel");
    let offline = env.prefix("offline");
    let again = env.run_with(&offline, json!({"kind": "create", "specs": ["tinylib"]}), &[&url], true).ok();
    assert_eq!(names(&again), ["tinylib-1.0", "tinyutil-2.0"]);
    let clone = env.prefix("clone");
    env.run_with(&clone, json!({"kind": "clone", "source": online}), &[&url], true).ok();
    assert_eq!(requests.load(Ordering::SeqCst), served, "offline runs open no connection");
    let unknown = env.run_with(
        &env.prefix("x"),
        json!({"kind": "create", "specs": ["tinylib"]}),
        &["http://127.0.0.1:9/none"],
        true,
    );
    assert!(
        unknown.error().starts_with("Channel http://127.0.0.1:9/none could not be read: "),
        "{}",
        unknown.error()
    );
}

#[test]
fn offline_a_remote_channel_is_read_from_the_operators_cache_of_an_earlier_layout() {
    let env = Env::new();
    let (url, requests) = serve(env.root.join("channel"));
    env.run_with(&env.prefix("online"), json!({"kind": "create", "specs": ["tinylib"]}), &[&url], false).ok();
    // The whole cache (pkgs/ and repodata/ inside, as runnerd's earlier releases laid the
    // operator's cache out) becomes the operator's, read-only; the store's own is empty.
    let operator = env.root.join("operator-cache");
    std::fs::rename(env.root.join("cache"), &operator).expect("move the cache");
    set_writable(&operator, false);
    let served = requests.load(Ordering::SeqCst);
    let prefix = env.prefix("offline");
    let op = json!({"kind": "create", "specs": ["tinylib"]});
    let mut stage = json!({"kind": "fetch"});
    let mut last = Value::Null;
    for _ in 0..2 {
        let mut request = env.request(&prefix, &op, &[url.as_str()], true, stage.clone());
        request["readOnlyCaches"] = json!([operator]);
        last = provision(request.to_string().as_bytes()).ok();
        stage = json!({"kind": "link", "solution": last["solution"]});
    }
    assert_eq!(names(&last), ["tinylib-1.0", "tinyutil-2.0"]);
    assert_eq!(requests.load(Ordering::SeqCst), served, "offline: no connection");
    set_writable(&operator, true);
}

#[test]
fn python_from_host_runs_as_the_prefix_and_ensurepip_works_offline() {
    let Some(python) = test_channel::host_python() else {
        eprintln!("SKIP: no host python3 to package");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut channel = Channel::new(dir.path().join("channel"));
    channel.python_from_host(&python).expect("python package");
    channel.stub_r_base("4.4.0").expect("r-base");
    channel.index().expect("index");
    let prefix = dir.path().join("env");
    let request = json!({
        "op": {"kind": "create", "specs": ["python", "r-base"]},
        "prefix": prefix,
        "channels": [channel.url()],
        "cacheDir": dir.path().join("cache"),
        "offline": true,
        "stage": {"kind": "fetch"},
    });
    let fetched = provision(request.to_string().as_bytes()).ok();
    let mut request = request;
    request["stage"] = json!({"kind": "link", "solution": fetched["solution"]});
    let response = provision(request.to_string().as_bytes()).ok();
    assert_eq!(response["installed"][0]["name"], "python");
    assert_eq!(response["installed"][0]["subdir"], "linux-64");
    let interpreter = prefix.join("bin/python");
    let run = |args: &[&str]| {
        let out = Command::new(&interpreter)
            .args(args)
            .env_clear()
            .env("HOME", dir.path())
            .env("PATH", "/usr/bin:/bin")
            .output()
            .expect("run the environment's python");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(run(&["-I", "-c", "import sys; print(sys.prefix)"]), prefix.display().to_string());
    run(&["-I", "-m", "ensurepip", "--default-pip"]);
    let pip = run(&["-I", "-m", "pip", "--version"]);
    assert!(pip.contains(&prefix.display().to_string()), "pip lives in the prefix: {pip}");
    let r = Command::new(prefix.join("bin/R")).args(["--vanilla", "--slave"]).output().expect("stub R");
    assert_eq!(r.stdout, b"stub R --vanilla --slave\n");
}

/// Every file and directory under `dir` made read-only (as the sandbox's read-only bind makes
/// them to the sandbox user; rattler also reads a layer without write bits as read-only), or
/// writable by its owner again (so that the temporary directory can be removed).
fn set_writable(dir: &Path, writable: bool) {
    use std::os::unix::fs::PermissionsExt;
    let chmod = |path: &Path, meta: &std::fs::Metadata| {
        let mode = meta.permissions().mode();
        let mode = if writable { mode | 0o200 } else { mode & !0o222 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    let meta = std::fs::metadata(dir).expect("metadata");
    if writable {
        chmod(dir, &meta);
    }
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        let meta = std::fs::symlink_metadata(&path).expect("metadata");
        if meta.is_dir() {
            set_writable(&path, writable);
        } else if !meta.file_type().is_symlink() {
            chmod(&path, &meta);
        }
    }
    if !writable {
        chmod(dir, &meta);
    }
}

fn make_read_only(dir: &Path) {
    set_writable(dir, false);
}

/// The whole tree's (path, length, modified) list: what "unchanged" is checked against.
fn tree(dir: &Path) -> Vec<(PathBuf, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries {
            let path = entry.expect("entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            if meta.is_dir() {
                pending.push(path.clone());
            }
            out.push((path, meta.len(), meta.modified().expect("mtime")));
        }
    }
    out.sort();
    out
}

#[test]
fn a_fetch_step_fills_the_cache_and_leaves_the_prefix_as_it_was() {
    let env = Env::new();
    let prefix = env.prefix("a");
    env.run(&prefix, json!({"kind": "create", "specs": ["tinyutil=1.0"]})).ok();
    let before = tree(&prefix);
    let op = json!({"kind": "install", "specs": ["tinylib", "tinyutil>=2"]});
    let fetch = env.request(&prefix, &op, &[env.channel.as_str()], false, json!({"kind": "fetch"}));
    let fetched = provision(fetch.to_string().as_bytes()).ok();
    assert_eq!(fetched["operations"], json!([]), "a fetch step changes no prefix");
    assert_eq!(names(&fetched), ["tinyutil-1.0"]);
    assert_eq!(tree(&prefix), before, "the prefix is untouched");
    let solution: Value =
        serde_json::from_str(fetched["solution"].as_str().expect("solution")).expect("JSON");
    let files: Vec<&str> =
        solution.as_array().expect("records").iter().filter_map(|r| r["fn"].as_str()).collect();
    assert!(files.contains(&"tinylib-1.0-0.conda") && files.contains(&"tinyutil-2.0-0.tar.bz2"), "{files:?}");
    assert!(env.root.join("cache/pkgs/tinylib-1.0-0/info/index.json").exists(), "fetched into the cache");
}

#[test]
fn a_link_step_links_from_read_only_caches_and_refuses_what_was_not_fetched() {
    let env = Env::new();
    let prefix = env.prefix("a");
    let op = json!({"kind": "create", "specs": ["tinylib"]});
    let fetch = env.request(&prefix, &op, &[env.channel.as_str()], false, json!({"kind": "fetch"}));
    let fetched = provision(fetch.to_string().as_bytes()).ok();
    let solution = fetched["solution"].as_str().expect("solution").to_owned();
    // The cache read-only, as the link step's sandbox binds it; the channel gone, so that
    // nothing could be read from anywhere but the cache.
    std::fs::remove_dir_all(env.root.join("channel")).expect("remove the channel");
    make_read_only(&env.root.join("cache"));
    let cache_before = tree(&env.root.join("cache"));
    let link = |solution: &str| {
        env.request(
            &prefix,
            &op,
            &[env.channel.as_str()],
            false,
            json!({"kind": "link", "solution": solution}),
        )
    };
    let linked = provision(link(&solution).to_string().as_bytes()).ok();
    assert_eq!(names(&linked), ["tinylib-1.0", "tinyutil-2.0"]);
    assert_eq!(std::fs::read(prefix.join("share/tinylib/data.txt")).expect("linked"), b"tinylib data\n");
    assert_eq!(tree(&env.root.join("cache")), cache_before, "the link step wrote nothing to the cache");
    // A solution naming a package the cache does not hold is refused before anything is linked.
    let other = env.prefix("b");
    let mut forged: Value = serde_json::from_str(&solution).expect("JSON");
    for record in forged.as_array_mut().expect("records") {
        if record["name"] == "tinylib" {
            record["version"] = json!("9.9");
            record["fn"] = json!("tinylib-9.9-0.conda");
            let url = record["url"].as_str().expect("url").replace("tinylib-1.0-0", "tinylib-9.9-0");
            record["url"] = json!(url);
        }
    }
    let request = json!({
        "op": op, "prefix": other, "channels": [env.channel], "cacheDir": env.root.join("cache"),
        "offline": false, "stage": {"kind": "link", "solution": forged.to_string()},
    });
    let refused = provision(request.to_string().as_bytes());
    assert!(refused.error().contains("was not fetched before linking"), "{}", refused.error());
    assert!(!other.join("conda-meta").exists(), "nothing was linked");
    // And one naming an archive outside the request's channels.
    let foreign = solution.replace(&env.channel, "file:///elsewhere");
    let request = json!({
        "op": op, "prefix": other, "channels": [env.channel], "cacheDir": env.root.join("cache"),
        "offline": false, "stage": {"kind": "link", "solution": foreign},
    });
    let refused = provision(request.to_string().as_bytes());
    assert!(
        refused.error().contains("which is not one of the environment's channels"),
        "{}",
        refused.error()
    );
    let mut garbage = link("[{");
    garbage["prefix"] = json!(other);
    let garbage = provision(garbage.to_string().as_bytes());
    assert!(
        garbage.error().starts_with("the link step's solution is not the fetch step's"),
        "{}",
        garbage.error()
    );
    set_writable(&env.root.join("cache"), true);
}

#[test]
fn an_operators_read_only_cache_in_condas_layout_serves_an_offline_change() {
    let env = Env::new();
    // A cache as micromamba's `CONDA_PKGS_DIRS` holds it: extracted packages directly in it.
    env.run(&env.prefix("seed"), json!({"kind": "create", "specs": ["tinylib"]})).ok();
    let operator = env.root.join("operator-cache");
    std::fs::rename(env.root.join("cache/pkgs"), &operator).expect("move the packages");
    remove_archives(&env.root.join("channel"));
    make_read_only(&operator);
    let before = tree(&operator);
    let prefix = env.prefix("offline");
    let op = json!({"kind": "clone", "source": env.prefix("seed")});
    let mut stage = json!({"kind": "fetch"});
    let mut last = Value::Null;
    for _ in 0..2 {
        let mut request = env.request(&prefix, &op, &[env.channel.as_str()], true, stage.clone());
        request["readOnlyCaches"] = json!([operator]);
        last = provision(request.to_string().as_bytes()).ok();
        stage = json!({"kind": "link", "solution": last["solution"]});
    }
    assert_eq!(names(&last), ["tinylib-1.0", "tinyutil-2.0"]);
    assert_eq!(tree(&operator), before, "the operator's cache is never written");
    set_writable(&operator, true);
}

/// The probes' hostile packages (issue #32): links out of the prefix, a link to procfs, an
/// absolute and a `..` path, a file that is a link in the archive. Each is refused by the
/// fetch step, with the prefix untouched and no byte of a link's target copied anywhere; a
/// package whose links stay inside gets them as links.
#[test]
fn hostile_packages_are_refused_before_anything_is_linked_and_links_stay_links() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().to_path_buf();
    let outside = root.join("outside");
    std::fs::create_dir_all(&outside).expect("outside");
    let hard = |path: &str| json!({"_path": path, "path_type": "hardlink", "sha256": "0".repeat(64), "size_in_bytes": 1});
    let mut channel = Channel::new(root.join("channel"));
    let escaped = outside.join("escaped");
    let cases: Vec<(Pkg, &str)> = vec![
        (
            Pkg::noarch("outlink", "1.0").symlink("lib/passwd", "/etc/passwd"),
            "links lib/passwd to \"/etc/passwd\", which leaves the prefix",
        ),
        (
            Pkg::noarch("procmap", "1.0").symlink("share/map", "/proc/self/pagemap"),
            "links share/map to \"/proc/self/pagemap\", which leaves the prefix",
        ),
        (
            Pkg::noarch("climber", "1.0").symlink("lib/up", "../../../outside"),
            "links lib/up to \"../../../outside\", which leaves the prefix",
        ),
        (
            Pkg::noarch("abspath", "1.0").raw_entry(hard(&escaped.display().to_string())),
            "which is not a relative path inside the prefix",
        ),
        (
            Pkg::noarch("dotdot", "1.0").raw_entry(hard("../../outside/escaped")),
            "which is not a relative path inside the prefix",
        ),
        (
            Pkg::noarch("disguised", "1.0")
                .hidden_link("lib/map", "/proc/self/pagemap")
                .raw_entry(hard("lib/map")),
            "lists lib/map as a file, but its archive holds a symbolic link there",
        ),
        (
            Pkg::noarch("throughlink", "1.0")
                .hidden_link("proc", "/proc/self")
                .raw_entry(hard("proc/pagemap")),
            "lists proc/pagemap as a file, but its archive holds a path through a symbolic link there",
        ),
    ];
    for (pkg, _) in &cases {
        channel.package(pkg.clone()).expect("a hostile package builds");
    }
    channel
        .package(
            Pkg::noarch("inlinks", "1.0")
                .file("lib/libz.so.1", b"zlib", false)
                .symlink("lib/libz.so", "libz.so.1")
                .symlink("bin/z", "../lib/libz.so.1"),
        )
        .expect("inlinks");
    channel.package(Pkg::noarch("big", "1.0").file("share/big", &[7u8; 4096], false)).expect("big");
    channel.index().expect("index");
    let url = channel.url();
    let request = |prefix: &Path, specs: &[&str], max: u64, stage: Value| {
        json!({
            "op": {"kind": "create", "specs": specs},
            "prefix": prefix,
            "channels": [url],
            "cacheDir": root.join("cache"),
            "offline": false,
            "stage": stage,
            "maxPrefixBytes": max,
        })
    };
    for (pkg, want) in &cases {
        let prefix = root.join("envs").join(&pkg.name);
        let started = std::time::Instant::now();
        let refused =
            provision(request(&prefix, &[&pkg.name], 0, json!({"kind": "fetch"})).to_string().as_bytes());
        let error = refused.error();
        assert!(
            error.contains(&format!("Package {}-1.0-0.tar.bz2", pkg.name)) && error.contains(want),
            "{}: {error}",
            pkg.name
        );
        assert!(error.contains("nothing was installed"), "{error}");
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "refused at once");
        assert!(!prefix.join("conda-meta").exists(), "{}: nothing was linked", pkg.name);
    }
    assert!(!escaped.exists(), "nothing was written outside");
    assert_eq!(std::fs::read_dir(&outside).expect("outside").count(), 0);

    // Links that stay inside are made as links, with their own text; nothing is copied.
    let prefix = root.join("envs/inlinks");
    let fetched =
        provision(request(&prefix, &["inlinks"], 0, json!({"kind": "fetch"})).to_string().as_bytes()).ok();
    let link = json!({"kind": "link", "solution": fetched["solution"]});
    provision(request(&prefix, &["inlinks"], 0, link).to_string().as_bytes()).ok();
    for (path, target) in [("lib/libz.so", "libz.so.1"), ("bin/z", "../lib/libz.so.1")] {
        let meta = std::fs::symlink_metadata(prefix.join(path)).expect(path);
        assert!(meta.file_type().is_symlink(), "{path} is a link");
        assert_eq!(std::fs::read_link(prefix.join(path)).expect(path), Path::new(target));
    }
    assert_eq!(std::fs::read(prefix.join("bin/z")).expect("through the link"), b"zlib");

    // The byte budget: the packages' files together, refused before the prefix is touched
    // (and by the link step too, should a fetch step have let them through).
    let prefix = root.join("envs/big");
    let refused =
        provision(request(&prefix, &["big"], 1000, json!({"kind": "fetch"})).to_string().as_bytes());
    let error = refused.error();
    assert!(
        error.contains("hold up to 4096 bytes")
            && error.contains("more than the 1000 bytes a prefix may hold"),
        "{error}"
    );
    assert!(error.contains("SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES"), "{error}");
    let fetched =
        provision(request(&prefix, &["big"], 0, json!({"kind": "fetch"})).to_string().as_bytes()).ok();
    let link = json!({"kind": "link", "solution": fetched["solution"]});
    let refused = provision(request(&prefix, &["big"], 1000, link).to_string().as_bytes());
    assert!(refused.error().contains("more than the 1000 bytes"), "{}", refused.error());
    assert!(!prefix.join("share/big").exists(), "nothing was linked");
}
