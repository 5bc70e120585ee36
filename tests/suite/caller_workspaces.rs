//! Issue #30, deliverable 1: workspaces the caller made (the API creates `projects/<p>/…` as
//! its own user, not as the sandbox user) are writable from real sandboxes, whoever started
//! runnerd. As root (sandboxes handed to an unprivileged user), the workspace is mounted
//! idmapped: sandbox code is not uid 0, sees the files as its own, and what it writes lands
//! on disk owned like the directory. Unprivileged, the caller is runnerd's own user. Where
//! idmapping is refused (a filesystem without support), the execution is refused with the
//! remedy, and nothing is written. Unlike `Server::project_workspace`, nothing here hands a
//! directory to the sandbox user.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runner_tests::server::{Server, shell_request};
use runner_tests::{idmap_or_skip, idmapped_workspaces, is_root, sandbox_or_skip, sandbox_user};
use serde_json::{Value, json};

/// The sandbox works and, as root, caller-made workspaces are idmapped (else CI fails).
fn ready(test: &str) -> bool {
    sandbox_or_skip(test) && idmap_or_skip(test)
}

/// Tests that make mounts or owners only root can: an unprivileged runnerd maps nothing (its
/// own directories need no map), so they say so and pass.
fn root_only(test: &str, why: &str) -> bool {
    if !is_root() {
        eprintln!("{test}: root only ({why})");
    }
    is_root()
}

/// A workspace made as the caller would: by this process, mode 0755, with one file of its own.
fn caller_workspace(server: &Server, name: &str) -> PathBuf {
    let ws = server.path("projects/caller").join(name);
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(ws.join("seed.txt"), "seed\n").unwrap();
    ws
}

/// (uid, gid) of this process: the caller's.
fn me() -> (u32, u32) {
    // SAFETY: getuid/getgid cannot fail.
    unsafe { (libc::getuid(), libc::getgid()) }
}

/// Every entry under `dir` (itself included) with an owner other than `owner`.
fn foreign_entries(dir: &Path, owner: (u32, u32)) -> Vec<String> {
    let mut out = Vec::new();
    let m = std::fs::symlink_metadata(dir).unwrap();
    if (m.uid(), m.gid()) != owner {
        out.push(format!("{} {}:{}", dir.display(), m.uid(), m.gid()));
    }
    if m.is_dir() {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            out.extend(foreign_entries(&e.path(), owner));
        }
    }
    out
}

fn names(v: &Value) -> Vec<String> {
    let mut n: Vec<String> = v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect();
    n.sort();
    n
}

#[tokio::test]
async fn a_caller_made_workspace_is_written_as_its_owner() {
    if !ready("a_caller_made_workspace_is_written_as_its_owner") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = caller_workspace(&server, "shell");
    let code = "id -u; stat -c %u seed.txt; echo x > new.txt; echo more >> seed.txt; mkdir -p d/e; echo y > d/e/f.txt";
    let r = client.post_signed("/execute-shell", &shell_request("main", "s", &ws, code)).await.unwrap();
    let body = r.json();
    assert_eq!((r.status, body["exitCode"].as_i64()), (200, Some(0)), "{body}");
    let lines: Vec<&str> = body["stdout"].as_str().unwrap().lines().collect();
    let sandbox_uid = sandbox_user().uid.to_string();
    // Not host root, and the caller's file is the sandbox user's own as seen from inside.
    assert_eq!(lines, [sandbox_uid.as_str(), sandbox_uid.as_str()], "{body}");
    assert_ne!(lines[0], "0");
    assert_eq!(names(&body["createdFiles"]), ["d/e/f.txt", "new.txt"], "{body}");
    assert_eq!(names(&body["modifiedFiles"]), ["seed.txt"], "{body}");
    assert_eq!(std::fs::read_to_string(ws.join("seed.txt")).unwrap(), "seed\nmore\n");
    // On the host, everything is still the caller's: the API can manage, move and delete it.
    assert_eq!(foreign_entries(&ws, me()), Vec::<String>::new());

    // The same through /execute (Python).
    let mut body =
        shell_request("main", "s", &ws, "open('py.txt','w').write('a')\nprint(open('seed.txt').read())");
    body["language"] = json!("python");
    let r = client.post_signed("/execute", &body).await.unwrap();
    let body = r.json();
    assert_eq!((r.status, body["exitCode"].as_i64()), (200, Some(0)), "{body}");
    assert_eq!(names(&body["createdFiles"]), ["py.txt"], "{body}");
    assert_eq!(foreign_entries(&ws, me()), Vec::<String>::new());
}

