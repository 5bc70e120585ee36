//! Applying a solution to a prefix with rattler's installer, in two steps that never run
//! with both the package cache and the prefix writable ([`common::provision::Stage`]).
//!
//! [`fetch`] puts every package the transaction will link into the package cache, before any
//! prefix is touched (and with the prefix read-only): a corrupt or unreachable archive then
//! fails the change while the prefix is exactly as it was. [`link`] only links from the
//! caches (read-only by then): a package they lack is an error, never a download, and the
//! installer takes its cache lock in a scratch layer of its own.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use common::provision::{Change, Operation};
use rattler::install::{
    ExternalSymlinkPolicy, InstallationResultRecord, Installer, InstallerError, LinkOptions,
    TransactionOperation,
};
use rattler::package_cache::PackageCache;
use rattler_conda_types::{MatchSpec, PrefixRecord, RepoDataRecord};
use rattler_networking::LazyClient;
use rattler_networking::retry_policies::default_retry_policy;

use crate::error_chain;
use crate::inventory;
use crate::links;
use crate::network::{self, Network};
use crate::packages;

#[derive(Debug, thiserror::Error)]
pub enum InstallFailure {
    #[error("Package {file} from {channel} is corrupt: {cause}")]
    Corrupt { file: String, channel: String, cause: String },
    #[error("Package {file} from {channel} could not be read: {cause}")]
    Unreadable { file: String, channel: String, cause: String },
    #[error("Package {file} could not be downloaded from {channel}: {cause}")]
    Download { file: String, channel: String, cause: String },
    #[error("Package {file} from {channel} is not in the package cache, and this run is offline")]
    NotCached { file: String, channel: String },
    #[error("Package {file} from {channel} was not fetched before linking; nothing was changed")]
    NotFetched { file: String, channel: String },
    #[error(transparent)]
    Foreign(#[from] links::LinkError),
    /// Found in the prefix once the packages were linked.
    #[error(
        "{0}. The packages were linked before it was found, so the environment cannot be used: delete it and create it again"
    )]
    Linked(#[source] links::LinkError),
    #[error(transparent)]
    Package(#[from] packages::PackageError),
    #[error("Prefix {prefix} is not writable: {cause}")]
    PrefixNotWritable { prefix: String, cause: String },
    #[error("Prefix {0} already exists and is not empty")]
    PrefixNotEmpty(String),
    #[error("The packages could not be installed into {prefix}: {cause}")]
    Installer { prefix: String, cause: String },
}

/// What to make the prefix hold.
#[allow(missing_debug_implementations)] // rattler's PackageCache has no Debug
pub struct Plan<'a> {
    pub prefix: &'a Path,
    pub installed: Vec<PrefixRecord>,
    pub desired: Vec<RepoDataRecord>,
    /// Recorded in each linked package's `requested_spec(s)`.
    pub requested: Vec<MatchSpec>,
    pub cache: &'a PackageCache,
    pub network: Network,
    /// The request's channels: every package fetched or linked comes from one of them.
    pub channels: &'a [String],
    /// The most bytes the incoming packages' files may add to the prefix (0: no limit).
    pub max_bytes: u64,
}

impl Plan<'_> {
    /// What the transaction adds: the desired records the prefix does not hold yet.
    fn incoming(&self) -> impl Iterator<Item = &RepoDataRecord> {
        let installed: HashSet<&url::Url> = self.installed.iter().map(|r| &r.repodata_record.url).collect();
        self.desired.iter().filter(move |r| !installed.contains(&r.url))
    }
}

/// Puts every package the plan adds into the cache; the prefix is not touched.
pub async fn fetch(plan: &Plan<'_>) -> Result<(), InstallFailure> {
    links::check_origins(plan.incoming(), plan.channels)?;
    let client = network::lazy_client(plan.network);
    for record in plan.incoming() {
        prefetch(record, plan.cache, &client, plan.network).await?;
    }
    // Refused here already (the prefix untouched, the cache gate released sooner); the
    // link step checks again what it links.
    checked(plan).await.map(drop)
}

