//! What code inside a baseline sandbox can and cannot do (R-SBX-4, R-SBX-6, R-SBX-7),
//! checked from inside real bwrap sandboxes under the real seccomp program.

use common::seccomp::{self, Arch, Profile};
use runner_tests::{Filter, Fixture, sandbox_or_skip};
use runnerd::launch::Termination;

/// Runs the probe binary once per check in one sandbox; returns `check -> answer`.
async fn probe(f: &Fixture, checks: &[&str]) -> Vec<(String, String)> {
    probe_under(f, checks, None).await
}

/// Like [`probe`], under a specific program instead of the launch's own profile.
async fn probe_under(f: &Fixture, checks: &[&str], filter: Option<Filter>) -> Vec<(String, String)> {
    let exe = f.install_probe();
    let script: String = checks.iter().map(|c| format!("printf '%s ' {c}; {exe} {c}\n")).collect();
    let mut launch =
        f.launch(runnerd::sandbox::Language::Shell, &script, Some(std::time::Duration::from_secs(60)));
    if filter.is_some() {
        launch.filter = filter;
    }
    let (outcome, out) = f.run(launch, 1 << 20).await;
    assert_eq!(outcome.termination, Termination::Exited(0), "stderr: {}", out.stderr);
    out.stdout
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap_or((l, ""));
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn errno_name(answer: &str) -> String {
    match answer.strip_prefix("errno=").and_then(|n| n.parse::<i32>().ok()) {
        Some(libc::EPERM) => "EPERM".into(),
        Some(libc::ENOSYS) => "ENOSYS".into(),
        Some(n) => format!("errno {n}"),
        None => answer.to_owned(),
    }
}

#[tokio::test]
async fn denied_syscalls_answer_as_the_profile_says() {
    if !sandbox_or_skip("denied_syscalls_answer_as_the_profile_says") {
        return;
    }
    let f = Fixture::new().await;
    let mut expected: Vec<(&str, &str)> = vec![
        ("ptrace", "EPERM"),
        ("unshare-user", "EPERM"),
        ("clone-newuser", "EPERM"),
        ("mount", "EPERM"),
        ("socket-inet", "EPERM"),
        ("socket-unix", "EPERM"),
        ("socketpair", "EPERM"),
        ("keyctl", "EPERM"),
        ("bpf", "EPERM"),
        ("perf_event_open", "EPERM"),
        ("userfaultfd", "EPERM"),
        ("io_uring_setup", "EPERM"),
        ("clone3", "ENOSYS"),
        ("tiocsti", "EPERM"),
        ("chroot", "EPERM"),
        ("getpid", "ok"),
    ];
    if cfg!(target_arch = "x86_64") {
        expected.push(("x32-getpid", "EPERM"));
    }
    let checks: Vec<&str> = expected.iter().map(|(c, _)| *c).collect();
    let answers = probe(&f, &checks).await;
    assert_eq!(answers.len(), expected.len(), "{answers:?}");
    for ((check, want), (got_check, got)) in expected.iter().zip(&answers) {
        assert_eq!(check, got_check);
        assert_eq!(errno_name(got), *want, "{check}");
    }
}

/// The same calls under the *marked* baseline program (EPERM answers EHWPOISON instead):
/// each refusal below comes from our filter, not from missing capabilities or sysctls.
#[tokio::test]
async fn the_refusals_come_from_the_filter() {
    if !sandbox_or_skip("the_refusals_come_from_the_filter") {
        return;
    }
    let f = Fixture::new().await;
    let marked = seccomp::compile(Profile::Baseline, Arch::host().unwrap()).unwrap().marked(libc::EHWPOISON);
    let mut checks = vec![
        "ptrace",
        "unshare-user",
        "clone-newuser",
        "mount",
        "socket-inet",
        "socket-unix",
        "socketpair",
        "keyctl",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "tiocsti",
        "chroot",
    ];
    if cfg!(target_arch = "x86_64") {
        checks.push("x32-getpid");
    }
    let answers = probe_under(&f, &checks, Some(Filter::Program(marked.bytes().into()))).await;
    assert_eq!(answers.len(), checks.len(), "{answers:?}");
    for (check, (got_check, got)) in checks.iter().zip(&answers) {
        assert_eq!(check, got_check);
        assert_eq!(got, &format!("errno={}", libc::EHWPOISON), "{check} was not refused by the filter");
    }
}

#[tokio::test]
async fn threads_still_work_despite_the_clone3_rule() {
    if !sandbox_or_skip("threads_still_work_despite_the_clone3_rule") {
        return;
    }
    let f = Fixture::new().await;
    // glibc tries clone3 for pthread_create, gets ENOSYS, and falls back to clone.
    let (outcome, out) = f.shell("python3 -c 'import threading; t=threading.Thread(target=print, args=(\"thread-ok\",)); t.start(); t.join()'\n(sleep 0; echo subshell-ok)").await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    assert_eq!(out.stdout, "thread-ok\nsubshell-ok\n");
}

#[tokio::test]
async fn nested_user_namespaces_fail_from_the_shell() {
    if !sandbox_or_skip("nested_user_namespaces_fail_from_the_shell") {
        return;
    }
    let f = Fixture::new().await;
    let (outcome, out) = f.shell("unshare -U true && echo escaped || echo refused").await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    assert_eq!(out.stdout.trim(), "refused", "{}", out.stderr);
}

#[tokio::test]
async fn process_status_shows_seccomp_no_new_privs_and_no_capabilities() {
    if !sandbox_or_skip("process_status_shows_seccomp_no_new_privs_and_no_capabilities") {
        return;
    }
    let f = Fixture::new().await;
    let (_, out) = f.shell("grep -E '^(Seccomp|NoNewPrivs|CapEff|CapPrm|CapBnd):' /proc/self/status").await;
    let status: Vec<(&str, &str)> =
        out.stdout.lines().filter_map(|l| l.split_once(':')).map(|(k, v)| (k, v.trim())).collect();
    let get = |k: &str| status.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
    assert_eq!(get("Seccomp"), Some("2"), "{}", out.stdout);
    assert_eq!(get("NoNewPrivs"), Some("1"));
    assert_eq!(get("CapEff"), Some("0000000000000000"));
    assert_eq!(get("CapPrm"), Some("0000000000000000"));
    assert_eq!(get("CapBnd"), Some("0000000000000000"));
}

#[tokio::test]
async fn the_sandbox_sees_only_its_own_processes_and_bwrap_has_no_environment() {
    if !sandbox_or_skip("the_sandbox_sees_only_its_own_processes_and_bwrap_has_no_environment") {
        return;
    }
    let f = Fixture::new().await;
    if f.capability.proc_fallback {
        panic!("this host only allows --ro-bind /proc; the fresh-procfs claim cannot be checked here");
    }
    let (_, out) = f
        .shell("ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '; echo; tr '\\0' '\\n' </proc/1/environ | wc -c; cat /proc/1/cmdline | tr '\\0' ' '")
        .await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    let pids: Vec<u32> = lines[0].split_whitespace().map(|p| p.parse().unwrap()).collect();
    assert!(pids.contains(&1), "{pids:?}");
    assert!(pids.iter().all(|p| *p < 50), "host processes visible: {pids:?}");
    // bwrap is PID 1 here; sandbox-init exec'd it with an empty environment (R-SBX-7).
    assert_eq!(lines[1].trim(), "0", "bwrap's environment leaks into the sandbox: {}", out.stderr);
    assert!(lines[2].contains("bwrap"), "{}", lines[2]);
}

#[tokio::test]
async fn filesystem_view() {
    if !sandbox_or_skip("filesystem_view") {
        return;
    }
    let f = Fixture::new().await;
    std::fs::write(f.workspace.join("input.txt"), "from host").unwrap();
    let data_dir = f.data_dir.canonicalize().unwrap();
    let script = format!(
        "touch /usr/escape 2>/dev/null && echo usr-writable || echo usr-readonly
test -e /root && echo root-visible || echo root-hidden
test -e /home && echo home-visible || echo home-hidden
test -e {data} && echo data-visible || echo data-hidden
cat /workspace/input.txt; echo
echo written > /workspace/output.txt && echo workspace-writable
pwd
id -un
grep -c . /etc/passwd
echo $HOME $PATH
env | cut -d= -f1 | sort | tr '\\n' ' '",
        data = data_dir.display()
    );
    let (outcome, out) = f.shell(&script).await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        &lines[..7],
        [
            "usr-readonly",
            "root-hidden",
            "home-hidden",
            "data-hidden",
            "from host",
            "workspace-writable",
            "/workspace"
        ]
    );
    let me = runner_tests::sandbox_user().name;
    assert!(lines[7] == me || lines[7] == "sciencediscovery", "{}", lines[7]);
    assert_eq!(lines[8], "1", "one passwd line");
    assert_eq!(lines[9], "/tmp /usr/bin:/bin");
    assert_eq!(std::fs::read_to_string(f.workspace.join("output.txt")).unwrap(), "written\n");
    // Nothing but what the launch injected (plus what bash itself sets).
    for var in lines[10].split_whitespace() {
        assert!(
            [
                "HOME",
                "PATH",
                "PWD",
                "SHLVL",
                "_",
                "OLDPWD",
                "SSL_CERT_FILE",
                "CURL_CA_BUNDLE",
                "REQUESTS_CA_BUNDLE",
                "SSL_CERT_DIR"
            ]
            .contains(&var),
            "unexpected variable {var}"
        );
    }
}

