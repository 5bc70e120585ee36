//! The cgroup(s) of one execution: made and limited by runnerd, verified by reading every
//! limit back, joined by sandbox-init (through the descriptors of the join files runnerd
//! opens: see [`join_file`]),
//! measured after the run, ended with `cgroup.kill` (v2) or by killing what is left (v1), and
//! removed. The cgroup filesystem itself is never bound into a sandbox: a sandbox runs as
//! the uid that owns these files and would otherwise raise its own limits.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Limits;

/// Which cgroup interface the files follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    V1,
    V2,
}

/// The parent directory of execution cgroups in one hierarchy, and its controllers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub dir: PathBuf,
    pub controllers: Vec<String>,
}

impl Hierarchy {
    fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot create the cgroup {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write {value:?} to {path}")]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
    },
    #[error("the limit did not hold: {path} reads {found:?} after {wanted:?} was written")]
    NotHeld { path: PathBuf, wanted: String, found: String },
    #[error("cannot open {path} for the sandbox to join")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the counter file {path}")]
    OpenCounter {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove the cgroup {path}: processes are still in it")]
    Remove {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl CgroupError {
    /// Whether the host refused us (as opposed to a limit that did not hold).
    pub fn is_permission(&self) -> bool {
        let source = match self {
            CgroupError::Create { source, .. }
            | CgroupError::Write { source, .. }
            | CgroupError::Open { source, .. }
            | CgroupError::OpenCounter { source, .. }
            | CgroupError::Remove { source, .. } => source,
            CgroupError::NotHeld { .. } => return false,
        };
        matches!(source.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::EROFS))
    }
}

/// Writes one control file (the kernel takes the whole value in one `write`).
pub fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_owned(),
        value: value.to_owned(),
        source,
    })
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// The value of `key` in a flat keyed file (`memory.events`, `cpu.stat`, `memory.oom_control`).
pub fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Moves process `pid` (runnerd: itself) into the `supervisor` leaf of its delegated v2
/// cgroup ("no internal processes": a cgroup with controllers enabled for its children may
/// hold no process), creating the leaf if needed.
pub fn move_into_supervisor(supervisor: &Path, pid: u32) -> Result<(), CgroupError> {
    match std::fs::create_dir(supervisor) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(CgroupError::Create { path: supervisor.to_owned(), source }),
    }
    write(&supervisor.join("cgroup.procs"), &pid.to_string())
}

/// One execution's cgroup directories (one per hierarchy).
#[derive(Debug)]
pub struct ExecCgroup {
    flavor: Flavor,
    /// (directory, its hierarchy's controllers), in the order sandbox-init joins them.
    dirs: Vec<(PathBuf, Vec<String>)>,
    /// The counter files [`ExecCgroup::usage`] reads, opened when the cgroup is made (ahead of
    /// the run, for a spare): the answer then waits for reads only, not for a path walk and an
    /// open and close of each file in the cgroup filesystem.
    counters: Vec<(&'static str, std::fs::File)>,
    /// The join file of each directory ([`join_file`]), opened for writing when the cgroup
    /// is made (ahead of the run, for a spare), in the order of `dirs`.
    joins: Vec<OwnedFd>,
    /// What it was limited to (a spare made ahead serves only a run with these).
    limits: Limits,
    removed: bool,
}

/// The counter files of `flavor` that [`ExecCgroup::usage`] reads: (controller, file).
fn counter_files(flavor: Flavor) -> &'static [(&'static str, &'static str)] {
    match flavor {
        Flavor::V2 => &[
            ("memory", "memory.events"),
            ("memory", "memory.peak"),
            ("cpu", "cpu.stat"),
            ("pids", "pids.events"),
            ("pids", "pids.peak"),
        ],
        Flavor::V1 => &[
            ("memory", "memory.oom_control"),
            ("memory", "memory.max_usage_in_bytes"),
            ("cpuacct", "cpuacct.usage"),
            ("cpu", "cpu.stat"),
            ("pids", "pids.events"),
            ("pids", "pids.peak"),
        ],
    }
}

