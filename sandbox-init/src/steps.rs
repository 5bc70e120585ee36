//! The steps of [`crate::run`], one function each, in the order they run.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use common::channel::{self, ChannelError};
use common::plan::{
    IdPair, Idmap, InitFailure, InitReport, InitStep, LaunchPlan, MAX_TARGET_FD, Resource, Rlimit,
    SandboxUser,
};
use common::sys::{self, cvt};

/// Where received descriptors wait before they move to their targets: above every target
/// and above the channel.
const STAGING_FLOOR: RawFd = 128;

fn failure(step: InitStep, errno: i32, detail: impl Into<String>) -> InitFailure {
    InitFailure { step, errno, detail: detail.into() }
}

fn os_failure(step: InitStep, error: &io::Error, detail: impl Into<String>) -> InitFailure {
    failure(step, error.raw_os_error().unwrap_or(0), detail)
}

/// Step 0: die with runnerd (the signal fires when the *thread* that spawned us exits).
pub fn die_with_parent() -> Result<(), String> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number; no pointers involved.
    cvt(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
        .map(drop)
        .map_err(|e| format!("cannot arm PR_SET_PDEATHSIG: {e}"))
}

/// Part of step 1: descriptors are staged at numbers up to about [`STAGING_FLOOR`] + 16,
/// which needs a soft `RLIMIT_NOFILE` above that; raise it (never above the hard limit).
/// The plan's own limit is applied in step 7.
pub fn room_for_staging() -> Result<(), String> {
    // SAFETY: an all-zero rlimit is a valid out-buffer.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: getrlimit writes into the struct we own.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) })
        .map_err(|e| format!("cannot read RLIMIT_NOFILE: {e}"))?;
    let needed = (STAGING_FLOOR as libc::rlim_t) + 64;
    if limit.rlim_cur < needed {
        limit.rlim_cur = needed.min(limit.rlim_max);
        // SAFETY: setrlimit reads the struct we pass.
        cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) })
            .map_err(|e| format!("cannot raise RLIMIT_NOFILE for staging: {e}"))?;
    }
    Ok(())
}

