//! The bwrap argv, as a pure function of a [`BwrapSpec`] (R-SBX-4, R-SBX-5), in the
//! original runner's order (internals §2.2). It also returns the environment map and the
//! working directory it injected, for provenance.
//!
//! Differences from the original, each deliberate:
//! * `--new-session` stays (the original drops it to kill by process group). It is our
//!   TIOCSTI defence next to the seccomp rule; we end a sandbox by killing its
//!   PID-namespace init instead, which bwrap reports on `--info-fd 4`.
//! * The options end before the descriptor options: the launcher appends `--info-fd 4`
//!   and `--seccomp 3` itself, the original's last option.
//! * Nothing the sandbox can write is unsized or on bwrap's own filesystems (issue #14):
//!   `/proc/sys` is bound read-only over the fresh procfs (bwrap leaves it writable, and a
//!   sysctl is a host-wide setting), `/dev/shm` is its own sized tmpfs, `/tmp` is always
//!   sized, `/dev` is remounted read-only, and the launcher remounts `/` read-only last.

use std::path::{Path, PathBuf};

use common::egress::protocol;
use common::seccomp::Profile;
use serde::Serialize;

use super::host::{HostRuntime, PYTHON_PACKAGES_MOUNT};
use crate::accel_mount::AccelMount;

/// Where a skill package ([`SkillsMount`]) and the workspace's extensions directory appear
/// in the sandbox, and the variables that name them there.
pub const SKILLS_MOUNT: &str = "/skills";
pub const EXTENSIONS_MOUNT: &str = "/skill-extensions";
pub const SKILLS_DIR_VAR: &str = "SCIENCEDISCOVERY_SKILLS_DIR";
pub const EXTENSIONS_DIR_VAR: &str = "SCIENCEDISCOVERY_SKILL_EXTENSIONS_DIR";

/// How the sandbox gets its `/proc` (R-SBX-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcMode {
    /// `--proc /proc`: a fresh procfs that shows only the sandbox's processes.
    New,
    /// `--ro-bind /proc /proc`: the weaker fallback where the kernel refuses a new procfs.
    Bind,
}

/// The probe-decided form of every sandbox on this host (R-SBX-2, R-SBX-3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxShape {
    pub proc_mode: ProcMode,
    pub disable_userns: bool,
}

/// What runs inside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    Shell,
    Python,
    R,
}

impl Language {
    /// The label in error messages ("Shell execution timed out after …").
    pub fn label(self) -> &'static str {
        match self {
            Language::Shell => "Shell execution",
            Language::Python => "Python execution",
            Language::R => "R execution",
        }
    }
}

/// Where the workspace appears inside the sandbox (contract §2A "Sandbox layout").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceLayout {
    /// Writable root at `/workspace`; a read-only parent, if any, at `/parent_workspace`.
    Plain { root: PathBuf, read_only_parent: Option<PathBuf> },
    /// The writable root lies inside the read-only parent: the parent at `/workspace`, the
    /// root at `/workspace/<rel>`.
    Nested { parent: PathBuf, root: PathBuf, rel: String },
}

impl WorkspaceLayout {
    /// Chooses the layout from already-resolved (canonical) host paths.
    pub fn new(root: PathBuf, read_only_parent: Option<PathBuf>) -> WorkspaceLayout {
        if let Some(parent) = &read_only_parent
            && let Ok(rel) = root.strip_prefix(parent)
            && !rel.as_os_str().is_empty()
        {
            let rel = rel.to_string_lossy().into_owned();
            return WorkspaceLayout::Nested { parent: parent.clone(), root, rel };
        }
        WorkspaceLayout::Plain { root, read_only_parent }
    }

    /// The writable root on the host.
    pub fn root(&self) -> &Path {
        match self {
            WorkspaceLayout::Plain { root, .. } | WorkspaceLayout::Nested { root, .. } => root,
        }
    }

    /// The sandbox path of the writable root: the default working directory.
    pub fn mount_point(&self) -> String {
        match self {
            WorkspaceLayout::Plain { .. } => "/workspace".to_owned(),
            WorkspaceLayout::Nested { rel, .. } => format!("/workspace/{rel}"),
        }
    }

    fn bind_args(&self, args: &mut Vec<String>, fds: Option<WorkspaceFds>) {
        // With descriptors, bwrap mounts exactly the directories runnerd opened and checked.
        let rw = |path: &Path| match fds {
            Some(f) => ("--bind-fd", f.root.to_string()),
            None => ("--bind", lossy(path)),
        };
        let ro = |path: &Path| match fds.and_then(|f| f.read_only) {
            Some(fd) => ("--ro-bind-fd", fd.to_string()),
            None => ("--ro-bind", lossy(path)),
        };
        match self {
            WorkspaceLayout::Plain { root, read_only_parent } => {
                if let Some(parent) = read_only_parent {
                    let (opt, src) = ro(parent);
                    push(args, &[opt, &src, "/parent_workspace"]);
                }
                let (opt, src) = rw(root);
                push(args, &[opt, &src, "/workspace"]);
            }
            WorkspaceLayout::Nested { parent, root, rel } => {
                let (opt, src) = ro(parent);
                push(args, &[opt, &src, "/workspace"]);
                let (opt, src) = rw(root);
                push(args, &[opt, &src, &format!("/workspace/{rel}")]);
            }
        }
    }
}

