//! The microvm backend's two argument lists, pure: bwrap's options for the sandbox QEMU runs
//! in, and QEMU's own argv. Nothing here touches the filesystem.
//!
//! Inside QEMU's sandbox it sees `/usr` (its own binary, libraries and firmware, and the
//! guest's `/usr` share), the kernel and initramfs at `/vm/`, each share at `/vm/share/<tag>`
//! and its channel to runnerd as an inherited socket descriptor; nothing else of the host.
//!
//! QEMU's flags are the research's working set (`microvm-research.md`): `-M microvm` with
//! its ACPI kept on (Debian's kernels find virtio-mmio devices only through ACPI), modern
//! virtio-mmio (`force-legacy=false`), the ELF vmlinux entered through its PVH note,
//! `-nodefaults` and no `-netdev`/`-nic` at all (no NIC: no DNS path to close), and
//! `tsc_early_khz` (under TCG on a loaded host the PIT calibration fails and boot hangs).

use std::path::Path;

/// How the guest's CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
    /// QEMU's software emulation: a separate guest kernel still, much slower.
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Where a share's directory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A descriptor slot runnerd opened and checked (`--bind-fd`).
    Fd(i32),
    /// A path (bwrap without `--bind-fd`).
    Path(String),
}

/// One 9p share: its mount tag (the guest agent mounts by tag) and whether QEMU may write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub tag: &'static str,
    pub source: Source,
    pub writable: bool,
}

/// Everything that decides one VM's two argument lists.
#[derive(Debug, Clone)]
pub struct VmArgs<'a> {
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub accel: Accel,
    pub memory_mib: u64,
    pub cpus: u32,
    /// The descriptor number of QEMU's end of the agent channel.
    pub agent_fd: i32,
    /// The descriptor number of QEMU's end of the egress channel; `None`: no egress port.
    pub egress_fd: Option<i32>,
    pub shares: &'a [Share],
    /// bwrap's `--disable-userns` (the start-up probe's shape).
    pub disable_userns: bool,
}

/// The guest kernel's command line. `tsc_early_khz` only has to be plausible: the guest's
/// TSC is QEMU's under TCG; it spares the PIT calibration that hangs on a loaded host.
pub const KERNEL_CMDLINE: &str =
    "console=ttyS0 quiet loglevel=3 tsc_early_khz=2445406 reboot=t panic=-1 pci=off rdinit=/init";

/// Where QEMU's sandbox holds the environment prefix's share: a VM waiting in the pool that
/// binds it is discarded when an environment changes ([`crate::isolation::prestart::Shape`]).
pub const ENV_SHARE: &str = "/vm/share/env";

const IN_KERNEL: &str = "/vm/vmlinux";
const IN_INITRAMFS: &str = "/vm/initramfs";

fn share_path(share: &Share) -> String {
    if share.tag == "usr" { "/usr".to_owned() } else { format!("/vm/share/{}", share.tag) }
}

fn push(args: &mut Vec<String>, items: &[&str]) {
    args.extend(items.iter().map(|s| (*s).to_owned()));
}