/// Step 1: the channel arrives as standard input. It must be a socketpair made by our
/// parent: if the creator is not our parent, runnerd died before step 0 armed the death
/// signal (we were re-parented), or someone started us by hand; either way, stop.
/// Then move it above the target range, close-on-exec, so that its end-of-file tells
/// runnerd that exec succeeded.
pub fn take_channel() -> Result<UnixStream, String> {
    // SAFETY: an all-zero stat is a valid out-buffer for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into the buffer we own.
    cvt(unsafe { libc::fstat(0, &mut st) }).map_err(|e| format!("standard input is unusable: {e}"))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err("standard input is not the Unix socket runnerd passes".into());
    }
    // SAFETY: an all-zero ucred is a valid out-buffer.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`.
    cvt(unsafe {
        libc::getsockopt(0, libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    })
    .map_err(|e| format!("cannot read the channel's peer credentials: {e}"))?;
    // SAFETY: getppid cannot fail.
    let parent = unsafe { libc::getppid() };
    if cred.pid != parent {
        return Err(format!(
            "the channel was made by process {}, but our parent is {parent}: runnerd has exited or did not start us",
            cred.pid
        ));
    }
    // SAFETY: F_DUPFD_CLOEXEC duplicates fd 0 onto the lowest free number ≥ MAX_TARGET_FD.
    let fd = cvt(unsafe { libc::fcntl(0, libc::F_DUPFD_CLOEXEC, MAX_TARGET_FD) })
        .map_err(|e| format!("cannot move the channel off standard input: {e}"))?;
    // SAFETY: the descriptor was just created for us and nothing else owns it.
    Ok(UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Steps 2–10. Returns only on failure.
pub fn launch(channel: &UnixStream) -> InitFailure {
    match prepare_and_exec(channel) {
        Ok(never) => match never {},
        Err(failure) => failure,
    }
}

enum Never {}

fn prepare_and_exec(channel: &UnixStream) -> Result<Never, InitFailure> {
    let plan: LaunchPlan = channel::read_message(&mut &*channel).map_err(|e| match &e {
        ChannelError::Read(io) => os_failure(InitStep::ReadPlan, io, e.to_string()),
        _ => failure(InitStep::ReadPlan, 0, common::error_chain(&e)),
    })?;
    plan.validate().map_err(|e| failure(InitStep::ValidatePlan, 0, e.to_string()))?;

    let mut fds =
        channel::recv_fds(channel.as_fd(), plan.fds.len() + plan.join_cgroups).map_err(|e| match &e {
            ChannelError::RecvFd { source, .. } => os_failure(InitStep::ReceiveFds, source, e.to_string()),
            _ => failure(InitStep::ReceiveFds, 0, e.to_string()),
        })?;
    let cgroups = fds.split_off(plan.fds.len());
    join_cgroups(cgroups)?;
    place_fds(fds, &plan.fds)?;
    idmap_dirs(&plan.idmaps, plan.user)?;
    close_other_fds(&plan.fds, channel.as_fd())?;
    apply_rlimits(&plan.rlimits)?;
    reset_signals()?;
    switch_user(plan.user)?;
    Err(exec(&plan, channel))
}

/// Step 4b: move ourselves into each execution cgroup (every process bwrap starts inherits
/// it), then close the files. A refused write is a typed failure: runnerd never runs a
/// sandbox outside the cgroups it planned.
fn join_cgroups(procs: Vec<OwnedFd>) -> Result<(), InitFailure> {
    for (i, fd) in procs.into_iter().enumerate() {
        let mut file = std::fs::File::from(fd);
        io::Write::write_all(&mut file, b"0").map_err(|e| {
            os_failure(
                InitStep::JoinCgroups,
                &e,
                format!("writing to the join file (cgroup.procs or tasks) number {}", i + 1),
            )
        })?;
    }
    Ok(())
}

/// Step 5: move every received descriptor to a staging number first (so no target can
/// clobber a descriptor still waiting to move), then `dup2` each onto its target.
fn place_fds(fds: Vec<OwnedFd>, targets: &[RawFd]) -> Result<(), InitFailure> {
    let staged: Vec<OwnedFd> = fds
        .iter()
        .map(|fd| {
            // SAFETY: duplicates a descriptor we own onto a fresh number ≥ STAGING_FLOOR.
            let raw = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, STAGING_FLOOR) })
                .map_err(|e| os_failure(InitStep::ArrangeFds, &e, "staging a received descriptor"))?;
            // SAFETY: fresh descriptor, owned by nobody else.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        })
        .collect::<Result<_, InitFailure>>()?;
    drop(fds);
    for (fd, target) in staged.iter().zip(targets) {
        // SAFETY: dup2 onto a target number; the target is not CLOEXEC afterwards, which is
        // what lets bwrap inherit it.
        cvt(unsafe { libc::dup2(fd.as_raw_fd(), *target) })
            .map_err(|e| os_failure(InitStep::ArrangeFds, &e, format!("placing descriptor {target}")))?;
    }
    Ok(())
}

/// Step 5b (issue #30): for each directory the plan idmaps, while still root: in a mount
/// namespace of our own (private, so nothing propagates back to the host), attach an
/// idmapped clone of it on top of the directory itself, and put the clone's descriptor
/// at the target number. bwrap, started in this namespace, re-resolves a `--bind-fd`
/// descriptor by its path and checks the inode it finds (its copy of our namespace then
/// finds the idmapped mount on top); its bind copies the mount with its idmap. The
/// mount is `nosuid` and `nodev`. Deeper directories are attached first: a mount cannot be
/// idmapped twice, so a nested workspace gets its own mapping on the original mount, and its
/// parent's recursive clone carries that mount along beneath its own mapping.
fn idmap_dirs(maps: &[Idmap], user: Option<SandboxUser>) -> Result<(), InitFailure> {
    let step = InitStep::Idmap;
    if maps.is_empty() {
        return Ok(());
    }
    // The plan was validated: idmaps come with a user.
    let user = user.ok_or_else(|| failure(step, 0, "an idmap needs a sandbox user"))?;
    // SAFETY: unshare with a flag only; affects this (single-threaded) process.
    cvt(unsafe { libc::unshare(libc::CLONE_NEWNS) })
        .map_err(|e| os_failure(step, &e, "unsharing the mount namespace"))?;
    // SAFETY: the path is a NUL-terminated literal; the other pointers may be NULL for a
    // propagation change.
    cvt(unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    })
    .map_err(|e| os_failure(step, &e, "making the mount namespace private"))?;
    let mut dirs = maps
        .iter()
        .map(|map| {
            let link = format!("/proc/self/fd/{}", map.fd);
            let path =
                std::fs::read_link(&link).map_err(|e| os_failure(step, &e, format!("reading {link}")))?;
            Ok((path, *map))
        })
        .collect::<Result<Vec<_>, InitFailure>>()?;
    dirs.sort_by_key(|(path, _)| std::cmp::Reverse(path.components().count()));
    let mut namespaces: Vec<(IdPair, OwnedFd)> = Vec::new();
    for (path, map) in dirs {
        // SAFETY: the target was placed in step 5 and stays open for this step.
        let placed = unsafe { BorrowedFd::borrow_raw(map.fd) };
        let (path, here) = reopen_here(placed, path)?;
        let userns = match namespaces.iter().position(|(owner, _)| *owner == map.owner) {
            Some(i) => i,
            None => {
                namespaces.push((map.owner, user_namespace(map.owner, user)?));
                namespaces.len() - 1
            }
        };
        let tree = sys::open_tree_clone(here.as_fd())
            .map_err(|e| os_failure(step, &e, format!("cloning the mount of {path}")))?;
        let mut attrs = sys::MOUNT_ATTR_IDMAP | sys::MOUNT_ATTR_NOSUID | sys::MOUNT_ATTR_NODEV;
        if map.read_only {
            attrs |= sys::MOUNT_ATTR_RDONLY;
        }
        sys::mount_setattr_idmap(tree.as_fd(), namespaces[userns].1.as_fd(), attrs).map_err(|e| {
            os_failure(
                step,
                &e,
                format!("idmapping {path} (the kernel or its filesystem may not support idmapped mounts)"),
            )
        })?;
        sys::move_mount_onto(tree.as_fd(), here.as_fd())
            .map_err(|e| os_failure(step, &e, format!("attaching the idmapped mount over {path}")))?;
        // SAFETY: dup2 onto the plan's target number, which the placed descriptor held.
        cvt(unsafe { libc::dup2(tree.as_raw_fd(), map.fd) })
            .map_err(|e| os_failure(step, &e, format!("placing the idmapped mount at {}", map.fd)))?;
    }
    Ok(())
}

