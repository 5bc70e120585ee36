//! The scientific environments' settings (contract §5.5 and issue #16): the original's
//! `SCIENTIFIC_ENVS`, channels and package cache, plus ours for the starters' package lists,
//! the provisioner's path and the CRAN mirror. Pure: a function of a variable lookup.

use std::path::PathBuf;

use super::catalog::Language;
use super::ids;
use crate::config::ConfigError;

/// No `SCIENCE_AGENT_` prefix, as in the original.
pub const ENABLED_VAR: &str = "SCIENTIFIC_ENVS";
pub const CHANNELS_VAR: &str = "SCIENCE_AGENT_SCIENTIFIC_CHANNELS";
pub const PACKAGE_CACHE_VAR: &str = "SCIENCE_AGENT_PACKAGE_CACHE_DIR";
pub const STARTER_PYTHON_VAR: &str = "SCIENCE_AGENT_STARTER_PYTHON_SPECS";
pub const STARTER_R_VAR: &str = "SCIENCE_AGENT_STARTER_R_SPECS";
/// Ours: the `runner-provisioner` binary (default: next to runnerd).
pub const PROVISIONER_VAR: &str = "SCIENCE_AGENT_RUNNER_PROVISIONER_PATH";
pub const CRAN_VAR: &str = "SCIENCE_AGENT_CRAN_REPO";
/// Ours: the largest file one provisioning step may write (`RLIMIT_FSIZE`; 0: none).
pub const STEP_MAX_FILE_VAR: &str = "SCIENCE_AGENT_ENV_STEP_MAX_FILE_BYTES";
/// Ours: the most a prefix may hold while and after a step writes it (0: no limit).
pub const STEP_MAX_PREFIX_VAR: &str = "SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES";
/// Ours: the most one conda fetch step may add to the shared package cache (0: no limit).
pub const STEP_MAX_FETCH_VAR: &str = "SCIENCE_AGENT_ENV_STEP_MAX_FETCH_BYTES";

/// The largest single files of real environments (CUDA libraries, torch's) take 1-3 GiB.
pub const DEFAULT_STEP_MAX_FILE_BYTES: u64 = 16 << 30;
/// A CUDA PyTorch environment takes 10-20 GiB; four times that is no real prefix.
pub const DEFAULT_STEP_MAX_PREFIX_BYTES: u64 = 64 << 30;
/// What one change fetches is what its link step then copies into a prefix: no more than a
/// prefix may hold.
pub const DEFAULT_STEP_MAX_FETCH_BYTES: u64 = DEFAULT_STEP_MAX_PREFIX_BYTES;

pub const DEFAULT_CRAN: &str = "https://cloud.r-project.org";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvSettings {
    /// `SCIENTIFIC_ENVS` matches `/^(1|true|yes)$/i`, or is unset.
    pub enabled: bool,
    /// Channel names or URLs, in priority order.
    pub channels: Vec<String>,
    /// Offline mode: packages come from this cache (and `file://` channels) only.
    pub package_cache_dir: Option<PathBuf>,
    pub starter_python: Vec<String>,
    pub starter_r: Vec<String>,
    pub provisioner: Option<PathBuf>,
    pub cran_repo: String,
    /// `RLIMIT_FSIZE` of every provisioning step (0: none).
    pub step_max_file_bytes: u64,
    /// The most bytes a prefix may hold while a step writes it and after (0: no limit).
    pub step_max_prefix_bytes: u64,
    /// The most bytes one conda fetch step may add to the shared package cache (0: no limit).
    pub step_max_fetch_bytes: u64,
}

/// A byte count variable, or its default when unset.
fn bytes(name: &str, text: Option<String>, default: u64) -> Result<u64, ConfigError> {
    match text {
        None => Ok(default),
        Some(t) => t.trim().parse().map_err(|_| ConfigError::Invalid {
            name: name.to_owned(),
            reason: format!("{t:?} is not a byte count (a whole number; 0: no limit)"),
        }),
    }
}

/// A list variable checked by `parse`, or its default when unset.
fn list(
    name: &str,
    text: Option<String>,
    parse: fn(&str) -> Result<Vec<String>, ids::IdError>,
    default: &[&str],
) -> Result<Vec<String>, ConfigError> {
    match text {
        None => Ok(default.iter().map(|s| (*s).to_owned()).collect()),
        Some(t) => {
            parse(&t).map_err(|e| ConfigError::Invalid { name: name.to_owned(), reason: e.to_string() })
        }
    }
}

