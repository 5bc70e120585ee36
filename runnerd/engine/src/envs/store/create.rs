//! Creating environments: the starters, and task environments cloned from a base.

use common::provision::Op;

use crate::app::App;
use crate::envs::catalog::{Environment, Kind, Status};
use crate::envs::ids::{self, STARTER_PYTHON, STARTER_R};
use crate::sandbox::Language;

use super::changes::{Change, new_environment};
use super::lease::env_language;
use super::prefixes::remove_prefix;
use super::{EnvStore, StoreError, audit, ready};

/// The starters' display names, as the original's.
const STARTER_PYTHON_NAME: &str = "Starter Python";
const STARTER_R_NAME: &str = "Starter R";

impl EnvStore {
    /// Creates a starter (`starter-python` at setup, `starter-r` as the base of the first R
    /// environment), named as the original names them.
    pub(super) async fn create_starter(
        &self,
        app: &App,
        language: Language,
    ) -> Result<Environment, StoreError> {
        let (id, specs) = match language {
            Language::R => (STARTER_R, self.settings.starter_r.clone()),
            _ => (STARTER_PYTHON, self.settings.starter_python.clone()),
        };
        let _w = self.gates.write(id).await;
        if let Some(env) = self.cat().environment(id).filter(|e| e.status == Status::Ready).cloned() {
            return Ok(env);
        }
        let rev = ids::new_revision_id();
        let prefix = self.fresh_prefix(app, id, &rev)?;
        let channels = self.channel_urls(&self.settings.channels)?;
        let answer =
            self.conda_change(app, Op::Create { specs: specs.clone() }, &prefix, &channels, &[]).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                let _ = remove_prefix(&prefix);
                return Err(e);
            }
        };
        let name = match language {
            Language::R => STARTER_R_NAME,
            _ => STARTER_PYTHON_NAME,
        };
        let env = new_environment(id, name, Kind::Starter, env_language(language), &rev, None);
        // As the original: a starter's first revision records no requested change.
        let requested = Vec::new();
        let env = self
            .publish_new(app, env, Change { prefix: &prefix, channels, answer, requested, wheels: None })
            .await?;
        audit("environment_created", id, &rev, "starter");
        Ok(env)
    }

    /// `POST /environments`: a task environment cloned from its base's current packages.
    pub async fn create(
        &self,
        app: &App,
        name: &str,
        language: Language,
        base: Option<&str>,
    ) -> Result<Environment, StoreError> {
        self.require_available()?;
        let lang = env_language(language);
        ids::check_new_name(name, self.cat().names())?;
        let base_id = base.unwrap_or(lang.starter_id());
        ids::check_env_id(base_id).map_err(|_| StoreError::NotFound(base_id.to_owned()))?;
        if base_id == STARTER_R && self.cat().environment(STARTER_R).is_none() {
            self.create_starter(app, Language::R).await?;
        }
        let _r = self.gates.read(base_id).await;
        let base_env = self.cat().environment(base_id).cloned();
        let base_env = base_env.ok_or_else(|| StoreError::NotFound(base_id.to_owned()))?;
        if base_env.language != lang {
            return Err(StoreError::Invalid(format!(
                "Base environment {base_id} is a {} environment, not {}",
                base_env.language.as_str(),
                lang.as_str()
            )));
        }
        ready(&base_env)?;
        let source = self.root.join(base_env.prefix_rel()?);
        let id = ids::new_task_env_id();
        let rev = ids::new_revision_id();
        let prefix = self.fresh_prefix(app, &id, &rev)?;
        let base_rev = self.cat().revision(&base_env.current_revision_id).cloned();
        let channels =
            self.conda_channels(&base_rev.as_ref().map(|r| r.channels.clone()).unwrap_or_default());
        let urls = self.channel_urls(&channels)?;
        let clone = Op::Clone { source: source.clone() };
        let answer = match self.conda_change(app, clone, &prefix, &urls, std::slice::from_ref(&source)).await
        {
            Ok(a) => a,
            Err(e) => {
                let _ = remove_prefix(&prefix);
                return Err(e);
            }
        };
        let env = new_environment(&id, name, Kind::Task, lang, &rev, Some(base_id));
        let wheels = base_rev.and_then(|r| r.local_wheels);
        // As the original: a clone records no requested change (its base is in the record).
        let requested = Vec::new();
        let env = self
            .publish_new(app, env, Change { prefix: &prefix, channels, answer, requested, wheels })
            .await?;
        audit("environment_created", &id, &rev, name);
        Ok(env)
    }
}