/// The whole of a small file in the cgroup filesystem, read afresh from offset 0 through a
/// descriptor opened earlier (a read at offset 0 regenerates the kernel's text).
fn read_again(file: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut text = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match file.read_at(&mut buf, text.len() as u64) {
            Ok(0) => break,
            Ok(n) => text.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    String::from_utf8(text).ok()
}

/// What an execution used and hit, as the cgroup counted it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    pub peak_memory_bytes: Option<u64>,
    pub cpu_time_ms: Option<u64>,
    pub pids_peak: Option<u64>,
    pub oom_kills: u64,
    pub pids_max_hits: u64,
    pub cpu_throttled_periods: Option<u64>,
}

/// The value to write for a CPU share: v2 `cpu.max` ("quota period" or "max period"),
/// v1 `cpu.cfs_quota_us` (-1 for no limit); the period is 100 ms.
pub fn cpu_quota(flavor: Flavor, millicores: u64) -> String {
    const PERIOD_US: u64 = 100_000;
    let quota = (millicores * PERIOD_US / 1000).max(1000);
    match (flavor, millicores) {
        (Flavor::V2, 0) => format!("max {PERIOD_US}"),
        (Flavor::V2, _) => format!("{quota} {PERIOD_US}"),
        (Flavor::V1, 0) => "-1".into(),
        (Flavor::V1, _) => quota.to_string(),
    }
}

/// The file sandbox-init writes `0` (itself) into. On v1 that is `tasks`, which moves the
/// writing *thread*: sandbox-init is single-threaded, so that is the whole process, and a
/// thread move by `current` skips the global `cgroup_threadgroup_rwsem` that a
/// `cgroup.procs` write takes for writing — which waits for an RCU grace period (about
/// 14 ms per launch measured here, against none for `tasks`). v2 moves processes only
/// through `cgroup.procs` (`cgroup.threads` is for threaded subtrees).
pub fn join_file(flavor: Flavor) -> &'static str {
    match flavor {
        Flavor::V1 => "tasks",
        Flavor::V2 => "cgroup.procs",
    }
}

/// What the kernel shows after `value` was written to a memory limit: a page multiple,
/// rounded down; "max" (v2) or a huge number (v1) when unlimited.
fn memory_holds(flavor: Flavor, wanted: u64, found: &str) -> bool {
    let found = found.trim();
    match (flavor, wanted) {
        (Flavor::V2, 0) => found == "max",
        (Flavor::V1, 0) => found.parse::<u64>().is_ok_and(|v| v >= (1 << 62)),
        (_, w) => found.parse::<u64>().is_ok_and(|v| v == w & !4095),
    }
}

impl ExecCgroup {
    /// Creates `name` in every hierarchy, writes the limits and reads each back.
    pub fn create(
        flavor: Flavor,
        hierarchies: &[Hierarchy],
        name: &str,
        limits: &Limits,
    ) -> Result<ExecCgroup, CgroupError> {
        let mut group = ExecCgroup {
            flavor,
            dirs: Vec::new(),
            counters: Vec::new(),
            joins: Vec::new(),
            limits: *limits,
            removed: false,
        };
        for h in hierarchies {
            let dir = h.dir.join(name);
            std::fs::create_dir(&dir).map_err(|source| CgroupError::Create { path: dir.clone(), source })?;
            // From here on, Drop removes what was made if a later step fails.
            group.dirs.push((dir, h.controllers.clone()));
        }
        group.apply(limits)?;
        for (controller, file) in counter_files(flavor) {
            let Some(path) = group.dir_with(controller).map(|d| d.join(file)) else { continue };
            match std::fs::File::open(&path) {
                Ok(opened) => group.counters.push((file, opened)),
                // A counter this kernel lacks is reported absent, as a failed read was before.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // Anything else would report a counter as zero for the whole run (a spare is
                // made long before it): no cgroup rather than one that cannot be read.
                Err(source) => return Err(CgroupError::OpenCounter { path, source }),
            }
        }
        for (dir, _) in &group.dirs {
            let path = dir.join(join_file(flavor));
            match std::fs::OpenOptions::new().write(true).open(&path) {
                Ok(file) => group.joins.push(OwnedFd::from(file)),
                Err(source) => return Err(CgroupError::Open { path, source }),
            }
        }
        Ok(group)
    }

