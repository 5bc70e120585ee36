//! `conda-meta/history` in conda's own format, which rattler leaves empty: one entry appended
//! per change, and the requested specs read back from earlier entries.
//!
//! ```text
//! ==> 2026-12-01 22:00:00 <==
//! # cmd: runner-provisioner install
//! -file:///srv/channel::tinyutil-1.0-0
//! +file:///srv/channel::tinyutil-2.0-0
//! # update specs: ['tinyutil>=2']
//! ```
//!
//! The time is UTC (conda writes local time; the provisioner's sandbox has no time zone).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("conda-meta/history could not be read")]
    Read(#[source] std::io::Error),
    #[error("conda-meta/history could not be written")]
    Write(#[source] std::io::Error),
}

/// What the entry's last line records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Specs {
    /// `# update specs: [...]`: the specs this step asked for.
    Update(Vec<String>),
    /// `# remove specs: [...]`: the names this step removed.
    Remove(Vec<String>),
}

/// One appended entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub unix_secs: u64,
    /// The op, as in `# cmd: runner-provisioner <op>`.
    pub op: String,
    /// `channel::name-version-build` of each package removed (a change removes the old one).
    pub removed: Vec<String>,
    /// `channel::name-version-build` of each package linked.
    pub added: Vec<String>,
    pub specs: Specs,
}

/// The history file's text for `entry`.
pub fn format(entry: &Entry) -> String {
    let mut text =
        format!("==> {} <==\n# cmd: runner-provisioner {}\n", timestamp(entry.unix_secs), entry.op);
    for package in &entry.removed {
        text.push_str(&format!("-{package}\n"));
    }
    for package in &entry.added {
        text.push_str(&format!("+{package}\n"));
    }
    let (label, list) = match &entry.specs {
        Specs::Update(specs) => ("update", specs),
        Specs::Remove(names) => ("remove", names),
    };
    let quoted: Vec<String> = list.iter().map(|s| format!("'{s}'")).collect();
    text.push_str(&format!("# {label} specs: [{}]\n", quoted.join(", ")));
    text
}

/// Appends `entry` to `<prefix>/conda-meta/history`, creating it if rattler did not.
pub fn append(prefix: &Path, entry: &Entry) -> Result<(), HistoryError> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(prefix.join("conda-meta/history"))
        .map_err(HistoryError::Write)?;
    file.write_all(format(entry).as_bytes()).map_err(HistoryError::Write)
}

/// The prefix's history text, empty when there is none.
pub fn read(prefix: &Path) -> Result<String, HistoryError> {
    match std::fs::read_to_string(prefix.join("conda-meta/history")) {
        Ok(text) => Ok(text),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(err) => Err(HistoryError::Read(err)),
    }
}

/// The specs still requested after every entry of `history`, by package name: an update
/// replaces an earlier spec for the same name, a removal drops it.
pub fn requested_specs(history: &str) -> BTreeMap<String, String> {
    let mut specs = BTreeMap::new();
    for line in history.lines() {
        if let Some(list) = line.strip_prefix("# update specs:") {
            for spec in quoted_items(list) {
                specs.insert(spec_name(&spec).to_string(), spec);
            }
        } else if let Some(list) = line.strip_prefix("# remove specs:") {
            for spec in quoted_items(list) {
                specs.remove(spec_name(&spec));
            }
        }
    }
    specs
}

/// The package name at the front of a match spec or a `depends` entry (`numpy >=1.2`,
/// `python=3.12`, `conda-forge::scipy`).
pub fn spec_name(spec: &str) -> &str {
    let spec = spec.trim();
    let spec = spec.rsplit_once("::").map_or(spec, |(_, rest)| rest);
    let end = spec.find(|c: char| " <>=!~[".contains(c)).unwrap_or(spec.len());
    &spec[..end]
}

/// The quoted strings of a Python list literal (`['a', "b>=1,<2"]`): commas may sit inside.
fn quoted_items(list: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        if c == '\'' || c == '"' {
            let item: String = chars.by_ref().take_while(|&d| d != c).collect();
            if !item.is_empty() {
                items.push(item);
            }
        }
    }
    items
}

/// Seconds since the epoch now.
pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// `YYYY-MM-DD HH:MM:SS` (UTC), conda's history timestamp.
/// conda's `YYYY-MM-DD HH:MM:SS` (UTC): the ISO form the daemons write, reshaped.
fn timestamp(secs: u64) -> String {
    let iso = common::timefmt::iso8601(secs.saturating_mul(1000));
    format!("{} {}", &iso[..10], &iso[11..19])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        for (secs, text) in [
            (0, "1970-01-01 00:00:00"),
            (951_782_400, "2000-02-29 00:00:00"),
            (1_796_162_400, "2026-12-01 22:00:00"),
        ] {
            assert_eq!(timestamp(secs), text);
        }
    }

    #[test]
    fn format_entry() {
        let entry = Entry {
            unix_secs: 1_796_162_400,
            op: "install".into(),
            removed: vec!["file:///c::tinyutil-1.0-0".into()],
            added: vec!["file:///c::tinyutil-2.0-0".into(), "file:///c::tinylib-1.0-0".into()],
            specs: Specs::Update(vec!["tinyutil>=2".into(), "tinylib".into()]),
        };
        assert_eq!(
            format(&entry),
            "==> 2026-12-01 22:00:00 <==\n# cmd: runner-provisioner install\n\
             -file:///c::tinyutil-1.0-0\n+file:///c::tinyutil-2.0-0\n+file:///c::tinylib-1.0-0\n\
             # update specs: ['tinyutil>=2', 'tinylib']\n"
        );
        let removal = Entry { specs: Specs::Remove(vec!["tinylib".into()]), ..entry };
        assert!(format(&removal).ends_with("# remove specs: ['tinylib']\n"));
    }

    #[test]
    fn requested_specs_accumulate() {
        let history = "\
==> 2026-12-01 22:00:00 <==
# cmd: conda create
+c::a-1-0
# update specs: ['python=3.12', 'numpy>=1,<2']
==> 2026-12-01 22:01:00 <==
# update specs: [\"numpy>=2\", 'tinylib']
==> 2026-12-01 22:02:00 <==
# remove specs: ['tinylib']
";
        let specs: Vec<String> = requested_specs(history).into_values().collect();
        assert_eq!(specs, ["numpy>=2", "python=3.12"]);
        assert!(requested_specs("").is_empty());
        assert!(requested_specs("# update specs: []\n").is_empty());
    }

    #[test]
    fn spec_names() {
        for (spec, name) in [
            ("numpy", "numpy"),
            ("numpy >=1.2", "numpy"),
            ("python=3.12", "python"),
            ("conda-forge::scipy>=1", "scipy"),
            ("r-base[version='>=4']", "r-base"),
            ("pkg!=1", "pkg"),
        ] {
            assert_eq!(spec_name(spec), name, "{spec}");
        }
    }
}
