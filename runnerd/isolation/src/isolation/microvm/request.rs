//! From a [`SandboxSpec`] to what the guest agent runs and what QEMU shares: the command,
//! environment and cwd are the bwrap form's own ([`argv::build`] decides them, so the two
//! backends cannot drift; with egress, its proxy variables too, the guest agent taking the
//! bridge's place), the mounts become 9p shares, each directory by the descriptor runnerd
//! checked where bwrap can bind one.

use std::os::fd::OwnedFd;

use common::egress::protocol;
use runner_guest_agent::wire::RunRequest;

use super::argv::{Share, Source};
use crate::isolation::{Dir, SandboxSpec};
use crate::sandbox::argv::{self, BwrapSpec, ProcMode, SandboxShape};
use crate::sandbox::user::Identity;
use crate::sandbox::{FdSlots, WorkspaceLayout};

/// What the spec asks for that a VM cannot give yet; the job is refused, never run with
/// less than it asked.
pub fn unsupported(spec: &SandboxSpec<'_>) -> Option<&'static str> {
    if spec.accel.is_some_and(|a| !a.is_empty()) {
        return Some("accelerators cannot be passed into a microvm; use isolation bwrap");
    }
    if !spec.binds.is_empty() {
        return Some("provisioning steps (extra binds) do not run under isolation microvm; they use bwrap");
    }
    None
}

/// The bwrap form's command without its egress bridge in front (`egress-bridge --socket S
/// --port P -- CMD…` → `CMD…`, `P`): in a VM the guest agent is the bridge, on that port.
/// `None` when the command does not start with exactly that prefix.
pub fn without_bridge(command: &[String]) -> Option<(Vec<String>, u16)> {
    match command {
        [bridge, socket_flag, socket, port_flag, port, end, rest @ ..]
            if bridge == protocol::SANDBOX_BRIDGE
                && socket_flag == "--socket"
                && socket == protocol::SANDBOX_SOCKET
                && port_flag == "--port"
                && end == "--" =>
        {
            Some((rest.to_vec(), port.parse().ok()?))
        }
        _ => None,
    }
}

/// The request, the shares, and the descriptors the shares and the channel name.
#[derive(Debug)]
pub struct Planned {
    pub request: RunRequest,
    pub shares: Vec<Share>,
    pub slots: FdSlots,
    pub agent_slot: i32,
    /// QEMU's end of the egress port's channel ([`super::egress::open`]); `None`: no port.
    pub egress_slot: Option<i32>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
}

/// Plans `spec` for user `who`, QEMU's end of the channel being `agent`.
pub fn plan(
    spec: &SandboxSpec<'_>,
    who: &Identity,
    agent: &OwnedFd,
    by_fd: bool,
) -> std::io::Result<Planned> {
    // Only for the environment it sets (the skill variables); the guest mounts the shares.
    let skills = spec.skills.map(|s| argv::SkillsMount {
        packages: s.packages.to_owned(),
        extensions: s.extensions.to_owned(),
        fds: None,
    });
    let egress_mount = spec.egress.map(|_| argv::EgressMount {
        bridge: protocol::SANDBOX_BRIDGE.into(),
        gateway_socket: protocol::SANDBOX_SOCKET.into(),
        gateway_fd: None,
    });
    let cmd = argv::build(&BwrapSpec {
        shape: SandboxShape { proc_mode: ProcMode::New, disable_userns: false },
        host: spec.host,
        workspace: spec.workspace,
        cwd: spec.cwd,
        language: spec.language,
        interpreter_masks: spec.interpreter_masks,
        python: spec.python,
        science_env: spec.science_env,
        workspace_fds: None,
        // With egress, the bwrap form's proxy variables and port (so the two backends cannot
        // drift); its bridge mount and socket are not the VM's (QEMU gets neither).
        egress: egress_mount.as_ref(),
        accel: None,
        command: spec.command,
        tmp_bytes: spec.tmp_bytes,
        python_packages: spec.python_packages,
        skills: skills.as_ref(),
        profile: spec.profile,
        binds: &[],
        extra_env: spec.extra_env,
    });
    let (command, egress_port) = match &egress_mount {
        Some(_) => match without_bridge(&cmd.command) {
            Some((command, port)) => (command, Some(port)),
            None => return Err(std::io::Error::other("the sandbox command has no egress bridge to replace")),
        },
        None => (cmd.command.clone(), None),
    };
    let mut slots = FdSlots::default();
    let agent_slot = slots.push(agent)?;
    let mut shares = vec![Share { tag: "usr", source: Source::Path("/usr".into()), writable: false }];
    let mut dir = |slots: &mut FdSlots,
                   tag: &'static str,
                   d: Option<Dir<'_>>,
                   path: &std::path::Path,
                   writable: bool| {
        let source = match d.filter(|_| by_fd) {
            Some(d) => Source::Fd(slots.push_dir(d.fd, d.owner, !writable)?),
            None => Source::Path(path.to_string_lossy().into_owned()),
        };
        shares.push(Share { tag, source, writable });
        Ok::<_, std::io::Error>(())
    };
    let dirs = spec.workspace_dirs;
    let (parent_path, workspace_parent) = match spec.workspace {
        WorkspaceLayout::Plain { read_only_parent: Some(p), .. } => {
            (Some(p), Some("/parent_workspace".to_owned()))
        }
        WorkspaceLayout::Nested { parent, .. } => (Some(parent), Some("/workspace".to_owned())),
        WorkspaceLayout::Plain { read_only_parent: None, .. } => (None, None),
    };
    if let Some(p) = parent_path {
        dir(&mut slots, "wsparent", dirs.and_then(|d| d.read_only), p, false)?;
    }
    dir(&mut slots, "ws", dirs.map(|d| d.root), spec.workspace.root(), true)?;
    if let Some(prefix) = spec.science_env {
        dir(&mut slots, "env", None, prefix, false)?;
    }
    // The operator's python-packages, as the bwrap form binds them: by the path the engine
    // checked for this execution, read-only, never beside a science environment.
    let python_packages = spec.python_packages.filter(|_| spec.science_env.is_none());
    if let Some(packages) = python_packages {
        dir(&mut slots, "pypkg", None, packages, false)?;
    }
    if let Some(s) = spec.skills {
        dir(&mut slots, "skills", Some(Dir { fd: s.fds.0, owner: None }), s.packages, false)?;
        dir(&mut slots, "skillext", Some(Dir { fd: s.fds.1, owner: None }), s.extensions, true)?;
    }
    let name = crate::sandbox::host::sandbox_user_name(Some(&who.name));
    let (passwd, group) = crate::sandbox::host::identity_lines(name, who.uid, who.gid);
    let request = RunRequest {
        argv: command,
        env: cmd.env.clone(),
        cwd: cmd.cwd.clone(),
        workspace: spec.workspace.mount_point(),
        workspace_parent,
        uid: who.uid,
        gid: who.gid,
        science_env: spec.science_env.is_some(),
        skills: spec.skills.is_some(),
        python_packages: python_packages.map(|_| crate::sandbox::host::PYTHON_PACKAGES_MOUNT.to_owned()),
        masks: spec.interpreter_masks.iter().map(|p| p.to_string_lossy().into_owned()).collect(),
        tmp_bytes: argv::tmpfs_sizes(spec.tmp_bytes).0,
        pids: 0,
        fsize: 0,
        passwd: passwd.into_bytes(),
        group: group.into_bytes(),
        egress_port,
    };
    Ok(Planned { request, shares, slots, agent_slot, egress_slot: None, env: cmd.env, cwd: cmd.cwd })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::sandbox::{HostRuntime, Language};

    fn planned(python_packages: Option<&Path>, science_env: Option<&Path>) -> Planned {
        let host = HostRuntime::default();
        let ws = WorkspaceLayout::new("/data/projects/p/ws".into(), None);
        let mut spec = SandboxSpec::new(&host, &ws, Language::Python);
        spec.python_packages = python_packages;
        spec.science_env = science_env;
        let who = Identity {
            uid: 999,
            gid: 995,
            name: "sbx".into(),
            origin: crate::sandbox::user::Origin::Configured,
        };
        let agent: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
        plan(&spec, &who, &agent, false).unwrap()
    }

    fn share<'p>(p: &'p Planned, tag: &str) -> Option<&'p Share> {
        p.shares.iter().find(|s| s.tag == tag)
    }

    #[test]
    fn python_packages_are_shared_read_only_where_the_bwrap_form_binds_them_and_never_beside_an_environment()
    {
        let packages = Path::new("/data/python-packages/py3");
        let with = planned(Some(packages), None);
        let pypkg = share(&with, "pypkg").expect("a pypkg share");
        assert!(!pypkg.writable);
        assert!(matches!(&pypkg.source, Source::Path(p) if p == "/data/python-packages/py3"));
        let mount = crate::sandbox::host::PYTHON_PACKAGES_MOUNT;
        assert_eq!(with.request.python_packages.as_deref(), Some(mount));
        assert!(with.env.contains(&("PYTHONPATH".to_owned(), mount.to_owned())), "{:?}", with.env);

        let without = planned(None, None);
        assert!(share(&without, "pypkg").is_none());
        assert_eq!(without.request.python_packages, None);
        assert!(!without.env.iter().any(|(k, _)| k == "PYTHONPATH"), "{:?}", without.env);

        // A science environment wins, as in the bwrap form.
        let beside = planned(Some(packages), Some(Path::new("/data/envs/e1")));
        assert!(share(&beside, "pypkg").is_none());
        assert_eq!(beside.request.python_packages, None);
        assert!(share(&beside, "env").is_some_and(|s| !s.writable));
    }
}
