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
        let entry = from_cache_only(record, plan.cache).await.map_err(not_fetched)?;
        let name = file_name(record);
        total = total.saturating_add(packages::check(&name, entry.path())?);
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
    links::check(prefix)?;
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
    let channel = inventory::package(record).channel;
    if record.url.scheme() == "file" {
        let path: PathBuf = record.url.to_file_path().unwrap_or_default();
        if let Err(err) = std::fs::metadata(&path) {
            // A clone's source channel need not be visible any more: the caches may hold it.
            return from_cache_only(record, cache).await.map(drop).map_err(|_| InstallFailure::Unreadable {
                file,
                channel,
                cause: err.to_string(),
            });
        }
        return cache
            .get_or_fetch_from_path(&path, Some(&record.package_record), None)
            .await
            .map(drop)
            .map_err(|err| InstallFailure::Corrupt { file, channel, cause: error_chain(&err) });
    }
    if network == Network::Offline {
        return from_cache_only(record, cache)
            .await
            .map(drop)
            .map_err(|_| InstallFailure::NotCached { file, channel });
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
        .map(drop)
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
    from_cache_only(record, cache).await.map(drop).map_err(|_| InstallFailure::NotCached {
        file: file_name(record),
        channel: inventory::package(record).channel,
    })
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
