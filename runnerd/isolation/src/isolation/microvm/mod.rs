//! The microvm backend (issue #36): each job in a QEMU `-M microvm` guest of its own, so
//! memory, CPU and processes are limited by a separate kernel and a kernel bug reachable
//! through seccomp's allowlist is not a host escape.
//!
//! A job runs like this:
//! 1. [`request::plan`] turns the spec into the guest agent's request (the bwrap form's
//!    command, environment and cwd) and 9p shares, by descriptor where bwrap can bind one;
//! 2. QEMU is started through the same launcher as every bwrap sandbox — sandbox-init, bwrap,
//!    seccomp, the unprivileged sandbox user — seeing only `/usr`, the kernel, the initramfs,
//!    the shares and its end of a socket pair ([`argv`]); `-sandbox on` adds QEMU's filter;
//! 3. [`channel::converse`] sends the request and input over runnerd's end and streams the
//!    guest's output into the job's sink, believing nothing the protocol does not allow;
//!    with egress, [`egress`] relays a second port to egressd's gateway (no port without);
//! 4. the guest agent ends every guest process, reports, and powers the VM off. A timeout,
//!    a cancel, a protocol breach, or a guest that does not power off ends QEMU through the
//!    launcher (SIGKILL to its PID namespace): no process and no mount stay behind.
//!
//! The VM's size is the request's `memoryBytes` and `cpus`; the execution's cgroup is not
//! joined, because its memory limit would count QEMU's own overhead and kill the VMM instead
//! of OOM-killing inside the guest.

pub mod argv;
pub mod channel;
pub mod egress;
pub mod request;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::plan::Resource;
use common::seccomp::Profile;
use runner_guest_agent::wire::Exit;
use tokio::sync::watch;

use self::argv::{Accel, VmArgs};
use self::channel::{Channel, Verdict};
use super::prestart::{self, Discard, Pool, Prestart, PrestartSettings, Scope, Shape, release};
use super::{Isolation, Job, Ran, RunFuture};
use crate::launch::{Filter, Launch, LaunchError, Launcher, Outcome, OutputSink, Stream, Termination};
use crate::sandbox::SandboxShape;
use crate::sandbox::user::Identity;

/// The guest's memory when the request sets none.
pub const DEFAULT_MEMORY_MIB: u64 = 512;
/// Below this a Debian kernel with the agent does not boot reliably.
pub const MIN_MEMORY_MIB: u64 = 128;
/// How long a guest that reported its end may take to power off before QEMU is killed.
const POWER_OFF_GRACE: Duration = Duration::from_secs(5);
/// How long a KVM boot probe may take to reach the agent (a stock guest on KVM: well under 1 s).
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// How much of QEMU's own stdout/stderr (the guest console) is kept for error messages.
const CONSOLE_TAIL: usize = 4096;

/// `SCIENCE_AGENT_MICROVM_*`: where QEMU and the prepared guest are, and which accelerator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicrovmSettings {
    /// `SCIENCE_AGENT_MICROVM_QEMU`: QEMU's binary (it runs inside the sandbox, so under `/usr`).
    pub qemu: PathBuf,
    /// `SCIENCE_AGENT_MICROVM_KERNEL`: the ELF vmlinux (`scripts/build-microvm-guest`).
    pub kernel: PathBuf,
    /// `SCIENCE_AGENT_MICROVM_INITRAMFS`: the initramfs with the guest agent.
    pub initramfs: PathBuf,
    /// `SCIENCE_AGENT_MICROVM_ACCEL`: `auto`, `kvm` or `tcg` ([`Microvm::probe_kvm`] decides).
    pub accel: AccelSetting,
    /// `SCIENCE_AGENT_MICROVM_POOL` and `_POOL_PER_TENANT`: how many booted VMs wait for
    /// their workspace's next call (0: none); their idle limit is the pre-started
    /// sandboxes' (`SCIENCE_AGENT_PRESTART_IDLE_SECS`).
    pub pool: PrestartSettings,
}

/// A VM waiting in the pool costs its guest's RAM that the kernel touched plus QEMU's own
/// (about 280 MiB under TCG, measured with Debian's kernel): a few per node, one per tenant.
pub const DEFAULT_POOL: PrestartSettings =
    PrestartSettings { per_node: 2, per_tenant: 1, idle: Duration::from_secs(120) };

impl Default for MicrovmSettings {
    fn default() -> Self {
        MicrovmSettings {
            qemu: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            kernel: PathBuf::from("/usr/lib/sciencediscovery/microvm/vmlinux"),
            initramfs: PathBuf::from("/usr/lib/sciencediscovery/microvm/initramfs.cpio.gz"),
            accel: AccelSetting::Auto,
            pool: DEFAULT_POOL,
        }
    }
}

/// Which accelerator the operator asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelSetting {
    /// KVM when the sandbox user can open `/dev/kvm` and a guest boots under it at
    /// start-up; TCG otherwise, and `/health` says why.
    Auto,
    /// KVM, or the backend is unavailable with the reason.
    Kvm,
    Tcg,
}

impl AccelSetting {
    pub fn parse(value: &str) -> Option<AccelSetting> {
        match value {
            "auto" => Some(AccelSetting::Auto),
            "kvm" => Some(AccelSetting::Kvm),
            "tcg" => Some(AccelSetting::Tcg),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AccelSetting::Auto => "auto",
            AccelSetting::Kvm => "kvm",
            AccelSetting::Tcg => "tcg",
        }
    }
}

/// QEMU microvm guests through the launcher.
#[derive(Debug)]
pub struct Microvm {
    settings: MicrovmSettings,
    bwrap: PathBuf,
    launcher: Arc<Launcher>,
    user: Identity,
    shape: Option<SandboxShape>,
    bind_fd: bool,
    /// Why no VM can start here (`None`: they can).
    unusable: Option<String>,
    /// The accelerator the VMs use, and why (under `auto`): decided by [`Microvm::probe_kvm`]
    /// and, where KVM may work, by [`Microvm::try_kvm`] in the background.
    accel: std::sync::Mutex<(Accel, Option<String>)>,
    /// Booted VMs, each waiting for its workspace's next call and serving exactly one
    /// (issue #36's pool); `None`: off, or no VM can start here.
    pool: Option<Arc<Pool<Channel>>>,
    /// The next VM of each workspace whose call has not ended yet.
    pending: prestart::Pending<VmNext>,
}

