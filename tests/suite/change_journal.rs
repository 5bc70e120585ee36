//! Issue #31: receipts from the change journal, through the HTTP API of real runnerds. Two
//! runnerds run the same random workloads in real sandboxes — one with the journal, one
//! with it switched off, which walks the workspace before and after every run as before —
//! and every run's `createdFiles`, `modifiedFiles` and `workspaceSnapshot` must be
//! identical. Writes from the host between runs (outside any lease) go to both.

use std::path::Path;

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, keyed_shell_request};
use runnerctl::client::{Reply, RunnerClient};
use serde_json::Value;

async fn run(client: &RunnerClient, key: &str, code: &str) -> Reply {
    client.post_signed("/execute-shell", &keyed_shell_request("main", "s", key, code)).await.unwrap()
}

fn walking() -> Server {
    Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_JOURNAL_WORKSPACES".into(), "0".into())],
        ..ServerOptions::default()
    })
}

/// A small deterministic generator (the same dice for both runnerds).
struct Dice(u64);

impl Dice {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }

    fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
        of[self.next(of.len() as u64) as usize]
    }
}

const DIRS: &[&str] = &[".", "a", "a/b", "c", "c/d/e", "moved"];
const TREES: &[&str] = &["a/b", "c", "moved", "c/d"];

/// One random shell step: every kind of change the journal must see, including the ones
/// that raise no event of their own (a write through a mapping, a write through another
/// name of a linked file, a write by an orphan that outlives its parent).
fn step(dice: &mut Dice) -> String {
    let (dir, other_dir) = (dice.pick(DIRS), dice.pick(DIRS));
    let f = format!("{dir}/f{}", dice.next(5));
    let g = format!("{other_dir}/f{}", dice.next(5));
    let n = dice.next(3000);
    match dice.next(16) {
        0 => format!("mkdir -p {dir} && head -c {n} /dev/zero > {f}"),
        1 => format!("[ ! -d {dir} ] || echo more >> {f}"),
        2 => format!("[ ! -f {f} ] || truncate -s {} {f}", dice.next(20)),
        3 => format!("mkdir -p {other_dir}; [ ! -f {f} ] || mv -f {f} {g}"),
        4 => format!("rm -rf {}", dice.pick(TREES)),
        5 => format!("[ ! -f {f} ] || chmod {} {f}", dice.pick(&["600", "755"])),
        // Refused (EXDEV): the journal could not see a link made in a directory it has not
        // read yet. The host makes links instead (host_write).
        6 => format!("mkdir -p {other_dir}; [ ! -f {f} ] || ln -f {f} {g} 2>/dev/null; true"),
        7 => format!("mkdir -p {dir} && ln -sfn /etc {dir}/link{}", dice.next(2)),
        8 => format!(
            "[ ! -s {f} ] || python3 -c 'import mmap,sys; f=open(sys.argv[1],\"r+b\"); m=mmap.mmap(f.fileno(),0); \
             m[0:1]=b\"M\"; m.flush()' {f}"
        ),
        // A directory swapped for a symlink to outside: never followed.
        9 => format!("rm -rf {} && ln -s /etc {}", dice.pick(TREES), dice.pick(TREES)),
        10 => {
            format!("[ ! -d {} ] || mv -T {} moved2 2>/dev/null || true", dice.pick(TREES), dice.pick(TREES))
        }
        // An orphan (its parent subshell exits at once) writes after a while, through a
        // mapping, while the run goes on.
        11 => format!(
            "mkdir -p {dir}; head -c 64 /dev/zero > {f}; ( (sleep 0.05; python3 -c 'import mmap,sys; \
             f=open(sys.argv[1],\"r+b\"); m=mmap.mmap(f.fileno(),0); m[1:2]=b\"O\"' {f}) & ); sleep 0.3"
        ),
        12 => format!("[ ! -f {f} ] || echo through-the-other-name >> {g}"),
        // The root's own mode: no watched parent names it, so the journal gives up and walks.
        13 => "chmod 755 .".to_owned(),
        // A write through a name already removed, into a file with another name elsewhere.
        14 => format!(
            "mkdir -p {other_dir}; [ ! -f {f} ] || python3 -c 'import os,sys; os.link(sys.argv[1], sys.argv[2]); \
             fd=os.open(sys.argv[2], os.O_WRONLY|os.O_APPEND); os.unlink(sys.argv[2]); os.write(fd, b\"ghost\"*100)' \
             {f} {g}.ghost"
        ),
        _ => format!("mkdir -p {dir} && echo {} > {f}", dice.next(1_000_000)),
    }
}

/// One random change from the host, outside any run (the same on both sides).
fn host_write(root: &Path, dice: &mut Dice) {
    let dir = root.join(dice.pick(DIRS));
    let linked = root.join(dice.pick(DIRS)).join(format!("hl{}", dice.next(3)));
    let target = dir.join(format!("f{}", dice.next(5)));
    let _ = match dice.next(4) {
        // A hard link (sandboxes cannot make one): writes through either name in later runs.
        3 => std::fs::remove_file(&linked).or(Ok(())).and_then(|_| std::fs::hard_link(&target, &linked)),
        0 => std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(dir.join("host"), "from the host")),
        1 => std::fs::remove_file(dir.join("host")),
        _ => std::fs::create_dir_all(dir.join("hostdir"))
            .and_then(|_| std::fs::write(dir.join("hostdir/x"), "x")),
    };
}

