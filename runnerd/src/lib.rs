//! runnerd: the runner daemon's library.
//!
//! * [`launch`]: starting sandboxes through `sandbox-init`, with streaming output, budgets,
//!   timeouts and clean kills.
//! * [`sandbox`]: what a sandbox looks like — preflight probes and the bwrap argv.
//! * [`startup`]: the start-up sequence that decides and prepares all of it.
//! * `egress`: asking egressd for a policy's gateway (network sandboxes).
//! * [`cli`]: the `runnerd` command line (the benchmarks are the `runnerd-bench` crate).
//!
//! Public are only the modules the binaries, the integration suite (`tests/`) and the
//! benchmarks (`runnerd/bench`) use; the rest (the HTTP layer, the daemon's state, the
//! stores) is `pub(crate)`, so the compiler reports what nobody calls.

pub(crate) mod accel;
pub(crate) mod api;
pub(crate) mod app;
pub use common::audit;
pub mod auth;
pub(crate) mod blocking;
pub(crate) mod check;
pub mod cli;
pub mod client;
pub(crate) mod config;
pub mod coordination;
pub mod ctl;
pub(crate) mod dbcheck;
pub(crate) mod egress;
pub(crate) mod envs;
pub mod exec;
pub(crate) mod fsat;
pub mod history;
pub(crate) mod http;
pub mod isolation;
pub mod journal;
pub mod launch;
pub mod limits;
pub(crate) mod managed;
pub mod memory;
pub(crate) mod metrics;
pub(crate) mod npu_broker;
pub(crate) mod remote;
pub mod sandbox;
pub(crate) mod selftest;
pub(crate) mod skills;
pub mod startup;
pub use common::timefmt;
pub(crate) mod token;
pub(crate) mod versioning;
pub mod writer;

pub use common::error_chain;
