//! The start-up choice of how limits are enforced, best first: a delegated cgroup v2
//! subtree, a cgroup v1 subtree runnerd may write, otherwise rlimits only. Each candidate is
//! probed for real — a child cgroup is made, limited, read back and removed — because a
//! limit that was accepted is not necessarily a limit that holds (limits-research.md:
//! "systemd accepts limits it cannot enforce"). The reasons a better mode was not taken are
//! kept for `/health`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::cgroup::{self, CgroupError, ExecCgroup, Flavor, Hierarchy, Usage};
use super::spares::Maker;
use super::{LimitSettings, Limits, ModeChoice};

/// How this runner enforces memory, pids and CPU limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    CgroupV2,
    CgroupV1,
    RlimitsOnly,
}

impl Mode {
    /// `cgroupMode` in `/health` and in results; "none" is the original's value for "no
    /// cgroup limits", kept for rlimits-only so that callers see nothing new there.
    pub fn label(self) -> &'static str {
        match self {
            Mode::CgroupV2 => "cgroup-v2",
            Mode::CgroupV1 => "cgroup-v1",
            Mode::RlimitsOnly => "none",
        }
    }
}

/// What start-up decided.
#[derive(Debug)]
pub struct Enforcement {
    pub mode: Mode,
    /// The subtree was handed to an unprivileged runnerd (systemd `Delegate=`, or a chown).
    pub delegated: bool,
    /// Where execution cgroups are made (the memory hierarchy's directory on v1).
    pub root: PathBuf,
    /// One per hierarchy an execution joins.
    pub hierarchies: Vec<Hierarchy>,
    /// Why better modes were not taken; empty when the best one was.
    pub reasons: Vec<String>,
    /// `None` in rlimits-only.
    maker: Option<Arc<Maker>>,
}

#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("{var} is {mode}, but that mode is not available here: {reason}")]
    Unavailable { var: &'static str, mode: &'static str, reason: String },
}

/// The limits the start-up probe applies and verifies.
const PROBE: Limits = Limits { memory_bytes: 64 << 20, pids: 64, cpu_millicores: 500, tmp_bytes: 0 };

impl Enforcement {
    /// rlimits only, for `reasons`.
    pub fn rlimits_only(reasons: Vec<String>) -> Enforcement {
        Enforcement {
            mode: Mode::RlimitsOnly,
            delegated: false,
            root: PathBuf::new(),
            hierarchies: Vec::new(),
            reasons,
            maker: None,
        }
    }

    /// Probes this host as `settings` allow. A mode named explicitly that does not work is
    /// an error (the operator asked for it); `auto` falls back and says why.
    pub fn detect(settings: &LimitSettings) -> Result<Enforcement, DetectError> {
        let root = settings.cgroup_root.as_deref();
        let mut reasons = Vec::new();
        let unavailable = |mode: ModeChoice, reason: String| DetectError::Unavailable {
            var: super::MODE_VAR,
            mode: mode.name(),
            reason,
        };
        if settings.mode == ModeChoice::RlimitsOnly {
            return Ok(Enforcement::rlimits_only(vec![format!("{} is rlimits-only", super::MODE_VAR)]));
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        if matches!(settings.mode, ModeChoice::Auto | ModeChoice::CgroupV2) {
            match try_v2(&mounts, &own, root) {
                Ok(e) => return Ok(e),
                Err(reason) if settings.mode == ModeChoice::CgroupV2 => {
                    return Err(unavailable(ModeChoice::CgroupV2, reason));
                }
                Err(reason) => reasons.push(format!("cgroup v2: {reason}")),
            }
        }
        if matches!(settings.mode, ModeChoice::Auto | ModeChoice::CgroupV1) {
            match try_v1(&mounts, &own, root) {
                Ok(mut e) => {
                    e.reasons = reasons;
                    return Ok(e);
                }
                Err(reason) if settings.mode == ModeChoice::CgroupV1 => {
                    return Err(unavailable(ModeChoice::CgroupV1, reason));
                }
                Err(reason) => reasons.push(format!("cgroup v1: {reason}")),
            }
        }
        Ok(Enforcement::rlimits_only(reasons))
    }

    /// The cgroup(s) of one execution, limited and verified: a spare made ahead with these
    /// limits, else new ones; `None` in rlimits-only.
    pub fn create(&self, limits: &Limits) -> Result<Option<ExecCgroup>, CgroupError> {
        self.maker.as_ref().map(|m| m.take(limits)).transpose()
    }

    /// What makes execution cgroups, for a backend that starts a sandbox ahead of the
    /// execution it will serve (issue #37).
    pub fn cgroups(&self) -> CgroupSource {
        CgroupSource(self.maker.clone())
    }

    /// An execution's end in one blocking task ([`super::end`]): its cgroup ended and its
    /// counters read, then `then`, both answered; then the removal, and a spare with the same
    /// limits made for the next run.
    pub async fn finish_execution<T: Send + 'static>(
        &self,
        cgroup: Option<ExecCgroup>,
        then: impl FnOnce() -> T + Send + 'static,
    ) -> Option<(Option<Usage>, T)> {
        let ahead = self.maker.clone().zip(cgroup.as_ref().map(|c| *c.limits()));
        super::end(cgroup, then, move || {
            if let Some((maker, limits)) = ahead {
                maker.refill(&limits);
            }
        })
        .await
    }

