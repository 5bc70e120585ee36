//! What a request or the catalog may name (internals §5.1, §5.3): environment and revision
//! ids, environment names, package specs, conda channels and pip index URLs. Pure, so each
//! rule is a table; every error's text is the original's where the original has one, since
//! the routes answer them verbatim (400).
//!
//! Ids are checked twice in the original's sense: when the catalog is loaded and whenever a
//! path is built from one (`revisions/<envId>/<revId>`), so a tampered catalog can never
//! name a directory outside the store.
//!
//! One difference from the original: a package spec may not start with `-`. The original's
//! pattern admits `--pre` or `--no-deps`, which pip and micromamba would read as options;
//! no conda, PyPI or CRAN name starts with `-`, so nothing valid is refused.

use crate::versioning::new_uuid_v4;

/// Why an identifier, name, spec, channel or index URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// An environment or revision id outside the original's patterns.
    #[error("Environment metadata contains an unsafe identifier")]
    UnsafeIdentifier,
    #[error(
        "Environment name must be 1-80 characters: letters, digits, spaces, '.', '_' or '-', starting with a letter or digit"
    )]
    InvalidName,
    #[error("An environment named {0} already exists")]
    DuplicateName(String),
    #[error("At least one package is required")]
    NoPackages,
    #[error("Invalid package specification: {0}")]
    InvalidSpec(String),
    /// The refused channels, in request order, joined with `, `.
    #[error("Package channels are not allowed: {0}")]
    ChannelsNotAllowed(String),
    #[error("Package channel is neither a channel name nor an https://, http:// or file:// URL: {0}")]
    InvalidChannel(String),
    #[error("Package index URL must use HTTPS")]
    IndexNotHttps,
    #[error("Package manager must be conda, pip, cran or bioconductor: {0}")]
    UnknownManager(String),
}

/// Who installs an install request's packages (`manager`, default `conda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Manager {
    Conda,
    Pip,
    Cran,
    Bioconductor,
}

impl Manager {
    pub fn parse(text: &str) -> Result<Manager, IdError> {
        match text {
            "conda" => Ok(Manager::Conda),
            "pip" => Ok(Manager::Pip),
            "cran" => Ok(Manager::Cran),
            "bioconductor" => Ok(Manager::Bioconductor),
            other => Err(IdError::UnknownManager(other.to_owned())),
        }
    }

    /// As the request and `requestedChanges` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Manager::Conda => "conda",
            Manager::Pip => "pip",
            Manager::Cran => "cran",
            Manager::Bioconductor => "bioconductor",
        }
    }
}

/// The two starter environments (kind `starter`, read-only, undeletable).
pub const STARTER_PYTHON: &str = "starter-python";
pub const STARTER_R: &str = "starter-r";

/// The longest package spec accepted.
pub const MAX_SPEC_CHARS: usize = 160;
/// The longest environment name accepted.
pub const MAX_NAME_CHARS: usize = 80;

/// The configured channels' default (`SCIENCE_AGENT_SCIENTIFIC_CHANNELS` unset).
pub const DEFAULT_CHANNEL: &str = "conda-forge";

/// Where a bare channel name lives (`conda-forge` → `https://conda.anaconda.org/conda-forge`).
const ANACONDA_ORG: &str = "https://conda.anaconda.org";

/// conda-forge mirrors a request may name even when the operator configured only
/// `conda-forge`: the original's built-in presets (the tuna mirror is in its tests), plus
/// the other common university mirrors and conda-forge's own URL.
pub const PRESET_MIRRORS: [&str; 4] = [
    "https://conda.anaconda.org/conda-forge",
    "https://mirrors.tuna.tsinghua.edu.cn/anaconda/cloud/conda-forge",
    "https://mirrors.bfsu.edu.cn/anaconda/cloud/conda-forge",
    "https://mirrors.ustc.edu.cn/anaconda/cloud/conda-forge",
];

