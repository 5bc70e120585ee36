//! The per-chip probe (R-NPU-2): one throwaway sandbox per chip, of the executions' form —
//! the same argv builder, launcher, seccomp profile and fresh `/dev` — binding only that
//! chip (an Ascend chip renumbered to `/dev/davinci0`), running `npu-smi info` or
//! `nvidia-smi -L`. Exit 0 means usable. Also the host-side tool runner for discovery.

use std::future::Future;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};

use super::AccelConfig;
use super::{MAX_TOOL_OUTPUT, PROBE_TIMEOUT, mount};
use crate::isolation::{Dir, Job, SandboxSpec, WorkspaceDirs};
use crate::launch::{OutputBudget, Termination};
use crate::sandbox::{Language, WorkspaceLayout, argv};
use crate::startup::SandboxRuntime;

/// Which kind of chip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Ascend,
    Nvidia,
}

impl Family {
    pub fn label(self) -> &'static str {
        match self {
            Family::Ascend => "NPU",
            Family::Nvidia => "GPU",
        }
    }
}

/// What one probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOutcome {
    pub usable: bool,
    /// The tool's standard output (NVIDIA: the `-L` line names the chip).
    pub stdout: String,
    /// Why it failed: the tool's first telling line, or what went wrong around it.
    pub detail: String,
}

pub type ProbeFuture<'a> = Pin<Box<dyn Future<Output = ProbeOutcome> + Send + 'a>>;

/// Probes one chip. The real one launches a sandbox; tests count and script calls.
pub trait Prober: Send + Sync {
    fn probe(&self, family: Family, host_index: u32) -> ProbeFuture<'_>;
}

/// The first line that says something: not blank, not table art (`+`, `|`), not the
/// driver's log-level chatter (internals §4.3).
pub fn telling_line(stderr: &str, stdout: &str) -> Option<String> {
    stderr
        .lines()
        .chain(stdout.lines())
        .map(str::trim)
        .find(|l| {
            !l.is_empty()
                && !l.starts_with('+')
                && !l.starts_with('|')
                && !l.starts_with("DrvMngGetConsoleLogLevel")
        })
        .map(str::to_owned)
}

/// `NPU 4 cannot be opened inside the sandbox: <detail>`.
pub fn unusable_reason(family: Family, host_index: u32, detail: &str) -> String {
    format!("{} {host_index} cannot be opened inside the sandbox: {detail}", family.label())
}

/// Probes through real sandboxes of the executions' form: the sandbox side's start-up facts
/// (its isolation backend, host runtime and user), where scratch workspaces go, and the
/// chips' configuration.
#[derive(Debug, Clone, Copy)]
pub struct SandboxProber<'a> {
    pub sandbox: &'a SandboxRuntime,
    pub data_dir: &'a Path,
    pub config: &'a AccelConfig,
}

static SCRATCH: AtomicU64 = AtomicU64::new(0);