    /// Removes the spares (at a graceful stop; a killed runnerd's are removed by the next
    /// start, as any cgroup named for a dead pid).
    pub fn remove_spares(&self) {
        if let Some(maker) = &self.maker {
            maker.close();
        }
    }
}

/// Makes execution cgroups as [`Enforcement::create`] does (`None` in rlimits-only).
#[derive(Debug, Clone, Default)]
pub struct CgroupSource(Option<Arc<Maker>>);

impl CgroupSource {
    pub fn create(&self, limits: &Limits) -> Result<Option<ExecCgroup>, CgroupError> {
        self.0.as_ref().map(|m| m.take(limits)).transpose()
    }
}

fn euid_is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// One line of `/proc/self/mountinfo`: (mount point, filesystem type, super options).
pub fn parse_mounts(text: &str) -> Vec<(String, String, String)> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fstype = r.next()?;
            let _source = r.next()?;
            let options = r.next().unwrap_or("");
            Some((unescape(point), fstype.to_owned(), options.to_owned()))
        })
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

/// `/proc/self/cgroup`: (controllers, path) per hierarchy; v2's line has no controllers.
pub fn parse_own(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            let list = controllers.split(',').filter(|c| !c.is_empty()).map(str::to_owned).collect();
            Some((list, path.to_owned()))
        })
        .collect()
}

/// The directory execution cgroups go in: `root` absolute from the hierarchy's mount,
/// relative below runnerd's own cgroup, or runnerd's own cgroup.
fn parent_dir(mount: &str, own: &str, root: Option<&str>) -> Result<PathBuf, String> {
    let rel = match root {
        Some(r) if r.starts_with('/') => r.to_owned(),
        Some(r) => format!("{}/{r}", own.trim_end_matches('/')),
        None => own.to_owned(),
    };
    if rel.split('/').any(|c| c == "..") {
        return Err(format!("{} must not contain \"..\"", super::ROOT_VAR));
    }
    Ok(Path::new(mount).join(rel.trim_start_matches('/')))
}

const NEEDED: [&str; 3] = ["memory", "pids", "cpu"];

