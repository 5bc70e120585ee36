//! runnerd: the runner daemon's library.
//!
//! * [`launch`]: starting sandboxes through `sandbox-init`, with streaming output, budgets,
//!   timeouts and clean kills.
//! * [`sandbox`]: what a sandbox looks like — preflight probes and the bwrap argv.
//! * [`startup`]: the start-up sequence that decides and prepares all of it.
//! * [`egress`]: asking egressd for a policy's gateway (network sandboxes).
//! * [`cli`]: the `runnerd` command line (the benchmarks are the `runnerd-bench` crate).

pub mod accel;
pub mod api;
pub mod app;
pub use common::audit;
pub mod auth;
pub mod check;
pub mod cli;
pub mod client;
pub mod config;
pub mod coordination;
pub mod ctl;
pub mod egress;
pub mod exec;
pub mod fsat;
pub mod http;
pub mod launch;
pub mod limits;
pub mod managed;
pub mod memory;
pub mod metrics;
pub mod npu_broker;
pub mod remote;
pub mod sandbox;
pub mod selftest;
pub mod skills;
pub mod startup;
pub use common::timefmt;
pub mod token;
pub mod versioning;
pub mod writer;

pub use common::error_chain;
