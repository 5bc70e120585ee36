//! Remote workspaces (R-WS-1, contract §5.1): moving files in and out of
//! `<dataDir>/remote-workspaces/<key>` over HTTP, by descriptor and never through a symlink.
//! The HTTP handlers are runnerd's (`api::remote`).

pub mod files;
pub mod paths;
