//! The whitelist's template language (internals §4.7): each argument of a workload's fixed
//! argv is a string with `${…}` expressions, parsed when the whitelist loads (an unknown or
//! malformed expression refuses the whole file) and expanded when the job starts (a path
//! that escapes its root fails the job, naming the expression).
//!
//! * `${python}`: the configured interpreter, else `python3`;
//! * `${managedPython}`: the managed environment's interpreter for `environmentRevisionId`;
//! * `${workspaceRoot}`;
//! * `${input:configPath}`: workspace-relative, realpath'd, inside the workspace;
//! * `${repo:path}`: repository-relative, realpath'd, inside the repository;
//! * `${env:NAME}` and `${env:NAME:-<nested expression>}`.
//!
//! Each argument expands to exactly one argv entry: nothing is split, nothing reaches a shell.

use std::path::{Component, Path, PathBuf};

/// One expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    Python,
    ManagedPython,
    WorkspaceRoot,
    /// Only `configPath` exists.
    Input(String),
    Repo(String),
    Env {
        name: String,
        default: Option<Box<Expr>>,
    },
}

/// A literal run or an expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Expr { source: String, expr: Expr },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("unknown template expression ${{{0}}}")]
    Unknown(String),
    #[error("template expression ${{{0}}} is not closed with }}")]
    Unclosed(String),
    #[error("input:{0} is not supported; only input:configPath is")]
    UnsupportedInput(String),
    #[error("env:{0} is not a valid variable name")]
    BadEnvName(String),
    #[error("repo: needs a repository-relative path")]
    EmptyRepo,
}

/// Parses one argument template.
pub fn parse(template: &str) -> Result<Vec<Piece>, TemplateError> {
    let mut pieces = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        if start > 0 {
            pieces.push(Piece::Text(rest[..start].to_owned()));
        }
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| TemplateError::Unclosed(after.to_owned()))?;
        let source = &after[..end];
        pieces.push(Piece::Expr { source: source.to_owned(), expr: parse_expr(source)? });
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest.to_owned()));
    }
    Ok(pieces)
}

fn parse_expr(source: &str) -> Result<Expr, TemplateError> {
    match source {
        "python" => return Ok(Expr::Python),
        "managedPython" => return Ok(Expr::ManagedPython),
        "workspaceRoot" => return Ok(Expr::WorkspaceRoot),
        _ => {}
    }
    if let Some(name) = source.strip_prefix("input:") {
        return if name == "configPath" {
            Ok(Expr::Input(name.to_owned()))
        } else {
            Err(TemplateError::UnsupportedInput(name.to_owned()))
        };
    }
    if let Some(path) = source.strip_prefix("repo:") {
        return if path.is_empty() { Err(TemplateError::EmptyRepo) } else { Ok(Expr::Repo(path.to_owned())) };
    }
    if let Some(rest) = source.strip_prefix("env:") {
        let (name, default) = match rest.split_once(":-") {
            Some((name, nested)) => (name, Some(Box::new(parse_expr(nested)?))),
            None => (rest, None),
        };
        let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(TemplateError::BadEnvName(name.to_owned()));
        }
        return Ok(Expr::Env { name: name.to_owned(), default });
    }
    Err(TemplateError::Unknown(source.to_owned()))
}

/// The expressions of a parsed template, nested defaults included.
pub fn expressions(pieces: &[Piece]) -> Vec<&Expr> {
    fn walk<'a>(e: &'a Expr, out: &mut Vec<&'a Expr>) {
        out.push(e);
        if let Expr::Env { default: Some(d), .. } = e {
            walk(d, out);
        }
    }
    let mut out = Vec::new();
    for p in pieces {
        if let Piece::Expr { expr, .. } = p {
            walk(expr, &mut out);
        }
    }
    out
}

