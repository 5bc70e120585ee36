//! Egress policy: pure functions shared by egressd and runnerd (R-NET-*).

pub mod protocol;
pub mod route;
