//! The microvm isolation backend (issue #36) through the real runnerd: commands in a QEMU
//! microvm guest with its own kernel, no NIC, the workspace shared over 9p. Each VM boots in
//! ~2–4 s under TCG, so the checks are packed into few executions.
//!
//! Needs QEMU (`qemu-system-x86`) and the guest from `scripts/build-microvm-guest` (found in
//! `$MICROVM_GUEST_DIR`, else `microvm/` beside the binaries' `debug/`): in CI a missing one
//! fails the test, elsewhere it is skipped loudly. The refusals need neither.

use std::path::PathBuf;
use std::time::Duration;

use runner_tests::server::{Server, ServerOptions, shell_request};
use runner_tests::{in_ci, sandbox_or_skip};
use serde_json::json;

const QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// The prepared guest's directory (vmlinux, initramfs.cpio.gz, kernel-release): beside the
/// binaries' profile directory, as `scripts/build-microvm-guest` leaves it.
fn guest_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MICROVM_GUEST_DIR") {
        return d.into();
    }
    runner_tests::bin_dir().parent().map_or_else(|| PathBuf::from("target"), PathBuf::from).join("microvm")
}

/// Whether a VM can run here; fails in CI, skips loudly elsewhere.
pub(crate) fn microvm_or_skip(test: &str) -> bool {
    if !sandbox_or_skip(test) {
        return false;
    }
    let dir = guest_dir();
    let missing = if !std::path::Path::new(QEMU).exists() {
        Some(format!("{QEMU} is missing (apt-get install qemu-system-x86)"))
    } else if !dir.join("vmlinux").exists() || !dir.join("initramfs.cpio.gz").exists() {
        Some(format!("no guest in {} (run scripts/build-microvm-guest)", dir.display()))
    } else {
        None
    };
    match missing {
        None => true,
        Some(why) if in_ci() => panic!("{test}: {why}"),
        Some(why) => {
            eprintln!("\n!!! SKIPPING {test}: {why} !!!\n");
            false
        }
    }
}

/// A server whose VMs boot from the prepared guest. Its pool is off unless `extra` turns it
/// on: each VM booted ahead and never used costs seconds of TCG on CI's two cores, and the
/// checks of single runs (no QEMU left after the answer) would see the next one booting.
pub(crate) fn start(extra: &[(&str, &str)]) -> Server {
    let dir = guest_dir();
    let mut env = vec![
        ("SCIENCE_AGENT_MICROVM_KERNEL".to_owned(), dir.join("vmlinux").display().to_string()),
        ("SCIENCE_AGENT_MICROVM_INITRAMFS".to_owned(), dir.join("initramfs.cpio.gz").display().to_string()),
        ("SCIENCE_AGENT_MICROVM_POOL".to_owned(), "0".to_owned()),
    ];
    env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    Server::start_with(ServerOptions { env, ..ServerOptions::default() })
}

async fn run(
    server: &Server,
    ws: &std::path::Path,
    code: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut body = shell_request("main", "session-microvm", ws, code);
    body["isolation"] = json!("microvm");
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
    let r = reply.json();
    assert_eq!(reply.status, 200, "{r}\nrunnerd: {}", server.stderr());
    r
}

/// The QEMU processes this server started (descendants of its runnerd; the command line
/// names bwrap too for the sandbox's own bwrap processes, which are skipped).
fn qemu_of(server: &Server) -> Vec<(u32, String)> {
    let runnerd = server.pid().unwrap();
    let parent = parent_of;
    let ours = |mut pid: u32| {
        while let Some(p) = parent(pid).filter(|p| *p > 1) {
            if p == runnerd {
                return true;
            }
            pid = p;
        }
        false
    };
    // An orphan (its sandbox gone, re-parented to PID 1) is the leak to catch, whoever
    // started it: no test leaves a QEMU without its bwrap.
    runner_tests::processes_matching("qemu-system")
        .into_iter()
        .filter(|(pid, _)| ours(*pid) || parent(*pid) == Some(1))
        .collect()
}

/// A process's parent (`/proc/PID/stat`'s fourth field), if it still runs.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// No QEMU process started by this server is left (R-RUN-4 on the host: the VMM is gone).
fn no_qemu_left(server: &Server) {
    let left = qemu_of(server);
    assert!(left.is_empty(), "QEMU left behind: {left:?}");
}

/// What the kernel says of a process: `/proc/<pid>/status`'s `name:` value.
fn status_field(pid: u32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).unwrap_or("").trim().to_owned()
}

