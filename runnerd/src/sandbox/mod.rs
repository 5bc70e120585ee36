//! What a sandbox is: the host facts it needs ([`host`]), the start-up probes that decide
//! its form ([`preflight`]), and the bwrap argv ([`argv`]), built by a pure function.

pub mod argv;
pub mod host;
pub mod preflight;

pub use argv::{
    EgressMount, Language, ProcMode, SandboxCommand, SandboxShape, SandboxSpec, WorkspaceFds, WorkspaceLayout,
};
pub use host::HostRuntime;
