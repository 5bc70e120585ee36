//! Which backend an execution runs in (issue #36): `SCIENCE_AGENT_ISOLATION` (or the
//! configuration file's `isolation`) sets the default, a request's `isolation` field picks
//! one per execution. Provisioning steps, accelerator probes and `selftest` stay on bwrap.
//! Pure: the settings are a function of a variable lookup, the choice of a request's value.

use std::path::PathBuf;

use super::microvm::{AccelSetting, MicrovmSettings};

pub const ISOLATION_VAR: &str = "SCIENCE_AGENT_ISOLATION";
pub const QEMU_VAR: &str = "SCIENCE_AGENT_MICROVM_QEMU";
pub const KERNEL_VAR: &str = "SCIENCE_AGENT_MICROVM_KERNEL";
pub const INITRAMFS_VAR: &str = "SCIENCE_AGENT_MICROVM_INITRAMFS";
pub const ACCEL_VAR: &str = "SCIENCE_AGENT_MICROVM_ACCEL";
pub const POOL_VAR: &str = "SCIENCE_AGENT_MICROVM_POOL";
pub const POOL_PER_TENANT_VAR: &str = "SCIENCE_AGENT_MICROVM_POOL_PER_TENANT";

/// The configuration file's keys, each with its variable.
pub const KEYS: [(&str, &str); 7] = [
    ("isolation", ISOLATION_VAR),
    ("microvm_qemu", QEMU_VAR),
    ("microvm_kernel", KERNEL_VAR),
    ("microvm_initramfs", INITRAMFS_VAR),
    ("microvm_accel", ACCEL_VAR),
    ("microvm_pool", POOL_VAR),
    ("microvm_pool_per_tenant", POOL_PER_TENANT_VAR),
];

/// An isolation backend by name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Bwrap,
    Microvm,
}

impl Backend {
    pub const NAMES: &'static str = "bwrap or microvm";

    pub fn parse(value: &str) -> Option<Backend> {
        match value {
            "bwrap" | "bubblewrap" => Some(Backend::Bwrap),
            "microvm" => Some(Backend::Microvm),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Bwrap => "bwrap",
            Backend::Microvm => "microvm",
        }
    }
}

/// The backends' settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IsolationSettings {
    /// Executions without an `isolation` field.
    pub default: Backend,
    pub microvm: MicrovmSettings,
}

/// A setting start-up refuses: the variable and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}: {reason}")]
pub struct SettingError {
    pub name: &'static str,
    pub reason: String,
}

impl IsolationSettings {
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<IsolationSettings, SettingError> {
        let get = |name: &str| get(name).filter(|v| !v.is_empty());
        let default = match get(ISOLATION_VAR) {
            None => Backend::Bwrap,
            Some(v) => Backend::parse(&v).ok_or_else(|| SettingError {
                name: ISOLATION_VAR,
                reason: format!("must be {}, not {v:?}", Backend::NAMES),
            })?,
        };
        let accel = match get(ACCEL_VAR) {
            None => AccelSetting::Auto,
            Some(v) => AccelSetting::parse(&v).ok_or_else(|| SettingError {
                name: ACCEL_VAR,
                reason: format!("must be auto, kvm or tcg, not {v:?}"),
            })?,
        };
        let fallback = MicrovmSettings::default();
        let path = |name, default: PathBuf| get(name).map_or(default, PathBuf::from);
        let count = |name: &'static str, default: usize, least: usize| match get(name) {
            None => Ok(default),
            Some(v) => v.trim().parse::<usize>().ok().filter(|n| *n >= least).ok_or_else(|| SettingError {
                name,
                reason: format!("must be a whole number of at least {least}, not {v:?}"),
            }),
        };
        let pool = super::PrestartSettings {
            per_node: count(POOL_VAR, fallback.pool.per_node, 0)?,
            per_tenant: count(POOL_PER_TENANT_VAR, fallback.pool.per_tenant, 1)?,
            idle: fallback.pool.idle,
        };
        Ok(IsolationSettings {
            default,
            microvm: MicrovmSettings {
                qemu: path(QEMU_VAR, fallback.qemu),
                kernel: path(KERNEL_VAR, fallback.kernel),
                initramfs: path(INITRAMFS_VAR, fallback.initramfs),
                accel,
                pool,
            },
        })
    }

    /// The effective value of one of [`KEYS`], for `--check-config`.
    pub fn row(&self, key: &str) -> String {
        match key {
            "isolation" => self.default.name().to_owned(),
            "microvm_qemu" => self.microvm.qemu.display().to_string(),
            "microvm_kernel" => self.microvm.kernel.display().to_string(),
            "microvm_initramfs" => self.microvm.initramfs.display().to_string(),
            "microvm_accel" => self.microvm.accel.name().to_owned(),
            "microvm_pool" => self.microvm.pool.per_node.to_string(),
            "microvm_pool_per_tenant" => self.microvm.pool.per_tenant.to_string(),
            _ => String::new(),
        }
    }
}

