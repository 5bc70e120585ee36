//! The bridge's command line, parsed strictly and without I/O:
//! `--socket PATH [--port N] [--listen ADDR] [--max-connections N] -- PROGRAM [ARG…]`.

use std::ffi::{OsStr, OsString};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// The port the sandbox's `HTTP_PROXY`/`HTTPS_PROXY` point at (R-NET-2).
pub(crate) const DEFAULT_PORT: u16 = 18118;
/// The sandbox's own loopback.
pub(crate) const DEFAULT_LISTEN: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// Relayed connections open at once; one more is answered 503.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// Upper bound for `--max-connections` (each connection costs two threads).
const MAX_MAX_CONNECTIONS: usize = 4096;
/// `sun_path` holds 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

pub(crate) const USAGE: &str = "\
egress-bridge: the sandbox's way out under the domain-allowlist network policy.

Usage:
  egress-bridge --socket PATH [--port N] [--listen ADDR] [--max-connections N] -- PROGRAM [ARG...]
  egress-bridge --help

Listens on ADDR:N (default 127.0.0.1:18118) and relays every TCP connection to the egress
gateway's Unix socket at PATH. Runs PROGRAM with the bridge's stdin, stdout, stderr,
environment and working directory, forwards SIGTERM, SIGINT and SIGHUP to it, and exits
with its status (128+S when it was killed by signal S). The bridge never writes to stdout.

  --socket PATH          the egress gateway's Unix socket (required)
  --port N               TCP port to listen on (default 18118)
  --listen ADDR          IP address to listen on (default 127.0.0.1)
  --max-connections N    relayed connections at once; more are answered 503 (default 256)

Exit status of the bridge itself: 2 usage error, 125 the bridge could not be set up,
126 PROGRAM is not executable, 127 PROGRAM was not found.
";

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Invocation {
    Help,
    Run(Options),
}

/// A complete, validated bridge configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Options {
    /// The gateway's Unix socket.
    pub socket: PathBuf,
    /// Where the bridge listens.
    pub listen: SocketAddr,
    /// Relayed connections open at once.
    pub max_connections: usize,
    /// The workload: program and arguments, never empty.
    pub argv: Vec<OsString>,
}

/// A command line the bridge refuses; every message fits on one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UsageError {
    #[error("--socket PATH is required")]
    MissingSocket,
    #[error("{0} needs a value")]
    MissingValue(&'static str),
    #[error("{0} is given twice")]
    Repeated(&'static str),
    #[error("--socket must not be empty")]
    EmptySocket,
    #[error("--socket path {0:?} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket address can hold")]
    SocketTooLong(String),
    #[error("--port must be a number from 1 to 65535, not {0:?}")]
    BadPort(String),
    #[error("--listen must be an IP address such as 127.0.0.1 or ::1, not {0:?}")]
    BadListen(String),
    #[error("--max-connections must be a number from 1 to {MAX_MAX_CONNECTIONS}, not {0:?}")]
    BadMaxConnections(String),
    #[error("unknown option {0:?}")]
    UnknownOption(String),
    #[error("unexpected argument {0:?}; the program to run goes after `--`")]
    Unexpected(String),
    #[error("missing `--` and the program to run after it")]
    MissingSeparator,
    #[error("no program to run after `--`")]
    MissingProgram,
}

/// The options that take a value, by their spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flag {
    Socket,
    Port,
    Listen,
    MaxConnections,
}

impl Flag {
    fn from_name(name: &[u8]) -> Option<Flag> {
        match name {
            b"--socket" => Some(Flag::Socket),
            b"--port" => Some(Flag::Port),
            b"--listen" => Some(Flag::Listen),
            b"--max-connections" => Some(Flag::MaxConnections),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Flag::Socket => "--socket",
            Flag::Port => "--port",
            Flag::Listen => "--listen",
            Flag::MaxConnections => "--max-connections",
        }
    }
}

