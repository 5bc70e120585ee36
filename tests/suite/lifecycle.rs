//! Launch mechanics: exit codes, stdin, output budgets, timeouts that leave nothing behind,
//! abandoned runs, and sandboxes that outlive idle runtime threads.

use std::time::Duration;

use runner_tests::{Fixture, processes_matching, sandbox_or_skip};
use runnerd::launch::{Launch, LaunchError, OutputBudget, Termination};
use runnerd::sandbox::Language;

#[tokio::test]
async fn exit_codes_stdout_stderr_and_stdin() {
    if !sandbox_or_skip("exit_codes_stdout_stderr_and_stdin") {
        return;
    }
    let f = Fixture::new().await;
    let (outcome, out) = f.shell("echo out; echo err >&2; exit 7").await;
    assert_eq!(outcome.termination, Termination::Exited(7));
    assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("out\n", "err\n"));
    assert!(outcome.sandbox_pid.is_some());

    // Strict mode: a failing command stops the script.
    let (outcome, out) = f.shell("false\necho not-reached").await;
    assert_eq!(outcome.termination, Termination::Exited(1));
    assert_eq!(out.stdout, "");

    // Code arrives on stdin; a large script too (beyond one pipe buffer).
    let big = format!("x='{}'\necho ${{#x}}", "a".repeat(300_000));
    let (outcome, out) = f.shell(&big).await;
    assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
    assert_eq!(out.stdout, "300000\n");

    let (outcome, out) = f
        .run(f.launch(Language::Python, "import sys; print(sys.flags.isolated); sys.exit(3)", None), 1 << 20)
        .await;
    assert_eq!(outcome.termination, Termination::Exited(3), "{}", out.stderr);
    assert_eq!(out.stdout, "1\n");
}

#[tokio::test]
async fn an_output_flood_is_cut_to_the_budget() {
    if !sandbox_or_skip("an_output_flood_is_cut_to_the_budget") {
        return;
    }
    let f = Fixture::new().await;
    let launch = f.launch(Language::Shell, "seq 1 200000; seq 1 1000 >&2", None);
    let (outcome, out) = f.run(launch, 2000).await;
    assert_eq!(outcome.termination, Termination::Exited(0));
    assert!(out.truncated);
    assert!(out.stdout.contains("output truncated"));
    assert!(out.stdout.len() + out.stderr.len() <= 2000);
    assert!(out.stdout.starts_with("1\n2\n3\n"));
    assert!(out.stdout.ends_with("199999\n200000\n"));
}

#[tokio::test]
async fn a_timeout_kills_the_whole_namespace_background_included() {
    if !sandbox_or_skip("a_timeout_kills_the_whole_namespace_background_included") {
        return;
    }
    let f = Fixture::new().await;
    let marker = format!("{}", 900_000 + std::process::id() % 90_000);
    let script = format!("sleep 1{marker} &\nsetsid sleep 2{marker} &\necho started\nsleep 3{marker}");
    let launch = f.launch(Language::Shell, &script, Some(Duration::from_millis(1500)));
    let (outcome, out) = f.run(launch, 1 << 20).await;
    assert_eq!(outcome.termination, Termination::TimedOut);
    assert_eq!(out.stdout, "started\n");
    let left = processes_matching(&format!("sleep 1{marker}"))
        .into_iter()
        .chain(processes_matching(&format!("sleep 2{marker}")))
        .chain(processes_matching(&format!("sleep 3{marker}")))
        .collect::<Vec<_>>();
    assert!(left.is_empty(), "processes survived the timeout: {left:?}");
    let pid = outcome.sandbox_pid.expect("bwrap reported the namespace init");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    assert!(status.is_empty(), "namespace init {pid} survived: {status}");
}

#[tokio::test]
async fn a_normal_exit_also_ends_background_processes() {
    if !sandbox_or_skip("a_normal_exit_also_ends_background_processes") {
        return;
    }
    let f = Fixture::new().await;
    let marker = format!("{}", 800_000 + std::process::id() % 90_000);
    let (outcome, _) = f.shell(&format!("nohup sleep 4{marker} >/dev/null 2>&1 &\necho done")).await;
    assert_eq!(outcome.termination, Termination::Exited(0));
    let left = processes_matching(&format!("sleep 4{marker}"));
    assert!(left.is_empty(), "a background process outlived its sandbox: {left:?}");
}

#[tokio::test]
async fn dropping_the_run_kills_the_sandbox() {
    if !sandbox_or_skip("dropping_the_run_kills_the_sandbox") {
        return;
    }
    let f = Fixture::new().await;
    let marker = format!("{}", 700_000 + std::process::id() % 90_000);
    let launch = f.launch(Language::Shell, &format!("sleep 5{marker}"), None);
    let mut output = OutputBudget::new(1 << 20);
    let run = f.launcher.run(launch, &mut output);
    // The client "disconnects" after a second.
    let abandoned = tokio::time::timeout(Duration::from_secs(1), run).await;
    assert!(abandoned.is_err(), "the sleep should still have been running");
    // The kill is synchronous (pidfd); the kernel tears the namespace down right after.
    for _ in 0..100 {
        if processes_matching(&format!("sleep 5{marker}")).is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the abandoned sandbox is still running");
}

#[test]
fn a_sandbox_outlives_an_idle_minute() {
    if !sandbox_or_skip("a_sandbox_outlives_an_idle_minute") {
        return;
    }
    // Idle runtime threads retire after one second here; PDEATHSIG would fire if a
    // retiring thread had spawned the sandbox.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_keep_alive(Duration::from_secs(1))
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let f = Fixture::new().await;
        // Give the blocking pool a job, so it has a thread that will retire.
        tokio::task::spawn_blocking(|| ()).await.unwrap();
        let launch = f.launch(Language::Shell, "sleep 65; echo still-here", None);
        let (outcome, out) = f.run(launch, 1 << 20).await;
        assert_eq!(outcome.termination, Termination::Exited(0), "{}", out.stderr);
        assert_eq!(out.stdout, "still-here\n");
    });
}

