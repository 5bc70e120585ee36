//! A daemon's configuration file (issue 6, part 3): TOML, one top-level key per
//! `SCIENCE_AGENT_*` variable, turned into the same variable lookup that the daemons' pure
//! parsers already read, while remembering where each value came from. Variables override
//! the file; the file overrides the defaults.
//!
//! * [`FileChoice`]: which file (`--config`, a variable, or the daemon's default path).
//! * [`ConfigFile::parse`]: the pure part: text to values, with every rule about keys and
//!   types (unknown keys with a suggestion, refused keys, type errors), each error naming the
//!   key and the file.
//! * [`Layered`]: environment over file, the lookup the daemons use, and the origin of each
//!   value, so that a validation error about a variable is rewritten to name the key and the
//!   file when that is where the value came from.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use toml::de::{DeTable, DeValue};

/// JavaScript's `Number.MAX_SAFE_INTEGER`: the original validates "safe integers".
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// A non-negative safe integer in decimal, like the original's parser accepts.
pub fn parse_non_negative(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse::<u64>().ok().filter(|v| *v <= MAX_SAFE_INTEGER)
}

/// What a key accepts in the file. Each value is stringified exactly as the variable would
/// be written, and the daemon's parser then validates it as it validates the variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A string (a path, a host name, a level).
    Text,
    /// A TOML integer, or a string (of digits, which the daemon checks).
    Integer,
    /// A TOML boolean, or one of the strings the variables accept.
    Bool,
    /// A user or group: a name (string) or a number (integer).
    Name,
    /// An array of strings (or one comma-separated string), joined with commas.
    List,
}

impl Kind {
    fn expected(self) -> &'static str {
        match self {
            Kind::Text => "a string",
            Kind::Integer => "an integer (or a string of digits)",
            Kind::Bool => "true or false",
            Kind::Name => "a name (string) or a number (integer)",
            Kind::List => "an array of strings",
        }
    }
}

/// One setting: its key in the file and the variable it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub name: &'static str,
    pub var: &'static str,
    pub kind: Kind,
}

impl Key {
    /// For the daemons' static key tables.
    pub const fn new(name: &'static str, var: &'static str, kind: Kind) -> Key {
        Key { name, var, kind }
    }
}

/// A daemon's settings.
#[derive(Debug)]
pub struct Schema {
    /// The daemon, for messages.
    pub daemon: &'static str,
    pub keys: &'static [Key],
    /// Keys refused outright, with what to do instead (a secret never goes in the file).
    pub refused: &'static [(&'static str, &'static str)],
}

impl Schema {
    pub fn key(&self, name: &str) -> Option<&'static Key> {
        self.keys.iter().find(|k| k.name == name)
    }

    pub fn key_for_var(&self, var: &str) -> Option<&'static Key> {
        self.keys.iter().find(|k| k.var == var)
    }

    /// The known key closest to `unknown`: the same key spelled as its variable, with
    /// dashes, or in another case; else the nearest by edit distance, when near enough.
    pub fn suggest(&self, unknown: &str) -> Option<&'static str> {
        let norm = unknown.trim().to_ascii_lowercase().replace('-', "_");
        if let Some(k) = self.keys.iter().find(|k| k.name == norm || k.var.eq_ignore_ascii_case(&norm)) {
            return Some(k.name);
        }
        self.keys
            .iter()
            .map(|k| (edit_distance(&norm, k.name), k.name))
            .filter(|(d, name)| *d <= (name.len() / 3).max(2))
            .min()
            .map(|(_, name)| name)
    }

    fn refusal(&self, key: &str) -> Option<&'static str> {
        let norm = key.trim().to_ascii_lowercase().replace('-', "_");
        self.refused
            .iter()
            .find(|(name, _)| *name == norm || format!("science_agent_{name}") == norm)
            .map(|(_, advice)| *advice)
    }
}

/// Levenshtein distance over bytes (keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1).min(row[j] + 1).min(diagonal + usize::from(ca != cb));
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Which configuration file a daemon reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileChoice {
    /// The daemon's default path: a missing file means defaults.
    Default(PathBuf),
    /// Named by a flag or a variable (`named_by`): a missing file is an error.
    Explicit { path: PathBuf, named_by: String },
}

