//! `runnerctl fleet ls|drain|undrain` (issue #35), against a runner-router: the nodes as the
//! router sees them, and a drain that moves each workspace off a node, with its progress on
//! stderr until the node holds none (run it again to resume an interrupted drain).

use std::time::Duration;

use serde_json::{Value, json};

use crate::client::RunnerClient;

/// How often a drain's progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

fn refused(status: u16, answer: &Value) -> i32 {
    eprintln!(
        "runnerctl: the router answered {status}: {}",
        answer["error"].as_str().unwrap_or("(no error text; is --url a runner-router?)")
    );
    1
}

/// One line per node: name, pool, state, load, URL.
fn table(nodes: &Value) -> String {
    let mut out =
        format!("{:<24} {:<7} {:<9} {:>9} {:>9}  {}\n", "NODE", "POOL", "STATE", "RUNNING", "QUEUED", "URL");
    for n in nodes["nodes"].as_array().into_iter().flatten() {
        let state = if n["routable"] != true {
            match n["downForSeconds"].as_u64() {
                Some(s) => format!("down {s}s"),
                None => "down".to_owned(),
            }
        } else if n["draining"] == true {
            "draining".to_owned()
        } else {
            "ready".to_owned()
        };
        let load = &n["load"];
        let pair = |a: &str, b: &str| match (load[a].as_u64(), load[b].as_u64()) {
            (Some(x), Some(y)) => format!("{x}/{y}"),
            _ => "-".to_owned(),
        };
        out.push_str(&format!(
            "{:<24} {:<7} {:<9} {:>9} {:>9}  {}\n",
            n["name"].as_str().unwrap_or("?"),
            n["pool"].as_str().unwrap_or("?"),
            state,
            pair("running", "slots"),
            pair("admitted", "queueCapacity"),
            n["url"].as_str().unwrap_or("?"),
        ));
    }
    out
}

pub async fn run(client: &RunnerClient, sub: &str, node: Option<&str>) -> anyhow::Result<i32> {
    match (sub, node) {
        ("ls", None) => {
            let reply = client.get("/fleet/nodes").await?;
            if reply.status != 200 {
                return Ok(refused(reply.status, &reply.json()));
            }
            print!("{}", table(&reply.json()));
            Ok(0)
        }
        ("drain" | "undrain", Some(node)) => {
            // The client's clock offset, learnt from `Date`, before a signed request.
            let _ = client.raw("GET", "/health", &[], Vec::new()).await;
            let body = json!({"node": node, "requestId": crate::client::new_execution_id()});
            let reply = client.post_signed(&format!("/fleet/{sub}"), &body).await?;
            if !(200..300).contains(&reply.status) {
                return Ok(refused(reply.status, &reply.json()));
            }
            if sub == "undrain" {
                println!("{}", serde_json::to_string_pretty(&reply.json())?);
                return Ok(0);
            }
            follow(client, node).await
        }
        ("ls", Some(_)) => anyhow::bail!("fleet ls takes no node"),
        ("drain" | "undrain", None) => {
            anyhow::bail!("fleet {sub} needs a NODE (its name or URL, see fleet ls)")
        }
        (other, _) => anyhow::bail!("unknown fleet command {other:?} (ls, drain, undrain)"),
    }
}

/// Prints the drain's progress until it is done; exit 0 when the node holds no workspace.
async fn follow(client: &RunnerClient, node: &str) -> anyhow::Result<i32> {
    let path = format!("/fleet/drain?node={}", crate::client::encode(node));
    loop {
        let reply = client.get(&path).await?;
        if reply.status != 200 {
            return Ok(refused(reply.status, &reply.json()));
        }
        let p = reply.json();
        let d = &p["drain"];
        eprintln!(
            "runnerctl: {}: {} moved, {} failed, {} left{}",
            p["node"].as_str().unwrap_or(node),
            d["moved"].as_u64().unwrap_or(0),
            d["failed"].as_u64().unwrap_or(0),
            p["remaining"].as_u64().unwrap_or(0),
            d["current"].as_str().map(|c| format!(", moving {c}")).unwrap_or_default(),
        );
        if d["done"] == true || d.is_null() {
            for e in d["errors"].as_array().into_iter().flatten() {
                eprintln!("runnerctl: not moved: {}", e.as_str().unwrap_or_default());
            }
            println!("{}", serde_json::to_string_pretty(&p)?);
            return Ok(if p["remaining"] == 0 { 0 } else { 1 });
        }
        tokio::time::sleep(PROGRESS_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_state_and_load() {
        let nodes = json!({"nodes": [
            {"name": "n1", "pool": "cpu", "routable": true, "draining": false, "url": "http://a:1",
             "load": {"running": 1, "slots": 4, "admitted": 2, "queueCapacity": 64}},
            {"name": "n2", "pool": "nvidia", "routable": false, "downForSeconds": 12, "url": "http://b:1", "load": null},
            {"name": "n3", "pool": "cpu", "routable": true, "draining": true, "url": "http://c:1", "load": null},
        ]});
        let t = table(&nodes);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[1].contains("n1")
                && lines[1].contains("ready")
                && lines[1].contains("1/4")
                && lines[1].contains("2/64"),
            "{t}"
        );
        assert!(lines[2].contains("down 12s") && lines[2].contains("nvidia"), "{t}");
        assert!(lines[3].contains("draining"), "{t}");
    }
}
