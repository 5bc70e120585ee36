//! Fakes for the accelerator tests: a fake `npu-smi` with its tables and device nodes as
//! regular files, a fake `libdcmi.so` built with `cc`, and a scripted prober.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::AccelConfig;
use super::probe::{Family, ProbeFuture, ProbeOutcome, Prober};

pub const FAKE_NPU_SMI: &str = include_str!("fixtures/fake-npu-smi.sh");
pub const FAKE_DCMI_C: &str = include_str!("fixtures/fake_dcmi.c");

/// Mapping for an 8-chip host, logic ids 0..=7 on cards 0..=7, plus one 310P3 at logic 9.
pub fn mapping_text() -> String {
    let mut s = String::from("\tNPU ID    Chip ID    Chip Logic ID    Chip Name\n");
    for card in 0..8 {
        s.push_str(&format!("\t{card}         0          {card}                Ascend 910B3\n"));
        s.push_str(&format!("\t{card}         1          -                Mcu\n"));
    }
    s.push_str("\t9         0          9                Ascend 310P3\n");
    s
}

/// A fake host: `root/bin/npu-smi` with its tables, `root/dev/davinci{0..=7,9}` (content
/// `chip N`) and the management nodes. Returns the configuration pointing at it.
pub fn fake_host(root: &Path) -> AccelConfig {
    let bin = root.join("bin");
    let dev = root.join("dev");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    let smi = bin.join("npu-smi");
    std::fs::write(&smi, FAKE_NPU_SMI).unwrap();
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(bin.join("mapping.txt"), mapping_text()).unwrap();
    std::fs::write(bin.join("info.txt"), include_str!("fixtures/npu-smi-info-910b3.txt")).unwrap();
    for n in (0..8).chain([9]) {
        std::fs::write(dev.join(format!("davinci{n}")), format!("chip {n}\n")).unwrap();
    }
    for m in super::mount::ASCEND_MANAGEMENT {
        std::fs::write(dev.join(m), "").unwrap();
    }
    AccelConfig {
        npu_smi_path: Some(smi),
        npu_device_dir: dev,
        dcmi_library: root.join("no-libdcmi.so"),
        ..AccelConfig::default()
    }
}

/// Builds the fake DCMI library into `dir` with the system C compiler.
pub fn build_fake_dcmi(dir: &Path) -> PathBuf {
    let src = dir.join("fake_dcmi.c");
    let lib = dir.join("libdcmi.so");
    std::fs::write(&src, FAKE_DCMI_C).unwrap();
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc (needed to link Rust anyway) builds the fake libdcmi.so");
    assert!(status.success(), "cc failed to build the fake libdcmi.so");
    lib
}

/// Answers probes from a set of usable chips and records every call.
#[derive(Debug, Default)]
pub struct ScriptedProber {
    pub usable: Mutex<BTreeSet<u32>>,
    pub calls: Mutex<Vec<(Family, u32)>>,
}

impl ScriptedProber {
    pub fn with(usable: &[u32]) -> ScriptedProber {
        ScriptedProber { usable: Mutex::new(usable.iter().copied().collect()), calls: Mutex::default() }
    }

    pub fn calls(&self) -> Vec<(Family, u32)> {
        self.calls.lock().unwrap().clone()
    }
}

impl Prober for ScriptedProber {
    fn probe(&self, family: Family, host_index: u32) -> ProbeFuture<'_> {
        self.calls.lock().unwrap().push((family, host_index));
        let usable = self.usable.lock().unwrap().contains(&host_index);
        Box::pin(async move {
            ProbeOutcome {
                usable,
                stdout: format!("GPU {host_index}: Fake GPU (UUID: GPU-{host_index})\n"),
                detail: if usable {
                    String::new()
                } else {
                    "dcmi model initialized failed, because the device is used. ret is -8020".into()
                },
            }
        })
    }
}
