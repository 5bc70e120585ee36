//! The object store's settings (issue #34): where replication sends (endpoint, bucket, prefix,
//! region), with what credentials, and the rule that plain http goes only to this machine
//! unless the operator says otherwise. Pure: parsed from a variable lookup and table-tested;
//! the secret is read at start-up ([`secret`]), never kept in the configuration.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

pub const ENDPOINT_VAR: &str = "SCIENCE_AGENT_REPLICA_ENDPOINT";
pub const BUCKET_VAR: &str = "SCIENCE_AGENT_REPLICA_BUCKET";
pub const PREFIX_VAR: &str = "SCIENCE_AGENT_REPLICA_PREFIX";
pub const REGION_VAR: &str = "SCIENCE_AGENT_REPLICA_REGION";
pub const ACCESS_KEY_ID_VAR: &str = "SCIENCE_AGENT_REPLICA_ACCESS_KEY_ID";
pub const SECRET_FILE_VAR: &str = "SCIENCE_AGENT_REPLICA_SECRET_ACCESS_KEY_FILE";
pub const ALLOW_HTTP_VAR: &str = "SCIENCE_AGENT_REPLICA_ALLOW_HTTP";
/// Not a key of the configuration file: a secret never goes there.
pub const SECRET_VAR: &str = "SCIENCE_AGENT_REPLICA_SECRET_ACCESS_KEY";
pub const NODE_URL_VAR: &str = "SCIENCE_AGENT_NODE_URL";

pub const DEFAULT_REGION: &str = "us-east-1";

/// Where and how to replicate; `None` in the configuration when no endpoint is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSettings {
    /// `http(s)://host[:port]`, without a trailing slash.
    pub endpoint: String,
    pub bucket: String,
    /// Empty, or ends with `/`.
    pub prefix: String,
    pub region: String,
    pub access_key_id: Option<String>,
    pub secret_access_key_file: Option<PathBuf>,
    pub allow_http: bool,
}

/// Why the replication settings are refused. Those [`from_vars`] and [`node_url`] answer leave
/// the setting's name to the configuration's error ([`SettingsError::variable`]), which names
/// the file's key when the value came from there; those [`secret`] answers name theirs.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("must be an http:// or https:// URL with a host and nothing after it, not {0:?}")]
    Endpoint(String),
    #[error(
        "plain http to {0}, which is not this machine: use https, or set replica_allow_http = true ({ALLOW_HTTP_VAR}) if the network path is trusted"
    )]
    PlainHttp(String),
    #[error("is required when the replica endpoint ({ENDPOINT_VAR}) is set")]
    NoBucket,
    #[error("must be 3 to 63 characters of lowercase letters, digits, '.' and '-', not {0:?}")]
    Bucket(String),
    #[error("must be segments of letters, digits, '.', '_' and '-' separated by '/', not {0:?}")]
    Prefix(String),
    #[error(
        "{ACCESS_KEY_ID_VAR} and a secret ({SECRET_FILE_VAR} or {SECRET_VAR}) go together: set both or neither"
    )]
    HalfCredentials,
    #[error("{SECRET_FILE_VAR}: cannot read {path}")]
    SecretFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("must be an http:// or https:// URL with a host and nothing after it, not {0:?}")]
    NodeUrl(String),
}

impl SettingsError {
    /// The variable the error is about (the configuration names it, or its file key).
    pub fn variable(&self) -> &'static str {
        match self {
            SettingsError::Endpoint(_) | SettingsError::PlainHttp(_) => ENDPOINT_VAR,
            SettingsError::NoBucket | SettingsError::Bucket(_) => BUCKET_VAR,
            SettingsError::Prefix(_) => PREFIX_VAR,
            SettingsError::HalfCredentials => ACCESS_KEY_ID_VAR,
            SettingsError::SecretFile { .. } => SECRET_FILE_VAR,
            SettingsError::NodeUrl(_) => NODE_URL_VAR,
        }
    }
}

