//! Whose files a sandbox writes (issue #30): a workspace the caller made (the API creates
//! `projects/<p>/…` as its own user) is usually not owned by the sandbox user. A root
//! runnerd then mounts it into the sandbox through an idmapped mount: sandbox code runs as
//! the unprivileged sandbox user and sees the directory's files as its own, and what it
//! writes lands on disk owned like the directory, so the API can still manage it. Where the
//! kernel or the filesystem cannot idmap, or runnerd is not root, such a workspace runs
//! only if the sandbox user may write it by its mode; otherwise the execution is refused
//! with the remedy, never run on a silently read-only workspace.
//!
//! The decision is a pure function ([`decide`]); [`access_of`] is its I/O (one `fstat`), and
//! [`probe`] tells at start-up whether this host can idmap at all.

use std::os::fd::OwnedFd;
use std::path::Path;

use common::plan::IdPair;
use runner_store::fsat;
use serde::Serialize;

use super::user::Identity;

/// Whether sandbox-init can mount a directory idmapped, as found at start-up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "state", content = "reason")]
pub enum IdmapSupport {
    /// A probe sandbox saw the data directory through an idmapped mount.
    Available,
    /// runnerd is not root: it runs sandboxes as itself and cannot map another user's files.
    Unprivileged,
    /// Tried and refused (the kernel's or the filesystem's answer), or no sandbox to try in.
    Unavailable(String),
}

impl IdmapSupport {
    /// One line for the start-up log and `/health`.
    pub fn describe(&self) -> String {
        match self {
            IdmapSupport::Available => {
                "available: workspaces owned by another user are mounted idmapped for the sandbox user".into()
            }
            IdmapSupport::Unprivileged => "not used: runnerd runs sandboxes as its own user; workspaces owned by \
                                           another user run only where that user's mode bits let runnerd write"
                .into(),
            IdmapSupport::Unavailable(why) => format!(
                "unavailable ({why}): workspaces owned by another user than the sandbox user run only where their \
                 mode bits let the sandbox user write"
            ),
        }
    }
}

/// How one directory reaches the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Bound as it is.
    Direct,
    /// Bound through an idmapped mount mapping this owner to the sandbox user.
    Idmapped(IdPair),
}

impl Access {
    pub fn owner(self) -> Option<IdPair> {
        match self {
            Access::Direct => None,
            Access::Idmapped(owner) => Some(owner),
        }
    }
}

/// The owner and mode of a directory, as `fstat` found them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirFacts {
    pub owner: IdPair,
    pub mode: u32,
}

/// A writable workspace the sandbox user could not write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "Runner workspace {path} is owned by uid {owner_uid} (gid {owner_gid}) with mode {mode:o}, which the sandbox user \
     {user} (uid {user_uid}) cannot write, and {why}; nothing was run. Run runnerd as the data directory's owner, or \
     as root on a kernel (5.12 or later) and filesystem that support idmapped mounts"
)]
pub struct Unwritable {
    pub path: String,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub mode: u32,
    pub user: String,
    pub user_uid: u32,
    pub why: String,
}

/// Whether `uid`/`gid` may create entries in a directory of `mode` owned by `owner`
/// (write and search bits of the class that applies; only the primary group counts).
pub fn may_write(mode: u32, owner: IdPair, uid: u32, gid: u32) -> bool {
    let bits = if uid == owner.uid {
        mode >> 6
    } else if gid == owner.gid {
        mode >> 3
    } else {
        mode
    };
    bits & 0o3 == 0o3
}

