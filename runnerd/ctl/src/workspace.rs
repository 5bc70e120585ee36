//! `runnerctl workspace push|backup|restore|where` (issue #34): a workspace moved to another
//! runnerd, replicated to the object store now, restored, or located. A push prints its
//! progress on stderr while it runs (polled from `where`, which shows the move in flight).

use std::time::Duration;

use serde_json::json;

use crate::client::RunnerClient;
use runnerd::transfer::Ident;

/// How often a long push's progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// What names the workspace: a remote key, or `--project PATH`.
pub struct Target<'a> {
    pub key: Option<&'a str>,
    pub project: Option<&'a str>,
}

impl Target<'_> {
    /// The workspace, checked here as runnerd checks it.
    fn ident(&self) -> Result<Ident, String> {
        match (self.key, self.project) {
            (Some(key), None) => Ident::remote(key).map_err(|e| e.to_string()),
            (None, Some(path)) => Ident::project(path).map_err(|e| e.to_string()),
            _ => Err("name the workspace: a remote workspace KEY, or --project PATH (not both)".into()),
        }
    }
}

/// What the subcommand needs besides the workspace.
pub struct Args<'a> {
    pub to: Option<&'a str>,
    pub version: Option<&'a str>,
    pub from_store: bool,
}

pub async fn run(
    client: &RunnerClient,
    sub: &str,
    target: Target<'_>,
    args: Args<'_>,
) -> anyhow::Result<i32> {
    let ident = target.ident().map_err(anyhow::Error::msg)?;
    let mut body = ident.to_json();
    // Each request its own: a retry signed at the same timestamp is not refused as a replay.
    body["requestId"] = json!(runner_store::versioning::new_uuid_v4());
    // The client has no clock offset yet: one cheap request learns it from `Date`.
    let _ = client.raw("GET", "/health", &[], Vec::new()).await;
    let reply = match sub {
        "where" => client.get(&format!("/workspace-transfer/where?{}", ident.query())).await?,
        "push" => {
            let to = args.to.ok_or_else(|| anyhow::anyhow!("push needs --to URL (the target runnerd)"))?;
            body["to"] = json!(to);
            let pushing = client.post_signed("/workspace-transfer/push", &body);
            tokio::pin!(pushing);
            loop {
                tokio::select! {
                    reply = &mut pushing => break reply?,
                    _ = tokio::time::sleep(PROGRESS_EVERY) => progress(client, &ident).await,
                }
            }
        }
        "backup" => client.post_signed("/workspace-transfer/backup", &body).await?,
        "restore" => {
            if let Some(v) = args.version {
                body["version"] = json!(v);
            }
            body["fromStore"] = json!(args.from_store);
            client.post_signed("/workspace-transfer/restore", &body).await?
        }
        other => anyhow::bail!("unknown workspace command {other:?} (push, backup, restore, where)"),
    };
    if reply.status != 200 {
        let answer = reply.json();
        let moved = answer["movedTo"].as_str().map(|m| format!(" (moved to {m})")).unwrap_or_default();
        eprintln!(
            "runnerctl: runnerd answered {}: {}{moved}",
            reply.status,
            answer["error"].as_str().unwrap_or("(no error text)")
        );
        return Ok(1);
    }
    println!("{}", serde_json::to_string_pretty(&reply.json())?);
    Ok(0)
}

/// One progress line from the move in flight (nothing when none is reported yet).
async fn progress(client: &RunnerClient, ident: &Ident) {
    let Ok(reply) = client.get(&format!("/workspace-transfer/where?{}", ident.query())).await else {
        return;
    };
    let t = &reply.json()["transfer"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    if t.is_object() {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        eprintln!(
            "runnerctl: sent {}/{} objects, {:.1}/{:.1} MiB to {}",
            n("objectsSent"),
            n("objectsTotal"),
            mib(n("bytesSent")),
            mib(n("bytesTotal")),
            t["to"].as_str().unwrap_or("?")
        );
    }
}
