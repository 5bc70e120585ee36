//! The setup state machine (`GET`/`POST /environment-setup`, `/health.scientificEnvs`): what
//! the background bootstrap is doing, per component, with a next step an operator can take
//! when it fails. Held in memory: `/health` reads it without touching the disk.
//!
//! The two components keep the original's names so callers that read them notice nothing:
//! `micromamba` is the provisioner (ours is `runner-provisioner`, shipped with runnerd, never
//! downloaded) and `conda` is the starter-python environment.

use serde::Serialize;
use serde_json::{Value, json};

use super::settings::EnvSettings;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    Disabled,
    NotStarted,
    Installing,
    Ready,
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    Idle,
    Provisioner,
    StarterPython,
    /// The original's name for the end of setup.
    #[serde(rename = "complete")]
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComponentState {
    Pending,
    Checking,
    Installing,
    Ready,
    Failed,
    Disabled,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Component {
    pub state: ComponentState,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
}

impl Component {
    fn new(state: ComponentState, detail: impl Into<String>) -> Component {
        Component { state, detail: detail.into(), action: None }
    }
}

/// Why the starter could not be made, as far as runnerd can tell: it picks the action text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The provisioner is missing or not executable by the sandbox user.
    Provisioner,
    /// No space left on the data directory's filesystem.
    DiskFull,
    /// A channel could not be read, or the packages do not solve against it.
    Channels,
    /// egressd or the sandbox could not be used.
    Sandbox,
    Other,
}

/// The next step for a failure, in words an operator can act on.
pub fn action(kind: FailureKind, settings: &EnvSettings, provisioner: &str, store_dir: &str) -> String {
    match kind {
        FailureKind::Provisioner => format!(
            "Verify that {provisioner} exists and is executable by the Runner user (install runner-provisioner next to runnerd or set SCIENCE_AGENT_RUNNER_PROVISIONER_PATH), then POST /environment-setup {{\"confirmed\":true}}"
        ),
        FailureKind::DiskFull => format!(
            "Free disk space on the filesystem of {store_dir}, then POST /environment-setup {{\"confirmed\":true}}"
        ),
        FailureKind::Channels => match settings.offline() {
            true => format!(
                "Check the Conda channels ({}) and the package cache (SCIENCE_AGENT_PACKAGE_CACHE_DIR): offline mode installs only what they hold",
                settings.channels.join(", ")
            ),
            false => format!(
                "Check the Conda channels ({}): each must be reachable from this host through egressd and hold the starter packages ({}); set SCIENCE_AGENT_SCIENTIFIC_CHANNELS or SCIENCE_AGENT_STARTER_PYTHON_SPECS",
                settings.channels.join(", "),
                settings.starter_python.join(", ")
            ),
        },
        FailureKind::Sandbox => "Check that egressd is running and that runnerd's sandbox works (runnerctl check), then POST /environment-setup {\"confirmed\":true}".to_owned(),
        FailureKind::Other => "See runnerd's journal (journalctl -t runnerd) for the failed step, then POST /environment-setup {\"confirmed\":true}".to_owned(),
    }
}

/// The whole setup view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    pub state: State,
    pub phase: Phase,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub provisioner: Component,
    pub conda: Component,
    pub error: Option<String>,
}

impl Setup {
    pub fn initial(enabled: bool) -> Setup {
        let (state, c) = match enabled {
            true => (State::NotStarted, ComponentState::Pending),
            false => (State::Disabled, ComponentState::Disabled),
        };
        Setup {
            state,
            phase: Phase::Idle,
            started_at: None,
            finished_at: None,
            provisioner: Component::new(c, ""),
            conda: Component::new(c, ""),
            error: None,
        }
    }

    /// A new attempt begins (start-up, or `POST /environment-setup`).
    pub fn begin(&mut self, now: String) {
        self.state = State::Installing;
        self.phase = Phase::Provisioner;
        self.started_at = Some(now);
        self.finished_at = None;
        self.error = None;
        self.provisioner = Component::new(ComponentState::Checking, "checking runner-provisioner");
        self.conda = Component::new(ComponentState::Pending, "waiting for the provisioner check");
    }

    pub fn provisioner_ready(&mut self, detail: String) {
        self.provisioner = Component::new(ComponentState::Ready, detail);
        self.phase = Phase::StarterPython;
        self.conda = Component::new(ComponentState::Installing, "creating starter-python");
    }

    pub fn ready(&mut self, now: String, detail: String) {
        self.state = State::Ready;
        self.phase = Phase::Done;
        self.finished_at = Some(now);
        self.conda = Component::new(ComponentState::Ready, detail);
    }

    /// The attempt failed in the current phase: that component fails, a later one is skipped.
    pub fn failed(&mut self, now: String, error: String, action: String) {
        self.state = State::Failed;
        self.finished_at = Some(now);
        let failed = Component { state: ComponentState::Failed, detail: error.clone(), action: Some(action) };
        match self.phase {
            Phase::Provisioner | Phase::Idle => {
                self.provisioner = failed;
                self.conda =
                    Component::new(ComponentState::Pending, "not attempted: the provisioner check failed");
            }
            Phase::StarterPython | Phase::Done => self.conda = failed,
        }
        self.phase = Phase::Done;
        self.error = Some(error);
    }

