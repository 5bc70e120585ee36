//! Accelerators in sandboxes (R-NPU-1..4, issue #7 "beyond the seed" for NVIDIA).
//!
//! * Discovery: Ascend chips from the driver's DCMI library ([`dcmi`]), else `npu-smi info
//!   -m` + `npu-smi info` ([`npu_smi`]); NVIDIA GPUs from their device nodes ([`nvidia`]).
//!   Identity is the N of `/dev/davinciN` (the chip logic id) or of `/dev/nvidiaN` (the minor).
//! * Probe ([`probe`]): every supported chip, concurrently, in its own throwaway sandbox of
//!   the executions' form (same argv builder, launcher and seccomp profile) binding only
//!   that chip, running `npu-smi info` / `nvidia-smi -L`. Only chips that pass are usable.
//! * Selection ([`select`]): an execution naming chips re-probes exactly those, fresh; one
//!   refused chip refuses the execution, naming it. The status view (`GET /npu/devices`)
//!   reads a 60 s cache ([`cache`]).
//! * Binds ([`mount`]): the chips after a fresh `/dev`, renumbered (Ascend), the CANN
//!   environment, the `npu` seccomp profile.

pub mod cache;
pub mod dcmi;
#[cfg(test)]
mod launch_tests;
pub use runner_isolation::accel_mount as mount;
pub mod npu_smi;
pub mod nvidia;
pub mod probe;
pub mod select;
#[cfg(test)]
pub mod test_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// Probes and host tools get this long (the original's `NPU_PROBE_TIMEOUT_MS`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// The status view's cache lifetime (`NPU_INVENTORY_TTL_MS`).
pub const INVENTORY_TTL: Duration = Duration::from_secs(60);
/// Output kept from a host tool or a probe (the original's maxBuffer).
pub const MAX_TOOL_OUTPUT: u64 = 1 << 20;

pub const DEFAULT_ASCEND_TOOLKIT: &str = "/usr/local/Ascend/ascend-toolkit/latest";
pub const NPU_SMI_CANDIDATES: &[&str] =
    &["/usr/local/bin/npu-smi", "/usr/local/sbin/npu-smi", "/usr/bin/npu-smi"];
pub const NVIDIA_SMI_CANDIDATES: &[&str] = &["/usr/bin/nvidia-smi", "/usr/local/bin/nvidia-smi"];

/// A number that serializes as an integer when it is one (`0`, not `0.0`), like JSON from
/// JavaScript.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Num(pub f64);

impl Serialize for Num {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_finite() && self.0.fract() == 0.0 && self.0.abs() < 9.0e15 {
            s.serialize_i64(self.0 as i64)
        } else {
            s.serialize_f64(self.0)
        }
    }
}

/// One Ascend chip as `GET /npu/devices` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NpuDevice {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ai_core_percent: Option<Num>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub card_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chip_id: Option<u32>,
    pub chip_name: String,
    /// Always present, `""` when unknown (the original's `health: string`).
    pub health: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hbm_percent: Option<Num>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hbm_total_mb: Option<Num>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hbm_used_mb: Option<Num>,
    /// The chip logic id: the N of `/dev/davinciN`.
    pub host_index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub power_watts: Option<Num>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_unusable_reason: Option<String>,
    pub sandbox_usable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature_celsius: Option<Num>,
}

impl NpuDevice {
    /// A chip known only by identity and name.
    pub fn bare(host_index: u32, chip_name: String) -> NpuDevice {
        NpuDevice {
            ai_core_percent: None,
            bus_id: None,
            card_id: None,
            chip_id: None,
            chip_name,
            health: String::new(),
            hbm_percent: None,
            hbm_total_mb: None,
            hbm_used_mb: None,
            host_index,
            power_watts: None,
            sandbox_unusable_reason: None,
            sandbox_usable: false,
            temperature_celsius: None,
        }
    }
}

/// `GET /npu/devices`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NpuInventory {
    pub captured_at: String,
    pub devices: Vec<NpuDevice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Whether this host has the Ascend tooling (`npu-smi`) at all.
    pub supported: bool,
    /// Ours: where the listing came from (`dcmi`, `npu-smi`), absent when unsupported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'static str>,
}

/// One NVIDIA GPU as `GET /gpu/devices` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuDevice {
    /// The minor number: the N of `/dev/nvidiaN`.
    pub host_index: u32,
    /// From the probe's `nvidia-smi -L` line, when it passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_unusable_reason: Option<String>,
    pub sandbox_usable: bool,
}

/// `GET /gpu/devices` (ours).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    pub captured_at: String,
    pub devices: Vec<GpuDevice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub supported: bool,
}