/// `^(?:starter-(?:python|r)|task-[a-f0-9-]+)$`.
pub fn check_env_id(id: &str) -> Result<(), IdError> {
    let ok =
        id == STARTER_PYTHON || id == STARTER_R || id.strip_prefix("task-").is_some_and(is_lower_hex_dashes);
    ok.then_some(()).ok_or(IdError::UnsafeIdentifier)
}

/// `^rev-[a-f0-9-]+$`.
pub fn check_revision_id(id: &str) -> Result<(), IdError> {
    id.strip_prefix("rev-").is_some_and(is_lower_hex_dashes).then_some(()).ok_or(IdError::UnsafeIdentifier)
}

/// `[a-f0-9-]+`.
fn is_lower_hex_dashes(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| matches!(b, b'a'..=b'f' | b'0'..=b'9' | b'-'))
}

/// A fresh task environment id: `task-<uuid v4>`.
pub fn new_task_env_id() -> String {
    format!("task-{}", new_uuid_v4())
}

/// A fresh revision id: `rev-<uuid v4>`.
pub fn new_revision_id() -> String {
    format!("rev-{}", new_uuid_v4())
}

/// 1–80 characters matching `^[a-zA-Z0-9][a-zA-Z0-9 ._-]*$`.
pub fn check_name(name: &str) -> Result<(), IdError> {
    let b = name.as_bytes();
    let ok = (1..=MAX_NAME_CHARS).contains(&b.len())
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b' ' | b'.' | b'_' | b'-'));
    ok.then_some(()).ok_or(IdError::InvalidName)
}

/// [`check_name`], and no name in `existing` equal to it ignoring ASCII case (names are
/// ASCII by the pattern, so ASCII folding is the whole of "case-insensitively").
pub fn check_new_name<'a>(name: &str, existing: impl IntoIterator<Item = &'a str>) -> Result<(), IdError> {
    check_name(name)?;
    match existing.into_iter().any(|other| other.eq_ignore_ascii_case(name)) {
        true => Err(IdError::DuplicateName(name.to_owned())),
        false => Ok(()),
    }
}

/// `^[a-zA-Z0-9_.:+-]+(?:[<>=!~][a-zA-Z0-9_.:+*!<>=~-]+)?$`, at most 160 characters, and
/// (ours) not starting with `-`.
///
/// The name's class has none of the operator characters, so the pattern splits at the first
/// character outside it: no backtracking is needed for an exact match.
pub fn check_spec(spec: &str) -> Result<(), IdError> {
    let name_char = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b':' | b'+' | b'-');
    let op_char = |c: u8| matches!(c, b'<' | b'>' | b'=' | b'!' | b'~');
    let constraint_char = |c: u8| name_char(c) || op_char(c) || c == b'*';
    let b = spec.as_bytes();
    let split = b.iter().position(|c| !name_char(*c)).unwrap_or(b.len());
    let (name, rest) = b.split_at(split);
    let ok = b.len() <= MAX_SPEC_CHARS
        && !name.is_empty()
        && name[0] != b'-'
        && match rest.split_first() {
            None => true,
            Some((op, constraint)) => {
                op_char(*op) && !constraint.is_empty() && constraint.iter().all(|c| constraint_char(*c))
            }
        };
    ok.then_some(()).ok_or_else(|| IdError::InvalidSpec(spec.to_owned()))
}

/// Every spec of an install or uninstall request; at least one.
pub fn check_specs<S: AsRef<str>>(specs: &[S]) -> Result<(), IdError> {
    if specs.is_empty() {
        return Err(IdError::NoPackages);
    }
    specs.iter().try_for_each(|s| check_spec(s.as_ref()))
}

/// A comma-separated spec list (`SCIENCE_AGENT_STARTER_PYTHON_SPECS`, `…_R_SPECS`):
/// entries trimmed, empty ones dropped, each checked; at least one.
pub fn parse_spec_list(text: &str) -> Result<Vec<String>, IdError> {
    let specs: Vec<String> =
        text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
    check_specs(&specs)?;
    Ok(specs)
}

