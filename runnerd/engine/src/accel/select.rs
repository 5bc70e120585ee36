//! Inventories and selection (internals §4.3, §4.5): list the chips, probe the supported
//! ones concurrently, and decide an execution's chips from a fresh probe of exactly those
//! it names. The rules are pure functions; the probing goes through a [`Prober`].

use std::path::Path;

use serde_json::Value;

use super::cache::Cache;
use super::dcmi;
use super::mount::{self, AccelMount};
use super::npu_smi;
use super::nvidia;
use super::probe::{Family, Prober, SandboxProber, host_tool, unusable_reason};
use super::{
    AccelConfig, GpuDevice, GpuInventory, INVENTORY_TTL, NpuDevice, NpuInventory, PROBE_TIMEOUT, join_all,
};
use crate::code::ErrorCode;
use crate::error::EngineError;
use crate::timefmt;

/// Ascend 910 series only (910A, 910B, 910C …, not 310).
pub fn supported_chip(name: &str) -> bool {
    name.contains("910")
}

pub fn unsupported_reason(name: &str) -> String {
    format!("Only Ascend 910 series chips are supported; this one reports \"{name}\".")
}

/// The chips and their status views' caches, held by the [`crate::app::App`].
#[derive(Debug, Default)]
pub struct Accelerators {
    pub config: AccelConfig,
    pub npu: Cache<NpuInventory>,
    pub gpu: Cache<GpuInventory>,
}

impl Accelerators {
    pub fn new(config: AccelConfig) -> Accelerators {
        Accelerators { config, ..Accelerators::default() }
    }
}

/// `GET /npu/devices[?refresh=1]`: the cached inventory (60 s), or a fresh one.
pub async fn npu_view(accel: &Accelerators, prober: &SandboxProber<'_>, refresh: bool) -> NpuInventory {
    let cfg = &accel.config;
    accel.npu.get(refresh, INVENTORY_TTL, || collect_npu(cfg, None, prober), keep_npu).await
}

/// Which NPU inventories the status view keeps: all of them. An inventory whose listing
/// failed (`error` set) is an answer, not a failed load, and the original caches it like
/// any other for the TTL (`?refresh=1` reloads).
pub fn keep_npu(_: &NpuInventory) -> bool {
    true
}

/// `GET /gpu/devices[?refresh=1]`.
pub async fn gpu_view(accel: &Accelerators, prober: &SandboxProber<'_>, refresh: bool) -> GpuInventory {
    let cfg = &accel.config;
    accel.gpu.get(refresh, INVENTORY_TTL, || collect_gpu(cfg, None, prober), |i| i.error.is_none()).await
}

/// DCMI first (off the runtime, bounded), else `npu-smi info -m` + `npu-smi info`.
async fn list_npus(cfg: &AccelConfig, smi: &Path) -> Result<(Vec<NpuDevice>, &'static str), String> {
    let library = cfg.dcmi_library.clone();
    let read = tokio::task::spawn_blocking(move || dcmi::read(&library));
    match tokio::time::timeout(PROBE_TIMEOUT, read).await {
        Ok(Ok(Ok(chips))) if !chips.is_empty() => {
            return Ok((chips.iter().map(dcmi::DcmiChip::to_device).collect(), "dcmi"));
        }
        Ok(Ok(Err(e))) => tracing::debug!(event = "dcmi_unavailable", error = %e),
        _ => tracing::debug!(event = "dcmi_unavailable", error = "no chips, or no answer in time"),
    }
    let (mapping, info) = tokio::join!(host_tool(smi, &["info", "-m"]), host_tool(smi, &["info"]));
    let readings = npu_smi::parse_info(&info?);
    let mapping = mapping.map(|m| npu_smi::parse_mapping(&m)).unwrap_or_default();
    Ok((npu_smi::join(readings, &mapping), "npu-smi"))
}

