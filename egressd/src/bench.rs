//! `egressd-bench` (issue #5): egressd's data path measured against a direct connection and
//! against tinyproxy, in one run, figures and ratios, never pass/fail.
//!
//! Everything runs on this host: an HTTP upstream on 127.0.0.1 and a DNS responder
//! (`bench.test` → 127.0.0.1) served by this process's threads, the real `egressd` binary
//! next to this one (confined as deployed, one gateway for `bench.test` with private network
//! access), and tinyproxy when installed. Cases:
//! * (a) TCP straight to the upstream;
//! * (b) egressd's gateway Unix socket, `CONNECT bench.test:<port>`;
//! * (c) tinyproxy over TCP, `CONNECT localhost:<port>`.
//!
//! The client is the same code for all three (one thread, 128 KiB reads); only how its byte
//! stream is obtained differs. Runs interleave a, b, c so that drift hits them alike.
//! Measured: bulk download throughput (median of `--repeat`), per-connection latency of
//! sequential small requests (p50/p90/p99), and egressd's resident memory idle and with
//! `--tunnels` open tunnels. The last line, `BENCH_JSON {…}`, carries every figure.

mod client;
mod fixtures;
mod procs;
mod stats;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

use client::{Conn, Route};
use procs::{Egressd, Scratch, Tinyproxy};
use stats::{Latency, mb_per_s, median};

/// The name the gateway allows and the bench's DNS answers.
pub const BENCH_NAME: &str = "bench.test";

/// Targets printed next to the figures (never enforced).
const TARGET_THROUGHPUT_RATIO: f64 = 0.9;
const TARGET_ADDED_P50_MS: f64 = 0.3;

const USAGE: &str = "\
egressd-bench: egressd's data path against direct TCP and tinyproxy; figures in one run,
never pass/fail (build with --release; egressd must sit next to this binary).

Usage:
  egressd-bench [--bulk-mib N] [--repeat N] [--small N] [--tunnels N] [--tinyproxy PATH]

  --bulk-mib N     bulk download size per run, MiB             (default 1024)
  --repeat N       bulk runs per case; the median is reported  (default 3)
  --small N        sequential small round trips per case       (default 1000)
  --tunnels N      open tunnels for the memory figure          (default 100)
  --tinyproxy PATH tinyproxy binary (default: PATH, /usr/sbin); without one, (c) is skipped
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub bulk_mib: u64,
    pub repeat: usize,
    pub small: usize,
    pub tunnels: usize,
    pub tinyproxy: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Options {
        Options { bulk_mib: 1024, repeat: 3, small: 1000, tunnels: 100, tinyproxy: None }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    Run(Options),
    Help,
}

/// Parses the arguments (without the program name).
pub fn parse_args(args: &[String]) -> Result<Parsed, String> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_owned())),
            _ => (arg.as_str(), None),
        };
        let mut value =
            || inline.clone().or_else(|| it.next().cloned()).ok_or(format!("{flag} needs a value"));
        let mut number = |min: u64| -> Result<u64, String> {
            let v = value()?;
            v.parse::<u64>()
                .ok()
                .filter(|n| *n >= min)
                .ok_or(format!("{flag} needs a number ≥ {min}, not {v:?}"))
        };
        match flag {
            "--help" | "-h" => return Ok(Parsed::Help),
            "--bulk-mib" => o.bulk_mib = number(1)?,
            "--repeat" => o.repeat = number(1)? as usize,
            "--small" => o.small = number(1)? as usize,
            "--tunnels" => o.tunnels = number(1)? as usize,
            "--tinyproxy" => o.tinyproxy = Some(value()?.into()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Parsed::Run(o))
}

/// Entry point of the `egressd-bench` binary; returns the exit status.
pub fn run() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match parse_args(&args) {
        Ok(Parsed::Run(o)) => o,
        Ok(Parsed::Help) => {
            print!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("egressd-bench: {e}\n\n{USAGE}");
            return 2;
        }
    };
    match bench(&options) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("egressd-bench: {e:#}");
            1
        }
    }
}

