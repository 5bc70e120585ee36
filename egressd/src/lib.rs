//! egressd: the egress gateway daemon (R-NET-3).

pub mod bridge;
pub mod dns;

/// Entry point of the `egressd` binary.
pub fn run() -> i32 {
    eprintln!("egressd: not assembled yet");
    2
}