/// The comma-separated `SCIENCE_AGENT_SCIENTIFIC_CHANNELS`: entries trimmed, empty ones
/// dropped, each a channel name or URL; none at all is [`DEFAULT_CHANNEL`].
pub fn parse_channel_list(text: &str) -> Result<Vec<String>, IdError> {
    let channels: Vec<String> =
        text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
    channels.iter().try_for_each(|c| channel_url(c).map(drop))?;
    match channels.is_empty() {
        true => Ok(vec![DEFAULT_CHANNEL.to_owned()]),
        false => Ok(channels),
    }
}

/// The channels of a conda install: the request's, or the configured ones when it names
/// none. A requested channel must be one of the configured ones or a preset mirror,
/// compared by URL (`conda-forge` is `https://conda.anaconda.org/conda-forge`, a trailing
/// `/` is no difference); otherwise every refused one is listed.
pub fn allowed_channels<S: AsRef<str>>(requested: &[S], configured: &[S]) -> Result<Vec<String>, IdError> {
    if requested.is_empty() {
        return Ok(configured.iter().map(|c| c.as_ref().to_owned()).collect());
    }
    let key = |c: &str| channel_url(c).unwrap_or_else(|_| c.to_owned());
    let allowed: Vec<String> =
        configured.iter().map(|c| key(c.as_ref())).chain(PRESET_MIRRORS.iter().map(|c| key(c))).collect();
    let refused: Vec<&str> =
        requested.iter().map(AsRef::as_ref).filter(|c| !allowed.contains(&key(c))).collect();
    match refused.is_empty() {
        true => Ok(requested.iter().map(|c| c.as_ref().to_owned()).collect()),
        false => Err(IdError::ChannelsNotAllowed(refused.join(", "))),
    }
}

/// The URL the provisioner is given for a channel: `https://`, `http://` and `file://`
/// URLs as they are (a trailing `/` trimmed), a name such as `conda-forge` or
/// `bioconda/label/dev` on anaconda.org.
pub fn channel_url(channel: &str) -> Result<String, IdError> {
    let invalid = || IdError::InvalidChannel(channel.to_owned());
    if channel.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid());
    }
    for scheme in ["https://", "http://", "file://"] {
        if let Some(rest) = channel.strip_prefix(scheme) {
            return match rest.trim_end_matches('/').is_empty() {
                true => Err(invalid()),
                false => Ok(channel.trim_end_matches('/').to_owned()),
            };
        }
    }
    let segment_ok = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
    };
    match channel.split('/').all(segment_ok) {
        true => Ok(format!("{ANACONDA_ORG}/{channel}")),
        false => Err(invalid()),
    }
}