/// The v2 start-up check of limits-research.md: cgroup2 mounted, our cgroup offers memory,
/// pids and cpu and is ours to write; then move into `supervisor/`, enable the controllers
/// for children, and probe.
fn try_v2(mounts: &str, own: &str, root: Option<&str>) -> Result<Enforcement, String> {
    let mounts = parse_mounts(mounts);
    let Some((mount, _, _)) = mounts.iter().find(|(_, t, _)| t == "cgroup2") else {
        return Err("no cgroup2 filesystem is mounted".into());
    };
    let Some((_, path)) = parse_own(own).into_iter().find(|(c, _)| c.is_empty()) else {
        return Err("runnerd's cgroup2 membership is not in /proc/self/cgroup".into());
    };
    let own_dir = Path::new(mount).join(path.trim_start_matches('/'));
    // Our own cgroup is the delegated one; after a restart inside the same unit we may
    // already sit in its `supervisor/` leaf.
    let delegated_dir = if own_dir.file_name().is_some_and(|n| n == "supervisor") {
        own_dir.parent().map(Path::to_path_buf).unwrap_or(own_dir.clone())
    } else {
        own_dir.clone()
    };
    let offered = std::fs::read_to_string(delegated_dir.join("cgroup.controllers")).unwrap_or_default();
    let missing: Vec<&str> =
        NEEDED.iter().copied().filter(|c| !offered.split_whitespace().any(|o| o == *c)).collect();
    if !missing.is_empty() {
        let v1 = mounts.iter().any(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| missing.contains(&x)));
        return Err(format!(
            "controllers missing: {} offers {}; limits need {}{}",
            delegated_dir.display(),
            if offered.trim().is_empty() { "no controllers".to_owned() } else { offered.trim().to_owned() },
            missing.join(", "),
            if v1 { " (they are held by cgroup v1 hierarchies)" } else { "" }
        ));
    }
    for file in ["cgroup.procs", "cgroup.subtree_control"] {
        if nix::unistd::access(&delegated_dir.join(file), nix::unistd::AccessFlags::W_OK).is_err() {
            return Err(format!(
                "not delegated: {} is not writable by runnerd; run it under systemd with Delegate=memory pids cpu",
                delegated_dir.join(file).display()
            ));
        }
    }
    let supervisor = delegated_dir.join("supervisor");
    cgroup::move_into_supervisor(&supervisor, std::process::id()).map_err(|e| common::error_chain(&e))?;
    cgroup::write(&delegated_dir.join("cgroup.subtree_control"), "+memory +pids +cpu")
        .map_err(|e| common::error_chain(&e))?;
    let parent = parent_dir(&delegated_dir.to_string_lossy(), "", root)?;
    if parent != delegated_dir {
        std::fs::create_dir_all(&parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        cgroup::write(&parent.join("cgroup.subtree_control"), "+memory +pids +cpu")
            .map_err(|e| common::error_chain(&e))?;
    }
    let hierarchies =
        vec![Hierarchy { dir: parent.clone(), controllers: NEEDED.map(str::to_owned).to_vec() }];
    probe(Flavor::V2, &hierarchies)?;
    cgroup::remove_stale(&hierarchies);
    Ok(Enforcement {
        mode: Mode::CgroupV2,
        delegated: true,
        root: parent,
        reasons: Vec::new(),
        maker: Maker::new(Flavor::V2, &hierarchies),
        hierarchies,
    })
}

/// cgroup v1: each of memory, pids and cpu (and cpuacct for CPU time, when mounted) in its
/// hierarchy, below runnerd's own cgroup or `root`; probed like v2.
fn try_v1(mounts: &str, own: &str, root: Option<&str>) -> Result<Enforcement, String> {
    let mounts = parse_mounts(mounts);
    let own = parse_own(own);
    let mut hierarchies: Vec<Hierarchy> = Vec::new();
    for controller in NEEDED.iter().chain(&["cpuacct"]) {
        if hierarchies.iter().any(|h| h.controllers.iter().any(|c| c == controller)) {
            continue;
        }
        let found = mounts.iter().find(|(_, t, o)| t == "cgroup" && o.split(',').any(|x| x == *controller));
        let Some((mount, _, options)) = found else {
            if *controller == "cpuacct" {
                continue;
            }
            return Err(format!("no cgroup v1 hierarchy has the {controller} controller"));
        };
        let controllers: Vec<String> = options
            .split(',')
            .filter(|o| {
                ["memory", "pids", "cpu", "cpuacct", "cpuset", "blkio", "devices", "freezer"].contains(o)
            })
            .map(str::to_owned)
            .collect();
        let path = own
            .iter()
            .find(|(c, _)| c.iter().any(|x| x == controller))
            .map(|(_, p)| p.clone())
            .unwrap_or_else(|| "/".to_owned());
        let dir = parent_dir(mount, &path, root)?;
        if !dir.is_dir() {
            return Err(format!(
                "{} does not exist (set {} to a subtree handed to runnerd)",
                dir.display(),
                super::ROOT_VAR
            ));
        }
        hierarchies.push(Hierarchy { dir, controllers });
    }
    probe(Flavor::V1, &hierarchies)?;
    cgroup::remove_stale(&hierarchies);
    let root_dir = hierarchies
        .iter()
        .find(|h| h.controllers.iter().any(|c| c == "memory"))
        .map(|h| h.dir.clone())
        .unwrap_or_default();
    Ok(Enforcement {
        mode: Mode::CgroupV1,
        delegated: !euid_is_root(),
        root: root_dir,
        reasons: Vec::new(),
        maker: Maker::new(Flavor::V1, &hierarchies),
        hierarchies,
    })
}

