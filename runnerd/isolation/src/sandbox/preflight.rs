//! Start-up preflight (R-SBX-1..3, R-API-5): does the bwrap binary have the options we
//! need, and which sandbox form does this host allow? Decided by real probe sandboxes,
//! never by version numbers or `--help` text alone, in the original's order: first the
//! `/proc` form, then `--disable-userns` on that form (internals §2.8).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::OnceCell;

use super::argv::{ProcMode, SandboxShape};
use crate::isolation::bubblewrap;
use crate::launch::{Launcher, OutputBudget, Termination};

/// What `bwrap --help` must list.
pub const REQUIRED_OPTIONS: [&str; 6] =
    ["--cap-drop", "--die-with-parent", "--new-session", "--seccomp", "--unshare-all", "--unshare-user"];

/// The original's probe timeout and output cap.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(15_000);
const PROBE_OUTPUT_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("Could not execute bubblewrap at \"{path}\": spawn {path} {code}")]
    Missing { path: String, code: &'static str },
    #[error("Could not execute bubblewrap at \"{path}\"")]
    Unrunnable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bubblewrap at \"{path}\" lacks required sandbox options: {}", missing.join(", "))]
    LacksOptions { path: String, missing: Vec<&'static str> },
}

/// Which of [`REQUIRED_OPTIONS`] the help text does not mention.
pub fn missing_options(help: &str) -> Vec<&'static str> {
    REQUIRED_OPTIONS
        .iter()
        .copied()
        .filter(|opt| {
            !help
                .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[')
                .any(|word| word == *opt)
        })
        .collect()
}

/// Resolves a configured bwrap (`bwrap` by default) to an absolute path: a name without a
/// slash is searched in `path_env`, like the original's spawn does.
pub fn resolve_bwrap(configured: &str, path_env: Option<&OsStr>) -> Result<PathBuf, PreflightError> {
    let missing = || PreflightError::Missing { path: configured.to_owned(), code: "ENOENT" };
    if configured.contains('/') {
        let p = Path::new(configured);
        return if p.exists() {
            std::fs::canonicalize(p)
                .map_err(|source| PreflightError::Unrunnable { path: configured.into(), source })
        } else {
            Err(missing())
        };
    }
    let path_env = path_env.unwrap_or(OsStr::new("/usr/local/bin:/usr/bin:/bin"));
    std::env::split_paths(path_env)
        .map(|dir| dir.join(configured))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(missing)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Optional bwrap features we use when present.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BwrapFeatures {
    /// `--bind-fd`/`--ro-bind-fd` (bwrap ≥ 0.8): bind the directory runnerd opened and
    /// checked, not whatever a path names by the time bwrap mounts it.
    pub bind_fd: bool,
}

/// Runs `bwrap --help` (not a sandbox: a plain child), checks the six required options and
/// reports the optional ones.
pub async fn check_bwrap_options(bwrap: &Path) -> Result<BwrapFeatures, PreflightError> {
    let path = bwrap.to_string_lossy().into_owned();
    let help = tokio::process::Command::new(bwrap)
        .arg("--help")
        .env_clear()
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(PROBE_TIMEOUT, help)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::other(format!(
                "--help did not finish within {} ms",
                PROBE_TIMEOUT.as_millis()
            )))
        })
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => PreflightError::Missing { path: path.clone(), code: "ENOENT" },
            _ => PreflightError::Unrunnable { path: path.clone(), source },
        })?;
    let mut help = String::from_utf8_lossy(&out.stdout).into_owned();
    help.push_str(&String::from_utf8_lossy(&out.stderr));
    let missing = missing_options(&help);
    if !missing.is_empty() {
        return Err(PreflightError::LacksOptions { path, missing });
    }
    let has = |opt: &str| help.split(|c: char| c.is_whitespace() || c == ',').any(|w| w == opt);
    Ok(BwrapFeatures { bind_fd: has("--bind-fd") && has("--ro-bind-fd") })
}