#[tokio::test]
async fn a_command_runs_in_its_own_kernel_without_a_nic_and_writes_the_workspace() {
    if !microvm_or_skip("a_command_runs_in_its_own_kernel_without_a_nic_and_writes_the_workspace") {
        return;
    }
    let server = start(&[]);
    let ws = server.project_workspace("vm");
    let script = r#"
echo "kernel $(uname -r)"
echo "to stderr" >&2
echo "ifaces $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ,)"
echo "id $(id -u)"
echo written > out.txt
if touch /usr/should-fail 2>/dev/null; then echo "usr writable"; else echo "usr read-only"; fi
echo "usr mount $(grep ' /usr ' /proc/mounts | cut -d' ' -f4 | cut -d, -f1)"
python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); socket.create_connection(s.getsockname()); print('loopback up')"
sleep 30 &
exit 3
"#;
    let r = run(&server, &ws, script, json!({})).await;
    let release = std::fs::read_to_string(guest_dir().join("kernel-release")).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let stdout = r["stdout"].as_str().unwrap();
    assert_eq!(r["exitCode"], 3, "{r}");
    assert_eq!(r["sandbox"], "microvm", "{r}");
    assert!(stdout.contains(&format!("kernel {}", release.trim())), "{r}");
    assert_ne!(release.trim(), host.trim());
    assert!(stdout.contains("ifaces lo,\n"), "only loopback: {r}");
    assert!(stdout.contains("usr read-only"), "{r}");
    // Mounted read-only, not only unwritable by a non-root uid.
    assert!(stdout.contains("usr mount ro\n"), "{r}");
    assert!(stdout.contains("loopback up"), "lo is up, as in bwrap's namespace: {r}");
    assert!(!stdout.contains("id 0\n"), "the command must not run as root in the guest: {r}");
    assert_eq!(r["stderr"], "to stderr\n", "{r}");
    assert_eq!(std::fs::read_to_string(ws.join("out.txt")).unwrap(), "written\n");
    let created: Vec<&str> =
        r["createdFiles"].as_array().unwrap().iter().filter_map(|f| f.as_str()).collect();
    assert!(created.iter().any(|f| f.ends_with("out.txt")), "{r}");
    // The background `sleep` did not keep the VM: the answer came, and no QEMU is left.
    no_qemu_left(&server);

    // A signal, reported as bwrap reports it (128+N).
    let r = run(&server, &ws, "kill -TERM $$", json!({})).await;
    assert_eq!(r["exitCode"], 128 + libc::SIGTERM, "{r}");

    // /execute: Python, the same interpreter as the bwrap form, in the guest, with the
    // operator's python-packages shared read-only where the bwrap form binds them.
    let packages = server.data_dir.join("python-packages").join("py3");
    std::fs::create_dir_all(&packages).unwrap();
    std::fs::write(packages.join("tinymod.py"), "WHERE = 'py3'\n").unwrap();
    let code = r#"
import os, sys, tinymod
print(6 * 7, sys.executable, os.getcwd())
print(tinymod.WHERE, os.environ.get("PYTHONPATH"), sys.flags.isolated)
try:
    open(os.path.join(os.path.dirname(tinymod.__file__), "planted.py"), "w")
    print("write allowed")
except OSError:
    print("write refused")
"#;
    let mut body = shell_request("main", "session-microvm", &ws, code);
    body["isolation"] = json!("microvm");
    let reply = server.client().post_signed("/execute", &body).await.unwrap();
    let r = reply.json();
    assert_eq!((reply.status, r["exitCode"].clone()), (200, json!(0)), "{r}");
    assert_eq!(
        r["stdout"],
        "42 /usr/bin/python3 /workspace\npy3 /opt/sciencediscovery-python-packages 0\nwrite refused\n",
        "{r}"
    );
    assert!(!packages.join("planted.py").exists());
}

