//! Accelerators through the real runnerd, real bwrap and the real seccomp programs (issue
//! #7; R-NPU-1..4): a fake `npu-smi` / `nvidia-smi` and fake device nodes (regular files:
//! the bind path is the same as for character devices). The fakes behave like the driver:
//! they fail when any chip they can see is taken by another tenant, and the NPU probe fake
//! insists on seeing exactly `/dev/davinci0`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use runner_tests::sandbox_or_skip;
use runner_tests::server::{Server, ServerOptions, shell_request};
use runnerctl::client::Reply;
use serde_json::{Value, json};

const FAKE_NPU_SMI: &str = include_str!("../../runnerd/engine/src/accel/fixtures/fake-npu-smi.sh");
const INFO_910B3: &str = include_str!("../../runnerd/engine/src/accel/fixtures/npu-smi-info-910b3.txt");
const FAKE_DCMI_C: &str = include_str!("../../runnerd/engine/src/accel/fixtures/fake_dcmi.c");
const OCCUPIED: &str = "dcmi model initialized failed, because the device is used. ret is -8020";

/// A fake GPU driver's `nvidia-smi -L`: one line per visible GPU node; fails like NVML when
/// a visible GPU is taken.
const FAKE_NVIDIA_SMI: &str = r#"#!/bin/sh
[ "$1" = -L ] || { echo "usage: nvidia-smi -L" >&2; exit 2; }
for node in /dev/nvidia[0-9]*; do
    [ -e "$node" ] || continue
    if grep -q occupied "$node"; then echo "Failed to initialize NVML: Unknown Error" >&2; exit 1; fi
    n=${node#/dev/nvidia}
    echo "GPU $n: Fake H200 (UUID: GPU-fake-$n)"
done
"#;

fn executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// An 8-chip 910B3 host (logic ids 0..=7) plus a 310P3 at logic id 9; chip nodes say `chip N`.
fn fake_npu_host(root: &Path) -> Vec<(String, String)> {
    let (bin, dev) = (root.join("bin"), root.join("dev"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    executable(&bin.join("npu-smi"), FAKE_NPU_SMI);
    let mut mapping = String::from("\tNPU ID    Chip ID    Chip Logic ID    Chip Name\n");
    for card in 0..8 {
        mapping.push_str(&format!("\t{card}         0          {card}                Ascend 910B3\n"));
        mapping.push_str(&format!("\t{card}         1          -                Mcu\n"));
    }
    mapping.push_str("\t9         0          9                Ascend 310P3\n");
    std::fs::write(bin.join("mapping.txt"), mapping).unwrap();
    std::fs::write(bin.join("info.txt"), INFO_910B3).unwrap();
    for n in (0..8).chain([9]) {
        std::fs::write(dev.join(format!("davinci{n}")), format!("chip {n}\n")).unwrap();
    }
    for m in ["davinci_manager", "devmm_svm", "hisi_hdc"] {
        std::fs::write(dev.join(m), "").unwrap();
    }
    vec![
        ("SCIENCE_AGENT_NPU_SMI_PATH".into(), bin.join("npu-smi").display().to_string()),
        ("SCIENCE_AGENT_NPU_DEVICE_DIR".into(), dev.display().to_string()),
        ("SCIENCE_AGENT_NPU_DCMI_LIBRARY".into(), root.join("no-libdcmi.so").display().to_string()),
    ]
}

fn occupy(dev: &Path, name: &str) {
    std::fs::write(dev.join(name), format!("{name} occupied by another tenant\n")).unwrap();
}

async fn get(server: &Server, path: &str) -> Value {
    let reply = server.client().get(path).await.unwrap();
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
    reply.json()
}

fn device(inv: &Value, h: u64) -> Value {
    inv["devices"].as_array().unwrap().iter().find(|d| d["hostIndex"] == h).cloned().unwrap_or(Value::Null)
}

async fn run(server: &Server, ws: &Path, field: &str, chips: Value, code: &str) -> Reply {
    let mut body = shell_request("main", "session", ws, code);
    body[field] = chips;
    server.client().post_signed("/execute-shell", &body).await.unwrap()
}

fn probes_logged(server: &Server) -> usize {
    server.stderr().matches("accel_probe").count()
}

#[tokio::test]
async fn npu_chips_are_probed_one_by_one_bound_renumbered_and_refused_by_name() {
    if !sandbox_or_skip("npu_chips_are_probed_one_by_one_bound_renumbered_and_refused_by_name") {
        return;
    }
    let host = runner_tests::scratch_dir();
    let dev = host.path().join("dev");
    let env = fake_npu_host(host.path());
    occupy(&dev, "davinci2");
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let ws = server.project_workspace("session");

    // The inventory: every 910 chip probed in its own sandbox. Chip 2 is taken; had a probe
    // seen more than its own chip, every probe would have failed like the driver does.
    let inv = get(&server, "/npu/devices").await;
    assert_eq!((inv["supported"].as_bool(), inv["source"].as_str()), (Some(true), Some("npu-smi")), "{inv}");
    let ids: Vec<u64> =
        inv["devices"].as_array().unwrap().iter().map(|d| d["hostIndex"].as_u64().unwrap()).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5, 6, 7, 9]);
    for h in [0, 1, 3, 4, 5, 6, 7] {
        assert_eq!(device(&inv, h)["sandboxUsable"], true, "chip {h}: {inv}");
    }
    assert_eq!(device(&inv, 0)["hbmUsedMb"], 3445);
    // A chip that `info -m` lists but `info` has no readings for: still listed, `health`
    // present and empty (the original's `?? ""`), no readings.
    assert_eq!(device(&inv, 1)["health"], "", "{inv}");
    assert!(device(&inv, 1).get("hbmUsedMb").is_none());
    assert_eq!(device(&inv, 2)["sandboxUsable"], false);
    assert_eq!(
        device(&inv, 2)["sandboxUnusableReason"],
        format!("NPU 2 cannot be opened inside the sandbox: {OCCUPIED}")
    );
    assert_eq!(
        device(&inv, 9)["sandboxUnusableReason"],
        "Only Ascend 910 series chips are supported; this one reports \"310P3\"."
    );
    assert_eq!(probes_logged(&server), 8, "one probe per supported chip");

    // An execution without chips never probes, and sees no chip.
    let plain = run(&server, &ws, "npuDevices", json!([]), "ls /dev | grep -c davinci || true").await;
    assert_eq!((plain.status, plain.json()["stdout"].as_str()), (200, Some("0\n")), "{}", plain.json());
    assert_eq!(probes_logged(&server), 8);

    // Chosen chips only, renumbered from 0 in ascending host order, with the CANN variables.
    let code = "ls /dev | grep -E '^(davinci|devmm|hisi)' | tr '\\n' ' '; echo; cat /dev/davinci0 /dev/davinci1; echo \"$PATH\"";
    let reply = run(&server, &ws, "npuDevices", json!([6, 4]), code).await;
    let v = reply.json();
    assert_eq!(reply.status, 200, "{v}");
    assert_eq!(
        v["stdout"],
        "davinci0 davinci1 davinci_manager devmm_svm hisi_hdc \nchip 4\nchip 6\n/usr/local/bin:/usr/bin:/bin\n"
    );
    assert_eq!(v["environmentVariables"]["ASCEND_TOOLKIT_HOME"], "/usr/local/Ascend/ascend-toolkit/latest");
    assert!(v["environmentVariables"]["LD_LIBRARY_PATH"].as_str().unwrap().contains("driver/lib64/common"));
    assert!(v.get("npuDevices").is_none(), "the result has no NPU fields");
    assert_eq!(probes_logged(&server), 10, "exactly the two named chips were re-probed");
    assert!(
        server.stderr().lines().any(|l| l.contains("execution_started") && l.contains("profile=npu")),
        "the audit names the npu profile"
    );
    // The `npu` seccomp profile, seen from inside: it lets the driver open netlink sockets,
    // which the baseline profile of a run without chips refuses.
    let netlink = "python3 -c 'import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0); print(\"netlink ok\")'";
    let with_chip = run(&server, &ws, "npuDevices", json!([0]), netlink).await.json();
    assert_eq!(
        (with_chip["exitCode"].as_i64(), with_chip["stdout"].as_str()),
        (Some(0), Some("netlink ok\n")),
        "{with_chip}"
    );
    let without = run(&server, &ws, "npuDevices", json!([]), netlink).await.json();
    assert_ne!(without["exitCode"].as_i64(), Some(0), "{without}");
    assert!(without["stderr"].as_str().unwrap().contains("Operation not permitted"), "{without}");
    assert_eq!(probes_logged(&server), 11);

    // A taken chip fails the execution by name; nothing runs on fewer chips.
    let reply = run(&server, &ws, "npuDevices", json!([4, 2]), "touch ran.txt").await;
    assert_eq!(
        (reply.status, reply.json()["error"].as_str(), reply.json()["code"].as_str()),
        (
            400,
            Some(format!("Requested NPU cards are not usable on this machine: NPU 2 cannot be opened inside the sandbox: {OCCUPIED}").as_str()),
            Some("npu_unavailable")
        )
    );
    assert!(!ws.join("ran.txt").exists());

    // A cached "usable" verdict is overridden by the fresh probe.
    occupy(&dev, "davinci5");
    assert_eq!(device(&get(&server, "/npu/devices").await, 5)["sandboxUsable"], true, "the 60 s cache");
    let reply = run(&server, &ws, "npuDevices", json!([5]), "touch ran.txt").await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["error"],
        format!(
            "Requested NPU cards are not usable on this machine: NPU 5 cannot be opened inside the sandbox: {OCCUPIED}"
        )
    );
    assert!(!ws.join("ran.txt").exists());
    let fresh = get(&server, "/npu/devices?refresh=1").await;
    assert_eq!(device(&fresh, 5)["sandboxUsable"], false, "refresh=1 drops the cache");

    // Unsupported and absent chips are refused with the original's reasons.
    let reply = run(&server, &ws, "npuDevices", json!([9, 12]), "touch ran.txt").await;
    assert_eq!(
        reply.json()["error"],
        "Requested NPU cards are not usable on this machine: Only Ascend 910 series chips are supported; this one reports \"310P3\". NPU 12 is no longer present on this machine."
    );
    // /resources carries the (cached) inventory where the host has the tooling.
    let resources = get(&server, "/resources").await;
    assert_eq!(resources["npu"]["supported"], true);
}