/// The probe argv of the original (internals §2.8).
pub fn probe_args(proc_mode: ProcMode, disable_userns: bool) -> Vec<String> {
    let mut args = vec!["--unshare-all", "--unshare-user", "--die-with-parent"];
    if disable_userns {
        args.push("--disable-userns");
    }
    args.extend([
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
    ]);
    args.extend(["--symlink", "usr/lib64", "/lib64"]);
    match proc_mode {
        ProcMode::New => args.extend(["--proc", "/proc"]),
        ProcMode::Bind => args.extend(["--ro-bind", "/proc", "/proc"]),
    }
    args.push("/usr/bin/true");
    args.into_iter().map(str::to_owned).collect()
}

/// Why `--disable-userns` is or is not used (or why there is no sandbox at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapabilityReason {
    Supported,
    OptionUnknown,
    OptionRejected,
    SandboxUnusable,
}

/// The probes' conclusion for one bwrap binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Capability {
    pub reason: CapabilityReason,
    pub sandbox_usable: bool,
    pub disable_userns: bool,
    pub proc_mode: ProcMode,
    pub proc_fallback: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proc_detail: Option<String>,
}

impl Capability {
    /// The shape executions use; `None` when no sandbox can be built.
    pub fn shape(&self) -> Option<SandboxShape> {
        self.sandbox_usable
            .then_some(SandboxShape { proc_mode: self.proc_mode, disable_userns: self.disable_userns })
    }
}

/// Runs one probe sandbox; `Err` carries the failure detail (last non-empty stderr line).
pub trait Prober {
    fn probe(
        &self,
        proc_mode: ProcMode,
        disable_userns: bool,
    ) -> impl Future<Output = Result<(), String>> + Send;
}

/// The decision sequence: `/proc` form first, then `--disable-userns` on that form.
pub async fn detect(prober: &impl Prober) -> Capability {
    let (proc_mode, proc_detail) = match prober.probe(ProcMode::New, false).await {
        Ok(()) => (ProcMode::New, None),
        Err(new_detail) => match prober.probe(ProcMode::Bind, false).await {
            Ok(()) => (ProcMode::Bind, Some(new_detail)),
            Err(_) => {
                return Capability {
                    reason: CapabilityReason::SandboxUnusable,
                    sandbox_usable: false,
                    disable_userns: false,
                    proc_mode: ProcMode::New,
                    proc_fallback: false,
                    detail: non_empty(new_detail),
                    proc_detail: None,
                };
            }
        },
    };
    let proc_fallback = proc_mode == ProcMode::Bind;
    let proc_detail = proc_detail.and_then(non_empty);
    match prober.probe(proc_mode, true).await {
        Ok(()) => Capability {
            reason: CapabilityReason::Supported,
            sandbox_usable: true,
            disable_userns: true,
            proc_mode,
            proc_fallback,
            detail: None,
            proc_detail,
        },
        Err(detail) => Capability {
            reason: if detail.to_ascii_lowercase().contains("unknown option") {
                CapabilityReason::OptionUnknown
            } else {
                CapabilityReason::OptionRejected
            },
            sandbox_usable: true,
            disable_userns: false,
            proc_mode,
            proc_fallback,
            detail: non_empty(detail),
            proc_detail,
        },
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Probes through the real launch path (sandbox-init, no seccomp, 15 s, 1 MiB of output).
#[derive(Debug)]
pub struct LaunchProber<'a> {
    pub launcher: &'a Launcher,
    pub bwrap: &'a Path,
}

impl Prober for LaunchProber<'_> {
    async fn probe(&self, proc_mode: ProcMode, disable_userns: bool) -> Result<(), String> {
        let mut options = probe_args(proc_mode, disable_userns);
        let command = options.split_off(options.len() - 1);
        let mut output = OutputBudget::new(PROBE_OUTPUT_BYTES);
        let (slots, timeout) = (Default::default(), PROBE_TIMEOUT);
        match bubblewrap::probe(self.launcher, self.bwrap, options, command, slots, timeout, &mut output)
            .await
        {
            Ok(outcome) => {
                let stderr = output.finish().stderr;
                let last =
                    stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_owned();
                match outcome.termination {
                    Termination::Exited(0) => Ok(()),
                    Termination::TimedOut => Err(format!(
                        "the probe sandbox did not finish within {} ms",
                        PROBE_TIMEOUT.as_millis()
                    )),
                    _ => Err(last),
                }
            }
            Err(e) => Err(common::error_chain(&e)),
        }
    }
}

