//! Scientific environments with a real R (issue #16): the test channel's `r-base` copied from
//! the distribution's R (`r-base-core`) into a conda package, so that R itself runs from the
//! environment's prefix inside our sandboxes; and a CRAN-like repository the test builds (one
//! pure-R source package and its `PACKAGES` index) served over plain HTTP on loopback, which
//! the provisioning sandbox reaches only through egressd under a name (`cran.test`).
//!
//! Without R these tests fail in CI (the machine is meant to have it) and skip loudly
//! elsewhere.

use std::path::{Path, PathBuf};

use runner_tests::egress::{Egressd, FakeDns};
use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};
use serde_json::{Value, json};

use super::environments::{environment, get, post, serve_channel, setup_outcome};

/// The package the repository serves: a name, a version, and what its one function says.
const PKG: &str = "tinyr";
const PKG_VERSION: &str = "1.0.2";
const ANSWER: &str = "tinyr says 42";
/// What its DESCRIPTION names as the repository (CRAN's tarballs say `Repository: CRAN`).
const REPOSITORY: &str = "TestCRAN";

/// The host's R home when the distribution's R is installed; `None` (after saying so) when
/// the test must skip. In CI a missing R fails the test.
fn real_r_or_skip(test: &str) -> Option<PathBuf> {
    if !sandbox_or_skip(test) {
        return None;
    }
    match test_channel::host_r_home() {
        Some(home) => Some(home),
        None if runner_tests::in_ci() => {
            panic!(
                "{test}: R is missing: install r-base-core (apt-get install --no-install-recommends r-base-core)"
            )
        }
        None => {
            eprintln!(
                "\n!!! SKIPPING {test}: no R on this machine (apt-get install --no-install-recommends r-base-core) !!!\n"
            );
            None
        }
    }
}

/// An R function (called at install time) that writes, into the R home of the environment,
/// whether each of two URLs could be read (`<R home>/egress-probe.txt`: `channel=…`, `other=…`).
const EGRESS_PROBE: &str = "(function(channel, other) { probe <- function(u) tryCatch({ con <- url(u); on.exit(close(con)); readLines(con, warn = FALSE); \"reached\" }, error = function(e) \"refused\", warning = function(w) \"refused\"); writeLines(c(paste0(\"channel=\", probe(channel)), paste0(\"other=\", probe(other))), file.path(R.home(), \"egress-probe.txt\")) })";

/// A CRAN-like repository in `dir`: `src/contrib/tinyr_1.0.2.tar.gz` (DESCRIPTION,
/// NAMESPACE, R/answer.R, as `R CMD build` lays a pure-R package out) and its
/// `src/contrib/PACKAGES` index.
fn build_cran_repo(dir: &Path, port: u16) {
    let source = dir.join("build").join(PKG);
    let description = format!(
        "Package: {PKG}\nVersion: {PKG_VERSION}\nTitle: A Tiny Test Package\nDescription: One function, for the runner's tests.\n\
         Author: Runner tests\nMaintainer: Runner tests <tests@example.invalid>\nLicense: MIT\n\
         NeedsCompilation: no\nRepository: {REPOSITORY}\n"
    );
    for (path, text) in [
        ("DESCRIPTION", description),
        ("NAMESPACE", "export(answer)\n".to_owned()),
        ("R/answer.R", format!("answer <- function() \"{ANSWER}\"\n")),
        // Top-level code, run while R CMD INSTALL builds the lazy-load database: that is,
        // inside the provisioning sandbox, as a hostile package's would be. It tries the
        // repository's host and one the step was not given.
        (
            "R/probe.R",
            format!(
                "{EGRESS_PROBE}(\"http://cran.test:{port}/src/contrib/PACKAGES\", \"http://blocked.test:{port}/src/contrib/PACKAGES\")\n"
            ),
        ),
    ] {
        let file = source.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, text).unwrap();
    }
    let contrib = dir.join("src/contrib");
    std::fs::create_dir_all(&contrib).unwrap();
    let tarball = contrib.join(format!("{PKG}_{PKG_VERSION}.tar.gz"));
    let status = std::process::Command::new("tar")
        .arg("-C")
        .arg(source.parent().unwrap())
        .arg("-czf")
        .arg(&tarball)
        .arg(PKG)
        .status()
        .expect("tar runs");
    assert!(status.success(), "the source package is packed");
    let index = format!("Package: {PKG}\nVersion: {PKG_VERSION}\nLicense: MIT\nNeedsCompilation: no\n\n");
    std::fs::write(contrib.join("PACKAGES"), index).unwrap();
}

