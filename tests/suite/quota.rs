//! Issue #14, holes 5 and 6, run as attacks from real sandboxes through the HTTP API: the
//! workspace quota holds (sparse files, blocks allocated past the end, a directory the
//! runner cannot list, a write stopped by RLIMIT_FSIZE), and what a snapshot cannot take
//! (a FIFO, a tree deeper than 256 levels) fails that write without poisoning the workspace,
//! and never fails a parent's commit when it sits in a nested workspace.

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, keyed_shell_request, shell_request};
use runnerctl::client::{Reply, RunnerClient};
use serde_json::{Value, json};

const POISONED: &str = "workspace_poisoned";

async fn run(client: &RunnerClient, body: &Value) -> Reply {
    client.post_signed("/execute-shell", body).await.unwrap()
}

fn in_key(key: &str, code: &str, quota: Option<u64>) -> Value {
    let mut body = keyed_shell_request("main", "s", key, code);
    if let Some(q) = quota {
        body["maxWorkspaceBytes"] = json!(q);
    }
    body
}

/// The original's quota error (before/after: "exceeds"; the poll: "exceeded").
fn assert_quota_error(r: &Reply, limit: u64) {
    let body = r.json();
    assert_eq!(r.status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    let tail = format!(
        " the {limit} byte execution quota (current limit from system quota settings / SCIENCE_AGENT_MAX_WORKSPACE_BYTES; set to 0 for unlimited)"
    );
    assert!(
        error.starts_with(&format!("Workspace exceeds{tail}"))
            || error.starts_with(&format!("Workspace exceeded{tail}")),
        "{body}"
    );
}

/// Apparent bytes of every file under `dir`.
fn bytes_under(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(m) = e.path().symlink_metadata() else { continue };
        total += if m.is_dir() { bytes_under(&e.path()) } else { m.len() };
    }
    total
}

/// Hole 5, the per-file cap: a write RLIMIT_FSIZE stops answers the original's quota error,
/// not a truncated file with exit 0 (python: EFBIG) or exit 153 (head: SIGXFSZ).
#[tokio::test]
async fn a_write_stopped_at_the_quota_answers_the_quota_error() {
    if !sandbox_or_skip("a_write_stopped_at_the_quota_answers_the_quota_error") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = server.project_workspace("capped");
    for code in [
        "python3 -c \"open('b','wb').write(b'x'*5000)\"; echo written",
        "head -c 5000 /dev/zero > b; echo written",
    ] {
        let mut body = shell_request("main", "s", &ws, code);
        body["maxWorkspaceBytes"] = json!(1000);
        let r = run(&client, &body).await;
        assert_quota_error(&r, 1000);
        let left = std::fs::metadata(ws.join("b")).unwrap().len();
        assert!(left <= 1001, "RLIMIT_FSIZE still caps the file: {left}");
        // Not poisoned: a run without the quota can clean up.
        let r = run(&client, &shell_request("main", "s", &ws, "rm b; echo clean")).await;
        assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("clean\n")), "{}", r.json());
    }
}

/// Hole 5: sparse files (nothing allocated, each below RLIMIT_FSIZE, 570 MB in all) under
/// a 20 MB quota: the run fails, and the version store does not write them out (the failed
/// run's commit used to store them in full).
#[tokio::test]
async fn sparse_files_count_their_apparent_size_and_stay_out_of_the_store() {
    if !sandbox_or_skip("sparse_files_count_their_apparent_size_and_stay_out_of_the_store") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let quota = 20_000_000;
    let code = "for i in $(seq 1 30); do truncate -s 19M s$i; done; echo done";
    let r = run(&client, &in_key("t/sparse", code, Some(quota))).await;
    assert_quota_error(&r, quota);
    let stored = bytes_under(&server.path("versioning"));
    assert!(stored < quota, "the version store took {stored} bytes");
    // Counted before the next run too; and the workspace is not poisoned.
    let r = run(&client, &in_key("t/sparse", "echo never", Some(quota))).await;
    assert_quota_error(&r, quota);
    let r = run(&client, &in_key("t/sparse", "rm s*; echo clean", Some(0))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("clean\n")), "{}", r.json());
}