/// How `dir` reaches sandboxes of `who`. `writable`: the workspace root (a read-only
/// parent is never refused: it is bound as before when it cannot be idmapped).
/// `under_idmapped`: the directory lies inside one that is idmapped, whose mapping would
/// otherwise apply to it too (so even the sandbox user's own files get an identity map).
pub fn decide(
    dir: DirFacts,
    who: &Identity,
    support: &IdmapSupport,
    writable: bool,
    under_idmapped: bool,
) -> Result<Access, String> {
    let mine = dir.owner == IdPair { uid: who.uid, gid: who.gid };
    if mine && !under_idmapped {
        return Ok(Access::Direct);
    }
    let why = match support {
        IdmapSupport::Available if who.switches() => return Ok(Access::Idmapped(dir.owner)),
        IdmapSupport::Available | IdmapSupport::Unprivileged => {
            "an unprivileged runnerd cannot map another user's files".to_owned()
        }
        IdmapSupport::Unavailable(reason) => format!("idmapped mounts are unavailable here ({reason})"),
    };
    if !writable || dir.owner.uid == who.uid || may_write(dir.mode, dir.owner, who.uid, who.gid) {
        return Ok(Access::Direct);
    }
    Err(why)
}

/// [`decide`] for the directory behind `fd`.
pub fn access_of(
    fd: &OwnedFd,
    path: &Path,
    who: &Identity,
    support: &IdmapSupport,
    writable: bool,
    under_idmapped: bool,
) -> Result<Access, Unwritable> {
    let refused = |facts: Option<DirFacts>, why: String| Unwritable {
        path: path.display().to_string(),
        owner_uid: facts.map_or(u32::MAX, |f| f.owner.uid),
        owner_gid: facts.map_or(u32::MAX, |f| f.owner.gid),
        mode: facts.map_or(0, |f| f.mode & 0o7777),
        user: who.name.clone(),
        user_uid: who.uid,
        why,
    };
    // Fails closed: a directory that cannot even be inspected is not handed over.
    let facts = facts(fd).map_err(|e| refused(None, format!("it cannot be inspected ({e})")))?;
    decide(facts, who, support, writable, under_idmapped).map_err(|why| refused(Some(facts), why))
}

/// Start-up: can this host idmap what lies under `data_dir`? A probe sandbox (no seccomp,
/// as the preflight probes) binds `projects/` (or, before the API made it, the data
/// directory) read-only through an idmapped mount mapping its owner to the sandbox user,
/// and lists it. Only a root runnerd that switches
/// sandboxes to another user can idmap at all.
pub async fn probe(
    launcher: &crate::launch::Launcher,
    bwrap: &Path,
    capability: &super::preflight::Capability,
    bind_fd: bool,
    who: &Identity,
    data_dir: &Path,
) -> IdmapSupport {
    use crate::isolation::bubblewrap;
    use crate::launch::{OutputBudget, Termination};
    if !who.switches() {
        return IdmapSupport::Unprivileged;
    }
    if let Some(why) = shared_user(who) {
        return IdmapSupport::Unavailable(why);
    }
    let Some(shape) = capability.shape() else {
        return IdmapSupport::Unavailable("no usable sandbox to try it in".into());
    };
    if !bind_fd {
        return IdmapSupport::Unavailable("bubblewrap has no --bind-fd (0.8 or later is needed)".into());
    }
    // Caller-made workspaces live under projects/, which the API may not have made yet; a
    // link there is never followed (the data directory itself is the operator's choice).
    let projects = data_dir.join(common::layout::PROJECTS);
    let opened = match fsat::open_path(&projects, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fsat::open_path(data_dir, libc::O_PATH | libc::O_DIRECTORY).map(|d| (d, data_dir.to_owned()))
        }
        other => other.map(|d| (d, projects)),
    };
    let (dir, data_dir) = match opened {
        Ok(opened) => opened,
        Err(e) => return IdmapSupport::Unavailable(format!("cannot open {}: {e}", data_dir.display())),
    };
    let data_dir = data_dir.as_path();
    let owner = match facts(&dir) {
        Ok(f) => f.owner,
        Err(e) => return IdmapSupport::Unavailable(format!("cannot inspect {}: {e}", data_dir.display())),
    };
    let mut slots = super::FdSlots::default();
    let slot = match slots.push_dir(&dir, Some(owner), true) {
        Ok(slot) => slot,
        Err(e) => return IdmapSupport::Unavailable(format!("cannot duplicate a descriptor: {e}")),
    };
    let mut options = super::preflight::probe_args(shape.proc_mode, shape.disable_userns);
    options.pop();
    options.extend(["--ro-bind-fd".into(), slot.to_string(), "/mnt".into()]);
    let command = vec!["/usr/bin/ls".into(), "-dn".into(), "/mnt".into()];
    let mut output = OutputBudget::new(64 * 1024);
    let timeout = super::preflight::PROBE_TIMEOUT;
    let outcome = bubblewrap::probe(launcher, bwrap, options, command, slots, timeout, &mut output).await;
    let text = output.finish();
    match outcome {
        Ok(o) if o.termination == Termination::Exited(0) => {
            // `ls -dn` prints the owner as the sandbox sees it: the sandbox user's id.
            let seen = text.stdout.split_whitespace().nth(2).and_then(|f| f.parse::<u32>().ok());
            match seen {
                Some(uid) if uid == who.uid => IdmapSupport::Available,
                _ => IdmapSupport::Unavailable(format!(
                    "the probe sandbox saw the data directory as {:?}, not owned by uid {}",
                    text.stdout.trim(),
                    who.uid
                )),
            }
        }
        Ok(o) => IdmapSupport::Unavailable(format!(
            "the probe sandbox ended with {:?}: {}",
            o.termination,
            text.stderr.trim()
        )),
        Err(e) => IdmapSupport::Unavailable(common::error_chain(&e)),
    }
}

