//! What a sandbox is: the host facts it needs ([`host`]), the start-up probes that decide
//! its form ([`preflight`]), the host user it runs as ([`user`]), and the bwrap argv
//! ([`argv`]), built by a pure function.

pub mod argv;
pub mod host;
pub mod preflight;
pub mod user;

pub use argv::{
    EgressMount, Language, ProcMode, SandboxCommand, SandboxShape, SandboxSpec, WorkspaceFds, WorkspaceLayout,
};
pub use host::HostRuntime;