/// Parses the arguments after the program name. `--help` anywhere before `--` wins; after
/// `--` everything belongs to the workload, verbatim.
pub(crate) fn parse(args: &[OsString]) -> Result<Invocation, UsageError> {
    let mut socket: Option<PathBuf> = None;
    let mut port: Option<u16> = None;
    let mut listen: Option<IpAddr> = None;
    let mut max_connections: Option<usize> = None;
    let mut rest = args.iter();
    let mut argv: Option<Vec<OsString>> = None;
    while let Some(arg) = rest.next() {
        let bytes = arg.as_bytes();
        if bytes == b"--" {
            argv = Some(rest.by_ref().cloned().collect());
            break;
        }
        if bytes == b"--help" || bytes == b"-h" {
            return Ok(Invocation::Help);
        }
        if !bytes.starts_with(b"-") {
            return Err(UsageError::Unexpected(lossy(arg)));
        }
        // `--flag=value` or `--flag value`.
        let (name, inline) = match bytes.iter().position(|&b| b == b'=') {
            Some(eq) => (&bytes[..eq], Some(OsStr::from_bytes(&bytes[eq + 1..]))),
            None => (bytes, None),
        };
        let flag = Flag::from_name(name).ok_or_else(|| UsageError::UnknownOption(lossy(arg)))?;
        let value = match inline {
            Some(v) => v,
            None => match rest.next() {
                Some(v) if v.as_bytes() != b"--" => v.as_os_str(),
                _ => return Err(UsageError::MissingValue(flag.name())),
            },
        };
        match flag {
            Flag::Socket => set_once(&mut socket, flag, parse_socket(value)?)?,
            Flag::Port => set_once(&mut port, flag, parse_port(value)?)?,
            Flag::Listen => set_once(&mut listen, flag, parse_listen(value)?)?,
            Flag::MaxConnections => set_once(&mut max_connections, flag, parse_max_connections(value)?)?,
        }
    }
    let argv = argv.ok_or(UsageError::MissingSeparator)?;
    if argv.is_empty() {
        return Err(UsageError::MissingProgram);
    }
    let socket = socket.ok_or(UsageError::MissingSocket)?;
    Ok(Invocation::Run(Options {
        socket,
        listen: SocketAddr::new(listen.unwrap_or(DEFAULT_LISTEN), port.unwrap_or(DEFAULT_PORT)),
        max_connections: max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS),
        argv,
    }))
}

fn set_once<T>(slot: &mut Option<T>, flag: Flag, value: T) -> Result<(), UsageError> {
    if slot.replace(value).is_some() { Err(UsageError::Repeated(flag.name())) } else { Ok(()) }
}

fn parse_socket(value: &OsStr) -> Result<PathBuf, UsageError> {
    match value.len() {
        0 => Err(UsageError::EmptySocket),
        n if n > MAX_SOCKET_PATH => Err(UsageError::SocketTooLong(lossy(value))),
        _ => Ok(PathBuf::from(value)),
    }
}

fn parse_port(value: &OsStr) -> Result<u16, UsageError> {
    parse_decimal(value)
        .and_then(|n| u16::try_from(n).ok())
        .filter(|&n| n != 0)
        .ok_or_else(|| UsageError::BadPort(lossy(value)))
}

fn parse_listen(value: &OsStr) -> Result<IpAddr, UsageError> {
    value.to_str().and_then(|s| s.parse().ok()).ok_or_else(|| UsageError::BadListen(lossy(value)))
}

fn parse_max_connections(value: &OsStr) -> Result<usize, UsageError> {
    match parse_decimal(value) {
        Some(n @ 1..=MAX_MAX_CONNECTIONS) => Ok(n),
        _ => Err(UsageError::BadMaxConnections(lossy(value))),
    }
}

/// Plain ASCII digits only: no sign, no spaces, no radix prefix.
fn parse_decimal(value: &OsStr) -> Option<usize> {
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > 9 || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    value.to_str()?.parse().ok()
}

