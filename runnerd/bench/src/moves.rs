//! `runnerd-bench move` (issue #34's targets): a workspace moved between two runnerd on
//! loopback, against `tar | tar` between the same directories in the same run.
//!
//! * A remote workspace of 10,000 files and 200 MiB (incompressible, distinct content, so
//!   nothing dedups; many small files, some medium, a few large, in nested directories) is
//!   written into A's data directory and committed by one `true` (timed on its own).
//! * The baseline: `tar -C <A's workspace> -cf - . | tar -C <empty dir> -xf -`, on the same
//!   filesystem, once before the move and once after it; the faster counts. Both tars read
//!   from a warm page cache, as the push does (the files were just written and committed).
//! * The move: `POST /workspace-transfer/push` A→B, end to end; its rate and the ratio
//!   against tar's (same bytes: the workspace's files), the objects and bytes the answer
//!   says were sent, the phases seen by polling A's `where` (prepare, stream, the target's
//!   commit), both runnerd's CPU; then B's epoch and whether an execution on B sees the tree
//!   A's last execution left.
//! * One small file changed on B, pushed back B→A: the bytes sent against the total.
//! * A move of a workspace the target already holds in full (A→B again): its time.
//!
//! `RUNNERD_BENCH_MOVE_PERF="record -g -o FILE"` (any perf arguments; `-p <target's pid>`
//! is added) runs perf on the target runnerd during the push `RUNNERD_BENCH_MOVE_PERF_CASE`
//! names (`b`, `c` or `d`; `b` unless set). That push's timing then includes perf's cost.
//! * With `RUNNERD_BENCH_REPLICA_ENDPOINT` and `_BUCKET` (scripts/bench starts a local
//!   SeaweedFS and sets them when `weed` is installed): a third runnerd replicating to that
//!   store; five 1 MiB commits, each's lag from its answer until `/health` shows it sent.
//!
//! Figures only, never pass/fail.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use runnerctl::client::{Endpoint, RunnerClient, new_execution_id, permission_epoch};
use serde_json::{Value, json};

use crate::perf::Perf;
use crate::{BENCH_TOKEN, Scratch, http_once, own_cpu_ms, start_runnerd_with};

const KEY: &str = "bench/move";
/// perf's arguments, and (`…_CASE`) the push it records.
const PERF: &str = "RUNNERD_BENCH_MOVE_PERF";
const FILES: usize = 10_000;
const TOTAL: u64 = 200 << 20;
/// Files of 256 B..8 KiB (sources, configs), of 8..64 KiB, and the large ones that take
/// the rest of [`TOTAL`] (about 2.4 MiB each: data, archives, models).
const SMALL: usize = 7_960;
const MEDIUM: usize = 2_000;
const LARGE: usize = FILES - SMALL - MEDIUM;
const MIB: f64 = 1024.0 * 1024.0;

/// One file of the tree: where, how long, its content's seed.
struct Planned {
    rel: PathBuf,
    len: usize,
}

/// splitmix64: the sizes and names, the same in every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// The tree: [`FILES`] files, [`TOTAL`] bytes exactly, over `src/pNN/mM/` (200 leaf
/// directories, a tenth of the small files one level up), `data/` for the large files and
/// a chain `deep/a/b/c/d/e` with a few.
fn plan() -> Vec<Planned> {
    let mut rng = Rng(34);
    let mut out = Vec::with_capacity(FILES);
    let ext = ["rs", "py", "json", "md", "txt", "toml", "csv", "html"];
    for i in 0..SMALL + MEDIUM {
        let len = if i < SMALL { rng.between(256, 8 << 10) } else { rng.between(8 << 10, 64 << 10) };
        let (p, m) = (i % 20, (i / 20) % 10);
        let name = format!("f{i:05}.{}", ext[i % ext.len()]);
        let rel = match i % 50 {
            0 => PathBuf::from(format!("deep/a/b/c/d/e/{name}")),
            n if n % 10 == 1 && i < SMALL => PathBuf::from(format!("src/p{p:02}/{name}")),
            _ => PathBuf::from(format!("src/p{p:02}/m{m}/{name}")),
        };
        out.push(Planned { rel, len: len as usize });
    }
    let rest = TOTAL - out.iter().map(|p| p.len as u64).sum::<u64>();
    let weights: Vec<u64> = (0..LARGE).map(|_| rng.between(500, 1500)).collect();
    let sum: u64 = weights.iter().sum();
    let mut given = 0;
    for (i, w) in weights.iter().enumerate() {
        let len = if i + 1 == LARGE { rest - given } else { rest * w / sum };
        given += len;
        out.push(Planned { rel: PathBuf::from(format!("data/large{i:02}.bin")), len: len as usize });
    }
    out
}