/// Descriptors (numbers in the sandbox launch) of the opened workspace directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceFds {
    pub root: i32,
    pub read_only: Option<i32>,
}

/// Everything that decides one sandbox's argv: a [`crate::isolation::SandboxSpec`] in this
/// host's form, with the slot number of each descriptor it names (the bubblewrap backend
/// fills these in; see `crate::isolation::bubblewrap`).
#[derive(Debug, Clone)]
pub struct BwrapSpec<'a> {
    pub shape: SandboxShape,
    pub host: &'a HostRuntime,
    pub workspace: &'a WorkspaceLayout,
    /// A workspace-relative directory inside the writable root, already validated.
    pub cwd: Option<&'a str>,
    pub language: Language,
    /// Host interpreter binaries to hide (resolved targets); empty unless a science
    /// environment is mounted.
    pub interpreter_masks: &'a [PathBuf],
    /// The Python interpreter for `Language::Python` without a science environment.
    pub python: &'a str,
    /// A science environment prefix to mount read-only at `/opt/science-env` (R-SBX-5).
    pub science_env: Option<&'a Path>,
    /// Bind the workspace from these descriptors instead of by path.
    pub workspace_fds: Option<WorkspaceFds>,
    /// A domain-allowlist sandbox: the bridge and the gateway socket to bind (R-NET-2).
    pub egress: Option<&'a EgressMount>,
    /// Accelerator chips, their nodes and environment (R-NPU-1, runnerd's `accel`).
    pub accel: Option<&'a AccelMount>,
    /// Runs this instead of the language's interpreter (the accelerator probes).
    pub command: Option<&'a [String]>,
    /// The size of the sandbox's `/tmp` tmpfs in bytes (issue #8); 0 (unlimited) is taken
    /// as [`FALLBACK_TMP_BYTES`]: a tmpfs is never unsized.
    pub tmp_bytes: u64,
    /// `<dataDir>/python-packages[/pyX.Y|/py3]` as [`super::host::detect_python_packages`]
    /// checked it: bound read-only at [`PYTHON_PACKAGES_MOUNT`] unless a science environment
    /// is mounted; then `PYTHONPATH` names it, `PYTHONNOUSERSITE=1` and Python runs without `-I`.
    pub python_packages: Option<&'a Path>,
    /// A verified skill package and the workspace's extensions directory (runnerd's `skills`).
    pub skills: Option<&'a SkillsMount>,
    /// The seccomp profile, decided once by the caller (runnerd's `exec::profile_for` for
    /// an execution): `network` with egress, `npu` with Ascend chips.
    pub profile: Profile,
    /// More binds after the workspace, each at its own host path (a provisioning sandbox's
    /// prefix and package cache: conda prefixes embed their path).
    pub binds: &'a [ExtraBind],
    /// Variables set after every other (a provisioning step's own).
    pub extra_env: &'a [(String, String)],
}

/// A bind a caller adds ([`BwrapSpec::binds`]): by descriptor where bwrap can, so a path
/// swapped after it was checked is never what gets mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraBind {
    pub source: PathBuf,
    pub target: PathBuf,
    pub writable: bool,
    /// A descriptor slot for `--bind-fd` / `--ro-bind-fd`.
    pub fd: Option<i32>,
}

/// Skill binds (internals §2.2 item 20): the package read-only at `/skills`, the
/// extensions directory writable at `/skill-extensions`, by descriptor when bwrap can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillsMount {
    pub packages: PathBuf,
    pub extensions: PathBuf,
    /// `(packages, extensions)` descriptor numbers for `--ro-bind-fd` / `--bind-fd`.
    pub fds: Option<(i32, i32)>,
}

/// What a network sandbox gets: still no interface (`--unshare-all`, never `--share-net`);
/// the bridge, read-only, and the policy's gateway socket; the proxy variables; the bridge
/// as command prefix; and the `network` seccomp profile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressMount {
    pub bridge: PathBuf,
    pub gateway_socket: PathBuf,
    /// Bind the socket runnerd opened and checked (`--bind-fd`) instead of the path egressd
    /// named: a compromised egressd cannot swap the path for a directory it wants mounted.
    pub gateway_fd: Option<i32>,
}

impl<'a> BwrapSpec<'a> {
    /// A spec with no cwd, no masks, the host `/usr/bin/python3`, no science environment
    /// and path binds; callers override what they decide.
    pub fn new(
        shape: SandboxShape,
        host: &'a HostRuntime,
        workspace: &'a WorkspaceLayout,
        language: Language,
    ) -> Self {
        BwrapSpec {
            shape,
            host,
            workspace,
            cwd: None,
            language,
            interpreter_masks: &[],
            python: "/usr/bin/python3",
            science_env: None,
            workspace_fds: None,
            egress: None,
            accel: None,
            command: None,
            tmp_bytes: 0,
            python_packages: None,
            skills: None,
            profile: Profile::Baseline,
            binds: &[],
            extra_env: &[],
        }
    }
}

/// The `/tmp` size when no limit is set: a tmpfs without `--size` could take half the host's
/// memory, outside every limit.
pub const FALLBACK_TMP_BYTES: u64 = 1 << 30;
/// `/dev/shm` gets the `/tmp` size, but at most this (POSIX shared memory and semaphores).
pub const MAX_SHM_BYTES: u64 = 64 << 20;

