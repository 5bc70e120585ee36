//! Issue #8: per-execution memory, process, CPU and `/tmp` limits, in every enforcement mode
//! this machine offers — cgroup v1 as root, cgroup v1 handed to the unprivileged test user,
//! rlimits only — with real workloads (a Python memory hog, a fork bomb, CPU spinners, a
//! `/tmp` filler) in real sandboxes, and `/health` checked against what was observed.
//!
//! Tests that need root (cgroup v1 is only writable by root here, or by whoever root hands
//! a subtree to) skip loudly when unprivileged; under `CI=true` as root they must run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use runner_tests::server::{Server, ServerOptions, shell_request};
use runner_tests::{in_ci, sandbox_or_skip};
use serde_json::{Value, json};

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether this host has cgroup v1 hierarchies for memory, pids and cpu.
fn has_v1() -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let parsed = runnerd::limits::detect::parse_mounts(&mounts);
    ["memory", "pids", "cpu"]
        .iter()
        .all(|c| parsed.iter().any(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == *c)))
}

/// Root with cgroup v1, or a loud skip (a failure in CI, which runs as root on a v1 host).
fn root_v1_or_skip(test: &str) -> bool {
    if !sandbox_or_skip(test) {
        return false;
    }
    if is_root() && has_v1() {
        return true;
    }
    let why = if is_root() { "this host has no cgroup v1 memory/pids/cpu hierarchies" } else { "not root" };
    if in_ci() && is_root() {
        panic!("{test}: CI must exercise cgroup v1 as root, but {why}");
    }
    eprintln!("\n!!! SKIPPING {test}: {why} !!!\n");
    false
}

fn start(env: &[(&str, &str)]) -> Server {
    Server::start_with(ServerOptions {
        env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        ..Default::default()
    })
}

async fn health(server: &Server) -> Value {
    server.client().get("/health").await.unwrap().json()
}

async fn run(server: &Server, ws: &Path, code: &str, limits: Value) -> Value {
    let mut body = shell_request("main", "session-limits", ws, code);
    body["resourceLimits"] = limits;
    let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 200, "{}\n{}", String::from_utf8_lossy(&reply.body), server.stderr());
    reply.json()
}

/// Allocates and touches 16 MiB at a time, forever.
const HOG: &str = "python3 -c 'b=[]\nwhile True: b.append(b\"x\" * (16 << 20))'";

