//! Which host user every sandbox runs as (issue #14): never uid 0.
//!
//! An unprivileged runnerd launches sandboxes as itself (it cannot do otherwise). A runnerd
//! started as root — a hand start, `scripts/dev` or CI as root — hands every sandbox to an
//! unprivileged user: sandbox-init switches to it before it execs bwrap, so code in a
//! sandbox has none of root's owner rights on the host (`/proc/sys`, root-owned files, a
//! setuid copy left in the workspace). The user is, in this order: the configured one
//! (`SCIENCE_AGENT_SANDBOX_USER` / `sandbox_user`), the package's `sciencediscovery-runner`,
//! and for `--dev` only `nobody`. Without one, start-up refuses, naming the fix.
//!
//! The choice is a pure function ([`choose`]) over a user lookup; [`resolve`] is its I/O.

use std::os::fd::{AsRawFd, BorrowedFd};

use common::plan::SandboxUser;
use serde::Serialize;

pub const USER_VAR: &str = "SCIENCE_AGENT_SANDBOX_USER";
/// The system user the packages create; runnerd's own user there.
pub const PACKAGE_USER: &str = "sciencediscovery-runner";
/// `--dev` as root without any other choice: present on every Debian/Ubuntu/Fedora system.
pub const DEV_USER: &str = "nobody";
/// `nobody`'s conventional ids, for a system whose passwd lacks the entry.
const NOBODY_ID: u32 = 65534;

/// Where the sandbox user came from (reported at start and in `/health`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Origin {
    /// runnerd is not root: sandboxes run as runnerd's own user.
    Runner,
    /// `SCIENCE_AGENT_SANDBOX_USER` or `sandbox_user`.
    Configured,
    /// The package's system user.
    Package,
    /// `--dev` as root: `nobody`.
    DevDefault,
}

/// The host user sandboxes run as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// The passwd name, or the number when the user has no entry.
    pub name: String,
    pub origin: Origin,
}

impl Identity {
    /// What sandbox-init must switch to: `None` when runnerd already is this user.
    pub fn switch(&self) -> Option<SandboxUser> {
        (self.origin != Origin::Runner).then_some(SandboxUser { uid: self.uid, gid: self.gid })
    }

    /// runnerd runs as root and hands what it creates for a sandbox to this user.
    pub fn switches(&self) -> bool {
        self.origin != Origin::Runner
    }

    /// Gives a file or directory runnerd just created for the sandbox (a workspace
    /// directory, an uploaded file) to the sandbox user, so the sandbox can write it. A
    /// no-op when runnerd itself is the sandbox user. Works on `O_PATH` descriptors.
    pub fn hand_over(&self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.hand_over_to(fd, self.uid, self.gid)
    }

    /// Like [`Identity::hand_over`], to `uid`/`gid` (the owner of an idmapped workspace the
    /// entry lies in); a no-op when runnerd runs as the sandbox user.
    pub fn hand_over_to(&self, fd: BorrowedFd<'_>, uid: u32, gid: u32) -> std::io::Result<()> {
        if !self.switches() {
            return Ok(());
        }
        // SAFETY: fchownat on a descriptor we borrow, with an empty NUL-terminated path and
        // AT_EMPTY_PATH: it changes exactly that inode and follows nothing.
        common::sys::cvt(unsafe {
            libc::fchownat(fd.as_raw_fd(), c"".as_ptr(), uid, gid, libc::AT_EMPTY_PATH)
        })
        .map(drop)
    }

    /// One line for the start-up banner.
    pub fn describe(&self) -> String {
        let why = match self.origin {
            Origin::Runner => "runnerd's own user",
            Origin::Configured => "configured",
            Origin::Package => "the package's user",
            Origin::DevDefault => "--dev default for a root start",
        };
        format!("{} (uid {}, gid {}; {why})", self.name, self.uid, self.gid)
    }
}

/// The store creates a remote workspace's directories and uploaded files for the sandbox.
impl runner_store::owner::HandOver for Identity {
    fn hand_over(&self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        Identity::hand_over(self, fd)
    }
}

/// Whether `uid`/`gid` (and no supplementary group: sandbox-init keeps only the primary one)
/// may search a directory of `mode` owned by `owner`/`group`.
pub fn may_search(mode: u32, owner: u32, group: u32, uid: u32, gid: u32) -> bool {
    let bits = if uid == owner {
        mode >> 6
    } else if gid == group {
        mode >> 3
    } else {
        mode
    };
    bits & 0o1 != 0
}

/// bwrap re-resolves even a bind from a descriptor by its path, as the sandbox user: a
/// root runnerd whose data directory that user cannot reach would fail every execution.
/// Returns the first directory on the way to `dir` (itself included) that the user may not
/// search, with its mode.
pub fn unreachable_component(who: &Identity, dir: &std::path::Path) -> Option<(std::path::PathBuf, u32)> {
    use std::os::unix::fs::MetadataExt;
    if !who.switches() {
        return None;
    }
    // Fails closed: a directory that cannot even be resolved is reported as unreachable.
    let real = match std::fs::canonicalize(dir) {
        Ok(real) => real,
        Err(_) => return Some((dir.to_owned(), 0)),
    };
    real.ancestors().collect::<Vec<_>>().into_iter().rev().find_map(|p| {
        let m = std::fs::metadata(p).ok()?;
        (!may_search(m.mode(), m.uid(), m.gid(), who.uid, who.gid)).then(|| (p.to_owned(), m.mode() & 0o7777))
    })
}

