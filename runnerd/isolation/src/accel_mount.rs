//! What a sandbox with accelerators gets (internals §4.4), as pure functions of the
//! selection and of which host paths exist: the device binds after the fresh `--dev /dev`,
//! the read-only binds, the CANN environment, the `PATH` prefix and `PYTHONPATH` entries.
//!
//! Ascend chips are renumbered from 0 in ascending host order: the driver enumerates the
//! `/dev/davinciN` it can see, all or nothing. NVIDIA GPUs keep their names: the kernel
//! driver identifies a GPU by the node's minor number, which a bind mount keeps, and
//! NVML/CUDA look for `/dev/nvidia<minor>` under that number.

use std::path::{Path, PathBuf};

/// The fixed driver root of an Ascend installation.
pub const ASCEND_DRIVER: &str = "/usr/local/Ascend/driver";
/// Ascend management nodes, bound where they exist.
pub const ASCEND_MANAGEMENT: &[&str] = &["davinci_manager", "devmm_svm", "hisi_hdc"];
/// NVIDIA control nodes, bound where they exist.
pub const NVIDIA_CONTROL: &[&str] = &["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];
/// Without it the Ascend driver warns "driver package may not be completely installed".
pub const ASCEND_INSTALL_INFO: &str = "/etc/ascend_install.info";

/// One bind: `--dev-bind` for device nodes, `--ro-bind` for files and trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub device: bool,
    pub source: PathBuf,
    pub target: String,
}

/// The accelerator part of one sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccelMount {
    /// Placed right after `--dev /dev`, in order.
    pub binds: Vec<Bind>,
    /// Appended after the host runtime's variables, in order; replaces earlier values.
    pub env: Vec<(String, String)>,
    /// `PATH` gains `/usr/local/bin:` in front (where `npu-smi` lives).
    pub path_prefix: bool,
    /// `PYTHONPATH` entries, after any existing ones.
    pub python_path: Vec<String>,
    /// The host indices bound, in bind order (for the audit record).
    pub ascend: Vec<u32>,
    pub nvidia: Vec<u32>,
}

impl AccelMount {
    pub fn is_empty(&self) -> bool {
        self.ascend.is_empty() && self.nvidia.is_empty()
    }

    /// Both families in one sandbox.
    pub fn merge(mut self, other: AccelMount) -> AccelMount {
        for b in other.binds {
            if !self.binds.contains(&b) {
                self.binds.push(b);
            }
        }
        self.env.extend(other.env);
        self.path_prefix |= other.path_prefix;
        self.python_path.extend(other.python_path);
        self.ascend.extend(other.ascend);
        self.nvidia.extend(other.nvidia);
        self
    }
}

/// Deduplicated, ascending.
pub fn normalize(selection: &[u32]) -> Vec<u32> {
    let mut s = selection.to_vec();
    s.sort_unstable();
    s.dedup();
    s
}

/// The Ascend toolkit's environment for toolkit root `t` (replaces earlier values).
pub fn cann_env(t: &Path) -> Vec<(String, String)> {
    let t = t.to_string_lossy();
    let d = ASCEND_DRIVER;
    vec![
        ("ASCEND_AICPU_PATH".into(), t.to_string()),
        ("ASCEND_HOME_PATH".into(), t.to_string()),
        ("ASCEND_OPP_PATH".into(), format!("{t}/opp")),
        ("ASCEND_TOOLKIT_HOME".into(), t.to_string()),
        ("TOOLCHAIN_HOME".into(), format!("{t}/toolkit")),
        // `common` is needed: libascend_hal.so links libc_sec.so from there.
        (
            "LD_LIBRARY_PATH".into(),
            format!(
                "{d}/lib64:{d}/lib64/common:{d}/lib64/driver:{t}/lib64:{t}/lib64/plugin/opskernel:{t}/lib64/plugin/nnengine"
            ),
        ),
    ]
}