/// bwrap's options for QEMU's sandbox (the launcher adds `--info-fd`, `--seccomp`, the
/// identity files and `--remount-ro /`).
pub fn bwrap_options(vm: &VmArgs<'_>) -> Vec<String> {
    let mut args = Vec::with_capacity(48);
    push(&mut args, &["--die-with-parent", "--new-session", "--unshare-all", "--unshare-user"]);
    if vm.disable_userns {
        push(&mut args, &["--disable-userns"]);
    }
    push(&mut args, &["--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]);
    push(&mut args, &["--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib"]);
    push(&mut args, &["--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev"]);
    if vm.accel == Accel::Kvm {
        push(&mut args, &["--dev-bind", "/dev/kvm", "/dev/kvm"]);
    }
    push(&mut args, &["--tmpfs", "/tmp"]);
    push(&mut args, &["--ro-bind", &vm.kernel.to_string_lossy(), IN_KERNEL]);
    push(&mut args, &["--ro-bind", &vm.initramfs.to_string_lossy(), IN_INITRAMFS]);
    for share in vm.shares.iter().filter(|s| s.tag != "usr") {
        let target = share_path(share);
        match (&share.source, share.writable) {
            (Source::Fd(fd), true) => push(&mut args, &["--bind-fd", &fd.to_string(), &target]),
            (Source::Fd(fd), false) => push(&mut args, &["--ro-bind-fd", &fd.to_string(), &target]),
            (Source::Path(p), true) => push(&mut args, &["--bind", p, &target]),
            (Source::Path(p), false) => push(&mut args, &["--ro-bind", p, &target]),
        }
    }
    push(&mut args, &["--chdir", "/", "--clearenv", "--setenv", "PATH", "/usr/bin"]);
    args
}

/// QEMU's argv, the binary first.
pub fn qemu_argv(qemu: &Path, vm: &VmArgs<'_>) -> Vec<String> {
    let mut a = Vec::with_capacity(64);
    // TCG's translation cache bounded (QEMU's default grows to an eighth of the host's RAM).
    let accel = match vm.accel {
        Accel::Tcg => "tcg,tb-size=64",
        Accel::Kvm => "kvm",
    };
    push(&mut a, &[&qemu.to_string_lossy(), "-M", "microvm,pit=on", "-accel", accel]);
    if vm.accel == Accel::Kvm {
        // `-cpu host` alone dies on MSR 0x10a (ARCH_CAPABILITIES) on some hosts.
        push(&mut a, &["-cpu", "host,-arch-capabilities"]);
    }
    push(&mut a, &["-m", &vm.memory_mib.to_string(), "-smp", &vm.cpus.max(1).to_string()]);
    push(&mut a, &["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]);
    push(&mut a, &["-global", "virtio-mmio.force-legacy=false"]);
    // QEMU's own seccomp filter on top of ours: no exec, no privilege changes.
    push(&mut a, &["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]);
    push(&mut a, &["-kernel", IN_KERNEL, "-initrd", IN_INITRAMFS, "-append", KERNEL_CMDLINE]);
    // The guest's console (kernel messages, the agent's last words) is QEMU's stdout.
    push(&mut a, &["-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console"]);
    push(&mut a, &["-device", "virtio-serial-device"]);
    push(&mut a, &["-chardev", &format!("socket,id=agent,fd={}", vm.agent_fd)]);
    push(
        &mut a,
        &["-device", &format!("virtserialport,chardev=agent,name={}", runner_guest_agent::wire::PORT_NAME)],
    );
    if let Some(fd) = vm.egress_fd {
        // Egress (`domain-allowlist`) only: a second port to runnerd, which relays it to
        // egressd. Without it the guest has no way out at all.
        push(&mut a, &["-chardev", &format!("socket,id=egress,fd={fd}")]);
        push(
            &mut a,
            &[
                "-device",
                &format!("virtserialport,chardev=egress,name={}", runner_guest_agent::wire::EGRESS_PORT_NAME),
            ],
        );
    }
    for share in vm.shares {
        let ro = if share.writable { "" } else { ",readonly=on" };
        push(
            &mut a,
            &[
                "-fsdev",
                &format!("local,id={0},path={1},security_model=none{ro}", share.tag, share_path(share)),
            ],
        );
        push(&mut a, &["-device", &format!("virtio-9p-device,fsdev={0},mount_tag={0}", share.tag)]);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(shares: &[Share], accel: Accel) -> VmArgs<'_> {
        VmArgs {
            kernel: Path::new("/cache/vmlinux"),
            initramfs: Path::new("/cache/initramfs.cpio.gz"),
            accel,
            memory_mib: 512,
            cpus: 2,
            agent_fd: 9,
            egress_fd: None,
            shares,
            disable_userns: false,
        }
    }

    fn shares() -> Vec<Share> {
        vec![
            Share { tag: "usr", source: Source::Path("/usr".into()), writable: false },
            Share { tag: "ws", source: Source::Fd(5), writable: true },
            Share { tag: "env", source: Source::Path("/envs/e1".into()), writable: false },
        ]
    }

    fn window(args: &[String], items: &[&str]) -> bool {
        args.windows(items.len()).any(|w| w.iter().zip(items).all(|(a, b)| a == b))
    }

    #[test]
    fn qemu_has_no_network_and_the_research_flags() {
        let s = shares();
        let a = qemu_argv(Path::new("/usr/bin/qemu-system-x86_64"), &vm(&s, Accel::Tcg));
        assert!(!a.iter().any(|x| x.contains("netdev") || x == "-nic" || x == "-net"));
        for w in [
            &["-nodefaults"][..],
            &["-accel", "tcg,tb-size=64"],
            &["-m", "512", "-smp", "2"],
            &["-global", "virtio-mmio.force-legacy=false"],
            &["-kernel", "/vm/vmlinux", "-initrd", "/vm/initramfs"],
            &["-chardev", "socket,id=agent,fd=9"],
        ] {
            assert!(window(&a, w), "{w:?} missing from {a:?}");
        }
        assert!(a.iter().any(|x| x.starts_with("on,") && x.contains("spawn=deny")));
        assert!(!a.iter().any(|x| x.contains("acpi=off")), "ACPI must stay on");
        assert!(!a.contains(&"-cpu".to_owned()));
        let k = qemu_argv(Path::new("/q"), &vm(&s, Accel::Kvm));
        assert!(window(&k, &["-accel", "kvm", "-cpu", "host,-arch-capabilities"]));
    }

    #[test]
    fn the_egress_port_exists_only_with_egress() {
        let s = shares();
        let none = qemu_argv(Path::new("/q"), &vm(&s, Accel::Tcg));
        assert!(!none.iter().any(|x| x.contains("egress")), "{none:?}");
        let with = qemu_argv(Path::new("/q"), &VmArgs { egress_fd: Some(11), ..vm(&s, Accel::Tcg) });
        assert!(window(&with, &["-chardev", "socket,id=egress,fd=11"]), "{with:?}");
        assert!(window(
            &with,
            &["-device", "virtserialport,chardev=egress,name=org.sciencediscovery.egress"]
        ));
        // Still no NIC: egress is a serial port to runnerd, never a network device.
        assert!(!with.iter().any(|x| x.contains("netdev") || x == "-nic" || x == "-net"));
    }

    #[test]
    fn shares_are_read_only_unless_writable_and_mounted_by_their_descriptor() {
        let s = shares();
        let v = vm(&s, Accel::Tcg);
        let a = qemu_argv(Path::new("/q"), &v);
        assert!(a.contains(&"local,id=usr,path=/usr,security_model=none,readonly=on".to_owned()));
        assert!(a.contains(&"local,id=ws,path=/vm/share/ws,security_model=none".to_owned()));
        assert!(a.contains(&"local,id=env,path=/vm/share/env,security_model=none,readonly=on".to_owned()));
        let b = bwrap_options(&v);
        assert!(window(&b, &["--bind-fd", "5", "/vm/share/ws"]));
        assert!(window(&b, &["--ro-bind", "/envs/e1", ENV_SHARE]));
        assert!(window(&b, &["--ro-bind", "/cache/vmlinux", "/vm/vmlinux"]));
        // /usr is QEMU's own and the guest's; never a second bind, never /dev/kvm under TCG.
        assert_eq!(b.iter().filter(|x| *x == "/usr").count(), 2);
        assert!(!b.iter().any(|x| x == "/dev/kvm"));
        assert!(window(&bwrap_options(&vm(&s, Accel::Kvm)), &["--dev-bind", "/dev/kvm", "/dev/kvm"]));
    }
}
