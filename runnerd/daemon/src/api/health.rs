//! `GET /health` (contract §4): every key of the original, with honest values, plus what
//! api.md improvement 5 adds — per-limit `enforced` with `reasons`, the preflight's
//! `sandboxProfile`, and the reachability of the helper daemons. No disk access, no
//! subprocess: everything was decided at start-up, except egressd's reachability, which
//! the caller asked egressd a moment ago (R-NET-3: health says when network is unavailable).

use serde_json::{Value, json};

use crate::app::{App, runner_version};
use crate::egress::EgressError;
use common::egress::protocol::EgressStatus;
use common::seccomp::Profile;

/// `sandboxNetwork` and the `egressd` block from egressd's answer (or why there is none).
fn network(app: &App, egress: &Result<EgressStatus, EgressError>) -> (Value, Value) {
    let bridge = app.egress.bridge_ready().map_err(|e| e.to_string());
    match (egress, bridge) {
        (Ok(status), Ok(_)) => (
            json!({"available": true, "modes": ["none", "domain-allowlist"]}),
            json!({
                "reachable": true,
                "controlSocket": app.egress.control_socket,
                "bridge": app.egress.bridge,
                "version": status.version,
                "gateways": status.gateways,
                "openConnections": status.open_connections,
                "confinement": {
                    "landlock": status.confinement.landlock,
                    "seccomp": status.confinement.seccomp,
                    "noNewPrivileges": status.confinement.no_new_privs,
                },
            }),
        ),
        (Ok(_), Err(bridge)) => (
            json!({"available": false, "modes": ["none"], "unavailableReason": format!("Sandbox network access (domain-allowlist) is unavailable: {bridge}")}),
            json!({"reachable": true, "controlSocket": app.egress.control_socket, "bridge": app.egress.bridge}),
        ),
        (Err(EgressError::Refused(why)), _) => (
            json!({"available": false, "modes": ["none"], "unavailableReason": format!("Sandbox network access (domain-allowlist) is unavailable: egressd refused runnerd: {why}")}),
            json!({"reachable": true, "controlSocket": app.egress.control_socket, "refused": why}),
        ),
        (Err(e), _) => {
            let reason = crate::error_chain(e);
            (
                json!({"available": false, "modes": ["none"], "unavailableReason": format!("Sandbox network access (domain-allowlist) is unavailable: {reason}; start egressd or set SCIENCE_AGENT_EGRESS_SOCKET")}),
                json!({"reachable": false, "controlSocket": app.egress.control_socket, "reason": reason}),
            )
        }
    }
}

pub fn health(
    app: &App,
    egress: &Result<EgressStatus, EgressError>,
    (npu_broker, npu_brokerd): (Value, Value),
) -> Value {
    let (sandbox_network, egressd) = network(app, egress);
    let cfg = &app.config;
    let (enforced, reasons) = enforcement(app);
    let mut health = json!({
        "cgroupDelegated": app.limits.delegated,
        "cgroupMode": app.limits.mode.label(),
        "cgroupRoot": app.limits.root.display().to_string(),
        "executionAuth": "bearer+hmac-sha256",
        "executionUser": app.execution_user,
        "sandboxUser": app.sandbox.user,
        "executionTimeoutMs": cfg.exec_timeout_ms,
        "maxFileBytes": 0,
        "maxOutputBytes": cfg.max_output_bytes,
        "bufferedOutput": {
            "ceilingBytes": app.output_pool.ceiling(),
            "usedBytes": app.output_pool.used(),
        },
        "maxWorkspaceBytes": cfg.max_workspace_bytes,
        "networkPolicy": "none",
        "noNewPrivileges": true,
        "npuBroker": npu_broker,
        "platform": "linux",
        "runnerVersion": runner_version(),
        "sandbox": "bubblewrap",
        "sandboxNetwork": sandbox_network,
        "scientificEnvs": app.envs.health(),
        "seccompBaseline": Profile::Baseline.version_label(),
        "status": "ok",
        "workerConcurrency": null,
        "enforced": enforced,
        "reasons": reasons,
        "sandboxProfile": sandbox_profile(app),
        "egressd": egressd,
        "npuBrokerd": npu_brokerd,
        "queue": {"admitted": app.admission.admitted(), "capacity": cfg.queue_capacity, "maxConcurrent": cfg.max_concurrent},
    });
    health["resourceLimits"] = crate::limits::health_block(&app.limits, &cfg.limits);
    health["executionRecords"] = app.managed.health_block();
    health["versionHistory"] = app.history.health();
    health["replication"] =
        app.replica.as_ref().map_or_else(crate::replica::Replica::health_off, |r| r.health());
    health["sharedDatabases"] = app.versions.damaged_json();
    health["isolation"] = crate::isolation::select::health(
        app.sandbox.default_backend,
        &*app.sandbox.isolation,
        &app.sandbox.microvm,
    );
    health["isolation"]["backends"]["microvm"]["pool"] = match crate::isolation::Isolation::prestarted(
        &*app.sandbox.microvm,
    ) {
        Some(r) => pool_block(
            &r,
            "resident memory of the waiting VMs' processes (bwrap, QEMU with the guest's touched RAM), RSS summed per process",
        ),
        None => {
            json!({"enabled": false, "reason": "off (SCIENCE_AGENT_MICROVM_POOL=0), no VM can start here, or bwrap has no --bind-fd"})
        }
    };
    health
}

