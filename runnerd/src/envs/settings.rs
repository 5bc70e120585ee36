//! The scientific environments' settings (contract §5.5 and issue #16): the original's
//! `SCIENTIFIC_ENVS`, channels and package cache, plus ours for the starters' package lists,
//! the provisioner's path and the CRAN mirror. Pure: a function of a variable lookup.

use std::path::PathBuf;

/// No `SCIENCE_AGENT_` prefix, as in the original.
pub(crate) const ENABLED_VAR: &str = "SCIENTIFIC_ENVS";
pub(crate) const CHANNELS_VAR: &str = "SCIENCE_AGENT_SCIENTIFIC_CHANNELS";
pub(crate) const PACKAGE_CACHE_VAR: &str = "SCIENCE_AGENT_PACKAGE_CACHE_DIR";
pub(crate) const STARTER_PYTHON_VAR: &str = "SCIENCE_AGENT_STARTER_PYTHON_SPECS";
pub(crate) const STARTER_R_VAR: &str = "SCIENCE_AGENT_STARTER_R_SPECS";
/// Ours: the `runner-provisioner` binary (default: next to runnerd).
pub(crate) const PROVISIONER_VAR: &str = "SCIENCE_AGENT_RUNNER_PROVISIONER_PATH";
pub(crate) const CRAN_VAR: &str = "SCIENCE_AGENT_CRAN_REPO";

/// The original's starter lists (internals §5.3).
pub(crate) const STARTER_PYTHON: &[&str] = &["python=3.12", "numpy=2.0", "pandas=2.2", "scipy=1.14", "matplotlib=3.9"];
pub(crate) const STARTER_R: &[&str] = &["r-base=4.4", "r-tidyverse=2.0", "r-data.table=1.16"];
pub(crate) const DEFAULT_CHANNEL: &str = "conda-forge";
pub(crate) const DEFAULT_CRAN: &str = "https://cloud.r-project.org";

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
}

fn list(text: Option<String>, default: &[&str]) -> Vec<String> {
    let items: Vec<String> = match text {
        Some(t) => t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect(),
        None => Vec::new(),
    };
    if items.is_empty() { default.iter().map(|s| (*s).to_owned()).collect() } else { items }
}

impl EnvSettings {
    /// `get` yields only non-empty values.
    pub(crate) fn from_vars(get: impl Fn(&str) -> Option<String>) -> EnvSettings {
        EnvSettings {
            enabled: get(ENABLED_VAR)
                .is_none_or(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes")),
            channels: list(get(CHANNELS_VAR), &[DEFAULT_CHANNEL]),
            package_cache_dir: get(PACKAGE_CACHE_VAR).map(PathBuf::from),
            starter_python: list(get(STARTER_PYTHON_VAR), STARTER_PYTHON),
            starter_r: list(get(STARTER_R_VAR), STARTER_R),
            provisioner: get(PROVISIONER_VAR).map(PathBuf::from),
            cran_repo: get(CRAN_VAR).unwrap_or_else(|| DEFAULT_CRAN.to_owned()),
        }
    }

    /// Offline-cache mode (the original adds `--offline`).
    pub(crate) fn offline(&self) -> bool {
        self.package_cache_dir.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> EnvSettings {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        EnvSettings::from_vars(|k| map.get(k).filter(|v| !v.is_empty()).map(|v| (*v).to_owned()))
    }

    #[test]
    fn defaults_are_the_originals() {
        let s = settings(&[]);
        assert!(s.enabled);
        assert_eq!(s.channels, ["conda-forge"]);
        assert_eq!(s.starter_python, STARTER_PYTHON);
        assert_eq!(s.starter_r, STARTER_R);
        assert!(!s.offline());
        assert_eq!(s.cran_repo, DEFAULT_CRAN);
    }

    #[test]
    fn enabled_only_for_the_originals_words() {
        for (value, on) in
            [("1", true), ("TRUE", true), ("Yes", true), ("0", false), ("false", false), ("on", false), (" 1", false)]
        {
            assert_eq!(settings(&[(ENABLED_VAR, value)]).enabled, on, "{value:?}");
        }
    }

    #[test]
    fn lists_are_comma_separated_trimmed_and_never_empty() {
        let s = settings(&[
            (CHANNELS_VAR, " file:///srv/ch , https://m.example/c,,"),
            (STARTER_PYTHON_VAR, "python=3.11,tinyutil"),
            (STARTER_R_VAR, " , "),
            (PACKAGE_CACHE_VAR, "/var/cache/pkgs"),
        ]);
        assert_eq!(s.channels, ["file:///srv/ch", "https://m.example/c"]);
        assert_eq!(s.starter_python, ["python=3.11", "tinyutil"]);
        assert_eq!(s.starter_r, STARTER_R);
        assert!(s.offline());
    }
}
