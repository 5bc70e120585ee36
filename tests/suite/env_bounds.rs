//! Provisioning steps and stored wheels are bounded (issue #32), end to end: the real runnerd
//! provisioning with the real `runner-provisioner` in its sandbox, against a channel the test
//! builds with the probes' hostile packages (links out of the prefix and into procfs, an
//! absolute and a `..` path, a file that is a link in the archive); pip steps stopped by the
//! per-file limit and by the prefix's byte limit; wheels of failed installs not kept; a
//! decompression bomb's fetch stopped at its byte budget for the shared package cache, which
//! it leaves as it found it, giving the cache's gate back at once.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions};
use serde_json::{Value, json};
use test_channel::{Format, Pkg};

use super::environments::{post, setup_outcome};

/// The hostile packages and the refusal each must get (`paths.json` entries written raw).
fn hostile() -> Vec<(Pkg, &'static str)> {
    let hard = |path: &str| json!({"_path": path, "path_type": "hardlink", "sha256": "0".repeat(64), "size_in_bytes": 1});
    vec![
        (
            Pkg::noarch("outlink", "1.0").symlink("lib/passwd", "/etc/passwd"),
            "links lib/passwd to \"/etc/passwd\", which leaves the prefix",
        ),
        (
            Pkg::noarch("procmap", "1.0").symlink("share/map", "/proc/self/pagemap"),
            "links share/map to \"/proc/self/pagemap\", which leaves the prefix",
        ),
        (
            Pkg::noarch("abspath", "1.0").raw_entry(hard("/tmp/escaped-by-abspath")),
            "lists \"/tmp/escaped-by-abspath\" in its paths.json, which is not a relative path inside the prefix",
        ),
        (
            Pkg::noarch("dotdot", "1.0").raw_entry(hard("../../../escaped-by-dotdot")),
            "lists \"../../../escaped-by-dotdot\" in its paths.json, which is not a relative path inside the prefix",
        ),
        (
            Pkg::noarch("disguised", "1.0")
                .hidden_link("lib/map", "/proc/self/pagemap")
                .raw_entry(hard("lib/map")),
            "lists lib/map as a file, but its archive holds a symbolic link there",
        ),
        (
            // A link listed with a prefix placeholder: the installer reads it (through the
            // unlisted `lib/y` too) and would copy /etc/passwd into the prefix.
            Pkg::noarch("placeholder", "1.0")
                .hidden_link("lib/x", "y")
                .hidden_link("lib/y", "/etc/passwd")
                .raw_entry(json!({"_path": "lib/x", "path_type": "softlink", "prefix_placeholder": "/opt/anaconda1anaconda2anaconda3", "file_mode": "text"})),
            "lists a prefix placeholder for lib/x, which its archive holds as a symbolic link, not a regular file",
        ),
        (
            // Metadata the cache reads through links: the step's own stdout, a pipe that
            // never ends while the step runs (it would hold the cache's gate for an hour).
            Pkg::noarch("pipemeta", "1.0").metadata_link("info/paths.json", "/proc/self/fd/1"),
            "holds a symbolic link as its info/paths.json, not a regular file",
        ),
        (
            Pkg::noarch("pipeindex", "1.0").metadata_link("info/index.json", "/proc/self/fd/1"),
            "holds a symbolic link as its info/index.json, not a regular file",
        ),
    ]
}

/// A `.conda` whose 32 files of 32 MiB of zeros take a few hundred kilobytes of zstd and
/// 1 GiB once unpacked into the package cache.
fn bomb() -> Pkg {
    let mut pkg = Pkg::noarch("zerobomb", "1.0").format(Format::Conda);
    pkg.quick = true;
    (0..32).fold(pkg, |p, i| p.zeros(&format!("share/zeros-{i}"), 32 << 20))
}

struct Envs {
    server: Server,
    _channel: tempfile::TempDir,
    url: String,
}