#[tokio::test]
async fn a_timeout_kills_the_vm_and_keeps_the_workspace() {
    if !microvm_or_skip("a_timeout_kills_the_vm_and_keeps_the_workspace") {
        return;
    }
    let server = start(&[]);
    let ws = server.project_workspace("timeout");
    let mut body = shell_request("main", "session-microvm", &ws, "echo before > before.txt; sleep 300");
    body["isolation"] = json!("microvm");
    body["executionTimeoutMs"] = json!(15_000);
    let started = std::time::Instant::now();
    let client = server.client();
    let request =
        tokio::spawn(async move { client.post_signed("/execute-shell", &body).await.unwrap().json() });

    // Meanwhile: QEMU is confined. The VMM itself (not bwrap) runs as the unprivileged
    // sandbox user, under a seccomp filter (ours, then QEMU's -sandbox), with no new
    // privileges, and its root holds nothing of the host but /usr, the guest and its shares.
    let vmm = loop {
        let found: Vec<_> =
            qemu_of(&server).into_iter().filter(|(_, c)| c.starts_with("/usr/bin/qemu")).collect();
        if let Some((pid, _)) = found.first() {
            break *pid;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no QEMU started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let uid = status_field(vmm, "Uid");
    assert!(!uid.starts_with("0\t") && !uid.is_empty(), "QEMU runs as uid {uid:?}");
    assert_eq!(uid.split_whitespace().next().unwrap(), runner_tests::sandbox_user().uid.to_string());
    assert_eq!(status_field(vmm, "Seccomp"), "2", "QEMU runs under a seccomp filter");
    assert_eq!(status_field(vmm, "NoNewPrivs"), "1");
    assert_eq!(status_field(vmm, "CapEff"), "0000000000000000", "no capabilities in its namespace");
    if runner_tests::is_root() {
        // Its view of the filesystem (a non-root test cannot look into its namespace).
        let root = format!("/proc/{vmm}/root");
        let mut top: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        top.sort();
        assert_eq!(top, ["bin", "dev", "etc", "lib", "lib64", "proc", "tmp", "usr", "vm"], "QEMU's root");
        let mut etc: Vec<String> = std::fs::read_dir(format!("{root}/etc"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        etc.sort();
        assert_eq!(etc, ["group", "passwd"], "no host /etc in QEMU's root");
        let mut vm: Vec<String> = std::fs::read_dir(format!("{root}/vm/share"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        vm.sort();
        assert_eq!(vm, ["ws"], "only the workspace is shared");
    }

    let r = request.await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(40), "{r}");
    assert!(r.to_string().contains("timed out"), "{r}");
    assert_eq!(std::fs::read_to_string(ws.join("before.txt")).unwrap(), "before\n");
    no_qemu_left(&server);
}

#[tokio::test]
async fn a_memory_hog_is_oom_killed_inside_and_explained() {
    if !microvm_or_skip("a_memory_hog_is_oom_killed_inside_and_explained") {
        return;
    }
    let server = start(&[]);
    let ws = server.project_workspace("oom");
    // Touched memory, 16 MiB at a time: a VM of 256 MiB runs out and its kernel OOM-kills.
    let code = "echo start; python3 -c 'l = []\nwhile True: l.append(b\"x\" * (16 << 20))'";
    let r = run(&server, &ws, code, json!({"resourceLimits": {"memoryBytes": 256 << 20}})).await;
    assert_eq!(r["exitCode"], 128 + libc::SIGKILL, "bash -e ends with python's SIGKILL: {r}");
    assert!(r["stdout"].as_str().unwrap().starts_with("start"), "{r}");
    // The shell's child died of the OOM killer; bash then exited 1 (-e): the guest counted it.
    assert_eq!(r["oomKilled"], true, "{r}");
}

#[tokio::test]
async fn unavailable_or_unknown_backends_are_refused_with_400_and_health_says_why() {
    // No QEMU run needed: the guest named here does not exist.
    let server = start(&[("SCIENCE_AGENT_MICROVM_KERNEL", "/nonexistent/vmlinux")]);
    let ws = server.project_workspace("refused");
    for (isolation, want) in [
        (json!("microvm"), "scripts/build-microvm-guest"),
        (json!("firecracker"), "isolation must be bwrap or microvm"),
        (json!(7), "must be a string"),
    ] {
        let mut body = shell_request("main", "session-microvm", &ws, "echo ran > ran.txt");
        body["isolation"] = isolation;
        let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
        let e = reply.json();
        assert_eq!(reply.status, 400, "{e}");
        assert_eq!(e["code"], "invalid_isolation", "{e}");
        assert!(e["error"].as_str().unwrap().contains(want), "{e}");
        assert!(!ws.join("ran.txt").exists(), "nothing may run");
    }
    let health = server.client().get("/health").await.unwrap().json();
    let vm = &health["isolation"]["backends"]["microvm"];
    assert_eq!(vm["available"], false, "{health}");
    assert!(vm["reason"].as_str().unwrap().contains("/nonexistent/vmlinux"), "{health}");
    assert_eq!(health["isolation"]["default"], "bwrap", "{health}");
}

/// The default accelerator setting, `auto`: KVM only when the sandbox user can open
/// `/dev/kvm` and a guest boots under it at start-up, else TCG — and `/health` says which and
/// why.
#[tokio::test]
async fn auto_picks_kvm_only_where_a_guest_boots_under_it_and_says_why() {
    if !microvm_or_skip("auto_picks_kvm_only_where_a_guest_boots_under_it_and_says_why") {
        return;
    }
    let server = start(&[]);
    // Where KVM may work, its start-up boot runs in the background: its end is waited for.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let health = loop {
        let health = server.client().get("/health").await.unwrap().json();
        let trying = health["isolation"]["backends"]["microvm"]["accelReason"]
            .as_str()
            .is_some_and(|r| r.contains("to try it"));
        if !trying || std::time::Instant::now() > deadline {
            break health;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let vm = &health["isolation"]["backends"]["microvm"];
    assert_eq!(
        (vm["available"].clone(), vm["accelSetting"].clone()),
        (json!(true), json!("auto")),
        "{health}"
    );
    let reason = vm["accelReason"].as_str().unwrap();
    match vm["accel"].as_str().unwrap() {
        "kvm" => assert!(reason.starts_with("KVM: a guest booted"), "{health}"),
        "tcg" => assert!(reason.starts_with("TCG: ") && reason.contains("/dev/kvm"), "{health}"),
        other => panic!("accel {other}: {health}"),
    }
    // Where the sandbox user cannot open /dev/kvm (this project's machines: 0600 root, or
    // no device), TCG without a boot at start-up.
    use std::os::unix::fs::MetadataExt;
    let user = runner_tests::sandbox_user();
    let openable = std::fs::metadata("/dev/kvm").is_ok_and(|m| {
        let mode = m.mode();
        mode & 0o6 == 0o6
            || (m.uid() == user.uid && mode & 0o600 == 0o600)
            || (m.gid() == user.gid && mode & 0o60 == 0o60)
    });
    if !openable {
        assert_eq!(vm["accel"], "tcg", "{health}");
        assert!(
            reason.contains("cannot be opened read-write by the sandbox user")
                || reason.contains("No such file"),
            "{health}"
        );
    }
    let ws = server.project_workspace("auto");
    let r = run(&server, &ws, "echo on-$(uname -r)", json!({})).await;
    assert_eq!(r["exitCode"], 0, "{r}");
}

#[tokio::test]
async fn chips_are_refused_under_microvm_before_anything_runs() {
    // A backend whose files all check out (QEMU is never started: the refusal comes first).
    let server = start(&[
        ("SCIENCE_AGENT_MICROVM_QEMU", "/usr/bin/true"),
        ("SCIENCE_AGENT_MICROVM_KERNEL", "/etc/hostname"),
        ("SCIENCE_AGENT_MICROVM_INITRAMFS", "/etc/hostname"),
    ]);
    let ws = server.project_workspace("chips");
    let mut body = shell_request("main", "session-microvm", &ws, "echo ran > ran.txt");
    body["isolation"] = json!("microvm");
    body["npuDevices"] = json!([0]);
    let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
    let e = reply.json();
    assert_eq!((reply.status, e["code"].as_str()), (400, Some("invalid_isolation")), "{e}");
    assert!(e["error"].as_str().unwrap().contains("cannot be passed into a microvm"), "{e}");
    assert!(!ws.join("ran.txt").exists(), "nothing may run");
    let health = server.client().get("/health").await.unwrap().json();
    assert_eq!(health["isolation"]["backends"]["microvm"]["available"], true, "{health}");
    assert_eq!(health["isolation"]["backends"]["microvm"]["accel"], "tcg", "{health}");
    let network = health["isolation"]["backends"]["microvm"]["enforces"]["network"].as_str().unwrap();
    assert!(network.contains("egressd"), "{health}");
}

#[tokio::test]
async fn domain_allowlist_reaches_egressd_through_the_guest_bridge_and_nothing_else_does() {
    if !microvm_or_skip("domain_allowlist_reaches_egressd_through_the_guest_bridge_and_nothing_else_does") {
        return;
    }
    use runner_tests::egress::{Egressd, FakeDns, Upstream, with_network};
    // Both names resolve (at egressd's resolver) to the host's loopback, where the upstream
    // listens; only mirror.test is allowlisted.
    let dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    let egressd = Egressd::start(dns.addr, &[]);
    let env = egressd.runner_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let server = start(&env);
    let ws = server.project_workspace("egress");
    let port = upstream.port;
    // One VM for every check (a boot costs seconds under TCG).
    let script = format!(
        r#"
echo "env=$HTTP_PROXY|$HTTPS_PROXY|$http_proxy|$https_proxy|${{NO_PROXY:-}}"
echo "plain=$(curl -sS --max-time 60 http://mirror.test:{port}/hello)"
echo "tunnel=$(curl -sS --max-time 60 --proxytunnel http://mirror.test:{port}/through)"
echo "blocked=$(curl -s --max-time 60 -o /dev/null -w '%{{http_code}}' http://blocked.test:{port}/)"
python3 - <<'PY'
import socket, urllib.request
print("py=" + urllib.request.urlopen("http://mirror.test:{port}/py", timeout=60).read().decode())
try:
    print("dns=" + repr(socket.getaddrinfo("mirror.test", 80)))
except OSError as e:
    print("dns=failed " + type(e).__name__)
PY
echo "direct=$(curl -s --noproxy '*' -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:{port}/ ; echo " rc=$?")"
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ,)"
echo "ports=$(ls /dev/ | grep -c '^vport')"
"#
    );
    let mut body = with_network(
        shell_request("main", "session-microvm", &ws, &script),
        &["mirror.test"],
        true,
        "rev-vm",
    );
    body["isolation"] = json!("microvm");
    body["executionTimeoutMs"] = json!(240_000);
    let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
    let r = reply.json();
    assert_eq!(reply.status, 200, "{r}\nrunnerd: {}", server.stderr());
    let out = r["stdout"].as_str().unwrap();
    let line = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {r}\negressd: {}", egressd.log()))
            .to_owned()
    };
    // The bwrap form's proxy variables, pointing at the guest's own bridge.
    assert_eq!(
        line("env"),
        "http://127.0.0.1:18118|http://127.0.0.1:18118|http://127.0.0.1:18118|http://127.0.0.1:18118|",
        "{r}"
    );
    assert_eq!(line("plain"), "ok /hello", "{r}\negressd: {}", egressd.log());
    assert_eq!(line("tunnel"), "ok /through", "{r}");
    assert_eq!(line("py"), "ok /py", "{r}");
    // egressd's allowlist, not the VM, refuses the other name.
    assert_eq!(line("blocked"), "403", "{r}");
    // No resolver answers inside the guest, and nothing is reached but through the proxy.
    assert!(line("dns").starts_with("failed "), "{r}");
    assert_eq!(line("direct"), "000 rc=7", "{r}");
    assert_eq!(line("ifaces"), "lo,", "still no NIC: {r}");
    assert_eq!(line("ports"), "2", "the agent's port and the egress port: {r}");
    assert_eq!(r["exitCode"], 0, "{r}");
    assert_eq!(r["sandbox"], "microvm", "{r}");
    assert_eq!(
        (&r["networkPolicy"], &r["networkAccessRevision"]),
        (&json!("domain-allowlist"), &json!("rev-vm")),
        "{r}"
    );
    let seen = upstream.requests.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "only the allowed requests reached the upstream: {seen:?}");
    let log = egressd.log();
    for needle in ["decision=\"allowed\"", "decision=\"denied\"", "revision=rev-vm"] {
        assert!(log.contains(needle), "{needle} missing from egressd's log:\n{log}");
    }
    no_qemu_left(&server);

    // Policy none: no egress port in the guest, no proxy variables.
    let script = r#"echo "env=${HTTP_PROXY:-unset}"; echo "ports=$(ls /dev/ | grep -c '^vport')""#;
    let r = run(&server, &ws, script, json!({})).await;
    assert_eq!(r["stdout"], "env=unset\nports=1\n", "{r}");
    no_qemu_left(&server);
}

/// An initramfs whose `/init` is hostile: busybox loads the real guest's modules, then writes
/// `payload` raw to the agent's port and keeps the VM alive. In `dir`, readable by anyone.
fn hostile_initramfs(dir: &std::path::Path, name: &str, payload: &[u8]) -> PathBuf {
    use std::process::Command;
    let root = dir.join(format!("{name}-root"));
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let unpack = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "gzip -dc '{}' | (cd '{}' && cpio -idm --quiet)",
            guest_dir().join("initramfs.cpio.gz").display(),
            root.display()
        ))
        .status()
        .unwrap();
    assert!(unpack.success(), "unpack the guest's initramfs");
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("busybox-static is installed");
    std::fs::write(root.join("payload"), payload).unwrap();
    let init = r#"#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc; $B mount -t sysfs sys /sys; $B mount -t devtmpfs dev /dev
for m in $($B cat /lib/modules/load.list); do $B insmod /lib/modules/$m.ko; done
for p in /sys/class/virtio-ports/*; do
  [ "$($B cat $p/name)" = org.sciencediscovery.agent ] && port=/dev/${p##*/}
done
$B cat /payload > $port
$B sleep 1000
"#;
    std::fs::write(root.join("init"), init).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("init"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.join(format!("{name}.cpio.gz"));
    let pack = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd '{}' && find . | cpio -o -H newc --quiet -R 0:0 | gzip -1 > '{}'",
            root.display(),
            out.display()
        ))
        .status()
        .unwrap();
    assert!(pack.success(), "pack the hostile initramfs");
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
    out
}

