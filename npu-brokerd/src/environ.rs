//! A job's environment (internals §4.7): host variables pass only through an allowlist,
//! names that look like secrets are dropped even then, and the broker's fixed values are
//! set last. Pure: the host environment is an argument.

use std::path::Path;

/// Host variables a job may inherit: locale, search paths, and the Ascend toolchain's.
const ALLOWED: [&str; 8] = [
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "TOOLCHAIN_HOME",
    "SCIENCE_AGENT_NPU_PYTHON",
];
const ALLOWED_PREFIXES: [&str; 5] = ["LC_", "ASCEND_", "HCCL_", "NPU_", "SCIENCE_AGENT_NPU_"];

/// `TOKEN|SECRET|PASSWORD|PASSWD|API[_-]?KEY|ACCESS[_-]?KEY|PRIVATE[_-]?KEY|CREDENTIAL`,
/// case-insensitively.
pub fn looks_secret(name: &str) -> bool {
    let n = name.to_ascii_uppercase().replace('-', "_");
    [
        "TOKEN",
        "SECRET",
        "PASSWORD",
        "PASSWD",
        "CREDENTIAL",
        "API_KEY",
        "APIKEY",
        "ACCESS_KEY",
        "ACCESSKEY",
        "PRIVATE_KEY",
        "PRIVATEKEY",
    ]
    .iter()
    .any(|s| n.contains(s))
}

fn allowed(name: &str) -> bool {
    ALLOWED.contains(&name) || ALLOWED_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The environment of a job in workspace `ws`; `site_packages` (the managed environment's)
/// goes first on `PYTHONPATH`.
pub fn job_environment(
    host: impl IntoIterator<Item = (String, String)>,
    ws: &Path,
    site_packages: Option<&Path>,
) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> =
        host.into_iter().filter(|(k, _)| allowed(k) && !looks_secret(k)).collect();
    env.retain(|(k, _)| {
        !matches!(
            k.as_str(),
            "HOME"
                | "SCIENCE_AGENT_NPU_BROKER"
                | "SCIENCE_AGENT_NPU_BROKER_MODE"
                | "SCIENCE_AGENT_NPU_WORKSPACE"
        )
    });
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    }
    if let Some(site) = site_packages {
        let site = site.display().to_string();
        match env.iter_mut().find(|(k, _)| k == "PYTHONPATH") {
            Some((_, v)) if !v.is_empty() => *v = format!("{site}:{v}"),
            Some((_, v)) => *v = site,
            None => env.push(("PYTHONPATH".into(), site)),
        }
    }
    let ws_text = ws.display().to_string();
    env.push(("HOME".into(), ws.join(".npu-home").display().to_string()));
    env.push(("ANTIBODY_ALLOW_HOST_NPU_PYTHON".into(), "1".into()));
    env.push(("SCIENCE_AGENT_NPU_BROKER".into(), "1".into()));
    env.push(("SCIENCE_AGENT_NPU_BROKER_MODE".into(), "1".into()));
    env.push(("SCIENCE_AGENT_NPU_WORKSPACE".into(), ws_text));
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names() {
        for (name, secret) in [
            ("SCIENCE_AGENT_RUNNER_TOKEN", true),
            ("ASCEND_API_KEY", true),
            ("ascend_api-key", true),
            ("NPU_APIKEY", true),
            ("AWS_SECRET_ACCESS_KEY", true),
            ("DB_PASSWD", true),
            ("GIT_CREDENTIALS", true),
            ("SSH_PRIVATE_KEY", true),
            ("ASCEND_HOME_PATH", false),
            ("PATH", false),
            ("KEYBOARD", false),
        ] {
            assert_eq!(looks_secret(name), secret, "{name}");
        }
    }

    #[test]
    fn the_environment_is_allowlisted_filtered_and_fixed() {
        let host = [
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C.UTF-8"),
            ("ASCEND_HOME_PATH", "/usr/local/Ascend"),
            ("ASCEND_ACCESS_KEY", "secret"),
            ("SCIENCE_AGENT_NPU_SMOKE_SCRIPT", "/s.py"),
            ("SCIENCE_AGENT_NPU_TOKEN", "t"),
            ("SCIENCE_AGENT_RUNNER_TOKEN", "t"),
            ("AWS_SECRET_ACCESS_KEY", "x"),
            ("HOME", "/root"),
            ("PYTHONPATH", "/opt/lib"),
            ("SCIENCE_AGENT_NPU_BROKER", "0"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let env = job_environment(host, Path::new("/w"), Some(Path::new("/env/site")));
        let got: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("PATH", "/usr/bin"),
                ("LC_ALL", "C.UTF-8"),
                ("ASCEND_HOME_PATH", "/usr/local/Ascend"),
                ("SCIENCE_AGENT_NPU_SMOKE_SCRIPT", "/s.py"),
                ("PYTHONPATH", "/env/site:/opt/lib"),
                ("HOME", "/w/.npu-home"),
                ("ANTIBODY_ALLOW_HOST_NPU_PYTHON", "1"),
                ("SCIENCE_AGENT_NPU_BROKER", "1"),
                ("SCIENCE_AGENT_NPU_BROKER_MODE", "1"),
                ("SCIENCE_AGENT_NPU_WORKSPACE", "/w"),
            ]
        );
        let bare = job_environment(Vec::new(), Path::new("/w"), None);
        assert_eq!(bare[0], ("PATH".to_owned(), "/usr/local/bin:/usr/bin:/bin".to_owned()));
    }
}
