//! An execution's environment: chosen at `prepare`, leased (read-gated) when the run starts.

use std::path::PathBuf;

use crate::envs::catalog;
use crate::envs::gate::ReadGuard;
use crate::envs::ids::{STARTER_PYTHON, STARTER_R};
use crate::sandbox::Language;

use super::{EnvStore, StoreError, ready};

/// An execution's selection, decided in `prepare` and leased when the run starts (after the
/// agent queue and the workspace lease: taking the read gate earlier could deadlock with a
/// queued writer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub environment_id: String,
    /// `/execute`'s `environmentRevisionId`: must still be the current revision at the start.
    pub revision_id: Option<String>,
    pub language: Language,
}

/// A leased environment: the prefix stays as it is until this is dropped.
#[derive(Debug)]
pub struct Runtime {
    pub revision_id: String,
    pub prefix: PathBuf,
    /// Host interpreters to hide (Python and R runs only; internals §2.4).
    pub masks: Vec<PathBuf>,
    _guard: ReadGuard,
}

/// The environment language an execution language runs in (a shell runs in either).
pub(super) fn env_language(l: Language) -> catalog::Language {
    match l {
        Language::R => catalog::Language::R,
        _ => catalog::Language::Python,
    }
}

impl EnvStore {
    /// The environment an execution names, checked at `prepare` (the texts of contract §2A).
    pub fn select(
        &self,
        language: Language,
        environment_id: Option<&str>,
        revision_id: Option<&str>,
    ) -> Result<Selection, StoreError> {
        self.require_available()?;
        let environment_id = match (environment_id, revision_id) {
            (Some(e), _) => e.to_owned(),
            (None, Some(rev)) => {
                let catalog = self.cat();
                let revision = catalog.revision(rev).ok_or_else(|| {
                    StoreError::Invalid("Unknown environment revision; select a current environment".into())
                })?;
                revision.environment_id.clone()
            }
            // There once an R environment was created (starter-r is its base); an execution
            // never installs it (issue #30: the original answers 400 until then).
            (None, None) if language == Language::R => STARTER_R.to_owned(),
            (None, None) => STARTER_PYTHON.to_owned(),
        };
        Ok(Selection { environment_id, revision_id: revision_id.map(str::to_owned), language })
    }

    /// The read lease for a run that is about to start.
    pub async fn lease(&self, selection: &Selection) -> Result<Runtime, StoreError> {
        let guard = self.gates.read(&selection.environment_id).await;
        let catalog = self.cat();
        let env = catalog.environment(&selection.environment_id).cloned().ok_or_else(|| {
            StoreError::Invalid(format!("Unknown scientific environment: {}", selection.environment_id))
        })?;
        drop(catalog);
        if let Some(rev) = &selection.revision_id
            && *rev != env.current_revision_id
        {
            return Err(StoreError::Invalid(
                "Historical environment revisions are audit-only; select the latest environment".into(),
            ));
        }
        if selection.language != Language::Shell && env.language != env_language(selection.language) {
            return Err(StoreError::Invalid(format!(
                "Environment {} is a {} environment, not {}",
                env.id,
                env.language.as_str(),
                env_language(selection.language).as_str()
            )));
        }
        ready(&env)?;
        let masks = match selection.language {
            Language::Shell => Vec::new(),
            _ => self.masks.clone(),
        };
        Ok(Runtime {
            prefix: self.root.join(env.prefix_rel()?),
            revision_id: env.current_revision_id,
            masks,
            _guard: guard,
        })
    }
}