/// One case: its letter, what it is, how it connects.
struct Case {
    key: &'static str,
    name: &'static str,
    route: Route,
}

fn machine() -> serde_json::Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned()))
        .unwrap_or_default();
    json!({
        "nproc": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "cpu": cpu,
        "egressd_version": crate::version(),
    })
}

/// A process's user + system CPU time so far, from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Option<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = parse_stat_cpu_ticks(&text)?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().filter(|h| *h > 0)?;
    Some(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// utime + stime (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock ticks.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn bench(o: &Options) -> anyhow::Result<()> {
    let machine = machine();
    println!(
        "egressd-bench: {} CPUs ({}), Linux {}, egressd {}",
        machine["nproc"],
        machine["cpu"].as_str().unwrap_or(""),
        machine["kernel"].as_str().unwrap_or(""),
        machine["egressd_version"].as_str().unwrap_or(""),
    );

    let scratch = Scratch::new()?;
    let upstream = fixtures::Upstream::start()?;
    let dns = fixtures::start_dns(BENCH_NAME, Ipv4Addr::LOCALHOST)?;
    let egressd = Egressd::start(&scratch.0, dns, 1000)?;
    let tinyproxy_bin = o.tinyproxy.clone().or_else(procs::find_tinyproxy);
    let tinyproxy = match &tinyproxy_bin {
        Some(bin) => Some(Tinyproxy::start(bin, &scratch.0, upstream.port)?),
        None => {
            println!();
            println!("!!! tinyproxy is not installed: case (c) and the ratios against it are SKIPPED.");
            println!(
                "!!! Install it (apt-get install tinyproxy) or pass --tinyproxy PATH for the full comparison."
            );
            None
        }
    };
    let tinyproxy_version = tinyproxy_bin.as_deref().map(procs::tinyproxy_version).unwrap_or_default();
    if let (Some(t), Some(bin)) = (&tinyproxy, &tinyproxy_bin) {
        println!("tinyproxy: {} ({tinyproxy_version}), pid {}", bin.display(), t.daemon.pid());
    }
    println!(
        "upstream 127.0.0.1:{} (this process); egressd pid {}, gateway {}",
        upstream.port,
        egressd.daemon.pid(),
        egressd.gateway.display()
    );
    println!("client: one thread, 128 KiB reads, identical for every case; cases interleaved a, b, c");

    let mut cases = vec![
        Case { key: "a", name: "(a) direct TCP", route: Route::Direct { upstream_port: upstream.port } },
        Case {
            key: "b",
            name: "(b) egressd gateway",
            route: Route::Gateway { socket: egressd.gateway.clone(), upstream_port: upstream.port },
        },
    ];
    if let Some(t) = &tinyproxy {
        cases.push(Case {
            key: "c",
            name: "(c) tinyproxy",
            route: Route::Tinyproxy { proxy_port: t.port, upstream_port: upstream.port },
        });
    }
    for case in &cases {
        Conn::open(&case.route)
            .and_then(|mut c| c.get("/small"))
            .with_context(|| format!("{}: a first request failed", case.name))
            .map_err(|e| with_logs(e, &egressd, tinyproxy.as_ref()))?;
    }

    // 3 first, so the memory figures are not blurred by what bulk transfers leave behind.
    let memory = memory_phase(o, &cases, &egressd, tinyproxy.as_ref())?;
    let bulk = bulk_phase(o, &cases, &egressd, tinyproxy.as_ref())?;
    let small = small_phase(o, &cases)?;
    let dns_rtt = dns_round_trips(dns, 200)?;
    let end = procs::memory(egressd.daemon.pid())?;

    let report = Report { o, cases: &cases, bulk, small, dns_rtt, memory, end };
    report.print();
    let v4 = upstream.accepted[0].load(Ordering::Relaxed);
    let v6 = upstream.accepted[1].load(Ordering::Relaxed);
    println!("upstream connections accepted: {v4} over IPv4, {v6} over IPv6");
    let mut all = report.json();
    all["machine"] = machine;
    all["tinyproxy_version"] = json!(tinyproxy_version);
    all["upstream_accepted"] = json!({"ipv4": v4, "ipv6": v6});
    println!("BENCH_JSON {all}");
    Ok(())
}

