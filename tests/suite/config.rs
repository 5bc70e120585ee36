//! The daemons' configuration files, through the real binaries: `--check-config --config`
//! with good and bad files, precedence as reported, and a daemon that refuses to start on a
//! bad file with a message naming the key and the file.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use runner_tests::server::{Server, ServerOptions};
use runner_tests::{bin, scratch_dir};
use runnerd::sandbox::preflight::REQUIRED_OPTIONS;

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn finish(out: Output) -> Run {
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A bubblewrap stand-in whose `--help` lists every required option, so that the check
/// does not depend on this host's bubblewrap.
fn stub_bwrap(dir: &Path) -> PathBuf {
    let path = dir.join("bwrap");
    std::fs::write(&path, format!("#!/bin/sh\necho 'usage: bwrap {}'\n", REQUIRED_OPTIONS.join(" ")))
        .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// runnerd with a clean environment: a token, a stub bwrap, and `vars`.
fn runnerd(dir: &Path, args: &[&str], vars: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin("runnerd"));
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
        .env("SCIENCE_AGENT_RUNNER_TOKEN", "config-test-token")
        .env("SCIENCE_AGENT_BWRAP_PATH", stub_bwrap(dir))
        .env("SCIENCE_AGENT_LOG_TARGET", "stderr")
        .stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

fn egressd(args: &[&str], vars: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(bin("egressd"));
    cmd.args(args).env_clear().env("SCIENCE_AGENT_LOG_TARGET", "stderr").stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    finish(cmd.output().unwrap())
}

/// The report's row for `key`: `(value, origin)`.
fn row<'a>(report: &'a str, key: &str) -> (&'a str, &'a str) {
    let line = report
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no row {key} in\n{report}"));
    let rest = line.trim_start()[key.len()..].trim_start();
    let mut parts = rest.splitn(2, "  ");
    (parts.next().unwrap_or("").trim(), parts.next().unwrap_or("").trim())
}

#[test]
fn runnerd_check_config_reports_each_setting_and_its_origin() {
    let dir = scratch_dir();
    let data = dir.path().join("data");
    let file = dir.path().join("runnerd.toml");
    std::fs::write(
        &file,
        format!(
            "# a comment\nrunner_port = 4399\ndata_dir = \"{}\"\nmax_workspace_bytes = 1_000\nnpu_broker = false\n\
             log_level = \"debug\"\n",
            data.display()
        ),
    )
    .unwrap();
    let config = file.to_str().unwrap();
    let run = finish(
        runnerd(
            dir.path(),
            &["--check-config", "--config", config],
            &[("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "2000")],
        )
        .output()
        .unwrap(),
    );
    assert_eq!(run.code, Some(0), "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    let out = &run.stdout;
    assert!(out.starts_with("runnerd configuration is valid."), "{out}");
    assert!(out.contains(&format!("configuration file: {config} (5 settings)")), "{out}");
    assert_eq!(row(out, "runner_port"), ("4399", format!("file {config}:2").as_str()));
    assert_eq!(row(out, "max_workspace_bytes"), ("2000", "environment SCIENCE_AGENT_MAX_WORKSPACE_BYTES"));
    assert_eq!(row(out, "runner_host"), ("127.0.0.1", "default"));
    assert_eq!(row(out, "log_level"), ("debug", format!("file {config}:6").as_str()));
    assert!(row(out, "token").0.starts_with("SCIENCE_AGENT_RUNNER_TOKEN"), "{out}");
    assert!(row(out, "listen").0.starts_with("http://127.0.0.1:4399 (not bound"), "{out}");
    assert!(!out.contains("config-test-token"), "the token is never printed:\n{out}");
    assert!(!data.exists(), "--check-config must not create the data directory");
    // Nothing listens on the port it named.
    assert!(std::net::TcpStream::connect("127.0.0.1:4399").is_err());
}

#[test]
fn runnerd_refuses_a_bad_file_naming_the_key_and_the_file() {
    let dir = scratch_dir();
    let data = dir.path().join("data");
    let file = dir.path().join("runnerd.toml");
    let config = file.to_str().unwrap().to_owned();
    let cases: &[(&str, String)] = &[
        (
            "runner_port = 4311\nmax_workspace_bytes = -1\n",
            format!("max_workspace_bytes in {config}:2 must be a non-negative integer, not \"-1\""),
        ),
        (
            "max_workspace = 5\n",
            format!("unknown key max_workspace in {config}:1 (did you mean max_workspace_bytes?)"),
        ),
        (
            "runner_port = \"http\"\n",
            format!("runner_port in {config}:1 must be an integer between 0 and 65535"),
        ),
        (
            "runner_port = 1.5\n",
            format!("runner_port in {config}:1 must be an integer (or a string of digits)"),
        ),
        ("runner_token = \"hunter2\"\n", format!("runner_token in {config}:1 is not accepted")),
        (
            "runner_port = \n",
            format!("the configuration file {config} is not valid TOML: TOML parse error at line 1"),
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&file, text).unwrap();
        let check =
            finish(runnerd(dir.path(), &["--check-config", "--config", &config], &[]).output().unwrap());
        assert_eq!(check.code, Some(1), "{text}: {}", check.stderr);
        assert!(check.stderr.contains(want.as_str()), "{text}:\n  got  {}\n  want {want}", check.stderr);
        assert!(!check.stderr.contains("hunter2"), "{}", check.stderr);
        // And the daemon itself refuses to start with the same sentence, before touching
        // its data directory.
        let serve = finish(
            runnerd(
                dir.path(),
                &["--config", &config],
                &[("SCIENCE_AGENT_DATA_DIR", data.to_str().unwrap())],
            )
            .output()
            .unwrap(),
        );
        assert_eq!(serve.code, Some(1), "{text}: {}", serve.stderr);
        assert!(serve.stderr.contains(want.as_str()), "{text}:\n  got  {}\n  want {want}", serve.stderr);
        assert!(!data.exists());
    }
    // The same file named by the variable; a file that was asked for must exist.
    let missing = dir.path().join("absent.toml");
    let run = finish(
        runnerd(dir.path(), &["--check-config"], &[("SCIENCE_AGENT_CONFIG", missing.to_str().unwrap())])
            .output()
            .unwrap(),
    );
    assert_eq!(run.code, Some(1));
    assert!(
        run.stderr.contains(&format!(
            "the configuration file {} (named by SCIENCE_AGENT_CONFIG) does not exist",
            missing.display()
        )),
        "{}",
        run.stderr
    );
    // A variable overrides a bad value in the file, and the error names the variable.
    std::fs::write(&file, "queue_capacity = 5\n").unwrap();
    let run = finish(
        runnerd(
            dir.path(),
            &["--check-config", "--config", &config],
            &[("SCIENCE_AGENT_QUEUE_CAPACITY", "0")],
        )
        .output()
        .unwrap(),
    );
    assert_eq!(run.code, Some(1));
    assert!(
        run.stderr.contains("SCIENCE_AGENT_QUEUE_CAPACITY must be a positive integer, not \"0\""),
        "{}",
        run.stderr
    );
}

#[test]
fn runnerd_starts_with_settings_from_the_file() {
    let dir = scratch_dir();
    let file = dir.path().join("runnerd.toml");
    // The test server sets SCIENCE_AGENT_RUNNER_PORT=0 and SCIENCE_AGENT_DATA_DIR: those
    // variables override the file; the rest comes from the file.
    std::fs::write(&file, "runner_port = 1\ndata_dir = \"/nonexistent/data\"\nmax_output_bytes = 4242\n")
        .unwrap();
    let server = Server::start_with(ServerOptions {
        args: vec!["--config".into(), file.to_str().unwrap().into()],
        ..ServerOptions::default()
    });
    assert!(server.address().starts_with("127.0.0.1:"), "{}", server.address());
    assert!(server.banner.contains(&format!("data dir {}", server.data_dir.display())), "{}", server.banner);
    assert!(server.banner.contains("max output 4242 bytes"), "{}", server.banner);
}

#[test]
fn egressd_check_config_flags_over_variables_over_the_file() {
    let dir = scratch_dir();
    let file = dir.path().join("egressd.toml");
    let runtime = dir.path().join("rt");
    std::fs::write(
        &file,
        format!(
            "runtime_dir = \"{}\"\nnameservers = [\"127.0.0.1:5300\", \"::1\"]\nmax_tunnels = 64\n\
             tunnel_idle_ms = \"1000\"\nheader_timeout_ms = 500\n",
            runtime.display()
        ),
    )
    .unwrap();
    let config = file.to_str().unwrap();
    let run = egressd(
        &["--check-config", "--config", config, "--tunnel-idle-ms", "3000"],
        &[("SCIENCE_AGENT_EGRESS_MAX_TUNNELS", "32"), ("SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS", "2000")],
    );
    assert_eq!(run.code, Some(0), "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    let out = &run.stdout;
    assert!(out.starts_with("egressd configuration is valid."), "{out}");
    assert_eq!(row(out, "runtime_dir"), (runtime.to_str().unwrap(), format!("file {config}:1").as_str()));
    assert_eq!(row(out, "nameservers"), ("127.0.0.1:5300, [::1]:53", format!("file {config}:2").as_str()));
    assert_eq!(row(out, "max_tunnels"), ("32", "environment SCIENCE_AGENT_EGRESS_MAX_TUNNELS"));
    assert_eq!(row(out, "tunnel_idle_ms"), ("3000", "flag --tunnel-idle-ms"));
    assert_eq!(row(out, "header_timeout_ms"), ("500", format!("file {config}:5").as_str()));
    assert_eq!(row(out, "connect_timeout_ms"), ("10000", "default"));
    assert!(!runtime.exists(), "--check-config must not create the runtime directory");
}

#[test]
fn egressd_refuses_a_bad_file_naming_the_key_and_the_file() {
    let dir = scratch_dir();
    let file = dir.path().join("egressd.toml");
    let config = file.to_str().unwrap().to_owned();
    let socket = dir.path().join("control.sock");
    let cases: &[(&str, String)] = &[
        ("max_tunnel = 5\n", format!("unknown key max_tunnel in {config}:1 (did you mean max_tunnels?)")),
        ("\nmax_tunnels = 0\n", format!("max_tunnels in {config}:2 must be a positive integer, not \"0\"")),
        (
            "nameservers = \"dns.google\"\n",
            format!("nameservers in {config}:1: \"dns.google\" is not an IP address"),
        ),
        (
            "nameservers = [1]\n",
            format!("nameservers in {config}:1 must be an array of strings, not an array"),
        ),
        (
            "runner_uid = \"no-such-user-here\"\n",
            format!("checking runner_uid in {config}:1: there is no user named \"no-such-user-here\""),
        ),
        ("log_level = \"loud\"\n", format!("log_level in {config}:1 must be one of error, warn, info")),
    ];
    for (text, want) in cases {
        std::fs::write(&file, text).unwrap();
        let check = egressd(&["--check-config", "--config", &config, "--nameserver", "127.0.0.1"], &[]);
        let expect_code = Some(1);
        assert_eq!(check.code, expect_code, "{text}: {}", check.stderr);
        assert!(check.stderr.contains(want.as_str()), "{text}:\n  got  {}\n  want {want}", check.stderr);
        let socket_var = ("SCIENCE_AGENT_EGRESS_SOCKET", socket.to_str().unwrap());
        let serve = egressd(&["--config", &config, "--no-confine"], &[socket_var]);
        assert_eq!(serve.code, Some(1), "{text}: {}", serve.stderr);
        assert!(serve.stderr.contains(want.as_str()), "{text}:\n  got  {}\n  want {want}", serve.stderr);
        assert!(!socket.exists(), "a refused start binds nothing");
    }
    let missing = dir.path().join("absent.toml");
    let run = egressd(&["--check-config"], &[("SCIENCE_AGENT_EGRESS_CONFIG", missing.to_str().unwrap())]);
    assert_eq!(run.code, Some(1));
    assert!(run.stderr.contains("(named by SCIENCE_AGENT_EGRESS_CONFIG) does not exist"), "{}", run.stderr);
    // A bad flag is a usage error (2), whatever the file says.
    std::fs::write(&file, "max_tunnels = 5\n").unwrap();
    let run = egressd(&["--check-config", "--config", &config, "--max-tunnels", "0"], &[]);
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("--max-tunnels must be a positive integer"), "{}", run.stderr);
}