/// A frame as the wire has it: `u32` LE length + body.
fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

#[tokio::test]
async fn hostile_guest_messages_are_refused_and_runnerd_carries_on() {
    if !microvm_or_skip("hostile_guest_messages_are_refused_and_runnerd_carries_on") {
        return;
    }
    if !std::path::Path::new("/bin/busybox").exists() {
        assert!(!in_ci(), "busybox-static is missing");
        eprintln!(
            "\n!!! SKIPPING hostile_guest_messages_are_refused_and_runnerd_carries_on: no /bin/busybox !!!\n"
        );
        return;
    }
    let scratch = runner_tests::scratch_dir();
    // Ready (variant 0, the protocol's version: one postcard byte while it is under 128), then:
    let protocol = u8::try_from(runner_guest_agent::wire::PROTOCOL).ok().filter(|p| *p < 128).unwrap();
    let ready = frame(&[0, protocol]);
    let oversized = [ready.clone(), u32::MAX.to_le_bytes().to_vec()].concat();
    // Exit (variant 3) with both a code (Some 0) and a signal (Some 9): not an exit record.
    let bad_exit = [ready.clone(), frame(&[3, 1, 0, 1, 18, 0])].concat();
    // Output before Ready, then a flood of it.
    let early: Vec<u8> = (0..2000).flat_map(|_| frame(&[1, 3, b'x', b'y', b'z'])).collect();
    for (name, payload, want) in [
        ("oversized", oversized, "announced 4294967295 bytes"),
        ("bad-exit", bad_exit, "neither one exit code nor one signal"),
        ("early", early, "before ready"),
    ] {
        let initramfs = hostile_initramfs(scratch.path(), name, &payload);
        let server = start(&[("SCIENCE_AGENT_MICROVM_INITRAMFS", initramfs.to_str().unwrap())]);
        let ws = server.project_workspace("hostile");
        let mut body = shell_request("main", "session-microvm", &ws, "echo ran > ran.txt");
        body["isolation"] = json!("microvm");
        body["executionTimeoutMs"] = json!(60_000);
        let started = std::time::Instant::now();
        let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
        let e = reply.json();
        // Refused as soon as the frame arrives, not at the timeout; the VM is ended.
        assert!(started.elapsed() < Duration::from_secs(30), "{name}: {e}");
        assert_eq!(e["code"], "sandbox_launch_failed", "{name} ({}): {e}", reply.status);
        assert!(e.to_string().contains("broke the protocol") && e.to_string().contains(want), "{name}: {e}");
        assert!(!ws.join("ran.txt").exists());
        no_qemu_left(&server);
        // runnerd carries on: health answers and a bwrap execution runs.
        assert_eq!(server.client().get("/health").await.unwrap().status, 200);
        let plain = shell_request("main", "session-microvm", &ws, "echo fine");
        let r = server.client().post_signed("/execute-shell", &plain).await.unwrap().json();
        assert_eq!(r["stdout"], "fine\n", "{name}: {r}");
    }
}

