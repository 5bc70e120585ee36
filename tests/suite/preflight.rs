//! Preflight with stub bwrap binaries that print the three known refusals (internals §2.8),
//! and with the real bwrap. The stubs are launched through sandbox-init like every probe.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use runner_tests::{Fixture, bwrap, sandbox_or_skip};
use runnerd::sandbox::ProcMode;
use runnerd::sandbox::preflight::{
    CapabilityCache, CapabilityReason, PreflightError, check_bwrap_options, warnings,
};

const PROC_REFUSED: &str = "bwrap: Can't mount proc on /newroot/proc: Operation not permitted";
const SYSCTL_RO: &str = "bwrap: cannot open /proc/sys/user/max_user_namespaces: Read-only file system";
const UNKNOWN: &str = "bwrap: Unknown option --disable-userns";

/// Writes an executable stub: it appends one line per call to `calls` next to itself,
/// fails with `proc_err` when asked for a fresh /proc, with `userns_err` when asked for
/// --disable-userns, and succeeds otherwise. sandbox-init runs it with an empty
/// environment, so it uses only shell built-ins.
fn stub(
    dir: &Path,
    name: &str,
    proc_err: Option<&str>,
    userns_err: Option<&str>,
    always_err: Option<&str>,
) -> PathBuf {
    let path = dir.join(name);
    let fail = |msg: Option<&str>| match msg {
        Some(m) => format!("echo '{}' >&2; exit 1", m.replace('\'', "'\\''")),
        None => ":".to_owned(),
    };
    let script = format!(
        "#!/bin/sh\necho \"$*\" >> \"${{0%/*}}/{name}.calls\"\n\
         {always}\n\
         for a in \"$@\"; do\n  case \"$a\" in\n    --proc) {proc} ;;\n    --disable-userns) {userns} ;;\n  esac\ndone\nexit 0\n",
        always = always_err.map(|m| fail(Some(m))).unwrap_or_default(),
        proc = fail(proc_err),
        userns = fail(userns_err),
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The stub runs as the sandbox user and records its calls next to itself.
    runner_tests::hand_to_sandbox(dir);
    path
}

fn calls(stub: &Path) -> usize {
    std::fs::read_to_string(format!("{}.calls", stub.display())).map(|s| s.lines().count()).unwrap_or(0)
}

#[tokio::test]
async fn stub_hosts_yield_the_original_conclusions_and_warnings() {
    let f = Fixture::new_without_probe().await;
    let dir = f.dir.path();
    let cache = CapabilityCache::default();
    let cases = [
        (stub(dir, "full", None, None, None), CapabilityReason::Supported, true, ProcMode::New, vec![]),
        (
            stub(dir, "docker", Some(PROC_REFUSED), None, None),
            CapabilityReason::Supported,
            true,
            ProcMode::Bind,
            vec!["cannot mount a fresh /proc", "--ro-bind /proc /proc", "systempaths=unconfined"],
        ),
        (
            stub(dir, "old", None, Some(UNKNOWN), None),
            CapabilityReason::OptionUnknown,
            false,
            ProcMode::New,
            vec!["does not support --disable-userns", "Upgrade bubblewrap"],
        ),
        (
            stub(dir, "lxc", None, Some(SYSCTL_RO), None),
            CapabilityReason::OptionRejected,
            false,
            ProcMode::New,
            vec!["cannot use it here", "Read-only file system"],
        ),
        (
            stub(dir, "docker-lxc", Some(PROC_REFUSED), Some(SYSCTL_RO), None),
            CapabilityReason::OptionRejected,
            false,
            ProcMode::Bind,
            vec!["cannot mount a fresh /proc", "cannot use it here"],
        ),
        (
            stub(dir, "broken", None, None, Some("bwrap: setting up uid map: Permission denied")),
            CapabilityReason::SandboxUnusable,
            false,
            ProcMode::New,
            vec![
                "could not build a sandbox: bwrap: setting up uid map",
                "run_python and run_shell will fail",
            ],
        ),
    ];
    for (path, reason, userns, proc_mode, needles) in cases {
        let cap = cache.get(&f.launcher, &path).await;
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!((cap.reason, cap.disable_userns, cap.proc_mode), (reason, userns, proc_mode), "{name}");
        let text: String = warnings(&path.to_string_lossy(), &cap).into_iter().map(|w| w.text).collect();
        for needle in needles {
            assert!(text.contains(needle), "{name}: {needle:?} not in {text:?}");
        }
        if reason == CapabilityReason::Supported && proc_mode == ProcMode::New {
            assert!(text.is_empty(), "{name}: {text}");
        }
    }
}

#[tokio::test]
async fn two_concurrent_callers_and_a_third_make_exactly_two_probe_launches() {
    let f = Fixture::new_without_probe().await;
    let path = stub(f.dir.path(), "counted", None, None, None);
    let cache = CapabilityCache::default();
    let (a, b) = tokio::join!(cache.get(&f.launcher, &path), cache.get(&f.launcher, &path));
    let c = cache.get(&f.launcher, &path).await;
    assert_eq!(a, b);
    assert_eq!(b, c);
    assert_eq!(calls(&path), 2);
}

#[tokio::test]
async fn options_check_with_stub_and_missing_binaries() {
    let f = Fixture::new_without_probe().await;
    let lacking = f.dir.path().join("lacking-bwrap");
    std::fs::write(&lacking, "#!/bin/sh\necho 'usage: bwrap --unshare-all --unshare-user --cap-drop --die-with-parent --new-session'\n").unwrap();
    std::fs::set_permissions(&lacking, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = check_bwrap_options(&lacking).await.unwrap_err();
    assert!(matches!(&err, PreflightError::LacksOptions { missing, .. } if missing == &["--seccomp"]));
    assert!(err.to_string().contains("lacks required sandbox options: --seccomp"));

    let err = check_bwrap_options(Path::new("/nonexistent/bwrap")).await.unwrap_err();
    assert!(err.to_string().contains("ENOENT"), "{err}");
}

#[tokio::test]
async fn the_real_bwrap_passes_and_probes_usable() {
    if !sandbox_or_skip("the_real_bwrap_passes_and_probes_usable") {
        return;
    }
    let f = Fixture::new().await;
    check_bwrap_options(&bwrap()).await.expect("the installed bwrap has every required option");
    assert!(f.capability.sandbox_usable, "{:?}", f.capability);
    // bwrap ≥ 0.8 with writable /proc/sys: the full profile. Anything else must say why.
    if f.capability.reason != CapabilityReason::Supported {
        assert!(f.capability.detail.is_some(), "{:?}", f.capability);
    }
}
