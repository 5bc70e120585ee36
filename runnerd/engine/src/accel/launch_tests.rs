//! The accelerator part of the bwrap argv (internals §4.3, §4.6), through the executions'
//! own pure builder.

use std::path::{Path, PathBuf};

use common::seccomp::Profile;

use super::mount::{self, AccelMount};
use crate::sandbox::{
    BwrapSpec, EgressMount, HostRuntime, Language, ProcMode, SandboxShape, WorkspaceLayout, argv,
};

const FULL: SandboxShape = SandboxShape { proc_mode: ProcMode::New, disable_userns: true };
const T: &str = "/usr/local/Ascend/ascend-toolkit/latest";

fn position(args: &[String], window: &[&str]) -> Option<usize> {
    args.windows(window.len()).position(|w| w.iter().zip(window).all(|(a, b)| a == b))
}

fn npu(sel: &[u32]) -> AccelMount {
    mount::ascend(
        sel,
        Path::new("/dev"),
        Path::new(T),
        Some(Path::new("/usr/local/bin/npu-smi")),
        &|p: &Path| p.ends_with("davinci_manager"),
    )
}

#[test]
fn the_probe_binds_one_chip_as_device_0_after_a_fresh_dev_and_ends_with_npu_smi_info() {
    let host = HostRuntime::default();
    let ws = WorkspaceLayout::new("/data/runner-runtime/accel-probe/1-0".into(), None);
    let command = vec!["/usr/local/bin/npu-smi".to_owned(), "info".to_owned()];
    for shape in [FULL, SandboxShape { proc_mode: ProcMode::Bind, disable_userns: false }] {
        let one = npu(&[5]);
        let mut spec = BwrapSpec::new(shape, &host, &ws, Language::Shell);
        spec.accel = Some(&one);
        spec.command = Some(&command);
        let cmd = argv::build(&spec);
        let a = cmd.args();
        let dev = position(&a, &["--dev", "/dev"]).unwrap();
        let chip = position(&a, &["--dev-bind", "/dev/davinci5", "/dev/davinci0"]).unwrap();
        assert!(dev < chip, "a fresh /dev first");
        assert!(position(&a, &["--dev-bind", "/dev/davinci_manager", "/dev/davinci_manager"]).is_some());
        assert!(!a.iter().any(|x| x == "/dev/devmm_svm"), "absent management nodes are not bound");
        assert_eq!(
            a.iter()
                .filter(|x| x.starts_with("/dev/davinci") && x.as_str() != "/dev/davinci_manager")
                .count(),
            2
        );
        for flag in ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv"] {
            assert!(a.iter().any(|x| x == flag), "{flag}");
        }
        assert!(position(&a, &["--cap-drop", "ALL"]).is_some());
        assert_eq!(a.iter().any(|x| x == "--disable-userns"), shape.disable_userns);
        assert!(a.ends_with(&command), "{a:?}");
        let ld = cmd.env.iter().find(|(k, _)| k == "LD_LIBRARY_PATH").unwrap();
        assert!(ld.1.contains("/usr/local/Ascend/driver/lib64/common"));
        assert_eq!(
            argv::profile(false, !one.ascend.is_empty()),
            Profile::Npu,
            "the probe (accel::probe) runs under the executions' profile"
        );
    }
}