/// Where two trees (one in each runnerd's store) differ, for a failure's message.
fn tree_diff(a: &Server, b: &Server, ra: &Value, rb: &Value, at: &str, out: &mut Vec<String>) {
    let read = |s: &Server, r: &Value| -> Value {
        let digest = r["digest"].as_str().unwrap_or_default().trim_start_matches("sha256:").to_owned();
        let bytes = std::fs::read(s.path(&format!("versioning/agent-state/blobs/sha256/{digest}")))
            .unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or(Value::Null)
    };
    let (ta, tb) = (read(a, ra), read(b, rb));
    let entries = |t: &Value| -> Vec<Value> { t["value"]["entries"].as_array().cloned().unwrap_or_default() };
    let (ea, eb) = (entries(&ta), entries(&tb));
    for e in &ea {
        let twin = eb.iter().find(|x| x["name"] == e["name"]);
        match twin {
            None => out.push(format!("{at}/{}: only in the journal's", e["name"])),
            Some(t) if t == e => {}
            Some(t) if e.get("tree").is_some() && t.get("tree").is_some() => {
                tree_diff(a, b, &e["tree"], &t["tree"], &format!("{at}/{}", e["name"]), out)
            }
            Some(t) => out.push(format!("{at}: {e} against {t}")),
        }
    }
    for e in &eb {
        if !ea.iter().any(|x| x["name"] == e["name"]) {
            out.push(format!("{at}/{}: only in the walk's", e["name"]));
        }
    }
}

fn receipt(r: &Reply) -> (Value, Value, Value, Value) {
    let b = r.json();
    (
        b["exitCode"].clone(),
        b["createdFiles"].clone(),
        b["modifiedFiles"].clone(),
        b["workspaceSnapshot"].clone(),
    )
}

async fn scrape(client: &RunnerClient) -> String {
    String::from_utf8(client.get("/metrics").await.unwrap().body).unwrap()
}

fn journal_runs(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("runner_journal_runs{measured=\"journal\"} "))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn receipts_from_the_journal_are_those_of_a_full_walk() {
    if !sandbox_or_skip("receipts_from_the_journal_are_those_of_a_full_walk") {
        return;
    }
    let (journaled, walked) = (Server::start(), walking());
    let (a, b) = (journaled.client(), walked.client());
    let key = "journal/diff";
    let health = a.get("/health").await.unwrap().json();
    assert_eq!(health["sandboxProfile"]["workspaceJournal"]["mode"], "inotify", "{health}");
    let off = b.get("/health").await.unwrap().json();
    assert_eq!(off["sandboxProfile"]["workspaceJournal"]["mode"], "walk", "{off}");
    let seed = "mkdir -p a/b c/d/e && for i in $(seq 1 200); do echo $i > a/b/s$i; done";
    assert_eq!(receipt(&run(&a, key, seed).await), receipt(&run(&b, key, seed).await));
    // JOURNAL_DIFF_SEED / JOURNAL_DIFF_ROUNDS explore further by hand.
    let var =
        |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let mut dice = Dice(var("JOURNAL_DIFF_SEED", 7));
    for round in 0..var("JOURNAL_DIFF_ROUNDS", 40) {
        let code: Vec<String> = (0..1 + dice.next(6)).map(|_| step(&mut dice)).collect();
        let code = format!("set +e\n{}\ntrue", code.join("\n"));
        let (ra, rb) = (run(&a, key, &code).await, run(&b, key, &code).await);
        assert_eq!(ra.status, 200, "round {round}: {}", ra.json());
        if receipt(&ra) != receipt(&rb) {
            let mut diff = Vec::new();
            tree_diff(
                &journaled,
                &walked,
                &ra.json()["workspaceSnapshot"],
                &rb.json()["workspaceSnapshot"],
                "",
                &mut diff,
            );
            panic!("round {round}: {code}\n{}\n{}\n{diff:#?}", ra.json(), rb.json());
        }
        let created = ra.json()["createdFiles"].to_string();
        assert!(!created.contains("passwd"), "round {round}: a link to /etc was followed: {created}");
        if dice.next(4) == 0 {
            let mut host = Dice(dice.0);
            host_write(&journaled.path(&format!("remote-workspaces/{key}")), &mut host);
            let mut host = Dice(dice.0);
            host_write(&walked.path(&format!("remote-workspaces/{key}")), &mut host);
            dice.next(2);
        }
    }
    let metrics = scrape(&a).await;
    assert!(journal_runs(&metrics) >= 30, "most runs came from the journal:\n{metrics}");
    assert_eq!(journal_runs(&scrape(&b).await), 0);
}