#[tokio::test]
async fn dcmi_is_read_first_through_dlopen() {
    if !sandbox_or_skip("dcmi_is_read_first_through_dlopen") {
        return;
    }
    let host = runner_tests::scratch_dir();
    let mut env = fake_npu_host(host.path());
    let src = host.path().join("fake_dcmi.c");
    let lib = host.path().join("libdcmi.so");
    std::fs::write(&src, FAKE_DCMI_C).unwrap();
    let built =
        std::process::Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&src).status();
    assert!(built.is_ok_and(|s| s.success()), "cc builds the fake libdcmi.so");
    env.retain(|(k, _)| k != "SCIENCE_AGENT_NPU_DCMI_LIBRARY");
    env.push(("SCIENCE_AGENT_NPU_DCMI_LIBRARY".into(), lib.display().to_string()));
    std::fs::remove_file(host.path().join("bin/info.txt")).unwrap(); // npu-smi's listing would fail
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let inv = get(&server, "/npu/devices").await;
    assert_eq!(inv["source"], "dcmi", "{inv}");
    let got: Vec<(u64, &str, f64, bool)> = inv["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let usable = d["sandboxUsable"].as_bool().unwrap();
            (
                d["hostIndex"].as_u64().unwrap(),
                d["chipName"].as_str().unwrap(),
                d["powerWatts"].as_f64().unwrap(),
                usable,
            )
        })
        .collect();
    // Card 1 does not answer and card 0's third chip has no logic id: skipped, not the
    // whole read. Card 2's chip (logic 7) answers neither name nor health.
    assert_eq!(got, [(4, "910C", 103.9, true), (5, "910C", 138.8, true), (7, "", 103.9, false)]);
    assert_eq!(device(&inv, 5)["health"], "Alarm");
    assert_eq!(device(&inv, 7)["health"], "", "health is always present, empty when unknown");
    assert_eq!(
        device(&inv, 7)["sandboxUnusableReason"],
        "Only Ascend 910 series chips are supported; this one reports \"\"."
    );
}

