//! The start-up scaffold of the three daemons (runnerd, egressd, npu-brokerd): one command
//! line grammar, one configuration loading error, one `run()`.
//!
//! Each daemon used to carry its own copy of these, and the copies had drifted only where
//! nobody looked (which exit status a bad flag value gets, whether `--config=` is "missing"
//! or "empty"). What stays different is spelt out as data: the [`Grammar`] a daemon parses
//! (runnerd's sub-commands, the helpers' setting flags, how a blank value is reported) and
//! the [`Daemon`] hooks it fills in (loading, what start-up checks, serving).
//!
//! The order every daemon follows, in [`run`]:
//! 1. the command line ([`parse_args`]); a bad one exits 2;
//! 2. `--help` and `--version` answer and exit 0, before any file or variable is read;
//! 3. the settings: flags over variables over the configuration file over the defaults
//!    ([`layered`]); a bad one exits 1 (2 when the command line is to blame, [`Usage`]);
//! 4. what start-up validates before it touches anything ([`Daemon::prepare`]);
//! 5. `--check-config` prints the report ([`Daemon::check`]) and exits 0, or 1;
//! 6. logging to journald or stderr ([`crate::audit::init_with`]), then [`Daemon::serve`].

use std::fmt::Display;
use std::path::{Path, PathBuf};

use crate::audit::{self, LogError, LogSettings, Sink};
use crate::settings::{FileChoice, Layered, Schema, SettingsError};

/// What the command line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Serve,
    CheckConfig,
    Help,
    Version,
}

/// `(key in the configuration file, flag, variable)` of a setting that has a flag.
pub type Setting = (&'static str, &'static str, &'static str);

/// How a blank value (`--flag=`, `--flag ""`, a value of spaces) is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blank {
    /// A value of only whitespace is [`ArgError::MissingValue`] (npu-brokerd).
    Missing,
    /// A value of only whitespace is [`ArgError::Empty`] (egressd).
    Empty,
    /// Only the empty string is missing; anything else is taken as given (runnerd).
    Verbatim,
}

/// A daemon's command line: the shared words (`--help`, `--version`, `--check-config`,
/// `--config PATH`) and its own.
#[derive(Debug, Clone, Copy)]
pub struct Grammar {
    /// The binary's name, for messages.
    pub daemon: &'static str,
    /// Words that ask for the usage text (`--help`, `-h`; runnerd adds `help`).
    pub help: &'static [&'static str],
    /// Words without a value the daemon interprets itself (`--no-confine`, runnerd's
    /// sub-commands), kept in [`Args::switches`] in the order given.
    pub switches: &'static [&'static str],
    /// The settings that have a flag taking a value.
    pub settings: &'static [Setting],
    /// Whether any `--word=value` is split at `=` (the helpers: `--no-confine=x` is
    /// `--no-confine`), or only the flags that take a value (runnerd: `--dev=1` is unknown).
    pub split_every_flag: bool,
    pub blank: Blank,
}

/// The command line, parsed: the mode, `--config`, the switches and each setting flag with
/// its value, in the order given (a flag may repeat).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    pub mode: Mode,
    /// `--config PATH`.
    pub config: Option<PathBuf>,
    pub switches: Vec<&'static str>,
    pub flags: Vec<(&'static str, String)>,
}

impl Args {
    /// Whether the setting flag `flag` was given.
    pub fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|(f, _)| *f == flag)
    }

    /// Whether the switch `word` was given.
    pub fn switched(&self, word: &str) -> bool {
        self.switches.contains(&word)
    }

    /// The last of `words` given, if any (runnerd's sub-command).
    pub fn last_of(&self, words: &[&str]) -> Option<&'static str> {
        self.switches.iter().rev().find(|s| words.contains(s)).copied()
    }

    /// The helpers' self-confinement: on unless `--no-confine`.
    pub fn confine(&self) -> bool {
        !self.switched("--no-confine")
    }
}

