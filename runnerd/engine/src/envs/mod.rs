//! Scientific environments (issue #16): named conda environments under
//! `<dataDir>/scientific-envs/`, updated in place with a revision record and a write-once
//! snapshot per change, exactly the original's on-disk store (internals §5).
//!
//! * [`ids`]: what may be named (ids, names, package specs, channels, index URLs); pure.
//! * [`catalog`]: `catalog.json`'s types, its atomic replacement, the update transitions.
//! * [`snapshot`]: the v2 revision snapshot, its bytes, hash and write-once file.
//! * [`gate`]: the per-environment FIFO readers/writer gate and the global mutation lock.
//! * [`wheels`]: workspace wheels persisted by content for pip installs.
//! * `disk`: the descriptor-relative file operations those share.
//! * [`settings`]: the variables (`SCIENTIFIC_ENVS`, channels, cache, starters).
//! * [`setup`]: the setup state machine `/environment-setup` and `/health` report.
//! * [`steps`]: each provisioning step (conda, pip, CRAN, Bioconductor, inventories) as a
//!   sandboxed command; [`sandboxed`]: running one in our sandbox, a prefix or the package
//!   cache it writes watched (`cache_growth`: what a fetch step adds to the shared cache).
//! * [`store`]: the operations (setup, create, install, uninstall, delete, the execution's
//!   read lease) over those pieces.

mod cache_growth;
pub mod catalog;
mod disk;
pub mod gate;
pub mod ids;
pub mod sandboxed;
pub mod settings;
pub mod setup;
pub mod snapshot;
pub mod steps;
pub mod store;
pub mod wheels;