/// Why `who` may not be the target of an idmap, when it is a user other services share.
/// Every process of the sandbox user can reach a running sandbox's workspace through
/// `/proc/<pid>/root`, and through the map it writes there as the workspace's owner: only
/// sandboxes (under seccomp, which refuses set-ID bits) may run as that user.
pub fn shared_user(who: &Identity) -> Option<String> {
    (who.name == super::user::DEV_USER || who.uid == 65534).then(|| {
        format!(
            "the sandbox user {} (uid {}) is shared with other services, and every process of that user could \
             write a running sandbox's workspace as its owner: give sandboxes a user of their own \
             (SCIENCE_AGENT_SANDBOX_USER)",
            who.name, who.uid
        )
    })
}

fn facts(fd: &OwnedFd) -> std::io::Result<DirFacts> {
    let st = fsat::Stat::of_fd(fd)?;
    Ok(DirFacts { owner: IdPair { uid: st.uid, gid: st.gid }, mode: st.mode })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::user::Origin;

    fn who(origin: Origin) -> Identity {
        Identity { uid: 65534, gid: 65534, name: "nobody".into(), origin }
    }

    const ROOT: IdPair = IdPair { uid: 0, gid: 0 };
    const SANDBOX: IdPair = IdPair { uid: 65534, gid: 65534 };
    const OTHER: IdPair = IdPair { uid: 1000, gid: 1000 };

    #[test]
    fn decision_table() {
        let unavailable = IdmapSupport::Unavailable("EINVAL".into());
        let root_runner = who(Origin::DevDefault);
        let plain_runner = who(Origin::Runner);
        type Case<'a> = (&'a str, DirFacts, &'a Identity, &'a IdmapSupport, bool, bool, Result<Access, ()>);
        let cases: Vec<Case> = vec![
            (
                "own dir",
                DirFacts { owner: SANDBOX, mode: 0o700 },
                &root_runner,
                &IdmapSupport::Available,
                true,
                false,
                Ok(Access::Direct),
            ),
            (
                "root's dir, idmap",
                DirFacts { owner: ROOT, mode: 0o755 },
                &root_runner,
                &IdmapSupport::Available,
                true,
                false,
                Ok(Access::Idmapped(ROOT)),
            ),
            (
                "read-only parent, idmap",
                DirFacts { owner: OTHER, mode: 0o755 },
                &root_runner,
                &IdmapSupport::Available,
                false,
                false,
                Ok(Access::Idmapped(OTHER)),
            ),
            (
                "own dir under an idmapped parent",
                DirFacts { owner: SANDBOX, mode: 0o700 },
                &root_runner,
                &IdmapSupport::Available,
                true,
                true,
                Ok(Access::Idmapped(SANDBOX)),
            ),
            (
                "root's dir, no idmap",
                DirFacts { owner: ROOT, mode: 0o755 },
                &root_runner,
                &unavailable,
                true,
                false,
                Err(()),
            ),
            (
                "root's dir, no idmap, world-writable",
                DirFacts { owner: ROOT, mode: 0o777 },
                &root_runner,
                &unavailable,
                true,
                false,
                Ok(Access::Direct),
            ),
            (
                "root's dir, no idmap, read-only",
                DirFacts { owner: ROOT, mode: 0o755 },
                &root_runner,
                &unavailable,
                false,
                false,
                Ok(Access::Direct),
            ),
            (
                "unprivileged, another's dir",
                DirFacts { owner: OTHER, mode: 0o755 },
                &plain_runner,
                &IdmapSupport::Unprivileged,
                true,
                false,
                Err(()),
            ),
            (
                "unprivileged, another's dir, group-writable",
                DirFacts { owner: IdPair { uid: 1000, gid: 65534 }, mode: 0o775 },
                &plain_runner,
                &IdmapSupport::Unprivileged,
                true,
                false,
                Ok(Access::Direct),
            ),
            (
                "unprivileged, own uid other gid",
                DirFacts { owner: IdPair { uid: 65534, gid: 5 }, mode: 0o755 },
                &plain_runner,
                &IdmapSupport::Unprivileged,
                true,
                false,
                Ok(Access::Direct),
            ),
        ];
        for (name, facts, who, support, writable, under, expected) in cases {
            let got = decide(facts, who, support, writable, under).map_err(drop);
            assert_eq!(got, expected, "{name}");
        }
    }

    #[test]
    fn the_refusal_names_the_remedy() {
        let text = Unwritable {
            path: "/d/projects/p/ws".into(),
            owner_uid: 0,
            owner_gid: 0,
            mode: 0o755,
            user: "nobody".into(),
            user_uid: 65534,
            why: "idmapped mounts are unavailable here (EINVAL)".into(),
        }
        .to_string();
        assert!(text.contains("Run runnerd as the data directory's owner"), "{text}");
        assert!(text.contains("owned by uid 0 (gid 0) with mode 755"), "{text}");
    }

    #[test]
    fn write_bits_by_class() {
        assert!(may_write(0o700, SANDBOX, 65534, 65534));
        assert!(!may_write(0o500, SANDBOX, 65534, 65534));
        assert!(may_write(0o770, IdPair { uid: 1, gid: 65534 }, 65534, 65534));
        assert!(!may_write(0o757, IdPair { uid: 1, gid: 65534 }, 65534, 65534));
        assert!(may_write(0o777, ROOT, 65534, 65534));
        assert!(!may_write(0o775, ROOT, 65534, 65534));
    }

    #[test]
    fn nobody_is_never_an_idmap_target() {
        let nobody = who(Origin::DevDefault);
        assert!(shared_user(&nobody).unwrap().contains("SCIENCE_AGENT_SANDBOX_USER"));
        let numbered = Identity { uid: 65534, gid: 65534, name: "65534".into(), origin: Origin::Configured };
        assert!(shared_user(&numbered).is_some());
        let own = Identity {
            uid: 990,
            gid: 990,
            name: "sciencediscovery-sandbox".into(),
            origin: Origin::Configured,
        };
        assert_eq!(shared_user(&own), None);
    }
}