/// A command line the daemon cannot take (exit status 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    #[error("unknown argument {arg:?}; see {daemon} --help")]
    Unknown { daemon: &'static str, arg: String },
    #[error("{flag} needs a value; see {daemon} --help")]
    MissingValue { daemon: &'static str, flag: String },
    #[error("{flag} must not be empty")]
    Empty { flag: String },
}

/// Parses the arguments (without the program name). `--help` and `--version` end the
/// parse where they stand: what follows them is not looked at; an error before them wins.
pub fn parse_args(grammar: &Grammar, args: &[String]) -> Result<Args, ArgError> {
    let mut parsed = Args { mode: Mode::Serve, config: None, switches: Vec::new(), flags: Vec::new() };
    let takes_value = |flag: &str| flag == "--config" || grammar.settings.iter().any(|(_, f, _)| *f == flag);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") && (grammar.split_every_flag || takes_value(f)) => {
                (f, Some(v.to_owned()))
            }
            _ => (arg.as_str(), None),
        };
        let mut value = || -> Result<String, ArgError> {
            let missing = || ArgError::MissingValue { daemon: grammar.daemon, flag: flag.to_owned() };
            let v = match inline.clone() {
                Some(v) => v,
                None => it.next().cloned().ok_or_else(missing)?,
            };
            match grammar.blank {
                Blank::Verbatim if v.is_empty() => Err(missing()),
                Blank::Missing if v.trim().is_empty() => Err(missing()),
                Blank::Empty if v.trim().is_empty() => Err(ArgError::Empty { flag: flag.to_owned() }),
                _ => Ok(v),
            }
        };
        match flag {
            f if grammar.help.contains(&f) => return Ok(Args { mode: Mode::Help, ..parsed }),
            "--version" | "-V" => return Ok(Args { mode: Mode::Version, ..parsed }),
            "--check-config" => parsed.mode = Mode::CheckConfig,
            "--config" => parsed.config = Some(value()?.into()),
            f => {
                if let Some(word) = grammar.switches.iter().find(|w| **w == f) {
                    parsed.switches.push(word);
                } else if let Some((_, f, _)) = grammar.settings.iter().find(|(_, s, _)| *s == f) {
                    parsed.flags.push((f, value()?));
                } else {
                    return Err(ArgError::Unknown { daemon: grammar.daemon, arg: f.to_owned() });
                }
            }
        }
    }
    Ok(parsed)
}

/// An error that may be the command line's fault rather than the environment's or the
/// file's: a bad flag value exits 2 (usage), a bad variable or key 1.
pub trait Usage {
    fn is_usage(&self) -> bool;
}

impl Usage for std::convert::Infallible {
    fn is_usage(&self) -> bool {
        match *self {}
    }
}

/// Why a daemon's settings could not be loaded. `E` is the daemon's own value check
/// (`Infallible` when every value is taken as text).
#[derive(Debug, thiserror::Error)]
pub enum LoadError<E: std::error::Error + 'static> {
    #[error(transparent)]
    File(#[from] SettingsError),
    #[error(transparent)]
    Value(E),
    #[error(transparent)]
    Log(#[from] LogError),
}

impl<E: std::error::Error + Usage + 'static> LoadError<E> {
    /// Whether the command line is at fault (rather than a variable or the file).
    pub fn is_usage(&self) -> bool {
        matches!(self, LoadError::Value(e) if e.is_usage())
    }
}

