//! `<dataDir>/python-packages` (issue #17, contract §2A env rules): bound read-only at
//! /opt/sciencediscovery-python-packages, `pyX.Y` over `py3` over the directory itself, with
//! `PYTHONPATH` naming it, `PYTHONNOUSERSITE=1` and Python run without `-I`; checked from
//! inside a real sandbox. A python-packages that is a symlink is never bound.

use std::path::Path;

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, shell_request};
use serde_json::Value;

const MOUNT: &str = "/opt/sciencediscovery-python-packages";

const PROBE: &str = r#"
import os, sys
try:
    import tinymod
    print("module=" + tinymod.WHERE)
except ImportError:
    print("module=none")
print("pythonpath=" + os.environ.get("PYTHONPATH", "unset"))
print("nousersite=" + os.environ.get("PYTHONNOUSERSITE", "unset"))
print("isolated=%d" % sys.flags.isolated)
try:
    open("/opt/sciencediscovery-python-packages/planted.py", "w")
    print("write=allowed")
except OSError as e:
    print("write=refused")
"#;

fn module(dir: &Path, label: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tinymod.py"), format!("WHERE = {label:?}\n")).unwrap();
}

async fn run(server: &Server, path: &str, code: &str) -> String {
    let ws = server.project_workspace("session");
    let body = shell_request("main", "session", &ws, code);
    let reply = server.client().post_signed(path, &body).await.expect("runnerd answers");
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    let v: Value = reply.json();
    assert_eq!(v["exitCode"], 0, "{v}");
    v["stdout"].as_str().unwrap_or_default().to_owned()
}

fn lines(out: &str) -> Vec<&str> {
    out.lines().collect()
}

#[tokio::test]
async fn python_packages_are_importable_read_only_with_the_contract_variables() {
    if !sandbox_or_skip("python_packages_are_importable_read_only_with_the_contract_variables") {
        return;
    }
    let server = Server::start();
    let base = server.data_dir.join("python-packages");

    // Absent: the plain launch, `-I` and no PYTHONPATH.
    let out = run(&server, "/execute", PROBE).await;
    assert_eq!(
        lines(&out),
        ["module=none", "pythonpath=unset", "nousersite=1", "isolated=1", "write=refused"],
        "{out}"
    );

    // py3 (detected per execution: no restart).
    module(&base.join("py3"), "py3");
    let out = run(&server, "/execute", PROBE).await;
    let want_pythonpath = format!("pythonpath={MOUNT}");
    assert_eq!(
        lines(&out),
        ["module=py3", want_pythonpath.as_str(), "nousersite=1", "isolated=0", "write=refused"],
        "{out}\n{}",
        server.stderr()
    );

    // pyX.Y of the interpreter runnerd uses wins over py3.
    let real = std::fs::canonicalize("/usr/bin/python3").unwrap();
    let name = real.file_name().unwrap().to_string_lossy().into_owned();
    if let Some(version) = name.strip_prefix("python").filter(|v| v.contains('.')) {
        module(&base.join(format!("py{version}")), "versioned");
        let out = run(&server, "/execute", PROBE).await;
        assert!(out.starts_with("module=versioned\n"), "{out}");
    }

    // A shell sees the variables too (its python3 can import the packages).
    let out = run(
        &server,
        "/execute-shell",
        "echo \"$PYTHONPATH|$PYTHONNOUSERSITE\"; /usr/bin/python3 -c 'import tinymod; print(tinymod.WHERE)'",
    )
    .await;
    assert!(out.starts_with(&format!("{MOUNT}|1\n")), "{out}");
}

#[tokio::test]
async fn a_python_packages_symlink_is_never_bound() {
    if !sandbox_or_skip("a_python_packages_symlink_is_never_bound") {
        return;
    }
    let server = Server::start();
    // Somewhere else entirely, reached only through the symlink.
    let elsewhere = server.data_dir.join("projects").join("elsewhere-packages");
    module(&elsewhere.join("py3"), "through-symlink");
    std::os::unix::fs::symlink(&elsewhere, server.data_dir.join("python-packages")).unwrap();
    let out = run(&server, "/execute", PROBE).await;
    assert_eq!(
        lines(&out),
        ["module=none", "pythonpath=unset", "nousersite=1", "isolated=1", "write=refused"],
        "{out}"
    );
    assert!(server.stderr().contains("python_packages_skipped"), "{}", server.stderr());
}
