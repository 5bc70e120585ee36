//! `GET /metrics` (api.md improvement 6): Bearer only, a strict parse of the exposition, and
//! counters that move with real executions and refusals.

use std::collections::BTreeMap;

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};

/// One sample: its metric name and its labels, sorted.
type Key = (String, Vec<(String, String)>);

/// A strict parser of the OpenMetrics text format as far as a scrape of runnerd needs: every
/// sample belongs to a family declared by `# TYPE` before it, label values are quoted with
/// only `\\`, `\"` and `\n` escapes, values are numbers, no sample repeats, and `# EOF` ends it.
fn parse(text: &str) -> Result<BTreeMap<Key, f64>, String> {
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let body = text.strip_suffix("# EOF\n").ok_or("the exposition does not end with # EOF")?;
    for (n, line) in body.lines().enumerate() {
        let bad = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap_or(""), parts.next().ok_or_else(|| bad("no name"))?);
            match kind {
                "TYPE" => {
                    let t = parts.next().ok_or_else(|| bad("no type"))?;
                    if !["counter", "gauge", "histogram", "info", "unknown"].contains(&t) {
                        return Err(bad("unknown type"));
                    }
                    if families.insert(name.to_owned(), t.to_owned()).is_some() {
                        return Err(bad("family declared twice"));
                    }
                }
                "HELP" | "UNIT" => {}
                _ => return Err(bad("unknown comment")),
            }
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => return Err(bad("no value")),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            return Err(bad("bad metric name"));
        }
        let family = families
            .iter()
            .filter(|(f, t)| match t.as_str() {
                "counter" => name == format!("{f}_total") || name == format!("{f}_created"),
                "histogram" => {
                    ["_bucket", "_sum", "_count", "_created"].iter().any(|s| name == format!("{f}{s}"))
                }
                _ => name == f.as_str(),
            })
            .count();
        if family != 1 {
            return Err(bad("sample of no declared family"));
        }
        let mut labels = Vec::new();
        let mut rest = rest;
        if let Some(mut l) = rest.strip_prefix('{') {
            loop {
                if let Some(after) = l.strip_prefix('}') {
                    rest = after;
                    break;
                }
                let eq = l.find("=\"").ok_or_else(|| bad("label without a quoted value"))?;
                let key = &l[..eq];
                if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(bad("bad label name"));
                }
                let mut value = String::new();
                let mut chars = l[eq + 2..].char_indices();
                let end = loop {
                    match chars.next() {
                        Some((i, '"')) => break i,
                        Some((_, '\\')) => match chars.next() {
                            Some((_, '\\')) => value.push('\\'),
                            Some((_, '"')) => value.push('"'),
                            Some((_, 'n')) => value.push('\n'),
                            _ => return Err(bad("bad escape")),
                        },
                        Some((_, c)) => value.push(c),
                        None => return Err(bad("unterminated label value")),
                    }
                };
                labels.push((key.to_owned(), value));
                l = &l[eq + 2 + end + 1..];
                l = l.strip_prefix(',').unwrap_or(l);
            }
        }
        let value = rest.strip_prefix(' ').ok_or_else(|| bad("no space before the value"))?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().map_err(|_| bad("value is not a number"))?,
        };
        labels.sort();
        if samples.insert((name.to_owned(), labels), value).is_some() {
            return Err(bad("sample repeated"));
        }
    }
    Ok(samples)
}

fn sample(m: &BTreeMap<Key, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut labels: Vec<(String, String)> = labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
    labels.sort();
    m.get(&(name.to_owned(), labels)).copied().unwrap_or(0.0)
}

