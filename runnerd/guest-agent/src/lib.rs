//! The microvm backend's guest side (issue #36) and the protocol it speaks with runnerd.
//!
//! [`wire`] is the one protocol: typed messages, length-prefixed postcard frames, every
//! frame bounded; pure encode/decode used by both sides. [`agent`] is PID 1 inside the VM;
//! [`egress`] its proxy bridge to egressd for a run with egress.

pub mod agent;
pub mod egress;
pub mod wire;