fn base_env(url: &str) -> Vec<(String, String)> {
    [
        ("SCIENTIFIC_ENVS", "1"),
        ("SCIENCE_AGENT_SCIENTIFIC_CHANNELS", url),
        ("SCIENCE_AGENT_STARTER_PYTHON_SPECS", "python,tinyutil=1.0"),
        ("SCIENCE_AGENT_CRAN_REPO", "file:///nonexistent-cran"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect()
}

/// A ready store over the demo channel plus the hostile packages.
async fn ready(extra: &[(&str, &str)]) -> Envs {
    let channel = runner_tests::scratch_dir();
    let dir = channel.path().join("channel");
    let mut built = test_channel::demo(&dir).expect("the demo channel builds");
    for (pkg, _) in hostile() {
        built.package(pkg).expect("a hostile package builds");
    }
    built.package(bomb()).expect("the bomb builds");
    built.index().expect("the channel indexes");
    runner_tests::hand_tree_to_sandbox(channel.path());
    let url = built.url();
    let mut env = base_env(&url);
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let setup = setup_outcome(&server).await;
    assert_eq!(setup["state"], "ready", "{setup}\n{}", server.stderr());
    Envs { server, _channel: channel, url }
}

async fn task_env(server: &Server, name: &str) -> String {
    let (status, env) = post(server, "/environments", json!({"name": name, "language": "python"})).await;
    assert_eq!(status, 201, "{env}\n{}", server.stderr());
    env["id"].as_str().unwrap().to_owned()
}

async fn install(server: &Server, id: &str, body: Value) -> (u16, Value) {
    post(server, &format!("/environments/{id}/install"), body).await
}

/// Every path below `dir`, relative, without following links.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(path.clone());
            }
            out.push(path.strip_prefix(dir).unwrap().to_path_buf());
        }
    }
    out.sort();
    out
}