fn ro(source: &Path) -> Bind {
    Bind { device: false, source: source.to_owned(), target: source.to_string_lossy().into_owned() }
}

/// A tool outside `/usr` is not covered by `--ro-bind /usr /usr`: it is bound read-only at
/// its own path (relocated installs, and the test fakes).
fn tool_bind(tool: Option<&Path>) -> Option<Bind> {
    tool.filter(|p| !p.starts_with("/usr")).map(ro)
}

/// Ascend chips `selection` (host logic ids) from `device_dir`, renumbered from 0.
pub fn ascend(
    selection: &[u32],
    device_dir: &Path,
    toolkit: &Path,
    npu_smi: Option<&Path>,
    exists: &dyn Fn(&Path) -> bool,
) -> AccelMount {
    let chips = normalize(selection);
    if chips.is_empty() {
        return AccelMount::default();
    }
    let mut binds: Vec<Bind> = chips
        .iter()
        .enumerate()
        .map(|(i, h)| Bind {
            device: true,
            source: device_dir.join(format!("davinci{h}")),
            target: format!("/dev/davinci{i}"),
        })
        .collect();
    for name in ASCEND_MANAGEMENT {
        let p = device_dir.join(name);
        if exists(&p) {
            binds.push(Bind { device: true, source: p, target: format!("/dev/{name}") });
        }
    }
    if exists(Path::new(ASCEND_INSTALL_INFO)) {
        binds.push(ro(Path::new(ASCEND_INSTALL_INFO)));
    }
    binds.extend(tool_bind(npu_smi));
    if !toolkit.starts_with("/usr") && exists(toolkit) {
        binds.push(ro(toolkit));
    }
    let t = toolkit.to_string_lossy();
    AccelMount {
        binds,
        env: cann_env(toolkit),
        path_prefix: true,
        python_path: vec![
            format!("{t}/python/site-packages"),
            format!("{t}/opp/built-in/op_impl/ai_core/tbe"),
        ],
        ascend: chips,
        nvidia: Vec::new(),
    }
}

