//! Test support: where the built binaries are, whether this host can run sandboxes (and
//! what to do when it cannot), and a fixture that runs scripts in real sandboxes.

pub mod egress;
pub mod journal;
pub mod kube;
pub mod npu;
pub mod router;
pub mod seaweed;
pub mod server;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub use runnerd::launch::Filter;
use runnerd::launch::{CollectedOutput, Launch, LaunchIdentity, Launcher, Outcome, OutputBudget};
use runnerd::sandbox::preflight::{self, Capability};
use runnerd::sandbox::{BwrapSpec, HostRuntime, Language, WorkspaceLayout, argv, host};

/// Directory of the workspace's built binaries: `$RUNNER_BIN_DIR`, else the cargo target
/// directory this test binary was built into (`target/<profile>/deps/..`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RUNNER_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(Path::parent).expect("target/<profile>").to_owned()
}

/// A built binary of the workspace; panics with the command that builds it.
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace first (`cargo build --workspace`), or use scripts/test",
        path.display()
    );
    path
}

/// Whether the tests run as root (then runnerd hands every sandbox to [`sandbox_user`]).
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The user a runnerd started by these tests runs sandboxes as: itself when unprivileged;
/// as root, `$RUNNER_TEST_SANDBOX_USER`, else [`DEDICATED_SANDBOX_USER`] when it exists
/// (`scripts/test` makes it), else `nobody` (what `--dev` picks).
pub fn sandbox_user() -> runnerd::sandbox::user::Identity {
    let dedicated = || {
        runnerd::sandbox::user::resolve(Some(DEDICATED_SANDBOX_USER), true)
            .is_ok_and(|who| who.name == DEDICATED_SANDBOX_USER)
            .then(|| DEDICATED_SANDBOX_USER.to_owned())
    };
    let configured = std::env::var(SANDBOX_USER_VAR).ok().or_else(|| is_root().then(dedicated).flatten());
    runnerd::sandbox::user::resolve(
        Some(configured.as_deref().unwrap_or("nobody")).filter(|_| is_root()),
        true,
    )
    .expect("a sandbox user for the tests")
}

const SANDBOX_USER_VAR: &str = "RUNNER_TEST_SANDBOX_USER";
/// A system user only the tests' sandboxes run as (made by `scripts/test` as root): caller-
/// made workspaces are idmapped only for a sandbox user of its own (issue #30).
pub const DEDICATED_SANDBOX_USER: &str = "sciencediscovery-sbx";

/// Whether a runnerd started by these tests mounts caller-made workspaces idmapped: as root
/// with a sandbox user of its own (never `nobody`, which other services share).
pub fn idmapped_workspaces() -> bool {
    is_root() && runnerd::sandbox::ownership::shared_user(&sandbox_user()).is_none()
}

/// For tests that need [`idmapped_workspaces`] as root: fails in CI without it, else skips
/// loudly. Unprivileged (no idmap to test), true.
pub fn idmap_or_skip(test: &str) -> bool {
    if !is_root() || idmapped_workspaces() {
        return true;
    }
    let why = format!(
        "the sandbox user {} is shared; run scripts/test (which makes {DEDICATED_SANDBOX_USER}) or set {SANDBOX_USER_VAR}",
        sandbox_user().name
    );
    if in_ci() {
        panic!("{test}: {why}");
    }
    eprintln!("\n!!! SKIPPING {test}: {why} !!!\n");
    false
}

/// Gives a directory a test made (as root) to the sandbox user, as runnerd does with the
/// workspaces it creates; a no-op when unprivileged.
pub fn hand_to_sandbox(path: &Path) {
    let user = sandbox_user();
    if user.switches() {
        std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).expect("chown to the sandbox user");
    }
}

/// `SCIENCE_AGENT_SANDBOX_USER=<uid of sandbox_user()>`, for tests that start runnerd by hand.
pub fn sandbox_user_env() -> (&'static str, String) {
    (runnerd::sandbox::user::USER_VAR, sandbox_user().uid.to_string())
}

/// Gives a tree a test seeded (as root) to the sandbox user, every entry, as if the
/// sandbox had written it; a no-op when unprivileged.
pub fn hand_tree_to_sandbox(path: &Path) {
    hand_to_sandbox(path);
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.flatten() {
            let p = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                hand_tree_to_sandbox(&p);
            } else if !entry.file_type().is_ok_and(|t| t.is_symlink()) {
                hand_to_sandbox(&p);
            }
        }
    }
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The resolved system bwrap.
pub fn bwrap() -> PathBuf {
    preflight::resolve_bwrap("bwrap", std::env::var_os("PATH").as_deref()).expect("bubblewrap is installed")
}

fn bwrap_or_default() -> PathBuf {
    preflight::resolve_bwrap("bwrap", std::env::var_os("PATH").as_deref())
        .unwrap_or_else(|_| "/usr/bin/bwrap".into())
}