#[tokio::test]
async fn the_command_inherits_only_stdio() {
    if !sandbox_or_skip("the_command_inherits_only_stdio") {
        return;
    }
    // Leak an inheritable descriptor in runnerd's process, as a careless library might.
    // SAFETY: opening /dev/null without O_CLOEXEC; closed below.
    let leaked = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY) };
    let f = Fixture::new().await;
    let (outcome, out) = f.shell("exec ls -l /proc/self/fd").await;
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(leaked) };
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    let fds: Vec<&str> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once(" -> "))
        .filter(|(_, target)| !target.starts_with("/proc/"))
        .filter_map(|(left, _)| left.split_whitespace().last())
        .collect();
    // Not the seccomp program (3), not bwrap's info pipe (4), not the leaked descriptor.
    assert_eq!(fds, ["0", "1", "2"], "{}", out.stdout);
}

#[tokio::test]
async fn no_network_in_the_baseline() {
    if !sandbox_or_skip("no_network_in_the_baseline") {
        return;
    }
    let f = Fixture::new().await;
    let (outcome, out) = f
        .run(
            f.launch(
                runnerd::sandbox::Language::Python,
                "import urllib.request\ntry:\n    urllib.request.urlopen('http://127.0.0.1:9', timeout=2)\nexcept Exception as e:\n    print(type(e).__name__, e)\n",
                Some(std::time::Duration::from_secs(30)),
            ),
            1 << 20,
        )
        .await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    assert!(
        out.stdout.contains("PermissionError") || out.stdout.contains("Errno 1"),
        "expected the socket call to be refused: {}",
        out.stdout
    );
}