/// The directory behind `placed` (opened in runnerd's mount namespace; `path` is what its
/// `/proc/self/fd` link read), opened again by that path in ours, following no symbolic link: a mount can only be attached there. The path
/// may have been renamed since; the inode must be the one runnerd opened, else the launch
/// fails.
fn reopen_here(placed: BorrowedFd<'_>, path: std::path::PathBuf) -> Result<(String, OwnedFd), InitFailure> {
    let step = InitStep::Idmap;
    let path_text = path.to_string_lossy().into_owned();
    let c_path = CString::new(path.into_os_string().into_encoded_bytes())
        .map_err(|_| failure(step, 0, "a workspace path with a NUL byte"))?;
    // No link followed in any component, as root: the inode is checked below anyway, but a
    // link could send the lookup through an automount or a stale network path.
    let here = sys::open_dir_no_symlinks(&c_path)
        .map_err(|e| os_failure(step, &e, format!("opening {path_text} again")))?;
    let (a, b) = (fstat(placed)?, fstat(here.as_fd())?);
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
        return Err(failure(step, 0, format!("{path_text} was replaced after runnerd opened it")));
    }
    Ok((path_text, here))
}

fn fstat(fd: BorrowedFd<'_>) -> Result<libc::stat, InitFailure> {
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into the buffer we own.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })
        .map_err(|e| os_failure(InitStep::Idmap, &e, "fstat of a workspace descriptor"))?;
    Ok(st)
}

