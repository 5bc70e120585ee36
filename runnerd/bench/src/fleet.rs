//! `runnerd-bench fleet` (issue #35's targets): runner-router in front of runnerd nodes on
//! loopback, against the same requests sent to a node directly, in the same run.
//!
//! * (a) One node (127.0.0.2) and one router in front of it: sequential signed
//!   `POST /execute-shell` of `true` in one workspace, in blocks of [`BLOCK`] alternating
//!   direct and through the router, so that drift hits both; p50/p95 of each, the
//!   router's overhead at p50 and the ratio.
//! * (b) The router's own CPU (utime+stime of `/proc/PID/stat`, and its threads' schedstat
//!   to the nanosecond) per routed execution of (a), load polls included; the node's CPU
//!   per execution, direct and routed, for context.
//! * (c) The first call of a new workspace (a new key each time), through the router and
//!   directly, interleaved: with one node, and with three (the router asks every node
//!   `where` before it places); one `where` alone from a fresh connection; and
//!   [`placement::order`] alone, in this process, over three polled fake nodes.
//! * (d) Three nodes (127.0.0.2, .3, .4, each its own data directory): executions per
//!   second of [`CLIENTS`] concurrent clients, each in its own workspace (and as its own
//!   agent), for a fixed time, through the router over the three against directly to one
//!   node; in [`PARTS`] interleaved parts; failures (anything but 200 with exit code 0) counted.
//!
//! `RUNNERD_BENCH_FLEET_PERF="record -g -o FILE"` (any perf arguments; `-p <router's pid>` is
//! added) runs perf on the router during the case `RUNNERD_BENCH_FLEET_PERF_CASE` names: `a`
//! (the default; the direct blocks then count the idle router too) or `d` (all its parts).
//! That case's routed timings then include perf's cost.
//!
//! The same two cores serve every node here: three nodes cannot be faster than one, only the
//! router can make them slower. Figures only, never pass/fail.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use runner_router::fleet::{Fleet, Load, Member, Pool};
use runner_router::placement;
use runnerctl::client::{Endpoint, RunnerClient};

use crate::perf::Perf;
use crate::{
    BENCH_TOKEN, Daemon, Scratch, Stats, live_threads_cpu_ms, own_cpu_ms, start_runnerd_with, stats,
};

/// Executions per block in (a): one block direct, the next through the router.
const BLOCK: usize = 10;
/// New workspaces per case in (c).
const NEW_WORKSPACES: usize = 50;
/// Concurrent clients in (d).
const CLIENTS: usize = 8;
/// The parts (d)'s time per case is cut into, direct and routed alternating.
const PARTS: usize = 4;
/// Calls of [`placement::order`] timed in (c).
const PLACEMENTS: usize = 100_000;
/// The nodes' loopback addresses.
const HOSTS: [&str; 3] = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
/// How often the router reads each node's load: its default, as deployed.
const LOAD_INTERVAL_MS: u64 = runner_router::config::DEFAULT_LOAD_INTERVAL_MS;
/// perf's arguments, and (`…_CASE`) the case it records.
const PERF: &str = "RUNNERD_BENCH_FLEET_PERF";

/// A runner-router started from the binary next to this one (or `RUNNERD_BENCH_ROUTER`).
struct Router {
    child: Child,
    client: Arc<RunnerClient>,
    stderr: PathBuf,
    _scratch: Scratch,
}