/// The Ascend inventory, narrowed to `only` when given, every supported chip probed.
pub async fn collect_npu(cfg: &AccelConfig, only: Option<&[u32]>, prober: &dyn Prober) -> NpuInventory {
    let captured_at = timefmt::now_iso();
    let Some(smi) = cfg.npu_smi() else {
        return NpuInventory { captured_at, devices: vec![], error: None, supported: false, source: None };
    };
    let (mut devices, source) = match list_npus(cfg, &smi).await {
        Ok(listed) => listed,
        Err(msg) => {
            return NpuInventory {
                captured_at,
                devices: vec![],
                error: Some(format!("Could not read NPU status: {msg}")),
                supported: true,
                source: None,
            };
        }
    };
    if let Some(only) = only {
        devices.retain(|d| only.contains(&d.host_index));
    }
    let verdicts = join_all(
        devices
            .iter()
            .map(|d| async move {
                if !supported_chip(&d.chip_name) {
                    return Err(unsupported_reason(&d.chip_name));
                }
                let node = cfg.npu_device_dir.join(format!("davinci{}", d.host_index));
                if !node.exists() {
                    return Err(format!("{} does not exist on this machine.", node.display()));
                }
                let seen = prober.probe(Family::Ascend, d.host_index).await;
                if seen.usable {
                    Ok(())
                } else {
                    Err(unusable_reason(Family::Ascend, d.host_index, &seen.detail))
                }
            })
            .collect(),
    )
    .await;
    for (d, v) in devices.iter_mut().zip(verdicts) {
        d.sandbox_usable = v.is_ok();
        d.sandbox_unusable_reason = v.err();
    }
    NpuInventory { captured_at, devices, error: None, supported: true, source: Some(source) }
}

/// The NVIDIA inventory: every `/dev/nvidiaN`, each probed with `nvidia-smi -L`.
pub async fn collect_gpu(cfg: &AccelConfig, only: Option<&[u32]>, prober: &dyn Prober) -> GpuInventory {
    let captured_at = timefmt::now_iso();
    if cfg.nvidia_smi().is_none() {
        return GpuInventory { captured_at, devices: vec![], error: None, supported: false };
    }
    let mut minors = match nvidia::list_nodes(&cfg.gpu_device_dir) {
        Ok(m) => m,
        Err(e) => {
            return GpuInventory {
                captured_at,
                devices: vec![],
                error: Some(format!(
                    "Could not read GPU device nodes in {}: {e}",
                    cfg.gpu_device_dir.display()
                )),
                supported: true,
            };
        }
    };
    if let Some(only) = only {
        minors.retain(|m| only.contains(m));
    }
    let seen = join_all(minors.iter().map(|m| prober.probe(Family::Nvidia, *m)).collect()).await;
    let devices = minors
        .iter()
        .zip(seen)
        .map(|(m, s)| {
            let (name, uuid) = nvidia::parse_list(&s.stdout).map_or((None, None), |(n, u)| (Some(n), u));
            GpuDevice {
                host_index: *m,
                name: name.filter(|_| s.usable),
                uuid: uuid.filter(|_| s.usable),
                sandbox_unusable_reason: (!s.usable).then(|| unusable_reason(Family::Nvidia, *m, &s.detail)),
                sandbox_usable: s.usable,
            }
        })
        .collect();
    GpuInventory { captured_at, devices, error: None, supported: true }
}

/// Why each requested chip cannot be used (empty: all can), from a fresh inventory.
pub fn rejections(
    family: Family,
    supported: bool,
    listed: &[(u32, bool, Option<String>)],
    requested: &[u32],
) -> Vec<String> {
    let label = family.label();
    requested
        .iter()
        .filter_map(|h| match listed.iter().find(|(i, _, _)| i == h) {
            None if !supported => Some(match family {
                Family::Ascend => {
                    format!("This machine reports no Ascend NPU cards, so NPU {h} cannot be selected.")
                }
                Family::Nvidia => {
                    format!("This machine reports no NVIDIA GPUs, so GPU {h} cannot be selected.")
                }
            }),
            None => Some(format!("{label} {h} is no longer present on this machine.")),
            Some((_, true, _)) => None,
            Some((_, false, reason)) => Some(reason.clone().unwrap_or_else(|| {
                format!("{label} {h} cannot be opened inside the sandbox on this machine.")
            })),
        })
        .collect()
}