fn with_logs(e: anyhow::Error, egressd: &Egressd, tinyproxy: Option<&Tinyproxy>) -> anyhow::Error {
    let mut text = format!("\n--- egressd log (end):\n{}", egressd.daemon.log_tail());
    if let Some(t) = tinyproxy {
        text.push_str(&format!("\n--- tinyproxy log (end):\n{}", t.daemon.log_tail()));
    }
    e.context(text)
}

struct MemoryFigures {
    /// egressd right after start, with its gateway, with `tunnels` open tunnels.
    started_kib: u64,
    gateway_kib: u64,
    tunnels_kib: u64,
    /// tinyproxy idle and with the same tunnels, when it runs.
    tinyproxy: Option<(u64, u64)>,
}

fn open_tunnels(route: &Route, n: usize) -> anyhow::Result<Vec<Conn>> {
    (0..n).map(|i| Conn::open(route).with_context(|| format!("opening tunnel {}", i + 1))).collect()
}

fn memory_phase(
    o: &Options,
    cases: &[Case],
    egressd: &Egressd,
    tinyproxy: Option<&Tinyproxy>,
) -> anyhow::Result<MemoryFigures> {
    let settle = || std::thread::sleep(Duration::from_millis(300));
    settle();
    let pid = egressd.daemon.pid();
    let gateway_kib = procs::memory(pid)?.rss_kib;
    let tunnels = open_tunnels(&cases[1].route, o.tunnels).map_err(|e| with_logs(e, egressd, tinyproxy))?;
    settle();
    let tunnels_kib = procs::memory(pid)?.rss_kib;
    drop(tunnels);
    // tinyproxy serves at most MaxClients (200) connections, each tunnel holding one.
    let tinyproxy = match (tinyproxy, cases.get(2)) {
        (Some(t), Some(case)) if o.tunnels <= 190 => {
            settle();
            let idle = procs::memory(t.daemon.pid())?.rss_kib;
            let open = open_tunnels(&case.route, o.tunnels).map_err(|e| with_logs(e, egressd, Some(t)))?;
            settle();
            let with = procs::memory(t.daemon.pid())?.rss_kib;
            drop(open);
            Some((idle, with))
        }
        _ => None,
    };
    settle();
    Ok(MemoryFigures { started_kib: egressd.rss_started_kib, gateway_kib, tunnels_kib, tinyproxy })
}

struct BulkFigures {
    /// Per case: MB/s of each run.
    runs: Vec<Vec<f64>>,
    /// Per case: the proxy's CPU time per GB moved (b and c), median over runs.
    proxy_cpu_s_per_gb: Vec<Option<f64>>,
    /// Per case: this process's (client + upstream) CPU time per GB, median over runs.
    bench_cpu_s_per_gb: Vec<Option<f64>>,
}

fn bulk_once(route: &Route, bytes: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let got = Conn::open(route)?.get(&format!("/bulk?n={bytes}"))?;
    let took = started.elapsed();
    anyhow::ensure!(got == bytes, "received {got} of {bytes} bytes");
    Ok(took)
}