/// A tree a run left over the quota (sparse files of distinct contents, which neither count
/// their holes against the disk nor share a blob) is never written out into the version
/// store by another route: the snapshot route and an upload's commit take the configured
/// quota too (review helper: they stored all 570 MB).
#[tokio::test]
async fn the_workspace_routes_never_store_a_tree_over_the_quota() {
    if !sandbox_or_skip("the_workspace_routes_never_store_a_tree_over_the_quota") {
        return;
    }
    let quota: u64 = 20_000_000;
    let server = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_MAX_WORKSPACE_BYTES".into(), quota.to_string())],
        ..Default::default()
    });
    let client = server.client();
    let code = "for i in $(seq 1 30); do printf %08d $i > s$i; truncate -s 19M s$i; done; echo done";
    let r = run(&client, &in_key("t/left", code, None)).await;
    assert_quota_error(&r, quota);
    assert!(bytes_under(&server.path("versioning")) < quota);
    let left = server.path("remote-workspaces/t/left");
    assert!(std::fs::read_dir(&left).unwrap().count() > 1, "the run left its files");
    let snap =
        client.post_json("/remote-workspace/snapshots", &json!({"workspace": "t/left"})).await.unwrap();
    assert_ne!(snap.status, 201, "{}", snap.json());
    let put = client
        .send_bytes("PUT", "/remote-workspace/file?workspace=t/left&path=tiny", &[], b"x".to_vec())
        .await
        .unwrap();
    assert_ne!(put.status, 201, "{}", put.json());
    let stored = bytes_under(&server.path("versioning"));
    assert!(stored < quota, "the version store took {stored} bytes");
    // Not poisoned: once the files are gone the workspace works again.
    let r = run(&client, &in_key("t/left", "rm s*; echo clean", Some(0))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("clean\n")), "{}", r.json());
    let put = client
        .send_bytes("PUT", "/remote-workspace/file?workspace=t/left&path=tiny", &[], b"x".to_vec())
        .await
        .unwrap();
    assert_eq!(put.status, 201, "{}", put.json());
}

/// Hole 5: blocks `fallocate`d past the end of a file (its size stays 0, RLIMIT_FSIZE does
/// not look) and fallocate bursts (gigabytes per call, faster than any poll): the seccomp
/// profiles refuse fallocate (EOPNOTSUPP), and what blocks a file does hold count.
#[tokio::test]
async fn preallocation_is_refused_and_allocated_blocks_count() {
    if !sandbox_or_skip("preallocation_is_refused_and_allocated_blocks_count") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let quota = 20_000_000;
    let code = "touch f; for i in $(seq 1 50); do fallocate -n -l 64M f 2>/dev/null || echo refused; fallocate -l 19M g$i 2>/dev/null || echo refused; done | sort -u";
    let r = run(&client, &in_key("t/prealloc", code, Some(quota))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("refused\n")), "{}", r.json());
    let dir = server.path("remote-workspaces/t/prealloc");
    let allocated: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| std::os::unix::fs::MetadataExt::blocks(&e.metadata().unwrap()) * 512)
        .sum();
    assert!(allocated < 1 << 20, "{allocated} bytes allocated");
    // Blocks a file holds beyond its size (here reserved from the host) count before a run.
    let f = std::fs::OpenOptions::new().write(true).open(dir.join("f")).unwrap();
    // SAFETY: fallocate on a descriptor we own; the result is checked.
    let rc = unsafe {
        libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FALLOC_FL_KEEP_SIZE, 0, 64 << 20)
    };
    if rc != 0 {
        assert!(!runner_tests::in_ci(), "fallocate failed in CI: {}", std::io::Error::last_os_error());
        eprintln!("SKIP the preallocated half: {}", std::io::Error::last_os_error());
        return;
    }
    assert_eq!(f.metadata().unwrap().len(), 0);
    let r = run(&client, &in_key("t/prealloc", "echo never", Some(quota))).await;
    assert_quota_error(&r, quota);
}

/// Hole 5: a directory the runner cannot list (write and search, no read: as an
/// unprivileged runnerd it cannot read it) no longer hides what it holds. As root runnerd
/// the contents are counted; unprivileged, the walk fails closed and names the directory.
#[tokio::test]
async fn an_unlistable_directory_does_not_hide_its_contents() {
    if !sandbox_or_skip("an_unlistable_directory_does_not_hide_its_contents") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let quota = 2_000_000;
    // Each file below the quota; the directory is never listable, from its creation on.
    let code = "mkdir d && chmod 300 d && for i in $(seq 1 10); do head -c 1000000 /dev/zero > d/f$i; done; echo written";
    let r = run(&client, &in_key("t/hidden", code, Some(quota))).await;
    assert_quota_error(&r, quota);
    let error = r.json()["error"].as_str().unwrap().to_owned();
    if error.contains("cannot read") {
        assert!(error.contains("\"d\""), "{error}");
    }
    // Not poisoned: without the quota a run can make it readable and remove it.
    let r = run(&client, &in_key("t/hidden", "chmod 700 d && rm -r d && echo clean", Some(0))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("clean\n")), "{}", r.json());
    let r = run(&client, &in_key("t/hidden", "echo fine", Some(quota))).await;
    assert_eq!(r.status, 200, "{}", r.json());
}

