//! Job records (`NpuJob` on the wire) and their durable store: `<state>/npu-jobs/jobs.json`,
//! written whole and atomically (`<path>.<pid>.tmp`, fsync, rename) on every state change.
//! On start, a job left queued or running by a previous broker becomes `interrupted`
//! (internals §4.7); a file that cannot be read is set aside, never lost, and the broker
//! starts with no jobs (contract §7 item 18).

use std::io::Write;
use std::path::{Path, PathBuf};

use common::layout;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Interrupted,
}

impl State {
    pub fn terminal(self) -> bool {
        !matches!(self, State::Queued | State::Running)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Logs {
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Job {
    pub id: String,
    pub session_id: String,
    pub workload_id: String,
    pub state: State,
    pub created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub workspace_root: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_revision_id: Option<String>,
    pub logs: Logs,
    #[serde(default)]
    pub created_files: Vec<String>,
}

impl Job {
    /// The list form: no workspace path, no log text (contract §5.2).
    pub fn summary(&self) -> Job {
        Job {
            workspace_root: String::new(),
            logs: Logs { stdout: String::new(), stderr: String::new(), truncated: self.logs.truncated },
            ..self.clone()
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct File {
    version: u32,
    jobs: Vec<Job>,
}

/// What the original says of a job a restart cut short.
pub const INTERRUPTED: &str = "Runner restarted before the NPU job completed";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("could not create {}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not write the NPU job state {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The on-disk state of every job.
#[derive(Debug)]
pub struct Store {
    pub path: PathBuf,
}

/// What loading found.
#[derive(Debug)]
pub struct Loaded {
    pub jobs: Vec<Job>,
    /// Jobs marked interrupted by this load.
    pub interrupted: Vec<String>,
    /// A file that could not be read, and where it was moved.
    pub set_aside: Option<(String, PathBuf)>,
}

/// Marks queued and running jobs interrupted (pure, for the restart rule).
pub fn interrupt_active(jobs: &mut [Job], now: &str) -> Vec<String> {
    let mut ids = Vec::new();
    for job in jobs.iter_mut().filter(|j| !j.state.terminal()) {
        job.state = State::Interrupted;
        job.error = Some(INTERRUPTED.to_owned());
        job.finished_at = Some(now.to_owned());
        ids.push(job.id.clone());
    }
    ids
}

impl Store {
    pub fn new(state_dir: &Path) -> Store {
        Store { path: layout::npu_jobs_file(state_dir) }
    }

    /// Reads the file (absent: no jobs) and applies the restart rule.
    pub fn load(&self, now: &str) -> Result<Loaded, StoreError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir { path: dir.to_owned(), source })?;
        let mut set_aside = None;
        let mut jobs = match std::fs::read(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(StoreError::Write { path: self.path.clone(), source: e });
            }
            Ok(bytes) => match serde_json::from_slice::<File>(&bytes) {
                Ok(f) => f.jobs,
                Err(e) => {
                    let aside = self.path.with_extension(format!("json.corrupt-{}", std::process::id()));
                    std::fs::rename(&self.path, &aside)
                        .map_err(|source| StoreError::Write { path: aside.clone(), source })?;
                    set_aside = Some((e.to_string(), aside));
                    Vec::new()
                }
            },
        };
        let interrupted = interrupt_active(&mut jobs, now);
        if !interrupted.is_empty() {
            self.save(&jobs)?;
        }
        Ok(Loaded { jobs, interrupted, set_aside })
    }

    /// Writes every job atomically.
    pub fn save(&self, jobs: &[Job]) -> Result<(), StoreError> {
        let err = |source| StoreError::Write { path: self.path.clone(), source };
        let text = serde_json::to_vec(&File { version: 1, jobs: jobs.to_vec() })
            .map_err(|e| err(std::io::Error::other(e)))?;
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|source| StoreError::Dir { path: dir.to_owned(), source })?;
        }
        let tmp = self.path.with_extension(format!("json.{}.tmp", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode_0600()
            .open(&tmp)
            .map_err(err)?;
        f.write_all(&text).and_then(|()| f.sync_all()).map_err(err)?;
        drop(f);
        std::fs::rename(&tmp, &self.path).map_err(err)?;
        if let Some(dir) = self.path.parent()
            && let Ok(d) = std::fs::File::open(dir)
        {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, 0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn job(id: &str, state: State) -> Job {
        Job {
            id: id.into(),
            session_id: "s".into(),
            workload_id: "w".into(),
            state,
            created_at: "t0".into(),
            started_at: None,
            finished_at: None,
            exit_code: None,
            signal: None,
            error: None,
            workspace_root: "/w".into(),
            config_path: None,
            environment_revision_id: None,
            logs: Logs { stdout: "out".into(), stderr: "err".into(), truncated: false },
            created_files: vec![],
        }
    }

    #[test]
    fn restart_interrupts_only_active_jobs_and_persists_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        assert!(store.load("t1").unwrap().jobs.is_empty());
        store.save(&[job("a", State::Queued), job("b", State::Running), job("c", State::Succeeded)]).unwrap();
        let loaded = store.load("t2").unwrap();
        assert_eq!(loaded.interrupted, ["a", "b"]);
        let states: Vec<State> = loaded.jobs.iter().map(|j| j.state).collect();
        assert_eq!(states, [State::Interrupted, State::Interrupted, State::Succeeded]);
        assert_eq!(loaded.jobs[0].error.as_deref(), Some(INTERRUPTED));
        // Persisted: a second load changes nothing more.
        let again = store.load("t3").unwrap();
        assert!(again.interrupted.is_empty());
        assert_eq!(again.jobs[1].finished_at.as_deref(), Some("t2"));
        let names: Vec<_> = std::fs::read_dir(dir.path().join("npu-jobs"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["jobs.json"], "no temporary file is left behind");
    }

    #[test]
    fn a_corrupt_file_is_set_aside_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        std::fs::create_dir_all(store.path.parent().unwrap()).unwrap();
        std::fs::write(&store.path, b"{not json").unwrap();
        let loaded = store.load("t").unwrap();
        assert!(loaded.jobs.is_empty());
        let (_, aside) = loaded.set_aside.unwrap();
        assert_eq!(std::fs::read(aside).unwrap(), b"{not json");
    }

    #[test]
    fn summaries_blank_the_workspace_and_logs() {
        let s = job("a", State::Running).summary();
        assert_eq!((s.workspace_root.as_str(), s.logs.stdout.as_str(), s.logs.stderr.as_str()), ("", "", ""));
        let v = serde_json::to_value(job("a", State::Queued)).unwrap();
        assert_eq!(v["state"], "queued");
        assert_eq!(v["exitCode"], serde_json::Value::Null);
        assert!(v.get("startedAt").is_none());
    }
}