/// `SCIENCE_AGENT_MICROVM_ACCEL=kvm` is believed only after a guest booted under KVM at
/// start-up, as the sandbox user: on this project's hosts (PVM, or `/dev/kvm` only root's) the
/// backend is unavailable with the reason; on a host with working KVM it runs.
#[tokio::test]
async fn kvm_is_used_only_when_a_guest_boots_under_it() {
    if !microvm_or_skip("kvm_is_used_only_when_a_guest_boots_under_it") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_MICROVM_ACCEL", "kvm")]);
    let health = server.client().get("/health").await.unwrap().json();
    let vm = &health["isolation"]["backends"]["microvm"];
    assert_eq!(vm["accel"], "kvm", "{health}");
    if vm["available"] == true {
        let ws = server.project_workspace("kvm");
        let r = run(&server, &ws, "echo on-kvm", json!({})).await;
        assert_eq!(r["stdout"], "on-kvm\n", "{r}");
    } else {
        let reason = vm["reason"].as_str().unwrap();
        assert!(reason.starts_with("SCIENCE_AGENT_MICROVM_ACCEL=kvm"), "{health}");
        eprintln!("KVM unusable here, as /health says: {reason}");
        let ws = server.project_workspace("kvm");
        let mut body = shell_request("main", "session-microvm", &ws, "true");
        body["isolation"] = json!("microvm");
        let reply = server.client().post_signed("/execute-shell", &body).await.unwrap();
        assert_eq!(reply.status, 400, "{}", reply.json());
    }
    no_qemu_left(&server);
}

