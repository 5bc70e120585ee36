use std::collections::HashMap;

use super::*;

static SCHEMA: Schema = Schema {
    daemon: "testd",
    keys: &[
        Key { name: "runner_host", var: "SCIENCE_AGENT_RUNNER_HOST", kind: Kind::Text },
        Key { name: "runner_port", var: "SCIENCE_AGENT_RUNNER_PORT", kind: Kind::Integer },
        Key { name: "max_workspace_bytes", var: "SCIENCE_AGENT_MAX_WORKSPACE_BYTES", kind: Kind::Integer },
        Key { name: "npu_broker", var: "SCIENCE_AGENT_NPU_BROKER", kind: Kind::Bool },
        Key { name: "runner_uid", var: "SCIENCE_AGENT_EGRESS_RUNNER_UID", kind: Kind::Name },
        Key { name: "nameservers", var: "SCIENCE_AGENT_EGRESS_NAMESERVERS", kind: Kind::List },
    ],
    refused: &[("runner_token", "use runner_token_file")],
};

const PATH: &str = "/etc/sciencediscovery/testd.toml";

fn parse(text: &str) -> Result<ConfigFile, SettingsError> {
    ConfigFile::parse(&SCHEMA, Path::new(PATH), text)
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + Send + Sync + 'static {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| map.get(k).cloned()
}

fn layered(text: &str, vars: &[(&str, &str)]) -> Layered {
    let file = parse(text).unwrap();
    Layered::new(&SCHEMA, FileChoice::Default(PATH.into()), Some(file), env(vars))
}

