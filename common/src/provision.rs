//! The runnerd ↔ `runner-provisioner` protocol: one JSON [`Request`] on the provisioner's
//! stdin, one JSON [`Response`] on its stdout.
//!
//! The provisioner is the conda solver and installer (the rattler crates). It runs inside one
//! of runnerd's sandboxes, so a hostile archive or a crash in that code reaches neither
//! runnerd nor the rest of the data directory; runnerd never links it (its idle memory stays
//! small). Every path here is an absolute host path that the sandbox binds at the same place:
//! conda prefixes embed their own path, so the prefix must be where it will be run from.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The largest request runnerd writes and the provisioner reads: a link request carries the
/// fetch step's solution (at most [`MAX_SOLUTION_BYTES`]) as a JSON string, which escaping
/// may double.
pub const MAX_REQUEST_BYTES: usize = 2 * MAX_SOLUTION_BYTES + (1 << 20);
/// The largest solution a fetch step answers (it refuses a larger one with a clear error).
pub const MAX_SOLUTION_BYTES: usize = MAX_RESPONSE_BYTES / 2;
/// The largest response the provisioner writes and runnerd reads.
pub const MAX_RESPONSE_BYTES: usize = 8 << 20;
/// The most entries (files, directories, links, the rest) a prefix may hold, and a step may
/// leave in one or add to the package cache: the provisioner's link check reads no more, so
/// a prefix past it could never be changed again (the largest conda environments hold a few
/// hundred thousand), and runnerd's watchdog stops a step past it.
pub const MAX_PREFIX_ENTRIES: u64 = 2_000_000;

/// One provisioning step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub op: Op,
    /// The conda prefix to create, change or list.
    pub prefix: PathBuf,
    /// Channel URLs in priority order (`https://…`, `http://…`, `file:///…`); runnerd has
    /// already turned names such as `conda-forge` into URLs and checked them against the
    /// allowlist. Strict priority: a package is taken from the first channel that has it.
    pub channels: Vec<String>,
    /// The package cache (`pkgs/`: extracted packages, copied or reflinked into prefixes:
    /// keep it on the prefix's filesystem) and the repodata cache (`repodata/`) beneath it.
    pub cache_dir: PathBuf,
    /// Package caches searched after `cache_dir`'s and never written: the operator's
    /// offline cache, laid out as conda's `pkgs_dirs` (an extracted package per directory).
    #[serde(default)]
    pub read_only_caches: Vec<PathBuf>,
    /// Use only what the caches and `file://` channels hold; open no connection.
    pub offline: bool,
    /// Which half of a change this step is; see [`Stage`].
    pub stage: Stage,
    /// The most bytes the packages a step adds may hold together (0: no limit): refused
    /// before anything is linked. runnerd also measures the whole prefix as the step runs.
    #[serde(default)]
    pub max_prefix_bytes: u64,
}

/// A change runs as two steps, so that no step ever has both the shared package cache and a
/// prefix writable: a pip or R step may have planted links in the prefix, and a step that
/// could write both would carry its writes through them into the cache that every other
/// environment is copied from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Stage {
    /// Solve, and put every package the change links into the cache: the prefix is only
    /// read. The answer's `solution` is what [`Stage::Link`] is then given. `List` is
    /// always this stage (it writes nothing).
    Fetch,
    /// Link `solution` (the fetch step's, unchanged) into the prefix: the caches are only
    /// read, nothing is downloaded, and a package the caches lack is an error.
    Link { solution: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum Op {
    /// A new prefix with these match specs (`python=3.12`, `numpy>=2`).
    Create { specs: Vec<String> },
    /// A new prefix holding exactly the packages of `source` (a task environment made from
    /// its base: the original's `create --clone`), taken from the cache, no solve.
    Clone { source: PathBuf },
    /// Add or change packages in place; `specs` are the new requests, the prefix's
    /// installed packages and earlier requests are kept where they still fit.
    Install { specs: Vec<String> },
    /// Remove these package names (and nothing that still needs them breaks: a solve
    /// without them).
    Remove { names: Vec<String> },
    /// Report what is installed; change nothing.
    List,
}

/// The provisioner's answer. On failure `error` says why in words an operator can act on,
/// and the prefix is as the failed step left it (runnerd marks the environment failed).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Response {
    pub error: Option<String>,
    /// What the step changed, in transaction order.
    pub operations: Vec<Operation>,
    /// Every conda package in the prefix after the step, sorted by name.
    pub installed: Vec<Package>,
    /// Time spent solving, in microseconds (0 when there was no solve).
    pub solve_micros: u64,
    /// The provisioner's peak resident set in KiB (`getrusage`'s `ru_maxrss`).
    pub peak_rss_kib: u64,
    /// A fetch step's solution: the package records to link, opaque to runnerd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub solution: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Change {
    Install,
    Remove,
    Change,
    Reinstall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub change: Change,
    /// The package after the step (for `Remove`, the package removed).
    pub package: Package,
    /// For `Change`: the package it replaced.
    pub previous: Option<Package>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Package {
    pub name: String,
    pub version: String,
    pub build: String,
    /// The channel's URL as the package record names it (`""` when unknown).
    pub channel: String,
    /// `linux-64`, `noarch`, …
    pub subdir: String,
}