fn truthy(text: &str) -> bool {
    matches!(text.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes")
}

/// The settings from `get` (an empty variable is unset): `None` when no endpoint is set.
/// Every variable is read whichever way it goes, so the configuration's key table and the
/// variables read stay one set.
pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<ReplicaSettings>, SettingsError> {
    let endpoint = get(ENDPOINT_VAR);
    let bucket = get(BUCKET_VAR);
    let prefix = get(PREFIX_VAR).unwrap_or_default();
    let region = get(REGION_VAR).unwrap_or_else(|| DEFAULT_REGION.to_owned());
    let access_key_id = get(ACCESS_KEY_ID_VAR);
    let secret_access_key_file = get(SECRET_FILE_VAR).map(PathBuf::from);
    let allow_http = get(ALLOW_HTTP_VAR).is_some_and(|v| truthy(&v));
    let Some(endpoint) = endpoint else { return Ok(None) };
    let endpoint = check_endpoint(&endpoint, allow_http)?;
    let bucket = check_bucket(bucket.as_deref().ok_or(SettingsError::NoBucket)?)?;
    Ok(Some(ReplicaSettings {
        endpoint,
        bucket,
        prefix: check_prefix(&prefix)?,
        region,
        access_key_id,
        secret_access_key_file,
        allow_http,
    }))
}

/// `(scheme, host)` of an `http(s)://host[:port][/]` URL; `None` for anything else (a
/// path, a query, user info, no host).
fn split_url(url: &str) -> Option<(&'static str, &str)> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("http://") {
        ("http", rest)
    } else {
        ("https", url.strip_prefix("https://")?)
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return None;
    }
    let host = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        host
    } else {
        match authority.split_once(':') {
            Some((host, port)) if is_port(port) => host,
            Some(_) => return None,
            None => authority,
        }
    };
    (!host.is_empty()).then_some((scheme, host))
}

fn is_port(text: &str) -> bool {
    !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `host` names this machine (a loopback address, or `localhost`).
pub fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The endpoint without a trailing slash; plain http only to loopback unless allowed.
pub fn check_endpoint(url: &str, allow_http: bool) -> Result<String, SettingsError> {
    let url = url.trim();
    let (scheme, host) = split_url(url).ok_or_else(|| SettingsError::Endpoint(url.to_owned()))?;
    if scheme == "http" && !allow_http && !is_loopback(host) {
        return Err(SettingsError::PlainHttp(host.to_owned()));
    }
    Ok(url.strip_suffix('/').unwrap_or(url).to_owned())
}

/// S3's bucket naming rules (the common subset every S3-compatible store accepts).
fn check_bucket(bucket: &str) -> Result<String, SettingsError> {
    let ok = (3..=63).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok { Ok(bucket.to_owned()) } else { Err(SettingsError::Bucket(bucket.to_owned())) }
}

/// The prefix as keys use it: empty, or its segments joined by `/` with one `/` after them.
fn check_prefix(prefix: &str) -> Result<String, SettingsError> {
    let trimmed = prefix.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    let segment_ok = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    };
    if trimmed.split('/').all(segment_ok) {
        Ok(format!("{trimmed}/"))
    } else {
        Err(SettingsError::Prefix(prefix.to_owned()))
    }
}

/// This node's URL for other nodes and the object store's head documents: the setting, or
/// `http://<host>:<port>` of the listener.
pub fn node_url(setting: Option<String>, host: &str, port: u16) -> Result<String, SettingsError> {
    match setting {
        Some(url) => {
            let url = url.trim();
            split_url(url).ok_or_else(|| SettingsError::NodeUrl(url.to_owned()))?;
            Ok(url.strip_suffix('/').unwrap_or(url).to_owned())
        }
        None if host.contains(':') => Ok(format!("http://[{host}]:{port}")),
        None => Ok(format!("http://{host}:{port}")),
    }
}

