//! A stub DNS resolver with timeouts.

pub mod conf;
pub mod wire;