impl Router {
    /// In front of `nodes`, on an ephemeral port of 127.0.0.1; waits until it has read
    /// every node's load once.
    async fn over(nodes: &[&Daemon], tag: &str) -> anyhow::Result<Router> {
        let exe = router_binary();
        let scratch =
            Scratch(std::env::temp_dir().join(format!("runnerd-bench-{tag}-{}", std::process::id())));
        std::fs::create_dir_all(&scratch.0)?;
        let urls = nodes.iter().map(|n| url(&n.endpoint)).collect::<anyhow::Result<Vec<_>>>()?;
        let stderr = scratch.0.join("runner-router.stderr");
        let mut child = Command::new(&exe)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
            .env("SCIENCE_AGENT_ROUTER_NODES", urls.join(","))
            .env("SCIENCE_AGENT_RUNNER_TOKEN", BENCH_TOKEN)
            .env("SCIENCE_AGENT_RUNNER_PORT", "0")
            .env("SCIENCE_AGENT_DATA_DIR", scratch.0.join("data"))
            .env("SCIENCE_AGENT_ROUTER_CONFIG", "/dev/null")
            .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
            .env("SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS", LOAD_INTERVAL_MS.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().context("stdout")?));
        let first = lines.next().transpose()?.unwrap_or_default();
        let Some(address) = first.strip_prefix("runner-router listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "runner-router did not start ({first:?}):\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
        };
        let client = Arc::new(RunnerClient::new(Endpoint::parse(address), BENCH_TOKEN));
        std::thread::spawn(move || for _ in lines {});
        let router = Router { child, client, stderr, _scratch: scratch };
        router.until_polled(nodes.len()).await?;
        Ok(router)
    }

    /// Until `/fleet/nodes` shows a load for each of the `n` nodes.
    async fn until_polled(&self, n: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(LOAD_INTERVAL_MS * 3 + 5_000);
        loop {
            let reply = self.client.get("/fleet/nodes").await?;
            let polled = reply.json()["nodes"]
                .as_array()
                .map_or(0, |a| a.iter().filter(|n| n["routable"] == true && n["load"].is_object()).count());
            if reply.status == 200 && polled == n {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the router has not read its {n} nodes' load: {}\n{}",
                    reply.json(),
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: a signal to our own child, not yet waited for (its pid is its own).
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The runner-router next to this binary (`RUNNERD_BENCH_ROUTER` names another).
fn router_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("RUNNERD_BENCH_ROUTER") {
        return PathBuf::from(p);
    }
    std::env::current_exe()
        .map(|e| e.with_file_name("runner-router"))
        .unwrap_or_else(|_| "runner-router".into())
}

fn url(endpoint: &Endpoint) -> anyhow::Result<String> {
    match endpoint {
        Endpoint::Tcp(addr) => Ok(format!("http://{addr}")),
        Endpoint::Unix(p) => bail!("runnerd listens on {}, not TCP", p.display()),
    }
}

/// A node on `host`, in its own data directory, away from this host's configuration, envs
/// and egressd.
fn start_node(init: &Path, host: &str, tag: &str) -> anyhow::Result<Daemon> {
    let no_egressd = std::env::temp_dir()
        .join(format!("runnerd-bench-{tag}-no-egressd-{}", std::process::id()))
        .join("control.sock");
    let no_egressd = no_egressd.to_str().context("a UTF-8 temp dir")?;
    start_runnerd_with(
        init,
        tag,
        &[
            ("SCIENCE_AGENT_RUNNER_HOST", host),
            ("SCIENCE_AGENT_CONFIG", "/dev/null"),
            ("SCIENCE_AGENT_EGRESS_SOCKET", no_egressd),
            ("SCIENTIFIC_ENVS", "0"),
        ],
    )
}

/// What one signed `POST /execute-shell` of `true` came to.
enum Outcome {
    Ok(Duration),
    /// Any other answer: its status (and the exit code when 200), or that none came.
    Failed(String),
}

/// One signed `POST /execute-shell` of `true` in the remote workspace `key`, as `agent`.
async fn execute(client: &RunnerClient, key: &str, agent: &str) -> Outcome {
    let body = crate::true_request(key, agent);
    let start = Instant::now();
    match client.post_signed("/execute-shell", &body).await {
        Ok(reply) if reply.status == 200 && reply.json()["exitCode"] == 0 => Outcome::Ok(start.elapsed()),
        Ok(reply) if reply.status == 200 => {
            Outcome::Failed(format!("200, exit code {}", reply.json()["exitCode"]))
        }
        Ok(reply) => {
            Outcome::Failed(format!("{} {}", reply.status, reply.json()["code"].as_str().unwrap_or("")))
        }
        Err(e) => Outcome::Failed(format!("no answer: {e}")),
    }
}

/// [`execute`] where anything but success ends the bench.
async fn execute_ok(client: &RunnerClient, key: &str) -> anyhow::Result<Duration> {
    match execute(client, key, "bench").await {
        Outcome::Ok(d) => Ok(d),
        Outcome::Failed(why) => bail!("an execution in {key} failed: {why}"),
    }
}

/// CPU ms of `pid` so far: utime+stime (clock ticks) and its live threads' schedstat.
#[derive(Clone, Copy, Default)]
struct Cpu {
    ticks_ms: f64,
    threads_ms: f64,
}

impl Cpu {
    fn of(pid: u32) -> anyhow::Result<Cpu> {
        Ok(Cpu { ticks_ms: own_cpu_ms(pid)?, threads_ms: live_threads_cpu_ms(pid)? })
    }

    /// What `pid` spent since `self`, added to `into`.
    fn add_since(self, pid: u32, into: &mut Cpu) -> anyhow::Result<()> {
        let now = Cpu::of(pid)?;
        into.ticks_ms += now.ticks_ms - self.ticks_ms;
        into.threads_ms += now.threads_ms - self.threads_ms;
        Ok(())
    }

    fn per(&self, n: usize) -> String {
        let n = n.max(1) as f64;
        format!("{:.3} ms ({:.3} ms)", self.ticks_ms / n, self.threads_ms / n)
    }
}

pub async fn bench(init: &Path, n: usize, duration: Duration) -> anyhow::Result<()> {
    let node1 = start_node(init, HOSTS[0], "fleet-1")?;
    println!(
        "runnerd-bench fleet: runner-router {} in front of runnerd nodes on loopback ({}), release builds; \
         the router reads each node's load every {LOAD_INTERVAL_MS} ms",
        router_binary().display(),
        HOSTS.join(", ")
    );
    let router1 = Router::over(&[&node1], "fleet-router-1").await?;
    let direct = RunnerClient::new(node1.endpoint.clone(), BENCH_TOKEN);
    let overhead = sequential(&node1, &direct, &router1, n).await?;
    let one = new_workspaces(&direct, &router1.client, "one").await?;
    drop(router1);

    let node2 = start_node(init, HOSTS[1], "fleet-2")?;
    let node3 = start_node(init, HOSTS[2], "fleet-3")?;
    let router3 = Router::over(&[&node1, &node2, &node3], "fleet-router-3").await?;
    let three = new_workspaces(&direct, &router3.client, "three").await?;
    let asked = where_alone(&direct).await?;
    print_new_workspaces(&one, &three, asked, overhead);
    placement_alone();
    throughput(&[&node1, &node2, &node3], &router3, duration).await
}

/// (a) and (b): the router's overhead, paired by rounds (see [`paired`]), for (c).
async fn sequential(node: &Daemon, direct: &RunnerClient, router: &Router, n: usize) -> anyhow::Result<f64> {
    const KEY: &str = "bench/fleet-seq";
    // The first call creates the workspace on the node; the router then finds it there.
    for _ in 0..5 {
        execute_ok(direct, KEY).await?;
        execute_ok(&router.client, KEY).await?;
    }
    let (node_pid, router_pid) = (node.child.id(), router.pid());
    let (mut d, mut r) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut d_wall, mut r_wall) = (Duration::ZERO, Duration::ZERO);
    let (mut node_direct, mut node_routed, mut router_cpu) = (Cpu::default(), Cpu::default(), Cpu::default());
    // Per round: the routed block's median minus the direct block's.
    let mut rounds = Vec::new();
    let perf = Perf::start(PERF, "a", "a", router_pid)?;
    for _ in 0..n.div_ceil(BLOCK) {
        let before = Cpu::of(node_pid)?;
        let start = Instant::now();
        for _ in 0..BLOCK {
            d.push(execute_ok(direct, KEY).await?);
        }
        d_wall += start.elapsed();
        before.add_since(node_pid, &mut node_direct)?;

        let (before, router_before) = (Cpu::of(node_pid)?, Cpu::of(router_pid)?);
        let start = Instant::now();
        for _ in 0..BLOCK {
            r.push(execute_ok(&router.client, KEY).await?);
        }
        r_wall += start.elapsed();
        before.add_since(node_pid, &mut node_routed)?;
        router_before.add_since(router_pid, &mut router_cpu)?;
        rounds.push(median_ms(&r[r.len() - BLOCK..]) - median_ms(&d[d.len() - BLOCK..]));
    }
    drop(perf);
    let overhead = median(rounds.clone());
    let (nd, nr) = (d.len(), r.len());
    let (sd, sr) = (stats(d, d_wall), stats(r, r_wall));
    println!(
        "\n(a) one node: sequential signed /execute-shell of `true` in one workspace, {nd} direct and {nr} through \
         the router, blocks of {BLOCK} alternating"
    );
    println!("{:<44} {:>9} {:>9} {:>11}", "case", "p50 ms", "p95 ms", "execs/s");
    for (label, s) in [("direct to the node", &sd), ("through the router", &sr)] {
        println!("{label:<44} {:>9.3} {:>9.3} {:>11.1}", s.p50, s.p95, s.per_sec);
    }
    println!(
        "  router overhead at p50: {:.3} ms (target ≤ 1 ms); at p95: {:.3} ms; ratio routed/direct at p50: {:.3}",
        sr.p50 - sd.p50,
        sr.p95 - sd.p95,
        sr.p50 / sd.p50
    );
    println!(
        "  paired, the median over the {} rounds of (routed block's median − direct block's): {overhead:.3} ms",
        rounds.len()
    );
    println!(
        "\n(b) CPU per execution of (a): utime+stime of /proc/PID/stat in clock ticks, summed over the \
         blocks (its threads' schedstat, to the ns, in brackets)"
    );
    println!(
        "  runner-router per routed execution: {} (target ≤ 0.3 ms; its load polls included)",
        router_cpu.per(nr)
    );
    println!("  runnerd per direct execution: {}", node_direct.per(nd));
    println!("  runnerd per routed execution: {} (with the router's load polls)", node_routed.per(nr));
    Ok(overhead)
}

/// The median of `v` (0 when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 }
}