#[tokio::test]
async fn a_failed_npu_listing_names_the_tools_words_and_is_cached_until_refresh() {
    if !sandbox_or_skip("a_failed_npu_listing_names_the_tools_words_and_is_cached_until_refresh") {
        return;
    }
    let host = runner_tests::scratch_dir();
    let mut env = fake_npu_host(host.path());
    // Blanks around a setting are trimmed, as the original's `.trim()`.
    for (k, v) in env.iter_mut() {
        if k == "SCIENCE_AGENT_NPU_SMI_PATH" {
            *v = format!("  {v} ");
        }
    }
    let info = host.path().join("bin/info.txt");
    std::fs::remove_file(&info).unwrap(); // `npu-smi info` fails as the driver's does
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let smi = host.path().join("bin/npu-smi");
    let first = get(&server, "/npu/devices").await;
    assert_eq!(
        first,
        json!({
            "capturedAt": first["capturedAt"],
            "devices": [],
            "error": format!("Could not read NPU status: Command failed: {} info\ndcmi model initialized failed\n", smi.display()),
            "supported": true
        })
    );
    std::fs::write(&info, INFO_910B3).unwrap();
    let again = get(&server, "/npu/devices").await;
    assert_eq!(again, first, "the answer is cached for the TTL like any other (as the original)");
    let fresh = get(&server, "/npu/devices?refresh=1").await;
    assert!(fresh.get("error").is_none(), "{fresh}");
    assert_eq!(fresh["devices"].as_array().map(Vec::len), Some(9), "{fresh}");
}