fn bulk_phase(
    o: &Options,
    cases: &[Case],
    egressd: &Egressd,
    tinyproxy: Option<&Tinyproxy>,
) -> anyhow::Result<BulkFigures> {
    let bytes = o.bulk_mib * 1024 * 1024;
    let proxy_pid = |key: &str| match key {
        "b" => Some(egressd.daemon.pid()),
        "c" => tinyproxy.map(|t| t.daemon.pid()),
        _ => None,
    };
    for case in cases {
        bulk_once(&case.route, bytes.min(64 << 20)).with_context(|| format!("{}: warm-up", case.name))?;
    }
    let mut runs = vec![Vec::new(); cases.len()];
    let mut proxy_cpu = vec![Vec::new(); cases.len()];
    let mut bench_cpu = vec![Vec::new(); cases.len()];
    let gb = bytes as f64 / 1e9;
    let me = std::process::id();
    for _ in 0..o.repeat {
        for (i, case) in cases.iter().enumerate() {
            let pid = proxy_pid(case.key);
            let before = (pid.and_then(cpu_time), cpu_time(me));
            let took = bulk_once(&case.route, bytes)
                .with_context(|| format!("{}: bulk download", case.name))
                .map_err(|e| with_logs(e, egressd, tinyproxy))?;
            let after = (pid.and_then(cpu_time), cpu_time(me));
            runs[i].push(mb_per_s(bytes, took));
            if let (Some(b), Some(a)) = (before.0, after.0) {
                proxy_cpu[i].push((a - b).as_secs_f64() / gb);
            }
            if let (Some(b), Some(a)) = (before.1, after.1) {
                bench_cpu[i].push((a - b).as_secs_f64() / gb);
            }
        }
    }
    Ok(BulkFigures {
        runs,
        proxy_cpu_s_per_gb: proxy_cpu.iter().map(|v| median(v)).collect(),
        bench_cpu_s_per_gb: bench_cpu.iter().map(|v| median(v)).collect(),
    })
}

fn small_phase(o: &Options, cases: &[Case]) -> anyhow::Result<Vec<Latency>> {
    let once = |route: &Route| -> anyhow::Result<Duration> {
        let started = Instant::now();
        let got = Conn::open(route)?.get("/small")?;
        let took = started.elapsed();
        anyhow::ensure!(got == fixtures::SMALL_BODY.len() as u64, "a short /small body");
        Ok(took)
    };
    for _ in 0..20 {
        for case in cases {
            once(&case.route).with_context(|| format!("{}: warm-up", case.name))?;
        }
    }
    let mut samples = vec![Vec::with_capacity(o.small); cases.len()];
    for _ in 0..o.small {
        for (i, case) in cases.iter().enumerate() {
            samples[i].push(once(&case.route).with_context(|| format!("{}: small request", case.name))?);
        }
    }
    samples.into_iter().map(|s| Latency::of(s).context("no samples")).collect()
}

/// Round trips of the `A` query egressd sends on every CONNECT (it sends `AAAA` alongside),
/// from this thread to the bench's responder: how much of (b)'s added latency is its lookup.
fn dns_round_trips(dns: std::net::SocketAddr, n: u16) -> anyhow::Result<Latency> {
    let socket = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
    socket.connect(dns)?;
    socket.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut answer = [0u8; 1500];
    let mut samples = Vec::with_capacity(n.into());
    for id in 0..n {
        let query = crate::dns::wire::encode_query(id, BENCH_NAME, crate::dns::wire::RecordType::A)?;
        let started = Instant::now();
        socket.send(&query)?;
        socket.recv(&mut answer).context("the bench's DNS responder did not answer")?;
        samples.push(started.elapsed());
    }
    Latency::of(samples).context("no DNS samples")
}

struct Report<'a> {
    o: &'a Options,
    cases: &'a [Case],
    bulk: BulkFigures,
    small: Vec<Latency>,
    dns_rtt: Latency,
    memory: MemoryFigures,
    end: procs::Memory,
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