/// Conclusions cached per bwrap path and shared by concurrent callers: the first caller
/// probes, the others wait for its answer.
#[derive(Debug, Default)]
pub struct CapabilityCache {
    entries: Mutex<HashMap<PathBuf, Arc<OnceCell<Capability>>>>,
}

impl CapabilityCache {
    pub async fn get(&self, launcher: &Launcher, bwrap: &Path) -> Capability {
        self.get_with(bwrap, &LaunchProber { launcher, bwrap }).await
    }

    pub async fn get_with(&self, bwrap: &Path, prober: &impl Prober) -> Capability {
        let cell = {
            let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            entries.entry(bwrap.to_owned()).or_default().clone()
        };
        cell.get_or_init(|| detect(prober)).await.clone()
    }

    /// Forgets every conclusion (tests; an operator-requested re-probe).
    pub fn reset(&self) {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// A start-up warning: a logger event name and the operator-facing text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub event: &'static str,
    pub text: String,
}

/// The original's hint after an unusable sandbox.
pub const SANDBOX_UNUSABLE_HINT: &str = "bubblewrap is installed but cannot create a sandbox on this host.
The Web UI and control API still start; run_python and run_shell will fail.
Check that unprivileged user namespaces are permitted:
  sysctl kernel.unprivileged_userns_clone             # 1 where the knob exists
  sysctl kernel.apparmor_restrict_unprivileged_userns # 0 on Ubuntu 24.04+";

/// `bubblewrap at "<path>" could not build a sandbox: <detail>` + the hint.
pub fn sandbox_unusable_message(path: &str, detail: Option<&str>) -> String {
    let detail = match detail {
        Some(d) => format!(": {d}"),
        None => ".".to_owned(),
    };
    format!("bubblewrap at \"{path}\" could not build a sandbox{detail}\n{SANDBOX_UNUSABLE_HINT}")
}

/// The warnings the original prints for a capability (internals §2.8), in order.
pub fn warnings(path: &str, cap: &Capability) -> Vec<Warning> {
    let mut out = Vec::new();
    if !cap.sandbox_usable {
        out.push(Warning {
            event: "sandbox_unusable",
            text: sandbox_unusable_message(path, cap.detail.as_deref()),
        });
        return out;
    }
    if cap.proc_fallback {
        let detail = cap.proc_detail.as_deref().unwrap_or("the sandbox probe failed with --proc /proc");
        out.push(Warning {
            event: "sandbox_proc_fallback",
            text: format!(
                "bubblewrap at \"{path}\" cannot mount a fresh /proc here: {detail}. Falling back to --ro-bind /proc /proc \
                 so executions still run. In this weaker profile the sandbox sees the container's /proc — that is, the \
                 surrounding container's process list — instead of only its own processes. Docker's default \
                 readonlyPaths/maskedPaths cause this; the supported deployment adds security_opt: \
                 systempaths=unconfined, which keeps the stronger fresh-procfs profile. Do not use privileged to work \
                 around it."
            ),
        });
    }
    match cap.reason {
        CapabilityReason::OptionUnknown => out.push(Warning {
            event: "sandbox_option_unavailable",
            text: format!(
                "bubblewrap at \"{path}\" does not support --disable-userns (requires bwrap >= 0.8; Ubuntu 22.04 ships \
                 0.6). Namespace isolation, seccomp and the mount allowlist still apply, but nested user namespaces \
                 inside executions are not blocked. Upgrade bubblewrap for the stronger profile."
            ),
        }),
        CapabilityReason::OptionRejected => out.push(Warning {
            event: "sandbox_option_unavailable",
            text: format!(
                "bubblewrap at \"{path}\" supports --disable-userns but cannot use it here: {}. This is expected under \
                 LXC and container runtimes that mount /proc/sys read-only, because the option works by writing \
                 user.max_user_namespaces. The option is omitted so executions still run. Namespace isolation, seccomp \
                 and the mount allowlist still apply, but nested user namespaces inside executions are not blocked.",
                cap.detail.as_deref().unwrap_or("the probe failed")
            ),
        }),
        CapabilityReason::Supported | CapabilityReason::SandboxUnusable => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const PROC_REFUSED: &str = "bwrap: Can't mount proc on /newroot/proc: Operation not permitted";
    const SYSCTL_RO: &str = "bwrap: cannot open /proc/sys/user/max_user_namespaces: Read-only file system";
    const UNKNOWN: &str = "bwrap: Unknown option --disable-userns";

    /// A host described by which probes fail and how.
    struct FakeHost {
        proc_new: Result<(), &'static str>,
        proc_bind: Result<(), &'static str>,
        disable_userns: Result<(), &'static str>,
        calls: AtomicUsize,
    }

    impl Prober for FakeHost {
        async fn probe(&self, proc_mode: ProcMode, disable_userns: bool) -> Result<(), String> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
            let base = match proc_mode {
                ProcMode::New => self.proc_new,
                ProcMode::Bind => self.proc_bind,
            };
            base.and(if disable_userns { self.disable_userns } else { Ok(()) }).map_err(str::to_owned)
        }
    }

    fn host(
        new: Result<(), &'static str>,
        bind: Result<(), &'static str>,
        userns: Result<(), &'static str>,
    ) -> FakeHost {
        FakeHost { proc_new: new, proc_bind: bind, disable_userns: userns, calls: AtomicUsize::new(0) }
    }

    #[tokio::test]
    async fn the_four_outcomes_and_both_proc_forms() {
        use CapabilityReason::*;
        let cases = [
            (host(Ok(()), Ok(()), Ok(())), Supported, true, ProcMode::New, true),
            (host(Err(PROC_REFUSED), Ok(()), Ok(())), Supported, true, ProcMode::Bind, true),
            (host(Ok(()), Ok(()), Err(UNKNOWN)), OptionUnknown, false, ProcMode::New, true),
            (host(Ok(()), Ok(()), Err(SYSCTL_RO)), OptionRejected, false, ProcMode::New, true),
            (host(Err(PROC_REFUSED), Ok(()), Err(SYSCTL_RO)), OptionRejected, false, ProcMode::Bind, true),
            (host(Err("bwrap: no"), Err("bwrap: no"), Ok(())), SandboxUnusable, false, ProcMode::New, false),
        ];
        for (i, (h, reason, userns, proc_mode, usable)) in cases.into_iter().enumerate() {
            let cap = detect(&h).await;
            assert_eq!(
                (cap.reason, cap.disable_userns, cap.proc_mode, cap.sandbox_usable),
                (reason, userns, proc_mode, usable),
                "case {i}"
            );
            assert_eq!(cap.proc_fallback, proc_mode == ProcMode::Bind && usable);
            if cap.proc_fallback {
                assert_eq!(cap.proc_detail.as_deref(), Some(PROC_REFUSED));
            }
        }
    }

    #[tokio::test]
    async fn concurrent_callers_share_one_detection() {
        let cache = CapabilityCache::default();
        let h = host(Ok(()), Ok(()), Ok(()));
        let path = Path::new("/usr/bin/bwrap");
        let (a, b) = tokio::join!(cache.get_with(path, &h), cache.get_with(path, &h));
        let c = cache.get_with(path, &h).await;
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(h.calls.load(Ordering::SeqCst), 2);
        cache.reset();
        cache.get_with(path, &h).await;
        assert_eq!(h.calls.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn option_parsing() {
        let full = "usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]\n    --unshare-user  x\n    --unshare-all\n    --seccomp FD\n    --die-with-parent\n    --new-session\n    --cap-drop CAP\n";
        assert!(missing_options(full).is_empty());
        let old = full.replace("--seccomp FD", "--seccomp-old");
        assert_eq!(missing_options(&old), ["--seccomp"]);
        assert_eq!(missing_options("").len(), 6);
    }

    #[test]
    fn option_error_text_matches_the_original() {
        let e = PreflightError::LacksOptions {
            path: "/opt/bwrap".into(),
            missing: vec!["--seccomp", "--cap-drop"],
        };
        assert_eq!(
            e.to_string(),
            "bubblewrap at \"/opt/bwrap\" lacks required sandbox options: --seccomp, --cap-drop"
        );
        let e = resolve_bwrap("/nonexistent/bwrap", None).unwrap_err();
        assert_eq!(
            common::error_chain(&e),
            "Could not execute bubblewrap at \"/nonexistent/bwrap\": spawn /nonexistent/bwrap ENOENT"
        );
        let e = resolve_bwrap("no-such-bwrap", Some(OsStr::new("/usr/bin"))).unwrap_err();
        assert!(e.to_string().contains("ENOENT"));
    }

    #[test]
    fn probe_argv() {
        assert_eq!(
            probe_args(ProcMode::Bind, true).join(" "),
            "--unshare-all --unshare-user --die-with-parent --disable-userns --ro-bind /usr /usr \
             --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64 --ro-bind /proc /proc /usr/bin/true"
        );
        assert!(probe_args(ProcMode::New, false).join(" ").contains("--die-with-parent --ro-bind /usr /usr"));
    }

    #[test]
    fn warning_texts() {
        let base = Capability {
            reason: CapabilityReason::Supported,
            sandbox_usable: true,
            disable_userns: true,
            proc_mode: ProcMode::New,
            proc_fallback: false,
            detail: None,
            proc_detail: None,
        };
        assert!(warnings("/b", &base).is_empty());

        let unknown =
            Capability { reason: CapabilityReason::OptionUnknown, disable_userns: false, ..base.clone() };
        let w = warnings("/b", &unknown);
        assert!(
            w[0].text.contains("does not support --disable-userns")
                && w[0].text.contains("Upgrade bubblewrap")
        );

        let rejected = Capability {
            reason: CapabilityReason::OptionRejected,
            disable_userns: false,
            detail: Some(SYSCTL_RO.into()),
            ..base.clone()
        };
        assert!(warnings("/b", &rejected)[0].text.contains("cannot use it here: bwrap: cannot open"));

        let fallback = Capability {
            proc_mode: ProcMode::Bind,
            proc_fallback: true,
            proc_detail: Some(PROC_REFUSED.into()),
            ..base.clone()
        };
        let w = warnings("/b", &fallback);
        assert_eq!(w[0].event, "sandbox_proc_fallback");
        for needle in ["cannot mount a fresh /proc", "--ro-bind /proc /proc", "systempaths=unconfined"] {
            assert!(w[0].text.contains(needle), "{needle}");
        }

        let unusable = Capability {
            reason: CapabilityReason::SandboxUnusable,
            sandbox_usable: false,
            disable_userns: false,
            detail: Some("bwrap: setting up uid map: Permission denied".into()),
            ..base
        };
        let w = warnings("/b", &unusable);
        assert!(
            w[0].text
                .starts_with("bubblewrap at \"/b\" could not build a sandbox: bwrap: setting up uid map")
        );
        assert!(w[0].text.contains("run_python and run_shell will fail"));
        assert_eq!(
            sandbox_unusable_message("/b", None).lines().next(),
            Some("bubblewrap at \"/b\" could not build a sandbox.")
        );
    }
}