    fn apply(&self, limits: &Limits) -> Result<(), CgroupError> {
        for (dir, controllers) in &self.dirs {
            let h = Hierarchy { dir: dir.clone(), controllers: controllers.clone() };
            if h.has("memory") {
                self.apply_memory(dir, limits.memory_bytes)?;
            }
            if h.has("pids") {
                let value = if limits.pids == 0 { "max".to_owned() } else { limits.pids.to_string() };
                set_verified(&dir.join("pids.max"), &value, |found| found.trim() == value)?;
            }
            if h.has("cpu") {
                let value = cpu_quota(self.flavor, limits.cpu_millicores);
                match self.flavor {
                    Flavor::V2 => set_verified(&dir.join("cpu.max"), &value, |f| f.trim() == value)?,
                    Flavor::V1 => {
                        set_verified(&dir.join("cpu.cfs_period_us"), "100000", |f| f.trim() == "100000")?;
                        set_verified(&dir.join("cpu.cfs_quota_us"), &value, |f| f.trim() == value)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn apply_memory(&self, dir: &Path, bytes: u64) -> Result<(), CgroupError> {
        let flavor = self.flavor;
        let holds = move |found: &str| memory_holds(flavor, bytes, found);
        match flavor {
            Flavor::V2 => {
                let value = if bytes == 0 { "max".to_owned() } else { bytes.to_string() };
                set_verified(&dir.join("memory.max"), &value, holds)?;
                // Without swap accounting the file is absent and there is no swap to limit.
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    set_verified(&swap, "0", |f| f.trim() == "0")?;
                }
                set_verified(&dir.join("memory.oom.group"), "1", |f| f.trim() == "1")?;
            }
            Flavor::V1 => {
                let value = if bytes == 0 { "-1".to_owned() } else { bytes.to_string() };
                set_verified(&dir.join("memory.limit_in_bytes"), &value, holds)?;
                // memory+swap must be at least the memory limit; present only with swap
                // accounting.
                let memsw = dir.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    set_verified(&memsw, &value, holds)?;
                }
            }
        }
        Ok(())
    }

    /// The limits it was made with.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The join file of each directory ([`join_file`]), open for writing and close-on-exec,
    /// for sandbox-init to write itself into: duplicates of the descriptors opened when the
    /// cgroup was made (no path walk in the cgroup filesystem on the launch path).
    pub fn procs_fds(&self) -> Result<Vec<OwnedFd>, CgroupError> {
        self.joins
            .iter()
            .zip(&self.dirs)
            .map(|(fd, (dir, _))| {
                fd.try_clone()
                    .map_err(|source| CgroupError::Open { path: dir.join(join_file(self.flavor)), source })
            })
            .collect()
    }

    fn dir_with(&self, controller: &str) -> Option<&Path> {
        self.dirs.iter().find(|(_, c)| c.iter().any(|x| x == controller)).map(|(d, _)| d.as_path())
    }

    /// Reads the counters: OOM kills and peak memory, refused forks and the process
    /// high-water mark, CPU time and throttled periods.
    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        let at = |file: &str| {
            self.counters.iter().find(|(name, _)| *name == file).and_then(|(_, f)| read_again(f))
        };
        match self.flavor {
            Flavor::V2 => {
                u.oom_kills = at("memory.events").and_then(|t| keyed(&t, "oom_kill")).unwrap_or(0);
                u.peak_memory_bytes = at("memory.peak").and_then(|t| t.trim().parse().ok());
                let cpu = at("cpu.stat").unwrap_or_default();
                u.cpu_time_ms = keyed(&cpu, "usage_usec").map(|us| us / 1000);
                u.cpu_throttled_periods = keyed(&cpu, "nr_throttled");
            }
            Flavor::V1 => {
                u.oom_kills = at("memory.oom_control").and_then(|t| keyed(&t, "oom_kill")).unwrap_or(0);
                u.peak_memory_bytes = at("memory.max_usage_in_bytes").and_then(|t| t.trim().parse().ok());
                u.cpu_time_ms =
                    at("cpuacct.usage").and_then(|t| t.trim().parse::<u64>().ok()).map(|ns| ns / 1_000_000);
                u.cpu_throttled_periods = at("cpu.stat").and_then(|t| keyed(&t, "nr_throttled"));
            }
        }
        u.pids_max_hits = at("pids.events").and_then(|t| keyed(&t, "max")).unwrap_or(0);
        u.pids_peak = at("pids.peak").and_then(|t| t.trim().parse().ok());
        u
    }

    /// Ends everything still in the cgroup and removes it: `cgroup.kill` on v2 (which kills
    /// even processes forking as fast as they can), SIGKILL to each listed pid on v1, until
    /// the directories can be removed. Blocking: call it off the async runtime.
    pub fn remove_blocking(mut self) -> Result<(), CgroupError> {
        self.removed = true;
        self.counters.clear();
        self.joins.clear();
        kill_and_remove(self.flavor, &self.dirs.iter().map(|(d, _)| d.clone()).collect::<Vec<_>>())
    }

    /// The execution's directories, in the order sandbox-init joins them.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.dirs.iter().map(|(d, _)| d.as_path())
    }

    /// Ends the processes in the cgroup now (the sandbox's end, whatever its state). On v1
    /// one hierarchy's list is enough: sandbox-init joins every hierarchy, in this order,
    /// before it execs, and its descendants inherit them all; nothing in a sandbox can move a
    /// process (no cgroup filesystem is bound in, capabilities are dropped, and seccomp
    /// refuses `mount`, `unshare` and new user namespaces, so none can be mounted either). A
    /// sandbox-init that failed to join them all stopped at the first refusal, so it is
    /// listed in the first; the removal then kills per hierarchy until each directory is
    /// empty.
    pub fn kill(&self) {
        if let Some((dir, _)) = self.dirs.first() {
            kill_dir(self.flavor, dir);
        }
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        if !self.removed {
            self.counters.clear();
            self.joins.clear();
            let dirs: Vec<PathBuf> = self.dirs.iter().map(|(d, _)| d.clone()).collect();
            if let Err(e) = kill_and_remove(self.flavor, &dirs) {
                tracing::warn!(event = "cgroup_left", error = %common::error_chain(&e));
            }
        }
    }
}

/// Writes `value` and reads back what the kernel holds, through one descriptor (a limit
/// that is not enforced is never reported as applied; one open instead of two, and no
/// size probe, on the launch path).
fn set_verified(path: &Path, value: &str, holds: impl Fn(&str) -> bool) -> Result<(), CgroupError> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let write_err = |source| CgroupError::Write { path: path.to_owned(), value: value.to_owned(), source };
    let mut file = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(write_err)?;
    file.write_all(value.as_bytes()).map_err(write_err)?;
    // Every value written here reads back in well under 64 bytes.
    let mut buf = [0u8; 64];
    let found = match file.read_at(&mut buf, 0) {
        Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
        Err(_) => String::new(),
    };
    if holds(&found) {
        Ok(())
    } else {
        Err(CgroupError::NotHeld {
            path: path.to_owned(),
            wanted: value.to_owned(),
            found: found.trim().to_owned(),
        })
    }
}