    /// `GET /environment-setup`'s body.
    pub fn view(&self, settings: &EnvSettings) -> Value {
        let mut v = json!({
            "state": self.state,
            "phase": self.phase,
            "enabled": settings.enabled,
            "components": {"micromamba": self.provisioner, "conda": self.conda},
            "provisioner": settings.enabled.then_some(super::sandboxed::PROVISIONER_NAME),
            "channels": settings.channels,
            // The original's name for the channels a change may name.
            "allowedChannels": settings.channels,
            "offline": settings.offline(),
            "starterPackages": {"python": settings.starter_python, "r": settings.starter_r},
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "completedAt": self.finished_at.as_ref().filter(|_| self.state == State::Ready),
        });
        if let Some(e) = &self.error {
            v["error"] = Value::from(e.clone());
        }
        v
    }

    /// `/health.scientificEnvs`: `available` needs setup `ready` and starter-python present.
    pub fn health(&self, settings: &EnvSettings, starter_python_ready: bool) -> Value {
        if !settings.enabled {
            return json!({
                "available": false, "enabled": false, "languages": [], "provisioner": null,
                "startersReady": false,
                "unavailableReason": "Scientific environments are disabled by configuration",
            });
        }
        let available = self.state == State::Ready && starter_python_ready;
        let mut v = json!({
            "available": available,
            "enabled": true,
            "languages": ["python", "r"],
            "provisioner": super::sandboxed::PROVISIONER_NAME,
            "startersReady": starter_python_ready,
        });
        if !available {
            v["unavailableReason"] = Value::from(self.unavailable_reason());
        }
        v
    }

    /// Why executions and environment routes cannot use the store now.
    pub fn unavailable_reason(&self) -> String {
        match self.state {
            State::Disabled => "Scientific environments are disabled by configuration".to_owned(),
            State::NotStarted => "Scientific environment setup has not started".to_owned(),
            State::Installing => "Scientific environment setup is still installing".to_owned(),
            State::Failed => format!(
                "Scientific environment setup failed: {}",
                self.error.as_deref().unwrap_or("unknown error")
            ),
            State::Ready => "The starter-python environment is not ready".to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> EnvSettings {
        EnvSettings::from_vars(|_| None).unwrap()
    }

    #[test]
    fn disabled_health_is_the_originals_block() {
        let s = EnvSettings { enabled: false, ..settings() };
        let h = Setup::initial(false).health(&s, false);
        assert_eq!(
            h.to_string(),
            r#"{"available":false,"enabled":false,"languages":[],"provisioner":null,"startersReady":false,"unavailableReason":"Scientific environments are disabled by configuration"}"#
        );
    }

    #[test]
    fn available_only_when_ready_with_the_starter() {
        let s = settings();
        let mut setup = Setup::initial(true);
        assert_eq!(setup.health(&s, false)["available"], false);
        setup.begin("t0".into());
        assert_eq!(setup.view(&s)["state"], "installing");
        assert_eq!(
            setup.health(&s, false)["unavailableReason"],
            "Scientific environment setup is still installing"
        );
        setup.provisioner_ready("ok".into());
        setup.ready("t1".into(), "starter-python ready".into());
        assert_eq!(setup.health(&s, true)["available"], true);
        assert!(setup.health(&s, true).get("unavailableReason").is_none());
        assert_eq!(setup.health(&s, false)["available"], false);
    }

    #[test]
    fn a_failure_marks_the_phase_component_with_an_action() {
        let s = settings();
        let mut setup = Setup::initial(true);
        setup.begin("t0".into());
        let act = action(FailureKind::Provisioner, &s, "/x/runner-provisioner", "/d");
        setup.failed("t1".into(), "not found".into(), act);
        let v = setup.view(&s);
        assert_eq!(v["components"]["micromamba"]["state"], "failed");
        assert!(
            v["components"]["micromamba"]["action"]
                .as_str()
                .unwrap()
                .contains("executable by the Runner user")
        );
        assert_eq!(v["components"]["conda"]["state"], "pending");

        let mut setup = Setup::initial(true);
        setup.begin("t0".into());
        setup.provisioner_ready("ok".into());
        setup.failed("t1".into(), "no space".into(), action(FailureKind::DiskFull, &s, "p", "/d"));
        let v = setup.view(&s);
        assert_eq!(v["components"]["micromamba"]["state"], "ready");
        assert_eq!(v["components"]["conda"]["state"], "failed");
        assert!(v["components"]["conda"]["action"].as_str().unwrap().starts_with("Free disk space"));
        assert_eq!(v["state"], "failed");
        assert!(setup.unavailable_reason().ends_with("no space"));
    }

    #[test]
    fn actions_differ_by_cause() {
        let s = settings();
        let texts: Vec<String> = [
            FailureKind::Provisioner,
            FailureKind::DiskFull,
            FailureKind::Channels,
            FailureKind::Sandbox,
            FailureKind::Other,
        ]
        .into_iter()
        .map(|k| action(k, &s, "p", "/d"))
        .collect();
        assert!(texts[2].contains("Conda channels (conda-forge)"));
        let unique: std::collections::HashSet<&String> = texts.iter().collect();
        assert_eq!(unique.len(), texts.len());
    }

    #[test]
    fn the_view_reports_starter_packages() {
        let s = settings();
        let v = Setup::initial(true).view(&s);
        assert_eq!(v["starterPackages"]["python"][0], "python=3.12");
        assert_eq!(v["starterPackages"]["r"][0], "r-base=4.4");
        assert_eq!(v["state"], "not-started");
    }
}