/// 1,000 workspaces used once each leave at most the configured number journaled, their
/// watches, and no more descriptors than a handful did.
#[tokio::test]
async fn watches_stay_bounded_over_a_thousand_workspaces() {
    if !sandbox_or_skip("watches_stay_bounded_over_a_thousand_workspaces") {
        return;
    }
    // The journal's descriptors alone: sandboxes started ahead hold pipes of their own,
    // within their own bound (suite::prestart checks that one).
    let server = Server::start_with(ServerOptions {
        env: vec![
            ("SCIENCE_AGENT_JOURNAL_WORKSPACES".into(), "4".into()),
            ("SCIENCE_AGENT_PRESTART_SANDBOXES".into(), "0".into()),
        ],
        ..ServerOptions::default()
    });
    let client = std::sync::Arc::new(server.client());
    let pid = server.pid().unwrap();
    let fds = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let batch = |from: usize, to: usize| {
        let client = client.clone();
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            for chunk in (from..to).collect::<Vec<_>>().chunks(8) {
                for &i in chunk {
                    let client = client.clone();
                    tasks.spawn(async move {
                        run(&client, &format!("bound/w{i}"), "mkdir -p d && echo x > d/f").await
                    });
                }
                while let Some(r) = tasks.join_next().await {
                    assert_eq!(r.unwrap().status, 200);
                }
            }
        }
    };
    batch(0, 16).await;
    let early = fds();
    batch(16, 1000).await;
    let late = fds();
    assert!(late <= early + 4, "descriptors grew from {early} to {late}");
    let metrics = scrape(&client).await;
    let gauge = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|n| n.parse().ok())
            .unwrap()
    };
    assert!(gauge("runner_journal_workspaces") <= 4, "{metrics}");
    // Two directories each (the root and d).
    assert!(gauge("runner_journal_watches") <= 8, "{metrics}");
}

/// Sets `fs.inotify.max_queued_events` for as long as it lives (the kernel reads it when an
/// inotify instance is made, so only a runnerd started meanwhile gets the tiny queue).
struct QueueLimit(String);

impl QueueLimit {
    const PATH: &str = "/proc/sys/fs/inotify/max_queued_events";

    fn set(n: u32) -> std::io::Result<QueueLimit> {
        let old = std::fs::read_to_string(Self::PATH)?;
        std::fs::write(Self::PATH, n.to_string())?;
        Ok(QueueLimit(old.trim().to_owned()))
    }
}

impl Drop for QueueLimit {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}

/// A real overflow, end to end: a runnerd whose inotify queue holds 16 events, a run that
/// changes far more than that. The journal notices, counts it, walks instead, and every
/// receipt stays what a full walk says. (Root only: the limit is a sysctl.)
#[tokio::test]
async fn an_overflowing_queue_falls_back_to_a_walk() {
    if !sandbox_or_skip("an_overflowing_queue_falls_back_to_a_walk") {
        return;
    }
    if !runner_tests::is_root() {
        // The unprivileged pass: the same fallback is unit-tested there (the reader starved
        // past the default queue, runnerd/engine/src/journal/tests.rs).
        eprintln!("SKIP an_overflowing_queue_falls_back_to_a_walk: the inotify queue limit is a root sysctl");
        return;
    }
    let tiny = {
        let _limit = QueueLimit::set(16).expect("set fs.inotify.max_queued_events");
        Server::start()
    };
    let walked = walking();
    let (a, b) = (tiny.client(), walked.client());
    let key = "journal/overflow";
    for code in [
        "mkdir -p d && echo seed > d/seed",
        "for i in $(seq 1 5000); do echo $i > d/f$i; done",
        "rm d/f1 d/f2 && echo more >> d/f3 && for i in $(seq 1 2000); do echo $i >> d/f$i 2>/dev/null; done; true",
        "echo small > d/f4",
        "true",
    ] {
        let (ra, rb) = (run(&a, key, code).await, run(&b, key, code).await);
        assert_eq!(ra.status, 200, "{}", ra.json());
        assert_eq!(receipt(&ra), receipt(&rb), "{code}");
    }
    let metrics = scrape(&a).await;
    let lost = metrics
        .lines()
        .find_map(|l| l.strip_prefix("runner_journal_runs{measured=\"events_lost\"} "))
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(lost >= 1, "the overflow was counted:\n{metrics}");
    assert!(journal_runs(&metrics) >= 1, "and the journal took over again:\n{metrics}");
}

/// Hard links are refused inside the sandbox with the answer a link across filesystems
/// gets (EXDEV), so tools copy instead; nothing else about the files changes.
#[tokio::test]
async fn a_sandbox_cannot_make_a_hard_link() {
    if !sandbox_or_skip("a_sandbox_cannot_make_a_hard_link") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let code = "set +e; echo one > a; ln a b; echo \"ln=$?\"; \
                python3 -c 'import os\ntry:\n os.link(\"a\", \"c\")\nexcept OSError as e: print(e.errno)'; \
                cp --link a d 2>/dev/null || cp a d; cat d; ls";
    let r = run(&client, "journal/links", code).await;
    let body = r.json();
    assert_eq!(r.status, 200, "{body}");
    assert_eq!(body["stdout"], "ln=1\n18\none\na\nd\n", "{body}");
    assert!(body["stderr"].as_str().unwrap_or_default().contains("Invalid cross-device link"), "{body}");
}