/// A passwd entry: (uid, primary gid, name).
pub type Entry = (u32, u32, String);

/// A sandbox user that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    #[error(
        "runnerd runs as root and has no unprivileged user for sandboxes (they never run as host root): set \
         {USER_VAR}=<user> (or sandbox_user in runnerd.toml), install the package (which creates \
         {PACKAGE_USER}), start runnerd as an unprivileged user, or use --dev (sandboxes then run as {DEV_USER})"
    )]
    NoUser,
    #[error("{USER_VAR}={0:?} names no user of this host (a name, a uid, or uid:gid)")]
    Unknown(String),
    #[error("{USER_VAR}={0:?} is root (uid or gid 0); sandboxes never run as host root")]
    Root(String),
    #[error(
        "{USER_VAR}={spec:?} asks for uid {uid}, but runnerd runs as uid {own} and cannot switch users; unset it \
         or start runnerd as root"
    )]
    CannotSwitch { spec: String, uid: u32, own: u32 },
}

/// Where the choice looks.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// runnerd's (uid, gid, name).
    pub own: (u32, u32, &'a str),
    pub configured: Option<&'a str>,
    pub dev: bool,
}

/// The sandbox user. Pure: `by_name` and `by_uid` are the passwd lookups.
pub fn choose(
    inputs: Inputs<'_>,
    by_name: impl Fn(&str) -> Option<Entry>,
    by_uid: impl Fn(u32) -> Option<Entry>,
) -> Result<Identity, UserError> {
    let (own_uid, own_gid, own_name) = inputs.own;
    let configured = inputs.configured.map(str::trim).filter(|s| !s.is_empty());
    let parsed = configured.map(|spec| parse(spec, &by_name, &by_uid).map(|e| (spec, e))).transpose()?;
    if own_uid != 0 {
        if let Some((spec, (uid, _, _))) = &parsed
            && *uid != own_uid
        {
            return Err(UserError::CannotSwitch { spec: (*spec).to_owned(), uid: *uid, own: own_uid });
        }
        return Ok(Identity {
            uid: own_uid,
            gid: own_gid,
            name: own_name.to_owned(),
            origin: Origin::Runner,
        });
    }
    let (entry, origin) = match parsed {
        Some((spec, entry)) => {
            if entry.0 == 0 || entry.1 == 0 {
                return Err(UserError::Root(spec.to_owned()));
            }
            (entry, Origin::Configured)
        }
        None => match by_name(PACKAGE_USER).filter(|e| e.0 != 0 && e.1 != 0) {
            Some(entry) => (entry, Origin::Package),
            None if inputs.dev => {
                let entry = by_name(DEV_USER).filter(|e| e.0 != 0 && e.1 != 0).unwrap_or((
                    NOBODY_ID,
                    NOBODY_ID,
                    DEV_USER.to_owned(),
                ));
                (entry, Origin::DevDefault)
            }
            None => return Err(UserError::NoUser),
        },
    };
    let (uid, gid, name) = entry;
    Ok(Identity { uid, gid, name, origin })
}

/// `name`, `uid` or `uid:gid`. A uid without an entry keeps its number as the gid.
fn parse(
    spec: &str,
    by_name: &impl Fn(&str) -> Option<Entry>,
    by_uid: &impl Fn(u32) -> Option<Entry>,
) -> Result<Entry, UserError> {
    let unknown = || UserError::Unknown(spec.to_owned());
    let number = |s: &str| s.parse::<u32>().ok().filter(|_| s.bytes().all(|b| b.is_ascii_digit()));
    match spec.split_once(':') {
        Some((u, g)) => {
            let (uid, gid) = (number(u).ok_or_else(unknown)?, number(g).ok_or_else(unknown)?);
            let name = by_uid(uid).map(|e| e.2).unwrap_or_else(|| uid.to_string());
            Ok((uid, gid, name))
        }
        None => match number(spec) {
            Some(uid) => Ok(by_uid(uid).unwrap_or((uid, uid, uid.to_string()))),
            None => by_name(spec).ok_or_else(unknown),
        },
    }
}

