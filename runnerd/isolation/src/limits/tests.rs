use super::*;
use serde_json::json;

fn settings() -> LimitSettings {
    LimitSettings::from_vars(|_| None).unwrap()
}

#[test]
fn settings_defaults_and_errors() {
    let s = settings();
    assert_eq!(
        s.default,
        Limits { memory_bytes: 2 << 30, pids: 256, cpu_millicores: 1000, tmp_bytes: 512 << 20 }
    );
    assert_eq!(s.max.cpu_millicores, 0);
    assert_eq!(s.mode, ModeChoice::Auto);
    let vars = |k: &str| match k {
        "SCIENCE_AGENT_LIMIT_PIDS" => Some("0".to_owned()),
        "SCIENCE_AGENT_CGROUP_MODE" => Some("rlimits-only".to_owned()),
        "SCIENCE_AGENT_CGROUP_ROOT" => Some("runner".to_owned()),
        _ => None,
    };
    let s = LimitSettings::from_vars(vars).unwrap();
    assert_eq!(
        (s.default.pids, s.mode, s.cgroup_root.as_deref()),
        (0, ModeChoice::RlimitsOnly, Some("runner"))
    );
    let bad =
        LimitSettings::from_vars(|k| (k == "SCIENCE_AGENT_LIMIT_MEMORY_BYTES").then(|| "-1".to_owned()));
    assert_eq!(
        bad.unwrap_err().to_string(),
        "SCIENCE_AGENT_LIMIT_MEMORY_BYTES must be a non-negative integer, not \"-1\""
    );
    let bad = LimitSettings::from_vars(|k| (k == MODE_VAR).then(|| "v3".to_owned()));
    assert!(bad.unwrap_err().to_string().contains("auto, cgroup-v2, cgroup-v1 or rlimits-only"));
}

#[test]
fn request_overrides_table() {
    let s = settings();
    let d = s.default;
    let cases: Vec<(Value, Result<Limits, &str>)> = vec![
        (Value::Null, Ok(d)),
        (json!({}), Ok(d)),
        (json!({"memoryBytes": 1 << 28}), Ok(Limits { memory_bytes: 1 << 28, ..d })),
        (json!({"cpu": 0.5, "pids": 32}), Ok(Limits { cpu_millicores: 500, pids: 32, ..d })),
        // No CPU maximum is configured: 0 (unlimited) and many cores are fine.
        (json!({"cpu": 0}), Ok(Limits { cpu_millicores: 0, ..d })),
        (json!({"cpu": 16}), Ok(Limits { cpu_millicores: 16000, ..d })),
        (json!({"tmpBytes": 1 << 20}), Ok(Limits { tmp_bytes: 1 << 20, ..d })),
        (json!({"memoryBytes": 9u64 << 30}), Err("resourceLimits.memoryBytes may be at most 8589934592")),
        (json!({"memoryBytes": 0}), Err("(0, unlimited, is not allowed)")),
        (json!({"pids": -1}), Err("resourceLimits.pids must be a non-negative number")),
        (json!({"pids": 1.5}), Err("resourceLimits.pids must be a non-negative number")),
        (json!({"cpu": "1"}), Err("resourceLimits.cpu must be a non-negative number")),
        (json!({"disk": 1}), Err("resourceLimits.disk is not a limit")),
        (json!([1]), Err("resourceLimits must be an object")),
    ];
    for (input, want) in cases {
        let got = requested(Some(&input), &s);
        match (got, want) {
            (Ok(g), Ok(w)) => assert_eq!(g, w, "{input}"),
            (Err(g), Err(w)) => assert!(g.contains(w), "{input}: {g}"),
            (g, w) => panic!("{input}: got {g:?}, want {w:?}"),
        }
    }
}

#[test]
fn rlimits_per_mode_table() {
    let l = Limits { memory_bytes: 1 << 28, pids: 64, cpu_millicores: 500, tmp_bytes: 0 };
    assert_eq!(rlimits_for(Mode::CgroupV1, &l, 10_000), vec![]);
    assert_eq!(rlimits_for(Mode::CgroupV2, &l, 10_000), vec![]);
    assert_eq!(
        rlimits_for(Mode::RlimitsOnly, &l, 10_000),
        vec![
            Rlimit::fixed(Resource::As, 1 << 28),
            Rlimit { resource: Resource::Cpu, soft: Some(5), hard: Some(6) }
        ]
    );
    // No timeout: no CPU seconds to derive; unlimited memory: no RLIMIT_AS.
    let free = Limits { memory_bytes: 0, ..l };
    assert_eq!(rlimits_for(Mode::RlimitsOnly, &free, 0), vec![]);
    // Never RLIMIT_NPROC (shared by every process of the uid).
    assert!(rlimits_for(Mode::RlimitsOnly, &l, 1).iter().all(|r| r.resource != Resource::NProc));
    assert_eq!(cpu_seconds(2000, 1500), Some(3));
    assert_eq!(cpu_seconds(100, 100), Some(1));
}

