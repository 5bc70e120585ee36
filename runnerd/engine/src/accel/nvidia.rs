//! NVIDIA GPUs: the device nodes name them (`/dev/nvidiaN`, N = the minor number the
//! driver gives GPU N), and the probe's `nvidia-smi -L` line names the chip.

use std::io;
use std::path::Path;

/// The GPU minors present under `dir` (`nvidia0`, `nvidia1`, …; not `nvidiactl` & co.).
pub fn list_nodes(dir: &Path) -> io::Result<Vec<u32>> {
    let mut out: Vec<u32> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| minor_of(&e.file_name().to_string_lossy()))
        .collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// `nvidia12` → 12.
pub fn minor_of(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("nvidia")?;
    if digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    digits.parse().ok()
}

/// `GPU 0: NVIDIA H200 (UUID: GPU-…)` → (name, uuid), from the first such line.
pub fn parse_list(text: &str) -> Option<(String, Option<String>)> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("GPU ")?;
        let (_, rest) = rest.split_once(": ")?;
        match rest.rsplit_once(" (UUID: ") {
            Some((name, uuid)) => {
                Some((name.trim().to_owned(), Some(uuid.trim_end_matches(')').trim().to_owned())))
            }
            None => Some((rest.trim().to_owned(), None)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names() {
        for (name, want) in [
            ("nvidia0", Some(0)),
            ("nvidia12", Some(12)),
            ("nvidiactl", None),
            ("nvidia-uvm", None),
            ("nvidia-caps", None),
            ("nvidia", None),
            ("nvidia01", None),
            ("davinci0", None),
        ] {
            assert_eq!(minor_of(name), want, "{name}");
        }
    }

    #[test]
    fn list_lines() {
        assert_eq!(
            parse_list("GPU 0: NVIDIA H200 (UUID: GPU-8a2c1f7e-0000-1111-2222-333344445555)\n"),
            Some(("NVIDIA H200".into(), Some("GPU-8a2c1f7e-0000-1111-2222-333344445555".into())))
        );
        assert_eq!(parse_list("GPU 3: Tesla T4\n"), Some(("Tesla T4".into(), None)));
        assert_eq!(parse_list("No devices were found\n"), None);
        assert_eq!(parse_list(""), None);
    }

    #[test]
    fn lists_only_gpu_nodes() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "null"] {
            std::fs::write(dir.path().join(n), "").unwrap();
        }
        assert_eq!(list_nodes(dir.path()).unwrap(), [0, 1]);
        assert!(list_nodes(&dir.path().join("missing")).is_err());
    }
}