impl FileChoice {
    /// `--config` (`flag`) over the variable `var_name` over `default`.
    pub fn choose(
        flag: Option<&Path>,
        var_name: &str,
        var: impl Fn(&str) -> Option<String>,
        default: &str,
    ) -> FileChoice {
        if let Some(path) = flag {
            return FileChoice::Explicit { path: path.to_owned(), named_by: "--config".to_owned() };
        }
        match var(var_name).filter(|v| !v.trim().is_empty()) {
            Some(path) => FileChoice::Explicit { path: path.into(), named_by: var_name.to_owned() },
            None => FileChoice::Default(default.into()),
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            FileChoice::Default(path) | FileChoice::Explicit { path, .. } => path,
        }
    }
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File {
        path: PathBuf,
        line: usize,
    },
    /// The variable that set it.
    Environment(String),
    /// The command-line flag that set it.
    Flag(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("default"),
            Origin::File { path, line } => write!(f, "file {}:{line}", path.display()),
            Origin::Environment(var) => write!(f, "environment {var}"),
            Origin::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("the configuration file {path} (named by {named_by}) does not exist")]
    Missing { path: PathBuf, named_by: String },
    #[error("could not read the configuration file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the configuration file {path} is not valid TOML")]
    Syntax {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("unknown key {key} in {path}:{line}{}", suggestion_text(.suggestion))]
    Unknown { key: String, path: PathBuf, line: usize, suggestion: Option<&'static str> },
    #[error(
        "[{key}] in {path}:{line}: {daemon}'s settings are top-level keys, without [sections]{}",
        suggestion_text(.suggestion)
    )]
    Section {
        daemon: &'static str,
        key: String,
        path: PathBuf,
        line: usize,
        suggestion: Option<&'static str>,
    },
    #[error("{key} in {path}:{line} is not accepted: {advice}")]
    Refused { key: String, path: PathBuf, line: usize, advice: &'static str },
    #[error("{key} in {path}:{line} must be {expected}, not {found}")]
    Type { key: &'static str, path: PathBuf, line: usize, expected: &'static str, found: String },
}

fn suggestion_text(suggestion: &Option<&'static str>) -> String {
    suggestion.map(|s| format!(" (did you mean {s}?)")).unwrap_or_default()
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FileValue {
    text: String,
    line: usize,
}

/// A parsed configuration file: the variable each key stands for, and its value as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    path: PathBuf,
    values: BTreeMap<&'static str, FileValue>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|b| **b == b'\n').count() + 1
}

fn describe_value(value: &DeValue<'_>) -> String {
    match value {
        DeValue::String(s) => format!("the string {s:?}"),
        DeValue::Integer(i) => format!("the integer {i}"),
        DeValue::Float(x) => format!("the number {x}"),
        DeValue::Boolean(b) => format!("the boolean {b}"),
        DeValue::Datetime(d) => format!("the date {d}"),
        DeValue::Array(_) => "an array".to_owned(),
        DeValue::Table(_) => "a table".to_owned(),
    }
}

/// A TOML integer in decimal (TOML also allows `0x`, `0o`, `0b` and `_` separators).
fn integer_text(value: &toml::de::DeInteger<'_>) -> Option<String> {
    let digits = value.as_str().replace('_', "");
    i128::from_str_radix(&digits, value.radix()).ok().map(|n| n.to_string())
}

/// The strings a boolean variable is written with (`SCIENCE_AGENT_NPU_BROKER=yes`).
const BOOL_WORDS: &[&str] = &["1", "true", "yes", "0", "false", "no"];

impl ConfigFile {
    /// Parses `text`, the contents of `path`. Pure: the rules are table-tested.
    pub fn parse(schema: &Schema, path: &Path, text: &str) -> Result<ConfigFile, SettingsError> {
        let table = DeTable::parse(text)
            .map_err(|e| SettingsError::Syntax { path: path.to_owned(), source: Box::new(e) })?;
        let mut entries: Vec<_> = table.get_ref().iter().collect();
        entries.sort_by_key(|(k, _)| k.span().start);
        let mut values = BTreeMap::new();
        for (key, value) in entries {
            let name: &str = key.get_ref();
            let line = line_of(text, key.span().start);
            let Some(spec) = schema.key(name) else {
                if let Some(advice) = schema.refusal(name) {
                    return Err(SettingsError::Refused {
                        key: name.to_owned(),
                        path: path.to_owned(),
                        line,
                        advice,
                    });
                }
                let suggestion = schema.suggest(name);
                return Err(match value.get_ref() {
                    DeValue::Table(_) => SettingsError::Section {
                        daemon: schema.daemon,
                        key: name.to_owned(),
                        path: path.to_owned(),
                        line,
                        suggestion,
                    },
                    _ => SettingsError::Unknown {
                        key: name.to_owned(),
                        path: path.to_owned(),
                        line,
                        suggestion,
                    },
                });
            };
            let type_error = || SettingsError::Type {
                key: spec.name,
                path: path.to_owned(),
                line,
                expected: spec.kind.expected(),
                found: describe_value(value.get_ref()),
            };
            let text = match (spec.kind, value.get_ref()) {
                (_, DeValue::String(s)) if s.trim().is_empty() => continue,
                (Kind::Bool, DeValue::String(s)) => {
                    if !BOOL_WORDS.contains(&s.trim().to_ascii_lowercase().as_str()) {
                        return Err(type_error());
                    }
                    s.to_string()
                }
                (_, DeValue::String(s)) => s.to_string(),
                (Kind::Integer | Kind::Name, DeValue::Integer(i)) => {
                    integer_text(i).ok_or_else(type_error)?
                }
                (Kind::Bool, DeValue::Boolean(b)) => b.to_string(),
                (Kind::List, DeValue::Array(items)) => {
                    let mut parts = Vec::new();
                    for item in items.iter() {
                        match item.get_ref() {
                            DeValue::String(s) => parts.push(s.trim().to_owned()),
                            _ => return Err(type_error()),
                        }
                    }
                    if parts.is_empty() {
                        continue;
                    }
                    parts.join(",")
                }
                _ => return Err(type_error()),
            };
            values.insert(spec.var, FileValue { text, line });
        }
        Ok(ConfigFile { path: path.to_owned(), values })
    }

