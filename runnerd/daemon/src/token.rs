//! Where the runner token comes from (api.md improvement 4): a systemd credential
//! (`$CREDENTIALS_DIRECTORY/runner-token`), a file named in the configuration
//! (`SCIENCE_AGENT_RUNNER_TOKEN_FILE`), or `SCIENCE_AGENT_RUNNER_TOKEN`, in that order.
//! A development start generates a random token into the data directory (0600) and says
//! where; the original's well-known default is used only when explicitly asked for.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::config::WELL_KNOWN_TOKEN;

/// The shared secret. Never printed: `Debug` is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn new(value: impl Into<String>) -> Token {
        Token(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Where the token was found, for the start-up log (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    Credential(PathBuf),
    File(PathBuf),
    Environment,
    Generated(PathBuf),
    WellKnownDefault,
}

impl fmt::Display for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSource::Credential(p) => write!(f, "systemd credential {}", p.display()),
            TokenSource::File(p) => write!(f, "token file {}", p.display()),
            TokenSource::Environment => f.write_str("SCIENCE_AGENT_RUNNER_TOKEN"),
            TokenSource::Generated(p) => write!(f, "generated development token in {}", p.display()),
            TokenSource::WellKnownDefault => f.write_str(
                "the well-known default token (--insecure-default-token; for local compatibility tests only)",
            ),
        }
    }
}

/// What the start-up allows beyond the configured sources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fallback {
    /// No configured token is an error.
    #[default]
    None,
    /// Development: reuse or generate `<data_dir>/runner-token`.
    Generate,
    /// Read `<data_dir>/runner-token` if a development start left one (runnerctl).
    ReadGenerated,
    /// The original's well-known token.
    WellKnown,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("could not read the runner token from {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the runner token in {0} is empty")]
    Empty(PathBuf),
    #[error("could not write the development token to {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "no runner token is configured: provide the systemd credential 'runner-token', \
         SCIENCE_AGENT_RUNNER_TOKEN_FILE (runner_token_file in the configuration file) or \
         SCIENCE_AGENT_RUNNER_TOKEN; or start with --dev to \
         generate one, or --insecure-default-token for local compatibility tests"
    )]
    Missing,
}

/// The development token file inside the data directory.
pub fn generated_path(data_dir: &Path) -> PathBuf {
    data_dir.join("runner-token")
}

/// Resolves the token. `var` looks up environment variables.
pub fn resolve(
    var: impl Fn(&str) -> Option<String>,
    token_file: Option<&Path>,
    data_dir: &Path,
    fallback: Fallback,
) -> Result<(Token, TokenSource), TokenError> {
    if let Some(dir) = var("CREDENTIALS_DIRECTORY").filter(|d| !d.is_empty()) {
        let path = Path::new(&dir).join("runner-token");
        if path.exists() {
            return Ok((read_token(&path)?, TokenSource::Credential(path)));
        }
    }
    if let Some(path) = token_file {
        return Ok((read_token(path)?, TokenSource::File(path.to_owned())));
    }
    if let Some(value) = var("SCIENCE_AGENT_RUNNER_TOKEN").filter(|v| !v.is_empty()) {
        return Ok((Token(value), TokenSource::Environment));
    }
    let generated = generated_path(data_dir);
    match fallback {
        Fallback::None => Err(TokenError::Missing),
        Fallback::WellKnown => Ok((Token(WELL_KNOWN_TOKEN.to_owned()), TokenSource::WellKnownDefault)),
        Fallback::ReadGenerated if generated.exists() => {
            Ok((read_token(&generated)?, TokenSource::Generated(generated)))
        }
        Fallback::ReadGenerated => Err(TokenError::Missing),
        Fallback::Generate => {
            if generated.exists() {
                tighten(&generated)?;
                return Ok((read_token(&generated)?, TokenSource::Generated(generated)));
            }
            let token =
                random_token().map_err(|source| TokenError::Write { path: generated.clone(), source })?;
            write_new(&generated, &token)
                .map_err(|source| TokenError::Write { path: generated.clone(), source })?;
            Ok((Token(token), TokenSource::Generated(generated)))
        }
    }
}