struct RealR {
    server: Server,
    egressd: Egressd,
    _dns: FakeDns,
    _scratch: tempfile::TempDir,
    /// The host R's `X.Y.Z`: the version of the channel's real `r-base`.
    version: String,
    /// Requests the CRAN repository served.
    cran_requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// runnerd with the demo channel (its stubs included) plus the real `r-base`, starter-r
/// pinned to the real one, and the CRAN repository at `http://cran.test:PORT`; setup ready.
async fn start_real_r(r_home: &Path) -> RealR {
    let scratch = runner_tests::scratch_dir();
    let channel_dir = scratch.path().join("channel");
    // The demo channel (stubs included: the pin below keeps them out) plus the real R.
    let mut channel = test_channel::demo(&channel_dir).expect("the test channel builds");
    channel.r_from_host(r_home).expect("the real r-base builds");
    channel.index().expect("the channel indexes");
    let url = channel.url();
    let version = test_channel::host_r_version(r_home).expect("the host R reports its version");
    let cran_dir = scratch.path().join("cran");
    std::fs::create_dir_all(&cran_dir).unwrap();
    runner_tests::hand_tree_to_sandbox(scratch.path());
    let (port, cran_requests) = serve_channel(cran_dir.clone());
    build_cran_repo(&cran_dir, port);
    runner_tests::hand_tree_to_sandbox(&cran_dir);
    // A name on loopback, as an offline site's CRAN mirror on its LAN would be: allowed
    // because the operator configured it.
    let dns = FakeDns::start(&[("cran.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let egressd = Egressd::start(dns.addr, &[]);
    let mut env = egressd.runner_env();
    env.extend([
        ("SCIENTIFIC_ENVS".to_owned(), "1".to_owned()),
        ("SCIENCE_AGENT_SCIENTIFIC_CHANNELS".to_owned(), url),
        ("SCIENCE_AGENT_STARTER_PYTHON_SPECS".to_owned(), "python,tinyutil=1.0".to_owned()),
        ("SCIENCE_AGENT_STARTER_R_SPECS".to_owned(), format!("r-base={version}")),
        ("SCIENCE_AGENT_CRAN_REPO".to_owned(), format!("http://cran.test:{port}")),
    ]);
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let setup = setup_outcome(&server).await;
    assert_eq!(setup["state"], "ready", "{setup}\n{}", server.stderr());
    RealR { server, egressd, _dns: dns, _scratch: scratch, version, cran_requests }
}

/// `/execute` with `language: "r"` (starter-r, or the environment of `revision`).
async fn r(server: &Server, revision: Option<&str>, code: &str) -> (u16, Value) {
    let ws = server.project_workspace("envs-r");
    let mut body = shell_request("main", "envs-r", &ws, code);
    body["language"] = "r".into();
    if let Some(rev) = revision {
        body["environmentRevisionId"] = rev.into();
    }
    let reply = server.client().post_signed("/execute", &body).await.unwrap();
    (reply.status, reply.json())
}

/// What an R run reports about itself: one `key=value` line each.
const R_PROBE: &str = r#"
cat("version=", R.version$major, ".", R.version$minor, "\n", sep = "")
cat("home=", R.home(), "\n", sep = "")
cat("libpaths=", paste(.libPaths(), collapse = ":"), "\n", sep = "")
cat("environ-user=[", Sys.getenv("R_ENVIRON_USER"), "]\n", sep = "")
maps <- readLines("/proc/self/maps")
cat("libR=", sub(".* ", "", grep("/libR\\.so$", maps, value = TRUE)[1]), "\n", sep = "")
cat("host-R-size=", file.info("/usr/bin/R")$size, "\n", sep = "")
cat("host-Rscript-size=", file.info("/usr/bin/Rscript")$size, "\n", sep = "")
cat("write-prefix=", suppressWarnings(file.create("/opt/science-env/lib/R/library/planted")), "\n", sep = "")
cat("stats=", stats::median(c(1, 5, 9)), "\n", sep = "")
cat("etc-R=", file.exists("/etc/R"), "\n", sep = "")
"#;

#[tokio::test]
async fn r_runs_for_real_from_starter_r_read_only_with_the_host_r_masked() {
    let test = "r_runs_for_real_from_starter_r";
    let Some(home) = real_r_or_skip(test) else {
        return;
    };
    let envs = start_real_r(&home).await;
    let s = &envs.server;
    // As the original: `language: "r"` runs only once an R environment exists, and an
    // execution never installs starter-r by itself (issue #30).
    let (status, v) = r(s, None, R_PROBE).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("Unknown scientific environment: starter-r")),
        "{v}"
    );
    let (_, list) = get(s, "/environments").await;
    assert!(!list.to_string().contains("\"starter-r\""), "{list}");
    let (status, env) = post(s, "/environments", json!({"name": "r-first", "language": "r"})).await;
    assert_eq!(status, 201, "{env}\n{}", s.stderr());
    let (status, v) = r(s, None, R_PROBE).await;
    assert_eq!(status, 200, "{v}\n{}", s.stderr());
    let out = v["stdout"].as_str().unwrap();
    assert_eq!(v["environmentVariables"]["R_ENVIRON_USER"], "/dev/null", "{v}");
    assert_eq!(v["environmentVariables"]["PATH"], "/opt/science-env/bin:/usr/bin", "{v}");
    let (_, list) = get(s, "/environments").await;
    let starter = environment(&list, "starter-r");
    assert_eq!(starter["status"], "ready", "{starter}");
    let rev = starter["currentRevisionId"].as_str().unwrap();
    assert_eq!(v["environmentRevisionId"], rev, "{v}");
    let (_, revision) = get(s, "/environment-revisions").await;
    let record = revision.as_array().unwrap().iter().find(|r| r["id"] == rev).unwrap();
    assert!(
        record["packages"]
            .as_array()
            .unwrap()
            .contains(&json!(format!("r-base={}=0_copy_of_host_r", envs.version))),
        "starter-r holds the real r-base, not a stub: {record}"
    );
    for line in [
        format!("version={}\n", envs.version),
        "home=/opt/science-env/lib/R\n".to_owned(),
        "libpaths=/opt/science-env/lib/R/library\n".to_owned(),
        // The run starts R with R_ENVIRON_USER=/dev/null (above); R's own front end empties it
        // for `--vanilla` (no user environ file either way), as conda's r-base does.
        "environ-user=[]\n".to_owned(),
        // The interpreter is the prefix's copy, not the host's /usr/lib/R.
        "libR=/opt/science-env/lib/R/lib/libR.so\n".to_owned(),
        "host-R-size=0\nhost-Rscript-size=0\n".to_owned(),
        "write-prefix=FALSE\n".to_owned(),
        "stats=5\n".to_owned(),
        // The sandbox shows no /etc/R: what R needs from it is in the prefix's lib/R/etc.
        "etc-R=FALSE\n".to_owned(),
    ] {
        assert!(out.contains(&line), "{line:?} in\n{out}\n{v}");
    }
    // The prefix at its own path is read-only too.
    let prefix = s.path(&format!("scientific-envs/revisions/starter-r/{rev}"));
    let code = format!(
        "cat(dir.exists({p:?}), suppressWarnings(file.create(file.path({p:?}, \"planted\"))), \"\\n\")",
        p = prefix.display().to_string()
    );
    let (status, v) = r(s, None, &code).await;
    assert_eq!((status, v["stdout"].as_str()), (200, Some("TRUE FALSE \n")), "{v}");
    // Rscript from the environment's PATH is the prefix's too.
    let code = "cat(system2(\"Rscript\", c(\"-e\", shQuote(\"cat(R.home())\")), stdout = TRUE), \"\\n\")";
    let (status, v) = r(s, None, code).await;
    assert_eq!((status, v["stdout"].as_str()), (200, Some("/opt/science-env/lib/R \n")), "{v}");
}

#[tokio::test]
async fn a_cran_install_lands_in_a_new_revision_and_loads_from_the_environment() {
    let test = "a_cran_install_lands_in_a_new_revision";
    let Some(home) = real_r_or_skip(test) else {
        return;
    };
    let envs = start_real_r(&home).await;
    let s = &envs.server;
    let (status, env) = post(s, "/environments", json!({"name": "r-analysis", "language": "r"})).await;
    assert_eq!(status, 201, "{env}\n{}", s.stderr());
    let id = env["id"].as_str().unwrap().to_owned();
    let first = env["currentRevisionId"].as_str().unwrap().to_owned();
    let body = json!({"manager": "cran", "packages": [PKG]});
    let (status, rev) = post(s, &format!("/environments/{id}/install"), body).await;
    assert_eq!(status, 201, "{rev}\n{}\n{}", s.stderr(), envs.egressd.log());
    let rev_id = rev["id"].as_str().unwrap().to_owned();
    assert_ne!(rev_id, first);
    let cran = rev["channels"][0].as_str().unwrap().to_owned();
    assert!(cran.starts_with("http://cran.test:"), "{rev}");
    assert!(rev["packages"].as_array().unwrap().contains(&json!(format!("r:{PKG}=={PKG_VERSION}"))), "{rev}");
    assert!(envs.cran_requests.load(std::sync::atomic::Ordering::SeqCst) > 0, "the repository was read");
    let log = envs.egressd.log();
    assert!(log.contains("host=cran.test") && log.contains("decision=\"allowed\""), "{log}");
    // From inside the provisioning sandbox, the package's own install-time code reached the
    // repository and nothing else, though both names lead to the same server.
    let probe = s.path(&format!(
        "scientific-envs/revisions/{id}/{}/lib/R/egress-probe.txt",
        env["runtimeRevisionId"].as_str().unwrap()
    ));
    let seen = std::fs::read_to_string(&probe).unwrap_or_else(|e| panic!("{}: {e}", probe.display()));
    assert_eq!(seen, "channel=reached\nother=refused\n", "{log}");
    let denied = log.lines().find(|l| l.contains("host=blocked.test")).unwrap_or_default();
    assert!(denied.contains("decision=\"denied\""), "{log}");

    // The snapshot's R inventory is real R's `installed.packages()`.
    let (status, snap) = get(s, &format!("/environment-revisions/{rev_id}/snapshot")).await;
    assert_eq!(status, 200, "{snap}");
    assert_eq!(snap["requestedChanges"], json!([format!("cran:{PKG}")]));
    let inventory = snap["installed"]["r"].as_array().unwrap();
    assert!(
        inventory.contains(&json!({"name": PKG, "version": PKG_VERSION, "repository": REPOSITORY})),
        "{inventory:?}"
    );
    assert!(
        inventory.contains(&json!({"name": "stats", "version": envs.version, "repository": ""})),
        "base packages are listed with R's version: {inventory:?}"
    );

    let code =
        format!("library({PKG}); cat({PKG}::answer(), \"\\n\"); cat(find.package(\"{PKG}\"), \"\\n\")");
    let (status, v) = r(s, Some(&rev_id), &code).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stdout"], format!("{ANSWER} \n/opt/science-env/lib/R/library/{PKG} \n"), "{v}");
    assert_eq!(v["environmentRevisionId"], rev_id.as_str());
    // starter-r (the base it was cloned from) does not have it.
    let code = format!("cat(requireNamespace(\"{PKG}\", quietly = TRUE), \"\\n\")");
    let (status, v) = r(s, None, &code).await;
    assert_eq!((status, v["stdout"].as_str()), (200, Some("FALSE \n")), "{v}");
}

#[tokio::test]
async fn a_cran_package_the_repository_lacks_fails_the_install_and_a_later_one_repairs_it() {
    let test = "a_cran_package_the_repository_lacks_fails_the_install";
    let Some(home) = real_r_or_skip(test) else {
        return;
    };
    let envs = start_real_r(&home).await;
    let s = &envs.server;
    let (status, env) = post(s, "/environments", json!({"name": "r-repair", "language": "r"})).await;
    assert_eq!(status, 201, "{env}\n{}", s.stderr());
    let id = env["id"].as_str().unwrap().to_owned();
    let first = env["currentRevisionId"].as_str().unwrap().to_owned();
    let body = json!({"manager": "cran", "packages": ["nosuchpkg"]});
    let (status, v) = post(s, &format!("/environments/{id}/install"), body).await;
    assert_eq!(status, 400, "{v}\n{}", s.stderr());
    // R's own text, as the original's (R says so and exits 0; the step makes it an error).
    let error = v["error"].as_str().unwrap();
    assert!(error.starts_with("cran step failed: "), "{v}");
    assert!(error.contains("package 'nosuchpkg' is not available"), "{v}");
    let (_, list) = get(s, "/environments").await;
    let e = environment(&list, &id);
    assert_eq!(e["status"], "failed", "{e}");
    assert_eq!(e["currentRevisionId"], first.as_str(), "no revision for a failed install");
    assert!(e["error"].as_str().unwrap().starts_with("In-place update failed"), "{e}");
    let (status, v) = r(s, Some(&first), "cat(1)").await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("is failed"), "{v}");

    // A later install repairs it, and R runs in it again.
    let body = json!({"manager": "cran", "packages": [PKG]});
    let (status, rev) = post(s, &format!("/environments/{id}/install"), body).await;
    assert_eq!(status, 201, "{rev}\n{}", s.stderr());
    let (_, list) = get(s, "/environments").await;
    assert_eq!(environment(&list, &id)["status"], "ready");
    let rev_id = rev["id"].as_str().unwrap();
    let (status, v) = r(s, Some(rev_id), &format!("cat({PKG}::answer())")).await;
    assert_eq!((status, v["stdout"].as_str()), (200, Some(ANSWER)), "{v}");
}