/// What expansion needs to know about this job and host.
pub struct Context<'a> {
    pub python: Option<&'a str>,
    /// The managed interpreter, resolved on first use (it needs `environmentRevisionId`).
    pub managed_python: &'a dyn Fn() -> Result<PathBuf, String>,
    /// Canonical.
    pub workspace: &'a Path,
    pub config_path: Option<&'a str>,
    /// Canonical.
    pub repo: &'a Path,
    pub env: &'a dyn Fn(&str) -> Option<String>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("workspace", &self.workspace).field("repo", &self.repo).finish()
    }
}

/// Expands a parsed template to one argument; the error is a sentence for the job's `error`.
pub fn expand(pieces: &[Piece], ctx: &Context) -> Result<String, String> {
    let mut out = String::new();
    for p in pieces {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Expr { source, expr } => {
                let value = expand_expr(expr, ctx)?;
                if value.is_empty() {
                    return Err(format!("template expression ${{{source}}} resolved to an empty value"));
                }
                out.push_str(&value);
            }
        }
    }
    Ok(out)
}

fn expand_expr(expr: &Expr, ctx: &Context) -> Result<String, String> {
    match expr {
        Expr::Python => Ok(ctx.python.filter(|p| !p.is_empty()).unwrap_or("python3").to_owned()),
        Expr::ManagedPython => (ctx.managed_python)().map(|p| p.display().to_string()),
        Expr::WorkspaceRoot => Ok(ctx.workspace.display().to_string()),
        Expr::Input(name) => {
            let value = ctx
                .config_path
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("input:{name} is required"))?;
            inside(ctx.workspace, value, &format!("input:{name}"), "the workspace")
        }
        Expr::Repo(path) => inside(ctx.repo, path, "repo", "the repository"),
        Expr::Env { name, default } => match (ctx.env)(name).filter(|v| !v.is_empty()) {
            Some(v) => Ok(v),
            None => match default {
                Some(d) => expand_expr(d, ctx),
                None => Err(format!("env:{name} is not set")),
            },
        },
    }
}