fn lossy(value: &OsStr) -> String {
    value.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    fn run(socket: &str, listen: &str, max: usize, argv: &[&str]) -> Result<Invocation, UsageError> {
        Ok(Invocation::Run(Options {
            socket: PathBuf::from(socket),
            listen: listen.parse().expect("test address"),
            max_connections: max,
            argv: args(argv),
        }))
    }

    #[test]
    fn command_lines() {
        use UsageError::*;
        let long = format!("/{}", "s".repeat(107));
        let table: Vec<(Vec<&str>, Result<Invocation, UsageError>)> = vec![
            (
                vec!["--socket", "/run/s.sock", "--port", "18118", "--", "bash", "-c", "x"],
                run("/run/s.sock", "127.0.0.1:18118", 256, &["bash", "-c", "x"]),
            ),
            (vec!["--socket", "/s", "--", "cat"], run("/s", "127.0.0.1:18118", 256, &["cat"])),
            (
                vec!["--socket=/s", "--port=80", "--listen=::1", "--max-connections=3", "--", "cat"],
                run("/s", "[::1]:80", 3, &["cat"]),
            ),
            (
                vec!["--listen", "0.0.0.0", "--socket", "/s", "--", "cat"],
                run("/s", "0.0.0.0:18118", 256, &["cat"]),
            ),
            // After `--` nothing is interpreted, not even --help or another `--`.
            (
                vec!["--socket", "/s", "--", "prog", "--help", "--", "--port"],
                run("/s", "127.0.0.1:18118", 256, &["prog", "--help", "--", "--port"]),
            ),
            (vec!["--help"], Ok(Invocation::Help)),
            (vec!["--socket", "/s", "-h", "--", "cat"], Ok(Invocation::Help)),
            (vec![], Err(MissingSeparator)),
            (vec!["--socket", "/s"], Err(MissingSeparator)),
            (vec!["--socket", "/s", "--"], Err(MissingProgram)),
            (vec!["--port", "1", "--", "cat"], Err(MissingSocket)),
            (vec!["--socket"], Err(MissingValue("--socket"))),
            (vec!["--socket", "--", "cat"], Err(MissingValue("--socket"))),
            (vec!["--socket", "/a", "--socket", "/b", "--", "cat"], Err(Repeated("--socket"))),
            (vec!["--socket=", "--", "cat"], Err(EmptySocket)),
            (vec!["--socket", &long, "--", "cat"], Err(SocketTooLong(long.clone()))),
            (vec!["--socket", "/s", "--port", "0", "--", "cat"], Err(BadPort("0".into()))),
            (vec!["--socket", "/s", "--port", "65536", "--", "cat"], Err(BadPort("65536".into()))),
            (vec!["--socket", "/s", "--port", "+80", "--", "cat"], Err(BadPort("+80".into()))),
            (vec!["--socket", "/s", "--port", " 80", "--", "cat"], Err(BadPort(" 80".into()))),
            (
                vec!["--socket", "/s", "--port", "99999999999", "--", "cat"],
                Err(BadPort("99999999999".into())),
            ),
            (
                vec!["--socket", "/s", "--listen", "localhost", "--", "cat"],
                Err(BadListen("localhost".into())),
            ),
            (
                vec!["--socket", "/s", "--max-connections", "0", "--", "cat"],
                Err(BadMaxConnections("0".into())),
            ),
            (
                vec!["--socket", "/s", "--max-connections", "5000", "--", "cat"],
                Err(BadMaxConnections("5000".into())),
            ),
            (vec!["--socket", "/s", "--verbose", "--", "cat"], Err(UnknownOption("--verbose".into()))),
            (vec!["--socket", "/s", "cat"], Err(Unexpected("cat".into()))),
        ];
        for (line, expected) in table {
            assert_eq!(parse(&args(&line)), expected, "{line:?}");
        }
    }

    #[test]
    fn socket_paths_and_workload_arguments_need_not_be_utf8() {
        let odd = OsString::from(OsStr::from_bytes(b"/run/\xff.sock"));
        let arg = OsString::from(OsStr::from_bytes(b"\xfe"));
        let line = vec!["--socket".into(), odd.clone(), "--".into(), "prog".into(), arg.clone()];
        let Ok(Invocation::Run(options)) = parse(&line) else { panic!("rejected") };
        assert_eq!(options.socket, PathBuf::from(odd));
        assert_eq!(options.argv, vec![OsString::from("prog"), arg]);
    }

    #[test]
    fn every_usage_message_is_one_line() {
        let nasty = "a\nb";
        let errors = [
            UsageError::Unexpected(nasty.into()),
            UsageError::UnknownOption(nasty.into()),
            UsageError::BadPort(nasty.into()),
            UsageError::BadListen(nasty.into()),
            UsageError::SocketTooLong(nasty.into()),
        ];
        for e in errors {
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }

    #[test]
    fn usage_fits_a_terminal() {
        for line in USAGE.lines() {
            assert!(line.chars().count() <= 100, "{line}");
        }
    }
}