#[test]
fn verdict_table() {
    let l = Limits { memory_bytes: 1 << 28, pids: 64, cpu_millicores: 1000, tmp_bytes: 0 };
    let oom = Usage { oom_kills: 1, ..Usage::default() };
    let forks = Usage { pids_max_hits: 3, ..Usage::default() };
    let quiet = Usage::default();
    let v = verdict(Some(libc::SIGKILL), false, Some(&oom), &l, &[]);
    assert_eq!(v.signal.as_deref(), Some("SIGKILL"));
    assert_eq!(v.oom_killed, Some(true));
    assert!(v.explanation.unwrap().contains("memory limit of 268435456 bytes"));
    let v = verdict(None, false, Some(&forks), &l, &[]);
    assert_eq!((v.signal, v.oom_killed, v.pids_limit_reached), (None, Some(false), Some(true)));
    assert!(v.explanation.unwrap().contains("process limit of 64"));
    let v = verdict(Some(libc::SIGSEGV), true, Some(&quiet), &l, &[]);
    assert!(v.explanation.unwrap().contains("SIGSEGV and wrote nothing to stderr"));
    let v = verdict(Some(libc::SIGSEGV), false, Some(&quiet), &l, &[]);
    assert_eq!(v.explanation, None);
    // rlimits-only: no counters, so oomKilled is unknown rather than false.
    let v = verdict(Some(libc::SIGKILL), true, None, &l, &[]);
    assert_eq!(v.oom_killed, None);
    let cpu = [Rlimit::fixed(Resource::Cpu, 1)];
    assert!(verdict(Some(libc::SIGXCPU), false, None, &l, &cpu).explanation.unwrap().contains("RLIMIT_CPU"));
    assert!(verdict(Some(libc::SIGXFSZ), false, None, &l, &[]).explanation.unwrap().contains("RLIMIT_FSIZE"));
    assert_eq!(
        verdict(None, true, None, &l, &[]),
        Verdict { signal: None, oom_killed: None, pids_limit_reached: None, explanation: None }
    );
}

#[test]
fn health_entries_name_the_mode_and_reason() {
    let e = Enforcement::rlimits_only(vec!["cgroup v2: controllers missing: x".into()]);
    let [mem, pids, cpu] = health_entries(&e, 0);
    assert_eq!((mem.1, pids.1, cpu.1), (json!("partial"), json!(false), json!(false)));
    assert!(mem.2.contains("controllers missing"), "{}", mem.2);
    assert_eq!(health_entries(&e, 1000)[2].1, json!("partial"));
}

#[test]
fn results_mark_what_the_mode_does_not_enforce() {
    let limits = Limits { memory_bytes: 256 << 20, pids: 256, cpu_millicores: 500, tmp_bytes: 16 << 20 };
    let all = EnforcedField {
        memory_bytes: json!(true),
        pids: json!(true),
        cpu: json!(true),
        tmp_bytes: json!(true),
    };
    for mode in [Mode::CgroupV2, Mode::CgroupV1] {
        assert_eq!(enforced(mode, &limits, &rlimits_for(mode, &limits, 10_000)), all, "{mode:?}");
    }
    // rlimits only: pids are never enforced; memory and CPU only partly (RLIMIT_AS, RLIMIT_CPU).
    let r = rlimits_for(Mode::RlimitsOnly, &limits, 10_000);
    let got = enforced(Mode::RlimitsOnly, &limits, &r);
    assert_eq!(
        got,
        EnforcedField {
            memory_bytes: json!("partial"),
            pids: json!(false),
            cpu: json!("partial"),
            tmp_bytes: json!(true)
        }
    );
    // Without a timeout there is no RLIMIT_CPU: the CPU share is not applied at all.
    let got = enforced(Mode::RlimitsOnly, &limits, &rlimits_for(Mode::RlimitsOnly, &limits, 0));
    assert_eq!(got.cpu, json!(false));
    // An unlimited setting promises nothing.
    let none = Limits { memory_bytes: 0, pids: 0, cpu_millicores: 0, tmp_bytes: 0 };
    assert_eq!(enforced(Mode::RlimitsOnly, &none, &[]), all);
    // And the reported /tmp size is the size it had.
    let fields =
        outcome_fields(crate::launch::Termination::Exited(0), true, None, &none, &[], Mode::RlimitsOnly);
    assert_eq!(fields.resource_limits.tmp_bytes, crate::sandbox::argv::FALLBACK_TMP_BYTES);
}
