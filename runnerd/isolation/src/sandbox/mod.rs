//! What a sandbox is: the host facts it needs ([`host`]), the start-up probes that decide
//! its form ([`preflight`]), the host user it runs as ([`user`]), and the bwrap argv
//! ([`argv`]), built by a pure function.

pub mod argv;
pub mod host;
pub mod ownership;
pub mod preflight;
pub mod user;

pub use argv::{
    BwrapSpec, EgressMount, Language, ProcMode, SandboxCommand, SandboxShape, WorkspaceFds, WorkspaceLayout,
};
pub use host::HostRuntime;

/// The descriptors a sandbox's options name (`--bind-fd 5 …`), in slot order: a bind takes
/// its number from [`FdSlots::push`] as the argv is decided, and the launcher places each
/// descriptor at exactly that number ([`FdSlots::into_placed`]): the argv and the
/// descriptors travel together and cannot disagree.
#[derive(Debug, Default)]
pub struct FdSlots {
    fds: Vec<std::os::fd::OwnedFd>,
    /// Slots sandbox-init mounts idmapped before bwrap binds them (issue #30).
    idmaps: Vec<common::plan::Idmap>,
}

impl FdSlots {
    /// A duplicate of `fd` in the next slot; returns its number in the sandbox launch.
    pub fn push(&mut self, fd: &std::os::fd::OwnedFd) -> std::io::Result<i32> {
        let slot = common::plan::FIRST_EXTRA_FD + self.fds.len() as i32;
        self.fds.push(fd.try_clone()?);
        Ok(slot)
    }

    /// Like [`FdSlots::push`], the directory to be seen through an idmapped mount when
    /// `owner` is `Some` (see [`ownership`]); `read_only` as it is bound.
    pub fn push_dir(
        &mut self,
        fd: &std::os::fd::OwnedFd,
        owner: Option<common::plan::IdPair>,
        read_only: bool,
    ) -> std::io::Result<i32> {
        let slot = self.push(fd)?;
        if let Some(owner) = owner {
            self.idmaps.push(common::plan::Idmap { fd: slot, owner, read_only });
        }
        Ok(slot)
    }

    /// The idmapped slots.
    pub fn idmaps(&self) -> &[common::plan::Idmap] {
        &self.idmaps
    }

    /// (device, inode) of each slot's file, in slot order: what the sandbox mounts.
    pub fn identities(&self) -> std::io::Result<Vec<(u64, u64)>> {
        self.fds.iter().map(crate::isolation::prestart::identity).collect()
    }

    /// The first number after the slots (where the launcher's own descriptors go).
    pub fn next(&self) -> i32 {
        common::plan::FIRST_EXTRA_FD + self.fds.len() as i32
    }

    /// `(number, descriptor)` for each slot.
    pub fn into_placed(self) -> impl Iterator<Item = (i32, std::os::fd::OwnedFd)> {
        self.fds.into_iter().enumerate().map(|(i, fd)| (common::plan::FIRST_EXTRA_FD + i as i32, fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_numbered_from_the_first_extra_fd_in_push_order() {
        let a: std::os::fd::OwnedFd = std::fs::File::open("/").unwrap().into();
        let mut slots = FdSlots::default();
        assert_eq!(slots.next(), common::plan::FIRST_EXTRA_FD);
        let first = slots.push(&a).unwrap();
        let second = slots.push(&a).unwrap();
        assert_eq!((first, second), (common::plan::FIRST_EXTRA_FD, common::plan::FIRST_EXTRA_FD + 1));
        assert_eq!(slots.next(), second + 1);
        let placed: Vec<i32> = slots.into_placed().map(|(n, _)| n).collect();
        assert_eq!(placed, [first, second]);
    }
}