/// Makes a probe cgroup with [`PROBE`]'s limits (creation verifies them) and removes it.
fn probe(flavor: Flavor, hierarchies: &[Hierarchy]) -> Result<(), String> {
    let name = format!("exec-{}-probe", std::process::id());
    let group = ExecCgroup::create(flavor, hierarchies, &name, &PROBE).map_err(|e| {
        let text = common::error_chain(&e);
        if e.is_permission() {
            format!(
                "{text}; runnerd may not write there: hand it a subtree (chown the directory, its cgroup.procs \
                 and tasks) and set {}",
                super::ROOT_VAR
            )
        } else {
            text
        }
    })?;
    group.remove_blocking().map_err(|e| common::error_chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:14 - cgroup cgroup rw,cpu,cpuacct
35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid shared:15 - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid shared:16 - cgroup cgroup rw,pids
";

    #[test]
    fn mountinfo_and_membership_parse() {
        let m = parse_mounts(MOUNTINFO);
        assert_eq!(m[1], ("/sys/fs/cgroup/unified".into(), "cgroup2".into(), "rw,nsdelegate".into()));
        assert_eq!(m[2].2, "rw,cpu,cpuacct");
        let own = parse_own("12:memory:/process_api/abc\n4:cpu,cpuacct:/\n0::/user.slice\n");
        assert_eq!(own[0], (vec!["memory".to_owned()], "/process_api/abc".to_owned()));
        assert_eq!(own[1].0, vec!["cpu".to_owned(), "cpuacct".to_owned()]);
        assert_eq!(own[2], (vec![], "/user.slice".to_owned()));
    }

    #[test]
    fn parent_directory_table() {
        let cases = [
            ("/sys/fs/cgroup/memory", "/a/b", None, Ok("/sys/fs/cgroup/memory/a/b")),
            ("/sys/fs/cgroup/memory", "/a/b", Some("runner"), Ok("/sys/fs/cgroup/memory/a/b/runner")),
            ("/sys/fs/cgroup/memory", "/a/b", Some("/top/runner"), Ok("/sys/fs/cgroup/memory/top/runner")),
            ("/sys/fs/cgroup/pids", "/", Some("x"), Ok("/sys/fs/cgroup/pids/x")),
            ("/sys/fs/cgroup/pids", "/", Some("../x"), Err(())),
        ];
        for (mount, own, root, want) in cases {
            let got = parent_dir(mount, own, root).map_err(drop);
            assert_eq!(got, want.map(PathBuf::from), "{mount} {own} {root:?}");
        }
    }

    /// On a hybrid host (this CI's kind) the cgroup2 mount has no controllers: v2 is
    /// refused with "controllers missing", naming v1 as their holder.
    #[test]
    fn v2_without_controllers_says_so() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cgroup.controllers"), "\n").unwrap();
        let mounts = format!(
            "31 30 0:27 / {} rw - cgroup2 cgroup2 rw\n35 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
            dir.path().display()
        );
        let err = try_v2(&mounts, "0::/\n", None).unwrap_err();
        assert!(err.starts_with("controllers missing:"), "{err}");
        assert!(err.contains("offers no controllers; limits need memory, pids, cpu"), "{err}");
        assert!(err.contains("held by cgroup v1"), "{err}");
        let err = try_v2("", "0::/\n", None).unwrap_err();
        assert_eq!(err, "no cgroup2 filesystem is mounted");
    }

    #[test]
    fn v2_controllers_present_but_not_writable_is_not_delegated() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        // No cgroup.procs / cgroup.subtree_control files: nothing to write.
        let mounts = format!("31 30 0:27 / {} rw - cgroup2 cgroup2 rw\n", dir.path().display());
        let err = try_v2(&mounts, "0::/\n", None).unwrap_err();
        assert!(err.starts_with("not delegated:"), "{err}");
    }
}