/// Whether real sandboxes can run here. In CI a test that needs one must fail, not skip;
/// elsewhere it skips with a loud message.
pub fn sandbox_or_skip(test: &str) -> bool {
    static USABLE: OnceLock<Result<(), String>> = OnceLock::new();
    let usable = USABLE.get_or_init(|| {
        let bwrap = preflight::resolve_bwrap("bwrap", std::env::var_os("PATH").as_deref())
            .map_err(|e| e.to_string())?;
        let status = std::process::Command::new(&bwrap)
            .args(preflight::probe_args(argv::ProcMode::New, false))
            .stderr(std::process::Stdio::null())
            .status()
            .map_err(|e| e.to_string())?;
        let bind = || {
            std::process::Command::new(&bwrap)
                .args(preflight::probe_args(argv::ProcMode::Bind, false))
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if status.success() || bind() {
            Ok(())
        } else {
            Err(format!("{} cannot build a sandbox", bwrap.display()))
        }
    });
    match usable {
        Ok(()) => true,
        Err(why) if in_ci() => panic!("{test}: this CI machine cannot run sandboxes: {why}"),
        Err(why) => {
            eprintln!("\n!!! SKIPPING {test}: no usable sandbox on this machine ({why}) !!!\n");
            false
        }
    }
}

/// A data directory with a workspace, a launcher, and the host's probed sandbox form.
#[derive(Debug)]
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub data_dir: PathBuf,
    pub workspace: PathBuf,
    pub launcher: Launcher,
    pub host: HostRuntime,
    pub capability: Capability,
    pub bwrap: PathBuf,
}

impl Fixture {
    /// Must be called inside a tokio runtime.
    pub async fn new() -> Fixture {
        let dir = scratch_dir();
        let data_dir = dir.path().join("data");
        let workspace = data_dir.join("projects/p/sessions/s/workspace");
        std::fs::create_dir_all(&workspace).unwrap();
        hand_to_sandbox(&workspace);
        let launcher =
            Launcher::new(bin("sandbox-init"), LaunchIdentity::of(&sandbox_user())).expect("launcher");
        let host = host::detect_host_runtime();
        let bwrap = bwrap();
        let cache = preflight::CapabilityCache::default();
        let capability = cache.get(&launcher, &bwrap).await;
        Fixture { dir, data_dir, workspace, launcher, host, capability, bwrap }
    }

    /// The launch for `code` in `language`, under the baseline profile.
    pub fn launch(&self, language: Language, code: &str, timeout: Option<Duration>) -> Launch {
        let shape = self.capability.shape().expect("the probes found a usable sandbox");
        let layout = WorkspaceLayout::new(self.workspace.canonicalize().unwrap(), None);
        let cmd = argv::build(&BwrapSpec::new(shape, &self.host, &layout, language));
        let mut launch = Launch::sandboxed(self.bwrap.clone(), cmd, Default::default());
        launch.rlimits = runnerd::launch::default_rlimits(Some(10 << 30));
        launch.stdin = code.as_bytes().to_vec();
        launch.timeout = timeout;
        launch
    }

    /// A fixture for launches that do not need a working sandbox (no probes are run).
    pub async fn new_without_probe() -> Fixture {
        let dir = scratch_dir();
        let data_dir = dir.path().join("data");
        let workspace = data_dir.join("projects/p/sessions/s/workspace");
        std::fs::create_dir_all(&workspace).unwrap();
        hand_to_sandbox(&workspace);
        let launcher =
            Launcher::new(bin("sandbox-init"), LaunchIdentity::of(&sandbox_user())).expect("launcher");
        let capability = Capability {
            reason: preflight::CapabilityReason::SandboxUnusable,
            sandbox_usable: false,
            disable_userns: false,
            proc_mode: argv::ProcMode::New,
            proc_fallback: false,
            detail: Some("not probed".into()),
            proc_detail: None,
        };
        Fixture {
            dir,
            data_dir,
            workspace,
            launcher,
            host: HostRuntime::default(),
            capability,
            bwrap: bwrap_or_default(),
        }
    }

    pub async fn run(&self, launch: Launch, budget: u64) -> (Outcome, CollectedOutput) {
        let mut output = OutputBudget::new(budget);
        let outcome = self.launcher.run(launch, &mut output).await.expect("launch");
        (outcome, output.finish())
    }

    /// Runs a bash script in a baseline sandbox; panics on launch errors.
    pub async fn shell(&self, script: &str) -> (Outcome, CollectedOutput) {
        self.run(self.launch(Language::Shell, script, Some(Duration::from_secs(60))), 1 << 20).await
    }

    /// Copies the probe binary into the workspace; returns its sandbox path.
    pub fn install_probe(&self) -> &'static str {
        std::fs::copy(bin("sbx-probe"), self.workspace.join("sbx-probe")).expect("copy sbx-probe");
        "/workspace/sbx-probe"
    }
}

/// A scratch directory for one test. Not under /tmp: the sandbox mounts its own tmpfs there,
/// which would hide a data directory under /tmp whether or not the sandbox's mounts were
/// right. `RUNNER_TEST_TMPDIR` overrides; /var/tmp is writable for any test user.
pub fn scratch_dir() -> tempfile::TempDir {
    let base = std::env::var_os("RUNNER_TEST_TMPDIR").map(PathBuf::from).unwrap_or_else(|| "/var/tmp".into());
    let dir = tempfile::Builder::new().prefix("runner-test-").tempdir_in(base).expect("scratch directory");
    if is_root() {
        // A root runnerd's sandboxes run as another user, who must reach what the tests
        // place here and bind by path (fake tools and device nodes).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod scratch");
    }
    dir
}

/// Host processes whose command line contains `needle` (other than ourselves).
pub fn processes_matching(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
            cmd.contains(needle).then_some((pid, cmd))
        })
        .collect()
}

/// The processes whose parent is `pid` (from `/proc/<pid>/stat`).
pub fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                .is_some_and(|ppid| ppid == pid)
        })
        .collect()
}

/// The pid of the program a wrapper (bwrap without a pid namespace) runs: its only child.
/// Waits briefly for it to appear; `None` when the wrapper has exited.
pub fn wrapped_pid(wrapper: u32) -> Option<u32> {
    for _ in 0..200 {
        if let Some(child) = children_of(wrapper).first() {
            return Some(*child);
        }
        if !Path::new(&format!("/proc/{wrapper}")).exists() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}
