//! `runnerd --check-config`: everything start-up validates (the settings from the file and
//! the environment, the token, the listen address, bubblewrap, sandbox-init, the seccomp
//! programs), without binding a port or writing anything: the data directory and the token
//! file are only read. The report shows each effective setting and where it came from.

use std::path::Path;

use anyhow::Context;
use common::seccomp::{self, Arch, Profile};
use common::settings::{Row, render};

use crate::config::Loaded;
use crate::sandbox::preflight;
use crate::startup::{self, StartupError};
use crate::token::{self, Fallback, TokenError};

/// Where the packages put the token that runnerd.service loads as its credential.
pub const PACKAGED_TOKEN: &str = "/etc/sciencediscovery/runner-token";

/// The report printed on success; an error names what to fix.
pub async fn check(loaded: &Loaded, fallback: Fallback) -> anyhow::Result<String> {
    let config = &loaded.config;
    let mut checks = Vec::new();

    // The token: read where start-up reads it; a development token is not generated here.
    let token = token_state(loaded, fallback)?;
    checks.push(Row::new("token", format!("{token} (the value is never printed)"), ""));

    checks.push(Row::new("replica credentials", replica_credentials(config)?, ""));

    // Where it will listen: resolved, not bound.
    let listen = listen_address(loaded).await?;
    checks.push(Row::new("listen", format!("{listen} (not bound by --check-config)"), ""));

    // The sandbox side of start-up, less what writes (seccomp files, identity files).
    sandbox_checks(loaded, &mut checks).await?;

    checks.push(Row::new("data directory", data_dir_state(&config.data_dir)?, ""));
    let bridge = startup::locate_helper(config.egress_bridge.clone(), "egress-bridge");
    let bridge_state = if bridge.exists() { "present" } else { "MISSING: network executions will fail" };
    checks.push(Row::new("egress bridge", format!("{} ({bridge_state})", bridge.display()), ""));
    let python = Path::new(&config.python_path);
    let python_state = if python.exists() { "present" } else { "MISSING: /execute will fail" };
    checks.push(Row::new("python", format!("{} ({python_state})", python.display()), ""));

    Ok(format!(
        "runnerd configuration is valid.\nconfiguration file: {}\nsettings (value, origin):\n{}checks:\n{}",
        loaded.settings.file_status(),
        render(&loaded.rows()),
        render(&checks),
    ))
}

/// What the token check reports: where start-up would find the token.
fn token_state(loaded: &Loaded, fallback: Fallback) -> anyhow::Result<String> {
    let config = &loaded.config;
    let env = |k: &str| std::env::var(k).ok();
    let token_file = config.token_file.as_deref();
    let token = match fallback {
        Fallback::Generate => {
            match token::resolve(env, token_file, &config.data_dir, Fallback::ReadGenerated) {
                Err(TokenError::Missing) => format!(
                    "a development token will be generated in {} (--dev)",
                    token::generated_path(&config.data_dir).display()
                ),
                other => other?.1.to_string(),
            }
        }
        _ => match token::resolve(env, token_file, &config.data_dir, fallback) {
            // Outside the unit the systemd credential is invisible; the packaged file it is
            // loaded from is what tells whether the service will have a token.
            Err(TokenError::Missing) if Path::new(PACKAGED_TOKEN).exists() => format!(
                "none visible to this process; runnerd.service gets it as the systemd credential runner-token (LoadCredential from {PACKAGED_TOKEN}, present)"
            ),
            other => other?.1.to_string(),
        },
    };
    Ok(token)
}

/// Whether the object store's secret can be read where start-up reads it (never printed).
fn replica_credentials(config: &crate::config::RunnerConfig) -> anyhow::Result<String> {
    let Some(settings) = &config.replica else { return Ok("replication off (no replica_endpoint)".into()) };
    let credentials = crate::replica::settings::secret(settings, |k| std::env::var(k).ok())
        .context("the object store's credentials")?;
    Ok(match credentials {
        Some((id, _)) => {
            let from = settings
                .secret_access_key_file
                .as_ref()
                .map_or_else(|| crate::replica::settings::SECRET_VAR.to_owned(), |p| p.display().to_string());
            format!("access key id {id}, its secret from {from} (the secret is never printed)")
        }
        None => "none: unsigned requests".into(),
    })
}

/// The address runnerd would listen on, the host resolved.
async fn listen_address(loaded: &Loaded) -> anyhow::Result<String> {
    let config = &loaded.config;
    let describe = |var: &str| loaded.settings.describe(var);
    Ok(match &config.socket_path {
        Some(path) => format!("unix:{}", path.display()),
        None => {
            let host = config.host.trim_start_matches('[').trim_end_matches(']');
            let address = tokio::net::lookup_host((host, config.port))
                .await
                .ok()
                .and_then(|mut a| a.next())
                .with_context(|| {
                    format!(
                        "{} {:?} is not an address or a host name this machine resolves",
                        describe("SCIENCE_AGENT_RUNNER_HOST"),
                        config.host
                    )
                })?;
            format!("http://{address}")
        }
    })
}

/// bubblewrap and its options, sandbox-init, the seccomp programs (compiled, not written).
async fn sandbox_checks(loaded: &Loaded, checks: &mut Vec<Row>) -> anyhow::Result<()> {
    let config = &loaded.config;
    let describe = |var: &str| loaded.settings.describe(var);
    let bwrap = preflight::resolve_bwrap(&config.bwrap_path, std::env::var_os("PATH").as_deref())
        .with_context(|| format!("checking {}", describe("SCIENCE_AGENT_BWRAP_PATH")))?;
    let features = preflight::check_bwrap_options(&bwrap).await?;
    checks.push(Row::new(
        "bwrap",
        format!("{} (--bind-fd: {})", bwrap.display(), if features.bind_fd { "yes" } else { "no" }),
        "",
    ));
    let init = startup::locate_sandbox_init(config.sandbox_init.clone());
    if !init.exists() {
        return Err(StartupError::SandboxInitMissing(init).into());
    }
    checks.push(Row::new("sandbox-init", init.display().to_string(), ""));
    let arch = Arch::host()?;
    for profile in Profile::ALL {
        seccomp::compile(profile, arch)
            .with_context(|| format!("compiling the {} seccomp profile", profile.name()))?;
    }
    let names: Vec<_> = Profile::ALL.iter().map(|p| p.name()).collect();
    checks.push(Row::new("seccomp", format!("{} for {}", names.join(", "), arch.name()), ""));
    Ok(())
}

/// Start-up creates the data directory when missing; something else in its place is fatal.
fn data_dir_state(dir: &Path) -> anyhow::Result<String> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(format!("{} (exists)", dir.display())),
        Ok(_) => anyhow::bail!("the data directory {} exists and is not a directory", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(format!("{} (absent: start-up creates it)", dir.display()))
        }
        Err(e) => Err(e).with_context(|| format!("reading the data directory {}", dir.display())),
    }
}