fn kill_dir(flavor: Flavor, dir: &Path) {
    let kill_file = dir.join("cgroup.kill");
    if flavor == Flavor::V2 && kill_file.exists() && write(&kill_file, "1").is_ok() {
        return;
    }
    for pid in read(&dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
    {
        // SAFETY: kill(2) with a pid read from the cgroup. Only processes of this
        // execution's cgroup are named; one that exited meanwhile gives ESRCH, which is
        // what we want (the cgroup's emptiness is checked by the caller).
        let _ = common::sys::cvt(unsafe { libc::kill(pid, libc::SIGKILL) });
    }
}

const REMOVE_LIMIT: Duration = Duration::from_secs(5);

fn kill_and_remove(flavor: Flavor, dirs: &[PathBuf]) -> Result<(), CgroupError> {
    let deadline = Instant::now() + REMOVE_LIMIT;
    // Children were created after their parents; remove in reverse (one level here anyway).
    for dir in dirs.iter().rev() {
        loop {
            match std::fs::remove_dir(dir) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    kill_dir(flavor, dir);
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => return Err(CgroupError::Remove { path: dir.clone(), source }),
            }
        }
    }
    Ok(())
}

/// The pid in an execution cgroup's name (`exec-<pid>-<n>`).
pub fn owner_pid(name: &str) -> Option<i32> {
    name.strip_prefix("exec-")?.split('-').next()?.parse().ok()
}