impl Microvm {
    /// Checks what can be checked without booting: QEMU, the kernel, the initramfs, `/dev/kvm`
    /// when asked for, and that the bwrap sandbox QEMU runs in can be built.
    pub fn new(
        settings: MicrovmSettings,
        bwrap: PathBuf,
        launcher: Arc<Launcher>,
        user: Identity,
        shape: Option<SandboxShape>,
        bind_fd: bool,
    ) -> Microvm {
        let unusable = unusable(&settings, shape.is_some(), &user);
        let pool =
            (settings.pool.per_node > 0 && bind_fd && unusable.is_none()).then(|| Pool::new(settings.pool));
        let accel = if settings.accel == AccelSetting::Kvm { Accel::Kvm } else { Accel::Tcg };
        Microvm {
            settings,
            bwrap,
            launcher,
            user,
            shape,
            bind_fd,
            unusable,
            pool,
            pending: Default::default(),
            accel: std::sync::Mutex::new((accel, None)),
        }
    }

    /// Decides the accelerator. With `kvm`, boots one guest under KVM through the launcher
    /// (as the sandbox user, who must be able to open `/dev/kvm`) and waits for its agent's
    /// `Ready`: a host whose KVM cannot boot a stock kernel (PVM) makes the backend
    /// unavailable with the reason, instead of every run hanging until its timeout. With
    /// `auto`, TCG, and whether [`Microvm::try_kvm`] should try KVM (the sandbox user may
    /// open `/dev/kvm`; else why not).
    pub async fn probe_kvm(&mut self) {
        if self.unusable.is_some() {
            return;
        }
        match self.settings.accel {
            AccelSetting::Tcg => {}
            AccelSetting::Kvm => {
                if let Err(why) = self.boot_probe().await {
                    self.unusable = Some(format!(
                        "SCIENCE_AGENT_MICROVM_ACCEL=kvm, but no guest booted under KVM within {} s: {why}; set it to tcg or auto",
                        KVM_PROBE_TIMEOUT.as_secs()
                    ));
                }
            }
            AccelSetting::Auto => {
                let kvm =
                    std::fs::metadata(KVM_DEVICE).map_err(|e| format!("{KVM_DEVICE}: {e}")).and_then(|m| {
                        use std::os::unix::fs::{FileTypeExt, MetadataExt};
                        kvm_openable(m.file_type().is_char_device(), m.mode(), m.uid(), m.gid(), &self.user)
                    });
                let reason = match kvm {
                    Err(why) => format!("TCG: {why}"),
                    Ok(()) => TRYING_KVM.to_owned(),
                };
                self.set_accel(Accel::Tcg, reason);
            }
        }
    }

    /// Under `auto` where the sandbox user may open `/dev/kvm`: boots one guest under KVM in
    /// the background (start-up does not wait; runs meanwhile use TCG) and switches to KVM if
    /// it reached the guest agent, else says why TCG stays.
    pub fn try_kvm(self: &Arc<Self>) {
        if self.accel_reason().as_deref() != Some(TRYING_KVM) {
            return;
        }
        let vm = self.clone();
        tokio::spawn(async move {
            match vm.boot_probe().await {
                Ok(()) => vm.set_accel(Accel::Kvm, "KVM: a guest booted under it at start-up".to_owned()),
                Err(why) => vm.set_accel(
                    Accel::Tcg,
                    format!(
                        "TCG: the sandbox user can open {KVM_DEVICE}, but no guest booted under KVM within {} s: {why}",
                        KVM_PROBE_TIMEOUT.as_secs()
                    ),
                ),
            }
            tracing::info!(
                event = "microvm_accel",
                accel = vm.accel().name(),
                reason = vm.accel_reason().unwrap_or_default()
            );
        });
    }

    fn set_accel(&self, accel: Accel, reason: String) {
        *self.accel.lock().unwrap_or_else(|p| p.into_inner()) = (accel, Some(reason));
    }

    async fn boot_probe(&self) -> Result<(), String> {
        let (host_end, guest_end) = std::os::unix::net::UnixStream::pair().map_err(|e| e.to_string())?;
        let mut slots = crate::sandbox::FdSlots::default();
        let agent_fd = slots.push(&OwnedFd::from(guest_end)).map_err(|e| e.to_string())?;
        let shares = [argv::Share { tag: "usr", source: argv::Source::Path("/usr".into()), writable: false }];
        let vm = VmArgs {
            kernel: &self.settings.kernel,
            initramfs: &self.settings.initramfs,
            accel: Accel::Kvm,
            memory_mib: MIN_MEMORY_MIB * 2,
            cpus: 1,
            agent_fd,
            egress_fd: None,
            shares: &shares,
            disable_userns: self.shape.is_some_and(|s| s.disable_userns),
        };
        let (kill_tx, kill_rx) = watch::channel(false);
        let launch = Launch {
            bwrap: self.bwrap.clone(),
            options: argv::bwrap_options(&vm),
            command: argv::qemu_argv(&self.settings.qemu, &vm),
            filter: Some(Filter::Profile(Profile::Baseline)),
            rlimits: Vec::new(),
            stdin: Vec::new(),
            timeout: Some(KVM_PROBE_TIMEOUT),
            cancel: Some(kill_rx),
            extra_fds: slots,
            cgroup_procs: Vec::new(),
        };
        host_end.set_nonblocking(true).map_err(|e| e.to_string())?;
        let stream = tokio::net::UnixStream::from_std(host_end).map_err(|e| e.to_string())?;
        let ready = async {
            let booted = Channel::new(stream).ready().await.is_ok();
            let _ = kill_tx.send(true);
            booted
        };
        let mut console = Console::default();
        let (launched, booted) = tokio::join!(self.launcher.run(launch, &mut console), ready);
        match (launched, booted) {
            (_, true) => Ok(()),
            (Err(e), false) => Err(e.to_string()),
            (Ok(_), false) => Err(format!("its console: {}", String::from_utf8_lossy(&console.0).trim())),
        }
    }