#[tokio::test]
async fn a_nested_workspace_under_a_caller_made_read_only_parent() {
    if !ready("a_nested_workspace_under_a_caller_made_read_only_parent") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let parent = caller_workspace(&server, "parent");
    let nested = parent.join("sub");
    std::fs::create_dir(&nested).unwrap();
    let mut body = shell_request(
        "main",
        "s",
        &nested,
        "pwd; stat -c %u /workspace/seed.txt; echo n > n.txt; echo p > /workspace/p.txt 2>/dev/null || echo read-only",
    );
    body["readOnlyWorkspaceRoot"] = json!(parent);
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    let body = r.json();
    assert_eq!((r.status, body["exitCode"].as_i64()), (200, Some(0)), "{body}");
    let uid = sandbox_user().uid;
    assert_eq!(body["stdout"].as_str().unwrap(), format!("/workspace/sub\n{uid}\nread-only\n"), "{body}");
    assert_eq!(names(&body["createdFiles"]), ["n.txt"], "{body}");
    assert!(!parent.join("p.txt").exists());
    assert_eq!(foreign_entries(&parent, me()), Vec::<String>::new());
}

#[tokio::test]
async fn a_managed_run_writes_a_caller_made_workspace_as_its_owner() {
    if !ready("a_managed_run_writes_a_caller_made_workspace_as_its_owner") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = caller_workspace(&server, "managed");
    let body = shell_request("main", "s", &ws, "echo managed > m.txt; echo again >> seed.txt");
    let id = body["executionId"].as_str().unwrap().to_owned();
    let r = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(r.status, 202, "{}", r.json());
    let query = format!("/shell-executions/{id}?sessionId=s&agentId=main");
    let start = Instant::now();
    let record = loop {
        let rec = client.get(&query).await.unwrap().json();
        if matches!(rec["state"].as_str(), Some("completed" | "failed" | "cancelled" | "unknown")) {
            break rec;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{rec}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (record["state"].as_str(), record["result"]["exitCode"].as_i64()),
        (Some("completed"), Some(0)),
        "{record}"
    );
    assert_eq!(std::fs::read_to_string(ws.join("m.txt")).unwrap(), "managed\n");
    assert_eq!(foreign_entries(&ws, me()), Vec::<String>::new());
}

/// No set-user-ID or set-group-ID file is made from inside: through an idmapped mount it would
/// be owned by the directory's owner on disk (root, here), a set-user-ID root program.
#[tokio::test]
async fn no_set_id_file_is_made_from_inside() {
    if !ready("no_set_id_file_is_made_from_inside") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let ws = caller_workspace(&server, "setid");
    let code = "touch a b; chmod u+s a 2>/dev/null || echo chmod-refused; chmod g+s b 2>/dev/null || echo chmod-refused; \
                python3 -c \"import os; os.open('c', os.O_CREAT | os.O_WRONLY, 0o4755)\" 2>/dev/null || echo open-refused; \
                python3 -c \"import os; os.mknod('d', 0o100000 | 0o6755)\" 2>/dev/null || echo mknod-refused; \
                chmod 755 a; echo plain-chmod-ok";
    let r = client.post_signed("/execute-shell", &shell_request("main", "s", &ws, code)).await.unwrap();
    let body = r.json();
    assert_eq!(r.status, 200, "{body}");
    assert_eq!(
        body["stdout"].as_str().unwrap(),
        "chmod-refused\nchmod-refused\nopen-refused\nmknod-refused\nplain-chmod-ok\n",
        "{body}"
    );
    for e in std::fs::read_dir(&ws).unwrap().flatten() {
        let mode = e.metadata().unwrap().mode();
        assert_eq!(mode & 0o6000, 0, "{} has mode {mode:o}", e.path().display());
    }
}

/// `/health` says how caller-made workspaces are served.
#[tokio::test]
async fn health_says_how_caller_made_workspaces_are_served() {
    if !sandbox_or_skip("health_says_how_caller_made_workspaces_are_served") {
        return;
    }
    let server = Server::start();
    let health = server.client().get("/health").await.unwrap().json();
    let state = health["sandboxProfile"]["workspaceIdmap"]["state"].as_str();
    let expected = match (is_root(), idmapped_workspaces()) {
        (false, _) => "unprivileged",
        (true, true) => "available",
        // A shared sandbox user (nobody) is never an idmap target.
        (true, false) => "unavailable",
    };
    assert_eq!(state, Some(expected), "{health}");
    assert!(
        health["sandboxProfile"]["callerWorkspaces"].as_str().unwrap().contains("idmapped mounts"),
        "{health}"
    );
}

/// A filesystem that refuses idmapped mounts (ramfs) under `projects/`: the execution is
/// refused with the remedy, nothing runs, nothing is written; never a silent read-only run.
#[tokio::test]
async fn a_filesystem_without_idmap_support_is_refused_with_the_remedy() {
    if !ready("a_filesystem_without_idmap_support_is_refused_with_the_remedy") {
        return;
    }
    if !root_only("a_filesystem_without_idmap_support_is_refused_with_the_remedy", "mounts ramfs") {
        return;
    }
    let server = Server::start();
    let mount = server.path("projects/ramfs");
    std::fs::create_dir_all(&mount).unwrap();
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mount(2) with NUL-terminated strings we own; the result is checked.
    let rc =
        unsafe { libc::mount(c"ramfs".as_ptr(), c(&mount).as_ptr(), c"ramfs".as_ptr(), 0, std::ptr::null()) };
    assert_eq!(rc, 0, "mounting ramfs: {}", std::io::Error::last_os_error());
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let path = std::ffi::CString::new(self.0.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: umount2 of the mount this test made.
            unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _unmount = Unmount(mount.clone());
    let ws = mount.join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::fs::set_permissions(&ws, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = server
        .client()
        .post_signed("/execute-shell", &shell_request("main", "s", &ws, "echo x > f"))
        .await
        .unwrap();
    let body = r.json();
    assert_eq!(r.status, 400, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(error.contains("could not be mounted for the sandbox user"), "{error}");
    assert!(error.contains("Run runnerd as the data directory's owner"), "{error}");
    assert!(error.contains("nothing was run"), "{error}");
    assert!(!ws.join("f").exists());
}

/// A set-user-ID file already in a caller-made workspace: through the map a sandbox could
/// rewrite it as its owner through a shared mapping (which keeps the bit), so an idmapped
/// workspace holding one is refused, naming the file; unmapped, it runs as before.
#[tokio::test]
async fn a_set_id_file_in_an_idmapped_workspace_is_refused() {
    if !ready("a_set_id_file_in_an_idmapped_workspace_is_refused") {
        return;
    }
    let server = Server::start();
    let ws = caller_workspace(&server, "setid-present");
    std::fs::write(ws.join("tool"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(ws.join("tool"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let r = server
        .client()
        .post_signed("/execute-shell", &shell_request("main", "s", &ws, "echo ran"))
        .await
        .unwrap();
    let body = r.json();
    if idmapped_workspaces() {
        assert_eq!((r.status, body["code"].as_str()), (400, Some("workspace_not_writable")), "{body}");
        let error = body["error"].as_str().unwrap();
        assert!(error.contains("set-user-ID") && error.contains("tool"), "{error}");
    } else {
        assert_eq!((r.status, body["stdout"].as_str()), (200, Some("ran\n")), "{body}");
    }
}

/// A read-only root that lies inside the writable one is reached through the writable
/// root's bind too: it is never idmapped, so a directory the sandbox user could not write
/// before stays so (review of issue #30).
#[tokio::test]
async fn a_read_only_root_inside_the_writable_one_is_not_idmapped() {
    if !ready("a_read_only_root_inside_the_writable_one_is_not_idmapped") {
        return;
    }
    if !root_only("a_read_only_root_inside_the_writable_one_is_not_idmapped", "chown") {
        return;
    }
    let server = Server::start();
    let ws = caller_workspace(&server, "ro-inside");
    runner_tests::hand_to_sandbox(&ws);
    let sub = ws.join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut body = shell_request(
        "main",
        "s",
        &ws,
        "echo x > /workspace/sub/f 2>/dev/null && echo sub-written || echo sub-refused; \
         echo y > /parent_workspace/g 2>/dev/null && echo parent-written || echo parent-refused",
    );
    body["readOnlyWorkspaceRoot"] = json!(sub);
    let r = server.client().post_signed("/execute-shell", &body).await.unwrap();
    let body = r.json();
    assert_eq!((r.status, body["stdout"].as_str()), (200, Some("sub-refused\nparent-refused\n")), "{body}");
    assert!(!sub.join("f").exists() && !sub.join("g").exists());
}

/// The mounts sandbox-init stages in its own namespace, as bwrap's monitor (which stays there
/// for the run) shows them: the workspace idmapped and writable, a read-only parent idmapped
/// and read-only, both `nosuid` — so the staged parent is never a writable path, even there.
#[tokio::test]
async fn the_staged_mounts_are_idmapped_and_a_read_only_parent_stays_read_only() {
    let test = "the_staged_mounts_are_idmapped_and_a_read_only_parent_stays_read_only";
    if !ready(test) || !root_only(test, "reads another user's /proc/PID/mountinfo") {
        return;
    }
    let server = Server::start();
    let ws = caller_workspace(&server, "staged-ws");
    let parent = caller_workspace(&server, "staged-parent");
    let (ws_real, parent_real) = (ws.canonicalize().unwrap(), parent.canonicalize().unwrap());
    let mut body = shell_request("main", "s", &ws, "sleep 4; echo done");
    body["readOnlyWorkspaceRoot"] = json!(parent);
    let client = server.client();
    let run = tokio::spawn(async move { client.post_signed("/execute-shell", &body).await.unwrap() });
    // Mount options of the staged mounts over `ws` and `parent`, from a bwrap monitor's view.
    let staged = |dir: &Path| -> Option<String> {
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let proc_dir = entry.path();
            if std::fs::read_to_string(proc_dir.join("comm")).is_ok_and(|c| c.trim() == "bwrap")
                && let Ok(info) = std::fs::read_to_string(proc_dir.join("mountinfo"))
                && let Some(line) = info.lines().find(|l| l.split(' ').nth(4) == dir.to_str())
            {
                return line.split(' ').nth(5).map(str::to_owned);
            }
        }
        None
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (ws_opts, parent_opts) = loop {
        if let (Some(w), Some(p)) = (staged(&ws_real), staged(&parent_real)) {
            break (w, p);
        }
        assert!(Instant::now() < deadline, "no bwrap monitor showed the staged mounts");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let opts = |o: &str| o.split(',').map(str::to_owned).collect::<Vec<_>>();
    let (w, p) = (opts(&ws_opts), opts(&parent_opts));
    for (name, o, access) in [("workspace", &w, "rw"), ("read-only parent", &p, "ro")] {
        for want in [access, "nosuid", "nodev", "idmapped"] {
            assert!(o.iter().any(|x| x == want), "{name}: {want} missing in {o:?}");
        }
    }
    let reply = run.await.unwrap();
    assert_eq!((reply.status, reply.json()["stdout"].as_str()), (200, Some("done\n")), "{}", reply.json());
}