/// The sizes of the sandbox's two writable tmpfs mounts, `/tmp` and `/dev/shm`.
pub fn tmpfs_sizes(tmp_bytes: u64) -> (u64, u64) {
    let tmp = if tmp_bytes == 0 { FALLBACK_TMP_BYTES } else { tmp_bytes };
    (tmp, tmp.min(MAX_SHM_BYTES))
}

/// Where a science environment appears inside the sandbox.
pub const SCIENCE_ENV_MOUNT: &str = "/opt/science-env";

/// The result: bwrap's options, the command, and what they inject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxCommand {
    /// bwrap's options (the launcher appends `--info-fd 4 --seccomp 3`).
    pub options: Vec<String>,
    /// The program and its arguments, after the options.
    pub command: Vec<String>,
    /// The environment after `--clearenv`, in insertion order.
    pub env: Vec<(String, String)>,
    /// The working directory inside the sandbox.
    pub cwd: String,
    pub seccomp: Profile,
}

impl SandboxCommand {
    /// bwrap's full argument list: the options, then the command.
    pub fn args(&self) -> Vec<String> {
        self.options.iter().chain(&self.command).cloned().collect()
    }
}

fn push(args: &mut Vec<String>, items: &[&str]) {
    args.extend(items.iter().map(|s| (*s).to_owned()));
}