    pub fn accel(&self) -> Accel {
        self.accel.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Why [`Microvm::accel`] is what it is, under `auto`.
    pub fn accel_reason(&self) -> Option<String> {
        self.accel.lock().unwrap_or_else(|p| p.into_inner()).1.clone()
    }

    pub fn settings(&self) -> &MicrovmSettings {
        &self.settings
    }
}

/// Why `settings` cannot run a VM for `user`; `None` when they can.
fn unusable(settings: &MicrovmSettings, bwrap_usable: bool, user: &Identity) -> Option<String> {
    if !bwrap_usable {
        return Some(
            "isolation microvm runs QEMU inside a bubblewrap sandbox, and none can be built on this host"
                .into(),
        );
    }
    if !settings.qemu.starts_with("/usr/") {
        return Some(format!(
            "SCIENCE_AGENT_MICROVM_QEMU={} is outside /usr, the only host directory QEMU's sandbox sees",
            settings.qemu.display()
        ));
    }
    if !is_executable(&settings.qemu) {
        return Some(format!(
            "QEMU was not found at {} (install qemu-system-x86, or set SCIENCE_AGENT_MICROVM_QEMU)",
            settings.qemu.display()
        ));
    }
    for (what, path, var) in [
        ("guest kernel", &settings.kernel, "SCIENCE_AGENT_MICROVM_KERNEL"),
        ("guest initramfs", &settings.initramfs, "SCIENCE_AGENT_MICROVM_INITRAMFS"),
    ] {
        if let Some(why) = unreadable_by(path, user) {
            return Some(format!(
                "the {what} {} {why} (prepare it with scripts/build-microvm-guest and set {var})",
                path.display()
            ));
        }
    }
    if settings.accel == AccelSetting::Kvm {
        let kvm = std::fs::OpenOptions::new().read(true).write(true).open(KVM_DEVICE);
        if let Err(e) = kvm {
            return Some(format!("SCIENCE_AGENT_MICROVM_ACCEL=kvm but /dev/kvm cannot be opened: {e}"));
        }
    }
    None
}

const KVM_DEVICE: &str = "/dev/kvm";
/// `auto`'s reason while [`Microvm::try_kvm`] boots its guest.
const TRYING_KVM: &str = "TCG while a guest boots under KVM to try it (start-up probe)";

/// Whether the sandbox user may open `/dev/kvm` read-write, from its type, mode and owner:
/// QEMU runs as that user with its uid and primary gid only (no supplementary groups), so
/// membership of a `kvm` group it is not primary in does not count. Else why not.
fn kvm_openable(char_device: bool, mode: u32, uid: u32, gid: u32, user: &Identity) -> Result<(), String> {
    if !char_device {
        return Err(format!("{KVM_DEVICE} is not a character device"));
    }
    let rw = |shift: u32| (mode >> shift) & 0o6 == 0o6;
    let allowed = (uid == user.uid && rw(6)) || (gid == user.gid && rw(3)) || rw(0);
    if allowed {
        Ok(())
    } else {
        Err(format!(
            "{KVM_DEVICE} (mode {:o}, owner {uid}:{gid}) cannot be opened read-write by the sandbox user {} ({}:{})",
            mode & 0o777,
            user.name,
            user.uid,
            user.gid
        ))
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Why the sandbox user cannot read `path` (a regular file, readable by its other bits, or
/// owned by the user); a coarse check: the launch itself is the final word.
fn unreadable_by(path: &Path, user: &Identity) -> Option<String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    match std::fs::metadata(path) {
        Err(e) => Some(format!("cannot be read: {e}")),
        Ok(m) if !m.is_file() => Some("is not a regular file".into()),
        Ok(m) => {
            let mode = m.permissions().mode();
            let readable = mode & 0o004 != 0
                || (m.uid() == user.uid && mode & 0o400 != 0)
                || (m.gid() == user.gid && mode & 0o040 != 0);
            (!readable).then(|| {
                format!("is not readable by the sandbox user {} (mode {:o})", user.name, mode & 0o777)
            })
        }
    }
}

/// What QEMU may take on the host beyond the guest's RAM: its TCG translation cache
/// (`tb-size`), its mapping of the kernel, its devices and threads' buffers.
pub const VMM_OVERHEAD_MIB: u64 = 384;

/// The limits of QEMU's host cgroup for a guest of `memory_mib` and `cpus`.
pub fn vmm_limits(memory_mib: u64, cpus: u32) -> crate::limits::Limits {
    crate::limits::Limits {
        memory_bytes: (memory_mib + VMM_OVERHEAD_MIB) << 20,
        // QEMU's vCPU, I/O and 9p worker threads.
        pids: 256,
        cpu_millicores: u64::from(cpus) * 1000,
        tmp_bytes: 0,
    }
}

/// What a run in a VM of these limits enforces, for the result's `resourceLimits.enforced`
/// (`true`, or `"partial"` where the VM is larger than asked: at least 128 MiB, whole vCPUs).
pub fn enforced(limits: &crate::limits::Limits) -> crate::limits::EnforcedField {
    use serde_json::json;
    let at_least = limits.memory_bytes == 0 || limits.memory_bytes >= MIN_MEMORY_MIB << 20;
    let whole = limits.cpu_millicores % 1000 == 0;
    crate::limits::EnforcedField {
        memory_bytes: if at_least { json!(true) } else { json!("partial") },
        pids: json!(true),
        cpu: if whole { json!(true) } else { json!("partial") },
        tmp_bytes: json!(true),
    }
}

/// The guest's size from the request's limits: memory in MiB (at least [`MIN_MEMORY_MIB`]),
/// whole vCPUs (rounded up, at most the host's).
pub fn vm_size(limits: Option<&crate::limits::Limits>, host_cpus: u32) -> (u64, u32) {
    let memory = limits.map(|l| l.memory_bytes).filter(|b| *b > 0).map(|b| b / (1024 * 1024));
    let memory = memory.unwrap_or(DEFAULT_MEMORY_MIB).max(MIN_MEMORY_MIB);
    let cpus = limits.map(|l| l.cpu_millicores).filter(|m| *m > 0).map(|m| m.div_ceil(1000) as u32);
    (memory, cpus.unwrap_or(1).clamp(1, host_cpus.max(1)))
}

/// The job's outcome from the launcher's and the conversation's: the job's cancel first, then
/// what the guest reported (a signal as bwrap reports it, 128+N) — a report means the command
/// ended before QEMU was killed, so a deadline that passed while the guest powered off is not
/// the command's timeout — then the launcher's timeout, else why the VM ended without a report.
fn judge(
    launched: Result<Outcome, LaunchError>,
    verdict: Verdict,
    stopped: bool,
    console: &[u8],
) -> Result<Outcome, LaunchError> {
    let mut outcome = launched?;
    let tail = || String::from_utf8_lossy(console).trim().to_owned();
    outcome.termination = match (outcome.termination, verdict) {
        (_, _) if stopped => Termination::Cancelled,
        (_, Verdict::Exit(Exit::Code { code, oom })) => {
            outcome.guest_oom = Some(oom);
            Termination::Exited(code.into())
        }
        (_, Verdict::Exit(Exit::Signal { signal, oom })) => {
            outcome.guest_oom = Some(oom);
            Termination::Exited(128 + i32::from(signal))
        }
        (Termination::TimedOut, _) => Termination::TimedOut,
        (_, Verdict::Failed(text)) => {
            return Err(LaunchError::Unavailable(format!(
                "the microvm guest could not start the command: {text}"
            )));
        }
        (_, Verdict::Refused(e)) => {
            return Err(LaunchError::Unavailable(format!(
                "the microvm guest broke the protocol and its VM was ended: {e}"
            )));
        }
        // After `Ready` the command ran: a VM that ends without its report (QEMU killed by its
        // cgroup or a file size limit, a guest kernel that panicked) is a run killed, whose
        // workspace is measured and committed like any other's.
        (_, Verdict::Closed { ready: true }) => Termination::Signaled(libc::SIGKILL),
        (_, Verdict::Closed { ready: false }) => {
            return Err(LaunchError::Unavailable(format!(
                "the microvm ended before its agent started; its console: {}",
                tail()
            )));
        }
        (_, Verdict::Io(e)) => return Err(LaunchError::Io { what: "talk to the microvm guest", source: e }),
    };
    Ok(outcome)
}

/// Keeps the last [`CONSOLE_TAIL`] bytes of QEMU's own output (the guest console).
#[derive(Debug, Default)]
struct Console(Vec<u8>);

impl OutputSink for Console {
    fn write(&mut self, _: Stream, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
        if self.0.len() > CONSOLE_TAIL {
            self.0.drain(..self.0.len() - CONSOLE_TAIL);
        }
    }
}

impl Isolation for Microvm {
    fn name(&self) -> &'static str {
        "microvm"
    }

    fn unavailable(&self) -> Option<String> {
        self.unusable.clone()
    }

    fn binds_by_descriptor(&self) -> bool {
        self.bind_fd
    }

    fn run<'a>(&'a self, mut job: Job<'a>, sink: &'a mut dyn OutputSink) -> RunFuture<'a> {
        // The execution's cgroup is not joined: its memory limit would count QEMU's own
        // overhead and kill QEMU rather than the command (the guest's size is the limit).
        // QEMU joins a cgroup of its own (`vmm_limits`), whose counters the run reports.
        let unjoined = job.cgroup.take();
        let ran = self.run_vm(job, sink);
        Box::pin(async move {
            let ran = ran.await;
            release(unjoined);
            ran
        })
    }