/// The median of `samples`, in ms.
fn median_ms(samples: &[Duration]) -> f64 {
    median(samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect())
}

/// (c): first calls of new workspaces, direct and through `router`, interleaved.
struct NewWorkspaces {
    direct: Stats,
    routed: Stats,
    /// The median of (routed − direct) over the pairs of calls made one after the other.
    paired: f64,
}

async fn new_workspaces(
    direct: &RunnerClient,
    router: &RunnerClient,
    tag: &str,
) -> anyhow::Result<NewWorkspaces> {
    let (mut d, mut r) = (Vec::new(), Vec::new());
    let (mut d_wall, mut r_wall) = (Duration::ZERO, Duration::ZERO);
    let mut pairs = Vec::new();
    for i in 0..NEW_WORKSPACES {
        let direct_first = i % 2 == 0;
        for routed in [!direct_first, direct_first] {
            let (client, key) = if routed {
                (router, format!("bench/new-{tag}-routed-{i}"))
            } else {
                (direct, format!("bench/new-{tag}-direct-{i}"))
            };
            let took = execute_ok(client, &key).await?;
            let (v, wall) = if routed { (&mut r, &mut r_wall) } else { (&mut d, &mut d_wall) };
            v.push(took);
            *wall += took;
        }
        pairs.push((r[i].as_secs_f64() - d[i].as_secs_f64()) * 1000.0);
    }
    Ok(NewWorkspaces { direct: stats(d, d_wall), routed: stats(r, r_wall), paired: median(pairs) })
}

