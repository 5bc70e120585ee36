//! `runnerd-bench output`: runnerd's peak RSS (`VmHWM`) during output floods, against the
//! output's size and the answer's (issue #14 hole 4). Each case runs in a fresh runnerd,
//! warmed up by a small run first; the figure is the peak's growth over that. Cases: a sync
//! flood of `\x01` (6 bytes each in the JSON answer) and of `x`, the `\x01` flood under a
//! 16 MiB server-wide ceiling, and a managed flood (result, record, logs).
//! Figures only, never pass/fail.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::bail;

use runnerctl::client::{RunnerClient, new_execution_id, permission_epoch};

const MIB: f64 = 1_048_576.0;

fn body(key: &str, code: &str) -> serde_json::Value {
    serde_json::json!({
        "agentId": "bench",
        "code": code,
        "executionId": new_execution_id(),
        "permissionEpoch": permission_epoch("bench-output"),
        "runnerWorkspaceKey": key,
    })
}

async fn sync(client: &RunnerClient, code: &str) -> anyhow::Result<(u64, u64)> {
    let reply = client.post_signed("/execute-shell", &body("bench/output", code)).await?;
    if reply.status != 200 {
        bail!(
            "runnerd answered {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body[..reply.body.len().min(500)])
        );
    }
    let kept = reply.json()["stdout"].as_str().map_or(0, str::len) as u64;
    Ok((kept, reply.body.len() as u64))
}

async fn managed(client: &RunnerClient, code: &str) -> anyhow::Result<(u64, u64)> {
    let mut request = body("bench/managed", code);
    request["maxOutputBytes"] = 0.into();
    let id = request["executionId"].as_str().unwrap_or_default().to_owned();
    let reply = client.post_signed("/shell-executions", &request).await?;
    if reply.status != 202 {
        bail!("managed start failed: {}", String::from_utf8_lossy(&reply.body));
    }
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let rec = client.get(&format!("/shell-executions/{id}?sessionId=bench-output&agentId=bench")).await?;
        let json = rec.json();
        match json["state"].as_str().unwrap_or("") {
            "completed" => {
                let kept = json["result"]["stdout"].as_str().map_or(0, str::len) as u64;
                return Ok((kept, rec.body.len() as u64));
            }
            "queued" | "running" => {}
            other => bail!("managed run ended {other}: {}", json["error"]),
        }
    }
}

pub async fn bench(init: &Path, mib: u64) -> anyhow::Result<()> {
    let bytes = mib << 20;
    let ones = format!("head -c {bytes} /dev/zero | tr '\\0' '\\1'");
    let xs = format!("head -c {bytes} /dev/zero | tr '\\0' 'x'");
    println!(
        "{:<44} {:>9} {:>9} {:>9} {:>10} {:>8}",
        "output flood (fresh runnerd each)", "out MiB", "kept MiB", "answer", "peak +MiB", "x output"
    );
    let cases: [(&str, &str, Option<&str>, bool); 4] = [
        ("sync, \\x01 (6 JSON bytes each)", &ones, None, false),
        ("sync, x", &xs, None, false),
        ("sync, \\x01, 16 MiB ceiling", &ones, Some("16777216"), false),
        ("managed, \\x01 (result + record + logs)", &ones, None, true),
    ];
    for (name, code, ceiling, is_managed) in cases {
        let env: Vec<(&str, &str)> =
            ceiling.map(|c| vec![("SCIENCE_AGENT_MAX_BUFFERED_OUTPUT_BYTES", c)]).unwrap_or_default();
        let daemon = crate::start_runnerd_with(init, "output", &env)?;
        let client = RunnerClient::new(daemon.endpoint.clone(), crate::BENCH_TOKEN);
        sync(&client, "head -c 100000 /dev/zero | tr '\\0' '\\1'").await?;
        let pid = daemon.child.id();
        let before = crate::rss_kib(pid, "VmHWM:");
        let (kept, answer) =
            if is_managed { managed(&client, code).await? } else { sync(&client, code).await? };
        let grown = crate::rss_kib(pid, "VmHWM:").saturating_sub(before) as f64 / 1024.0;
        println!(
            "{:<44} {:>9} {:>9.1} {:>9.1} {:>10.1} {:>8.2}",
            name,
            mib,
            kept as f64 / MIB,
            answer as f64 / MIB,
            grown,
            grown / mib as f64
        );
        std::io::stdout().flush()?;
    }
    Ok(())
}