/// Every incoming package as the caches hold it passes [`packages::check`], and together
/// their files stay within the plan's byte budget: before anything is linked.
async fn checked(plan: &Plan<'_>) -> Result<u64, InstallFailure> {
    let mut total = 0u64;
    for record in plan.incoming() {
        let not_fetched = |_| InstallFailure::NotFetched {
            file: file_name(record),
            channel: inventory::package(record).channel,
        };
        guard(record, plan.cache, false)?;
        let entry = from_cache_only(record, plan.cache).await.map_err(not_fetched)?;
        let name = file_name(record);
        let prefix_len = u64::try_from(plan.prefix.as_os_str().len()).unwrap_or(u64::MAX);
        total = total.saturating_add(packages::check(&name, entry.path(), prefix_len)?);
    }
    packages::within(total, plan.max_bytes)?;
    Ok(total)
}

/// Links and unlinks from the caches alone; the operations in transaction order.
pub async fn link(plan: Plan<'_>) -> Result<Vec<Operation>, InstallFailure> {
    links::check_origins(plan.incoming(), plan.channels)?;
    checked(&plan).await?;
    let prefix = plan.prefix;
    let result = Installer::new()
        // Files are copies (or copy-on-write reflinks), never hard links to the cache: a
        // later pip or R step runs hostile build code with the prefix writable, and a file
        // hard-linked from the shared cache would carry its change into every other
        // environment's prefix. A package's links are made as links, with the text they
        // have (checked to stay in the prefix by `checked`): with symbolic links off,
        // rattler would copy the bytes of whatever a link points at instead.
        .with_link_options(LinkOptions {
            allow_symbolic_links: Some(true),
            allow_hard_links: Some(false),
            allow_ref_links: Some(true),
        })
        // A package whose links point outside the prefix is refused, not warned about.
        .with_external_symlink_policy(ExternalSymlinkPolicy::Deny)
        // Every package is in the caches already (checked above): never built offline.
        .with_download_client(network::lazy_client(Network::Offline))
        .with_package_cache(plan.cache.clone())
        .with_installed_packages(plan.installed)
        .with_requested_specs(plan.requested)
        .install(plan.prefix, plan.desired)
        .await
        .map_err(|err| installer_failure(prefix, err))?;
    // Each link was judged by its own text; one that leaves only through another (`a -> ..`
    // and `b -> a/../x`) is found where the kernel resolves it.
    links::check(prefix).map_err(InstallFailure::Linked)?;
    Ok(result.transaction.operations.iter().map(operation).collect())
}

/// Refuses a prefix for `Create`/`Clone` unless it is absent or an empty directory.
pub fn require_new_prefix(prefix: &Path) -> Result<(), InstallFailure> {
    match std::fs::read_dir(prefix).map(|mut entries| entries.next().is_none()) {
        Ok(true) => Ok(()),
        Ok(false) => Err(InstallFailure::PrefixNotEmpty(prefix.display().to_string())),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(InstallFailure::PrefixNotWritable {
            prefix: prefix.display().to_string(),
            cause: err.to_string(),
        }),
    }
}

/// Puts one package into the cache: from its `file://` path, or downloaded (online only).
async fn prefetch(
    record: &RepoDataRecord,
    cache: &PackageCache,
    client: &LazyClient,
    network: Network,
) -> Result<(), InstallFailure> {
    let file = file_name(record);
    // What the caches hold already is read by rattler's lookup below: checked first (one
    // refused in the writable cache is taken out, to be fetched afresh).
    guard(record, cache, true)?;
    let fetched = fetch_one(record, cache, client, network).await?;
    // A fresh extraction is not read back by rattler until the next lookup: checked now, and
    // taken out of the cache when refused, so no later lookup reads it.
    if let Err(refused) = packages::check_metadata(&file, fetched.path()) {
        if let Err(err) = std::fs::remove_dir_all(fetched.path()) {
            eprintln!("runner-provisioner: the refused {file} could not be removed from the cache: {err}");
        }
        return Err(refused.into());
    }
    Ok(())
}

