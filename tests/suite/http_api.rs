//! The HTTP API of the real runnerd, driven like the original RunnerClient drives it.