/// What the prefix's regular files take, as runnerd measures it (size; these tests write no
/// sparse or preallocated files).
fn bytes_below(dir: &Path) -> u64 {
    tree(dir)
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(dir.join(p)).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

/// An environment's prefix: the one directory below `revisions/<id>/` (updates happen in
/// place, in the directory its first revision made).
fn prefix_of(data: &Path, id: &str) -> PathBuf {
    let dir = data.join(format!("scientific-envs/revisions/{id}"));
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    entries.pop().unwrap()
}

#[tokio::test]
async fn hostile_packages_are_refused_in_the_sandbox_and_release_the_cache_gate_at_once() {
    if !sandbox_or_skip("hostile_packages_are_refused_in_the_sandbox_and_release_the_cache_gate_at_once") {
        return;
    }
    let envs = ready(&[]).await;
    let s = &envs.server;
    let victim = task_env(s, "victim").await;
    let tenant = task_env(s, "tenant").await;
    let prefix = prefix_of(&s.data_dir, &victim);
    let before = tree(&prefix);
    for (pkg, want) in hostile() {
        // A second tenant's conda install runs alongside each refusal: the hostile step must
        // give the package cache's gate back at once, not after writing without bound.
        let started = Instant::now();
        let hostile = install(s, &victim, json!({"manager": "conda", "packages": [pkg.name]}));
        let other = install(s, &tenant, json!({"manager": "conda", "packages": ["tinyutil=2.0"]}));
        // Bounded here: a step that hangs would otherwise hold the test for its hour.
        let both = tokio::time::timeout(Duration::from_secs(300), async { tokio::join!(hostile, other) });
        let ((status, refused), (other_status, other_rev)) =
            both.await.unwrap_or_else(|_| panic!("{}: no answer in 5 minutes\n{}", pkg.name, s.stderr()));
        let took = started.elapsed();
        eprintln!("{}: refused, and the other tenant's install landed, in {took:?}", pkg.name);
        assert_eq!(status, 400, "{}: {refused}", pkg.name);
        let error = refused["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(&format!("Package {}-1.0-0.tar.bz2", pkg.name)) && error.contains(want),
            "{}: {refused}",
            pkg.name
        );
        assert!(error.contains("nothing was installed"), "{error}");
        assert_eq!(other_status, 201, "the other tenant's install lands: {other_rev}\n{}", s.stderr());
        assert!(took < Duration::from_secs(120), "{}: both done in {took:?}", pkg.name);
        assert_eq!(tree(&prefix), before, "{}: the prefix is as it was", pkg.name);
    }
    for escaped in ["/tmp/escaped-by-abspath", "escaped-by-dotdot"] {
        assert!(!Path::new(escaped).exists() && !s.path(escaped).exists(), "{escaped} was never written");
    }
    assert!(!s.path("scientific-envs/escaped-by-dotdot").exists());
    // A package refused for its metadata is not left in the shared cache for the next
    // lookup to read.
    let cached = tree(&s.path("scientific-envs"));
    for refused in ["pipemeta-1.0-0", "pipeindex-1.0-0"] {
        let found: Vec<_> = cached.iter().filter(|p| p.ends_with(refused)).collect();
        assert!(found.is_empty(), "{refused} left in the cache: {found:?}");
    }
    assert!(
        cached.iter().any(|p| p.ends_with("tinyutil-2.0-0")),
        "the cache is where this looks: {cached:?}"
    );
    // The refused environment is repairable: an ordinary install into it lands.
    let (status, rev) = install(s, &victim, json!({"manager": "conda", "packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{rev}\n{}", s.stderr());
    // And its links are links: python's own, made as links (never a copy of the target).
    let python3 = std::fs::symlink_metadata(prefix.join("bin/python3")).unwrap();
    assert!(python3.file_type().is_symlink(), "bin/python3 is a link");
}

#[tokio::test]
async fn pip_steps_are_stopped_at_the_file_and_prefix_limits_and_failed_installs_keep_no_wheel() {
    if !sandbox_or_skip(
        "pip_steps_are_stopped_at_the_file_and_prefix_limits_and_failed_installs_keep_no_wheel",
    ) {
        return;
    }
    // First: an environment with pip in it (ensurepip) and one wheel that landed.
    let mut envs = ready(&[]).await;
    let id = task_env(&envs.server, "bounded").await;
    let ws = envs.server.path("remote-workspaces/bound-ws");
    super::environments::build_wheel_with(&ws.join("dist/small-1.0-py3-none-any.whl"), "small", "1.0", &[]);
    runner_tests::hand_tree_to_sandbox(&ws);
    let wheel_body = |file: &str| json!({"manager": "pip", "packages": [format!("dist/{file}")], "runnerWorkspaceKey": "bound-ws"});
    let (status, rev) = install(&envs.server, &id, wheel_body("small-1.0-py3-none-any.whl")).await;
    assert_eq!(status, 201, "{rev}\n{}", envs.server.stderr());
    let small = rev["localWheels"][0]["content"]["hash"].as_str().unwrap().to_owned();
    let stored = || {
        let wheels = envs.server.path("scientific-envs/wheels");
        tree(&wheels).into_iter().filter(|p| p.components().count() == 2).collect::<Vec<_>>()
    };
    let only_small = [PathBuf::from(format!("{small}/small-1.0-py3-none-any.whl"))];
    assert_eq!(stored(), only_small);
    // A request refused half way through its copies (its second wheel is missing) keeps
    // none of them.
    super::environments::build_wheel_with(&ws.join("dist/other-1.0-py3-none-any.whl"), "other", "1.0", &[]);
    runner_tests::hand_tree_to_sandbox(&ws);
    let body = json!({
        "manager": "pip",
        "packages": ["dist/other-1.0-py3-none-any.whl", "dist/missing-1.0-py3-none-any.whl"],
        "runnerWorkspaceKey": "bound-ws",
    });
    let (status, refused) = install(&envs.server, &id, body).await;
    assert_eq!(status, 400, "{refused}");
    assert!(refused["error"].as_str().unwrap_or_default().contains("Local wheel not found"), "{refused}");
    assert_eq!(stored(), only_small, "the first wheel's copy went with the refusal");
    let held = bytes_below(&prefix_of(&envs.server.data_dir, &id));
    assert!(held > 1 << 20, "python and pip are in it: {held}");

    // Then the limits: 8 MiB per file, and the prefix's size now plus 12 MiB.
    let data_dir = envs.server.data_dir.display().to_string();
    envs.server.stop();
    let limit = held + (12 << 20);
    let (file_limit, prefix_limit) = ((8u64 << 20).to_string(), limit.to_string());
    let mut env = base_env(&envs.url);
    env.extend(
        [
            ("SCIENCE_AGENT_DATA_DIR", data_dir.as_str()),
            ("SCIENCE_AGENT_ENV_STEP_MAX_FILE_BYTES", file_limit.as_str()),
            ("SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES", prefix_limit.as_str()),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    // The first server's files are the data directory (it is removed with that server).
    let data = envs.server.data_dir.clone();
    let second = Server::start_with(ServerOptions { env, ..Default::default() });
    let s = &second;
    assert_eq!(setup_outcome(s).await["state"], "ready", "{}", s.stderr());

    // One 10 MiB file: past the per-file limit, whatever pip does with it.
    super::environments::build_wheel_with(
        &ws.join("dist/onebig-1.0-py3-none-any.whl"),
        "onebig",
        "1.0",
        &[("onebig_data.bin", 10 << 20)],
    );
    // Three 6 MiB files: each within it, together past the prefix's limit.
    let part = 6 << 20;
    super::environments::build_wheel_with(
        &ws.join("dist/manymid-1.0-py3-none-any.whl"),
        "manymid",
        "1.0",
        &[("manymid_a.bin", part), ("manymid_b.bin", part), ("manymid_c.bin", part)],
    );
    runner_tests::hand_tree_to_sandbox(&ws);
    let (status, refused) = install(s, &id, wheel_body("onebig-1.0-py3-none-any.whl")).await;
    assert_eq!(status, 400, "{refused}");
    let error = refused["error"].as_str().unwrap_or_default();
    eprintln!("the per-file limit's refusal: {error}");
    assert!(error.contains("env_step_max_file_bytes"), "the limit is named: {refused}");
    assert!(error.contains("File too large") || error.contains("larger than 8388608 bytes"), "{refused}");

    let (status, refused) = install(s, &id, wheel_body("manymid-1.0-py3-none-any.whl")).await;
    assert_eq!(status, 400, "{refused}");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!("more than the {limit} a prefix may hold (env_step_max_prefix_bytes, SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES)")),
        "{refused}"
    );

    // Neither failed install kept its wheel; the one a revision names stays.
    let wheels = data.join("scientific-envs/wheels");
    let stored: Vec<PathBuf> = tree(&wheels).into_iter().filter(|p| p.components().count() == 2).collect();
    assert_eq!(stored, [PathBuf::from(format!("{small}/small-1.0-py3-none-any.whl"))], "{}", s.stderr());
    assert_eq!(std::fs::read_dir(&wheels).unwrap().count(), 1, "no hash directory is left behind");

    // Deleting the environment lets its wheel go too: no live revision names it.
    let reply =
        s.client().send_bytes("DELETE", &format!("/environments/{id}"), &[], Vec::new()).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    assert_eq!(std::fs::read_dir(&wheels).unwrap().count(), 0, "{:?}", tree(&wheels));
}

#[tokio::test]
async fn a_decompression_bomb_is_stopped_at_the_fetch_budget_leaves_the_cache_as_it_was_and_frees_the_gate() {
    if !sandbox_or_skip(
        "a_decompression_bomb_is_stopped_at_the_fetch_budget_leaves_the_cache_as_it_was_and_frees_the_gate",
    ) {
        return;
    }
    // Set up under the default limits (the starter's own fetch is larger than the budget
    // below), then restarted over the same data directory with a 16 MiB fetch budget.
    let mut envs = ready(&[]).await;
    let victim = task_env(&envs.server, "victim").await;
    let tenant = task_env(&envs.server, "tenant").await;
    let data = envs.server.data_dir.clone();
    let data_dir = data.display().to_string();
    envs.server.stop();
    let budget: u64 = 16 << 20;
    let budget_text = budget.to_string();
    let mut env = base_env(&envs.url);
    env.extend(
        [
            ("SCIENCE_AGENT_DATA_DIR", data_dir.as_str()),
            ("SCIENCE_AGENT_ENV_STEP_MAX_FETCH_BYTES", &budget_text),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    let second = Server::start_with(ServerOptions { env, ..Default::default() });
    let s = &second;
    assert_eq!(setup_outcome(s).await["state"], "ready", "{}", s.stderr());
    let cache = data.join("scientific-envs/provisioner");
    let cache_before = bytes_below(&cache);
    let prefix = prefix_of(&data, &victim);
    let before = tree(&prefix);

    // The bomb and another tenant's install together: the bomb's fetch holds the cache's
    // exclusive gate until it is stopped, and must give it back at once.
    let started = Instant::now();
    let hostile = async {
        let answer = install(s, &victim, json!({"manager": "conda", "packages": ["zerobomb"]})).await;
        (answer, started.elapsed())
    };
    let other = install(s, &tenant, json!({"manager": "conda", "packages": ["tinyutil=2.0"]}));
    let both = tokio::time::timeout(Duration::from_secs(300), async { tokio::join!(hostile, other) });
    let (((status, refused), bomb_took), (other_status, other_rev)) =
        both.await.unwrap_or_else(|_| panic!("no answer in 5 minutes\n{}", s.stderr()));
    let took = started.elapsed();
    let error = refused["error"].as_str().unwrap_or_default();
    eprintln!("the bomb refused in {bomb_took:?}, the other install landed by {took:?}: {error}");
    assert_eq!(status, 400, "{refused}\n{}", s.stderr());
    assert!(
        error.contains(&format!(
            "bytes to the shared package cache, more than the {budget} one fetch may add (env_step_max_fetch_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FETCH_BYTES); install fewer or smaller packages, or ask the operator to raise the limit"
        )),
        "the budget, its key and the remedy are named: {refused}"
    );
    assert_eq!(other_status, 201, "the other tenant's install lands: {other_rev}\n{}", s.stderr());
    assert!(took < Duration::from_secs(120), "both done in {took:?}");

    // Nothing of the bomb is left in the shared cache (no half-extracted hidden directory, no
    // lock file, no finished package a later lookup would trust), and the cache grew by no
    // more than the other tenant's small package.
    let cached = tree(&cache);
    let left: Vec<_> = cached.iter().filter(|p| p.to_string_lossy().contains("zerobomb")).collect();
    assert!(left.is_empty(), "the bomb left {left:?} in the cache\n{}", s.stderr());
    assert!(
        cached.iter().any(|p| p.ends_with("tinyutil-2.0-0")),
        "the cache is where this looks: {cached:?}"
    );
    let grown = bytes_below(&cache).saturating_sub(cache_before);
    assert!(grown < 1 << 20, "the cache grew by {grown} bytes");
    assert!(s.stderr().contains("package_cache_restored"), "the removal is logged: {}", s.stderr());
    assert_eq!(tree(&prefix), before, "the victim's prefix is as it was");

    // The gate is free and the victim repairable: an ordinary install into it lands.
    let (status, rev) = install(s, &victim, json!({"manager": "conda", "packages": ["tinylib"]})).await;
    assert_eq!(status, 201, "{rev}\n{}", s.stderr());
}