fn read_token(path: &Path) -> Result<Token, TokenError> {
    let text =
        fs::read_to_string(path).map_err(|source| TokenError::Read { path: path.to_owned(), source })?;
    let value = text.trim();
    if value.is_empty() {
        return Err(TokenError::Empty(path.to_owned()));
    }
    Ok(Token(value.to_owned()))
}

/// 32 random bytes as 64 lowercase hex characters.
fn random_token() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn write_new(path: &Path, token: &str) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(format!("{token}\n").as_bytes())?;
    f.sync_all()
}

/// A development token readable by others is made private again.
fn tighten(path: &Path) -> Result<(), TokenError> {
    let meta = fs::metadata(path).map_err(|source| TokenError::Read { path: path.to_owned(), source })?;
    if meta.permissions().mode() & 0o077 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))
            .map_err(|source| TokenError::Write { path: path.to_owned(), source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn order_of_sources() {
        let dir = tempfile::tempdir().unwrap();
        let cred_dir = dir.path().join("creds");
        fs::create_dir(&cred_dir).unwrap();
        fs::write(cred_dir.join("runner-token"), "from-credential\n").unwrap();
        let file = dir.path().join("token");
        fs::write(&file, "from-file").unwrap();
        let cred = cred_dir.to_str().unwrap();
        let all = vars(&[("CREDENTIALS_DIRECTORY", cred), ("SCIENCE_AGENT_RUNNER_TOKEN", "from-env")]);

        let (t, s) = resolve(&all, Some(&file), dir.path(), Fallback::None).unwrap();
        assert_eq!((t.expose(), matches!(s, TokenSource::Credential(_))), ("from-credential", true));
        let env_only = vars(&[("SCIENCE_AGENT_RUNNER_TOKEN", "from-env")]);
        let (t, _) = resolve(&env_only, Some(&file), dir.path(), Fallback::None).unwrap();
        assert_eq!(t.expose(), "from-file");
        let (t, s) = resolve(&env_only, None, dir.path(), Fallback::None).unwrap();
        assert_eq!((t.expose(), s), ("from-env", TokenSource::Environment));
    }

    #[test]
    fn nothing_configured_is_an_error_unless_asked_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let none = vars(&[]);
        assert!(matches!(resolve(&none, None, dir.path(), Fallback::None), Err(TokenError::Missing)));
        assert!(matches!(
            resolve(&none, None, dir.path(), Fallback::ReadGenerated),
            Err(TokenError::Missing)
        ));
        let (t, s) = resolve(&none, None, dir.path(), Fallback::WellKnown).unwrap();
        assert_eq!((t.expose(), s), (WELL_KNOWN_TOKEN, TokenSource::WellKnownDefault));
    }

    #[test]
    fn development_token_is_random_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let none = vars(&[]);
        let (first, source) = resolve(&none, None, dir.path(), Fallback::Generate).unwrap();
        assert_eq!(first.expose().len(), 64);
        assert_ne!(first.expose(), WELL_KNOWN_TOKEN);
        let path = generated_path(dir.path());
        assert_eq!(source, TokenSource::Generated(path.clone()));
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let (again, _) = resolve(&none, None, dir.path(), Fallback::Generate).unwrap();
        assert_eq!(first, again);
        let (read, _) = resolve(&none, None, dir.path(), Fallback::ReadGenerated).unwrap();
        assert_eq!(first, read);
        // Another data directory: another token.
        let other = tempfile::tempdir().unwrap();
        let (different, _) = resolve(&none, None, other.path(), Fallback::Generate).unwrap();
        assert_ne!(first, different);
    }

    #[test]
    fn empty_files_and_debug_output() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        fs::write(&file, "  \n").unwrap();
        assert!(matches!(
            resolve(vars(&[]), Some(&file), dir.path(), Fallback::None),
            Err(TokenError::Empty(_))
        ));
        assert_eq!(format!("{:?}", Token::new("secret")), "Token(<redacted>)");
    }
}
