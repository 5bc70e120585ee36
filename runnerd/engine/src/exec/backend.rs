//! Which isolation backend an execution runs in (issue #36): the request's `isolation`, else
//! `SCIENCE_AGENT_ISOLATION`. Refused with 400 `invalid_isolation` before anything runs when
//! the name is unknown, when a backend the request names explicitly cannot run on this host,
//! or when the run needs what that backend cannot give yet (chips under microvm).

use crate::app::App;
use crate::code::ErrorCode;
use crate::error::EngineError;
use crate::isolation::select::{self, Backend};

/// `accel`: the request names NPUs or GPUs.
pub fn chosen(app: &App, requested: Option<&str>, accel: bool) -> Result<Backend, EngineError> {
    let invalid = |m: String| EngineError::invalid(ErrorCode::InvalidIsolation, m);
    let backend = select::requested(requested, app.sandbox.default_backend).map_err(invalid)?;
    if requested.is_some()
        && let Some(why) = app.sandbox.backend(backend).unavailable()
    {
        return Err(invalid(format!("isolation {} is unavailable on this runner: {why}", backend.name())));
    }
    if backend == Backend::Microvm && accel {
        return Err(invalid(
            "npuDevices and gpuDevices cannot be passed into a microvm; use isolation bwrap".to_owned(),
        ));
    }
    Ok(backend)
}