/// Writes the planned tree under `root`, owned like `root` when this runs as root (the
/// sandbox user's, as a run would have left it); its directory count.
fn write_tree(root: &Path, files: &[Planned]) -> anyhow::Result<usize> {
    let owner = root.metadata()?;
    let owned = |p: &Path| -> anyhow::Result<()> {
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::lchown(p, Some(owner.uid()), Some(owner.gid()))?;
        }
        Ok(())
    };
    let mut dirs = std::collections::BTreeSet::new();
    let mut buf = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let path = root.join(&f.rel);
        let mut dir = path.parent().context("a file has a parent")?.to_path_buf();
        while dir != root && dirs.insert(dir.clone()) {
            std::fs::create_dir_all(&dir)?;
            owned(&dir)?;
            dir = dir.parent().context("under root")?.to_path_buf();
        }
        buf.resize(f.len, 0);
        crate::versions::fill(i as u64 + 0x34_0000, &mut buf);
        std::fs::write(&path, &buf)?;
        owned(&path)?;
    }
    Ok(dirs.len())
}

/// One signed `POST /execute-shell` of `code` in [`KEY`]: the answer (exit code 0 required).
async fn shell(client: &RunnerClient, code: &str) -> anyhow::Result<Value> {
    let body = json!({
        "agentId": "bench",
        "code": code,
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch(KEY),
        "runnerWorkspaceKey": KEY,
    });
    let reply = client.post_signed("/execute-shell", &body).await?;
    if reply.status != 200 || reply.json()["exitCode"] != 0 {
        bail!("runnerd answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(reply.json())
}

async fn where_is(client: &RunnerClient) -> anyhow::Result<Value> {
    let reply = client.get(&format!("/workspace-transfer/where?workspace={KEY}")).await?;
    if reply.status != 200 {
        bail!("where answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(reply.json())
}

fn url(endpoint: &Endpoint) -> anyhow::Result<String> {
    match endpoint {
        Endpoint::Tcp(addr) => Ok(format!("http://{addr}")),
        Endpoint::Unix(p) => bail!("runnerd listens on {}, not TCP", p.display()),
    }
}

/// What a push answered, and what was seen of it.
struct Pushed {
    took: Duration,
    answer: Value,
    /// Since the request: the first `where` showing the move in flight (its closure listed
    /// under the lease), and the first showing every byte handed to the socket.
    listed: Option<Duration>,
    streamed: Option<Duration>,
    /// CPU ms (utime+stime) of the source and the target over the push.
    cpu: (f64, f64),
}

/// `POST /workspace-transfer/push` on `from` to `to`, `from`'s `where` polled every 20 ms.
async fn push(from: &crate::Daemon, to: &crate::Daemon) -> anyhow::Result<Pushed> {
    let client = Arc::new(RunnerClient::new(from.endpoint.clone(), BENCH_TOKEN));
    let body = json!({"workspace": KEY, "to": url(&to.endpoint)?});
    let (from_pid, to_pid) = (from.child.id(), to.child.id());
    let cpu_before = (own_cpu_ms(from_pid)?, own_cpu_ms(to_pid)?);
    let done = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let poller = {
        let (client, done) = (client.clone(), done.clone());
        tokio::spawn(async move {
            let (mut listed, mut streamed) = (None, None);
            while !done.load(Ordering::Relaxed) {
                if let Ok(w) = where_is(&client).await {
                    let t = &w["transfer"];
                    if t.is_object() {
                        listed.get_or_insert(start.elapsed());
                        if streamed.is_none() && t["bytesSent"] == t["bytesTotal"] {
                            streamed = Some(start.elapsed());
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (listed, streamed)
        })
    };
    let reply = client.post_signed("/workspace-transfer/push", &body).await?;
    let took = start.elapsed();
    done.store(true, Ordering::Relaxed);
    let (listed, streamed) = poller.await?;
    let cpu = (own_cpu_ms(from_pid)? - cpu_before.0, own_cpu_ms(to_pid)? - cpu_before.1);
    if reply.status != 200 {
        bail!("push answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
    }
    Ok(Pushed { took, answer: reply.json(), listed, streamed, cpu })
}

/// CPU ms (user + system) of this process's waited-for children so far.
fn children_cpu_ms() -> f64 {
    // SAFETY: rusage is plain integers, for which all zeros is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct it is given, nothing else.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

/// `tar | tar` from `src` into a fresh `dst` (removed first, untimed): wall time and the
/// tars' CPU ms. `sync_after`: a `sync` inside the timed span (the durable copy).
fn tar_pipe(src: &Path, dst: &Path, sync_after: bool) -> anyhow::Result<(Duration, f64)> {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst)?;
    let sync = if sync_after { " && sync" } else { "" };
    let script = format!("set -o pipefail; tar -C \"$1\" -cf - . | tar -C \"$2\" -xf -{sync}");
    let cpu = children_cpu_ms();
    let start = Instant::now();
    let status = Command::new("bash").arg("-c").arg(&script).arg("tar").arg(src).arg(dst).status()?;
    let took = start.elapsed();
    if !status.success() {
        bail!("tar | tar failed: {status}");
    }
    Ok((took, children_cpu_ms() - cpu))
}

/// One push's line: what was sent, its phases, both sides' CPU.
fn describe(label: &str, p: &Pushed) {
    let (so, to) = sent(&p.answer, "objects");
    let (sb, tb) = sent(&p.answer, "bytes");
    println!(
        "    {label} sent {so} of {to} objects, {sb} of {tb} bytes ({:.1} MiB), epoch {}; listed {} ms, streamed {} ms, \
         end {:.0} ms; CPU source {:.0} ms, target {:.0} ms",
        sb as f64 / MIB,
        p.answer["epoch"],
        ms(p.listed),
        ms(p.streamed),
        secs(p.took) * 1000.0,
        p.cpu.0,
        p.cpu.1
    );
}

fn sent(answer: &Value, what: &str) -> (u64, u64) {
    let n = |k: &str| answer[what][k].as_u64().unwrap_or(0);
    (n("sent"), n("total"))
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "?".to_owned(), |d| format!("{:.0}", d.as_secs_f64() * 1000.0))
}

pub async fn bench(init: &Path) -> anyhow::Result<()> {
    // Both with the same token (BENCH_TOKEN): a push authenticates to the target with its own.
    // The fenced copy stays an hour: the second tar reads it after the move.
    let env = [("SCIENCE_AGENT_MOVED_WORKSPACE_GRACE_SECS", "3600")];
    let a = start_runnerd_with(init, "move-a", &env)?;
    let b = start_runnerd_with(init, "move-b", &env)?;
    let (ca, cb) = (
        RunnerClient::new(a.endpoint.clone(), BENCH_TOKEN),
        RunnerClient::new(b.endpoint.clone(), BENCH_TOKEN),
    );
    // The first run creates the workspace (empty); the files then appear in it directly.
    http_once(&ca, KEY).await?;
    let ws = a.data_dir().join("remote-workspaces").join(KEY);
    let files = plan();
    let start = Instant::now();
    let dirs = write_tree(&ws, &files)?;
    Command::new("sync").status()?;
    let written = start.elapsed();
    // Snapshots trust their cache only for files changed more than 2 s before.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let start = Instant::now();
    let committed = shell(&ca, "true").await?;
    let commit = start.elapsed();
    let tree_a = committed["workspaceSnapshot"].clone();
    let bytes = files.iter().map(|f| f.len as u64).sum::<u64>();
    let size_of = |r: std::ops::Range<usize>| files[r].iter().map(|f| f.len as f64).sum::<f64>() / MIB;
    println!(
        "runnerd-bench move: remote workspace {KEY}, {} files, {:.1} MiB, {dirs} directories (deepest 6 levels), two runnerd on loopback",
        files.len(),
        bytes as f64 / MIB
    );
    println!(
        "  {SMALL} files of 256 B..8 KiB ({:.1} MiB), {MEDIUM} of 8..64 KiB ({:.1} MiB), {LARGE} large ({:.1} MiB, {:.1}..{:.1} MiB each); random content",
        size_of(0..SMALL),
        size_of(SMALL..SMALL + MEDIUM),
        size_of(SMALL + MEDIUM..FILES),
        files[SMALL + MEDIUM..].iter().map(|f| f.len).min().unwrap_or(0) as f64 / MIB,
        files[SMALL + MEDIUM..].iter().map(|f| f.len).max().unwrap_or(0) as f64 / MIB,
    );
    println!(
        "  written and synced in {:.2} s; first commit on A (`true` after the files appeared, not part of the move): {:.2} s",
        secs(written),
        secs(commit)
    );

    let tar_scratch =
        Scratch(std::env::temp_dir().join(format!("runnerd-bench-move-tar-{}", std::process::id())));
    let tar_dst = tar_scratch.0.join("copy");
    let tar_first = tar_pipe(&ws, &tar_dst, false)?;

    let perf = Perf::start(PERF, "b", "b", b.child.id())?;
    let moved = push(&a, &b).await?;
    drop(perf);

    let tar_second = tar_pipe(&ws, &tar_dst, false)?;
    let tar_durable = tar_pipe(&ws, &tar_dst, true)?;
    let _ = std::fs::remove_dir_all(&tar_dst);
    let tar = if tar_first.0 <= tar_second.0 { tar_first } else { tar_second };

    let seen = shell(&cb, "true").await?;
    let same = seen["workspaceSnapshot"] == tree_a && moved.answer["tree"] == tree_a;
    let epoch_b = where_is(&cb).await?["epoch"].clone();

    let small = files[0].rel.to_str().context("an ASCII name")?.to_owned();
    shell(&cb, &format!("echo x >> {small}")).await?;
    let perf = Perf::start(PERF, "b", "c", a.child.id())?;
    let back = push(&b, &a).await?;
    drop(perf);
    let perf = Perf::start(PERF, "b", "d", b.child.id())?;
    let again = push(&a, &b).await?;
    drop(perf);

    let rate = |d: Duration| bytes as f64 / MIB / secs(d);
    println!(
        "\n{:<46} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "case", "seconds", "MiB/s", "CPU ms", "ratio", "target"
    );
    println!(
        "{:<46} {:>9.3} {:>9.1} {:>9.0}",
        format!("(a) tar | tar (faster of {:.3} s, {:.3} s)", secs(tar_first.0), secs(tar_second.0)),
        secs(tar.0),
        rate(tar.0),
        tar.1
    );
    println!(
        "{:<46} {:>9.3} {:>9.1} {:>9.0}",
        "(a') tar | tar && sync (durable, for reference)",
        secs(tar_durable.0),
        rate(tar_durable.0),
        tar_durable.1
    );
    println!(
        "{:<46} {:>9.3} {:>9.1} {:>9.0} {:>9.3} {:>10}",
        "(b) push A→B, whole workspace",
        secs(moved.took),
        rate(moved.took),
        moved.cpu.0 + moved.cpu.1,
        secs(tar.0) / secs(moved.took),
        "≥ 0.70"
    );
    let (sent_b, total_b) = sent(&back.answer, "bytes");
    let percent = 100.0 * sent_b as f64 / total_b.max(1) as f64;
    println!(
        "{:<46} {:>9.3} {:>9} {:>9.0} {:>8.4}% {:>10}",
        "(c) push B→A after one small file changed",
        secs(back.took),
        "",
        back.cpu.0 + back.cpu.1,
        percent,
        "≤ 1 %"
    );
    println!(
        "{:<46} {:>9.3} {:>9} {:>9.0}",
        "(d) push A→B, all already there",
        secs(again.took),
        "",
        again.cpu.0 + again.cpu.1
    );
    println!(
        "    (b)/(a) is the rate ratio over the workspace's {:.1} MiB of files: (a)'s seconds / (b)'s",
        bytes as f64 / MIB
    );
    println!("    phases seen from the source's `where` (20 ms polls), ms since the request:");
    println!("      listed: its live files committed and the closure listed, under the lease");
    println!("      streamed: every byte the target lacked handed to the socket (after `missing`)");
    println!("      end: the target's commit (closure check, materialize, swap, commit) and the fence");
    describe("(b)", &moved);
    describe("(c)", &back);
    describe("(d)", &again);
    println!("    (b) tar | tar's CPU for the same files: {:.0} ms", tar.1);
    println!(
        "    B after (b): where epoch {epoch_b}; an execution on B sees A's tree: same tree: {}",
        if same { "yes" } else { "no" }
    );
    println!("    (c) changed `{small}`: {percent:.4} % of the bytes sent (target ≤ 1 %)");
    replication_lag(init).await
}

/// The lag of 1 MiB commits to the object store named by `RUNNERD_BENCH_REPLICA_*`.
async fn replication_lag(init: &Path) -> anyhow::Result<()> {
    let (Ok(endpoint), Ok(bucket)) =
        (std::env::var("RUNNERD_BENCH_REPLICA_ENDPOINT"), std::env::var("RUNNERD_BENCH_REPLICA_BUCKET"))
    else {
        println!(
            "  replication lag after a 1 MiB commit (target ≤ 2 s): not measured (no RUNNERD_BENCH_REPLICA_ENDPOINT)"
        );
        return Ok(());
    };
    let env = [
        ("SCIENCE_AGENT_REPLICA_ENDPOINT", endpoint.as_str()),
        ("SCIENCE_AGENT_REPLICA_BUCKET", bucket.as_str()),
        ("SCIENCE_AGENT_REPLICA_PREFIX", "bench/"),
    ];
    let daemon = start_runnerd_with(init, "move-r", &env)?;
    let client = RunnerClient::new(daemon.endpoint.clone(), BENCH_TOKEN);
    http_once(&client, "bench/lag").await?;
    let mut lags = Vec::new();
    for i in 0..5 {
        let before = client.get("/health").await?.json()["replication"]["replications"].as_u64().unwrap_or(0);
        let code = format!("head -c 1048576 /dev/urandom > blob-{i}");
        let body = json!({
            "agentId": "bench", "code": code, "executionId": new_execution_id(),
            "permissionEpoch": permission_epoch("bench/lag"), "runnerWorkspaceKey": "bench/lag",
        });
        let reply = client.post_signed("/execute-shell", &body).await?;
        if reply.status != 200 {
            bail!("the 1 MiB commit answered {}: {}", reply.status, String::from_utf8_lossy(&reply.body));
        }
        let answered = Instant::now();
        loop {
            let r = client.get("/health").await?.json()["replication"].clone();
            if r["pending"] == 0 && r["replications"].as_u64().unwrap_or(0) > before {
                lags.push(answered.elapsed());
                break;
            }
            if answered.elapsed() > Duration::from_secs(60) {
                bail!("the commit was not replicated within 60 s: {r}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let shown: Vec<String> = lags.iter().map(|l| format!("{:.0}", l.as_secs_f64() * 1000.0)).collect();
    lags.sort();
    println!(
        "  replication lag after a 1 MiB commit (target ≤ 2 s), {endpoint}: p50 {:.0} ms, max {:.0} ms (each: {} ms)",
        lags[lags.len() / 2].as_secs_f64() * 1000.0,
        lags[lags.len() - 1].as_secs_f64() * 1000.0,
        shown.join(", ")
    );
    Ok(())
}