/// `root/rel`, realpath'd, refused unless it stays inside `root` (which is canonical):
/// absolute paths and `..` are refused before the filesystem is asked, symlinks after.
pub fn inside(root: &Path, rel: &str, label: &str, what: &str) -> Result<String, String> {
    let escape = || format!("{label}: path must resolve inside {what}");
    let path = Path::new(rel);
    if path.is_absolute()
        || path.components().any(|c| matches!(c, Component::ParentDir | Component::Prefix(_)))
    {
        return Err(escape());
    }
    let real = std::fs::canonicalize(root.join(path))
        .map_err(|e| format!("{label}: {rel} cannot be resolved inside {what}: {e}"))?;
    if !real.starts_with(root) {
        return Err(escape());
    }
    Ok(real.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx<'a>(
        ws: &'a Path,
        repo: &'a Path,
        config: Option<&'a str>,
        env: &'a dyn Fn(&str) -> Option<String>,
        managed: &'a dyn Fn() -> Result<PathBuf, String>,
    ) -> Context<'a> {
        Context { python: None, managed_python: managed, workspace: ws, config_path: config, repo, env }
    }

    #[test]
    fn parsing_accepts_the_language_and_refuses_the_rest() {
        let ok: &[(&str, Vec<Piece>)] = &[
            ("plain", vec![Piece::Text("plain".into())]),
            ("${python}", vec![Piece::Expr { source: "python".into(), expr: Expr::Python }]),
            (
                "--cfg=${input:configPath}",
                vec![
                    Piece::Text("--cfg=".into()),
                    Piece::Expr { source: "input:configPath".into(), expr: Expr::Input("configPath".into()) },
                ],
            ),
            (
                "${env:SMOKE:-repo:w/s.py}",
                vec![Piece::Expr {
                    source: "env:SMOKE:-repo:w/s.py".into(),
                    expr: Expr::Env {
                        name: "SMOKE".into(),
                        default: Some(Box::new(Expr::Repo("w/s.py".into()))),
                    },
                }],
            ),
        ];
        for (t, want) in ok {
            assert_eq!(&parse(t).unwrap(), want, "{t}");
        }
        let bad: &[(&str, TemplateError)] = &[
            ("${pyhton}", TemplateError::Unknown("pyhton".into())),
            ("${python", TemplateError::Unclosed("python".into())),
            ("${input:other}", TemplateError::UnsupportedInput("other".into())),
            ("${env:1X}", TemplateError::BadEnvName("1X".into())),
            ("${env:A-B}", TemplateError::BadEnvName("A-B".into())),
            ("${repo:}", TemplateError::EmptyRepo),
            ("${env:X:-bogus}", TemplateError::Unknown("bogus".into())),
            ("${shell:rm}", TemplateError::Unknown("shell:rm".into())),
        ];
        for (t, want) in bad {
            assert_eq!(&parse(t).unwrap_err(), want, "{t}");
        }
    }

    #[test]
    fn expansion_keeps_paths_inside_their_roots() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let (ws, repo) = (base.join("ws"), base.join("repo"));
        std::fs::create_dir_all(ws.join("cfg")).unwrap();
        std::fs::create_dir_all(repo.join("w")).unwrap();
        std::fs::write(ws.join("cfg/run.json"), "{}").unwrap();
        std::fs::write(repo.join("w/s.py"), "").unwrap();
        std::fs::write(base.join("outside.py"), "").unwrap();
        std::os::unix::fs::symlink(base.join("outside.py"), repo.join("w/link.py")).unwrap();
        std::os::unix::fs::symlink(base.join("outside.py"), ws.join("cfg/link.json")).unwrap();
        let env = |k: &str| (k == "SET").then(|| "value".to_owned());
        let managed = || Err::<PathBuf, _>("environmentRevisionId is required".to_owned());
        let cases: &[(&str, Option<&str>, Result<String, String>)] = &[
            ("${python}", None, Ok("python3".into())),
            ("${workspaceRoot}", None, Ok(ws.display().to_string())),
            ("${repo:w/s.py}", None, Ok(repo.join("w/s.py").display().to_string())),
            ("${repo:../outside.py}", None, Err("repo: path must resolve inside the repository".into())),
            ("${repo:/etc/passwd}", None, Err("repo: path must resolve inside the repository".into())),
            ("${repo:w/link.py}", None, Err("repo: path must resolve inside the repository".into())),
            ("${input:configPath}", Some("cfg/run.json"), Ok(ws.join("cfg/run.json").display().to_string())),
            (
                "${input:configPath}",
                Some("../outside.py"),
                Err("input:configPath: path must resolve inside the workspace".into()),
            ),
            (
                "${input:configPath}",
                Some("cfg/link.json"),
                Err("input:configPath: path must resolve inside the workspace".into()),
            ),
            ("${input:configPath}", None, Err("input:configPath is required".into())),
            ("--v=${env:SET}", None, Ok("--v=value".into())),
            ("${env:UNSET}", None, Err("env:UNSET is not set".into())),
            ("${env:UNSET:-repo:w/s.py}", None, Ok(repo.join("w/s.py").display().to_string())),
            ("${env:UNSET:-env:SET}", None, Ok("value".into())),
            ("${managedPython}", None, Err("environmentRevisionId is required".into())),
        ];
        for (t, config, want) in cases {
            let c = ctx(&ws, &repo, *config, &env, &managed);
            assert_eq!(&expand(&parse(t).unwrap(), &c), want, "{t} with {config:?}");
        }
        let missing = expand(&parse("${repo:w/none.py}").unwrap(), &ctx(&ws, &repo, None, &env, &managed));
        assert!(missing.unwrap_err().starts_with("repo: w/none.py cannot be resolved inside the repository"));
        let empty_env = |_: &str| Some(String::new());
        let c = ctx(&ws, &repo, None, &empty_env, &managed);
        assert_eq!(expand(&parse("${env:X}").unwrap(), &c), Err("env:X is not set".into()));
    }
}