/// `GET /workspace-transfer/where` of a workspace the node does not hold, from a fresh
/// connection each (the router's are pooled): p50 ms.
async fn where_alone(node: &RunnerClient) -> anyhow::Result<f64> {
    let mut v = Vec::new();
    for i in 0..NEW_WORKSPACES {
        let start = Instant::now();
        let reply = node.get(&format!("/workspace-transfer/where?workspace=bench/nowhere-{i}")).await?;
        if !matches!(reply.status, 200 | 404) {
            bail!("where answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
        }
        v.push(start.elapsed());
    }
    Ok(stats(v, Duration::from_secs(1)).p50)
}

fn print_new_workspaces(one: &NewWorkspaces, three: &NewWorkspaces, asked: f64, overhead: f64) {
    println!(
        "\n(c) the first call of a new workspace ({NEW_WORKSPACES} new keys per case, direct and routed interleaved; \
         direct: always to the first node)"
    );
    println!("{:<44} {:>9} {:>9} {:>14} {:>9}", "case", "p50 ms", "p95 ms", "p50 − direct", "paired");
    for (label, c) in [("one node", one), ("three nodes", three)] {
        println!("{:<44} {:>9.3} {:>9.3}", format!("direct to a node [{label}]"), c.direct.p50, c.direct.p95);
        println!(
            "{:<44} {:>9.3} {:>9.3} {:>14.3} {:>9.3}",
            format!("through the router [{label}]"),
            c.routed.p50,
            c.routed.p95,
            c.routed.p50 - c.direct.p50,
            c.paired
        );
    }
    println!(
        "  paired: the median of (routed − direct) over the {NEW_WORKSPACES} pairs of calls made one after the other"
    );
    println!(
        "  routed − direct is the router asking every node `where` (in parallel, pooled connections) and placing, \
         besides (a)'s forwarding overhead ({overhead:.3} ms paired);"
    );
    println!(
        "  less that overhead (paired): {:.3} ms with one node, {:.3} ms with three (target for placement itself \
         ≤ 1 ms)",
        one.paired - overhead,
        three.paired - overhead
    );
    println!("  one `where` sent directly to a node from a fresh connection: p50 {asked:.3} ms");
}

/// [`placement::order`] alone over three polled fake nodes, [`PLACEMENTS`] calls; and with
/// the copy of the fleet's nodes the router takes before each placement.
fn placement_alone() {
    let fleet = Fleet::default();
    let urls = ["http://10.0.0.2:4311", "http://10.0.0.3:4311", "http://10.0.0.4:4311"];
    fleet.set_members(
        urls.iter()
            .map(|u| Member { url: (*u).to_owned(), pool: Pool::Cpu, name: (*u).to_owned(), ready: true })
            .collect(),
    );
    for (i, u) in urls.iter().enumerate() {
        let load = Load {
            running: i as u64,
            slots: 4,
            admitted: i as u64 * 2,
            queue_capacity: 256,
            disk_available: Some(100 << 30),
            draining: false,
        };
        fleet.polled(u, Ok(load));
    }
    let nodes = fleet.nodes();
    let keys: Vec<String> = (0..1024).map(|i| format!("team/workspace-{i}")).collect();
    let sample = runner_router::config::DEFAULT_SAMPLE;
    let start = Instant::now();
    for i in 0..PLACEMENTS {
        black_box(placement::order(black_box(&keys[i % keys.len()]), black_box(&nodes), sample));
    }
    let alone = start.elapsed().as_nanos() as f64 / PLACEMENTS as f64;
    let start = Instant::now();
    for i in 0..PLACEMENTS {
        let nodes = fleet.nodes();
        black_box(placement::order(black_box(&keys[i % keys.len()]), &nodes, sample));
    }
    let with_copy = start.elapsed().as_nanos() as f64 / PLACEMENTS as f64;
    println!(
        "  placement::order alone, in this process, over 3 polled nodes (best of {sample}), {PLACEMENTS} calls: \
         {alone:.0} ns per call; {with_copy:.0} ns with the copy of the fleet's nodes before it"
    );
}

/// (d): [`CLIENTS`] clients for `duration` in all per case, in [`PARTS`] interleaved parts.
async fn throughput(nodes: &[&Daemon], router: &Router, duration: Duration) -> anyhow::Result<()> {
    let direct = Arc::new(RunnerClient::new(nodes[0].endpoint.clone(), BENCH_TOKEN));
    let keys = |case: &str| (0..CLIENTS).map(|i| format!("bench/tp-{case}-{i}")).collect::<Vec<_>>();
    let (direct_keys, routed_keys) = (keys("direct"), keys("routed"));
    // Every workspace made (and placed) before the clock starts.
    for (client, keys) in [(&direct, &direct_keys), (&router.client, &routed_keys)] {
        for key in keys {
            execute_ok(client, key).await?;
        }
    }
    let placed = placement_of(nodes, &routed_keys).await?;
    let pids: Vec<u32> = nodes.iter().map(|n| n.child.id()).collect();
    let (mut d, mut r) = (Run::default(), Run::default());
    let (mut router_cpu, mut nodes_direct, mut nodes_routed) =
        (Cpu::default(), Cpu::default(), Cpu::default());
    let perf = Perf::start(PERF, "a", "d", router.pid())?;
    let part = duration / PARTS as u32;
    for i in 0..PARTS {
        // Direct first in even parts, routed first in odd ones: drift hits both alike.
        for routed in [i % 2 == 1, i % 2 == 0] {
            let befores = pids.iter().map(|p| Cpu::of(*p)).collect::<anyhow::Result<Vec<_>>>()?;
            if routed {
                let router_before = Cpu::of(router.pid())?;
                r.add(clients(&router.client, &routed_keys, part).await?);
                router_before.add_since(router.pid(), &mut router_cpu)?;
            } else {
                d.add(clients(&direct, &direct_keys, part).await?);
            }
            let into = if routed { &mut nodes_routed } else { &mut nodes_direct };
            for (before, pid) in befores.iter().zip(&pids) {
                before.add_since(*pid, into)?;
            }
        }
    }
    drop(perf);
    let (sd, sr) = (d.stats(), r.stats());
    println!(
        "\n(d) throughput: {CLIENTS} concurrent clients, each its own workspace and agent, {:.0} s per case in {PARTS} \
         interleaved parts",
        duration.as_secs_f64()
    );
    println!("{:<44} {:>9} {:>9} {:>11} {:>9}", "case", "p50 ms", "p95 ms", "execs/s", "failures");
    println!(
        "{:<44} {:>9.2} {:>9.2} {:>11.1} {:>9}",
        "directly to one node",
        sd.p50,
        sd.p95,
        sd.per_sec,
        d.failures.values().sum::<usize>()
    );
    println!(
        "{:<44} {:>9.2} {:>9.2} {:>11.1} {:>9}",
        format!("through the router, {} nodes", nodes.len()),
        sr.p50,
        sr.p95,
        sr.per_sec,
        r.failures.values().sum::<usize>()
    );
    println!(
        "  ratio routed/direct: {:.3} (target ≥ 0.9: the same 2 cores serve every node, the router must not be the \
         bottleneck)",
        sr.per_sec / sd.per_sec
    );
    println!("  the routed workspaces by node: {placed}");
    for (label, run) in [("direct", &d), ("routed", &r)] {
        for (why, count) in &run.failures {
            println!("  {label} failure: {count} × {why}");
        }
    }
    println!(
        "  runner-router CPU per routed execution (utime+stime; schedstat in brackets): {}",
        router_cpu.per(r.samples.len())
    );
    println!(
        "  the nodes' CPU per execution (all {} together): direct {}, routed {}",
        nodes.len(),
        nodes_direct.per(d.samples.len()),
        nodes_routed.per(r.samples.len())
    );
    Ok(())
}

/// Which node holds each of `keys`, by asking every node `where`: `URL: n, …`.
async fn placement_of(nodes: &[&Daemon], keys: &[String]) -> anyhow::Result<String> {
    let mut by_node = BTreeMap::new();
    for node in nodes {
        let client = RunnerClient::new(node.endpoint.clone(), BENCH_TOKEN);
        let mut held = 0;
        for key in keys {
            let reply = client.get(&format!("/workspace-transfer/where?workspace={key}")).await?;
            if reply.status == 200 && reply.json()["exists"] == true {
                held += 1;
            }
        }
        by_node.insert(url(&node.endpoint)?, held);
    }
    Ok(by_node.iter().map(|(u, n)| format!("{u}: {n}")).collect::<Vec<_>>().join(", "))
}

/// Executions of (d): their times, the failures by kind, the wall time.
#[derive(Default)]
struct Run {
    samples: Vec<Duration>,
    failures: BTreeMap<String, usize>,
    wall: Duration,
}

impl Run {
    fn add(&mut self, other: Run) {
        self.samples.extend(other.samples);
        for (why, n) in other.failures {
            *self.failures.entry(why).or_default() += n;
        }
        self.wall += other.wall;
    }

    fn stats(&self) -> Stats {
        stats(self.samples.clone(), self.wall)
    }
}

/// One client per key, each as its own agent, starting executions until `duration` is up;
/// the wall time runs until the last has answered.
async fn clients(client: &Arc<RunnerClient>, keys: &[String], duration: Duration) -> anyhow::Result<Run> {
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let (client, key) = (client.clone(), key.clone());
            tokio::spawn(async move {
                let mut run = Run::default();
                let agent = format!("bench-{i}");
                while Instant::now() < deadline {
                    match execute(&client, &key, &agent).await {
                        Outcome::Ok(d) => run.samples.push(d),
                        Outcome::Failed(why) => *run.failures.entry(why).or_default() += 1,
                    }
                }
                run
            })
        })
        .collect();
    let mut all = Run::default();
    for t in tasks {
        all.add(t.await?);
    }
    all.wall = start.elapsed();
    Ok(all)
}