/// Issue #14 hole 1: started as root, sandbox code ran as host uid 0 — it changed a host-wide
/// sysctl, read 0400 root files of /proc, and left a setuid-root binary in the workspace.
/// Whoever runs the tests, the sandbox must be a non-root host user with nothing writable
/// under /proc/sys, no writable /, /dev or unsized tmpfs, and no way to plant a setuid file.
#[tokio::test]
async fn sandbox_code_is_never_host_root_and_proc_sys_is_read_only() {
    if !sandbox_or_skip("sandbox_code_is_never_host_root_and_proc_sys_is_read_only") {
        return;
    }
    let f = Fixture::new().await;
    let before = std::fs::read_to_string("/proc/sys/fs/lease-break-time").unwrap();
    let script = r#"
echo start
echo 7 > /proc/sys/fs/lease-break-time 2>/dev/null && echo sysctl-written || echo sysctl-refused
echo '|/bin/false' > /proc/sys/kernel/core_pattern 2>/dev/null && echo core-written || echo core-refused
head -c 8 /proc/kpageflags >/dev/null 2>&1 && echo kpageflags-read || echo kpageflags-refused
cp /usr/bin/id /workspace/id-copy && echo copied
chmod 4755 /workspace/id-copy 2>/dev/null && echo setuid-set || echo setuid-refused
touch /planted 2>/dev/null && echo root-writable || echo root-readonly
touch /dev/planted 2>/dev/null && echo dev-writable || echo dev-readonly
grep -E ' /(tmp|dev/shm) ' /proc/self/mountinfo | grep -c 'size='
grep -E ' /(tmp|dev/shm) ' /proc/self/mountinfo | wc -l
head -c 80000000 /dev/zero > /dev/shm/fill 2>/dev/null && echo shm-unbounded || stat -c %s /dev/shm/fill
"#;
    let (outcome, out) = f.shell(script).await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "start");
    assert_eq!(
        &lines[1..10],
        [
            "sysctl-refused",
            "core-refused",
            "kpageflags-refused",
            "copied",
            "setuid-refused",
            "root-readonly",
            "dev-readonly",
            "2",
            "2"
        ],
        "{}",
        out.stderr
    );
    // /dev/shm fills to its size (64 MiB at the fallback /tmp size) and no further.
    assert_eq!(lines[10], (64u64 << 20).to_string(), "{}", out.stdout);
    assert_eq!(std::fs::read_to_string("/proc/sys/fs/lease-break-time").unwrap(), before);
    // What the sandbox wrote belongs on the host to the sandbox user, never to root, and
    // seccomp refused the set-user-ID bit (issue #30: through an idmapped mount the file
    // would be the directory owner's, root's).
    use std::os::unix::fs::MetadataExt;
    let copy = std::fs::metadata(f.workspace.join("id-copy")).unwrap();
    assert_ne!(copy.uid(), 0, "sandbox code runs as host root");
    assert_eq!(copy.uid(), runner_tests::sandbox_user().uid);
    assert_eq!(copy.mode() & 0o6000, 0, "mode {:o}", copy.mode());
}