#[tokio::test]
async fn npu_selection_on_a_host_without_npu_support_is_refused() {
    if !sandbox_or_skip("npu_selection_on_a_host_without_npu_support_is_refused") {
        return;
    }
    let env = vec![("SCIENCE_AGENT_NPU_SMI_PATH".to_owned(), "/nonexistent/npu-smi".to_owned())];
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let ws = server.project_workspace("session");
    let inv = get(&server, "/npu/devices").await;
    assert_eq!((&inv["supported"], &inv["devices"]), (&json!(false), &json!([])));
    assert!(get(&server, "/resources").await.get("npu").is_none(), "npu only when supported");
    let reply = run(&server, &ws, "npuDevices", json!(["0"]), "touch ran.txt").await;
    assert_eq!((reply.status, reply.json()["code"].as_str()), (400, Some("invalid_accelerators")));
    assert!(!ws.join("ran.txt").exists());
}

#[tokio::test]
async fn gpus_are_probed_and_bound_the_same_way() {
    if !sandbox_or_skip("gpus_are_probed_and_bound_the_same_way") {
        return;
    }
    let host = runner_tests::scratch_dir();
    let dev: PathBuf = host.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    for n in ["nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"] {
        std::fs::write(dev.join(n), format!("{n}\n")).unwrap();
    }
    occupy(&dev, "nvidia2");
    let smi = host.path().join("nvidia-smi");
    executable(&smi, FAKE_NVIDIA_SMI);
    let env = vec![
        ("SCIENCE_AGENT_NVIDIA_SMI_PATH".to_owned(), smi.display().to_string()),
        ("SCIENCE_AGENT_GPU_DEVICE_DIR".to_owned(), dev.display().to_string()),
    ];
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let ws = server.project_workspace("session");
    let inv = get(&server, "/gpu/devices").await;
    assert_eq!(inv["supported"], true, "{inv}");
    assert_eq!(device(&inv, 0)["name"], "Fake H200", "{inv}");
    assert_eq!(device(&inv, 1)["uuid"], "GPU-fake-1");
    assert_eq!(
        device(&inv, 2)["sandboxUnusableReason"],
        "GPU 2 cannot be opened inside the sandbox: Failed to initialize NVML: Unknown Error"
    );
    let reply = run(&server, &ws, "gpuDevices", json!([1]), "ls /dev | grep nvidia | tr '\\n' ' '").await;
    assert_eq!(
        (reply.status, reply.json()["stdout"].as_str()),
        (200, Some("nvidia-uvm nvidia1 nvidiactl ")),
        "{}",
        reply.json()
    );
    let reply = run(&server, &ws, "gpuDevices", json!([1, 2]), "touch ran.txt").await;
    assert_eq!(
        reply.json()["error"],
        "Requested GPUs are not usable on this machine: GPU 2 cannot be opened inside the sandbox: Failed to initialize NVML: Unknown Error"
    );
    assert!(!ws.join("ran.txt").exists());
}

