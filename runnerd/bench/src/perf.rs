//! perf attached to a daemon during one case of a benchmark, when the case's variable asks
//! for it (`RUNNERD_BENCH_MOVE_PERF`, `RUNNERD_BENCH_FLEET_PERF`).

use std::process::Command;
use std::time::Duration;

use anyhow::Context;

/// perf with `$var`'s arguments on `pid` during `case`, when that case is the one chosen
/// (`${var}_CASE`, else `default_case`); stopped (SIGINT) when the guard is dropped.
pub(crate) struct Perf(std::process::Child);
impl Perf {
    pub(crate) fn start(var: &str, default_case: &str, case: &str, pid: u32) -> anyhow::Result<Option<Perf>> {
        let Ok(args) = std::env::var(var) else { return Ok(None) };
        if std::env::var(format!("{var}_CASE")).as_deref().unwrap_or(default_case) != case {
            return Ok(None);
        }
        let child = Command::new("perf")
            .args(args.split_whitespace())
            .args(["-p", &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("starting perf")?;
        std::thread::sleep(Duration::from_millis(500));
        Ok(Some(Perf(child)))
    }
}
impl Drop for Perf {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            // SAFETY: a signal to perf, our own child (not yet waited for, so its pid is its own).
            unsafe { libc::kill(pid, libc::SIGINT) };
        }
        let _ = self.0.wait();
    }
}