fn plain_launch(bwrap: &str, rlimits: Vec<common::plan::Rlimit>) -> Launch {
    Launch {
        bwrap: bwrap.into(),
        options: Vec::new(),
        command: vec!["--version".into()],
        filter: None,
        rlimits,
        stdin: Vec::new(),
        timeout: None,
        cancel: None,
        extra_fds: Default::default(),
        cgroup_procs: Vec::new(),
    }
}

#[tokio::test]
async fn a_missing_bwrap_is_a_typed_error() {
    let f = Fixture::new_without_probe().await;
    let launch = plain_launch("/nonexistent/bwrap", Vec::new());
    let mut output = OutputBudget::new(0);
    let err = f.launcher.run(launch, &mut output).await.unwrap_err();
    assert!(matches!(&err, LaunchError::BwrapMissing { path } if path == "/nonexistent/bwrap"), "{err:?}");
}

#[tokio::test]
async fn a_failing_sandbox_init_step_is_a_typed_error() {
    let f = Fixture::new_without_probe().await;
    // Above the kernel's nr_open: sandbox-init's setrlimit step fails.
    let too_many = common::plan::Rlimit::fixed(common::plan::Resource::NoFile, u64::from(u32::MAX));
    let launch = plain_launch("/usr/bin/true", vec![too_many]);
    let mut output = OutputBudget::new(0);
    match f.launcher.run(launch, &mut output).await {
        Err(LaunchError::Init(failure)) => assert_eq!(failure.step, common::plan::InitStep::Rlimits),
        other => panic!("expected an rlimit failure, got {other:?}"),
    }
}

#[tokio::test]
async fn an_early_failure_survives_the_connection_reset() {
    // sandbox-init refuses a relative bwrap path before it receives its descriptors; it exits
    // with them unread, the kernel resets the channel, and the report must still arrive.
    let f = Fixture::new_without_probe().await;
    for _ in 0..5 {
        let mut output = OutputBudget::new(0);
        match f.launcher.run(plain_launch("bwrap", Vec::new()), &mut output).await {
            Err(LaunchError::Init(failure)) => assert_eq!(failure.step, common::plan::InitStep::ValidatePlan),
            other => panic!("expected a ValidatePlan failure, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn descriptor_options_belong_to_the_launcher() {
    let f = Fixture::new_without_probe().await;
    for reserved in ["--seccomp", "--info-fd", "--json-status-fd"] {
        let mut launch = plain_launch("/usr/bin/true", Vec::new());
        launch.options = vec![reserved.into(), "9".into()];
        let mut output = OutputBudget::new(0);
        let err = f.launcher.run(launch, &mut output).await.unwrap_err();
        assert!(matches!(&err, LaunchError::ReservedOption(o) if o == reserved), "{err:?}");
    }
}

#[tokio::test]
async fn timeouts_at_any_moment_of_the_start_leave_nothing_behind() {
    if !sandbox_or_skip("timeouts_at_any_moment_of_the_start_leave_nothing_behind") {
        return;
    }
    // Timeouts from 0 to ~12 ms land before, during and after bwrap sets the sandbox up;
    // each must still end the sandbox and return.
    let f = Fixture::new().await;
    let marker = format!("{}", 600_000 + std::process::id() % 90_000);
    for i in 0..40u64 {
        let launch =
            f.launch(Language::Shell, &format!("sleep 6{marker}"), Some(Duration::from_micros(i * 300)));
        let mut output = OutputBudget::new(1 << 16);
        // A liveness guard, not a performance threshold: a hung run never returns.
        let outcome = tokio::time::timeout(Duration::from_secs(60), f.launcher.run(launch, &mut output))
            .await
            .unwrap_or_else(|_| panic!("run {i} never returned"))
            .expect("launch");
        assert_eq!(outcome.termination, Termination::TimedOut, "run {i}");
    }
    // The watcher tasks may still be delivering late kills; give them their grace period.
    for _ in 0..300 {
        let left = processes_matching(&format!("6{marker}"));
        if left.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("processes survived early timeouts: {:?}", processes_matching(&format!("6{marker}")));
}

#[tokio::test]
async fn cancellation_ends_the_sandbox_and_says_so() {
    if !sandbox_or_skip("cancellation_ends_the_sandbox_and_says_so") {
        return;
    }
    let f = Fixture::new().await;
    let marker = format!("{}", 500_000 + std::process::id() % 90_000);
    let (cancel, rx) = tokio::sync::watch::channel(false);
    let mut launch =
        f.launch(Language::Shell, &format!("echo started; sleep 7{marker} & sleep 7{marker}"), None);
    launch.cancel = Some(rx);
    let mut output = OutputBudget::new(1 << 16);
    let run = f.launcher.run(launch, &mut output);
    let canceller = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        cancel.send(true).unwrap();
    };
    let (outcome, ()) = tokio::join!(run, canceller);
    assert_eq!(outcome.expect("launch").termination, Termination::Cancelled);
    assert_eq!(output.finish().stdout, "started\n");
    let left = processes_matching(&format!("sleep 7{marker}"));
    assert!(left.is_empty(), "{left:?}");
}