/// `npuDevices` / `gpuDevices`: absent, null or empty → none; else non-negative integers,
/// deduplicated and sorted.
pub fn requested(value: Option<&Value>, field: &str) -> Result<Vec<u32>, EngineError> {
    let bad = || {
        EngineError::invalid(
            ErrorCode::InvalidAccelerators,
            format!("{field} must be an array of non-negative integer device indices"),
        )
    };
    match value {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => {
            // `4.0` is the number 4 to the original (JavaScript has one number type).
            let index = |v: &Value| {
                v.as_u64().and_then(|n| u32::try_from(n).ok()).or_else(|| {
                    v.as_f64()
                        .filter(|f| f.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(f))
                        .map(|f| f as u32)
                })
            };
            let ids = items.iter().map(|v| index(v).ok_or_else(bad)).collect::<Result<Vec<u32>, _>>()?;
            Ok(mount::normalize(&ids))
        }
        Some(_) => Err(bad()),
    }
}

/// An execution's chips: `None` without any (and then nothing is probed); else a fresh
/// probe of exactly the named chips, and the whole execution refused if one is not usable.
pub async fn resolve(
    cfg: &AccelConfig,
    npu: &[u32],
    gpu: &[u32],
    prober: &dyn Prober,
) -> Result<Option<AccelMount>, EngineError> {
    if npu.is_empty() && gpu.is_empty() {
        return Ok(None);
    }
    let exists = |p: &Path| p.exists();
    let mut out = AccelMount::default();
    if !npu.is_empty() {
        let inv = collect_npu(cfg, Some(npu), prober).await;
        let listed: Vec<_> = inv
            .devices
            .iter()
            .map(|d| (d.host_index, d.sandbox_usable, d.sandbox_unusable_reason.clone()))
            .collect();
        let why = rejections(Family::Ascend, inv.supported, &listed, npu);
        if !why.is_empty() {
            return Err(EngineError::unavailable(
                ErrorCode::NpuUnavailable,
                format!("Requested NPU cards are not usable on this machine: {}", why.join(" ")),
            ));
        }
        out = out.merge(mount::ascend(
            npu,
            &cfg.npu_device_dir,
            &cfg.ascend_toolkit,
            cfg.npu_smi().as_deref(),
            &exists,
        ));
    }
    if !gpu.is_empty() {
        let inv = collect_gpu(cfg, Some(gpu), prober).await;
        let listed: Vec<_> = inv
            .devices
            .iter()
            .map(|d| (d.host_index, d.sandbox_usable, d.sandbox_unusable_reason.clone()))
            .collect();
        let why = rejections(Family::Nvidia, inv.supported, &listed, gpu);
        if !why.is_empty() {
            return Err(EngineError::unavailable(
                ErrorCode::GpuUnavailable,
                format!("Requested GPUs are not usable on this machine: {}", why.join(" ")),
            ));
        }
        out = out.merge(mount::nvidia(gpu, &cfg.gpu_device_dir, cfg.nvidia_smi().as_deref(), &exists));
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accel::Num;
    use crate::accel::test_support::{ScriptedProber, fake_host};

    const OCCUPIED: &str = "dcmi model initialized failed, because the device is used. ret is -8020";

    #[tokio::test]
    async fn no_npu_smi_means_unsupported_and_nothing_is_probed() {
        let cfg = AccelConfig { npu_smi_path: Some("/nonexistent/npu-smi".into()), ..AccelConfig::default() };
        let prober = ScriptedProber::with(&[0]);
        let inv = collect_npu(&cfg, None, &prober).await;
        assert_eq!((inv.supported, inv.devices.len(), inv.error.clone()), (false, 0, None));
        let err = resolve(&cfg, &[3], &[], &prober).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "Requested NPU cards are not usable on this machine: This machine reports no Ascend NPU cards, so NPU 3 cannot be selected."
        );
        assert!(prober.calls().is_empty());
    }

    #[tokio::test]
    async fn the_inventory_probes_supported_present_chips_concurrently_and_explains_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = fake_host(dir.path());
        std::fs::remove_file(cfg.npu_device_dir.join("davinci7")).unwrap();
        let prober = ScriptedProber::with(&[0, 1, 2, 3, 5, 6]);
        let inv = collect_npu(&cfg, None, &prober).await;
        assert!(inv.supported && inv.error.is_none(), "{inv:?}");
        assert_eq!(inv.source, Some("npu-smi"));
        let ids: Vec<u32> = inv.devices.iter().map(|d| d.host_index).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 9]);
        let d = |h: u32| inv.devices.iter().find(|d| d.host_index == h).unwrap();
        assert!(d(0).sandbox_usable && d(0).sandbox_unusable_reason.is_none());
        // Readings joined on (card, chip): card 5 chip 0 is logic 5.
        assert_eq!(
            (d(0).hbm_used_mb, d(5).hbm_used_mb, d(1).hbm_used_mb),
            (Some(Num(3445.0)), Some(Num(60156.0)), None)
        );
        assert_eq!(
            d(4).sandbox_unusable_reason.as_deref(),
            Some(format!("NPU 4 cannot be opened inside the sandbox: {OCCUPIED}").as_str())
        );
        let node7 = cfg.npu_device_dir.join("davinci7");
        assert_eq!(
            d(7).sandbox_unusable_reason,
            Some(format!("{} does not exist on this machine.", node7.display()))
        );
        assert_eq!(d(9).chip_name, "310P3");
        assert_eq!(
            d(9).sandbox_unusable_reason.as_deref(),
            Some("Only Ascend 910 series chips are supported; this one reports \"310P3\".")
        );
        let mut probed: Vec<u32> = prober.calls().iter().map(|(_, h)| *h).collect();
        probed.sort_unstable();
        assert_eq!(probed, [0, 1, 2, 3, 4, 5, 6], "unsupported and absent chips are not probed");
    }

    #[tokio::test]
    async fn a_failed_listing_is_reported_with_the_tools_words_and_cached_like_any_answer() {
        let dir = tempfile::tempdir().unwrap();
        let accel = Accelerators::new(fake_host(dir.path()));
        std::fs::remove_file(dir.path().join("bin/info.txt")).unwrap(); // `npu-smi info` now fails
        let prober = ScriptedProber::with(&[0]);
        let load = || collect_npu(&accel.config, None, &prober);
        let first = accel.npu.get(false, INVENTORY_TTL, load, keep_npu).await;
        let smi = accel.config.npu_smi_path.clone().unwrap();
        assert_eq!(
            first.error,
            Some(format!(
                "Could not read NPU status: Command failed: {} info\ndcmi model initialized failed\n",
                smi.display()
            ))
        );
        assert_eq!((first.supported, first.devices.len(), first.source), (true, 0, None));
        let again = accel.npu.get(false, INVENTORY_TTL, || async { unreachable!() }, keep_npu).await;
        assert_eq!(again, first, "within the TTL the same answer, as the original's cache");
        assert!(prober.calls().is_empty());
    }

    #[tokio::test]
    async fn executions_without_chips_never_probe() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = fake_host(dir.path());
        let prober = ScriptedProber::with(&[0, 1]);
        assert_eq!(resolve(&cfg, &[], &[], &prober).await.unwrap(), None);
        assert!(prober.calls().is_empty());
    }

    #[tokio::test]
    async fn a_cached_usable_verdict_is_overridden_by_the_fresh_probe_of_exactly_the_named_chip() {
        let dir = tempfile::tempdir().unwrap();
        let accel = Accelerators::new(fake_host(dir.path()));
        let prober = ScriptedProber::with(&[4]);
        let view =
            accel.npu.get(false, INVENTORY_TTL, || collect_npu(&accel.config, None, &prober), |_| true).await;
        assert!(view.devices.iter().any(|d| d.host_index == 4 && d.sandbox_usable));
        prober.usable.lock().unwrap().clear(); // another tenant takes chip 4
        prober.calls.lock().unwrap().clear();
        let err = resolve(&accel.config, &[4], &[], &prober).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "Requested NPU cards are not usable on this machine: NPU 4 cannot be opened inside the sandbox: {OCCUPIED}"
            )
        );
        assert_eq!(prober.calls(), [(Family::Ascend, 4)], "exactly the named chip, fresh");
        let cached = accel.npu.get(false, INVENTORY_TTL, || async { unreachable!() }, |_| true).await;
        assert!(
            cached.devices.iter().any(|d| d.host_index == 4 && d.sandbox_usable),
            "the status view keeps its cache"
        );
    }

    #[tokio::test]
    async fn one_refused_chip_refuses_the_execution_with_every_reason() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = fake_host(dir.path());
        let prober = ScriptedProber::with(&[4, 6]);
        let mount = resolve(&cfg, &[6, 4], &[], &prober).await.unwrap().unwrap();
        assert_eq!(mount.ascend, [4, 6]);
        let err = resolve(&cfg, &[4, 5, 9, 12], &[], &prober).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "Requested NPU cards are not usable on this machine: NPU 5 cannot be opened inside the sandbox: {OCCUPIED} Only Ascend 910 series chips are supported; this one reports \"310P3\". NPU 12 is no longer present on this machine."
            )
        );
        assert_eq!(err.code().as_str(), "npu_unavailable");
    }

    #[test]
    fn rejection_rules() {
        let listed = [(1, true, None), (2, false, Some("r2".to_owned())), (3, false, None)];
        assert_eq!(rejections(Family::Ascend, true, &listed, &[1]), Vec::<String>::new());
        assert_eq!(
            rejections(Family::Ascend, true, &listed, &[2, 3, 4]),
            [
                "r2",
                "NPU 3 cannot be opened inside the sandbox on this machine.",
                "NPU 4 is no longer present on this machine."
            ]
        );
        assert_eq!(
            rejections(Family::Nvidia, false, &[], &[0]),
            ["This machine reports no NVIDIA GPUs, so GPU 0 cannot be selected."]
        );
    }

    #[test]
    fn request_fields() {
        let obj = |v: Value| v.as_object().unwrap().clone();
        let cases: Vec<(Value, Result<Vec<u32>, ()>)> = vec![
            (serde_json::json!({}), Ok(vec![])),
            (serde_json::json!({"npuDevices": null}), Ok(vec![])),
            (serde_json::json!({"npuDevices": []}), Ok(vec![])),
            (serde_json::json!({"npuDevices": [6, 4, 4]}), Ok(vec![4, 6])),
            (serde_json::json!({"npuDevices": [-1]}), Err(())),
            (serde_json::json!({"npuDevices": [1.5]}), Err(())),
            (serde_json::json!({"npuDevices": ["1"]}), Err(())),
            (serde_json::json!({"npuDevices": 1}), Err(())),
            (serde_json::json!({"npuDevices": [4294967296u64]}), Err(())),
            (serde_json::json!({"npuDevices": [4.0, 2]}), Ok(vec![2, 4])),
            (serde_json::json!({"npuDevices": [-0.5]}), Err(())),
            (serde_json::json!({"npuDevices": [true]}), Err(())),
            (serde_json::json!({"npuDevices": [null]}), Err(())),
        ];
        for (v, want) in cases {
            assert_eq!(
                requested(obj(v.clone()).get("npuDevices"), "npuDevices").map_err(|_| ()),
                want,
                "{v}"
            );
        }
    }

    #[tokio::test]
    async fn gpus_from_device_nodes_probed_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        for n in ["nvidia0", "nvidia1", "nvidia3", "nvidiactl", "nvidia-uvm"] {
            std::fs::write(dev.join(n), "").unwrap();
        }
        let smi = dir.path().join("nvidia-smi");
        std::fs::write(&smi, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let cfg =
            AccelConfig { nvidia_smi_path: Some(smi), gpu_device_dir: dev.clone(), ..AccelConfig::default() };
        let prober = ScriptedProber::with(&[0, 3]);
        let inv = collect_gpu(&cfg, None, &prober).await;
        let got: Vec<(u32, bool, Option<&str>)> =
            inv.devices.iter().map(|d| (d.host_index, d.sandbox_usable, d.name.as_deref())).collect();
        assert_eq!(got, [(0, true, Some("Fake GPU")), (1, false, None), (3, true, Some("Fake GPU"))]);
        prober.calls.lock().unwrap().clear();
        let mount = resolve(&cfg, &[], &[3], &prober).await.unwrap().unwrap();
        assert_eq!(prober.calls(), [(Family::Nvidia, 3)]);
        let targets: Vec<&str> = mount.binds.iter().filter(|b| b.device).map(|b| b.target.as_str()).collect();
        assert_eq!(targets, ["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]);
        let smi = cfg.nvidia_smi_path.as_ref().unwrap();
        assert!(
            mount.binds.iter().any(|b| !b.device && &b.source == smi),
            "a tool outside /usr is bound read-only"
        );
        let err = resolve(&cfg, &[], &[1], &prober).await.unwrap_err();
        assert!(
            err.to_string()
                .starts_with("Requested GPUs are not usable on this machine: GPU 1 cannot be opened"),
            "{}",
            err.to_string()
        );
    }
}
