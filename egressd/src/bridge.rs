//! The in-sandbox egress bridge.

pub fn run() -> i32 {
    2
}