impl Report<'_> {
    fn index(&self, key: &str) -> Option<usize> {
        self.cases.iter().position(|c| c.key == key)
    }

    fn bulk_median(&self, key: &str) -> Option<f64> {
        self.index(key).and_then(|i| median(&self.bulk.runs[i]))
    }

    fn p50(&self, key: &str) -> Option<f64> {
        self.index(key).map(|i| self.small[i].p50)
    }

    fn ratio(&self, x: &str, y: &str) -> Option<f64> {
        Some(self.bulk_median(x)? / self.bulk_median(y)?)
    }

    fn added_p50(&self, x: &str) -> Option<f64> {
        Some(self.p50(x)? - self.p50("a")?)
    }

    fn per_tunnel_kib(&self) -> f64 {
        (self.memory.tunnels_kib as f64 - self.memory.gateway_kib as f64) / self.o.tunnels as f64
    }

    /// The report's three tables, each with its targets.
    fn print(&self) {
        self.print_bulk();
        self.print_small();
        self.print_memory();
    }

    fn print_bulk(&self) {
        let o = self.o;
        println!();
        println!("1. bulk download through a tunnel: {} MiB per run, median of {}", o.bulk_mib, o.repeat);
        let runs: String = (1..=o.repeat).map(|r| format!("{:>9}", format!("run{r}"))).collect();
        println!(
            "{:<22}{runs} {:>11} {:>14} {:>14}",
            "case", "median MB/s", "proxy CPU s/GB", "bench CPU s/GB"
        );
        for (i, case) in self.cases.iter().enumerate() {
            let runs: String = self.bulk.runs[i].iter().map(|v| format!("{v:>9.0}")).collect();
            let cpu = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.3}"));
            println!(
                "{:<22}{runs} {:>11.0} {:>14} {:>14}",
                case.name,
                median(&self.bulk.runs[i]).unwrap_or(0.0),
                cpu(self.bulk.proxy_cpu_s_per_gb[i]),
                cpu(self.bulk.bench_cpu_s_per_gb[i]),
            );
        }
        if let Some(r) = self.ratio("b", "a") {
            println!(
                "ratio b/a: {r:.3}   (target ≥ {TARGET_THROUGHPUT_RATIO:.2}: {})",
                verdict(r >= TARGET_THROUGHPUT_RATIO)
            );
        }
        if let Some(r) = self.ratio("c", "a") {
            println!("ratio c/a: {r:.3}");
        }
        if let Some(r) = self.ratio("b", "c") {
            println!("ratio b/c: {r:.3}   (target > 1, egressd ahead of tinyproxy: {})", verdict(r > 1.0));
        }
    }

    fn print_small(&self) {
        let o = self.o;
        println!();
        println!(
            "2. small round trips: {} sequential per case, each a new connection (+ CONNECT) + GET /small",
            o.small
        );
        println!("{:<22}{:>9}{:>9}{:>9}{:>9}", "case", "p50 ms", "p90 ms", "p99 ms", "mean ms");
        for (case, l) in self.cases.iter().zip(&self.small) {
            println!("{:<22}{:>9.3}{:>9.3}{:>9.3}{:>9.3}", case.name, l.p50, l.p90, l.p99, l.mean);
        }
        if let Some(d) = self.added_p50("b") {
            println!(
                "added p50 b over a: {d:.3} ms   (target ≤ {TARGET_ADDED_P50_MS:.1} ms: {})",
                verdict(d <= TARGET_ADDED_P50_MS)
            );
        }
        if let Some(d) = self.added_p50("c") {
            println!("added p50 c over a: {d:.3} ms");
        }
        if let (Some(b), Some(c)) = (self.p50("b"), self.p50("c")) {
            println!("p50 b/c: {:.3}   (target < 1, egressd ahead of tinyproxy: {})", b / c, verdict(b < c));
        }
        println!(
            "context: one DNS round trip to the bench's responder (egressd asks A and AAAA in parallel, \
             then keeps the answer for its TTL, 60 s here; tinyproxy reads /etc/hosts): p50 {:.3} ms",
            self.dns_rtt.p50
        );
    }

    fn print_memory(&self) {
        let o = self.o;
        println!();
        println!("3. egressd resident memory (VmRSS)");
        let m = &self.memory;
        println!("after start:                       {:>8.1} MiB", mib(m.started_kib));
        println!("idle, gateway created:             {:>8.1} MiB", mib(m.gateway_kib));
        println!("with {:>4} open tunnels:            {:>8.1} MiB", o.tunnels, mib(m.tunnels_kib));
        println!("increase per tunnel:               {:>8.1} KiB", self.per_tunnel_kib());
        println!(
            "after all runs:                    {:>8.1} MiB (peak VmHWM {:.1} MiB)",
            mib(self.end.rss_kib),
            mib(self.end.hwm_kib)
        );
        if let Some((idle, with)) = m.tinyproxy {
            println!(
                "tinyproxy, for comparison: idle {:.1} MiB, with {} tunnels {:.1} MiB, {:.1} KiB per tunnel",
                mib(idle),
                o.tunnels,
                mib(with),
                (with as f64 - idle as f64) / o.tunnels as f64
            );
        }
    }

    fn json(&self) -> serde_json::Value {
        let o = self.o;
        let mut bulk = json!({"mib": o.bulk_mib, "repeat": o.repeat});
        let mut small = json!({"count": o.small});
        for (i, case) in self.cases.iter().enumerate() {
            bulk[case.key] = json!({
                "runs_mb_s": self.bulk.runs[i],
                "median_mb_s": median(&self.bulk.runs[i]),
                "proxy_cpu_s_per_gb": self.bulk.proxy_cpu_s_per_gb[i],
                "bench_cpu_s_per_gb": self.bulk.bench_cpu_s_per_gb[i],
            });
            let l = &self.small[i];
            small[case.key] = json!({"p50_ms": l.p50, "p90_ms": l.p90, "p99_ms": l.p99, "mean_ms": l.mean});
        }
        bulk["ratio_b_a"] = json!(self.ratio("b", "a"));
        bulk["ratio_c_a"] = json!(self.ratio("c", "a"));
        bulk["ratio_b_c"] = json!(self.ratio("b", "c"));
        small["added_p50_b_ms"] = json!(self.added_p50("b"));
        small["added_p50_c_ms"] = json!(self.added_p50("c"));
        small["dns_round_trip_p50_ms"] = json!(self.dns_rtt.p50);
        let m = &self.memory;
        let targets = json!({
            "throughput_b_a_min": TARGET_THROUGHPUT_RATIO,
            "throughput_b_a_met": self.ratio("b", "a").map(|r| r >= TARGET_THROUGHPUT_RATIO),
            "added_p50_ms_max": TARGET_ADDED_P50_MS,
            "added_p50_met": self.added_p50("b").map(|d| d <= TARGET_ADDED_P50_MS),
            "b_ahead_of_c_throughput": self.ratio("b", "c").map(|r| r > 1.0),
            "b_ahead_of_c_p50": self.p50("b").zip(self.p50("c")).map(|(b, c)| b < c),
        });
        json!({
            "bulk": bulk,
            "small": small,
            "memory": {
                "tunnels": o.tunnels,
                "egressd_started_kib": m.started_kib,
                "egressd_idle_kib": m.gateway_kib,
                "egressd_tunnels_kib": m.tunnels_kib,
                "egressd_per_tunnel_kib": self.per_tunnel_kib(),
                "egressd_end_kib": self.end.rss_kib,
                "egressd_peak_kib": self.end.hwm_kib,
                "tinyproxy_idle_kib": m.tinyproxy.map(|t| t.0),
                "tinyproxy_tunnels_kib": m.tinyproxy.map(|t| t.1),
            },
            "targets": targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed, String> {
        parse_args(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn arguments() {
        assert_eq!(parse(&[]).unwrap(), Parsed::Run(Options::default()));
        let want =
            Options { bulk_mib: 256, repeat: 5, small: 10, tunnels: 7, tinyproxy: Some("/x/tp".into()) };
        let got = parse(&[
            "--bulk-mib",
            "256",
            "--repeat=5",
            "--small",
            "10",
            "--tunnels",
            "7",
            "--tinyproxy",
            "/x/tp",
        ]);
        assert_eq!(got.unwrap(), Parsed::Run(want));
        assert_eq!(parse(&["--help"]).unwrap(), Parsed::Help);
        for (args, needle) in [
            (&["--bulk-mib", "0"][..], "--bulk-mib needs a number ≥ 1"),
            (&["--repeat"], "--repeat needs a value"),
            (&["--small", "x"], "not \"x\""),
            (&["--fast"], "unknown argument \"--fast\""),
        ] {
            let err = parse(args).unwrap_err();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn cpu_ticks_from_proc_stat() {
        // comm may hold spaces and parentheses; fields count from after the last ')'.
        let stat = "4242 (egress d) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(325));
        assert_eq!(parse_stat_cpu_ticks("4242 (x) S 1"), None);
    }
}