/// Forks children that sleep until the fork fails, then reports how many it made.
const FORK_BOMB: &str = "python3 -c '
import os, sys, time
n = 0
try:
    while n < 10000:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print(\"stopped after\", n, \"errno\", e.errno)
    sys.stdout.flush()
    time.sleep(float(os.environ.get(\"HOLD\", \"0\")))
'";

/// Spins for 1.5 s of wall time and prints the CPU seconds it got.
const SPINNER: &str = "python3 -c '
import time
end = time.monotonic() + 1.5
while time.monotonic() < end:
    pass
print(time.process_time())
'";

fn assert_oom(r: &Value, limit: u64) {
    assert_eq!(r["exitCode"], 137, "{r}");
    assert_eq!(r["signal"], "SIGKILL", "{r}");
    assert_eq!(r["oomKilled"], true, "{r}");
    let why = r["explanation"].as_str().unwrap_or_default();
    assert!(why.contains(&format!("memory limit of {limit} bytes")), "{r}");
    let peak = r["resourceUsage"]["peakMemoryBytes"].as_u64().unwrap();
    assert!(peak > limit / 2 && peak <= limit + (1 << 20), "peak {peak} against {limit}: {r}");
}

/// The execution cgroups under `root` named `<prefix>…`, once runnerd's removal (which
/// follows the answer, in the background) has had up to 5 s.
fn exec_cgroups_left(root: &Path, prefix: &str) -> Vec<PathBuf> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let left: Vec<_> = exec_cgroups(root)
            .into_iter()
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
            .collect();
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether the v1 memory cgroup `dir` is an unused spare: no task in it and no memory ever
/// charged to it (runnerd makes the next run's cgroup ahead, issue #18).
fn unused_spare(dir: &Path) -> bool {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|_| "?".into());
    read("tasks").trim().is_empty() && read("memory.max_usage_in_bytes").trim() == "0"
}

/// [`exec_cgroups_left`] that are not unused spares.
fn used_exec_cgroups_left(root: &Path, prefix: &str) -> Vec<PathBuf> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let left: Vec<_> = exec_cgroups(root)
            .into_iter()
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix) && !unused_spare(p))
            .collect();
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The unused spares named `<prefix>…` under the v1 memory hierarchy `root` limited to
/// `limit` bytes, once one has had up to 5 s to be made.
fn spares_limited_to(root: &Path, prefix: &str, limit: u64) -> Vec<PathBuf> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let found: Vec<_> = exec_cgroups(root)
            .into_iter()
            .filter(|p| {
                p.file_name().unwrap().to_string_lossy().starts_with(prefix)
                    && unused_spare(p)
                    && std::fs::read_to_string(p.join("memory.limit_in_bytes"))
                        .is_ok_and(|t| t.trim() == (limit & !4095).to_string())
            })
            .collect();
        if !found.is_empty() || std::time::Instant::now() > deadline {
            return found;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The execution cgroups under `root` right now.
fn exec_cgroups(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("exec-"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn v1_as_root_kills_a_memory_hog_and_says_so() {
    if !root_v1_or_skip("v1_as_root_kills_a_memory_hog_and_says_so") {
        return;
    }
    // The spares of issue #18 alone: sandboxes started ahead (issue #37) would take them
    // (suite::prestart checks limits in those).
    let server =
        start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1"), ("SCIENCE_AGENT_PRESTART_SANDBOXES", "0")]);
    let h = health(&server).await;
    assert_eq!(h["cgroupMode"], "cgroup-v1", "{h}");
    assert_eq!(h["cgroupDelegated"], false, "root is not delegated to");
    assert_eq!(h["enforced"]["memory"], true);
    assert_eq!(h["enforced"]["pids"], true);
    assert_eq!(h["enforced"]["cpu"], true);
    let root = PathBuf::from(h["cgroupRoot"].as_str().unwrap());
    assert!(root.join("memory.limit_in_bytes").exists(), "{}", root.display());

    let ws = server.project_workspace("hog");
    let limit = 128u64 << 20;
    let r = run(&server, &ws, HOG, json!({"memoryBytes": limit})).await;
    assert_oom(&r, limit);
    assert_eq!(r["cgroupMode"], "cgroup-v1");
    assert_eq!(r["resourceLimits"]["memoryBytes"], limit);
    assert_eq!(r["resourceLimits"]["enforced"]["memoryBytes"], true, "{r}");
    assert_eq!(r["resourceLimits"]["enforced"]["pids"], true, "{r}");
    // The run's end made the next run's cgroup ahead, with the same limits: no task ever
    // in it. A run with those limits takes it, and the limit holds there as well.
    let mine = format!("exec-{}-", server.pid().unwrap());
    let spares = spares_limited_to(&root, &mine, limit);
    assert_eq!(spares.len(), 1, "{spares:?} in {:?}", exec_cgroups(&root));
    let again = run(&server, &ws, HOG, json!({"memoryBytes": limit})).await;
    assert_oom(&again, limit);
    assert!(!spares[0].exists(), "the spare was used (and removed after its run)");
    // The runner goes on serving; the only cgroups of its left are unused spares, at most
    // two, and none once it stopped.
    let ok = run(&server, &ws, "echo fine", Value::Null).await;
    assert_eq!(ok["stdout"], "fine\n");
    assert_eq!(ok["oomKilled"], false);
    assert!(ok["resourceUsage"]["cpuTimeMs"].is_u64(), "{ok}");
    let left = used_exec_cgroups_left(&root, &mine);
    assert!(left.is_empty(), "cgroups left behind: {left:?}");
    let mine_now = exec_cgroups(&root).into_iter().filter(|p| p.to_string_lossy().contains(&mine)).count();
    assert!(mine_now <= 2, "{:?}", exec_cgroups(&root));
    let mut server = server;
    assert!(server.stop().success());
    let left = exec_cgroups_left(&root, &mine);
    assert!(left.is_empty(), "cgroups left after a graceful stop: {left:?}");
}

/// Issue #37: a run handed to a sandbox started ahead runs in that sandbox's cgroup, made
/// with the run's limits: the memory limit holds there, the OOM is explained, the counters
/// are the run's, and a graceful stop leaves no cgroup.
#[tokio::test]
async fn v1_a_memory_hog_served_ahead_is_killed_in_its_own_cgroup() {
    if !root_v1_or_skip("v1_a_memory_hog_served_ahead_is_killed_in_its_own_cgroup") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1")]);
    let root = PathBuf::from(health(&server).await["cgroupRoot"].as_str().unwrap().to_owned());
    let mine = format!("exec-{}-", server.pid().unwrap());
    let ws = server.project_workspace("hog-ahead");
    let limit = 128u64 << 20;
    let first = run(&server, &ws, "echo first", json!({"memoryBytes": limit})).await;
    assert_eq!(first["stdout"], "first\n", "{first}");
    let pool = |h: &Value| h["sandboxProfile"]["prestartedSandboxes"].clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let before = loop {
        let p = pool(&health(&server).await);
        // Waiting and set up by bwrap: one still being set up is given only a bounded time.
        if p["waiting"] == 1 && p["settled"] == 1 {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "no sandbox waits, set up: {p}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let r = run(&server, &ws, HOG, json!({"memoryBytes": limit})).await;
    assert_eq!(
        pool(&health(&server).await)["hits"],
        before["hits"].as_u64().unwrap() + 1,
        "not served ahead"
    );
    assert_oom(&r, limit);
    // The counters are this run's: its Python allocated up to the limit.
    assert!(r["resourceUsage"]["cpuTimeMs"].as_u64().unwrap() > 0, "{r}");
    let mut server = server;
    assert!(server.stop().success());
    let left = exec_cgroups_left(&root, &mine);
    assert!(left.is_empty(), "cgroups left after a graceful stop: {left:?}");
}

#[tokio::test]
async fn v1_fork_bomb_is_stopped_while_other_executions_run() {
    if !root_v1_or_skip("v1_fork_bomb_is_stopped_while_other_executions_run") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1")]);
    let prefix = format!("exec-{}-", server.pid().unwrap());
    let ws_bomb = server.project_workspace("bomb");
    let ws_other = server.project_workspace("other");
    // The bomb holds its processes at the limit for 3 s.
    let bomb_code = format!("HOLD=3 {FORK_BOMB}");
    let bomb = run(&server, &ws_bomb, &bomb_code, json!({"pids": 32}));
    let other = async {
        // Wait until the bomb's cgroup is full, then run something else meanwhile.
        let mut full = false;
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(25)).await;
            let counts: Vec<u64> = walk_pids_current(Path::new("/sys/fs/cgroup/pids"), &prefix);
            if counts.iter().any(|c| *c >= 32) {
                full = true;
                break;
            }
        }
        let r = run(&server, &ws_other, "echo still serving", Value::Null).await;
        (full, r)
    };
    let (bomb, (full, other)) = tokio::join!(bomb, other);
    assert!(full, "the bomb's cgroup never reached its pids.max of 32");
    assert_eq!(other["stdout"], "still serving\n", "{other}");
    let out = bomb["stdout"].as_str().unwrap();
    let made: u64 = out.split_whitespace().nth(2).and_then(|n| n.parse().ok()).unwrap_or(u64::MAX);
    assert!(out.starts_with("stopped after") && made < 32, "{bomb}");
    assert!(out.trim_end().ends_with("errno 11"), "EAGAIN: {bomb}");
    assert_eq!(bomb["pidsLimitReached"], true, "{bomb}");
    assert!(bomb["explanation"].as_str().unwrap().contains("process limit of 32"), "{bomb}");
    // The process high-water mark is the limit itself (pids.peak).
    assert_eq!(bomb["resourceUsage"]["pidsPeak"], 32, "{bomb}");
}

/// `pids.current` of every execution cgroup named `<prefix>…` in the hierarchy below `dir`.
fn walk_pids_current(dir: &Path, prefix: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().unwrap().to_string_lossy().starts_with(prefix)
                    && let Some(n) = std::fs::read_to_string(p.join("pids.current"))
                        .ok()
                        .and_then(|t| t.trim().parse().ok())
                {
                    out.push(n);
                }
                stack.push(p);
            }
        }
    }
    out
}

#[tokio::test]
async fn v1_cpu_limit_throttles_a_spinner() {
    if !root_v1_or_skip("v1_cpu_limit_throttles_a_spinner") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1")]);
    let ws = server.project_workspace("spin");
    let free = run(&server, &ws, SPINNER, json!({"cpu": 0})).await;
    let limited = run(&server, &ws, SPINNER, json!({"cpu": 0.1})).await;
    let cpu = |r: &Value| r["stdout"].as_str().unwrap().trim().parse::<f64>().unwrap();
    let (free_s, limited_s) = (cpu(&free), cpu(&limited));
    // 0.1 of a core against whatever an unlimited spinner got on this (shared) machine.
    let ratio = limited_s / free_s;
    assert!(ratio < 0.6, "limited {limited_s} s vs unlimited {free_s} s (ratio {ratio:.2})");
    assert!(limited["resourceUsage"]["cpuThrottledPeriods"].as_u64().unwrap() > 0, "{limited}");
    assert_eq!(limited["resourceLimits"]["cpu"], 0.1);
    let cgroup_ms = limited["resourceUsage"]["cpuTimeMs"].as_u64().unwrap();
    assert!(
        cgroup_ms as f64 >= limited_s * 1000.0 * 0.5,
        "cgroup saw {cgroup_ms} ms, the process {limited_s} s"
    );
}

/// Fills `/tmp` past its size: the tmpfs stops it at the size (every mode: bwrap --size).
async fn tmp_fills_to_its_size(server: &Server) {
    let ws = server.project_workspace("tmpfill");
    let code =
        "dd if=/dev/zero of=/tmp/fill bs=1M count=32 2>/dev/null || echo full >&2; stat -c %s /tmp/fill";
    let r = run(server, &ws, code, json!({"tmpBytes": 8 << 20})).await;
    let size: u64 = r["stdout"].as_str().unwrap().trim().parse().unwrap();
    assert!((7 << 20..=8 << 20).contains(&size), "{r}");
    assert_eq!(r["stderr"], "full\n", "dd must have failed at the size: {r}");
    assert_eq!(r["resourceLimits"]["tmpBytes"], 8 << 20);
}

/// From inside a sandbox: no cgroup file can be written, no cgroup filesystem mounted.
async fn sandbox_cannot_touch_cgroups(server: &Server, host_root: Option<&Path>) {
    let ws = server.project_workspace("cgfs");
    let code = r#"
for f in $(find /sys/fs/cgroup /proc/self/root/sys/fs/cgroup -maxdepth 4 -type f 2>/dev/null); do
  (echo 0 > "$f") 2>/dev/null && echo "WROTE $f"
done
mkdir -p /tmp/m
for t in "cgroup2 none" "cgroup memory"; do
  set -- $t
  mount -t "$1" -o "$2" none /tmp/m 2>/dev/null && echo "MOUNTED $1"
done
python3 -c 'import os; print("SEE", os.path.exists("/sys/fs/cgroup/memory") or os.path.exists("/sys/fs/cgroup/cgroup.procs"))'
true
"#;
    let r = run(server, &ws, code, Value::Null).await;
    let out = r["stdout"].as_str().unwrap();
    assert!(!out.contains("WROTE") && !out.contains("MOUNTED"), "{r}");
    assert!(out.contains("SEE False"), "the cgroup filesystem is visible in the sandbox: {r}");
    // And the host's execution cgroups (which the sandbox's uid owns when delegated) were
    // not changed: none of their limits reads 0.
    if let Some(root) = host_root {
        assert!(root.join("memory.limit_in_bytes").exists() || root.join("memory.max").exists());
    }
}

#[tokio::test]
async fn v1_tmp_size_and_cgroupfs_from_inside() {
    if !root_v1_or_skip("v1_tmp_size_and_cgroupfs_from_inside") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1")]);
    let root = PathBuf::from(health(&server).await["cgroupRoot"].as_str().unwrap().to_owned());
    tmp_fills_to_its_size(&server).await;
    sandbox_cannot_touch_cgroups(&server, Some(&root)).await;
}

#[tokio::test]
async fn rlimits_only_mode_is_honest_about_what_it_can_do() {
    if !sandbox_or_skip("rlimits_only_mode_is_honest_about_what_it_can_do") {
        return;
    }
    let server =
        start(&[("SCIENCE_AGENT_CGROUP_MODE", "rlimits-only"), ("SCIENCE_AGENT_EXEC_TIMEOUT_MS", "20000")]);
    let h = health(&server).await;
    assert_eq!(
        (h["cgroupMode"].as_str(), h["cgroupDelegated"].as_bool()),
        (Some("none"), Some(false)),
        "{h}"
    );
    assert_eq!(h["cgroupRoot"], "");
    assert_eq!(h["enforced"]["memory"], "partial");
    assert_eq!(h["enforced"]["pids"], false);
    assert_eq!(h["enforced"]["cpu"], "partial");
    assert!(h["reasons"]["pids"].as_str().unwrap().contains("RLIMIT_NPROC"), "{h}");
    assert!(h["reasons"]["memory"].as_str().unwrap().contains("SCIENCE_AGENT_CGROUP_MODE is rlimits-only"));

    // RLIMIT_AS: the hog gets a MemoryError rather than an OOM kill; nothing claims an OOM.
    let ws = server.project_workspace("hog");
    let r = run(&server, &ws, HOG, json!({"memoryBytes": 256 << 20})).await;
    assert_eq!(r["exitCode"], 1, "{r}");
    assert!(r["stderr"].as_str().unwrap().contains("MemoryError"), "{r}");
    assert!(r.get("oomKilled").is_none() && r.get("resourceUsage").is_none(), "{r}");
    assert_eq!(r["cgroupMode"], "none");
    // Issue #14 hole 12: the result must not present the pids limit as applied.
    let limits = &r["resourceLimits"];
    assert_eq!(limits["pids"], 256, "{r}");
    assert_eq!(limits["enforced"]["pids"], false, "{r}");
    assert_eq!(limits["enforced"]["memoryBytes"], "partial", "{r}");
    assert_eq!(limits["enforced"]["cpu"], "partial", "{r}");
    assert_eq!(limits["enforced"]["tmpBytes"], true, "{r}");
    tmp_fills_to_its_size(&server).await;
    sandbox_cannot_touch_cgroups(&server, None).await;
}

#[tokio::test]
async fn requests_beyond_the_maxima_are_refused() {
    let server =
        start(&[("SCIENCE_AGENT_CGROUP_MODE", "rlimits-only"), ("SCIENCE_AGENT_LIMIT_MAX_PIDS", "100")]);
    let ws = server.project_workspace("max");
    for (limits, want) in [
        (json!({"pids": 101}), "resourceLimits.pids may be at most 100"),
        (json!({"pids": 0}), "resourceLimits.pids may be at most 100"),
        (json!({"memoryBytes": "1G"}), "resourceLimits.memoryBytes must be a non-negative number"),
        (json!({"swap": 1}), "resourceLimits.swap is not a limit"),
    ] {
        let mut body = shell_request("main", "session-limits", &ws, "echo ran > ran.txt");
        body["resourceLimits"] = limits;
        let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
        assert_eq!(reply.status, 400);
        let e = reply.json();
        assert_eq!(e["code"], "invalid_resource_limits", "{e}");
        assert!(e["error"].as_str().unwrap().contains(want), "{e}");
        assert!(!ws.join("ran.txt").exists(), "nothing may run");
    }
}

/// With the default (auto) choice, health says what this host gave, and why not better.
#[tokio::test]
async fn auto_mode_health_matches_the_host() {
    if !sandbox_or_skip("auto_mode_health_matches_the_host") {
        return;
    }
    let server = start(&[]);
    let h = health(&server).await;
    let mode = h["cgroupMode"].as_str().unwrap();
    let reasons = h["resourceLimits"]["fallbackReasons"].as_array().unwrap().clone();
    let v2_refused = reasons.iter().any(|r| {
        let r = r.as_str().unwrap();
        r.starts_with("cgroup v2: controllers missing") || r.starts_with("cgroup v2: no cgroup2")
    });
    if is_root() && has_v1() {
        assert_eq!(mode, "cgroup-v1", "{h}");
        // This kind of host: cgroup2 without controllers.
        assert!(v2_refused, "{h}");
        assert_eq!(h["enforced"]["memory"], true);
    } else if mode == "none" {
        assert!(!reasons.is_empty(), "rlimits-only must say why: {h}");
        assert_eq!(h["enforced"]["pids"], false);
    }
    if in_ci() && is_root() {
        assert_ne!(mode, "none", "CI as root has cgroups: {h}");
    }
    // What health claims is what a run reports.
    let ws = server.project_workspace("auto");
    let r = run(&server, &ws, "true", Value::Null).await;
    assert_eq!(r["cgroupMode"], mode);
    assert_eq!(r.get("resourceUsage").is_some(), mode != "none", "{r}");
}

/// The test user's (uid, gid), from `RUNNER_TEST_USER` or `sbxtest`.
fn test_user() -> Option<(String, u32, u32)> {
    let name = std::env::var("RUNNER_TEST_USER").unwrap_or_else(|_| "sbxtest".into());
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.first() != Some(&name.as_str()) || f.len() < 4 {
            return None;
        }
        Some((name.clone(), f[2].parse().ok()?, f[3].parse().ok()?))
    })
}

