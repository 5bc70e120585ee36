//! A stub DNS resolver with timeouts.

pub mod wire;