/// Removes the execution cgroups a crashed runnerd left behind: those named for a pid that
/// no longer runs (or for our own pid, which a previous process of ours cannot have had
/// while we live). Live runnerds' cgroups are left alone.
pub fn remove_stale(hierarchies: &[Hierarchy]) {
    for h in hierarchies {
        let Ok(entries) = std::fs::read_dir(&h.dir) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = owner_pid(&name) else { continue };
            let alive = Path::new(&format!("/proc/{pid}")).exists() && pid != std::process::id() as i32;
            if alive {
                continue;
            }
            let flavor = if h.dir.join("cgroup.kill").exists() || h.dir.join("cgroup.controllers").exists() {
                Flavor::V2
            } else {
                Flavor::V1
            };
            match kill_and_remove(flavor, &[entry.path()]) {
                Ok(()) => tracing::info!(event = "cgroup_stale_removed", path = %entry.path().display()),
                Err(e) => tracing::warn!(event = "cgroup_stale_left", error = %common::error_chain(&e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_quota_table() {
        let cases = [
            (Flavor::V2, 0, "max 100000"),
            (Flavor::V2, 500, "50000 100000"),
            (Flavor::V2, 2000, "200000 100000"),
            (Flavor::V2, 1, "1000 100000"),
            (Flavor::V1, 0, "-1"),
            (Flavor::V1, 250, "25000"),
        ];
        for (flavor, millicores, want) in cases {
            assert_eq!(cpu_quota(flavor, millicores), want, "{flavor:?} {millicores}");
        }
    }

    #[test]
    fn memory_read_back_table() {
        let cases = [
            (Flavor::V2, 0, "max\n", true),
            (Flavor::V2, 0, "1048576\n", false),
            (Flavor::V2, 1 << 20, "1048576\n", true),
            (Flavor::V2, (1 << 20) + 100, "1048576\n", true),
            (Flavor::V2, 1 << 20, "max\n", false),
            (Flavor::V1, 0, "9223372036854771712\n", true),
            (Flavor::V1, 1 << 28, "268435456\n", true),
            (Flavor::V1, 1 << 28, "9223372036854771712\n", false),
        ];
        for (flavor, wanted, found, holds) in cases {
            assert_eq!(memory_holds(flavor, wanted, found), holds, "{flavor:?} {wanted} {found:?}");
        }
    }

    #[test]
    fn keyed_files_and_names() {
        let events = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed(events, "oom_kill"), Some(1));
        assert_eq!(keyed(events, "max"), Some(12));
        assert_eq!(keyed(events, "absent"), None);
        assert_eq!(keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n", "oom_kill"), Some(3));
        assert_eq!(owner_pid("exec-123-7"), Some(123));
        assert_eq!(owner_pid("exec-123-probe"), Some(123));
        assert_eq!(owner_pid("supervisor"), None);
        assert_eq!(owner_pid("exec-x-1"), None);
    }
}