/// The credentials, read at start-up: `(key id, secret)`, or `None` for unsigned requests
/// (a store that allows anonymous access). The secret comes from its file, else from
/// [`SECRET_VAR`]; one without the other is refused.
pub fn secret(
    settings: &ReplicaSettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<(String, String)>, SettingsError> {
    let secret = match &settings.secret_access_key_file {
        Some(path) => Some(read_secret(path)?),
        None => env(SECRET_VAR).filter(|s| !s.is_empty()),
    };
    match (&settings.access_key_id, secret) {
        (Some(id), Some(secret)) => Ok(Some((id.clone(), secret))),
        (None, None) => Ok(None),
        _ => Err(SettingsError::HalfCredentials),
    }
}

fn read_secret(path: &Path) -> Result<String, SettingsError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| SettingsError::SecretFile { path: path.to_owned(), source: e })?;
    Ok(text.trim_end_matches(['\n', '\r']).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<ReplicaSettings>, String> {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        from_vars(|k| map.get(k).map(|v| v.to_string()).filter(|v| !v.is_empty())).map_err(|e| e.to_string())
    }

    fn text<T>(r: Result<T, SettingsError>) -> Result<T, String> {
        r.map_err(|e| e.to_string())
    }

    #[test]
    fn off_without_an_endpoint() {
        assert_eq!(parse(&[(BUCKET_VAR, "b")]), Ok(None));
    }

    #[test]
    fn endpoints() {
        let cases: &[(&str, bool, Result<&str, SettingsError>)] = &[
            ("http://127.0.0.1:8333", false, Ok("http://127.0.0.1:8333")),
            ("http://localhost:9000/", false, Ok("http://localhost:9000")),
            ("http://[::1]:9000", false, Ok("http://[::1]:9000")),
            ("https://s3.example.org", false, Ok("https://s3.example.org")),
            ("http://s3.example.org:80", false, Err(SettingsError::PlainHttp("s3.example.org".into()))),
            ("http://10.0.0.5:8333", true, Ok("http://10.0.0.5:8333")),
            ("ftp://x", false, Err(SettingsError::Endpoint("ftp://x".into()))),
            ("http://", false, Err(SettingsError::Endpoint("http://".into()))),
            ("http://h/path", false, Err(SettingsError::Endpoint("http://h/path".into()))),
            ("http://u@h", false, Err(SettingsError::Endpoint("http://u@h".into()))),
            ("http://h:port", false, Err(SettingsError::Endpoint("http://h:port".into()))),
        ];
        for (url, allow, want) in cases {
            let want = want.as_ref().map(|s| s.to_string()).map_err(|e| e.to_string());
            assert_eq!(text(check_endpoint(url, *allow)), want, "{url}");
        }
    }

    #[test]
    fn buckets_prefixes_and_defaults() {
        let s =
            parse(&[(ENDPOINT_VAR, "http://127.0.0.1:1"), (BUCKET_VAR, "runner-1"), (PREFIX_VAR, "/a/b/")])
                .unwrap()
                .unwrap();
        assert_eq!(
            (s.bucket.as_str(), s.prefix.as_str(), s.region.as_str()),
            ("runner-1", "a/b/", "us-east-1")
        );
        assert!(!s.allow_http);
        let cases: &[(&[(&str, &str)], SettingsError)] = &[
            (&[(ENDPOINT_VAR, "http://127.0.0.1:1")], SettingsError::NoBucket),
            (&[(ENDPOINT_VAR, "http://127.0.0.1:1"), (BUCKET_VAR, "Up")], SettingsError::Bucket("Up".into())),
            (
                &[(ENDPOINT_VAR, "http://127.0.0.1:1"), (BUCKET_VAR, "bkt"), (PREFIX_VAR, "a/../b")],
                SettingsError::Prefix("a/../b".into()),
            ),
        ];
        for (vars, want) in cases {
            assert_eq!(parse(vars), Err(want.to_string()), "{vars:?}");
        }
        assert_eq!(text(check_prefix("")), Ok(String::new()));
    }

    #[test]
    fn node_urls() {
        assert_eq!(node_url(None, "127.0.0.1", 4311).unwrap(), "http://127.0.0.1:4311");
        assert_eq!(node_url(None, "::1", 4311).unwrap(), "http://[::1]:4311");
        assert_eq!(node_url(Some("https://n1.example/".into()), "x", 1).unwrap(), "https://n1.example");
        assert_eq!(
            text(node_url(Some("n1".into()), "x", 1)),
            Err(SettingsError::NodeUrl("n1".into()).to_string())
        );
    }

    #[test]
    fn credentials_go_in_pairs() {
        let mut s = parse(&[(ENDPOINT_VAR, "http://127.0.0.1:1"), (BUCKET_VAR, "bkt")]).unwrap().unwrap();
        let half = Err(SettingsError::HalfCredentials.to_string());
        assert_eq!(text(secret(&s, |_| None)), Ok(None));
        assert_eq!(text(secret(&s, |_| Some("k".into()))), half);
        s.access_key_id = Some("id".into());
        assert_eq!(text(secret(&s, |_| None)), half);
        assert_eq!(
            text(secret(&s, |k| (k == SECRET_VAR).then(|| "k".into()))),
            Ok(Some(("id".into(), "k".into())))
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("secret");
        std::fs::write(&file, "from-file\n").unwrap();
        s.secret_access_key_file = Some(file);
        assert_eq!(text(secret(&s, |_| Some("env".into()))), Ok(Some(("id".into(), "from-file".into()))));
    }
}