impl EnvSettings {
    /// `get` yields only non-empty values.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<EnvSettings, ConfigError> {
        Ok(EnvSettings {
            enabled: get(ENABLED_VAR)
                .is_none_or(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes")),
            channels: list(
                CHANNELS_VAR,
                get(CHANNELS_VAR),
                ids::parse_channel_list,
                &[ids::DEFAULT_CHANNEL],
            )?,
            package_cache_dir: get(PACKAGE_CACHE_VAR).map(PathBuf::from),
            starter_python: list(
                STARTER_PYTHON_VAR,
                get(STARTER_PYTHON_VAR),
                ids::parse_spec_list,
                Language::Python.default_starter_specs(),
            )?,
            starter_r: list(
                STARTER_R_VAR,
                get(STARTER_R_VAR),
                ids::parse_spec_list,
                Language::R.default_starter_specs(),
            )?,
            provisioner: get(PROVISIONER_VAR).map(PathBuf::from),
            cran_repo: get(CRAN_VAR).unwrap_or_else(|| DEFAULT_CRAN.to_owned()),
            step_max_file_bytes: bytes(
                STEP_MAX_FILE_VAR,
                get(STEP_MAX_FILE_VAR),
                DEFAULT_STEP_MAX_FILE_BYTES,
            )?,
            step_max_prefix_bytes: bytes(
                STEP_MAX_PREFIX_VAR,
                get(STEP_MAX_PREFIX_VAR),
                DEFAULT_STEP_MAX_PREFIX_BYTES,
            )?,
            step_max_fetch_bytes: bytes(
                STEP_MAX_FETCH_VAR,
                get(STEP_MAX_FETCH_VAR),
                DEFAULT_STEP_MAX_FETCH_BYTES,
            )?,
        })
    }

    /// Offline-cache mode (the original adds `--offline`).
    pub fn offline(&self) -> bool {
        self.package_cache_dir.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> EnvSettings {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        EnvSettings::from_vars(|k| map.get(k).filter(|v| !v.is_empty()).map(|v| (*v).to_owned())).unwrap()
    }

    #[test]
    fn defaults_are_the_originals() {
        let s = settings(&[]);
        assert!(s.enabled);
        assert_eq!(s.channels, ["conda-forge"]);
        assert_eq!(s.starter_python, Language::Python.default_starter_specs());
        assert_eq!(s.starter_r, Language::R.default_starter_specs());
        assert!(!s.offline());
        assert_eq!(s.cran_repo, DEFAULT_CRAN);
        assert_eq!((s.step_max_file_bytes, s.step_max_prefix_bytes), (16 << 30, 64 << 30));
        assert_eq!(s.step_max_fetch_bytes, 64 << 30);
    }

    #[test]
    fn step_limits_are_byte_counts() {
        let s = settings(&[
            (STEP_MAX_FILE_VAR, "1048576"),
            (STEP_MAX_PREFIX_VAR, "0"),
            (STEP_MAX_FETCH_VAR, "4096"),
        ]);
        assert_eq!(
            (s.step_max_file_bytes, s.step_max_prefix_bytes, s.step_max_fetch_bytes),
            (1 << 20, 0, 4096)
        );
        for var in [STEP_MAX_PREFIX_VAR, STEP_MAX_FETCH_VAR] {
            for value in ["1G", "-1", "lots"] {
                let err = EnvSettings::from_vars(|k| (k == var).then(|| value.to_owned())).unwrap_err();
                assert!(err.to_string().contains("is not a byte count"), "{var}={value}: {err}");
            }
        }
    }

    #[test]
    fn enabled_only_for_the_originals_words() {
        for (value, on) in [
            ("1", true),
            ("TRUE", true),
            ("Yes", true),
            ("0", false),
            ("false", false),
            ("on", false),
            (" 1", false),
        ] {
            assert_eq!(settings(&[(ENABLED_VAR, value)]).enabled, on, "{value:?}");
        }
    }

    #[test]
    fn lists_are_comma_separated_trimmed_and_checked() {
        let s = settings(&[
            (CHANNELS_VAR, " file:///srv/ch , https://m.example/c,,"),
            (STARTER_PYTHON_VAR, "python=3.11,tinyutil"),
            (PACKAGE_CACHE_VAR, "/var/cache/pkgs"),
        ]);
        assert_eq!(s.channels, ["file:///srv/ch", "https://m.example/c"]);
        assert_eq!(s.starter_python, ["python=3.11", "tinyutil"]);
        assert!(s.offline());
        for (var, value, want) in [
            (STARTER_R_VAR, " , ", "SCIENCE_AGENT_STARTER_R_SPECS: At least one package is required"),
            (STARTER_PYTHON_VAR, "numpy,--pre", "Invalid package specification: --pre"),
            (CHANNELS_VAR, "ftp://x", "neither a channel name nor"),
        ] {
            let err = EnvSettings::from_vars(|k| (k == var).then(|| value.to_owned())).unwrap_err();
            assert!(err.to_string().contains(want), "{var}={value:?}: {err}");
        }
    }
}