fn lossy(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// The seccomp profile of a sandbox: `network` with egress (the bridge needs its sockets),
/// else `npu` with Ascend chips (the driver talks netlink), else `baseline`. The one rule;
/// callers decide it once and carry it in [`BwrapSpec::profile`].
pub fn profile(egress: bool, ascend: bool) -> Profile {
    match (egress, ascend) {
        (true, _) => Profile::Network,
        (false, true) => Profile::Npu,
        (false, false) => Profile::Baseline,
    }
}

/// Builds the argv. Pure: no filesystem access.
pub fn build(spec: &BwrapSpec<'_>) -> SandboxCommand {
    let mut args = Vec::with_capacity(64);
    system_mounts(&mut args, spec);
    // A science environment, or else the operator's python-packages (never both).
    let python_packages = spec.python_packages.filter(|_| spec.science_env.is_none());
    if let Some(prefix) = spec.science_env {
        let prefix = lossy(prefix);
        push(&mut args, &["--ro-bind", &prefix, SCIENCE_ENV_MOUNT, "--ro-bind", &prefix, &prefix]);
    } else if let Some(packages) = python_packages {
        push(&mut args, &["--ro-bind", &lossy(packages), PYTHON_PACKAGES_MOUNT]);
    }
    if let Some(egress) = spec.egress {
        push(&mut args, &["--ro-bind", &lossy(&egress.bridge), protocol::SANDBOX_BRIDGE]);
        match egress.gateway_fd {
            Some(fd) => push(&mut args, &["--bind-fd", &fd.to_string(), protocol::SANDBOX_SOCKET]),
            None => push(&mut args, &["--bind", &lossy(&egress.gateway_socket), protocol::SANDBOX_SOCKET]),
        }
    }
    spec.workspace.bind_args(&mut args, spec.workspace_fds);
    caller_binds(&mut args, spec);
    let cwd = match spec.cwd {
        Some(rel) if !rel.is_empty() && rel != "." => format!("{}/{}", spec.workspace.mount_point(), rel),
        _ => spec.workspace.mount_point(),
    };
    push(&mut args, &["--chdir", &cwd, "--clearenv"]);
    let env = environment(spec, python_packages.is_some());
    for (k, v) in &env {
        push(&mut args, &["--setenv", k, v]);
    }
    let command = command(spec, python_packages.is_some());
    SandboxCommand { options: args, command, env, cwd, seccomp: spec.profile }
}

/// The host's read-only system, `/proc`, a fresh `/dev` with the chips, the sized tmpfs
/// mounts, the interpreter masks and the accelerator files, in the original's order.
fn system_mounts(args: &mut Vec<String>, spec: &BwrapSpec<'_>) {
    push(args, &["--die-with-parent", "--new-session", "--unshare-all", "--unshare-user"]);
    if spec.shape.disable_userns {
        push(args, &["--disable-userns"]);
    }
    push(args, &["--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]);
    args.extend(spec.host.bind_args());
    push(args, &["--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib"]);
    push(args, &["--symlink", "usr/lib64", "/lib64"]);
    match spec.shape.proc_mode {
        // The host's /proc/sys seen from inside: sysctls resolve in the reader's namespaces.
        ProcMode::New => push(args, &["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]),
        ProcMode::Bind => push(args, &["--ro-bind", "/proc", "/proc"]),
    }
    let (tmp_size, shm_size) = tmpfs_sizes(spec.tmp_bytes);
    // bwrap ≥ 0.7 applies `--size` to the next `--tmpfs`.
    push(args, &["--dev", "/dev", "--size", &shm_size.to_string(), "--tmpfs", "/dev/shm"]);
    // Chips after the fresh /dev, never the host's /dev (internals §4.4).
    let accel_binds = spec.accel.map(|a| a.binds.as_slice()).unwrap_or_default();
    for bind in accel_binds.iter().filter(|b| b.device) {
        push(args, &["--dev-bind", &lossy(&bind.source), &bind.target]);
    }
    push(args, &["--remount-ro", "/dev"]);
    for target in spec.interpreter_masks {
        push(args, &["--ro-bind", "/dev/null", &lossy(target)]);
    }
    push(args, &["--size", &tmp_size.to_string(), "--tmpfs", "/tmp"]);
    // Accelerator files and tools after /tmp, which would otherwise cover one placed there.
    for bind in accel_binds.iter().filter(|b| !b.device) {
        push(args, &["--ro-bind", &lossy(&bind.source), &bind.target]);
    }
}

/// The skill package and extensions, then the caller's own binds, after the workspace.
fn caller_binds(args: &mut Vec<String>, spec: &BwrapSpec<'_>) {
    if let Some(s) = spec.skills {
        let (skills, extensions) = (SKILLS_MOUNT, EXTENSIONS_MOUNT);
        match s.fds {
            Some((p, e)) => {
                push(args, &["--ro-bind-fd", &p.to_string(), skills, "--bind-fd", &e.to_string(), extensions])
            }
            None => push(
                args,
                &["--ro-bind", &lossy(&s.packages), skills, "--bind", &lossy(&s.extensions), extensions],
            ),
        }
    }
    for b in spec.binds {
        let target = lossy(&b.target);
        match (b.fd, b.writable) {
            (Some(fd), true) => push(args, &["--bind-fd", &fd.to_string(), &target]),
            (Some(fd), false) => push(args, &["--ro-bind-fd", &fd.to_string(), &target]),
            (None, true) => push(args, &["--bind", &lossy(&b.source), &target]),
            (None, false) => push(args, &["--ro-bind", &lossy(&b.source), &target]),
        }
    }
}

/// The environment after `--clearenv`, in the order it is set (`python_packages`: the
/// operator's packages are mounted).
fn environment(spec: &BwrapSpec<'_>, python_packages: bool) -> Vec<(String, String)> {
    let path = match (spec.science_env.is_some(), spec.language) {
        (false, _) => "/usr/bin:/bin",
        (true, Language::Shell) => "/opt/science-env/bin:/usr/bin:/bin",
        (true, Language::Python | Language::R) => "/opt/science-env/bin:/usr/bin",
    };
    let accel = spec.accel.filter(|a| !a.is_empty());
    let path = match accel {
        Some(a) if a.path_prefix => format!("/usr/local/bin:{path}"),
        _ => path.to_owned(),
    };
    let mut env: Vec<(String, String)> = vec![("HOME".into(), "/tmp".into()), ("PATH".into(), path)];
    let python_path: Vec<&str> = python_packages
        .then_some(PYTHON_PACKAGES_MOUNT)
        .into_iter()
        .chain(accel.iter().flat_map(|a| a.python_path.iter().map(String::as_str)))
        .collect();
    if !python_path.is_empty() {
        env.push(("PYTHONPATH".into(), python_path.join(":")));
    }
    if spec.language == Language::Python || python_packages {
        env.push(("PYTHONNOUSERSITE".into(), "1".into()));
    }
    if spec.language == Language::R {
        env.push(("R_ENVIRON_USER".into(), "/dev/null".into()));
    }
    if spec.skills.is_some() {
        env.push((SKILLS_DIR_VAR.into(), SKILLS_MOUNT.into()));
        env.push((EXTENSIONS_DIR_VAR.into(), EXTENSIONS_MOUNT.into()));
    }
    env.extend(spec.host.env());
    if let Some(a) = accel {
        env.extend(a.env.iter().cloned());
    }
    if spec.egress.is_some() {
        env.extend(
            protocol::PROXY_VARIABLES.iter().map(|k| ((*k).to_owned(), protocol::PROXY_URL.to_owned())),
        );
    }
    env.extend(spec.extra_env.iter().cloned());
    env
}

/// The command after the options: the language's interpreter (or the caller's command),
/// behind the egress bridge in a network sandbox.
fn command(spec: &BwrapSpec<'_>, python_packages: bool) -> Vec<String> {
    let python = if spec.science_env.is_some() { "/opt/science-env/bin/python" } else { spec.python };
    let command: &[&str] = match spec.language {
        Language::Shell => &["/usr/bin/bash", "--noprofile", "--norc", "-euo", "pipefail", "-s"],
        // `-I` would ignore PYTHONPATH: dropped when the python-packages are bound.
        Language::Python if python_packages => &[python, "-"],
        Language::Python => &[python, "-I", "-"],
        Language::R => &["/opt/science-env/bin/R", "--vanilla", "--slave"],
    };
    let command: Vec<&str> = match spec.command {
        Some(c) => c.iter().map(String::as_str).collect(),
        None => command.to_vec(),
    };
    let mut argv: Vec<String> = Vec::with_capacity(command.len() + 6);
    if spec.egress.is_some() {
        let port = protocol::BRIDGE_PORT.to_string();
        argv.extend(
            [protocol::SANDBOX_BRIDGE, "--socket", protocol::SANDBOX_SOCKET, "--port", &port, "--"]
                .map(str::to_owned),
        );
    }
    argv.extend(command.iter().map(|s| (*s).to_owned()));
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostRuntime {
        HostRuntime::default()
    }

    fn spec<'a>(host: &'a HostRuntime, ws: &'a WorkspaceLayout, shape: SandboxShape) -> BwrapSpec<'a> {
        BwrapSpec::new(shape, host, ws, Language::Shell)
    }

    const FULL: SandboxShape = SandboxShape { proc_mode: ProcMode::New, disable_userns: true };

    fn plain() -> WorkspaceLayout {
        WorkspaceLayout::new("/data/projects/p/ws".into(), None)
    }

    fn position(args: &[String], window: &[&str]) -> Option<usize> {
        args.windows(window.len()).position(|w| w.iter().zip(window).all(|(a, b)| a == b))
    }

    #[test]
    fn full_profile_in_the_original_order() {
        let h = host();
        let ws = plain();
        let cmd = build(&spec(&h, &ws, FULL));
        let expected: Vec<&str> = vec![
            "--die-with-parent",
            "--new-session",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--cap-drop",
            "ALL",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--proc",
            "/proc",
            "--ro-bind",
            "/proc/sys",
            "/proc/sys",
            "--dev",
            "/dev",
            "--size",
            "67108864",
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            "1073741824",
            "--tmpfs",
            "/tmp",
            "--bind",
            "/data/projects/p/ws",
            "/workspace",
            "--chdir",
            "/workspace",
            "--clearenv",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "/usr/bin/bash",
            "--noprofile",
            "--norc",
            "-euo",
            "pipefail",
            "-s",
        ];
        assert_eq!(cmd.args(), expected);
        assert_eq!(cmd.cwd, "/workspace");
        assert_eq!(cmd.seccomp, Profile::Baseline);
    }

    #[test]
    fn skills_bind_after_the_workspace_and_their_variables_follow_the_language_ones() {
        let h = host();
        let ws = plain();
        let by_path = SkillsMount {
            packages: "/data/projects/.skill-packages/abc".into(),
            extensions: "/data/projects/p/ws/.sciencediscovery/skill-extensions".into(),
            fds: None,
        };
        let by_fd = SkillsMount { fds: Some((7, 8)), ..by_path.clone() };
        for (mount, binds) in [
            (
                &by_path,
                vec![
                    "--ro-bind",
                    "/data/projects/.skill-packages/abc",
                    "/skills",
                    "--bind",
                    "/data/projects/p/ws/.sciencediscovery/skill-extensions",
                    "/skill-extensions",
                ],
            ),
            (&by_fd, vec!["--ro-bind-fd", "7", "/skills", "--bind-fd", "8", "/skill-extensions"]),
        ] {
            let mut s = spec(&h, &ws, FULL);
            s.language = Language::Python;
            s.skills = Some(mount);
            let cmd = build(&s);
            let at = position(&cmd.options, &binds).expect("skill binds");
            let workspace = position(&cmd.options, &["--bind", "/data/projects/p/ws", "/workspace"]).unwrap();
            assert!(workspace < at, "after the workspace (internals §2.2 item 20)");
            let keys: Vec<&str> = cmd.env.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(
                keys,
                [
                    "HOME",
                    "PATH",
                    "PYTHONNOUSERSITE",
                    "SCIENCEDISCOVERY_SKILLS_DIR",
                    "SCIENCEDISCOVERY_SKILL_EXTENSIONS_DIR"
                ]
            );
            assert_eq!(cmd.env[3].1, "/skills");
            assert_eq!(cmd.env[4].1, "/skill-extensions");
        }
    }

    #[test]
    fn a_plain_launch_sets_exactly_home_and_path() {
        let h = host();
        let ws = plain();
        let cmd = build(&spec(&h, &ws, FULL));
        let keys: Vec<&str> = cmd.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["HOME", "PATH"]);
        assert_eq!(cmd.env[0].1, "/tmp");
        assert_eq!(cmd.env[1].1, "/usr/bin:/bin");
    }

    #[test]
    fn baseline_isolation_is_always_present() {
        let h = host();
        let ws = plain();
        for proc_mode in [ProcMode::New, ProcMode::Bind] {
            for disable_userns in [true, false] {
                let cmd = build(&spec(&h, &ws, SandboxShape { proc_mode, disable_userns }));
                let a = &cmd.args();
                for flag in
                    ["--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv"]
                {
                    assert!(a.iter().any(|x| x == flag), "{flag}");
                }
                assert!(position(a, &["--cap-drop", "ALL"]).is_some());
                // The launcher owns the descriptor options.
                assert!(!a.iter().any(|x| x == "--seccomp" || x == "--info-fd"));
                assert!(!a.iter().any(|x| x == "--share-net"));
                let first_ro = position(a, &["--ro-bind"]).unwrap();
                assert_eq!(a[first_ro + 1], "/usr");
                assert!(
                    position(a, &["--proc", "/proc"]).is_some()
                        || position(a, &["--ro-bind", "/proc", "/proc"]).is_some()
                );
                if disable_userns {
                    let u = position(a, &["--unshare-user"]).unwrap();
                    assert_eq!(position(a, &["--disable-userns"]), Some(u + 1));
                }
            }
        }
    }

    #[test]
    fn degradations_change_only_their_own_tokens() {
        let h = host();
        let ws = plain();
        let full = build(&spec(&h, &ws, FULL)).args();
        let bind =
            build(&spec(&h, &ws, SandboxShape { proc_mode: ProcMode::Bind, disable_userns: true })).args();
        let no_userns =
            build(&spec(&h, &ws, SandboxShape { proc_mode: ProcMode::New, disable_userns: false })).args();
        let both =
            build(&spec(&h, &ws, SandboxShape { proc_mode: ProcMode::Bind, disable_userns: false })).args();

        let p = position(&full, &["--proc", "/proc"]).unwrap();
        let mut expected = full.clone();
        // The fresh procfs and its read-only /proc/sys give way to one read-only bind.
        expected.splice(p..p + 5, ["--ro-bind".to_owned(), "/proc".to_owned(), "/proc".to_owned()]);
        assert_eq!(bind, expected);

        let mut expected = full.clone();
        expected.retain(|a| a != "--disable-userns");
        assert_eq!(no_userns, expected);

        let mut expected = bind.clone();
        expected.retain(|a| a != "--disable-userns");
        assert_eq!(both, expected);
    }

    #[test]
    fn workspace_layouts() {
        let cases: &[(&str, Option<&str>, &[&str], &str)] = &[
            ("/d/ws", None, &["--bind", "/d/ws", "/workspace"], "/workspace"),
            (
                "/d/sub",
                Some("/d/parent"),
                &["--ro-bind", "/d/parent", "/parent_workspace", "--bind", "/d/sub", "/workspace"],
                "/workspace",
            ),
            (
                "/d/parent/subagents/a",
                Some("/d/parent"),
                &[
                    "--ro-bind",
                    "/d/parent",
                    "/workspace",
                    "--bind",
                    "/d/parent/subagents/a",
                    "/workspace/subagents/a",
                ],
                "/workspace/subagents/a",
            ),
            // The same directory is not "nested".
            (
                "/d/p",
                Some("/d/p"),
                &["--ro-bind", "/d/p", "/parent_workspace", "--bind", "/d/p", "/workspace"],
                "/workspace",
            ),
            // A sibling whose name merely starts with the parent's is not nested either.
            (
                "/d/parent2",
                Some("/d/parent"),
                &["--ro-bind", "/d/parent", "/parent_workspace", "--bind", "/d/parent2", "/workspace"],
                "/workspace",
            ),
        ];
        let h = host();
        for (root, parent, binds, cwd) in cases {
            let ws = WorkspaceLayout::new(root.into(), parent.map(PathBuf::from));
            let cmd = build(&spec(&h, &ws, FULL));
            assert!(position(&cmd.args(), binds).is_some(), "{root}: {:?}", cmd.args());
            assert_eq!(cmd.cwd, *cwd);
            assert!(position(&cmd.args(), &["--chdir", cwd]).is_some());
        }
    }

    #[test]
    fn workspaces_bound_from_descriptors() {
        let h = host();
        let cases = [
            (WorkspaceLayout::new("/d/ws".into(), None), vec!["--bind-fd", "5", "/workspace"]),
            (
                WorkspaceLayout::new("/d/sub".into(), Some("/d/parent".into())),
                vec!["--ro-bind-fd", "6", "/parent_workspace", "--bind-fd", "5", "/workspace"],
            ),
            (
                WorkspaceLayout::new("/d/p/sub".into(), Some("/d/p".into())),
                vec!["--ro-bind-fd", "6", "/workspace", "--bind-fd", "5", "/workspace/sub"],
            ),
        ];
        for (ws, expected) in cases {
            let mut s = spec(&h, &ws, FULL);
            s.workspace_fds = Some(WorkspaceFds { root: 5, read_only: Some(6) });
            let args = build(&s).args();
            assert!(position(&args, &expected).is_some(), "{args:?}");
            assert!(!args.iter().any(|a| a.starts_with("/d/")), "no host path left: {args:?}");
        }
    }

    #[test]
    fn explicit_cwd_is_under_the_mount_point() {
        let h = host();
        let ws = WorkspaceLayout::new("/d/p/sub".into(), Some("/d/p".into()));
        let mut s = spec(&h, &ws, FULL);
        s.cwd = Some("analysis/run1");
        assert_eq!(build(&s).cwd, "/workspace/sub/analysis/run1");
        s.cwd = Some(".");
        assert_eq!(build(&s).cwd, "/workspace/sub");
    }

    #[test]
    fn languages() {
        let h = host();
        let ws = plain();
        let mut s = spec(&h, &ws, FULL);
        s.language = Language::Python;
        let cmd = build(&s);
        assert!(cmd.args().ends_with(&["/usr/bin/python3".into(), "-I".into(), "-".into()]));
        assert_eq!(
            cmd.env.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["HOME", "PATH", "PYTHONNOUSERSITE"]
        );
        s.language = Language::R;
        let cmd = build(&s);
        assert!(cmd.args().ends_with(&[
            "/opt/science-env/bin/R".into(),
            "--vanilla".into(),
            "--slave".into()
        ]));
        assert_eq!(cmd.env[2], ("R_ENVIRON_USER".into(), "/dev/null".into()));
    }

    #[test]
    fn python_packages_table() {
        let h = host();
        let ws = plain();
        let packages = PathBuf::from("/data/python-packages/py3.12");
        let env_prefix = PathBuf::from("/data/scientific-envs/envs/e");
        let bind = ["--ro-bind", "/data/python-packages/py3.12", PYTHON_PACKAGES_MOUNT];
        // (language, packages, science env, env keys, bound, command tail)
        type Case<'a> = (Language, bool, bool, &'a [&'a str], bool, &'a [&'a str]);
        let cases: &[Case] = &[
            (Language::Python, false, false, &["HOME", "PATH", "PYTHONNOUSERSITE"], false, &["-I", "-"]),
            (
                Language::Python,
                true,
                false,
                &["HOME", "PATH", "PYTHONPATH", "PYTHONNOUSERSITE"],
                true,
                &["/usr/bin/python3", "-"],
            ),
            (
                Language::Shell,
                true,
                false,
                &["HOME", "PATH", "PYTHONPATH", "PYTHONNOUSERSITE"],
                true,
                &["-s"],
            ),
            (Language::Shell, false, false, &["HOME", "PATH"], false, &["-s"]),
            // A managed environment wins: no bind, no PYTHONPATH, `-I` stays.
            (Language::Python, true, true, &["HOME", "PATH", "PYTHONNOUSERSITE"], false, &["-I", "-"]),
        ];
        for (language, with_packages, with_env, keys, bound, tail) in cases {
            let mut s = spec(&h, &ws, FULL);
            s.language = *language;
            s.python_packages = with_packages.then_some(packages.as_path());
            s.science_env = with_env.then_some(env_prefix.as_path());
            let cmd = build(&s);
            let case = format!("{language:?} packages={with_packages} env={with_env}");
            assert_eq!(cmd.env.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), *keys, "{case}");
            assert_eq!(position(&cmd.options, &bind).is_some(), *bound, "{case}");
            let tail: Vec<String> = tail.iter().map(|s| s.to_string()).collect();
            assert!(cmd.command.ends_with(&tail), "{case}: {:?}", cmd.command);
            if *bound {
                assert!(cmd.env.contains(&("PYTHONPATH".into(), PYTHON_PACKAGES_MOUNT.into())), "{case}");
                // Bound before the workspace, after /tmp (the original's item 17).
                let at = position(&cmd.options, &bind).unwrap();
                assert!(at > position(&cmd.options, &["--tmpfs", "/tmp"]).unwrap(), "{case}");
                assert!(at < position(&cmd.options, &["/workspace"]).unwrap(), "{case}");
            }
        }
    }

    #[test]
    fn science_environment_mounts_read_only_and_leads_path() {
        let h = host();
        let ws = plain();
        let prefix = PathBuf::from("/data/scientific-envs/envs/starter-python");
        let mut s = spec(&h, &ws, FULL);
        s.science_env = Some(&prefix);
        let cases = [
            (Language::Shell, "/opt/science-env/bin:/usr/bin:/bin", "/usr/bin/bash"),
            (Language::Python, "/opt/science-env/bin:/usr/bin", "/opt/science-env/bin/python"),
            (Language::R, "/opt/science-env/bin:/usr/bin", "/opt/science-env/bin/R"),
        ];
        for (language, path, program) in cases {
            s.language = language;
            let cmd = build(&s);
            let p = prefix.to_str().unwrap();
            let bind =
                position(&cmd.options, &["--ro-bind", p, "/opt/science-env", "--ro-bind", p, p]).unwrap();
            assert!(bind > position(&cmd.options, &["--tmpfs", "/tmp"]).unwrap());
            assert!(bind < position(&cmd.options, &["--bind"]).unwrap());
            assert_eq!(cmd.env[1], ("PATH".into(), path.into()), "{language:?}");
            assert_eq!(cmd.command[0], program);
        }
    }

    #[test]
    fn extra_binds_follow_the_workspace_by_descriptor_or_path_and_their_variables_come_last() {
        let h = host();
        let ws = plain();
        let binds = [
            ExtraBind { source: "/d/p".into(), target: "/d/p".into(), writable: true, fd: Some(7) },
            ExtraBind { source: "/d/c".into(), target: "/d/c".into(), writable: false, fd: Some(8) },
            ExtraBind { source: "/d/w".into(), target: "/d/w".into(), writable: true, fd: None },
            ExtraBind { source: "/d/r".into(), target: "/x/r".into(), writable: false, fd: None },
        ];
        let env = [("PIP_NO_INDEX".to_owned(), "1".to_owned())];
        let mut s = spec(&h, &ws, FULL);
        s.binds = &binds;
        s.extra_env = &env;
        let cmd = build(&s);
        let first = position(&cmd.options, &["--bind-fd", "7", "/d/p"]).unwrap();
        assert!(first > position(&cmd.options, &["--bind"]).unwrap(), "after the workspace");
        for (at, items) in [
            (first, &["--bind-fd", "7", "/d/p"][..]),
            (first + 3, &["--ro-bind-fd", "8", "/d/c"]),
            (first + 6, &["--bind", "/d/w", "/d/w"]),
            (first + 9, &["--ro-bind", "/d/r", "/x/r"]),
        ] {
            assert_eq!(position(&cmd.options, items), Some(at), "{items:?}");
        }
        assert_eq!(cmd.env.last().unwrap(), &env[0]);
    }

    #[test]
    fn every_tmpfs_is_sized_and_0_takes_the_fallback() {
        let h = host();
        let ws = plain();
        let mut s = spec(&h, &ws, FULL);
        let mib = |n: u64| (n << 20).to_string();
        for (bytes, tmp, shm) in [
            (0u64, FALLBACK_TMP_BYTES.to_string(), mib(64)),
            (8 << 20, mib(8), mib(8)),
            (512 << 20, mib(512), mib(64)),
        ] {
            s.tmp_bytes = bytes;
            let args = build(&s).args();
            assert!(position(&args, &["--size", &tmp, "--tmpfs", "/tmp"]).is_some(), "{bytes}: {args:?}");
            assert!(position(&args, &["--size", &shm, "--tmpfs", "/dev/shm"]).is_some(), "{bytes}: {args:?}");
            // No other tmpfs, and every one right after its size.
            let tmpfs: Vec<usize> =
                args.iter().enumerate().filter(|(_, a)| *a == "--tmpfs").map(|(i, _)| i).collect();
            assert_eq!(tmpfs.len(), 2);
            assert!(tmpfs.iter().all(|i| args[i - 2] == "--size"), "{args:?}");
        }
    }

    #[test]
    fn proc_sys_and_dev_are_read_only_and_device_binds_come_first() {
        let h = host();
        let ws = plain();
        let args = build(&spec(&h, &ws, FULL)).args();
        let proc = position(&args, &["--proc", "/proc"]).unwrap();
        assert_eq!(position(&args, &["--ro-bind", "/proc/sys", "/proc/sys"]), Some(proc + 2));
        let ro_dev = position(&args, &["--remount-ro", "/dev"]).unwrap();
        assert!(ro_dev > position(&args, &["--tmpfs", "/dev/shm"]).unwrap());
        assert!(ro_dev < position(&args, &["--tmpfs", "/tmp"]).unwrap());
    }

    #[test]
    fn interpreter_masks_bind_dev_null_over_targets_before_tmp() {
        let h = host();
        let ws = plain();
        let masks = vec![PathBuf::from("/usr/bin/python3.11"), PathBuf::from("/usr/lib/R/bin/exec/R")];
        let mut s = spec(&h, &ws, FULL);
        s.interpreter_masks = &masks;
        let args = build(&s).args();
        let m = position(&args, &["--ro-bind", "/dev/null", "/usr/bin/python3.11"]).unwrap();
        assert!(position(&args, &["--ro-bind", "/dev/null", "/usr/lib/R/bin/exec/R"]).is_some());
        assert!(m > position(&args, &["--dev", "/dev"]).unwrap());
        assert!(m < position(&args, &["--tmpfs", "/tmp"]).unwrap());
    }

    #[test]
    fn host_runtime_flows_into_binds_and_env() {
        let h = HostRuntime {
            ro_binds: vec!["/etc/alternatives".into(), "/etc/ssl/certs".into()],
            env: vec![("SSL_CERT_FILE".into(), "/etc/ssl/certs/ca-certificates.crt".into())],
        };
        let ws = plain();
        let cmd = build(&spec(&h, &ws, FULL));
        let usr = position(&cmd.args(), &["--ro-bind", "/usr", "/usr"]).unwrap();
        assert_eq!(
            position(&cmd.args(), &["--ro-bind", "/etc/alternatives", "/etc/alternatives"]),
            Some(usr + 3)
        );
        assert!(position(&cmd.args(), &["--ro-bind", "/etc/ssl/certs", "/etc/ssl/certs"]).is_some());
        assert_eq!(cmd.env[2].0, "SSL_CERT_FILE");
    }

    #[test]
    fn a_network_sandbox_still_has_no_network_and_reaches_out_only_through_the_bridge() {
        let h = host();
        let ws = plain();
        let mount = EgressMount {
            bridge: "/usr/libexec/x/egress-bridge".into(),
            gateway_socket: "/run/egressd/eg/0123456789abcdef".into(),
            gateway_fd: None,
        };
        let mut s = spec(&h, &ws, FULL);
        let none = build(&s);
        assert!(none.options.iter().all(|a| a != "--share-net" && !a.contains("egress")));
        assert_eq!(none.seccomp, Profile::Baseline);
        assert_eq!(none.command[0], "/usr/bin/bash");
        s.egress = Some(&mount);
        let cmd = build(&s);
        assert!(cmd.options.contains(&"--unshare-all".to_owned()));
        assert!(!cmd.options.contains(&"--share-net".to_owned()));
        let socket_bind = position(
            &cmd.options,
            &["--bind", "/run/egressd/eg/0123456789abcdef", "/run/sciencediscovery/egress.sock"],
        );
        let bridge_bind = position(
            &cmd.options,
            &["--ro-bind", "/usr/libexec/x/egress-bridge", "/opt/sciencediscovery-net/egress-bridge"],
        );
        let workspace = position(&cmd.options, &["--bind", "/data/projects/p/ws", "/workspace"]).unwrap();
        assert!(
            bridge_bind.unwrap() < socket_bind.unwrap() && socket_bind.unwrap() < workspace,
            "egress binds come before the workspace (original §2.2 item 18)"
        );
        let keys: Vec<&str> = cmd.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["HOME", "PATH", "HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"]);
        assert!(cmd.env[2..].iter().all(|(_, v)| v == "http://127.0.0.1:18118"));
        assert_eq!(
            cmd.command[..6],
            [
                "/opt/sciencediscovery-net/egress-bridge",
                "--socket",
                "/run/sciencediscovery/egress.sock",
                "--port",
                "18118",
                "--"
            ]
        );
        assert_eq!(cmd.command[6], "/usr/bin/bash");
        assert_eq!(cmd.seccomp, s.profile, "the command carries the caller's profile");
        assert_eq!(profile(true, false), Profile::Network);
        let by_fd = EgressMount { gateway_fd: Some(7), ..mount.clone() };
        s.egress = Some(&by_fd);
        let cmd = build(&s);
        assert!(position(&cmd.options, &["--bind-fd", "7", "/run/sciencediscovery/egress.sock"]).is_some());
        assert!(!cmd.options.iter().any(|a| a.contains("0123456789abcdef")));
    }
}