    /// Reads the chosen file; `None` when the default file does not exist.
    pub fn load(schema: &Schema, choice: &FileChoice) -> Result<Option<ConfigFile>, SettingsError> {
        let path = choice.path();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return match choice {
                    FileChoice::Default(_) => Ok(None),
                    FileChoice::Explicit { path, named_by } => {
                        Err(SettingsError::Missing { path: path.clone(), named_by: named_by.clone() })
                    }
                };
            }
            Err(source) => return Err(SettingsError::Read { path: path.to_owned(), source }),
        };
        ConfigFile::parse(schema, path, &text).map(Some)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The value the file gives the variable `var`.
    pub fn get(&self, var: &str) -> Option<&str> {
        self.values.get(var).map(|v| v.text.as_str())
    }

    /// The line that sets `var`.
    pub fn line(&self, var: &str) -> Option<usize> {
        self.values.get(var).map(|v| v.line)
    }
}

type Lookup = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The environment over the file: what the daemons' parsers read.
pub struct Layered {
    schema: &'static Schema,
    choice: FileChoice,
    file: Option<ConfigFile>,
    env: Lookup,
}

impl fmt::Debug for Layered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Layered")
            .field("daemon", &self.schema.daemon)
            .field("choice", &self.choice)
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

impl Layered {
    pub fn new(
        schema: &'static Schema,
        choice: FileChoice,
        file: Option<ConfigFile>,
        env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Layered {
        Layered { schema, choice, file, env: Box::new(env) }
    }

    /// Reads the chosen file (if any) under the environment `env`.
    pub fn load(
        schema: &'static Schema,
        choice: FileChoice,
        env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Layered, SettingsError> {
        let file = ConfigFile::load(schema, &choice)?;
        Ok(Layered::new(schema, choice, file, env))
    }

    fn env_value(&self, var: &str) -> Option<String> {
        (self.env)(var).filter(|v| !v.trim().is_empty())
    }

    /// The value of `var`: the environment's (unless empty), else the file's. Variables that
    /// are no key of the file (`CREDENTIALS_DIRECTORY`, `RUNTIME_DIRECTORY`) pass through.
    pub fn var(&self, var: &str) -> Option<String> {
        self.env_value(var).or_else(|| self.file.as_ref()?.get(var).map(str::to_owned))
    }

    /// Where the value of `var` came from.
    pub fn origin(&self, var: &str) -> Origin {
        if self.env_value(var).is_some() {
            return Origin::Environment(var.to_owned());
        }
        match self.file.as_ref().and_then(|f| Some((f.path(), f.line(var)?))) {
            Some((path, line)) => Origin::File { path: path.to_owned(), line },
            None => Origin::Default,
        }
    }

    /// How an error message names the setting `var`: the variable when the value came from
    /// the environment (or nowhere), `key in FILE:LINE` when it came from the file.
    pub fn describe(&self, var: &str) -> String {
        match (self.origin(var), self.schema.key_for_var(var)) {
            (Origin::File { path, line }, Some(key)) => format!("{} in {}:{line}", key.name, path.display()),
            _ => var.to_owned(),
        }
    }

    pub fn schema(&self) -> &'static Schema {
        self.schema
    }

    pub fn choice(&self) -> &FileChoice {
        &self.choice
    }

    /// The file read; `None` when the default file does not exist.
    pub fn file(&self) -> Option<&ConfigFile> {
        self.file.as_ref()
    }

    /// One line about the file, for `--check-config` and the start-up log.
    pub fn file_status(&self) -> String {
        match (&self.file, &self.choice) {
            (Some(f), _) => format!("{} ({} settings)", f.path().display(), f.values.len()),
            (None, choice) => format!("{} (absent: defaults apply)", choice.path().display()),
        }
    }
}

/// One row of `--check-config`'s report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub key: String,
    pub value: String,
    pub origin: String,
}

impl Row {
    pub fn new(key: impl Into<String>, value: impl Into<String>, origin: impl fmt::Display) -> Row {
        Row { key: key.into(), value: value.into(), origin: origin.to_string() }
    }
}

/// Rows as an aligned table: `key  value  origin`.
pub fn render(rows: &[Row]) -> String {
    let key_width = rows.iter().map(|r| r.key.len()).max().unwrap_or(0);
    let value_width = rows.iter().map(|r| r.value.chars().count()).max().unwrap_or(0).min(48);
    let mut out = String::new();
    for r in rows {
        let line = format!("  {:key_width$}  {:value_width$}  {}", r.key, r.value, r.origin);
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests;