/// A user namespace whose only mapping is `owner` → `user` (uid and gid), for
/// `MOUNT_ATTR_IDMAP`: a child is cloned into a new user namespace and waits on a pipe
/// while we, still root in ours, write its maps and open its namespace; it then exits.
fn user_namespace(owner: IdPair, user: SandboxUser) -> Result<OwnedFd, InitFailure> {
    let step = InitStep::Idmap;
    let mut ends = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    cvt(unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) })
        .map_err(|e| os_failure(step, &e, "making a pipe"))?;
    // SAFETY: fresh descriptors, owned by nobody else.
    let (wait_end, release_end) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a raw clone without CLONE_VM is a fork into a new user namespace: the child
    // has a copy of our memory and, below, makes only raw calls (close, read, _exit).
    let pid = cvt(unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) })
        .map_err(|e| os_failure(step, &e, "cloning a process into a new user namespace"))?;
    if pid == 0 {
        let mut byte = 0u8;
        // SAFETY: the child closes its copy of the release end, blocks until ours closes,
        // and exits without running any of our code.
        unsafe {
            libc::close(release_end.as_raw_fd());
            libc::read(wait_end.as_raw_fd(), (&raw mut byte).cast(), 1);
            libc::_exit(0);
        }
    }
    let pid = pid as libc::pid_t;
    let made = (|| {
        let write = |name: &str, text: String| {
            std::fs::write(format!("/proc/{pid}/{name}"), text)
                .map_err(|e| os_failure(step, &e, format!("writing the namespace's {name}")))
        };
        write("uid_map", format!("{} {} 1\n", owner.uid, user.uid))?;
        write("gid_map", format!("{} {} 1\n", owner.gid, user.gid))?;
        std::fs::File::open(format!("/proc/{pid}/ns/user"))
            .map(OwnedFd::from)
            .map_err(|e| os_failure(step, &e, "opening the user namespace"))
    })();
    drop(release_end);
    let mut status = 0;
    // SAFETY: reaps the child we cloned; status is ours.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    made
}

/// Step 6: close everything but the targets and the channel.
fn close_other_fds(targets: &[RawFd], channel: BorrowedFd<'_>) -> Result<(), InitFailure> {
    let mut keep: Vec<libc::c_uint> =
        targets.iter().chain([&channel.as_raw_fd()]).map(|fd| *fd as libc::c_uint).collect();
    keep.sort_unstable();
    let mut start: libc::c_uint = 0;
    let mut ranges = Vec::new();
    for k in keep {
        if k > start {
            ranges.push((start, k - 1));
        }
        start = k + 1;
    }
    ranges.push((start, libc::c_uint::MAX));
    for (first, last) in &ranges {
        match sys::close_range(*first, *last) {
            Ok(()) => {}
            // ENOSYS before Linux 5.9; EPERM under container seccomp profiles that refuse
            // syscalls they do not know.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
                return close_listed_fds(&ranges);
            }
            Err(e) => return Err(os_failure(InitStep::CloseFds, &e, "close_range")),
        }
    }
    Ok(())
}