async fn scrape(client: &runnerctl::client::RunnerClient) -> BTreeMap<Key, f64> {
    let reply = client.get("/metrics").await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let text = String::from_utf8(reply.body).expect("UTF-8");
    parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

#[test]
fn the_parser_refuses_what_prometheus_would() {
    let good = "# TYPE a counter\na_total{x=\"q\\\"\"} 1\n# TYPE b gauge\nb 2.5\n# EOF\n";
    let m = parse(good).unwrap();
    assert_eq!(sample(&m, "a_total", &[("x", "q\"")]), 1.0);
    assert_eq!(sample(&m, "b", &[]), 2.5);
    for bad in [
        "# TYPE a counter\na_total 1\n",                   // no EOF
        "a_total 1\n# EOF\n",                              // no family
        "# TYPE a counter\na_total{x=\"q} 1\n# EOF\n",     // unterminated
        "# TYPE a counter\na_total one\n# EOF\n",          // not a number
        "# TYPE a counter\na_total 1\na_total 2\n# EOF\n", // repeated
        "# TYPE a counter\na_total{x=\"\\t\"} 1\n# EOF\n", // bad escape
    ] {
        assert!(parse(bad).is_err(), "{bad:?} parsed");
    }
}

#[tokio::test]
async fn metrics_need_the_token_and_count_refusals() {
    let server = Server::start();
    let wrong = server.client_with_token("wrong");
    assert_eq!(wrong.get("/metrics").await.unwrap().status, 401);
    let client = server.client();
    let before = scrape(&client).await;
    // A 400 before admission: no workspace.
    let mut body = shell_request("main", "s", &server.project_workspace("m0"), "true");
    body.as_object_mut().unwrap().remove("workspaceRoot");
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(r.status, 400);
    let code = r.json()["code"].as_str().unwrap().to_owned();
    let after = scrape(&client).await;
    let name = "runner_execution_requests_total";
    let labels = [("route", "execute-shell"), ("code", code.as_str())];
    assert_eq!(sample(&after, name, &labels) - sample(&before, name, &labels), 1.0, "{code}");
    assert_eq!(sample(&after, "runner_queue_capacity", &[]), 256.0);
}

#[tokio::test]
async fn metrics_move_with_real_runs_timeouts_and_a_full_queue() {
    if !sandbox_or_skip("metrics_move_with_real_runs_timeouts_and_a_full_queue") {
        return;
    }
    let server = Server::start_with(ServerOptions {
        env: vec![("SCIENCE_AGENT_QUEUE_CAPACITY".into(), "1".into())],
        ..Default::default()
    });
    let client = std::sync::Arc::new(server.client());
    let ws = server.project_workspace("m1");
    let before = scrape(&client).await;

    let ok = client.post_signed("/execute-shell", &shell_request("main", "s", &ws, "true")).await.unwrap();
    assert_eq!(ok.status, 200, "{}", ok.json());
    let mut slow = shell_request("main", "s", &ws, "sleep 30");
    slow["executionTimeoutMs"] = 1500.into();
    let c = client.clone();
    let timing_out = tokio::spawn(async move { c.post_signed("/execute-shell", &slow).await.unwrap() });
    // While it holds the only place: a refusal, and a queue depth of one.
    for _ in 0..1000 {
        let status = client.get("/status").await.unwrap().json();
        if status["activeExecutions"].as_array().is_some_and(|a| a.len() == 1) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let refused =
        client.post_signed("/execute-shell", &shell_request("other", "s", &ws, "true")).await.unwrap();
    assert_eq!(refused.status, 503, "{}", refused.json());
    assert_eq!(refused.json()["code"], "queue_full");
    let during = scrape(&client).await;
    assert_eq!(sample(&during, "runner_queue_depth", &[]), 1.0);
    let timed_out = timing_out.await.unwrap();
    assert_eq!(timed_out.json()["code"], "execution_timeout", "{}", timed_out.json());
    let after = scrape(&client).await;

    let moved =
        |name: &str, labels: &[(&str, &str)]| sample(&after, name, labels) - sample(&before, name, labels);
    let run = |outcome| [("route", "execute-shell"), ("outcome", outcome), ("profile", "baseline")];
    assert_eq!(moved("runner_executions_total", &run("completed")), 1.0);
    assert_eq!(moved("runner_executions_total", &run("timed_out")), 1.0);
    assert_eq!(moved("runner_limits_hit_total", &[("limit", "timeout")]), 1.0);
    assert_eq!(moved("runner_admission_total", &[("result", "refused")]), 1.0);
    assert!(moved("runner_admission_total", &[("result", "admitted")]) >= 2.0);
    let req = |code| [("route", "execute-shell"), ("code", code)];
    assert_eq!(moved("runner_execution_requests_total", &req("ok")), 1.0);
    assert_eq!(moved("runner_execution_requests_total", &req("queue_full")), 1.0);
    assert_eq!(moved("runner_execution_requests_total", &req("execution_timeout")), 1.0);
    // Both runs had a sandbox, launched or started ahead and handed over (issue #37), and
    // both versions were committed.
    let ahead = sample(&after, "runner_prestart_hits", &[]) - sample(&before, "runner_prestart_hits", &[]);
    assert_eq!(moved("runner_launch_seconds_count", &[("profile", "baseline")]) + ahead, 2.0);
    assert_eq!(moved("runner_execution_duration_seconds_count", &[("route", "execute-shell")]), 2.0);
    assert_eq!(moved("runner_workspace_commit_seconds_count", &[("result", "ok")]), 2.0);
    assert_eq!(sample(&after, "runner_queue_depth", &[]), 0.0);
}

#[test]
fn runnerctl_metrics_prints_a_parsable_scrape() {
    let server = Server::start();
    let out = std::process::Command::new(runner_tests::bin("runnerctl"))
        .args(["--url", &format!("http://{}", server.address()), "metrics"])
        .env("SCIENCE_AGENT_RUNNER_TOKEN", runner_tests::server::TEST_TOKEN)
        .env("SCIENCE_AGENT_DATA_DIR", &server.data_dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let m = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(sample(&m, "runner_queue_capacity", &[]), 256.0);
}

#[tokio::test]
async fn egress_decisions_come_from_egressd_by_verdict() {
    use runner_tests::egress::{Egressd, FakeDns, Upstream, with_network};
    if !sandbox_or_skip("egress_decisions_come_from_egressd_by_verdict") {
        return;
    }
    let dns = FakeDns::start(&[("mirror.test", &["127.0.0.1"]), ("blocked.test", &["127.0.0.1"])]);
    let upstream = Upstream::start();
    let egressd = Egressd::start(dns.addr, &[]);
    let server = Server::start_with(ServerOptions { env: egressd.runner_env(), ..ServerOptions::default() });
    let client = server.client();
    let before = scrape(&client).await;
    assert_eq!(sample(&before, "runner_egress_up", &[]), 1.0);
    let port = upstream.port;
    let code = format!(
        "curl -sS -o /dev/null http://mirror.test:{port}/a; curl -s -o /dev/null http://blocked.test:{port}/; \
         curl -s -o /dev/null http://blocked.test:{port}/"
    );
    let body = with_network(
        shell_request("main", "s", &server.project_workspace("m2"), &code),
        &["mirror.test"],
        true,
        "r",
    );
    let r = client.post_signed("/execute-shell", &body).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.json());
    let after = scrape(&client).await;
    let moved = |v| {
        sample(&after, "runner_egress_decisions", &[("verdict", v)])
            - sample(&before, "runner_egress_decisions", &[("verdict", v)])
    };
    assert_eq!(moved("allowed"), 1.0, "{}", egressd.log());
    assert_eq!(moved("denied"), 2.0, "{}", egressd.log());
    let profile = [("route", "execute-shell"), ("outcome", "completed"), ("profile", "network")];
    assert_eq!(sample(&after, "runner_executions_total", &profile), 1.0);
}