#[test]
fn npu_launches_bind_only_the_selection_and_add_the_cann_environment() {
    let host = HostRuntime::default();
    let ws = WorkspaceLayout::new("/data/projects/p/ws".into(), None);
    let plain = argv::build(&BwrapSpec::new(FULL, &host, &ws, Language::Shell));
    let empty = AccelMount::default();
    let mut spec = BwrapSpec::new(FULL, &host, &ws, Language::Shell);
    spec.accel = Some(&empty);
    assert_eq!(argv::build(&spec), plain, "no selection leaves the launch unchanged");
    assert!(!plain.args().iter().any(|a| a.contains("davinci") || a.contains("ASCEND")));

    let chips = npu(&[6, 4]);
    spec.accel = Some(&chips);
    let cmd = argv::build(&spec);
    let a = cmd.args();
    let sources: Vec<&String> = a
        .windows(3)
        .filter(|w| w[0] == "--dev-bind")
        .map(|w| &w[1])
        .filter(|s| s.contains("davinci"))
        .collect();
    assert_eq!(sources, ["/dev/davinci4", "/dev/davinci6", "/dev/davinci_manager"]);
    assert!(position(&a, &["--dev-bind", "/dev/davinci6", "/dev/davinci1"]).is_some());
    assert_eq!(cmd.env[1], ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    assert_eq!(plain.env[1], ("PATH".into(), "/usr/bin:/bin".into()));
    assert_eq!(
        cmd.env[2],
        ("PYTHONPATH".into(), format!("{T}/python/site-packages:{T}/opp/built-in/op_impl/ai_core/tbe"))
    );
    let keys: Vec<&str> = cmd.env.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "HOME",
            "PATH",
            "PYTHONPATH",
            "ASCEND_AICPU_PATH",
            "ASCEND_HOME_PATH",
            "ASCEND_OPP_PATH",
            "ASCEND_TOOLKIT_HOME",
            "TOOLCHAIN_HOME",
            "LD_LIBRARY_PATH"
        ]
    );
    assert_eq!(cmd.seccomp, Profile::Baseline, "the profile is the caller's decision, not the mount's");
    // The isolation is what a plain launch has: only binds and variables were added.
    let mut stripped = a.clone();
    for w in [
        ["--dev-bind", "/dev/davinci4", "/dev/davinci0"],
        ["--dev-bind", "/dev/davinci6", "/dev/davinci1"],
        ["--dev-bind", "/dev/davinci_manager", "/dev/davinci_manager"],
    ] {
        let p = position(&stripped, &w).unwrap();
        stripped.drain(p..p + 3);
    }
    let before_env = |v: &[String]| v[..position(v, &["--clearenv"]).unwrap()].to_vec();
    assert_eq!(before_env(&stripped), before_env(&plain.args()));
}

#[test]
fn network_wins_the_seccomp_profile_and_python_keeps_its_flags() {
    let host = HostRuntime::default();
    let ws = WorkspaceLayout::new("/w".into(), None);
    let chips = npu(&[0]);
    let egress = EgressMount { bridge: "/b".into(), gateway_socket: "/s".into(), gateway_fd: None };
    let mut spec = BwrapSpec::new(FULL, &host, &ws, Language::Python);
    spec.accel = Some(&chips);
    let cmd = argv::build(&spec);
    assert!(cmd.command.ends_with(&["-I".to_owned(), "-".to_owned()]));
    assert_eq!(cmd.env[3], ("PYTHONNOUSERSITE".into(), "1".into()));
    spec.egress = Some(&egress);
    spec.profile = argv::profile(true, true);
    assert_eq!(argv::build(&spec).seccomp, Profile::Network, "the command carries the profile decided");
    use crate::exec::request::NetworkMode;
    assert_eq!(crate::exec::profile_for(&NetworkMode::DomainAllowlist, true), Profile::Network);
    assert_eq!(crate::exec::profile_for(&NetworkMode::None, true), Profile::Npu);
    assert_eq!(crate::exec::profile_for(&NetworkMode::None, false), Profile::Baseline);
}

#[test]
fn relocated_tools_are_bound_after_tmp_and_gpus_keep_the_baseline_profile() {
    let host = HostRuntime::default();
    let ws = WorkspaceLayout::new("/w".into(), None);
    let chips =
        mount::ascend(&[1], Path::new("/t/dev"), Path::new(T), Some(Path::new("/tmp/x/npu-smi")), &|_| false);
    let mut spec = BwrapSpec::new(FULL, &host, &ws, Language::Shell);
    spec.accel = Some(&chips);
    let a = argv::build(&spec).args();
    let tmp = position(&a, &["--tmpfs", "/tmp"]).unwrap();
    assert!(position(&a, &["--ro-bind", "/tmp/x/npu-smi", "/tmp/x/npu-smi"]).unwrap() > tmp);
    assert!(position(&a, &["--dev-bind", "/t/dev/davinci1", "/dev/davinci0"]).unwrap() < tmp);
    let gpus = mount::nvidia(&[2], &PathBuf::from("/dev"), None, &|_| true);
    spec.accel = Some(&gpus);
    let cmd = argv::build(&spec);
    assert_eq!(cmd.seccomp, Profile::Baseline);
    assert!(position(&cmd.args(), &["--dev-bind", "/dev/nvidia2", "/dev/nvidia2"]).is_some());
    assert!(position(&cmd.args(), &["--dev-bind", "/dev/nvidiactl", "/dev/nvidiactl"]).is_some());
    assert_eq!(cmd.env[1].1, "/usr/bin:/bin");
}