    fn call_ended(&self, workspace: &Path) {
        if let Some(next) = self.pending.take(workspace) {
            self.boot_next(next);
        }
    }

    fn forget(&self, scope: Scope<'_>, why: Discard) {
        let Some(pool) = &self.pool else { return };
        let env_only = why == Discard::Environment;
        drop(self.pending.forget(scope, |next| !env_only || next.shape.binds_environment()));
        pool.forget(scope, why);
    }

    fn prestarted(&self) -> Option<prestart::Report> {
        self.pool.as_ref().map(|p| p.report())
    }
}

/// One VM as planned from a job: QEMU's sandbox and argv, the descriptors they name, the
/// guest agent's request, and runnerd's end of the channel.
#[derive(Debug)]
struct VmPlan {
    options: Vec<String>,
    command: Vec<String>,
    slots: crate::sandbox::FdSlots,
    rlimits: Vec<common::plan::Rlimit>,
    channel: std::os::unix::net::UnixStream,
    request: runner_guest_agent::wire::RunRequest,
    memory_mib: u64,
    cpus: u32,
    env: Vec<(String, String)>,
    cwd: String,
    /// Where in `slots` the channel's guest end is (a fresh socket each VM: not a shape).
    agent_index: usize,
    /// runnerd's end of the egress port, with `domain-allowlist` (never booted ahead).
    egress: Option<egress::Channel>,
}

impl VmPlan {
    /// What a VM booted from this plan is, for the pool ([`Shape`]): QEMU's sandbox and argv
    /// (the shares, the guest's size), its rlimits and cgroup, and the identity of every
    /// directory it shares by descriptor. The request is not in it: a booted guest takes
    /// any command, cwd and environment.
    fn shape(&self) -> std::io::Result<Shape> {
        let mut objects = self.slots.identities()?;
        objects.remove(self.agent_index);
        Ok(Shape {
            options: self.options.clone(),
            command: self.command.clone(),
            profile: Profile::Baseline,
            rlimits: self.rlimits.clone(),
            limits: Some(vmm_limits(self.memory_mib, self.cpus)),
            idmaps: self.slots.idmaps().to_vec(),
            objects,
            cwd: None,
        })
    }