/// What is enforced on every execution, and why (or why not) each is.
fn enforcement(app: &App) -> (Value, Value) {
    let cfg = &app.config;
    let cap = &app.sandbox.capability;
    let [memory, pids, cpu] = crate::limits::health_entries(&app.limits, cfg.exec_timeout_ms);
    let workspace = crate::measure::quota_enforcement(cfg.max_workspace_bytes, app.journal.enabled());
    let enforced = json!({
        "memory": memory.1,
        "pids": pids.1,
        "cpu": cpu.1,
        "fsize": if cfg.max_workspace_bytes > 0 { json!("partial") } else { json!(false) },
        "workspaceBytes": workspace.0,
        "seccomp": cap.sandbox_usable,
        "nestedUserNamespaces": cap.disable_userns,
        "unprivilegedSandboxUser": app.sandbox.user.uid != 0,
    });
    let reasons = json!({
        "memory": memory.2,
        "pids": pids.2,
        "cpu": cpu.2,
        "fsize": if cfg.max_workspace_bytes > 0 {
            "RLIMIT_FSIZE caps each file at maxWorkspaceBytes + 1 byte (so a capped write fails the quota check)"
        } else {
            "maxWorkspaceBytes is 0 (unlimited)"
        },
        "unprivilegedSandboxUser": format!(
            "every sandbox runs as host uid {} ({}); sandbox-init refuses to start one as uid 0",
            app.sandbox.user.uid,
            app.sandbox.user.describe()
        ),
        "workspaceBytes": workspace.1,
        "seccomp": if cap.sandbox_usable { "the baseline profile on every execution (the network profile for domain-allowlist runs)" } else { "no sandbox can be built on this host" },
        "nestedUserNamespaces": match cap.reason {
            crate::sandbox::preflight::CapabilityReason::Supported => "--disable-userns, and clone(CLONE_NEWUSER)/unshare denied by seccomp",
            _ => "--disable-userns unavailable; clone(CLONE_NEWUSER)/unshare still denied by seccomp",
        },
    });
    (enforced, reasons)
}

/// Sandboxes started ahead for executions' next calls (issue #37): the bounds, what waits
/// now and its memory, the hits, misses and discards since start-up.
fn prestarted(app: &App) -> Value {
    let Some(r) = app.sandbox.isolation.prestarted() else {
        return json!({"enabled": false, "reason": "off (SCIENCE_AGENT_PRESTART_SANDBOXES=0), or bwrap has no --bind-fd"});
    };
    pool_block(
        &r,
        "resident memory of the waiting sandboxes' processes (bwrap, its init, the interpreter), RSS summed per process",
    )
}

/// A pool of sandboxes (or VMs) started ahead: its bounds, what waits and its memory, the
/// hits, misses and discards since start-up.
fn pool_block(r: &crate::isolation::prestart::Report, memory: &str) -> Value {
    let reasons = |list: &[(&str, u64)]| -> Value {
        Value::Object(list.iter().map(|(k, n)| ((*k).to_owned(), json!(n))).collect())
    };
    json!({
        "enabled": true,
        "perNode": r.settings.per_node,
        "perTenant": r.settings.per_tenant,
        "idleSeconds": r.settings.idle.as_secs(),
        "waiting": r.waiting,
        "settled": r.settled,
        "memoryBytes": r.memory_bytes,
        "memory": memory,
        "hits": r.hits,
        "misses": reasons(&r.misses),
        "discards": reasons(&r.discards),
        "started": r.started,
        "startFailures": r.failed,
    })
}

/// How sandboxes are built on this host.
fn sandbox_profile(app: &App) -> Value {
    let cap = &app.sandbox.capability;
    let warnings: Vec<&str> = app.sandbox.warnings.iter().map(|w| w.text.as_str()).collect();
    json!({
        "sandboxUsable": cap.sandbox_usable,
        "procMode": cap.proc_mode,
        "procFallback": cap.proc_fallback,
        "disableUserns": cap.disable_userns,
        "reason": cap.reason,
        "warnings": warnings,
        "workspaceIdmap": app.sandbox.idmap,
        "workspaceJournal": app.journal.describe(),
        "prestartedSandboxes": prestarted(app),
        "callerWorkspaces": format!(
            "workspaces owned by the sandbox user ({}) are bound as they are; those owned by another user: \
             idmapped mounts {}",
            app.sandbox.user.name,
            app.sandbox.idmap.describe()
        ),
    })
}