/// A v1 subtree handed to a user: `<hierarchy>/<root's own cgroup>/<name>` in each
/// hierarchy, the directory, `cgroup.procs` and `tasks` chowned. Removed on drop.
struct HandedOver {
    dirs: Vec<PathBuf>,
}

impl HandedOver {
    fn new(name: &str, uid: u32, gid: u32) -> HandedOver {
        let mounts =
            runnerd::limits::detect::parse_mounts(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
        let own = runnerd::limits::detect::parse_own(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
        let mut dirs: Vec<PathBuf> = Vec::new();
        for controller in ["memory", "pids", "cpu", "cpuacct"] {
            let Some((mount, _, _)) =
                mounts.iter().find(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == controller))
            else {
                continue;
            };
            let path = own.iter().find(|(c, _)| c.iter().any(|x| x == controller)).unwrap().1.clone();
            let dir = Path::new(mount).join(path.trim_start_matches('/')).join(name);
            if dirs.contains(&dir) {
                continue;
            }
            std::fs::create_dir(&dir).unwrap();
            for p in [dir.clone(), dir.join("cgroup.procs"), dir.join("tasks")] {
                std::os::unix::fs::chown(&p, Some(uid), Some(gid)).unwrap();
            }
            dirs.push(dir);
        }
        HandedOver { dirs }
    }
}

impl Drop for HandedOver {
    fn drop(&mut self) {
        for d in &self.dirs {
            // Execution cgroups inside were removed by runnerd; say so if not.
            if let Err(e) = std::fs::remove_dir(d) {
                eprintln!("could not remove {}: {e} (left: {:?})", d.display(), exec_cgroups(d));
            }
        }
    }
}

#[tokio::test]
async fn v1_handed_to_the_unprivileged_user() {
    if !root_v1_or_skip("v1_handed_to_the_unprivileged_user") {
        return;
    }
    let Some((user, uid, gid)) = test_user() else {
        assert!(!in_ci(), "CI must have the unprivileged test user");
        eprintln!(
            "\n!!! SKIPPING v1_handed_to_the_unprivileged_user: no test user (set RUNNER_TEST_USER) !!!\n"
        );
        return;
    };
    let name = format!("limits-test-{}", std::process::id());
    let handed = HandedOver::new(&name, uid, gid);
    {
        let server = Server::start_with(ServerOptions {
            env: vec![
                ("SCIENCE_AGENT_CGROUP_MODE".into(), "cgroup-v1".into()),
                ("SCIENCE_AGENT_CGROUP_ROOT".into(), name.clone()),
            ],
            run_as: Some((uid, gid)),
            ..Default::default()
        });
        let h = health(&server).await;
        assert_eq!(h["executionUser"], user);
        assert_eq!(
            (h["cgroupMode"].as_str(), h["cgroupDelegated"].as_bool()),
            (Some("cgroup-v1"), Some(true)),
            "{h}"
        );
        assert!(h["cgroupRoot"].as_str().unwrap().ends_with(&name), "{h}");
        let ws = server.project_workspace("hog");
        server.project_workspace("cgfs");
        let status = std::process::Command::new("chown")
            .arg("-R")
            .arg(format!("{uid}:{gid}"))
            .arg(server.data_dir.join("projects"))
            .status()
            .unwrap();
        assert!(status.success());
        let limit = 96u64 << 20;
        let r = run(&server, &ws, HOG, json!({"memoryBytes": limit})).await;
        assert_oom(&r, limit);
        // The unprivileged runner could not raise the limit of the subtree it was handed
        // from inside a sandbox either.
        sandbox_cannot_touch_cgroups(&server, Some(&handed.dirs[0])).await;
    }
    // runnerd removed its execution cgroups; the subtree is empty again (Drop checks).
    for d in &handed.dirs {
        let left = exec_cgroups_left(d, "exec-");
        assert!(left.is_empty(), "{}: {left:?}", d.display());
    }
}

/// cgroup v2's mechanics on this host's own cgroup2 (which has no controllers here, so no
/// limits): the supervisor/ self-move, a real sandbox joining an execution cgroup through
/// sandbox-init, and `cgroup.kill` ending the whole sandbox, then removal. Root only: the
/// cgroup2 tree is root's.
#[tokio::test]
async fn v2_supervisor_move_join_and_cgroup_kill_on_this_hosts_cgroup2() {
    use runnerd::limits::cgroup::{ExecCgroup, Flavor, Hierarchy, move_into_supervisor};
    let test = "v2_supervisor_move_join_and_cgroup_kill_on_this_hosts_cgroup2";
    if !sandbox_or_skip(test) {
        return;
    }
    let mounts =
        runnerd::limits::detect::parse_mounts(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    let own = runnerd::limits::detect::parse_own(&std::fs::read_to_string("/proc/self/cgroup").unwrap());
    let v2 = mounts.iter().find(|(_, t, _)| t == "cgroup2").map(|(m, _, _)| m.clone());
    let own_v2 = own.iter().find(|(c, _)| c.is_empty()).map(|(_, p)| p.clone());
    let (Some(mount), Some(own_v2), true) = (v2, own_v2, is_root()) else {
        assert!(!(in_ci() && is_root()), "{test}: CI as root must have a cgroup2 mount");
        eprintln!("\n!!! SKIPPING {test}: needs root and a cgroup2 mount !!!\n");
        return;
    };
    let base = Path::new(&mount)
        .join(own_v2.trim_start_matches('/'))
        .join(format!("limits-v2-{}", std::process::id()));
    std::fs::create_dir(&base).unwrap();
    // Every non-root cgroup has cgroup.kill on kernels that have it (5.14+).
    if !base.join("cgroup.kill").exists() {
        std::fs::remove_dir(&base).unwrap();
        assert!(!in_ci(), "{test}: the CI kernel must have cgroup.kill (5.14+)");
        eprintln!("\n!!! SKIPPING {test}: no cgroup.kill on this kernel !!!\n");
        return;
    }

    // The self-move, applied to a stand-in process (moving the test binary itself would
    // move every other test's threads with it).
    let mut stand_in = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    move_into_supervisor(&base.join("supervisor"), stand_in.id()).unwrap();
    let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", stand_in.id())).unwrap();
    assert!(membership.lines().any(|l| l.starts_with("0::") && l.ends_with("/supervisor")), "{membership}");

    // An execution cgroup without controllers (none exist in v2 here): nothing to limit,
    // but joining, listing and cgroup.kill are v2's own.
    let hierarchy = Hierarchy { dir: base.clone(), controllers: Vec::new() };
    let unlimited = runnerd::limits::Limits { memory_bytes: 0, pids: 0, cpu_millicores: 0, tmp_bytes: 0 };
    let group = ExecCgroup::create(Flavor::V2, &[hierarchy], "exec-1-1", &unlimited).unwrap();
    let dir = group.dirs().next().unwrap().to_path_buf();
    let fixture = runner_tests::Fixture::new().await;
    let mut launch = fixture.launch(
        runnerd::sandbox::Language::Shell,
        "sleep 60 & sleep 60",
        Some(Duration::from_secs(30)),
    );
    launch.cgroup_procs = group.procs_fds().unwrap();
    let run = fixture.run(launch, 1 << 16);
    let killer = async {
        let mut seen = 0;
        for _ in 0..400 {
            tokio::time::sleep(Duration::from_millis(25)).await;
            seen = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap().lines().count();
            // bwrap's monitor, the namespace init, bash and two sleeps.
            if seen >= 5 {
                break;
            }
        }
        group.kill();
        (seen, group)
    };
    let ((outcome, _), (seen, group)) = tokio::join!(run, killer);
    assert!(seen >= 5, "the sandbox did not join the cgroup (saw {seen} processes)");
    assert!(
        matches!(
            outcome.termination,
            runnerd::launch::Termination::Signaled(9) | runnerd::launch::Termination::Exited(137)
        ),
        "cgroup.kill ends the sandbox: {:?}",
        outcome.termination
    );
    assert!(outcome.elapsed < Duration::from_secs(30), "ended by the kill, not the timeout");
    group.remove_blocking().unwrap();
    assert!(!dir.exists());

    let _ = stand_in.kill();
    let _ = stand_in.wait();
    std::fs::remove_dir(base.join("supervisor")).unwrap();
    std::fs::remove_dir(&base).unwrap();
}

/// A forced v2 on a host whose cgroup2 has no controllers: start-up refuses, naming why.
#[tokio::test]
async fn forced_v2_without_controllers_refuses_to_start_and_says_why() {
    let mounts =
        runnerd::limits::detect::parse_mounts(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    let controllers_here = mounts
        .iter()
        .find(|(_, t, _)| t == "cgroup2")
        .and_then(|(m, _, _)| std::fs::read_to_string(Path::new(m).join("cgroup.controllers")).ok())
        .unwrap_or_default();
    if controllers_here.contains("memory") {
        eprintln!("\n!!! SKIPPING forced_v2_without_controllers: this host's cgroup2 has controllers !!!\n");
        return;
    }
    let scratch = runner_tests::scratch_dir();
    let out = tokio::process::Command::new(runner_tests::bin("runnerd"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
        .env("SCIENCE_AGENT_DATA_DIR", scratch.path())
        .env("SCIENCE_AGENT_RUNNER_PORT", "0")
        .env("SCIENCE_AGENT_CONFIG", "/dev/null")
        .env("SCIENCE_AGENT_RUNNER_TOKEN", "limits-test-token")
        .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
        .env("SCIENCE_AGENT_EGRESS_SOCKET", scratch.path().join("none.sock"))
        .env("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v2")
        .env(runner_tests::sandbox_user_env().0, runner_tests::sandbox_user_env().1)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("SCIENCE_AGENT_CGROUP_MODE is cgroup-v2, but that mode is not available here")
            && (stderr.contains("controllers missing") || stderr.contains("no cgroup2 filesystem")),
        "{stderr}"
    );
}

/// A crashed runnerd's execution cgroups (named for a pid that no longer runs) are removed
/// at the next start-up; those of a live process are left alone.
#[tokio::test]
async fn v1_stale_execution_cgroups_are_removed_at_start_up() {
    if !root_v1_or_skip("v1_stale_execution_cgroups_are_removed_at_start_up") {
        return;
    }
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let alive = std::process::id();
    let name = format!("limits-stale-{alive}");
    // A subtree of our own (as the handed-over test makes one), so that no other test's
    // runnerd sweeps it.
    let handed = HandedOver::new(&name, 0, 0);
    let mut made = Vec::new();
    for d in &handed.dirs {
        for owner in [dead, alive] {
            let dir = d.join(format!("exec-{owner}-0"));
            std::fs::create_dir(&dir).unwrap();
            made.push((owner, dir));
        }
    }
    {
        let server =
            start(&[("SCIENCE_AGENT_CGROUP_MODE", "cgroup-v1"), ("SCIENCE_AGENT_CGROUP_ROOT", &name)]);
        assert_eq!(health(&server).await["cgroupMode"], "cgroup-v1");
        for (owner, dir) in &made {
            assert_eq!(dir.exists(), *owner == alive, "{}", dir.display());
        }
    }
    for (owner, dir) in made {
        if owner == alive {
            std::fs::remove_dir(dir).unwrap();
        }
    }
}