/// Puts one package into the cache, or finds it there.
async fn fetch_one(
    record: &RepoDataRecord,
    cache: &PackageCache,
    client: &LazyClient,
    network: Network,
) -> Result<rattler::package_cache::CacheMetadata, InstallFailure> {
    let file = file_name(record);
    let channel = inventory::package(record).channel;
    if record.url.scheme() == "file" {
        let path: PathBuf = record.url.to_file_path().unwrap_or_default();
        if let Err(err) = std::fs::metadata(&path) {
            // A clone's source channel need not be visible any more: the caches may hold it.
            return from_cache_only(record, cache).await.map_err(|_| InstallFailure::Unreadable {
                file,
                channel,
                cause: err.to_string(),
            });
        }
        return cache
            .get_or_fetch_from_path(&path, Some(&record.package_record), None)
            .await
            .map_err(|err| InstallFailure::Corrupt { file, channel, cause: error_chain(&err) });
    }
    if network == Network::Offline {
        return from_cache_only(record, cache).await.map_err(|_| InstallFailure::NotCached { file, channel });
    }
    cache
        .get_or_fetch_from_url_with_retry(
            &record.package_record,
            record.url.clone(),
            client.clone(),
            default_retry_policy(),
            None,
            None,
        )
        .await
        .map_err(|err| {
            let cause = error_chain(&err);
            if is_network_error(&err) {
                InstallFailure::Download { file, channel, cause }
            } else {
                InstallFailure::Corrupt { file, channel, cause }
            }
        })
}

/// Whether the caches hold `record` (its hash checked when it has one); nothing is fetched.
pub async fn cached(record: &RepoDataRecord, cache: &PackageCache) -> Result<(), InstallFailure> {
    guard(record, cache, false)?;
    from_cache_only(record, cache).await.map(drop).map_err(|_| InstallFailure::NotCached {
        file: file_name(record),
        channel: inventory::package(record).channel,
    })
}

/// Checks the metadata of `record` wherever a cache layer holds it ([`packages::check_metadata`]),
/// before rattler's lookup reads it through whatever links it holds: a package whose
/// `info/paths.json` leads to a pipe would otherwise hang the step, holding the cache's gate.
/// With `repair` (a fetch step, its cache writable), a refused copy that can be removed is
/// removed instead, so the lookup fetches the package afresh.
fn guard(record: &RepoDataRecord, cache: &PackageCache, repair: bool) -> Result<(), InstallFailure> {
    let name = cache_dir_name(&record.package_record);
    // A channel's repodata (or a record a pip step wrote) names the build unchecked: a name
    // that is not one path component (`0/../victim`) would be checked, and removed, outside
    // the cache layer. rattler refuses it later (GHSA-h672-p7h7-97v9); this is before that.
    if let Err(unsafe_name) = rattler_conda_types::utils::ensure_safe_path_component(&name) {
        return Err(InstallFailure::Corrupt {
            file: file_name(record),
            channel: inventory::package(record).channel,
            cause: unsafe_name.to_string(),
        });
    }
    for layer in cache.layers() {
        let dir = layer.path().join(&name);
        if std::fs::symlink_metadata(&dir).is_err() {
            continue;
        }
        match packages::check_metadata(&file_name(record), &dir) {
            Ok(()) => {}
            Err(_) if repair && std::fs::remove_dir_all(&dir).is_ok() => {}
            Err(refused) => return Err(refused.into()),
        }
    }
    Ok(())
}

/// The directory rattler's cache keeps a conda package in (`CacheKey::relative_path` for a
/// record, with no origin hash: the caches are made with `cache_origin` off).
fn cache_dir_name(record: &rattler_conda_types::PackageRecord) -> String {
    format!("{}-{}-{}", record.name.as_normalized(), record.version, record.build)
}

/// The package from the cache, or an error: the fetch closure is the "not cached" answer.
async fn from_cache_only(
    record: &RepoDataRecord,
    cache: &PackageCache,
) -> Result<rattler::package_cache::CacheMetadata, rattler::package_cache::PackageCacheError> {
    cache
        .get_or_fetch(
            &record.package_record,
            |_| async { Err::<Option<_>, _>(std::io::Error::other("not in the package cache")) },
            None,
        )
        .await
}

/// Whether a reqwest error sits anywhere in the chain (a download, not the archive, failed).
fn is_network_error(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(err) = next {
        if err.is::<reqwest::Error>() || err.is::<reqwest_middleware::Error>() {
            return true;
        }
        next = err.source();
    }
    false
}