/// As root, the fake nodes are real character devices made with mknod (/dev/null's numbers
/// for a free chip, /dev/zero's for a taken one): the same binds, the same probe verdicts.
#[tokio::test]
async fn character_device_nodes_made_with_mknod_are_probed_and_bound_the_same_way() {
    const TEST: &str = "character_device_nodes_made_with_mknod_are_probed_and_bound_the_same_way";
    if !sandbox_or_skip(TEST) {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("\n!!! SKIPPING {TEST}: mknod needs root; the regular-file fakes cover this user !!!\n");
        return;
    }
    let host = runner_tests::scratch_dir();
    let env = fake_npu_host(host.path());
    let dev = host.path().join("dev");
    for (name, minor) in [("davinci0", "3"), ("davinci1", "5"), ("davinci_manager", "3")] {
        std::fs::remove_file(dev.join(name)).unwrap();
        let made = std::process::Command::new("mknod").arg(dev.join(name)).args(["c", "1", minor]).status();
        assert!(made.is_ok_and(|s| s.success()), "mknod {name}");
        std::fs::set_permissions(dev.join(name), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let ws = server.project_workspace("session");
    let inv = get(&server, "/npu/devices").await;
    assert_eq!(device(&inv, 0)["sandboxUsable"], true, "{inv}");
    assert_eq!(
        device(&inv, 1)["sandboxUnusableReason"],
        format!("NPU 1 cannot be opened inside the sandbox: {OCCUPIED}")
    );
    let reply = run(
        &server,
        &ws,
        "npuDevices",
        json!([0]),
        "[ -c /dev/davinci0 ] && [ -c /dev/davinci_manager ] && echo char",
    )
    .await;
    assert_eq!((reply.status, reply.json()["stdout"].as_str()), (200, Some("char\n")), "{}", reply.json());
    let reply = run(&server, &ws, "npuDevices", json!([1]), "touch ran.txt").await;
    assert_eq!(reply.json()["code"], "npu_unavailable");
    assert!(!ws.join("ran.txt").exists());
}

/// Managed runs (`/shell-executions`) take the same path: probed right before their sandbox.
#[tokio::test]
async fn managed_runs_get_their_chips_or_fail_naming_the_taken_one() {
    if !sandbox_or_skip("managed_runs_get_their_chips_or_fail_naming_the_taken_one") {
        return;
    }
    let host = runner_tests::scratch_dir();
    let env = fake_npu_host(host.path());
    occupy(&host.path().join("dev"), "davinci2");
    let server = Server::start_with(ServerOptions { env, ..Default::default() });
    let ws = server.project_workspace("session");
    let client = server.client();
    let mut finals = Vec::new();
    for (id, chips, code) in
        [("npu-ok", json!([4]), "cat /dev/davinci0"), ("npu-taken", json!([2]), "touch ran.txt")]
    {
        let mut body = shell_request("main", "session", &ws, code);
        body["executionId"] = json!(id);
        body["npuDevices"] = chips;
        let reply = client.post_signed("/shell-executions", &body).await.unwrap();
        assert!(reply.status < 300, "{}", reply.json());
        let path = format!("/shell-executions/{id}?sessionId=session&agentId=main");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let rec = loop {
            let rec = client.get(&path).await.unwrap().json();
            if matches!(rec["state"].as_str(), Some("completed" | "failed" | "cancelled")) {
                break rec;
            }
            assert!(std::time::Instant::now() < deadline, "{id} never finished: {rec}");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        finals.push(rec);
    }
    assert_eq!(
        (finals[0]["state"].as_str(), finals[0]["result"]["stdout"].as_str()),
        (Some("completed"), Some("chip 4\n")),
        "{}",
        finals[0]
    );
    assert_eq!(finals[1]["state"], "failed", "{}", finals[1]);
    assert_eq!(
        finals[1]["error"],
        format!(
            "Requested NPU cards are not usable on this machine: NPU 2 cannot be opened inside the sandbox: {OCCUPIED}"
        )
    );
    assert!(!ws.join("ran.txt").exists());
}
