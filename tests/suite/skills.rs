//! Skill packages through HTTP against the real binary (contract §5.2, §2A, §7 item 41;
//! R-WS-3): publication, ids and hashes, every refusal, concurrent identical posts, a
//! restart, the read-only mount with only the selected package visible, the writable
//! extensions directory, and packages tampered with after publication. Issue #32: deep or
//! wide bundles refused before a directory is made, and `DELETE /skill-packages/:id`.

use std::path::{Path, PathBuf};

use common::egress::route::base64;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, finished_record, shell_request};
use runnerctl::client::RunnerClient;

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The original's package hash, written out independently of runnerd's.
fn package_hash(files: &[(&str, &[u8])]) -> String {
    let mut sorted = files.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = Sha256::new();
    for (p, b) in sorted {
        h.update(format!("{}:{}:{}:", p.len(), p, b.len()).as_bytes());
        h.update(b);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn skill(id: &str, revision: u64, files: &[(&str, &[u8])]) -> Value {
    json!({
        "id": id, "revision": revision, "version": format!("{revision}.0"),
        "hash": package_hash(files),
        "files": files.iter().map(|(p, b)| json!({
            "path": p, "size": b.len(), "hash": hex(b), "content": base64(b),
        })).collect::<Vec<_>>(),
    })
}

fn bundle_id(skills: &[&Value]) -> String {
    let mut refs: Vec<&&Value> = skills.iter().collect();
    refs.sort_by_key(|s| s["id"].as_str().unwrap().to_owned());
    let text = Value::Array(
        refs.iter()
            .map(|s| json!({"hash": s["hash"], "id": s["id"], "revision": s["revision"], "version": s["version"]}))
            .collect(),
    )
    .to_string();
    hex(text.as_bytes())
}

const RUN_SH: &[u8] = b"echo selected\nexit 7\n";

fn demo() -> Value {
    skill("demo", 1, &[("SKILL.md", b"# demo\n"), ("scripts/run.sh", RUN_SH)])
}

fn packages_dir(server: &Server) -> PathBuf {
    server.data_dir.canonicalize().unwrap().join("projects/.skill-packages")
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(d) => d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    names
}

async fn publish(client: &RunnerClient, skills: &[&Value]) -> (u16, Value) {
    let r = client.post_json("/skill-packages", &json!({"skills": skills})).await.unwrap();
    (r.status, r.json())
}

/// Sends only a head announcing `length` bytes; returns the answer's status and error.
fn announce(server: &Server, path: &str, length: u64) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(server.address()).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: runnerd\r\nAuthorization: Bearer {}\r\nContent-Length: {length}\r\n\r\n",
        runner_tests::server::TEST_TOKEN
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("an answer before the body was sent");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
    let body: Value = serde_json::from_str(body.trim()).unwrap_or(Value::Null);
    (status, body["error"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn bundles_publish_idempotently_and_every_refusal_names_its_kind() {
    let server = Server::start();
    let client = server.client();
    let id = bundle_id(&[&demo()]);
    let root = packages_dir(&server).join(&id);

    // Absent: 200 {id}; a malformed id is no route (404), after auth (401 first).
    let absent = client.get(&format!("/skill-packages/{id}")).await.unwrap();
    assert_eq!((absent.status, absent.json()), (200, json!({"id": id})));
    for bad in [&id[..63], &id.to_uppercase(), &format!("{id}0")] {
        assert_eq!(client.get(&format!("/skill-packages/{bad}")).await.unwrap().status, 404, "{bad}");
    }
    let anonymous = server.client_with_token("wrong");
    assert_eq!(anonymous.get(&format!("/skill-packages/{}", &id[..10])).await.unwrap().status, 401);

    // Every refusal writes nothing.
    let good = demo();
    let variant = |f: &dyn Fn(&mut Value)| {
        let mut s = good.clone();
        f(&mut s);
        s
    };
    let cases: Vec<(Value, &str)> = vec![
        (json!({"skills": [variant(&|s| s["hash"] = json!("0".repeat(64)))]}), "integrity"),
        (
            json!({"skills": [variant(&|s| s["files"][1]["content"] = json!(base64(b"echo forged\n")))]}),
            "integrity",
        ),
        (json!({"skills": [variant(&|s| s["files"][1]["size"] = json!(3))]}), "integrity"),
        (json!({"skills": [variant(&|s| s["files"][1]["hash"] = json!(hex(b"other")))]}), "integrity"),
        (json!({"skills": [good.clone(), good.clone()]}), "metadata"),
        (json!({"skills": [variant(&|s| s["revision"] = json!(0))]}), "metadata"),
        (json!({"skills": [variant(&|s| s["id"] = json!("Not_Valid"))]}), "metadata"),
        (json!({"skills": []}), "metadata"),
        (json!({"skills": [skill("demo", 1, &[("README.md", b"no skill file")])]}), "SKILL.md"),
    ];
    let mut cases = cases;
    for bad_path in ["../escape", "/absolute", "a//b", "a/./b", "a\\b", "a\0b", "scripts/../../x"] {
        cases.push((json!({"skills": [skill("demo", 1, &[("SKILL.md", b"x"), (bad_path, b"y")])]}), "path"));
    }
    for (body, word) in &cases {
        let r = client.post_json("/skill-packages", body).await.unwrap();
        let error = r.json()["error"].as_str().unwrap_or_default().to_owned();
        assert_eq!(r.status, 400, "{body}: {error}");
        assert!(error.contains(word), "{word:?} not in {error:?}");
        assert!(
            entries(&packages_dir(&server)).is_empty(),
            "a refused bundle wrote {:?}",
            entries(&packages_dir(&server))
        );
    }

    // Published: the id and hashes as the original computes them, at the contract's root.
    let (status, answer) = publish(&client, &[&good]).await;
    assert_eq!((status, &answer), (200, &json!({"id": id, "root": root.to_string_lossy()})));
    assert_eq!(std::fs::read(root.join("demo/scripts/run.sh")).unwrap(), RUN_SH);
    assert_eq!(std::fs::read(root.join("demo/SKILL.md")).unwrap(), b"# demo\n");
    let present = client.get(&format!("/skill-packages/{id}")).await.unwrap();
    assert_eq!((present.status, present.json()), (200, answer.clone()));
    // Idempotent; a new revision or new content is a new id.
    assert_eq!(publish(&client, &[&good]).await, (200, answer.clone()));
    let revised = skill("demo", 2, &[("SKILL.md", b"# demo\n"), ("scripts/run.sh", RUN_SH)]);
    let (status, other) = publish(&client, &[&revised]).await;
    assert_eq!(status, 200);
    assert_eq!(other["id"], json!(bundle_id(&[&revised])));
    assert_ne!(other["id"], answer["id"]);
    assert_eq!(
        entries(&packages_dir(&server)).len(),
        2,
        "no staging left: {:?}",
        entries(&packages_dir(&server))
    );

    // The route's own limit: a 3 MB bundle (over the 2,000,000 of other routes) publishes;
    // a body over 64 MiB answers the contract's text.
    let big = vec![b'x'; 3_000_000];
    let large = skill("large", 1, &[("SKILL.md", b"big"), ("data.bin", &big)]);
    assert_eq!(publish(&client, &[&large]).await.0, 200);
    let (status, error) = announce(&server, "/skill-packages", 67_108_865);
    assert_eq!((status, error.as_str()), (400, "Request body exceeds the 67108864 byte limit"));
    let (status, error) = announce(&server, "/kernels/teardown", 2_000_001);
    assert_eq!((status, error.as_str()), (400, "Request body exceeds the 2000000 byte limit"));
}

#[tokio::test]
async fn concurrent_identical_posts_publish_one_package_and_a_restart_keeps_it() {
    let mut server = Server::start();
    let client = server.client();
    let skills = [demo(), skill("second", 1, &[("SKILL.md", b"# second\n")])];
    let body = json!({"skills": skills});
    let posts: Vec<_> = (0..8)
        .map(|_| {
            let (client, body) = (server.client(), body.clone());
            tokio::spawn(async move { client.post_json("/skill-packages", &body).await.unwrap() })
        })
        .collect();
    let _ = &client;
    let mut answers = Vec::new();
    for p in posts {
        let r = p.await.unwrap();
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        answers.push(r.json());
    }
    let id = bundle_id(&[&skills[0], &skills[1]]);
    assert!(answers.iter().all(|a| a["id"] == json!(id)), "{answers:?}");
    assert_eq!(entries(&packages_dir(&server)), vec![id.clone()], "one package, no staging left");

    // A post interrupted before its rename leaves a staging directory: a restart sweeps
    // it, and the published package is still answered, verified.
    let leftover = packages_dir(&server).join(".staging-interrupted");
    std::fs::create_dir_all(leftover.join("demo")).unwrap();
    std::fs::write(leftover.join("demo/SKILL.md"), "half").unwrap();
    server.stop();
    let again = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_DATA_DIR".into(), server.data_dir.to_string_lossy().into_owned())],
        ..Default::default()
    });
    let r = again.client().get(&format!("/skill-packages/{id}")).await.unwrap();
    assert_eq!(r.json(), answers[0]);
    assert_eq!(entries(&packages_dir(&server)), vec![id], "the staging directory was swept");
}

/// Runs `code` in `ws` with `extra` fields merged into the request.
async fn shell(client: &RunnerClient, ws: &Path, code: &str, extra: Value) -> (u16, Value) {
    let mut body = shell_request("main", "skills-session", ws, code);
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    (r.status, r.json())
}

const PROBE: &str = r#"
test "$SCIENCEDISCOVERY_SKILLS_DIR" = /skills
test "$SCIENCEDISCOVERY_SKILL_EXTENSIONS_DIR" = /skill-extensions
echo "$(ls -A /skills | tr '\n' ' ')"
if touch /skills/demo/planted 2>/dev/null; then echo writable; else echo read-only; fi
echo from-sandbox > "$SCIENCEDISCOVERY_SKILL_EXTENSIONS_DIR/note.txt"
sh /skills/demo/scripts/run.sh
"#;

#[tokio::test]
async fn the_selected_package_mounts_read_only_and_extensions_land_in_the_workspace() {
    if !sandbox_or_skip("the_selected_package_mounts_read_only_and_extensions_land_in_the_workspace") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let (_, selected) = publish(&client, &[&demo()]).await;
    let (_, unselected) = publish(&client, &[&skill("other", 1, &[("SKILL.md", b"# other\n")])]).await;
    assert_ne!(selected["root"], unselected["root"]);
    let ws = server.project_workspace("mounted");
    let (status, result) = shell(&client, &ws, PROBE, json!({"skillPackagesRoot": selected["root"]})).await;
    assert_eq!(status, 200, "{result}");
    // Only the selected package: its manifest and its one skill, not `other`.
    assert_eq!(result["stdout"], json!(".manifest.json demo \nread-only\nselected\n"), "{result}");
    assert_eq!(result["exitCode"], json!(7), "a packaged script's exit code is kept");
    let env = &result["environmentVariables"];
    assert_eq!(env["SCIENCEDISCOVERY_SKILLS_DIR"], json!("/skills"));
    assert_eq!(env["SCIENCEDISCOVERY_SKILL_EXTENSIONS_DIR"], json!("/skill-extensions"));
    let note = ws.join(".sciencediscovery/skill-extensions/note.txt");
    assert_eq!(std::fs::read_to_string(&note).unwrap(), "from-sandbox\n");
    let root = PathBuf::from(selected["root"].as_str().unwrap());
    assert!(!root.join("demo/planted").exists());

    // A managed execution mounts the same way.
    let mut body = shell_request("main", "skills-session", &ws, "sh /skills/demo/scripts/run.sh");
    body["skillPackagesRoot"] = selected["root"].clone();
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let id = reply.json()["id"].as_str().unwrap().to_owned();
    let record = finished_record(&client, &id, "skills-session", "main").await;
    assert_eq!(record["result"]["exitCode"], json!(7), "{record}");
    assert_eq!(record["result"]["stdout"], json!("selected\n"), "{record}");

    // Without skillPackagesRoot: no mount, no variables.
    let (status, plain) =
        shell(&client, &ws, "test ! -e /skills && test ! -e /skill-extensions", json!({})).await;
    assert_eq!((status, plain["exitCode"].clone()), (200, json!(0)), "{plain}");
    assert!(plain["environmentVariables"].get("SCIENCEDISCOVERY_SKILLS_DIR").is_none());
}

#[tokio::test]
async fn packages_changed_after_publication_are_refused_not_mounted() {
    if !sandbox_or_skip("packages_changed_after_publication_are_refused_not_mounted") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let (_, published) = publish(&client, &[&demo()]).await;
    let id = published["id"].as_str().unwrap().to_owned();
    let root = PathBuf::from(published["root"].as_str().unwrap());
    let ws = server.project_workspace("tampered");
    let script = root.join("demo/scripts/run.sh");
    let manifest = root.join(".manifest.json");
    let original_manifest = std::fs::read(&manifest).unwrap();
    let forged_manifest = String::from_utf8(original_manifest.clone()).unwrap().replace("\"1.0\"", "\"9.9\"");
    type Tamper = Box<dyn Fn()>;
    type Undo = Box<dyn Fn()>;
    let (s1, s2, s3, m1, m2, r1) =
        (script.clone(), script.clone(), script.clone(), manifest.clone(), manifest.clone(), root.clone());
    let (r2, r3) = (root.clone(), root.clone());
    let cases: Vec<(&str, Tamper, Undo)> = vec![
        (
            "a rewritten file",
            Box::new(move || std::fs::write(&s1, "echo forged\nexit 0\n").unwrap()),
            Box::new(move || std::fs::write(&s2, RUN_SH).unwrap()),
        ),
        (
            "an added file",
            Box::new(move || std::fs::write(r1.join("demo/extra.sh"), "echo extra").unwrap()),
            Box::new(move || std::fs::remove_file(r2.join("demo/extra.sh")).unwrap()),
        ),
        (
            "a symlink",
            Box::new(move || {
                std::fs::remove_file(&s3).unwrap();
                std::os::unix::fs::symlink("/etc/passwd", &s3).unwrap();
            }),
            Box::new(move || {
                let s = r3.join("demo/scripts/run.sh");
                std::fs::remove_file(&s).unwrap();
                std::fs::write(&s, RUN_SH).unwrap();
            }),
        ),
        (
            "a rewritten manifest",
            Box::new(move || std::fs::write(&m1, &forged_manifest).unwrap()),
            Box::new(move || std::fs::write(&m2, &original_manifest).unwrap()),
        ),
    ];
    for (what, tamper, undo) in cases {
        tamper();
        let get = client.get(&format!("/skill-packages/{id}")).await.unwrap();
        let error = get.json()["error"].as_str().unwrap_or_default().to_owned();
        assert_eq!(get.status, 400, "{what}: {}", get.json());
        assert!(error.contains("integrity"), "{what}: {error}");
        let (status, result) =
            shell(&client, &ws, "touch ran.txt", json!({"skillPackagesRoot": published["root"]})).await;
        assert_eq!(status, 400, "{what}: {result}");
        assert_eq!(result["code"], json!("skill_integrity_failed"), "{what}: {result}");
        assert!(!ws.join("ran.txt").exists(), "{what}: the execution ran");
        undo();
        let get = client.get(&format!("/skill-packages/{id}")).await.unwrap();
        assert_eq!(get.json(), published, "{what}: restored");
    }
    // Restored, it mounts again.
    let (status, result) = shell(
        &client,
        &ws,
        "sh /skills/demo/scripts/run.sh",
        json!({"skillPackagesRoot": published["root"]}),
    )
    .await;
    assert_eq!((status, result["exitCode"].clone()), (200, json!(7)), "{result}");
}

#[tokio::test]
async fn the_packages_are_never_a_workspace_and_no_other_directory_is_a_package() {
    if !sandbox_or_skip("the_packages_are_never_a_workspace_and_no_other_directory_is_a_package") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let (_, published) = publish(&client, &[&demo()]).await;
    let root = PathBuf::from(published["root"].as_str().unwrap());
    // A sandbox given the package as its writable workspace could rewrite it.
    let (status, result) = shell(&client, &root, "echo forged > demo/SKILL.md", json!({})).await;
    assert_eq!(status, 400, "{result}");
    assert_eq!(result["code"], json!("reserved_workspace_name"), "{result}");
    assert_eq!(std::fs::read(root.join("demo/SKILL.md")).unwrap(), b"# demo\n");

    // Any other directory, even one shaped like a skill, is not a package root.
    let ws = server.project_workspace("fake");
    let fake = server.project_workspace("fake-skills");
    std::fs::create_dir_all(fake.join("demo")).unwrap();
    std::fs::write(fake.join("demo/SKILL.md"), "fake").unwrap();
    let spelled = format!(
        "{}/../.skill-packages/{}",
        server.data_dir.join("projects/project").display(),
        published["id"].as_str().unwrap()
    );
    for bad in [json!(fake), json!(spelled), json!(7)] {
        let (status, result) = shell(&client, &ws, "touch ran.txt", json!({"skillPackagesRoot": bad})).await;
        assert_eq!(status, 400, "{bad}: {result}");
        assert!(!ws.join("ran.txt").exists(), "{bad}: the execution ran");
    }

    // A sandbox that plants `.sciencediscovery` as a link into another tenant's workspace
    // does not get that directory mounted writable.
    let victim = server.project_workspace("victim");
    let link = format!("ln -s {} .sciencediscovery", victim.display());
    let (status, planted) = shell(&client, &ws, &link, json!({})).await;
    assert_eq!((status, planted["exitCode"].clone()), (200, json!(0)), "{planted}");
    let (status, result) =
        shell(&client, &ws, "touch ran.txt", json!({"skillPackagesRoot": published["root"]})).await;
    assert_eq!(status, 400, "{result}");
    assert_eq!(result["code"], json!("skill_extensions_unavailable"), "{result}");
    assert!(!victim.join("skill-extensions").exists(), "nothing was created in the other workspace");
    assert!(!ws.join("ran.txt").exists());
}

#[tokio::test]
async fn runnerctl_pushes_a_directory_and_shows_the_package() {
    let server = Server::start();
    let ctl = |args: &[&str]| {
        std::process::Command::new(runner_tests::bin("runnerctl"))
            .args(["--url", &format!("http://{}", server.address())])
            .args(args)
            .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
            .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
            .output()
            .unwrap()
    };
    let src = server.dir.path().join("my-skill");
    std::fs::create_dir_all(src.join("scripts")).unwrap();
    std::fs::write(src.join("SKILL.md"), "# mine\n").unwrap();
    std::fs::write(src.join("scripts/run.sh"), RUN_SH).unwrap();
    let pushed = ctl(&["skills", "push", src.to_str().unwrap()]);
    assert!(pushed.status.success(), "{}", String::from_utf8_lossy(&pushed.stderr));
    let answer: Value = serde_json::from_slice(&pushed.stdout).unwrap();
    let expected = skill("my-skill", 1, &[("SKILL.md", b"# mine\n"), ("scripts/run.sh", RUN_SH)]);
    let mut expected = expected;
    expected["version"] = json!("local");
    assert_eq!(answer["id"], json!(bundle_id(&[&expected])), "{answer}");
    let id = answer["id"].as_str().unwrap();
    let shown = ctl(&["skills", "show", id]);
    assert_eq!(serde_json::from_slice::<Value>(&shown.stdout).unwrap(), answer);
    let root = PathBuf::from(answer["root"].as_str().unwrap());
    assert_eq!(std::fs::read(root.join("my-skill/scripts/run.sh")).unwrap(), RUN_SH);
    // `skills rm` deletes it; a second one says there is nothing to delete.
    let removed = ctl(&["skills", "rm", id]);
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    assert_eq!(serde_json::from_slice::<Value>(&removed.stdout).unwrap(), json!({"id": id, "deleted": true}));
    assert!(!root.exists());
    let shown = ctl(&["skills", "show", id]);
    assert_eq!(serde_json::from_slice::<Value>(&shown.stdout).unwrap(), json!({"id": id}));
    let again = ctl(&["skills", "rm", id]);
    assert!(!again.status.success());
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(stderr.contains("404") && stderr.contains("is not published"), "{stderr}");
    let pushed = ctl(&["skills", "push", src.to_str().unwrap()]);
    assert!(pushed.status.success(), "published again after its deletion");
    // A symlink in the directory is refused, never followed.
    std::os::unix::fs::symlink("/etc/passwd", src.join("scripts/passwd")).unwrap();
    let refused = ctl(&["skills", "push", src.to_str().unwrap()]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("symlinks are not packaged"));
}

#[tokio::test]
async fn a_package_published_under_a_strict_umask_is_still_readable_in_the_sandbox() {
    if !sandbox_or_skip("a_package_published_under_a_strict_umask_is_still_readable_in_the_sandbox") {
        return;
    }
    let server = Server::start_with(ServerOptions {
        wrapper: vec!["/bin/sh".into(), "-c".into(), "umask 077; \"$@\"".into(), "sh".into()],
        ..Default::default()
    });
    let client = server.client();
    let (status, published) = publish(&client, &[&demo()]).await;
    assert_eq!(status, 200, "{published}");
    let ws = server.project_workspace("umask");
    let (status, result) = shell(
        &client,
        &ws,
        "cat /skills/demo/SKILL.md; sh /skills/demo/scripts/run.sh",
        json!({"skillPackagesRoot": published["root"]}),
    )
    .await;
    assert_eq!(status, 200, "{result}");
    assert_eq!(
        (result["stdout"].clone(), result["exitCode"].clone()),
        (json!("# demo\nselected\n"), json!(7)),
        "{result}"
    );
}

/// Every directory below `dir` (relative paths, sorted).
fn all_directories(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                out.push(e.path().strip_prefix(dir).unwrap().to_owned());
                todo.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// Issue #32: a bundle whose paths ask for too deep a tree, or for more than 1,000
/// directories, is refused with the limit named, and the store holds no new directory
/// (the red team's 35 KiB bundle made 16,041). A bundle at both limits is published.
#[tokio::test]
async fn deep_or_wide_bundles_are_refused_before_a_directory_is_made() {
    let server = Server::start();
    let client = server.client();
    let (status, first) = publish(&client, &[&demo()]).await;
    assert_eq!(status, 200, "{first}");
    let before = all_directories(&server.data_dir);
    let deep = format!("{}/f", vec!["d"; 16].join("/"));
    // The red team's shape: a few hundred files, each naming its own chain of directories.
    let chains: Vec<String> = (0..400).map(|i| format!("c{i}/a/b/c/d/e/f/g/h/i/j/k/l/m/n/f")).collect();
    let mut wide: Vec<(&str, &[u8])> = vec![("SKILL.md", b"# wide")];
    wide.extend(chains.iter().map(|n| (n.as_str(), &b"x"[..])));
    let mut deep_files: Vec<(&str, &[u8])> = vec![("SKILL.md", b"# deep")];
    deep_files.push((deep.as_str(), b"x"));
    for (what, body, kind, limit) in [
        ("deep", skill("deep", 1, &deep_files), "path", "more than 16 names"),
        ("wide", skill("wide", 1, &wide), "metadata", "at most 1000 directories"),
    ] {
        let r = client.post_json("/skill-packages", &json!({"skills": [body]})).await.unwrap();
        let error = r.json()["error"].as_str().unwrap_or_default().to_owned();
        assert_eq!(r.status, 400, "{what}: {}", r.json());
        assert!(error.contains(kind) && error.contains(limit), "{what}: {error}");
        assert_eq!(all_directories(&server.data_dir), before, "{what}: a directory was made");
    }
    // Two skills whose directories add up past the limit, each within it alone.
    let halves: Vec<Vec<String>> =
        (0..2).map(|h| (0..500).map(|i| format!("h{h}-{i}/f")).collect::<Vec<_>>()).collect();
    let half = |h: usize, id: &str| {
        let mut files: Vec<(&str, &[u8])> = vec![("SKILL.md", b"# half")];
        files.extend(halves[h].iter().map(|n| (n.as_str(), &b""[..])));
        skill(id, 1, &files)
    };
    let (status, error) = publish(&client, &[&half(0, "one"), &half(1, "two")]).await;
    assert_eq!(status, 400, "{error}");
    assert!(error["error"].as_str().unwrap().contains("at most 1000 directories"), "{error}");
    assert_eq!(all_directories(&server.data_dir), before);

    // At the limits: 16 names deep, and exactly 1,000 directories.
    let fits_deep = vec!["d"; 16].join("/");
    let mut files: Vec<(&str, &[u8])> = vec![("SKILL.md", b"# fits"), (&fits_deep, b"x")];
    let flat: Vec<String> = (0..(1000 - 1 - 15)).map(|i| format!("f{i}/x")).collect();
    files.extend(flat.iter().map(|n| (n.as_str(), &b""[..])));
    let (status, fits) = publish(&client, &[&skill("fits", 1, &files)]).await;
    assert_eq!(status, 200, "{fits}");
    let root = PathBuf::from(fits["root"].as_str().unwrap());
    assert_eq!(all_directories(&root).len(), 1000);
    assert_eq!(std::fs::read(root.join("fits").join(&fits_deep)).unwrap(), b"x");
}

/// Issue #32: `DELETE /skill-packages/:id` removes a package no execution holds; while one
/// (here a managed run, its sandbox up with the package at /skills) holds it, 409 and nothing
/// changes; a deleted package is not mounted again, and can be published again.
#[tokio::test]
async fn delete_removes_a_package_but_not_while_an_execution_mounts_it() {
    if !sandbox_or_skip("delete_removes_a_package_but_not_while_an_execution_mounts_it") {
        return;
    }
    let server = Server::start();
    let client = server.client();
    let (_, published) = publish(&client, &[&demo()]).await;
    let id = published["id"].as_str().unwrap().to_owned();
    let root = PathBuf::from(published["root"].as_str().unwrap());
    let delete = |id: String| {
        let client = server.client();
        async move {
            let r = client.send_bytes("DELETE", &format!("/skill-packages/{id}"), &[], Vec::new()).await;
            let r = r.unwrap();
            (r.status, r.json())
        }
    };

    let ws = server.project_workspace("mounting");
    let code = "cat /skills/demo/SKILL.md > seen.txt; while [ ! -e go ]; do sleep 0.05; done; sh /skills/demo/scripts/run.sh";
    let mut body = shell_request("main", "skills-session", &ws, code);
    body["skillPackagesRoot"] = published["root"].clone();
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let run = reply.json()["id"].as_str().unwrap().to_owned();
    let start = std::time::Instant::now();
    while std::fs::read_to_string(ws.join("seen.txt")).unwrap_or_default() != "# demo\n" {
        assert!(start.elapsed().as_secs() < 120, "the run never mounted its package");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (status, refused) = delete(id.clone()).await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["code"], json!("skill_package_in_use"), "{refused}");
    let error = refused["error"].as_str().unwrap();
    assert!(error.contains("mounted by 1 execution") && error.contains("once they have ended"), "{error}");
    assert_eq!(client.get(&format!("/skill-packages/{id}")).await.unwrap().json(), published);

    std::fs::write(ws.join("go"), "").unwrap();
    let record = finished_record(&client, &run, "skills-session", "main").await;
    assert_eq!(record["result"]["stdout"], json!("selected\n"), "the run kept its package: {record}");

    let (status, deleted) = delete(id.clone()).await;
    assert_eq!((status, deleted), (200, json!({"id": id, "deleted": true})));
    assert!(!root.exists());
    assert!(entries(&packages_dir(&server)).is_empty(), "nothing is left behind, staging included");
    assert_eq!(client.get(&format!("/skill-packages/{id}")).await.unwrap().json(), json!({"id": id}));
    let (status, again) = delete(id.clone()).await;
    assert_eq!((status, again["code"].clone()), (404, json!("skill_not_published")), "{again}");

    // Not mounted again: the execution is refused and runs nothing.
    let other = server.project_workspace("after");
    let (status, result) =
        shell(&client, &other, "touch ran.txt", json!({"skillPackagesRoot": published["root"]})).await;
    assert_eq!(status, 400, "{result}");
    assert_eq!(result["code"], json!("skill_not_published"), "{result}");
    assert!(!other.join("ran.txt").exists());

    // Published again, it mounts again.
    let (status, republished) = publish(&client, &[&demo()]).await;
    assert_eq!((status, &republished), (200, &published));
    let (status, result) = shell(
        &client,
        &other,
        "sh /skills/demo/scripts/run.sh",
        json!({"skillPackagesRoot": published["root"]}),
    )
    .await;
    assert_eq!((status, result["exitCode"].clone()), (200, json!(7)), "{result}");
}

/// The same under isolation microvm (issue #36): the package over a read-only 9p share, the
/// extensions over a writable one, and a managed run (`/shell-executions`) in a VM too.
#[tokio::test]
async fn the_selected_package_mounts_read_only_in_a_microvm_too() {
    if !crate::suite::microvm::microvm_or_skip("the_selected_package_mounts_read_only_in_a_microvm_too") {
        return;
    }
    let server = crate::suite::microvm::start(&[]);
    let client = server.client();
    let (_, selected) = publish(&client, &[&demo()]).await;
    let ws = server.project_workspace("mounted-vm");
    let extra = json!({"skillPackagesRoot": selected["root"], "isolation": "microvm"});
    let (status, result) = shell(&client, &ws, PROBE, extra).await;
    assert_eq!(status, 200, "{result}");
    assert_eq!(result["sandbox"], "microvm", "{result}");
    assert_eq!(result["stdout"], json!(".manifest.json demo \nread-only\nselected\n"), "{result}");
    assert_eq!(result["exitCode"], json!(7));
    let note = ws.join(".sciencediscovery/skill-extensions/note.txt");
    assert_eq!(std::fs::read_to_string(&note).unwrap(), "from-sandbox\n");

    let mut body = shell_request("main", "skills-session", &ws, "uname -r; sh /skills/demo/scripts/run.sh");
    body["skillPackagesRoot"] = selected["root"].clone();
    body["isolation"] = json!("microvm");
    let reply = client.post_signed("/shell-executions", &body).await.unwrap();
    assert_eq!(reply.status, 202, "{}", reply.json());
    let id = reply.json()["id"].as_str().unwrap().to_owned();
    let record = finished_record(&client, &id, "skills-session", "main").await;
    assert_eq!(record["result"]["exitCode"], json!(7), "{record}");
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let stdout = record["result"]["stdout"].as_str().unwrap().to_owned();
    assert!(stdout.ends_with("\nselected\n") && !stdout.contains(host.trim()), "{record}");
}