/// A pip index URL: `https://` with a host, nothing that could split the argument.
pub fn check_index_url(url: &str) -> Result<(), IdError> {
    let host = url.get(..8).filter(|s| s.eq_ignore_ascii_case("https://")).map(|_| &url[8..]);
    let ok = host.is_some_and(|h| {
        !h.is_empty() && !h.starts_with('/') && !url.chars().any(|c| c.is_whitespace() || c.is_control())
    });
    ok.then_some(()).ok_or(IdError::IndexNotHttps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_and_revision_ids() {
        let envs: &[(&str, bool)] = &[
            ("starter-python", true),
            ("starter-r", true),
            ("task-0f9e8d7c-1234-4abc-8def-0123456789ab", true),
            ("task-abc", true),
            ("task-", false),
            ("task-ABC", false),
            ("task-../x", false),
            ("starter-julia", false),
            ("starter-python/..", false),
            ("Starter-python", false),
            ("", false),
            ("rev-abc", false),
        ];
        for (id, ok) in envs {
            assert_eq!(check_env_id(id).is_ok(), *ok, "{id}");
        }
        let revs: &[(&str, bool)] = &[
            ("rev-abc-123", true),
            ("rev-", false),
            ("rev-g", false),
            ("rev-a/b", false),
            ("task-a", false),
        ];
        for (id, ok) in revs {
            assert_eq!(check_revision_id(id).is_ok(), *ok, "{id}");
        }
        assert_eq!(
            check_env_id("../../etc").unwrap_err().to_string(),
            "Environment metadata contains an unsafe identifier"
        );
    }

    #[test]
    fn new_ids_match_their_own_patterns() {
        let (env, rev) = (new_task_env_id(), new_revision_id());
        check_env_id(&env).unwrap();
        check_revision_id(&rev).unwrap();
        assert_eq!(env.len(), "task-".len() + 36);
        assert_eq!(rev.len(), "rev-".len() + 36);
        assert_ne!(new_revision_id(), rev);
    }

    #[test]
    fn names() {
        let long = "a".repeat(80);
        let too_long = "a".repeat(81);
        let cases: &[(&str, bool)] = &[
            ("Single-cell 2024", true),
            ("a", true),
            ("9.x_y-z", true),
            (&long, true),
            (&too_long, false),
            ("", false),
            (" leading", false),
            ("-dash", false),
            ("slash/no", false),
            ("tab\tno", false),
            ("é", false),
        ];
        for (name, ok) in cases {
            assert_eq!(check_name(name).is_ok(), *ok, "{name:?}");
        }
        let existing = ["Genomics", "starter"];
        assert_eq!(
            check_new_name("genomics", existing).unwrap_err().to_string(),
            "An environment named genomics already exists"
        );
        check_new_name("genomics-2", existing).unwrap();
        assert_eq!(check_new_name("", existing), Err(IdError::InvalidName));
    }

    #[test]
    fn package_specs() {
        let long = format!("a{}", "b".repeat(159));
        let too_long = format!("a{}", "b".repeat(160));
        let cases: &[(&str, bool)] = &[
            ("numpy", true),
            ("scanpy=1.10", true),
            ("numpy>=2.0", true),
            ("numpy>=2,<3", false),
            ("python=3.12.*", true),
            ("pkg==1.0", true),
            ("pkg!=1.0", true),
            ("pkg~=1.4", true),
            ("r-base=4.4", true),
            ("conda-forge::numpy", true),
            ("cran:survival", true),
            ("a+b.c_d", true),
            ("pkg=", false),
            ("pkg>", false),
            ("=1.0", false),
            ("", false),
            ("--extra-index-url=", false),
            ("--extra-index-url=https://evil.example/simple", false),
            ("--pre", false),
            ("-e", false),
            ("pkg 1.0", false),
            ("pkg;rm", false),
            ("pkg[extra]", false),
            ("https://x.example/p.whl", false),
            ("pkg=1*", true),
            ("pkg=1\n", false),
            (&long, true),
            (&too_long, false),
        ];
        for (spec, ok) in cases {
            assert_eq!(check_spec(spec).is_ok(), *ok, "{spec:?}");
        }
        assert_eq!(
            check_specs(&["numpy", "--extra-index-url="]).unwrap_err().to_string(),
            "Invalid package specification: --extra-index-url="
        );
        assert_eq!(check_specs::<&str>(&[]), Err(IdError::NoPackages));
        check_specs(&["numpy", "pandas=2.2"]).unwrap();
    }

    #[test]
    fn channels_allowed() {
        let configured = ["conda-forge"];
        let ok: &[&[&str]] = &[
            &["conda-forge"],
            &["https://mirrors.tuna.tsinghua.edu.cn/anaconda/cloud/conda-forge"],
            &["https://mirrors.tuna.tsinghua.edu.cn/anaconda/cloud/conda-forge/"],
            &["https://conda.anaconda.org/conda-forge", "conda-forge"],
        ];
        for requested in ok {
            assert_eq!(allowed_channels(requested, &configured).unwrap(), *requested);
        }
        assert_eq!(allowed_channels(&[], &configured).unwrap(), ["conda-forge"]);
        assert_eq!(
            allowed_channels(&["https://attacker.example/conda"], &configured).unwrap_err().to_string(),
            "Package channels are not allowed: https://attacker.example/conda"
        );
        assert_eq!(
            allowed_channels(&["bioconda", "conda-forge", "file:///x"], &configured).unwrap_err().to_string(),
            "Package channels are not allowed: bioconda, file:///x"
        );
        let by_url = ["https://conda.anaconda.org/bioconda/"];
        assert_eq!(allowed_channels(&["bioconda"], &by_url).unwrap(), ["bioconda"]);
        assert!(allowed_channels(&["../bioconda"], &by_url).is_err());
        let local = ["file:///srv/channel", "http://127.0.0.1:8080/ch"];
        assert_eq!(
            allowed_channels(&["http://127.0.0.1:8080/ch/"], &local).unwrap(),
            ["http://127.0.0.1:8080/ch/"]
        );
    }

    #[test]
    fn channel_urls() {
        let cases: &[(&str, Option<&str>)] = &[
            ("conda-forge", Some("https://conda.anaconda.org/conda-forge")),
            ("bioconda/label/dev", Some("https://conda.anaconda.org/bioconda/label/dev")),
            ("https://mirror.example/cf/", Some("https://mirror.example/cf")),
            ("http://127.0.0.1:8080/ch", Some("http://127.0.0.1:8080/ch")),
            ("file:///srv/channel", Some("file:///srv/channel")),
            ("https://", None),
            ("ftp://x/y", None),
            ("../x", None),
            ("a//b", None),
            ("", None),
            ("conda forge", None),
        ];
        for (channel, want) in cases {
            assert_eq!(channel_url(channel).ok().as_deref(), *want, "{channel:?}");
        }
    }

    #[test]
    fn managers() {
        for m in [Manager::Conda, Manager::Pip, Manager::Cran, Manager::Bioconductor] {
            assert_eq!(Manager::parse(m.as_str()), Ok(m));
            assert_eq!(serde_json::to_value(m).unwrap(), m.as_str());
        }
        assert_eq!(
            Manager::parse("apt").unwrap_err().to_string(),
            "Package manager must be conda, pip, cran or bioconductor: apt"
        );
        assert!(Manager::parse("Conda").is_err());
    }

    #[test]
    fn configured_lists() {
        assert_eq!(parse_spec_list(" python=3.12 , numpy=2.0,,").unwrap(), ["python=3.12", "numpy=2.0"]);
        assert_eq!(parse_spec_list(" , "), Err(IdError::NoPackages));
        assert_eq!(parse_spec_list("numpy,--pre"), Err(IdError::InvalidSpec("--pre".into())));
        assert_eq!(parse_channel_list("").unwrap(), ["conda-forge"]);
        assert_eq!(
            parse_channel_list("file:///srv/ch, http://127.0.0.1:8000/ch").unwrap(),
            ["file:///srv/ch", "http://127.0.0.1:8000/ch"]
        );
        assert!(matches!(parse_channel_list("conda-forge,ftp://x"), Err(IdError::InvalidChannel(_))));
    }

    #[test]
    fn index_urls() {
        let cases: &[(&str, bool)] = &[
            ("https://pypi.org/simple", true),
            ("HTTPS://pypi.org/simple", true),
            ("https://mirrors.example/pypi/simple/", true),
            ("http://pypi.org/simple", false),
            ("https://", false),
            ("https:///path", false),
            ("file:///srv/wheels", false),
            ("https://pypi.org/simple --trusted-host x", false),
            ("pypi.org", false),
        ];
        for (url, ok) in cases {
            assert_eq!(check_index_url(url).is_ok(), *ok, "{url:?}");
        }
        assert_eq!(check_index_url("http://x").unwrap_err().to_string(), "Package index URL must use HTTPS");
    }
}
