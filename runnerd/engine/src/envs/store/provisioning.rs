//! Running provisioning steps: conda's fetch and link under the package cache's gate, pip
//! and R tools, and the failure texts they answer.

use std::path::{Path, PathBuf};

use common::provision::{self, Op};

use crate::app::App;
use crate::envs::ids;
use crate::envs::sandboxed::{self, StepOutput};
use crate::envs::steps::{self, CondaPlaces};

use super::{EnvStore, StoreError};

impl EnvStore {
    /// A conda step over `channels`: when every host it reaches belongs to a channel the
    /// operator configured, that host may resolve to a private address (an offline site's
    /// mirror on the LAN is allowed as configured); a request's preset mirror may not.
    fn conda_step(
        &self,
        op: Op,
        prefix: &Path,
        channels: &[String],
        extra_ro: &[PathBuf],
        stage: provision::Stage,
    ) -> sandboxed::Step {
        let mut step = steps::conda(&self.places(), op, prefix, channels, extra_ro, stage);
        let configured_urls: Vec<String> =
            self.settings.channels.iter().filter_map(|c| ids::channel_url(c).ok()).collect();
        steps::pin_configured(&mut step, &configured_urls);
        step
    }

    /// The conda channels of a step that does not name its own (an uninstall, a clone): the
    /// ones a revision recorded that are still allowed, else the configured ones. A pip or
    /// CRAN revision records its index or repository, which must never be read as a conda
    /// channel (nor opened to egress for one).
    pub(super) fn conda_channels(&self, recorded: &[String]) -> Vec<String> {
        let allowed: Vec<String> = recorded
            .iter()
            .filter(|c| ids::allowed_channels(std::slice::from_ref(*c), &self.settings.channels).is_ok())
            .cloned()
            .collect();
        match allowed.is_empty() {
            true => self.settings.channels.clone(),
            false => allowed,
        }
    }

    /// The conda step's places: the provisioner, the cache, offline or not.
    fn places(&self) -> CondaPlaces<'_> {
        CondaPlaces {
            provisioner: &self.provisioner,
            cache_dir: &self.cache_dir,
            read_only_caches: &self.read_only_caches,
            offline: self.settings.offline(),
            max_prefix_bytes: self.settings.step_max_prefix_bytes,
        }
    }

    pub(super) fn channel_urls(&self, channels: &[String]) -> Result<Vec<String>, StoreError> {
        Ok(channels.iter().map(|c| ids::channel_url(c)).collect::<Result<_, _>>()?)
    }

    /// A conda change as its two steps (`provision::Stage`): fetch with the prefix read-only,
    /// then link that solution with the caches read-only. The caller holds the environment's
    /// write gate across both, so the prefix the link step finds is the one the fetch step
    /// solved for. A fetch that fails has changed no prefix.
    pub(super) async fn conda_change(
        &self,
        app: &App,
        op: Op,
        prefix: &Path,
        channels: &[String],
        extra_ro: &[PathBuf],
    ) -> Result<provision::Response, StoreError> {
        let fetch = self.conda_step(op.clone(), prefix, channels, extra_ro, provision::Stage::Fetch);
        let writing = self.cache_gate.write().await;
        let fetched = self.conda(app, fetch).await?;
        let solution = fetched.solution.ok_or_else(|| StoreError::Step {
            label: "conda",
            detail: "the provisioner's fetch step answered no solution".into(),
        })?;
        let link = self.conda_step(op, prefix, channels, extra_ro, provision::Stage::Link { solution });
        // Downgraded, not released: no other fetch may replace an entry this solution links
        // before the link step has copied it; other link steps may run meanwhile.
        let reading = writing.downgrade();
        let mut linked = self.conda(app, link).await?;
        drop(reading);
        linked.solve_micros = fetched.solve_micros;
        linked.peak_rss_kib = linked.peak_rss_kib.max(fetched.peak_rss_kib);
        Ok(linked)
    }

    /// Runs a provisioner step and reads its answer.
    async fn conda(&self, app: &App, step: sandboxed::Step) -> Result<provision::Response, StoreError> {
        let out = sandboxed::run(app, step).await?;
        if out.truncated {
            return Err(StoreError::Step {
                label: "conda",
                detail: "the provisioner's answer was larger than runnerd reads".into(),
            });
        }
        let answer: Option<provision::Response> = serde_json::from_str(out.stdout.trim()).ok();
        match (out.succeeded(), answer) {
            (true, Some(a)) if a.error.is_none() => Ok(a),
            (_, Some(a)) if a.error.is_some() => Err(self.step_error("conda", a.error.unwrap_or_default())),
            _ => Err(self.step_error("conda", step_failure(&out))),
        }
    }

    /// pip or R: run it, then list the conda packages (unchanged by them, but the record
    /// carries the whole inventory).
    pub(super) async fn run_tool(
        &self,
        app: &App,
        step: sandboxed::Step,
    ) -> Result<provision::Response, StoreError> {
        let label = step.label;
        let prefix = step.binds[0].0.clone();
        let out = sandboxed::run(app, step).await?;
        if !out.succeeded() {
            return Err(self.step_error(label, step_failure(&out)));
        }
        let urls: Vec<String> = Vec::new();
        let places = CondaPlaces { offline: true, ..self.places() };
        let list = steps::conda(&places, Op::List, &prefix, &urls, &[], provision::Stage::Fetch);
        self.conda(app, list).await
    }

    fn step_error(&self, label: &'static str, detail: String) -> StoreError {
        StoreError::Step { label, detail: with_file_limit(detail, self.settings.step_max_file_bytes) }
    }
}

/// A step's own failure text, with the limit named when a write failed with `EFBIG` (the
/// provisioner and Python ignore `SIGXFSZ`, so `RLIMIT_FSIZE` reaches them as an error).
fn with_file_limit(detail: String, max_file: u64) -> String {
    let efbig = ["File too large", "os error 27", "Errno 27"].iter().any(|t| detail.contains(t));
    match efbig && max_file > 0 {
        true => format!(
            "{detail} (a provisioning step may write no file larger than {max_file} bytes: env_step_max_file_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FILE_BYTES)"
        ),
        false => detail,
    }
}

fn step_failure(out: &StepOutput) -> String {
    let tail = out.tail();
    match (out.code, tail.is_empty()) {
        (Some(c), true) => format!("exited with code {c}"),
        (None, true) => "was killed by a signal".to_owned(),
        (_, false) => tail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_stopped_by_the_file_limit_names_it() {
        for (detail, max, named) in [
            ("OSError: [Errno 27] File too large: '/p/lib/x'", 1 << 20, true),
            ("The packages could not be installed into /p: File too large (os error 27)", 1 << 20, true),
            ("ERROR: No matching distribution found for nothing", 1 << 20, false),
            ("OSError: [Errno 27] File too large", 0, false),
        ] {
            let out = with_file_limit(detail.to_owned(), max);
            assert_eq!(out.contains("env_step_max_file_bytes"), named, "{out}");
            assert!(out.starts_with(detail), "the step's own words come first: {out}");
        }
    }
}