/// Where the tools and nodes are. Every path is configurable so tests point at fakes
/// through the same code path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccelConfig {
    /// `SCIENCE_AGENT_NPU_SMI_PATH`: when set but not executable, npu-smi counts as absent.
    pub npu_smi_path: Option<PathBuf>,
    /// `SCIENCE_AGENT_ASCEND_TOOLKIT`.
    pub ascend_toolkit: PathBuf,
    /// `SCIENCE_AGENT_NPU_DEVICE_DIR` (ours): where `davinciN` and the management nodes are.
    pub npu_device_dir: PathBuf,
    /// `SCIENCE_AGENT_NPU_DCMI_LIBRARY` (ours).
    pub dcmi_library: PathBuf,
    /// `SCIENCE_AGENT_NVIDIA_SMI_PATH` (ours).
    pub nvidia_smi_path: Option<PathBuf>,
    /// `SCIENCE_AGENT_GPU_DEVICE_DIR` (ours): where `nvidiaN` and the control nodes are.
    pub gpu_device_dir: PathBuf,
}

pub const NPU_SMI_VAR: &str = "SCIENCE_AGENT_NPU_SMI_PATH";
pub const TOOLKIT_VAR: &str = "SCIENCE_AGENT_ASCEND_TOOLKIT";
pub const NPU_DEVICE_DIR_VAR: &str = "SCIENCE_AGENT_NPU_DEVICE_DIR";
pub const DCMI_VAR: &str = "SCIENCE_AGENT_NPU_DCMI_LIBRARY";
pub const NVIDIA_SMI_VAR: &str = "SCIENCE_AGENT_NVIDIA_SMI_PATH";
pub const GPU_DEVICE_DIR_VAR: &str = "SCIENCE_AGENT_GPU_DEVICE_DIR";

impl Default for AccelConfig {
    fn default() -> Self {
        AccelConfig::from_vars(&|_| None)
    }
}

impl AccelConfig {
    /// From a variable lookup. Values are trimmed, and a blank one counts as unset (the
    /// original's `env.X?.trim() || default`).
    pub fn from_vars(lookup: &dyn Fn(&str) -> Option<String>) -> AccelConfig {
        let get = |name: &str| lookup(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        AccelConfig {
            npu_smi_path: get(NPU_SMI_VAR).map(PathBuf::from),
            ascend_toolkit: get(TOOLKIT_VAR).unwrap_or_else(|| DEFAULT_ASCEND_TOOLKIT.to_owned()).into(),
            npu_device_dir: get(NPU_DEVICE_DIR_VAR).unwrap_or_else(|| "/dev".to_owned()).into(),
            dcmi_library: get(DCMI_VAR).unwrap_or_else(|| dcmi::DEFAULT_LIBRARY.to_owned()).into(),
            nvidia_smi_path: get(NVIDIA_SMI_VAR).map(PathBuf::from),
            gpu_device_dir: get(GPU_DEVICE_DIR_VAR).unwrap_or_else(|| "/dev".to_owned()).into(),
        }
    }

    /// The `npu-smi` to use now (looked up each time: a driver installed later counts).
    pub fn npu_smi(&self) -> Option<PathBuf> {
        find_tool(self.npu_smi_path.as_deref(), NPU_SMI_CANDIDATES)
    }

    pub fn nvidia_smi(&self) -> Option<PathBuf> {
        find_tool(self.nvidia_smi_path.as_deref(), NVIDIA_SMI_CANDIDATES)
    }
}

fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The configured tool if it is executable, else (when none is configured) the first
/// executable candidate.
fn find_tool(configured: Option<&Path>, candidates: &[&str]) -> Option<PathBuf> {
    match configured {
        Some(p) => executable(p).then(|| p.to_owned()),
        None => candidates.iter().map(PathBuf::from).find(|p| executable(p)),
    }
}

/// Polls every future to its end, concurrently, on the current task; results in order.
pub async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_trimmed_and_blank_ones_fall_back_to_the_defaults() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
        };
        let cfg =
            AccelConfig::from_vars(&vars(&[(TOOLKIT_VAR, "  /opt/cann  "), (NPU_SMI_VAR, " /x/npu-smi\n")]));
        assert_eq!(cfg.ascend_toolkit, PathBuf::from("/opt/cann"));
        assert_eq!(cfg.npu_smi_path, Some(PathBuf::from("/x/npu-smi")));
        let cfg = AccelConfig::from_vars(&vars(&[(TOOLKIT_VAR, "   "), (NPU_SMI_VAR, "\t")]));
        assert_eq!(cfg.ascend_toolkit, PathBuf::from(DEFAULT_ASCEND_TOOLKIT));
        assert_eq!(cfg.npu_smi_path, None, "blank: the standard places are searched");
    }
}