/// Fallback for kernels before 5.9: close what `/proc/self/fd` lists.
fn close_listed_fds(ranges: &[(libc::c_uint, libc::c_uint)]) -> Result<(), InitFailure> {
    let entries = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| os_failure(InitStep::CloseFds, &e, "listing /proc/self/fd"))?;
    let open: Vec<libc::c_uint> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
    for fd in open {
        if ranges.iter().any(|(first, last)| (*first..=*last).contains(&fd)) {
            // SAFETY: closing a descriptor that no live Rust object owns (the directory
            // handle used for listing is already gone); EBADF is harmless here.
            unsafe { libc::close(fd as libc::c_int) };
        }
    }
    Ok(())
}

/// Step 7.
fn apply_rlimits(limits: &[Rlimit]) -> Result<(), InitFailure> {
    for limit in limits {
        let resource = match limit.resource {
            Resource::Core => libc::RLIMIT_CORE,
            Resource::NoFile => libc::RLIMIT_NOFILE,
            Resource::FSize => libc::RLIMIT_FSIZE,
            Resource::NProc => libc::RLIMIT_NPROC,
            Resource::As => libc::RLIMIT_AS,
            Resource::Cpu => libc::RLIMIT_CPU,
        };
        // SAFETY: an all-zero rlimit is a valid out-buffer.
        let mut current: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: getrlimit writes into the struct we own.
        cvt(unsafe { libc::getrlimit(resource, &mut current) })
            .map_err(|e| os_failure(InitStep::Rlimits, &e, format!("reading {:?}", limit.resource)))?;
        let value = libc::rlimit {
            rlim_cur: limit.soft.unwrap_or(current.rlim_cur),
            rlim_max: limit.hard.unwrap_or(current.rlim_max),
        };
        // SAFETY: setrlimit reads the struct we pass.
        cvt(unsafe { libc::setrlimit(resource, &value) }).map_err(|e| {
            os_failure(
                InitStep::Rlimits,
                &e,
                format!("{:?} to {:?}/{:?}", limit.resource, limit.soft, limit.hard),
            )
        })?;
    }
    Ok(())
}

/// Step 8. The raw `rt_sigaction` is used because glibc's wrapper refuses the two signals
/// it reserves for itself (32, 33), and a parent may well have left those ignored.
fn reset_signals() -> Result<(), InitFailure> {
    // Large enough for every layout of the kernel's `struct sigaction` (handler, flags,
    // optional restorer, 64-bit mask); all zero means SIG_DFL, no flags, empty mask.
    let default_action = [0u64; 4];
    for signal in 1..=libc::SIGRTMAX() {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: the kernel reads a struct sigaction from the zeroed buffer we own;
        // the old action is not wanted; 8 is sizeof(kernel sigset_t).
        cvt(unsafe {
            libc::syscall(libc::SYS_rt_sigaction, signal, default_action.as_ptr(), std::ptr::null::<u8>(), 8)
        })
        .map_err(|e| os_failure(InitStep::Signals, &e, format!("signal {signal}")))?;
    }
    // SAFETY: an all-zero sigset_t is a valid buffer; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: initialises the set we own.
    cvt(unsafe { libc::sigemptyset(&mut empty) })
        .map_err(|e| os_failure(InitStep::Signals, &e, "emptying a signal set"))?;
    // SAFETY: sets the mask from a valid set; single-threaded, so sigprocmask is the right call.
    cvt(unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) })
        .map_err(|e| os_failure(InitStep::Signals, &e, "unblocking signals"))?;
    Ok(())
}