/// Issue #18: the quota poll (every 25 ms during the run), the post-check and
/// `createdFiles` walk by descriptor, so a directory a sandbox swaps for a symlink to a big
/// host directory (`/usr`, gigabytes on the host) between a walk's listing and its descent
/// is never followed: the run stays under a 20 MB quota and nothing below the link is listed.
#[tokio::test]
async fn a_directory_swapped_for_a_symlink_during_a_run_is_never_followed() {
    if !sandbox_or_skip("a_directory_swapped_for_a_symlink_during_a_run_is_never_followed") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let quota = 20_000_000;
    let code = "for i in $(seq 1 300); do mkdir d && echo x > d/mine && rm -r d && ln -s /usr d && rm d; done; \
                ln -s /usr d; echo done";
    let r = run(&client, &in_key("t/swap", code, Some(quota))).await;
    let body = r.json();
    assert_eq!((r.status, body["stdout"].as_str()), (200, Some("done\n")), "{body}");
    let created: Vec<&str> =
        body["createdFiles"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(created.iter().all(|p| !p.starts_with("d/")), "nothing below the link: {created:?}");
    // The next run sees the link as a link, and the quota still holds.
    let r = run(&client, &in_key("t/swap", "test -L d && echo link", Some(quota))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("link\n")), "{}", r.json());
}

/// Hole 6: a FIFO fails that run's commit, naming it, and leaves the workspace usable: the
/// next run can remove it, and so can a DELETE.
#[tokio::test]
async fn a_fifo_fails_one_commit_and_never_poisons() {
    if !sandbox_or_skip("a_fifo_fails_one_commit_and_never_poisons") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let r = run(&client, &in_key("t/fifo", "mkdir sub && mkfifo sub/pipe && echo planted", None)).await;
    let error = r.json()["error"].as_str().unwrap_or_default().to_owned();
    assert_eq!(r.status, 400, "{}", r.json());
    assert!(error.contains("rejects FIFO") && error.contains("\"sub/pipe\""), "{error}");
    let r = run(&client, &in_key("t/fifo", "rm sub/pipe && echo removed", None)).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("removed\n")), "{}", r.json());

    let r = run(&client, &in_key("t/fifo", "mkfifo again && echo planted", None)).await;
    assert_eq!(r.status, 400, "{}", r.json());
    assert_ne!(r.json()["code"], POISONED);
    let deleted =
        client.send_bytes("DELETE", "/remote-workspace?workspace=t/fifo", &[], Vec::new()).await.unwrap();
    assert_eq!((deleted.status, deleted.json()), (200, json!({"deleted": true})));
    let r = run(&client, &in_key("t/fifo", "ls; echo usable", None)).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("usable\n")), "{}", r.json());
}

/// Hole 6: a FIFO in a nested workspace (`P/agents/c`) does not fail P's commit; it is the
/// nested workspace's to answer for, and that one stays usable too.
#[tokio::test]
async fn a_fifo_in_a_nested_workspace_does_not_fail_its_parent() {
    if !sandbox_or_skip("a_fifo_in_a_nested_workspace_does_not_fail_its_parent") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let (parent, child) = ("n/s", "n/s/agents/c");
    let r = run(&client, &in_key(parent, "echo parent > p.txt", None)).await;
    assert_eq!(r.status, 200, "{}", r.json());
    let r = run(&client, &in_key(child, "echo child > c.txt", None)).await;
    assert_eq!(r.status, 200, "{}", r.json());
    // The parent's sandbox plants the FIFO in the child's tree.
    let r = run(&client, &in_key(parent, "mkfifo agents/c/pipe && echo planted", None)).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("planted\n")), "{}", r.json());
    let r = run(&client, &in_key(parent, "echo again", None)).await;
    assert_eq!(r.status, 200, "{}", r.json());
    // The child's own commit refuses it, without poisoning; its next run removes it.
    let r = run(&client, &in_key(child, "echo hi", None)).await;
    assert_eq!(r.status, 400, "{}", r.json());
    assert!(r.json()["error"].as_str().unwrap().contains("\"pipe\""), "{}", r.json());
    let r = run(&client, &in_key(child, "rm pipe && echo removed", None)).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("removed\n")), "{}", r.json());
}

