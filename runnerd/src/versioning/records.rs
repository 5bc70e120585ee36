//! Values of the record kinds the runner writes (§3.2, §3.3). Pure builders: `put_record`
//! adds the envelope and dependencies, JCS fixes the key order.

use serde_json::{Map, Value};

use super::Ref;

/// A `WorkspaceMutation` value. `id` is omitted (not null) for `baseline` and `checkpoint`.
pub fn mutation_value(id: Option<&str>, kind: &str, completed: bool, workspace: &Ref) -> Value {
    let mut map = Map::new();
    if let Some(id) = id {
        map.insert("id".into(), Value::from(id));
    }
    map.insert("kind".into(), Value::from(kind));
    map.insert("status".into(), Value::from(if completed { "completed" } else { "failed" }));
    map.insert("workspace".into(), workspace.to_value());
    Value::Object(map)
}

/// A `WorkspaceExecution` value; `environmentRevisionId` is written as null when absent, as
/// the original does. The argument list mirrors the record's fields one to one.
#[allow(clippy::too_many_arguments)]
pub fn execution_value(
    agent_id: &str,
    code: &Ref,
    environment_revision_id: Option<&str>,
    execution_id: &str,
    session_id: &str,
    state: &str,
    stderr: &Ref,
    stdout: &Ref,
    workspace: &Ref,
) -> Value {
    let mut map = Map::new();
    map.insert("agentId".into(), Value::from(agent_id));
    map.insert("code".into(), code.to_value());
    map.insert("environmentRevisionId".into(), environment_revision_id.map_or(Value::Null, Value::from));
    map.insert("executionId".into(), Value::from(execution_id));
    map.insert("sessionId".into(), Value::from(session_id));
    map.insert("state".into(), Value::from(state));
    map.insert("stderr".into(), stderr.to_value());
    map.insert("stdout".into(), stdout.to_value());
    map.insert("workspace".into(), workspace.to_value());
    Value::Object(map)
}
