//! The request's channels read into repodata: a rattler gateway over `file://`, `http://` and
//! `https://` channels, in the request's (priority) order, for the host's subdir and `noarch`.
//!
//! Offline, every channel is read with `ForceCacheOnly`: `file://` channels are read from disk
//! as always, remote ones only from the repodata cache, and the gateway's client is never
//! built.

use std::collections::HashMap;
use std::path::Path;

use rattler_cache::package_cache::PackageCache;
use rattler_conda_types::{Channel, MatchSpec, Subdir};
use rattler_repodata_gateway::fetch::CacheAction;
use rattler_repodata_gateway::{ChannelConfig, Gateway, GatewayError, RepoData, SourceConfig};
use url::Url;

use crate::error_chain;
use crate::network::{self, Network};

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("Channel {0} is not a valid channel URL")]
    InvalidUrl(String, #[source] url::ParseError),
    #[error("Channel {0} is not supported: only https://, http:// and file:// channels are")]
    UnsupportedScheme(String),
    #[error("No channel was given")]
    NoChannels,
    /// The message carries the cause itself: the operator reads one line.
    #[error("Channel {url} could not be read: {cause}")]
    Unreadable { url: String, cause: String },
    #[error("The channels could not be read: {0}")]
    Query(String),
    #[error("this host is not a conda platform")]
    UnknownPlatform,
}

/// One channel of the request: the URL as given (for messages) and rattler's channel.
#[derive(Debug, Clone)]
pub struct Source {
    pub url: String,
    pub channel: Channel,
}

/// Checks and converts the request's channel URLs, keeping their order.
pub fn parse(urls: &[String]) -> Result<Vec<Source>, ChannelError> {
    urls.iter()
        .map(|text| {
            let url = Url::parse(text).map_err(|err| ChannelError::InvalidUrl(text.clone(), err))?;
            if !matches!(url.scheme(), "https" | "http" | "file") {
                return Err(ChannelError::UnsupportedScheme(text.clone()));
            }
            Ok(Source { url: text.clone(), channel: Channel::from_url(url) })
        })
        .collect()
}

/// The gateway: repodata cached under `repodata_cache`, extracted packages in `packages`.
pub fn gateway(repodata_cache: &Path, packages: PackageCache, network: Network) -> Gateway {
    let cache_action = match network {
        Network::Online => CacheAction::CacheOrFetch,
        Network::Offline => CacheAction::ForceCacheOnly,
    };
    Gateway::builder()
        .with_client(network::lazy_client(network))
        .with_cache_dir(repodata_cache)
        .with_package_cache(packages)
        .with_channel_config(ChannelConfig {
            default: SourceConfig { cache_action, ..SourceConfig::default() },
            per_channel: HashMap::new(),
        })
        .finish()
}

/// Copies the regular files of `from` (an operator's repodata cache; absent is fine) into
/// `into` where `into` has no file of that name; links and anything else are skipped.
pub fn seed_repodata(into: &Path, from: &Path) -> std::io::Result<()> {
    let entries = match std::fs::read_dir(from) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
    };
    std::fs::create_dir_all(into)?;
    for entry in entries {
        let entry = entry?;
        let target = into.join(entry.file_name());
        if entry.file_type()?.is_file() && std::fs::symlink_metadata(&target).is_err() {
            std::fs::copy(entry.path(), &target)?;
            // `copy` keeps the operator's mode (read-only, perhaps); the gateway updates
            // what it owns.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644))?;
        }
    }
    Ok(())
}

/// The subdirs every query reads: the host's and `noarch`.
pub fn subdirs() -> Result<[Subdir; 2], ChannelError> {
    Ok([Subdir::current().ok_or(ChannelError::UnknownPlatform)?, Subdir::NoArch])
}

/// Repodata for `specs` and everything they depend on, one bucket per channel and subdir in
/// priority order. On failure the channel at fault is named: each is read alone to find it.
pub async fn query(
    gateway: &Gateway,
    sources: &[Source],
    specs: Vec<MatchSpec>,
) -> Result<Vec<RepoData>, ChannelError> {
    if sources.is_empty() {
        return Err(ChannelError::NoChannels);
    }
    let subdirs = subdirs()?;
    let channels: Vec<Channel> = sources.iter().map(|s| s.channel.clone()).collect();
    let result = gateway.query(channels, subdirs, specs.clone()).recursive(true).execute().await;
    match result {
        Ok(output) => Ok(output.repodata),
        Err(err) => Err(culprit(gateway, sources, specs, err).await),
    }
}

async fn culprit(
    gateway: &Gateway,
    sources: &[Source],
    specs: Vec<MatchSpec>,
    err: GatewayError,
) -> ChannelError {
    let Ok(subdirs) = subdirs() else { return ChannelError::UnknownPlatform };
    for source in sources {
        let alone =
            gateway.query([source.channel.clone()], subdirs, specs.clone()).recursive(false).execute().await;
        if let Err(cause) = alone {
            return ChannelError::Unreadable { url: source.url.clone(), cause: error_chain(&cause) };
        }
    }
    ChannelError::Query(error_chain(&err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let ok = ["https://conda.anaconda.org/conda-forge", "http://127.0.0.1:1/c", "file:///srv/c"];
        let sources = parse(&ok.map(String::from)).expect("valid");
        assert_eq!(sources.len(), 3);
        assert_eq!(sources[2].url, "file:///srv/c");
        for (bad, message) in [
            ("conda-forge", "Channel conda-forge is not a valid channel URL"),
            (
                "ftp://x/y",
                "Channel ftp://x/y is not supported: only https://, http:// and file:// channels are",
            ),
        ] {
            let err = parse(&[bad.to_string()]).expect_err(bad);
            assert_eq!(err.to_string(), message);
        }
    }
}