/// The backend a request asks for: its `isolation` value, else the default; the error is
/// the 400's text.
pub fn requested(value: Option<&str>, default: Backend) -> Result<Backend, String> {
    match value {
        None => Ok(default),
        Some(v) => {
            Backend::parse(v).ok_or_else(|| format!("isolation must be {}, not {v:?}", Backend::NAMES))
        }
    }
}

/// `/health`'s `isolation` block: the default, and per backend whether it can run and why
/// not; for microvm also KVM or TCG and, per limit, what the VM enforces (R-PEER-1).
pub fn health(default: Backend, bwrap: &dyn super::Isolation, microvm: &super::Microvm) -> serde_json::Value {
    let entry = |i: &dyn super::Isolation| {
        let reason = i.unavailable();
        serde_json::json!({"available": reason.is_none(), "reason": reason})
    };
    let mut vm = entry(microvm);
    vm["accel"] = microvm.accel().name().into();
    vm["accelSetting"] = microvm.settings().accel.name().into();
    vm["accelReason"] = microvm.accel_reason().into();
    vm["kernel"] = microvm.settings().kernel.display().to_string().into();
    vm["enforces"] = serde_json::json!({
        "memoryBytes": "the guest's RAM (QEMU -m, at least 128 MiB): the guest kernel's OOM killer ends the command and the answer still comes back",
        "cpu": "whole vCPUs (QEMU -smp, resourceLimits.cpu rounded up, at most the host's cores)",
        "pids": "RLIMIT_NPROC of the command's user inside the guest",
        "tmpBytes": "the size of the guest's /tmp tmpfs",
        "workspaceBytes": "as with bwrap: measured and enforced on the host",
        "network": "the VM has no NIC; domain-allowlist: a second virtio-serial port, relayed by runnerd to egressd's gateway (HTTP_PROXY inside), present only with egress",
    });
    serde_json::json!({
        "default": default.name(),
        "backends": {"bwrap": entry(bwrap), "microvm": vm},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<IsolationSettings, SettingError> {
        IsolationSettings::from_vars(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| (*v).to_owned()))
    }

    #[test]
    fn settings_table() {
        let d = settings(&[]).unwrap();
        assert_eq!((d.default, d.microvm.accel), (Backend::Bwrap, AccelSetting::Auto));
        let s = settings(&[(ISOLATION_VAR, "microvm"), (ACCEL_VAR, "kvm"), (KERNEL_VAR, "/k")]).unwrap();
        assert_eq!(
            (s.default, s.microvm.accel, s.microvm.kernel.as_path()),
            (Backend::Microvm, AccelSetting::Kvm, "/k".as_ref())
        );
        assert_eq!(settings(&[(ISOLATION_VAR, "")]).unwrap().default, Backend::Bwrap);
        assert_eq!(settings(&[(ISOLATION_VAR, "firecracker")]).unwrap_err().name, ISOLATION_VAR);
        assert_eq!(settings(&[(ACCEL_VAR, "hvf")]).unwrap_err().name, ACCEL_VAR);
        assert_eq!(d.microvm.pool, super::super::microvm::DEFAULT_POOL);
        let p = settings(&[(POOL_VAR, "0"), (POOL_PER_TENANT_VAR, "3")]).unwrap().microvm.pool;
        assert_eq!((p.per_node, p.per_tenant), (0, 3));
        assert_eq!(settings(&[(POOL_VAR, "-1")]).unwrap_err().name, POOL_VAR);
        assert_eq!(settings(&[(POOL_PER_TENANT_VAR, "0")]).unwrap_err().name, POOL_PER_TENANT_VAR);
    }

    #[test]
    fn a_request_picks_its_backend() {
        assert_eq!(requested(None, Backend::Microvm), Ok(Backend::Microvm));
        assert_eq!(requested(Some("bwrap"), Backend::Microvm), Ok(Backend::Bwrap));
        assert_eq!(requested(Some("microvm"), Backend::Bwrap), Ok(Backend::Microvm));
        assert!(requested(Some("vm"), Backend::Bwrap).unwrap_err().contains("bwrap or microvm"));
    }
}
