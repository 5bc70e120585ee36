//! What a prefix holds: its `conda-meta/*.json` records, and their protocol form.

use std::path::Path;

use common::provision::Package;
use rattler_conda_types::{PrefixRecord, RepoDataRecord};

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("the installed packages of {0} could not be read")]
    Read(String, #[source] std::io::Error),
}

/// The prefix's installed records (none when it has no `conda-meta`).
pub fn installed(prefix: &Path) -> Result<Vec<PrefixRecord>, InventoryError> {
    PrefixRecord::collect_from_prefix::<PrefixRecord>(prefix)
        .map_err(|err| InventoryError::Read(prefix.display().to_string(), err))
}

/// The protocol's view of one record.
pub fn package(record: &RepoDataRecord) -> Package {
    let package = &record.package_record;
    Package {
        name: package.name.as_normalized().to_string(),
        version: package.version.to_string(),
        build: package.build.to_string(),
        // rattler keeps the channel URL with a trailing `/`; conda and runnerd write none.
        channel: record.channel.as_deref().unwrap_or("").trim_end_matches('/').to_string(),
        subdir: package.subdir.clone(),
    }
}

/// Every installed package, sorted by name (then version, build).
pub fn packages(records: &[PrefixRecord]) -> Vec<Package> {
    let mut packages: Vec<Package> = records.iter().map(|r| package(&r.repodata_record)).collect();
    packages.sort();
    packages
}

/// `channel::name-version-build`, as conda's history names a package.
pub fn history_name(package: &Package) -> String {
    format!("{}::{}-{}-{}", package.channel, package.name, package.version, package.build)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_names() {
        let package = Package {
            name: "tinyutil".into(),
            version: "2.0".into(),
            build: "0".into(),
            channel: "file:///srv/c".into(),
            subdir: "noarch".into(),
        };
        assert_eq!(history_name(&package), "file:///srv/c::tinyutil-2.0-0");
    }
}