/// Hole 6: a tree 257 levels deep fails that commit, naming where, and leaves the workspace
/// usable (the next run removes it; a DELETE would too).
#[tokio::test]
async fn a_tree_too_deep_to_snapshot_never_poisons() {
    if !sandbox_or_skip("a_tree_too_deep_to_snapshot_never_poisons") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let code = "python3 -c \"import os\nfor _ in range(257):\n os.mkdir('d'); os.chdir('d')\" && echo deep";
    let r = run(&client, &in_key("t/deep", code, None)).await;
    assert_eq!(r.status, 400, "{}", r.json());
    let error = r.json()["error"].as_str().unwrap().to_owned();
    assert!(error.contains("deeper than 256 levels") && error.contains("d/d/d"), "{error}");
    let r = run(&client, &in_key("t/deep", "rm -rf d && echo flat", None)).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("flat\n")), "{}", r.json());
    let r = run(&client, &in_key("t/deep", code, None)).await;
    assert_eq!(r.status, 400, "{}", r.json());
    let deleted =
        client.send_bytes("DELETE", "/remote-workspace?workspace=t/deep", &[], Vec::new()).await.unwrap();
    assert_eq!((deleted.status, deleted.json()), (200, json!({"deleted": true})));
}

/// `/health` states how the total is enforced, and the bound (R-PEER-1).
#[tokio::test]
async fn health_states_how_the_workspace_quota_holds() {
    let server = Server::start();
    let h = server.client().get("/health").await.unwrap().json();
    assert_eq!(h["enforced"]["workspaceBytes"], "partial", "{h}");
    let reason = h["reasons"]["workspaceBytes"].as_str().unwrap();
    for part in [
        "RLIMIT_FSIZE = quota + 1",
        "fallocate refused",
        "plus the blocks allocated beyond it",
        "every 25 ms",
    ] {
        assert!(reason.contains(part), "{reason}");
    }
}

/// Issue #30: the quota counts as the original (`stat.size` summed), plus what is allocated
/// beyond the size: a 500-byte file under a 1000-byte quota passes (it used to count its 4 KiB
/// block), a 5000-byte one fails with the original's text, and a 1 GiB preallocation past the
/// end (`fallocate -n`, made on the host since seccomp refuses fallocate inside) under a
/// 10 MiB quota fails the next run.
#[tokio::test]
async fn the_quota_counts_sizes_as_the_original_and_preallocation_beyond_them() {
    if !sandbox_or_skip("the_quota_counts_sizes_as_the_original_and_preallocation_beyond_them") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let r = run(&client, &in_key("t/sizes", "head -c 500 /dev/zero > small; echo ok", Some(1000))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("ok\n")), "{}", r.json());
    let r = run(&client, &in_key("t/sizes", "echo again", Some(1000))).await;
    assert_eq!((r.status, r.json()["stdout"].as_str()), (200, Some("again\n")), "{}", r.json());
    let r = run(
        &client,
        &in_key("t/sizes", "head -c 5000 /dev/zero > big 2>/dev/null; echo written", Some(1000)),
    )
    .await;
    assert_quota_error(&r, 1000);
    let r = run(&client, &in_key("t/sizes", "rm -f big; echo clean", Some(0))).await;
    assert_eq!(r.status, 200, "{}", r.json());

    let dir = server.path("remote-workspaces/t/sizes");
    // `fallocate -n` opens without creating.
    std::fs::File::create(dir.join("pre")).unwrap();
    let status =
        std::process::Command::new("fallocate").args(["-n", "-l", "1G"]).arg(dir.join("pre")).status();
    match status {
        Ok(s) if s.success() => {}
        other => {
            assert!(!runner_tests::in_ci(), "fallocate -n failed in CI: {other:?}");
            eprintln!("SKIP the preallocated half: fallocate -n failed ({other:?})");
            return;
        }
    }
    assert_eq!(std::fs::metadata(dir.join("pre")).unwrap().len(), 0);
    let r = run(&client, &in_key("t/sizes", "echo never", Some(10 << 20))).await;
    assert_quota_error(&r, 10 << 20);
}