#[test]
fn file_values_become_the_variables_text() {
    let cases: &[(&str, &str, &str)] = &[
        ("runner_host = \"0.0.0.0\"", "SCIENCE_AGENT_RUNNER_HOST", "0.0.0.0"),
        ("runner_port = 4312", "SCIENCE_AGENT_RUNNER_PORT", "4312"),
        ("runner_port = \"4312\"", "SCIENCE_AGENT_RUNNER_PORT", "4312"),
        ("max_workspace_bytes = 10_737_418_240", "SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "10737418240"),
        ("max_workspace_bytes = 0x10", "SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "16"),
        ("max_workspace_bytes = -1", "SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "-1"),
        ("npu_broker = true", "SCIENCE_AGENT_NPU_BROKER", "true"),
        ("npu_broker = false", "SCIENCE_AGENT_NPU_BROKER", "false"),
        ("npu_broker = \"YES\"", "SCIENCE_AGENT_NPU_BROKER", "YES"),
        ("runner_uid = 998", "SCIENCE_AGENT_EGRESS_RUNNER_UID", "998"),
        ("runner_uid = \"runnerd\"", "SCIENCE_AGENT_EGRESS_RUNNER_UID", "runnerd"),
        (
            "nameservers = [\"10.0.0.2\", \"[::1]:5353\"]",
            "SCIENCE_AGENT_EGRESS_NAMESERVERS",
            "10.0.0.2,[::1]:5353",
        ),
        ("nameservers = \"10.0.0.2, 10.0.0.3\"", "SCIENCE_AGENT_EGRESS_NAMESERVERS", "10.0.0.2, 10.0.0.3"),
    ];
    for (text, var, want) in cases {
        let file = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(file.get(var), Some(*want), "{text}");
        assert_eq!(file.line(var), Some(1), "{text}");
    }
}

#[test]
fn comments_blank_values_and_empty_files() {
    let file = parse("").unwrap();
    assert_eq!(file.get("SCIENCE_AGENT_RUNNER_HOST"), None);
    let file = parse("# nothing but comments\n\n   # runner_port = 1\n").unwrap();
    assert_eq!(file.get("SCIENCE_AGENT_RUNNER_PORT"), None);
    // An empty string or array is an unset setting, as an empty variable is.
    let file = parse("runner_host = \"\"\nnameservers = []\nrunner_port = 1 # trailing\n").unwrap();
    assert_eq!(file.get("SCIENCE_AGENT_RUNNER_HOST"), None);
    assert_eq!(file.get("SCIENCE_AGENT_EGRESS_NAMESERVERS"), None);
    assert_eq!(
        (file.get("SCIENCE_AGENT_RUNNER_PORT"), file.line("SCIENCE_AGENT_RUNNER_PORT")),
        (Some("1"), Some(3))
    );
}

#[test]
fn errors_name_the_key_the_file_and_the_line() {
    let cases: &[(&str, &str)] = &[
        (
            "runner_prot = 1",
            "unknown key runner_prot in /etc/sciencediscovery/testd.toml:1 (did you mean runner_port?)",
        ),
        (
            "\n\nSCIENCE_AGENT_NPU_BROKER = true",
            "unknown key SCIENCE_AGENT_NPU_BROKER in /etc/sciencediscovery/testd.toml:3 (did you mean npu_broker?)",
        ),
        (
            "max-workspace-bytes = 1",
            "unknown key max-workspace-bytes in /etc/sciencediscovery/testd.toml:1 (did you mean max_workspace_bytes?)",
        ),
        ("completely_else = 1", "unknown key completely_else in /etc/sciencediscovery/testd.toml:1"),
        (
            "[runnerd]\nrunner_port = 1",
            "[runnerd] in /etc/sciencediscovery/testd.toml:1: testd's settings are top-level keys, without [sections]",
        ),
        (
            "runner_token = \"s3cret\"",
            "runner_token in /etc/sciencediscovery/testd.toml:1 is not accepted: use runner_token_file",
        ),
        ("SCIENCE_AGENT_RUNNER_TOKEN = \"s3cret\"", "is not accepted: use runner_token_file"),
        (
            "runner_port = 1.5",
            "runner_port in /etc/sciencediscovery/testd.toml:1 must be an integer (or a string of digits), not the number 1.5",
        ),
        (
            "runner_port = true",
            "runner_port in /etc/sciencediscovery/testd.toml:1 must be an integer (or a string of digits), not the boolean true",
        ),
        (
            "runner_host = 127",
            "runner_host in /etc/sciencediscovery/testd.toml:1 must be a string, not the integer 127",
        ),
        ("runner_host = [\"a\"]", "must be a string, not an array"),
        (
            "npu_broker = 1",
            "npu_broker in /etc/sciencediscovery/testd.toml:1 must be true or false, not the integer 1",
        ),
        ("npu_broker = \"maybe\"", "must be true or false, not the string \"maybe\""),
        (
            "nameservers = [\"10.0.0.2\", 53]",
            "nameservers in /etc/sciencediscovery/testd.toml:1 must be an array of strings",
        ),
        (
            "runner_uid = true",
            "runner_uid in /etc/sciencediscovery/testd.toml:1 must be a name (string) or a number (integer)",
        ),
        ("runner_port = 1979-05-27", "must be an integer (or a string of digits), not the date 1979-05-27"),
        ("runner_port = ", "the configuration file /etc/sciencediscovery/testd.toml is not valid TOML"),
        ("runner_port = 1\nrunner_port = 2", "is not valid TOML"),
    ];
    for (text, needle) in cases {
        let err = common_error_chain(&parse(text).unwrap_err());
        assert!(err.contains(needle), "{text:?}:\n  got  {err}\n  want {needle}");
        assert!(!err.contains("s3cret"), "{text:?}: the value of a refused key is never repeated: {err}");
    }
}

fn common_error_chain(e: &SettingsError) -> String {
    crate::error_chain(e)
}

#[test]
fn the_first_problem_by_line_is_reported() {
    let err = parse("zzz = 1\naaa = 2\n").unwrap_err().to_string();
    assert!(err.contains("zzz in /etc/sciencediscovery/testd.toml:1"), "{err}");
}

#[test]
fn environment_overrides_the_file() {
    let text = "runner_host = \"0.0.0.0\"\nrunner_port = 4312\n";
    let l = layered(text, &[("SCIENCE_AGENT_RUNNER_PORT", "5000"), ("RUNTIME_DIRECTORY", "/run/x")]);
    assert_eq!(l.var("SCIENCE_AGENT_RUNNER_HOST").as_deref(), Some("0.0.0.0"));
    assert_eq!(l.origin("SCIENCE_AGENT_RUNNER_HOST"), Origin::File { path: PATH.into(), line: 1 });
    assert_eq!(l.var("SCIENCE_AGENT_RUNNER_PORT").as_deref(), Some("5000"));
    assert_eq!(
        l.origin("SCIENCE_AGENT_RUNNER_PORT"),
        Origin::Environment("SCIENCE_AGENT_RUNNER_PORT".into())
    );
    // Not a key of the file: passes through.
    assert_eq!(l.var("RUNTIME_DIRECTORY").as_deref(), Some("/run/x"));
    assert_eq!(l.var("SCIENCE_AGENT_MAX_WORKSPACE_BYTES"), None);
    assert_eq!(l.origin("SCIENCE_AGENT_MAX_WORKSPACE_BYTES"), Origin::Default);
    // An empty variable is unset: the file applies.
    let l = layered(text, &[("SCIENCE_AGENT_RUNNER_HOST", " ")]);
    assert_eq!(l.var("SCIENCE_AGENT_RUNNER_HOST").as_deref(), Some("0.0.0.0"));
}

#[test]
fn errors_are_described_where_the_value_came_from() {
    let l = layered("\nmax_workspace_bytes = -1\n", &[("SCIENCE_AGENT_RUNNER_PORT", "x")]);
    assert_eq!(
        l.describe("SCIENCE_AGENT_MAX_WORKSPACE_BYTES"),
        "max_workspace_bytes in /etc/sciencediscovery/testd.toml:2"
    );
    assert_eq!(l.describe("SCIENCE_AGENT_RUNNER_PORT"), "SCIENCE_AGENT_RUNNER_PORT");
    assert_eq!(l.describe("--max-tunnels"), "--max-tunnels");
}

#[test]
fn choosing_the_file() {
    let none = env(&[]);
    let set = env(&[("SCIENCE_AGENT_CONFIG", "/srv/r.toml")]);
    assert_eq!(
        FileChoice::choose(None, "SCIENCE_AGENT_CONFIG", &none, PATH),
        FileChoice::Default(PATH.into())
    );
    assert_eq!(
        FileChoice::choose(None, "SCIENCE_AGENT_CONFIG", &set, PATH),
        FileChoice::Explicit { path: "/srv/r.toml".into(), named_by: "SCIENCE_AGENT_CONFIG".into() }
    );
    assert_eq!(
        FileChoice::choose(Some(Path::new("/x.toml")), "SCIENCE_AGENT_CONFIG", &set, PATH),
        FileChoice::Explicit { path: "/x.toml".into(), named_by: "--config".into() }
    );
}

#[test]
fn missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.toml");
    // The default file may be absent: defaults apply.
    let l = Layered::load(&SCHEMA, FileChoice::Default(absent.clone()), env(&[])).unwrap();
    assert!(l.file().is_none());
    assert!(l.file_status().contains("absent: defaults apply"), "{}", l.file_status());
    // A file that was asked for must exist.
    let choice = FileChoice::Explicit { path: absent.clone(), named_by: "--config".into() };
    let err = Layered::load(&SCHEMA, choice, env(&[])).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("the configuration file {} (named by --config) does not exist", absent.display())
    );
    // Present and readable.
    let present = dir.path().join("present.toml");
    std::fs::write(&present, "runner_port = 7\n").unwrap();
    let choice = FileChoice::Explicit { path: present.clone(), named_by: "--config".into() };
    let l = Layered::load(&SCHEMA, choice, env(&[])).unwrap();
    assert_eq!(l.var("SCIENCE_AGENT_RUNNER_PORT").as_deref(), Some("7"));
    // A directory is not a file.
    let err = Layered::load(&SCHEMA, FileChoice::Default(dir.path().into()), env(&[])).unwrap_err();
    assert!(matches!(err, SettingsError::Read { .. }), "{err}");
}

#[test]
fn suggestions() {
    assert_eq!(SCHEMA.suggest("runner_hots"), Some("runner_host"));
    assert_eq!(SCHEMA.suggest("RUNNER_PORT"), Some("runner_port"));
    assert_eq!(SCHEMA.suggest("science_agent_runner_port"), Some("runner_port"));
    assert_eq!(SCHEMA.suggest("nameserver"), Some("nameservers"));
    assert_eq!(SCHEMA.suggest("bogus"), None);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
}

#[test]
fn rendering() {
    let rows = [Row::new("a", "1", Origin::Default), Row::new("longer_key", "two", "file /x:2")];
    assert_eq!(render(&rows), "  a           1    default\n  longer_key  two  file /x:2\n");
}