fn installer_failure(prefix: &Path, err: InstallerError) -> InstallFailure {
    let prefix_text = prefix.display().to_string();
    match err {
        InstallerError::FailedToCreatePrefix(_, cause) => {
            InstallFailure::PrefixNotWritable { prefix: prefix_text, cause: cause.to_string() }
        }
        other => InstallFailure::Installer { prefix: prefix_text, cause: error_chain(&other) },
    }
}

fn operation<Old: OldRecord>(op: &TransactionOperation<Old, RepoDataRecord>) -> Operation {
    match op {
        TransactionOperation::Install(new) => {
            Operation { change: Change::Install, package: inventory::package(new), previous: None }
        }
        TransactionOperation::Change { old, new } => Operation {
            change: Change::Change,
            package: inventory::package(new),
            previous: Some(old.package()),
        },
        TransactionOperation::Reinstall { new, .. } => {
            Operation { change: Change::Reinstall, package: inventory::package(new), previous: None }
        }
        TransactionOperation::Remove(old) => {
            Operation { change: Change::Remove, package: old.package(), previous: None }
        }
    }
}

/// The installed side of a transaction, whichever record type rattler gives back.
trait OldRecord {
    fn package(&self) -> common::provision::Package;
}

impl OldRecord for InstallationResultRecord {
    fn package(&self) -> common::provision::Package {
        match self {
            InstallationResultRecord::Max(record) => inventory::package(&record.repodata_record),
            // Only when rattler read the prefix itself; it never does here (the installed
            // records are passed in), but a minimal record still names the package.
            InstallationResultRecord::Min(record) => common::provision::Package {
                name: record.name.as_normalized().to_string(),
                version: record.version.to_string(),
                build: record.build.to_string(),
                channel: String::new(),
                subdir: String::new(),
            },
        }
    }
}

/// The archive's file name, as the channel lists it.
pub fn file_name(record: &RepoDataRecord) -> String {
    record
        .url
        .path_segments()
        .and_then(|mut segments| segments.next_back())
        .map_or_else(|| record.url.to_string(), str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`guard`] looks where rattler's cache keeps a package: the same directory.
    #[tokio::test]
    async fn the_cache_directory_named_is_the_one_rattler_uses() {
        let dir = tempfile::tempdir().unwrap();
        let cache = PackageCache::new(dir.path());
        let record = rattler_conda_types::PackageRecord::new(
            rattler_conda_types::PackageName::new_unchecked("tiny-util"),
            "1.0.post1".parse::<rattler_conda_types::Version>().unwrap(),
            "py_0".parse().unwrap(),
        );
        let fetched = cache
            .get_or_fetch(
                &record,
                |destination: PathBuf| async move {
                    std::fs::create_dir_all(destination.join("info"))?;
                    Ok::<_, std::io::Error>(None)
                },
                None,
            )
            .await
            .unwrap();
        assert_eq!(fetched.path(), dir.path().join(cache_dir_name(&record)));
    }

    /// A build string that climbs out of the cache layer is refused before anything there
    /// is read or removed (a fetch step's repair would have removed the victim).
    #[test]
    fn a_record_naming_a_directory_outside_the_cache_is_refused_before_it_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let layer = dir.path().join("pkgs");
        let victim = dir.path().join("victim-1-0");
        std::fs::create_dir_all(victim.join("info")).unwrap();
        std::os::unix::fs::symlink("/proc/self/fd/1", victim.join("info/paths.json")).unwrap();
        // So that `pkgs/evil-1-0/../../victim-1-0` resolves to the victim.
        std::fs::create_dir_all(layer.join("evil-1-0")).unwrap();
        let cache = PackageCache::new(&layer);
        let record = rattler_conda_types::PackageRecord::new(
            rattler_conda_types::PackageName::new_unchecked("evil"),
            "1".parse::<rattler_conda_types::Version>().unwrap(),
            rattler_conda_types::package::BuildString::new_unchecked("0/../../victim-1-0"),
        );
        let record = RepoDataRecord {
            package_record: record,
            identifier: "evil-1-0.conda".parse().unwrap(),
            url: "file:///channel/noarch/evil-1-0.conda".parse().unwrap(),
            channel: Some("file:///channel".into()),
        };
        let refused = guard(&record, &cache, true).unwrap_err();
        assert!(refused.to_string().contains("path traversal"), "{refused}");
        assert!(victim.join("info/paths.json").symlink_metadata().is_ok(), "the victim was not removed");
    }
}