    /// QEMU's launch, its deadline and cancel left to the run.
    fn launch(self, bwrap: PathBuf, joins: Vec<OwnedFd>) -> (Launch, std::os::unix::net::UnixStream) {
        let launch = Launch {
            bwrap,
            options: self.options,
            command: self.command,
            // QEMU's channel is a descriptor it inherits: it needs no socket call, so the
            // baseline profile's socket denials hold for it too.
            filter: Some(Filter::Profile(Profile::Baseline)),
            rlimits: self.rlimits,
            stdin: Vec::new(),
            timeout: None,
            cancel: None,
            extra_fds: self.slots,
            cgroup_procs: joins,
        };
        (launch, self.channel)
    }
}

/// What booting a call's workspace's next VM takes (held until the call ends).
#[derive(Debug)]
struct VmNext {
    root: PathBuf,
    prestart: Prestart,
    shape: Shape,
    plan: VmPlan,
}

/// QEMU for a run: launched now, or booted ahead and waiting in the pool.
enum Vmm {
    Cold(Launch),
    Booted(crate::launch::Waiting),
}

/// Completes when `stop` says so; never without one.
async fn stopped(stop: Option<watch::Receiver<bool>>) {
    if let Some(mut stop) = stop
        && stop.wait_for(|s| *s).await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// How long a VM may take to boot to its agent's `Ready` when it boots ahead, and how long
/// a call waits for its workspace's VM still booting (a boot further along than a fresh
/// one; only a stuck boot costs this much).
const BOOT_LIMIT: Duration = Duration::from_secs(20);

/// Why a VM could not be booted ahead (logged; the next call boots its own).
#[derive(Debug, thiserror::Error)]
enum BootError {
    #[error("its cgroup could not be made")]
    Cgroup(#[source] crate::limits::cgroup::CgroupError),
    #[error("making its cgroup panicked")]
    Panicked,
    #[error("QEMU could not be launched")]
    Launch(#[source] LaunchError),
    #[error("its guest agent did not say ready: {0}")]
    NotReady(String),
    #[error("its workspace was forgotten while it booted")]
    Voided,
}

impl Microvm {
    /// Plans `job`'s VM (a second call plans the next VM's, with its own descriptors).
    fn plan(&self, job: &Job<'_>) -> std::io::Result<VmPlan> {
        let (channel, guest_end) = std::os::unix::net::UnixStream::pair()?;
        let guest_end = OwnedFd::from(guest_end);
        let mut planned = request::plan(&job.spec, &self.user, &guest_end, self.bind_fd)?;
        let egress = egress::open(&job.spec, &mut planned)?;
        let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let (memory_mib, cpus) = vm_size(job.limits.as_ref(), host_cpus);
        planned.request.pids = job.limits.as_ref().map_or(0, |l| l.pids);
        // The largest file (the quota) is the command's limit inside the guest, not
        // QEMU's: QEMU's own writes go to the shares on the command's behalf.
        planned.request.fsize =
            job.rlimits.iter().find(|r| r.resource == Resource::FSize).and_then(|r| r.hard).unwrap_or(0);
        // A /tmp larger than the guest's RAM would deadlock the guest kernel on memory
        // (tmpfs pages cannot be freed): at most half of it.
        planned.request.tmp_bytes = planned.request.tmp_bytes.min((memory_mib << 20) / 2);
        let vm = VmArgs {
            kernel: &self.settings.kernel,
            initramfs: &self.settings.initramfs,
            accel: self.accel(),
            memory_mib,
            cpus,
            agent_fd: planned.agent_slot,
            egress_fd: planned.egress_slot,
            shares: &planned.shares,
            disable_userns: self.shape.is_some_and(|s| s.disable_userns),
        };
        Ok(VmPlan {
            options: argv::bwrap_options(&vm),
            command: argv::qemu_argv(&self.settings.qemu, &vm),
            agent_index: (planned.agent_slot - common::plan::FIRST_EXTRA_FD) as usize,
            slots: planned.slots,
            // QEMU's own address space is not the guest's limit: no RLIMIT_AS or CPU time;
            // the file size limit is the guest command's (above).
            rlimits: job
                .rlimits
                .iter()
                .filter(|r| matches!(r.resource, Resource::Core | Resource::NoFile))
                .cloned()
                .collect(),
            channel,
            request: planned.request,
            memory_mib,
            cpus,
            env: planned.env,
            cwd: planned.cwd,
            egress,
        })
    }

    /// The next VM of `job`'s workspace, when the job is an execution whose VM may be
    /// booted ahead ([`prestart::ahead`]: no egress, chips or own command, the workspace
    /// bound by descriptor).
    fn next_of(&self, job: &mut Job<'_>) -> Option<VmNext> {
        self.pool.as_ref()?;
        let parts = prestart::Parts {
            own_command: job.spec.command.is_some(),
            chips: job.spec.accel.is_some_and(|a| !a.is_empty()),
            extra: !job.spec.binds.is_empty() || !job.spec.extra_env.is_empty(),
            egress: job.spec.egress.is_some(),
            by_descriptor: job.spec.workspace_dirs.is_some() && self.bind_fd,
        };
        if !prestart::ahead(&parts) {
            return None;
        }
        let prestart = job.prestart.clone()?;
        let plan = self.plan(job).ok()?;
        let shape = plan.shape().ok()?;
        Some(VmNext { root: job.spec.workspace.root().to_owned(), prestart, shape, plan })
    }

    /// Boots the next VM of a workspace in the background and files it in the pool once
    /// its agent said `Ready`, when the pool's bounds admit it.
    fn boot_next(&self, next: VmNext) {
        let Some(pool) = &self.pool else { return };
        let Some(reservation) = pool.reserve(&next.root, &next.prestart.tenant, &next.shape) else {
            return;
        };
        pool.ensure_sweeper();
        let (pool, launcher, bwrap) = (pool.clone(), self.launcher.clone(), self.bwrap.clone());
        tokio::spawn(async move {
            let VmNext { prestart, shape, plan, .. } = next;
            let limits = vmm_limits(plan.memory_mib, plan.cpus);
            let made = tokio::task::spawn_blocking(move || prestart.cgroups.create(&limits))
                .await
                .map_err(|_| BootError::Panicked)
                .and_then(|r| r.map_err(BootError::Cgroup));
            let cgroup = match made {
                Ok(c) => c,
                Err(e) => return pool.failed(reservation, &e),
            };
            let joins = match cgroup.as_ref().map(|c| c.procs_fds()).transpose() {
                Ok(joins) => joins.unwrap_or_default(),
                Err(e) => {
                    release(cgroup);
                    return pool.failed(reservation, &BootError::Cgroup(e));
                }
            };
            let (launch, channel) = plan.launch(bwrap, joins);
            let waiting = match launcher.start(launch).await {
                Ok(waiting) => waiting,
                Err(e) => {
                    release(cgroup);
                    return pool.failed(reservation, &BootError::Launch(e));
                }
            };
            let channel = channel
                .set_nonblocking(true)
                .and_then(|()| tokio::net::UnixStream::from_std(channel))
                .map(Channel::new);
            let booted = match channel {
                // A boot its workspace's forget voided (cleared, moved, an environment
                // changed…) ends now, not when its guest is up: it would be discarded then.
                Ok(mut channel) => tokio::select! {
                    ready = tokio::time::timeout(BOOT_LIMIT, channel.ready()) => match ready {
                        Ok(Ok(())) => Ok(channel),
                        Ok(Err(verdict)) => Err(BootError::NotReady(format!("{verdict:?}"))),
                        Err(_) => Err(BootError::NotReady(format!("not within {} s", BOOT_LIMIT.as_secs()))),
                    },
                    () = pool.until_voided(&reservation.root) => Err(BootError::Voided),
                },
                Err(e) => Err(BootError::NotReady(e.to_string())),
            };
            match booted {
                Ok(channel) => pool.insert(reservation, shape, waiting, cgroup, channel),
                Err(e) => {
                    waiting.end().await;
                    release(cgroup);
                    pool.failed(reservation, &e);
                }
            }
        });
    }

    /// [`Isolation::run`]'s VM: a booted one from the pool when one of the job's shape
    /// waits, else QEMU through the launcher; the guest agent over its channel.
    fn run_vm<'a>(&'a self, mut job: Job<'a>, sink: &'a mut dyn OutputSink) -> RunFuture<'a> {
        Box::pin(async move {
            let refused = |why: String| Ran {
                outcome: Err(LaunchError::Unavailable(why)),
                env: Vec::new(),
                cwd: String::new(),
                cgroup: None,
            };
            if let Some(why) = self.unavailable() {
                return refused(why);
            }
            if let Some(why) = request::unsupported(&job.spec) {
                return refused(why.to_owned());
            }
            let mut plan = match self.plan(&job) {
                Ok(p) => p,
                Err(source) => {
                    let outcome = Err(LaunchError::Io { what: "pass a descriptor to the microvm", source });
                    return Ran { outcome, env: Vec::new(), cwd: String::new(), cgroup: None };
                }
            };
            let next = self.next_of(&mut job);
            if next.is_none() && job.prestart.is_some() {
                // An execution whose next VM cannot be booted ahead (egress, a shape that
                // could not be made…): what waits for its workspace, booted for the call
                // before, would only hold a place until it expired.
                self.forget(Scope::Exactly(job.spec.workspace.root()), Discard::Shape);
            }
            // A VM still booting for this call is waited for, but not past the call's own
            // deadline, and not once the call is cancelled.
            let limit = job.timeout.map_or(BOOT_LIMIT, |t| t.min(BOOT_LIMIT));
            let taken = match (&self.pool, &next) {
                (Some(pool), Some(next)) => {
                    tokio::select! {
                        taken = pool.take_started(&next.root, &next.shape, limit) => taken.ok(),
                        () = stopped(job.stop.clone()) => None,
                    }
                }
                _ => None,
            };
            if job.stop.as_ref().is_some_and(|s| *s.borrow()) {
                // Cancelled before its VM was handed the command: nothing ran (a VM taken
                // meanwhile ends, unused).
                if let Some(entry) = taken {
                    tokio::spawn(async move {
                        entry.waiting.end().await;
                        release(entry.cgroup);
                    });
                }
                let outcome = Ok(Outcome {
                    termination: Termination::Cancelled,
                    sandbox_pid: None,
                    elapsed: Duration::ZERO,
                    launch_latency: None,
                    served_ahead: false,
                    guest_oom: None,
                });
                return Ran { outcome, env: plan.env, cwd: plan.cwd, cgroup: None };
            }
            if let (Some(pool), Some(_)) = (&self.pool, &taken) {
                pool.served();
            }
            let (env, cwd, request) = (plan.env.clone(), plan.cwd.clone(), plan.request.clone());
            let plan_egress = plan.egress.take();
            let (vmm, channel, vmm_cgroup) = match taken {
                Some(entry) => (Vmm::Booted(entry.waiting), entry.guest, entry.cgroup),
                None => {
                    // QEMU's host cgroup (issue #36's review): the guest's RAM plus QEMU's own
                    // margin, its threads and the vCPUs' CPU time, so that neither a guest
                    // nor a compromised QEMU takes more of the host; `None` where runnerd
                    // has no cgroups (rlimits only).
                    let vmm_cgroup = match job.prestart.as_ref().map(|p| p.cgroups.clone()) {
                        Some(cgroups) => {
                            let limits = vmm_limits(plan.memory_mib, plan.cpus);
                            match tokio::task::spawn_blocking(move || cgroups.create(&limits)).await {
                                Ok(Ok(c)) => c,
                                Ok(Err(e)) => {
                                    return refused(format!("the microvm's cgroup could not be made: {e}"));
                                }
                                Err(_) => return refused("making the microvm's cgroup panicked".to_owned()),
                            }
                        }
                        None => None,
                    };
                    let joins = match vmm_cgroup.as_ref().map(|c| c.procs_fds()).transpose() {
                        Ok(j) => j.unwrap_or_default(),
                        Err(e) => {
                            release(vmm_cgroup);
                            return refused(format!("the microvm's cgroup could not be joined: {e}"));
                        }
                    };
                    let (launch, channel) = plan.launch(self.bwrap.clone(), joins);
                    let channel = channel
                        .set_nonblocking(true)
                        .and_then(|()| tokio::net::UnixStream::from_std(channel))
                        .map(Channel::new);
                    match channel {
                        Ok(channel) => (Vmm::Cold(launch), channel, vmm_cgroup),
                        Err(e) => {
                            let outcome =
                                Err(LaunchError::Io { what: "open the microvm channel", source: e });
                            return Ran { outcome, env, cwd, cgroup: vmm_cgroup };
                        }
                    }
                }
            };
            // Relayed to egressd until the run ends (dropped with this future).
            let _egress = match plan_egress.map(egress::Channel::serve).transpose() {
                Ok(e) => e,
                Err(source) => {
                    let outcome = Err(LaunchError::Io { what: "open the microvm's egress channel", source });
                    return Ran { outcome, env, cwd, cgroup: vmm_cgroup };
                }
            };
            let outcome = self.conduct(vmm, channel, request, job.stdin, job.timeout, job.stop, sink).await;
            // A VM that could not be launched is not booted again ahead.
            if let Some(next) = next.filter(|_| outcome.is_ok()) {
                drop(self.pending.hold(next.root.clone(), next));
            }
            Ran { outcome, env, cwd, cgroup: vmm_cgroup }
        })
    }

    /// Runs the command in the VM: QEMU attended by the launcher (its deadline and cancel
    /// from now), the conversation over `channel`; QEMU ended when the guest breaks the
    /// protocol or does not power off after its report.
    #[allow(clippy::too_many_arguments)]
    async fn conduct(
        &self,
        vmm: Vmm,
        channel: Channel,
        request: runner_guest_agent::wire::RunRequest,
        stdin: Vec<u8>,
        timeout: Option<Duration>,
        stop: Option<watch::Receiver<bool>>,
        sink: &mut dyn OutputSink,
    ) -> Result<Outcome, LaunchError> {
        // The launcher ends QEMU on this: the job's stop, a protocol breach, or a guest
        // that does not power off after its report.
        let (kill_tx, kill_rx) = watch::channel(false);
        let kill_tx = Arc::new(kill_tx);
        // Already stopped (between the pool and here): the command is never sent.
        let already = stop.as_ref().is_some_and(|s| *s.borrow());
        if already {
            let _ = kill_tx.send(true);
        }
        let stopped = Arc::new(std::sync::atomic::AtomicBool::new(already));
        if let Some(mut stop) = stop {
            let (tx, stopped) = (kill_tx.clone(), stopped.clone());
            tokio::spawn(async move {
                if stop.wait_for(|s| *s).await.is_ok() {
                    stopped.store(true, std::sync::atomic::Ordering::SeqCst);
                    let _ = tx.send(true);
                }
            });
        }
        let mut console = Console::default();
        let talk = async {
            if already {
                return Verdict::Closed { ready: false };
            }
            let verdict = channel.converse(request, stdin, sink).await;
            let tx = kill_tx.clone();
            match verdict {
                Verdict::Exit(_) => {
                    tokio::spawn(async move {
                        tokio::time::sleep(POWER_OFF_GRACE).await;
                        let _ = tx.send(true);
                    });
                }
                _ => {
                    let _ = tx.send(true);
                }
            }
            verdict
        };
        let vmm = async {
            match vmm {
                Vmm::Cold(mut launch) => {
                    launch.timeout = timeout;
                    launch.cancel = Some(kill_rx);
                    self.launcher.run(launch, &mut console).await
                }
                Vmm::Booted(waiting) => {
                    waiting.finish(&self.launcher, Vec::new(), timeout, Some(kill_rx), &mut console).await
                }
            }
        };
        // QEMU's end closes the channel, so the conversation ends with it; if QEMU could not
        // be ended (the launcher gave up on it), the conversation is not waited for forever.
        let (launched, verdict) = {
            tokio::pin!(vmm, talk);
            let mut heard = None;
            let launched = loop {
                tokio::select! {
                    launched = &mut vmm => break launched,
                    verdict = &mut talk, if heard.is_none() => heard = Some(verdict),
                }
            };
            let verdict = match heard {
                Some(v) => v,
                None => match tokio::time::timeout(crate::launch::DRAIN_LIMIT, &mut talk).await {
                    Ok(v) => v,
                    Err(_) => {
                        Verdict::Io(std::io::Error::other("the microvm channel stayed open after QEMU ended"))
                    }
                },
            };
            (launched, verdict)
        };
        let stopped = stopped.load(std::sync::atomic::Ordering::SeqCst);
        let timed_out = matches!(&launched, Ok(o) if o.termination == Termination::TimedOut);
        if matches!(verdict, Verdict::Closed { ready: true }) && launched.is_ok() && !stopped && !timed_out {
            // The command ran (its files are measured and committed as any run's): say on
            // its stderr why no exit status came.
            let note = format!(
                "\nrunner: the microvm ended before it reported the command's end (the guest kernel or QEMU \
                 was stopped: out of memory, a file over the quota, a panic); its console: {}\n",
                String::from_utf8_lossy(&console.0).trim()
            );
            sink.write(crate::launch::Stream::Stderr, note.as_bytes());
        }
        judge(launched, verdict, stopped, &console.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::Limits;

    #[test]
    fn the_vm_is_sized_from_the_limits() {
        let l = |memory_bytes, cpu_millicores| Limits { memory_bytes, pids: 0, cpu_millicores, tmp_bytes: 0 };
        let table = [
            (None, (DEFAULT_MEMORY_MIB, 1)),
            (Some(l(0, 0)), (DEFAULT_MEMORY_MIB, 1)),
            (Some(l(1 << 30, 1500)), (1024, 2)),
            (Some(l(64 << 20, 500)), (MIN_MEMORY_MIB, 1)),
            (Some(l(256 << 20, 64_000)), (256, 8)),
        ];
        for (limits, want) in table {
            assert_eq!(vm_size(limits.as_ref(), 8), want, "{limits:?}");
        }
    }

    fn outcome(termination: Termination) -> Result<Outcome, LaunchError> {
        Ok(Outcome {
            termination,
            sandbox_pid: None,
            elapsed: Duration::ZERO,
            launch_latency: None,
            served_ahead: false,
            guest_oom: None,
        })
    }

    #[test]
    fn the_outcome_believes_the_cancel_then_the_checked_report_then_the_deadline() {
        let t = |r: Result<Outcome, LaunchError>| {
            r.map(|o| (o.termination, o.guest_oom)).map_err(|e| e.to_string())
        };
        let code = |code| Verdict::Exit(Exit::Code { code, oom: false });
        assert_eq!(
            t(judge(outcome(Termination::Exited(0)), code(3), false, b"")),
            Ok((Termination::Exited(3), Some(false)))
        );
        // The guest reported before QEMU was killed: the command ended in time (the deadline
        // passed while the guest powered off).
        assert_eq!(
            t(judge(outcome(Termination::TimedOut), code(0), false, b"")),
            Ok((Termination::Exited(0), Some(false)))
        );
        assert_eq!(
            t(judge(outcome(Termination::TimedOut), Verdict::Closed { ready: true }, false, b"")),
            Ok((Termination::TimedOut, None))
        );
        assert_eq!(
            t(judge(outcome(Termination::Cancelled), code(0), true, b"")),
            Ok((Termination::Cancelled, None))
        );
        let oom = Verdict::Exit(Exit::Signal { signal: 9, oom: true });
        assert_eq!(
            t(judge(outcome(Termination::Cancelled), oom, false, b"")),
            Ok((Termination::Exited(137), Some(true)))
        );
        let refused = Verdict::Refused(runner_guest_agent::wire::WireError::Oversized(1 << 30));
        assert!(
            t(judge(outcome(Termination::Cancelled), refused, false, b""))
                .unwrap_err()
                .contains("broke the protocol")
        );
        let closed = judge(
            outcome(Termination::Exited(0)),
            Verdict::Closed { ready: false },
            false,
            b"Kernel panic\n",
        );
        assert!(t(closed).unwrap_err().contains("before its agent started; its console: Kernel panic"));
        // After Ready the command ran: a VM gone without a report is a run killed (measured
        // and committed), not a launch that failed.
        let killed = judge(outcome(Termination::Exited(0)), Verdict::Closed { ready: true }, false, b"");
        assert_eq!(t(killed), Ok((Termination::Signaled(libc::SIGKILL), None)));
    }

    #[test]
    fn qemu_gets_the_guest_plus_its_margin_and_results_say_what_the_vm_enforces() {
        let l = vmm_limits(512, 2);
        assert_eq!((l.memory_bytes, l.pids, l.cpu_millicores), ((512 + VMM_OVERHEAD_MIB) << 20, 256, 2000));
        let asked = |memory_bytes, cpu_millicores| crate::limits::Limits {
            memory_bytes,
            pids: 0,
            cpu_millicores,
            tmp_bytes: 0,
        };
        let e = enforced(&asked(256 << 20, 2000));
        assert_eq!((e.memory_bytes, e.cpu), (serde_json::json!(true), serde_json::json!(true)));
        // Below the smallest guest, or a fraction of a CPU: the VM is larger than asked.
        let e = enforced(&asked(64 << 20, 500));
        assert_eq!((e.memory_bytes, e.cpu), (serde_json::json!("partial"), serde_json::json!("partial")));
    }

    #[test]
    fn kvm_is_tried_only_when_the_sandbox_user_can_open_it() {
        let who =
            Identity { uid: 999, gid: 992, name: "sbx".into(), origin: crate::sandbox::user::Origin::Runner };
        let table = [
            ((true, 0o600, 0, 0), false),
            ((true, 0o660, 0, 107), false),
            ((true, 0o660, 0, 992), true),
            ((true, 0o600, 999, 0), true),
            ((true, 0o666, 0, 0), true),
            ((true, 0o664, 0, 0), false),
            ((false, 0o666, 0, 0), false),
        ];
        for ((chr, mode, uid, gid), ok) in table {
            assert_eq!(kvm_openable(chr, mode, uid, gid, &who).is_ok(), ok, "{mode:o} {uid}:{gid}");
        }
        assert!(kvm_openable(true, 0o600, 0, 0, &who).unwrap_err().contains("sbx (999:992)"));
    }

    #[test]
    fn unusable_settings_say_what_to_do() {
        let who = Identity {
            uid: 65534,
            gid: 65534,
            name: "nobody".into(),
            origin: crate::sandbox::user::Origin::Runner,
        };
        let mut s = MicrovmSettings { qemu: "/usr/bin/true".into(), ..MicrovmSettings::default() };
        assert!(unusable(&s, false, &who).unwrap().contains("bubblewrap"));
        s.qemu = "/opt/qemu".into();
        assert!(unusable(&s, true, &who).unwrap().contains("outside /usr"));
        s.qemu = "/usr/bin/no-such-qemu".into();
        assert!(unusable(&s, true, &who).unwrap().contains("install qemu-system-x86"));
        s.qemu = "/usr/bin/true".into();
        s.kernel = "/no/such/vmlinux".into();
        assert!(unusable(&s, true, &who).unwrap().contains("scripts/build-microvm-guest"));
    }
}