/// The variables layered over the configuration file: `--config`, else the file `var`
/// names, else `default` (which may be absent).
pub fn layered(
    schema: &'static Schema,
    flag: Option<&Path>,
    var: &str,
    default: &str,
    env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> Result<Layered, SettingsError> {
    let choice = FileChoice::choose(flag, var, &env, default);
    Layered::load(schema, choice, env)
}

/// The log settings of a layered lookup, an error naming the key and the file when the
/// value came from it.
pub fn log_settings(settings: &Layered) -> Result<LogSettings, LogError> {
    LogSettings::from_vars(|k| settings.var(k))
        .map_err(|e| LogError { name: settings.describe(&e.name), ..e })
}

/// The sink as the `config_loaded` event names it (`Journald`, `Stderr`), `none` when this
/// command does not log.
pub fn sink_name(sink: Option<Sink>) -> String {
    sink.map_or_else(|| "none".to_owned(), |s| format!("{s:?}"))
}

/// What a daemon fills in for [`run`].
pub trait Daemon {
    /// The binary's name: messages, `--version` and the journald identifier.
    const NAME: &'static str;
    const USAGE: &'static str;
    const GRAMMAR: Grammar;
    /// The event logged when serving fails (`None`: the error is only printed).
    const FAILED_EVENT: Option<&'static str>;

    /// The settings, validated, with where each came from.
    type Loaded;
    /// The daemon's own value check, inside [`LoadError`].
    type ValueError: std::error::Error + Usage + 'static;
    /// What start-up validated beyond the settings (users, files), handed to serving.
    type Prepared;
    /// Printed with `{:#}` (an `anyhow::Error` shows its chain).
    type Error: Display;

    /// What `--version` prints after the name.
    fn version() -> String;

    /// A bad command line, as printed on stderr.
    fn usage_error(e: &ArgError) -> String {
        format!("{}: {e}", Self::NAME)
    }

    fn load(args: &Args) -> Result<Self::Loaded, LoadError<Self::ValueError>>;

    fn log_settings(loaded: &Self::Loaded) -> &LogSettings;

    /// Everything checked before anything is touched; runs for `--check-config` too.
    fn prepare(args: &Args, loaded: &Self::Loaded) -> Result<Self::Prepared, Self::Error>;

    /// The `--check-config` report.
    fn check(args: &Args, loaded: &Self::Loaded, prepared: &Self::Prepared) -> Result<String, Self::Error>;

    /// Whether this command logs (runnerd's `preflight` and `selftest` print their
    /// findings and nothing else).
    fn logs(_args: &Args) -> bool {
        true
    }

    /// Serves until stopped; the process exit status.
    fn serve(
        args: Args,
        loaded: Self::Loaded,
        prepared: Self::Prepared,
        sink: Option<Sink>,
    ) -> Result<i32, Self::Error>;
}

/// The daemon's `main`: the command line `argv` (without the program name) to an exit
/// status, in the order of the module documentation.
pub fn run<D: Daemon>(argv: &[String]) -> i32 {
    let args = match parse_args(&D::GRAMMAR, argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{}", D::usage_error(&e));
            return 2;
        }
    };
    match args.mode {
        Mode::Help => return crate::out::print_status(D::USAGE, 0),
        Mode::Version => return crate::out::print_status(&format!("{} {}\n", D::NAME, D::version()), 0),
        Mode::CheckConfig | Mode::Serve => {}
    }
    let loaded = match D::load(&args) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{}: {}", D::NAME, crate::error_chain(&e));
            return if e.is_usage() { 2 } else { 1 };
        }
    };
    let prepared = match D::prepare(&args, &loaded) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{}: {e:#}", D::NAME);
            return 1;
        }
    };
    if args.mode == Mode::CheckConfig {
        return match D::check(&args, &loaded, &prepared) {
            Ok(text) => crate::out::print_status(&text, 0),
            Err(e) => {
                eprintln!("{}: {e:#}", D::NAME);
                1
            }
        };
    }
    let sink = D::logs(&args).then(|| audit::init_with(D::NAME, D::log_settings(&loaded)));
    match D::serve(args, loaded, prepared, sink) {
        Ok(code) => code,
        Err(e) => {
            if let Some(event) = D::FAILED_EVENT {
                tracing::error!(event, error = %format!("{e:#}"));
            }
            eprintln!("{}: {e:#}", D::NAME);
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: &[Setting] = &[("state_dir", "--state-dir", "STATE"), ("peer", "--peer", "PEER")];

    fn grammar(blank: Blank, split_every_flag: bool) -> Grammar {
        Grammar {
            daemon: "d",
            help: &["--help", "-h"],
            switches: &["--no-confine", "serve", "preflight"],
            settings: SETTINGS,
            split_every_flag,
            blank,
        }
    }

    fn parse(g: &Grammar, args: &[&str]) -> Result<Args, ArgError> {
        parse_args(g, &args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn flags_switches_and_modes() {
        let g = grammar(Blank::Missing, true);
        let a = parse(&g, &["--check-config", "--config=/c.toml", "--peer", "a", "--peer=b", "--no-confine"])
            .unwrap();
        assert_eq!(a.mode, Mode::CheckConfig);
        assert_eq!(a.config, Some(PathBuf::from("/c.toml")));
        assert_eq!(a.flags, [("--peer", "a".to_owned()), ("--peer", "b".to_owned())]);
        assert!(a.has("--peer") && !a.has("--state-dir") && !a.confine());
        assert_eq!(
            parse(&g, &["serve", "preflight"]).unwrap().last_of(&["serve", "preflight"]),
            Some("preflight")
        );
        assert!(parse(&g, &[]).unwrap().confine());
        // --help and --version stop the parse; an error before them still wins.
        assert_eq!(parse(&g, &["--help", "--bogus"]).unwrap().mode, Mode::Help);
        assert_eq!(parse(&g, &["-V", "--bogus"]).unwrap().mode, Mode::Version);
        assert!(parse(&g, &["--bogus", "--help"]).is_err());
    }

    #[test]
    fn each_dialect_reports_bad_command_lines_in_its_words() {
        let unknown = |arg: &str| ArgError::Unknown { daemon: "d", arg: arg.into() };
        let missing = |flag: &str| ArgError::MissingValue { daemon: "d", flag: flag.into() };
        let empty = |flag: &str| ArgError::Empty { flag: flag.into() };
        let (npu, egress, runner) =
            (grammar(Blank::Missing, true), grammar(Blank::Empty, true), grammar(Blank::Verbatim, false));
        let cases: &[(&Grammar, &[&str], Result<(), ArgError>)] = &[
            (&npu, &["--bogus=1"], Err(unknown("--bogus"))),
            (&runner, &["--bogus=1"], Err(unknown("--bogus=1"))),
            (&npu, &["--no-confine=x"], Ok(())),
            (&runner, &["--no-confine=x"], Err(unknown("--no-confine=x"))),
            (&npu, &["--state-dir"], Err(missing("--state-dir"))),
            (&npu, &["--state-dir="], Err(missing("--state-dir"))),
            (&npu, &["--state-dir", " "], Err(missing("--state-dir"))),
            (&egress, &["--state-dir"], Err(missing("--state-dir"))),
            (&egress, &["--state-dir="], Err(empty("--state-dir"))),
            (&egress, &["--config", " "], Err(empty("--config"))),
            (&runner, &["--config"], Err(missing("--config"))),
            (&runner, &["--config="], Err(missing("--config"))),
            (&runner, &["--config", " "], Ok(())),
        ];
        for (g, args, want) in cases {
            assert_eq!(&parse(g, args).map(|_| ()), want, "{args:?}");
        }
        assert_eq!(unknown("-x").to_string(), "unknown argument \"-x\"; see d --help");
        assert_eq!(missing("--peer").to_string(), "--peer needs a value; see d --help");
        assert_eq!(empty("--peer").to_string(), "--peer must not be empty");
    }
}