/// A managed run in a VM is cancelled like any other: the VMM is killed, the record says
/// `cancelled`, and what the run wrote before stays.
#[tokio::test]
async fn a_managed_run_in_a_vm_is_cancelled() {
    if !microvm_or_skip("a_managed_run_in_a_vm_is_cancelled") {
        return;
    }
    let server = start(&[]);
    let client = server.client();
    let ws = server.project_workspace("cancel");
    let mut body = shell_request("main", "session-microvm", &ws, "echo started > started.txt; sleep 300");
    body["isolation"] = json!("microvm");
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let id = reply.json()["id"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    // Its content, not only the name: the guest creates the file before it writes to it.
    while std::fs::read_to_string(ws.join("started.txt")).ok().as_deref() != Some("started\n") {
        assert!(std::time::Instant::now() < deadline, "the VM never started the command");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cancel = client
        .raw(
            "POST",
            &format!("/shell-executions/{id}/cancel?sessionId=session-microvm&agentId=main"),
            &[("authorization", format!("Bearer {}", client.token()))],
            Vec::new(),
        )
        .await
        .unwrap();
    assert_eq!(cancel.status, 202, "{}", String::from_utf8_lossy(&cancel.body));
    let record = runner_tests::server::finished_record(&client, &id, "session-microvm", "main").await;
    assert_eq!(record["state"], "cancelled", "{record}");
    assert_eq!(std::fs::read_to_string(ws.join("started.txt")).unwrap(), "started\n");
    no_qemu_left(&server);
}

/// The microvm pool's block of `/health`.
async fn vm_pool(server: &Server) -> serde_json::Value {
    let health = server.client().get("/health").await.unwrap().json();
    health["isolation"]["backends"]["microvm"]["pool"].clone()
}

/// Waits until `ready` holds of the pool (a liveness bound only: a TCG boot on a loaded
/// host takes up to ~12 s).
async fn vm_pool_until(
    server: &Server,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let p = vm_pool(server).await;
        if ready(&p) {
            return p;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {p}\nrunnerd: {}", server.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_vm_booted_ahead_serves_one_call_of_its_shape_and_nothing_carries_over() {
    if !microvm_or_skip("a_vm_booted_ahead_serves_one_call_of_its_shape_and_nothing_carries_over") {
        return;
    }
    let mut server = start(&[("SCIENCE_AGENT_MICROVM_POOL", "2")]);
    let p = vm_pool(&server).await;
    assert_eq!(
        (p["enabled"].clone(), p["perNode"].clone(), p["waiting"].clone()),
        (json!(true), json!(2), json!(0)),
        "{p}"
    );
    let ws = server.project_workspace("vm-pool");
    std::fs::create_dir(ws.join("sub")).unwrap();
    // The first call boots its own VM, and leaves what must not carry over.
    let first = "echo left > /tmp/left; echo one > one.txt; setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo booted";
    let r = run(&server, &ws, first, json!({})).await;
    assert_eq!((r["exitCode"].clone(), r["stdout"].clone()), (json!(0), json!("booted\n")), "{r}");
    let p = vm_pool_until(&server, "a VM boots for the workspace's next call", |p| p["waiting"] == json!(1))
        .await;
    assert_eq!(p["hits"], 0, "{p}");
    assert!(p["memoryBytes"].as_u64().unwrap() > 16 << 20, "a booted VM's memory is stated: {p}");
    let vms = qemu_of(&server);
    assert_eq!(vms.iter().filter(|(_, c)| c.starts_with("/usr/bin/qemu")).count(), 1, "{vms:?}");

    // The host changes the workspace in between: the booted VM sees it as it is now. The
    // call has another cwd and language than the one the VM was booted after: a booted
    // guest takes any command of its shape (shares, size).
    std::fs::write(ws.join("host.txt"), "from the host\n").unwrap();
    std::fs::remove_file(ws.join("one.txt")).unwrap();
    let second = r#"
test -e /tmp/left && echo "tmp carried over"
pgrep -x sleep >/dev/null && echo "process carried over"
cat ../host.txt
test -e ../one.txt && echo "deleted file seen"
echo two > two.txt
pwd
"#;
    let r = run(&server, &ws, second, json!({"cwd": "sub"})).await;
    assert_eq!(r["exitCode"], 0, "{r}");
    assert_eq!(r["stdout"], "from the host\n/workspace/sub\n", "{r}");
    let created: Vec<&str> =
        r["createdFiles"].as_array().unwrap().iter().filter_map(|f| f.as_str()).collect();
    assert_eq!(created, ["sub/two.txt"], "the receipt is the call's own: {r}");
    let p = vm_pool_until(&server, "the next VM boots", |p| p["waiting"] == json!(1)).await;
    assert_eq!(p["hits"], 1, "the second call was served by the booted VM: {p}");
    assert_eq!(p["started"], 2, "{p}");
    // /metrics says the same, in series of its own beside bwrap's pool.
    let scrape = server.client().get("/metrics").await.unwrap();
    let text = String::from_utf8_lossy(&scrape.body);
    for line in
        ["runner_microvm_pool_hits 1", "runner_microvm_pool_waiting 1", "runner_microvm_pool_started 2"]
    {
        assert!(text.lines().any(|l| l == line), "{line:?} missing from\n{text}");
    }

    // A deadline runs from the hand-over, and a VM served ahead that times out is killed.
    let mut body = shell_request("main", "session-microvm", &ws, "echo start > started.txt; sleep 300");
    body["isolation"] = json!("microvm");
    body["executionTimeoutMs"] = json!(3000);
    let r = server.client().post_signed("/execute-shell", &body).await.unwrap().json();
    assert_eq!(r["code"], "execution_timeout", "{r}");
    assert_eq!(std::fs::read_to_string(ws.join("started.txt")).unwrap(), "start\n");
    let p = vm_pool(&server).await;
    assert_eq!(p["hits"], 2, "{p}");

    // Another shape (the guest's size): the waiting VM is discarded, the call boots its own.
    let p = vm_pool_until(&server, "the next VM boots", |p| p["waiting"] == json!(1)).await;
    let shape_changed = p["discards"]["shape_changed"].as_u64().unwrap();
    let r = run(&server, &ws, "echo big", json!({"resourceLimits": {"memoryBytes": 384u64 << 20}})).await;
    assert_eq!(r["stdout"], "big\n", "{r}");
    let p = vm_pool(&server).await;
    assert_eq!(
        (p["hits"].clone(), p["discards"]["shape_changed"].as_u64().unwrap()),
        (json!(2), shape_changed + 1),
        "{p}"
    );

    // A call of the same workspace in bwrap: the VM booted for the next microvm call goes
    // (it would only hold the tenant's place), and so does one still booting.
    let p = vm_pool_until(&server, "the next VM boots", |p| p["waiting"] == json!(1)).await;
    let mut body = shell_request("main", "session-microvm", &ws, "echo in-bwrap");
    body["isolation"] = json!("bwrap");
    let r = server.client().post_signed("/execute-shell", &body).await.unwrap().json();
    assert_eq!(r["stdout"], "in-bwrap\n", "{r}");
    let q = vm_pool(&server).await;
    assert_eq!(
        (q["waiting"].clone(), q["discards"]["shape_changed"].as_u64().unwrap()),
        (json!(0), p["discards"]["shape_changed"].as_u64().unwrap() + 1),
        "{q}"
    );

    // runnerd stops: the waiting VM and its QEMU end with it.
    run(&server, &ws, "true", json!({})).await;
    vm_pool_until(&server, "the next VM boots", |p| p["waiting"] == json!(1)).await;
    assert!(server.stop().success());
    let orphans: Vec<_> = runner_tests::processes_matching("qemu-system")
        .into_iter()
        .filter(|(pid, _)| parent_of(*pid) == Some(1))
        .collect();
    assert!(orphans.is_empty(), "QEMU left after a stop: {orphans:?}");
}

#[tokio::test]
async fn clearing_a_workspace_discards_its_booted_vm() {
    if !microvm_or_skip("clearing_a_workspace_discards_its_booted_vm") {
        return;
    }
    let server = start(&[("SCIENCE_AGENT_MICROVM_POOL", "1")]);
    let client = server.client();
    let key = "vm-pool-clear";
    let mut body = runner_tests::server::keyed_shell_request("a", "s", key, "echo x > f");
    body["isolation"] = json!("microvm");
    let reply = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    vm_pool_until(&server, "a VM boots", |p| p["waiting"] == json!(1)).await;
    let cleared = client
        .send_bytes("DELETE", &format!("/remote-workspace?workspace={key}"), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(cleared.status, 200, "{}", String::from_utf8_lossy(&cleared.body));
    let p = vm_pool_until(&server, "cleared", |p| p["waiting"] == json!(0)).await;
    assert_eq!(p["discards"]["workspace_changed"], 1, "{p}");
    // Its QEMU is gone (the discard ends it off the request's path).
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !qemu_of(&server).is_empty() {
        assert!(std::time::Instant::now() < deadline, "QEMU left: {:?}", qemu_of(&server));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Cleared while the next VM boots: the boot ends early, nothing is filed, no QEMU stays.
    let mut body = runner_tests::server::keyed_shell_request("a", "s", key, "echo y > g");
    body["isolation"] = json!("microvm");
    assert_eq!(client.post_signed("/execute-shell", &body).await.unwrap().status, 200);
    let cleared = client
        .send_bytes("DELETE", &format!("/remote-workspace?workspace={key}"), &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(cleared.status, 200, "{}", String::from_utf8_lossy(&cleared.body));
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !qemu_of(&server).is_empty() {
        assert!(std::time::Instant::now() < deadline, "QEMU left: {:?}", qemu_of(&server));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let p = vm_pool(&server).await;
    assert_eq!(p["waiting"], 0, "{p}");
    assert_eq!(p["discards"]["workspace_changed"], 2, "the voided boot counts as discarded: {p}");
    assert_eq!(p["startFailures"], 0, "{p}");
}

/// The other direction of the pool test's "a bwrap call discards the waiting VM": a microvm
/// call in a workspace discards the bwrap sandbox waiting for that workspace's next call
/// (made for a bwrap call, it could not serve the next one and would only hold a place).
#[tokio::test]
async fn a_microvm_call_discards_the_bwrap_sandbox_waiting_for_its_workspace() {
    if !microvm_or_skip("a_microvm_call_discards_the_bwrap_sandbox_waiting_for_its_workspace") {
        return;
    }
    let server = start(&[]);
    let ws = server.project_workspace("both");
    let bwrap_pool = || async {
        let health = server.client().get("/health").await.unwrap().json();
        health["sandboxProfile"]["prestartedSandboxes"].clone()
    };
    let body = shell_request("main", "session-microvm", &ws, "echo in-bwrap");
    let r = server.client().post_signed("/execute-shell", &body).await.unwrap().json();
    assert_eq!(r["stdout"], "in-bwrap\n", "{r}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let before = loop {
        let p = bwrap_pool().await;
        if p["waiting"] == 1 {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "no bwrap sandbox waits: {p}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let r = run(&server, &ws, "echo in-vm", json!({})).await;
    assert_eq!(r["stdout"], "in-vm\n", "{r}");
    let after = bwrap_pool().await;
    assert_eq!(
        (after["waiting"].clone(), after["discards"]["shape_changed"].as_u64().unwrap()),
        (json!(0), before["discards"]["shape_changed"].as_u64().unwrap() + 1),
        "{after}"
    );
    assert_eq!(after["hits"], before["hits"], "{after}");
}