impl SandboxProber<'_> {
    async fn run(&self, family: Family, host_index: u32) -> ProbeOutcome {
        let fail = |detail: String| ProbeOutcome { usable: false, stdout: String::new(), detail };
        let (sandbox, cfg) = (self.sandbox, self.config);
        if sandbox.isolation.unavailable().is_some() {
            return fail("no sandbox can be built on this host (see /health sandboxProfile)".into());
        }
        let exists = |p: &Path| p.exists();
        let (one, command) = match family {
            Family::Ascend => {
                let Some(smi) = cfg.npu_smi() else {
                    return fail("npu-smi is not installed on this machine.".into());
                };
                let m = mount::ascend(
                    &[host_index],
                    &cfg.npu_device_dir,
                    &cfg.ascend_toolkit,
                    Some(&smi),
                    &exists,
                );
                (m, vec![smi.to_string_lossy().into_owned(), "info".to_owned()])
            }
            Family::Nvidia => {
                let Some(smi) = cfg.nvidia_smi() else {
                    return fail("nvidia-smi is not installed on this machine.".into());
                };
                let m = mount::nvidia(&[host_index], &cfg.gpu_device_dir, Some(&smi), &exists);
                (m, vec![smi.to_string_lossy().into_owned(), "-L".to_owned()])
            }
        };
        // A throwaway, empty workspace: the probe's sandbox has the executions' layout.
        let scratch = match make_scratch(self.data_dir, &sandbox.user) {
            Ok(dir) => dir,
            Err(e) => return fail(format!("could not create the probe's scratch directory: {e}")),
        };
        // Bound from its descriptor: the sandbox user may not be able to reach the data
        // directory by path (a root runnerd's data directory may be 0700).
        let scratch_fd = match open_dir(&scratch) {
            Ok(fd) => fd,
            Err(e) => return fail(format!("could not open the probe's scratch directory: {e}")),
        };
        let layout = WorkspaceLayout::new(scratch.clone(), None);
        let mut spec = SandboxSpec::new(&sandbox.host, &layout, Language::Shell);
        spec.workspace_dirs =
            Some(WorkspaceDirs { root: Dir { fd: &scratch_fd, owner: None }, read_only: None });
        spec.accel = Some(&one);
        spec.command = Some(&command);
        spec.profile = argv::profile(false, !one.ascend.is_empty());
        let mut job = Job::new(spec);
        job.timeout = Some(PROBE_TIMEOUT);
        let mut output = OutputBudget::new(MAX_TOOL_OUTPUT);
        let ran = sandbox.isolation.run(job, &mut output).await.outcome;
        let _ = std::fs::remove_dir_all(&scratch);
        let out = output.finish();
        let (stdout, stderr) = (out.stdout, out.stderr);
        let usable = matches!(ran, Ok(ref o) if o.termination == Termination::Exited(0));
        let detail = match &ran {
            Ok(_) if usable => String::new(),
            Ok(o) => telling_line(&stderr, &stdout).unwrap_or_else(|| match o.termination {
                Termination::Exited(c) => format!("the probe exited with code {c}"),
                Termination::TimedOut => {
                    format!("the probe did not finish within {} s", PROBE_TIMEOUT.as_secs())
                }
                Termination::Signaled(s) => format!("the probe was killed by signal {s}"),
                Termination::Cancelled => "the probe was cancelled".to_owned(),
            }),
            Err(e) => crate::error_chain(e),
        };
        tracing::info!(event = "accel_probe", family = family.label(), chip = host_index, usable, detail = %detail);
        ProbeOutcome { usable, stdout, detail }
    }
}

impl Prober for SandboxProber<'_> {
    fn probe(&self, family: Family, host_index: u32) -> ProbeFuture<'_> {
        Box::pin(self.run(family, host_index))
    }
}

/// `O_PATH` descriptor of a directory runnerd just made (not followed if it is a symlink).
fn open_dir(dir: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    Ok(file.into())
}

/// A fresh, empty, absolute directory for one probe's workspace, the sandbox user's. Its
/// parents are searchable but not listable (0711): bwrap resolves the bind as that user.
fn make_scratch(data_dir: &Path, owner: &crate::sandbox::user::Identity) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let n = SCRATCH.fetch_add(1, Ordering::Relaxed);
    let runtime = data_dir.join(common::layout::RUNTIME);
    let probes = runtime.join(common::layout::ACCEL_PROBE);
    let dir = probes.join(format!("{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    for parent in [&runtime, &probes] {
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711))?;
    }
    owner.hand_over(open_dir(&dir)?.as_fd())?;
    std::fs::canonicalize(&dir)
}

/// Runs a host tool (discovery: `npu-smi info`, `npu-smi info -m`) with the probe timeout;
/// its standard output, or why it failed.
pub async fn host_tool(program: &Path, args: &[&str]) -> Result<String, String> {
    use tokio::io::AsyncReadExt;
    let shown = format!("{} {}", program.display(), args.join(" "));
    let mut child = match spawn_tool(program, args).await {
        Ok(child) => child,
        Err(e) => return Err(format!("{shown} could not be run: {e}")),
    };
    // Each stream is read up to the limit and no further (the original's maxBuffer): a tool
    // that floods its output cannot grow runnerd's memory. The reader is dropped at the
    // limit, so the tool gets EPIPE instead of blocking on a full pipe.
    let bounded = |stream: Option<tokio::process::ChildStdout>| async move {
        let mut buf = Vec::new();
        if let Some(s) = stream {
            let _ = s.take(MAX_TOOL_OUTPUT + 1).read_to_end(&mut buf).await;
        }
        buf
    };
    let bounded_err = |stream: Option<tokio::process::ChildStderr>| async move {
        let mut buf = Vec::new();
        if let Some(s) = stream {
            let _ = s.take(MAX_TOOL_OUTPUT + 1).read_to_end(&mut buf).await;
        }
        buf
    };
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let run = async { tokio::join!(bounded(out), bounded_err(err), child.wait()) };
    let (stdout, stderr, status) = match tokio::time::timeout(PROBE_TIMEOUT, run).await {
        Err(_) => return Err(format!("{shown} did not finish within {} s", PROBE_TIMEOUT.as_secs())),
        Ok((_, _, Err(e))) => return Err(format!("{shown} could not be waited for: {e}")),
        Ok((o, e, Ok(status))) => (o, e, status),
    };
    let limit = MAX_TOOL_OUTPUT as usize;
    if stdout.len() > limit {
        return Err(format!("{shown}: stdout maxBuffer length exceeded ({limit} bytes)"));
    }
    let stderr = String::from_utf8_lossy(&stderr[..stderr.len().min(limit)]).into_owned();
    if status.success() {
        Ok(String::from_utf8_lossy(&stdout).into_owned())
    } else {
        Err(command_failed(&shown, &stderr))
    }
}