/// [`choose`] against this host's passwd and runnerd's own ids.
pub fn resolve(configured: Option<&str>, dev: bool) -> Result<Identity, UserError> {
    use nix::unistd::{Uid, User, getegid, geteuid};
    let entry = |u: User| (u.uid.as_raw(), u.gid.as_raw(), u.name);
    let own_uid = geteuid().as_raw();
    let own_name =
        User::from_uid(geteuid()).ok().flatten().map(|u| u.name).unwrap_or_else(|| own_uid.to_string());
    choose(
        Inputs { own: (own_uid, getegid().as_raw(), &own_name), configured, dev },
        |name| User::from_name(name).ok().flatten().map(entry),
        |uid| User::from_uid(Uid::from_raw(uid)).ok().flatten().map(entry),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passwd() -> Vec<Entry> {
        vec![
            (0, 0, "root".into()),
            (65534, 65534, "nobody".into()),
            (999, 998, PACKAGE_USER.into()),
            (1000, 1000, "alice".into()),
            (1001, 0, "wheelish".into()),
        ]
    }

    fn run(own: u32, configured: Option<&str>, dev: bool, with_package: bool) -> Result<Identity, UserError> {
        let db: Vec<Entry> = passwd().into_iter().filter(|e| with_package || e.2 != PACKAGE_USER).collect();
        let name = if own == 0 { "root" } else { "alice" };
        choose(
            Inputs { own: (own, own, name), configured, dev },
            |n| db.iter().find(|e| e.2 == n).cloned(),
            |u| db.iter().find(|e| e.0 == u).cloned(),
        )
    }

    type Who = Result<(u32, u32, String, Origin), UserError>;

    fn who(r: Result<Identity, UserError>) -> Who {
        r.map(|i| (i.uid, i.gid, i.name, i.origin))
    }

    #[test]
    fn choice_table() {
        use Origin::*;
        let ok = |uid, gid, name: &str, origin| Ok((uid, gid, name.to_owned(), origin));
        let cases: Vec<(u32, Option<&str>, bool, bool, Who)> = vec![
            // Unprivileged: always itself; a configured other user cannot be honoured.
            (1000, None, false, true, ok(1000, 1000, "alice", Runner)),
            (1000, Some("alice"), true, true, ok(1000, 1000, "alice", Runner)),
            (
                1000,
                Some("nobody"),
                false,
                true,
                Err(UserError::CannotSwitch { spec: "nobody".into(), uid: 65534, own: 1000 }),
            ),
            // Root: configured, then the package's user, then nobody for --dev only.
            (0, Some("alice"), false, true, ok(1000, 1000, "alice", Configured)),
            (0, Some(" 1000:1000 "), false, true, ok(1000, 1000, "alice", Configured)),
            (0, Some("4242"), false, true, ok(4242, 4242, "4242", Configured)),
            (0, Some("4242:77"), false, true, ok(4242, 77, "4242", Configured)),
            (0, None, false, true, ok(999, 998, PACKAGE_USER, Package)),
            (0, None, true, true, ok(999, 998, PACKAGE_USER, Package)),
            (0, None, true, false, ok(65534, 65534, "nobody", DevDefault)),
            (0, Some(""), true, false, ok(65534, 65534, "nobody", DevDefault)),
            (0, None, false, false, Err(UserError::NoUser)),
            (0, Some("root"), true, true, Err(UserError::Root("root".into()))),
            (0, Some("0:1000"), true, true, Err(UserError::Root("0:1000".into()))),
            (0, Some("wheelish"), true, true, Err(UserError::Root("wheelish".into()))),
            (0, Some("1000:0"), true, true, Err(UserError::Root("1000:0".into()))),
            (0, Some("mallory"), true, true, Err(UserError::Unknown("mallory".into()))),
            (0, Some("-1"), true, true, Err(UserError::Unknown("-1".into()))),
            (0, Some("1000:x"), true, true, Err(UserError::Unknown("1000:x".into()))),
        ];
        for (own, configured, dev, with_package, expected) in cases {
            assert_eq!(who(run(own, configured, dev, with_package)), expected, "{own} {configured:?} {dev}");
        }
    }

    #[test]
    fn only_a_switching_identity_names_a_user_for_sandbox_init() {
        let me = run(1000, None, false, true).unwrap();
        assert_eq!((me.switch(), me.switches()), (None, false));
        let nobody = run(0, None, true, false).unwrap();
        assert_eq!(nobody.switch(), Some(SandboxUser { uid: 65534, gid: 65534 }));
        assert!(nobody.describe().contains("--dev default"), "{}", nobody.describe());
    }

    #[test]
    fn search_permission_table() {
        let cases = [
            // (mode, owner, group, uid, gid) → may search
            (0o700, 0, 0, 1000, 1000, false),
            (0o711, 0, 0, 1000, 1000, true),
            (0o750, 0, 1000, 1000, 1000, true),
            (0o750, 0, 1000, 1000, 1001, false),
            (0o705, 0, 1000, 1000, 1000, false), // the group bits apply, not the others'
            (0o070, 1000, 0, 1000, 0, false),    // the owner bits apply
            (0o100, 1000, 1000, 1000, 1000, true),
            (0o755, 1000, 1000, 65534, 65534, true),
        ];
        for (mode, owner, group, uid, gid, want) in cases {
            assert_eq!(
                may_search(mode, owner, group, uid, gid),
                want,
                "{mode:o} {owner}:{group} as {uid}:{gid}"
            );
        }
    }

    #[test]
    fn the_error_without_a_user_names_every_fix() {
        let text = UserError::NoUser.to_string();
        for fix in [USER_VAR, "sandbox_user", PACKAGE_USER, "--dev", "unprivileged user"] {
            assert!(text.contains(fix), "{fix}: {text}");
        }
    }
}