/// Step 9: become the unprivileged sandbox user (all three uids and gids, supplementary
/// groups only the primary one), so bwrap and everything it starts run without any of
/// root's owner rights on the host (`/proc/sys`, root-owned files, setuid copies). The
/// kernel clears the death signal on a credential change, so it is armed again, and the
/// parent checked again (runnerd may have died in between). Whatever the plan says, this
/// step refuses to continue as uid 0: no sandbox code ever runs as host root.
fn switch_user(user: Option<SandboxUser>) -> Result<(), InitFailure> {
    let step = InitStep::SwitchUser;
    if let Some(SandboxUser { uid, gid }) = user
        && (ids(Ids::User)? != [uid; 3] || ids(Ids::Group)? != [gid; 3])
    {
        // SAFETY: getppid cannot fail.
        let parent = unsafe { libc::getppid() };
        let groups = [gid as libc::gid_t];
        // SAFETY: setgroups reads one gid from the array we own.
        cvt(unsafe { libc::setgroups(1, groups.as_ptr()) })
            .map_err(|e| os_failure(step, &e, format!("setgroups([{gid}])")))?;
        // SAFETY: plain credential syscalls with integer arguments.
        cvt(unsafe { libc::setresgid(gid, gid, gid) })
            .map_err(|e| os_failure(step, &e, format!("setresgid({gid})")))?;
        // SAFETY: as above; with every uid non-zero the kernel clears all capabilities.
        cvt(unsafe { libc::setresuid(uid, uid, uid) })
            .map_err(|e| os_failure(step, &e, format!("setresuid({uid})")))?;
        if ids(Ids::User)? != [uid; 3] || ids(Ids::Group)? != [gid; 3] {
            return Err(failure(step, 0, format!("the switch to {uid}:{gid} did not take effect")));
        }
        // SAFETY: as in step 0.
        cvt(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) })
            .map_err(|e| os_failure(step, &e, "re-arming PR_SET_PDEATHSIG after the switch"))?;
        // SAFETY: getppid cannot fail.
        if unsafe { libc::getppid() } != parent {
            return Err(failure(step, 0, "runnerd exited during the user switch"));
        }
    }
    let [ruid, euid, suid] = ids(Ids::User)?;
    if ruid == 0 || euid == 0 || suid == 0 {
        return Err(failure(
            step,
            libc::EPERM,
            "refusing to execute bubblewrap as host root: the launch names no unprivileged sandbox user",
        ));
    }
    Ok(())
}

/// Which ids [`ids`] reads.
#[derive(Clone, Copy)]
enum Ids {
    User,
    Group,
}

/// The real, effective and saved user or group ids.
fn ids(which: Ids) -> Result<[u32; 3], InitFailure> {
    let (mut r, mut e, mut s) = (0, 0, 0);
    let ret = match which {
        // SAFETY: the call writes three ids into the variables we own.
        Ids::User => unsafe { libc::getresuid(&mut r, &mut e, &mut s) },
        // SAFETY: as above.
        Ids::Group => unsafe { libc::getresgid(&mut r, &mut e, &mut s) },
    };
    cvt(ret).map_err(|err| os_failure(InitStep::SwitchUser, &err, "reading the current ids"))?;
    Ok([r, e, s])
}

/// Step 10: say `Executing`, then exec. The channel is close-on-exec, so runnerd sees
/// end-of-file right after the marker when the exec succeeds.
fn exec(plan: &LaunchPlan, channel: &UnixStream) -> InitFailure {
    let to_c = |s: &str| CString::new(s).map_err(|_| failure(InitStep::Exec, 0, "argument with a NUL byte"));
    let program = match to_c(&plan.program) {
        Ok(p) => p,
        Err(f) => return f,
    };
    let mut argv = vec![program.clone()];
    for arg in &plan.args {
        match to_c(arg) {
            Ok(a) => argv.push(a),
            Err(f) => return f,
        }
    }
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    if let Err(e) = channel::write_message(&mut &*channel, &InitReport::Executing) {
        return failure(InitStep::Exec, 0, format!("could not tell runnerd about the exec: {e}"));
    }
    // SAFETY: program, argv and envp are NUL-terminated and outlive the call; execve only
    // returns on failure.
    let e = match cvt(unsafe { libc::execve(program.as_ptr(), argv_ptrs.as_ptr(), envp.as_ptr()) }) {
        Err(e) => e,
        Ok(_) => io::Error::other("execve returned without an error"),
    };
    os_failure(InitStep::Exec, &e, format!("could not execute {}: {e}", plan.program))
}