/// Starts a host tool. "Text file busy" (ETXTBSY) means the file is still open for writing
/// somewhere — a package upgrade replacing `npu-smi`, or a descriptor another thread's
/// child inherited between its fork and exec — and passes within moments: it is retried a
/// few times before it counts as the tool's failure.
async fn spawn_tool(program: &Path, args: &[&str]) -> std::io::Result<tokio::process::Child> {
    let mut tries = 0;
    loop {
        let spawned = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        match spawned {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 10 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// A host tool that exited non-zero, worded as the original's (Node's `execFile`) error
/// message, which `Could not read NPU status: …` carries: `Command failed: <command>` and,
/// on the next line, the tool's whole standard error.
pub fn command_failed(shown: &str, stderr: &str) -> String {
    format!("Command failed: {shown}\n{stderr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_telling_line_skips_table_art_and_driver_chatter() {
        let cases = [
            ("", "", None),
            ("\n  \n", "+---+\n| x |\n", None),
            (
                "DrvMngGetConsoleLogLevel failed. (g_conLogLevel=3)\n\ndcmi model initialized failed, because the device is used. ret is -8020\n",
                "",
                Some("dcmi model initialized failed, because the device is used. ret is -8020"),
            ),
            ("", "+----+\n| npu-smi |\n  Error: no device\n", Some("Error: no device")),
            ("stderr first\n", "stdout second\n", Some("stderr first")),
        ];
        for (stderr, stdout, want) in cases {
            assert_eq!(telling_line(stderr, stdout).as_deref(), want, "{stderr:?} {stdout:?}");
        }
        assert_eq!(unusable_reason(Family::Ascend, 4, "x"), "NPU 4 cannot be opened inside the sandbox: x");
        assert_eq!(unusable_reason(Family::Nvidia, 1, "y"), "GPU 1 cannot be opened inside the sandbox: y");
    }

    #[tokio::test]
    async fn a_failing_host_tool_is_reported_as_node_words_it_with_its_whole_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("npu-smi");
        std::fs::write(
            &tool,
            "#!/bin/sh\necho '+---+' >&2\necho 'dcmi model initialized failed' >&2\nexit 3\n",
        )
        .unwrap();
        std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let err = host_tool(&tool, &["info"]).await.unwrap_err();
        assert_eq!(
            err,
            format!("Command failed: {} info\n+---+\ndcmi model initialized failed\n", tool.display())
        );
    }

    #[tokio::test]
    async fn a_host_tool_that_floods_its_output_is_cut_off_at_the_limit_not_buffered() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("npu-smi");
        // Endless output: without the limit this would grow runnerd's memory until the
        // timeout; with it the reader stops at 1 MiB and the tool dies of EPIPE.
        std::fs::write(&tool, "#!/bin/sh\nexec yes 'npu-smi line'\n").unwrap();
        std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let err = host_tool(&tool, &["info"]).await.unwrap_err();
        assert_eq!(err, format!("{} info: stdout maxBuffer length exceeded (1048576 bytes)", tool.display()));
        let ok = dir.path().join("ok");
        std::fs::write(&ok, "#!/bin/sh\necho fine\n").unwrap();
        std::fs::set_permissions(&ok, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        assert_eq!(host_tool(&ok, &[]).await.as_deref(), Ok("fine\n"));
    }
}