/// NVIDIA GPUs `selection` (minor numbers) from `device_dir`, under their own names, with
/// the control nodes that exist.
pub fn nvidia(
    selection: &[u32],
    device_dir: &Path,
    nvidia_smi: Option<&Path>,
    exists: &dyn Fn(&Path) -> bool,
) -> AccelMount {
    let gpus = normalize(selection);
    if gpus.is_empty() {
        return AccelMount::default();
    }
    let mut binds: Vec<Bind> = gpus
        .iter()
        .map(|m| Bind {
            device: true,
            source: device_dir.join(format!("nvidia{m}")),
            target: format!("/dev/nvidia{m}"),
        })
        .collect();
    for name in NVIDIA_CONTROL {
        let p = device_dir.join(name);
        if exists(&p) {
            binds.push(Bind { device: true, source: p, target: format!("/dev/{name}") });
        }
    }
    binds.extend(tool_bind(nvidia_smi));
    AccelMount { binds, nvidia: gpus, ..AccelMount::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(_: &Path) -> bool {
        true
    }
    fn none(_: &Path) -> bool {
        false
    }
    const T: &str = "/usr/local/Ascend/ascend-toolkit/latest";

    fn pairs(m: &AccelMount) -> Vec<(String, String)> {
        m.binds
            .iter()
            .filter(|b| b.device)
            .map(|b| (b.source.display().to_string(), b.target.clone()))
            .collect()
    }

    #[test]
    fn ascend_selection_is_deduped_sorted_and_renumbered() {
        let dev = Path::new("/dev");
        type Case<'a> = (&'a [u32], &'a [(&'a str, &'a str)]);
        let cases: &[Case] = &[
            (&[6, 4], &[("/dev/davinci4", "/dev/davinci0"), ("/dev/davinci6", "/dev/davinci1")]),
            (&[4, 4], &[("/dev/davinci4", "/dev/davinci0")]),
            (&[5, 4], &[("/dev/davinci4", "/dev/davinci0"), ("/dev/davinci5", "/dev/davinci1")]),
        ];
        for (sel, want) in cases {
            let m = ascend(sel, dev, Path::new(T), Some(Path::new("/usr/local/bin/npu-smi")), &none);
            let want: Vec<(String, String)> = want.iter().map(|(a, b)| ((*a).into(), (*b).into())).collect();
            assert_eq!(pairs(&m), want, "{sel:?}");
            assert!(m.binds.iter().all(|b| b.device), "npu-smi under /usr is not bound separately");
        }
        assert_eq!(ascend(&[], dev, Path::new(T), None, &all), AccelMount::default());
    }

    #[test]
    fn ascend_management_nodes_install_info_and_relocated_tools() {
        let m = ascend(
            &[2],
            Path::new("/t/dev"),
            Path::new("/opt/cann"),
            Some(Path::new("/t/bin/npu-smi")),
            &all,
        );
        let got: Vec<(bool, String, String)> =
            m.binds.iter().map(|b| (b.device, b.source.display().to_string(), b.target.clone())).collect();
        let want = [
            (true, "/t/dev/davinci2", "/dev/davinci0"),
            (true, "/t/dev/davinci_manager", "/dev/davinci_manager"),
            (true, "/t/dev/devmm_svm", "/dev/devmm_svm"),
            (true, "/t/dev/hisi_hdc", "/dev/hisi_hdc"),
            (false, "/etc/ascend_install.info", "/etc/ascend_install.info"),
            (false, "/t/bin/npu-smi", "/t/bin/npu-smi"),
            (false, "/opt/cann", "/opt/cann"),
        ];
        let want: Vec<(bool, String, String)> =
            want.iter().map(|(d, s, t)| (*d, (*s).into(), (*t).into())).collect();
        assert_eq!(got, want);
        // The relocated toolkit is followed in every variable.
        assert_eq!(m.env[3], ("ASCEND_TOOLKIT_HOME".into(), "/opt/cann".into()));
        assert!(m.python_path[0].starts_with("/opt/cann/"));
    }

    #[test]
    fn cann_environment() {
        let m = ascend(&[0], Path::new("/dev"), Path::new(T), None, &none);
        let keys: Vec<&str> = m.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "ASCEND_AICPU_PATH",
                "ASCEND_HOME_PATH",
                "ASCEND_OPP_PATH",
                "ASCEND_TOOLKIT_HOME",
                "TOOLCHAIN_HOME",
                "LD_LIBRARY_PATH"
            ]
        );
        assert_eq!(m.env[2].1, format!("{T}/opp"));
        assert_eq!(m.env[4].1, format!("{T}/toolkit"));
        assert!(m.env[5].1.contains("/usr/local/Ascend/driver/lib64/common"));
        assert!(m.env[5].1.ends_with(&format!("{T}/lib64/plugin/nnengine")));
        assert_eq!(
            m.python_path,
            [format!("{T}/python/site-packages"), format!("{T}/opp/built-in/op_impl/ai_core/tbe")]
        );
        assert!(m.path_prefix);
    }

    #[test]
    fn nvidia_keeps_names_and_binds_control_nodes_that_exist() {
        let present = |p: &Path| p.ends_with("nvidiactl") || p.ends_with("nvidia-uvm");
        let m = nvidia(&[3, 1, 3], Path::new("/dev"), Some(Path::new("/usr/bin/nvidia-smi")), &present);
        assert_eq!(
            pairs(&m),
            [
                ("/dev/nvidia1".to_owned(), "/dev/nvidia1".to_owned()),
                ("/dev/nvidia3".into(), "/dev/nvidia3".into()),
                ("/dev/nvidiactl".into(), "/dev/nvidiactl".into()),
                ("/dev/nvidia-uvm".into(), "/dev/nvidia-uvm".into())
            ]
        );
        assert!(m.env.is_empty() && !m.path_prefix);
        assert_eq!(m.nvidia, [1, 3]);
    }
}
