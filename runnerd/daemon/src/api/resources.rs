//! `GET /resources` (contract §5.4): machine capacity, read from /proc and statvfs.

use std::path::Path;

use serde_json::{Value, json};

use crate::app::App;
use crate::timefmt;
use crate::workspace::REMOTE_WORKSPACES;

fn first_number(path: &str) -> Option<f64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

/// A `/proc/meminfo` field in bytes.
fn meminfo(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn cpu_cores() -> u64 {
    // SAFETY: sysconf has no memory effects. A failure (-1) counts one core.
    let n = common::sys::cvt(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(1);
    u64::try_from(n).unwrap_or(1).max(1)
}

/// Disk figures for the remote workspaces (the directory itself, or the data directory
/// while it does not exist yet); `None` when it is a symlink or cannot be measured.
fn workspace_disk(data_dir: &Path) -> Option<Value> {
    let real_data = std::fs::canonicalize(data_dir).ok()?;
    let remote = real_data.join(REMOTE_WORKSPACES);
    let measured = match std::fs::symlink_metadata(&remote) {
        Ok(m) if m.file_type().is_symlink() => return None,
        Ok(_) => remote.clone(),
        Err(_) => real_data,
    };
    let st = nix::sys::statvfs::statvfs(&measured).ok()?;
    let frsize = st.fragment_size();
    Some(json!({
        "path": remote,
        "totalBytes": st.blocks() * frsize,
        "availableBytes": st.blocks_available() * frsize,
    }))
}

pub async fn resources(app: &App) -> Value {
    let data_dir = app.data_dir.clone();
    let disk = tokio::task::spawn_blocking(move || workspace_disk(&data_dir)).await.ok().flatten();
    let meminfo_text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mut out = json!({
        "capturedAt": timefmt::now_iso(),
        "cpuCores": cpu_cores(),
        "loadAverage1m": first_number("/proc/loadavg").unwrap_or(0.0),
        "memoryTotalBytes": meminfo(&meminfo_text, "MemTotal:").unwrap_or(0),
        "memoryFreeBytes": meminfo(&meminfo_text, "MemAvailable:").or_else(|| meminfo(&meminfo_text, "MemFree:")).unwrap_or(0),
        "uptimeSeconds": first_number("/proc/uptime").unwrap_or(0.0),
        "workspaceDisk": disk.clone().unwrap_or(Value::Null),
    });
    if disk.is_none() {
        out["workspaceDiskError"] = json!(
            "Workspace filesystem metrics unavailable; check the Runner workspace directory and permissions."
        );
    }
    // The cached NPU inventory, only where this host has the Ascend tooling (contract §5.4).
    let npu = crate::accel::select::npu_view(&app.accel, &app.accel_prober(), false).await;
    if npu.supported {
        out["npu"] = serde_json::to_value(npu).unwrap_or_default();
    }
    out
}

/// `GET /load` (issue #35, ours): what a fleet router places by, cheap enough to poll every
/// few seconds — no subprocess, no chip probe: slots, queue, workspace disk, memory.
pub async fn load(app: &App) -> Value {
    let data_dir = app.data_dir.clone();
    let disk = tokio::task::spawn_blocking(move || workspace_disk(&data_dir)).await.ok().flatten();
    let meminfo_text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let a = &app.admission;
    json!({
        "capturedAt": timefmt::now_iso(),
        "runnerVersion": env!("CARGO_PKG_VERSION"),
        "running": a.running(),
        "slots": a.max_concurrent(),
        "admitted": a.admitted(),
        "queueCapacity": a.capacity(),
        "cpuCores": cpu_cores(),
        "loadAverage1m": first_number("/proc/loadavg").unwrap_or(0.0),
        "memoryFreeBytes": meminfo(&meminfo_text, "MemAvailable:").unwrap_or(0),
        "diskAvailableBytes": disk.as_ref().and_then(|d| d["availableBytes"].as_u64()),
        "diskTotalBytes": disk.as_ref().and_then(|d| d["totalBytes"].as_u64()),
        "draining": crate::transfer::draining::get(&app.data_dir),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parsing() {
        let text = "MemTotal:       24000000 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo(text, "MemTotal:"), Some(24_000_000 * 1024));
        assert_eq!(meminfo(text, "MemAvailable:"), Some(2000 * 1024));
        assert_eq!(meminfo(text, "Nope:"), None);
    }

    #[test]
    fn disk_of_a_symlinked_remote_root_is_withheld() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        let d = workspace_disk(&data).unwrap();
        assert!(d["totalBytes"].as_u64().unwrap() > 0);
        assert!(d["path"].as_str().unwrap().ends_with("/remote-workspaces"));
        std::os::unix::fs::symlink(dir.path(), data.join("remote-workspaces")).unwrap();
        assert!(workspace_disk(&data).is_none());
    }
}
