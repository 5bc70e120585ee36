//! A stub DNS resolver with timeouts.
