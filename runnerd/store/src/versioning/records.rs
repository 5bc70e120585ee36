//! Values of the record kinds the runner writes (§3.2, §3.3). Pure builders: `put_record`
//! adds the envelope and dependencies, JCS fixes the key order.

use crate::execution_state::ManagedState;
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

/// The fields of a `WorkspaceExecution` value, one to one.
#[derive(Debug, Clone, Copy)]
pub struct ExecutionFields<'a> {
    pub agent_id: &'a str,
    pub code: &'a Ref,
    pub environment_revision_id: Option<&'a str>,
    pub execution_id: &'a str,
    pub session_id: &'a str,
    pub state: ManagedState,
    pub stderr: &'a Ref,
    pub stdout: &'a Ref,
    pub workspace: &'a Ref,
}

/// A `WorkspaceExecution` value; `environmentRevisionId` is written as null when absent, as
/// the original does.
pub fn execution_value(fields: &ExecutionFields<'_>) -> Value {
    let ExecutionFields {
        agent_id,
        code,
        environment_revision_id,
        execution_id,
        session_id,
        state,
        stderr,
        stdout,
        workspace,
    } = *fields;
    let mut map = Map::new();
    map.insert("agentId".into(), Value::from(agent_id));
    map.insert("code".into(), code.to_value());
    map.insert("environmentRevisionId".into(), environment_revision_id.map_or(Value::Null, Value::from));
    map.insert("executionId".into(), Value::from(execution_id));
    map.insert("sessionId".into(), Value::from(session_id));
    map.insert("state".into(), Value::from(state.as_str()));
    map.insert("stderr".into(), stderr.to_value());
    map.insert("stdout".into(), stdout.to_value());
    map.insert("workspace".into(), workspace.to_value());
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::versioning::testutil::{blob_text, root_tree_ref, temp_store};
    use crate::versioning::{OCTET_STREAM, Pool};

    const BASELINE: &str = r#"{"dependencies":[{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656}],"kind":"WorkspaceMutation","schemaVersion":1,"value":{"kind":"baseline","status":"completed","workspace":{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656}}}"#;
    const LEGACY_FAILED: &str = r#"{"dependencies":[{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656}],"kind":"WorkspaceMutation","schemaVersion":1,"value":{"id":"exec-42","kind":"legacy-execution","status":"failed","workspace":{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656}}}"#;
    const EXECUTION: &str = r#"{"dependencies":[{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656},{"digest":"sha256:9d4cfe811321419f4bbdfb6b0a1456042bfa5aad13e0327a7540885930b54f19","mediaType":"application/octet-stream","pool":"agent-state","size":10},{"digest":"sha256:b7278539d56791874399fcf435d30dc1c208924eb48333a3b0e64fe81bfb4ef1","mediaType":"application/octet-stream","pool":"agent-state","size":15},{"digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","mediaType":"application/octet-stream","pool":"agent-state","size":0}],"kind":"WorkspaceExecution","schemaVersion":1,"value":{"agentId":"main","code":{"digest":"sha256:b7278539d56791874399fcf435d30dc1c208924eb48333a3b0e64fe81bfb4ef1","mediaType":"application/octet-stream","pool":"agent-state","size":15},"environmentRevisionId":null,"executionId":"exec-43","sessionId":"session-1","state":"completed","stderr":{"digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","mediaType":"application/octet-stream","pool":"agent-state","size":0},"stdout":{"digest":"sha256:9d4cfe811321419f4bbdfb6b0a1456042bfa5aad13e0327a7540885930b54f19","mediaType":"application/octet-stream","pool":"agent-state","size":10},"workspace":{"digest":"sha256:3281b48862c580205dbbfd69a71877636c9a5469fbdc4f6107c12d290bd91653","mediaType":"application/vnd.sciencediscovery.record.v1+json","pool":"agent-state","size":1656}}}"#;

    #[test]
    fn mutation_vectors() {
        let (_dir, store) = temp_store();
        let tree = root_tree_ref();
        let cases = [
            (
                mutation_value(None, "baseline", true, &tree),
                BASELINE,
                "2436366ad32fa74d4bb0308c853a6de9daf13b88f5776f6a8e74e8f461c6203b",
                484,
            ),
            (
                mutation_value(Some("exec-42"), "legacy-execution", false, &tree),
                LEGACY_FAILED,
                "ddeaf6c345f8cc7ddb8c0ee4ec2ef6c94f5559bba04c1be525076a3fa2a13760",
                504,
            ),
        ];
        for (value, text, hex, size) in cases {
            let r = store.put_record("WorkspaceMutation", value).unwrap();
            assert_eq!(blob_text(&store, &r), text);
            assert_eq!((r.hex(), r.size), (hex, size));
        }
    }

    #[test]
    fn execution_vector() {
        let (_dir, store) = temp_store();
        let code = store.put(Pool::AgentState, b"python train.py", OCTET_STREAM).unwrap();
        let stdout = store.put(Pool::AgentState, "训练中\n".as_bytes(), OCTET_STREAM).unwrap();
        let stderr = store.put(Pool::AgentState, b"", OCTET_STREAM).unwrap();
        assert_eq!((stdout.size, &stdout.hex()[..8]), (10, "9d4cfe81"));
        assert_eq!((code.size, &code.hex()[..8]), (15, "b7278539"));
        let tree = root_tree_ref();
        let fields = ExecutionFields {
            agent_id: "main",
            code: &code,
            environment_revision_id: None,
            execution_id: "exec-43",
            session_id: "session-1",
            state: ManagedState::Completed,
            stderr: &stderr,
            stdout: &stdout,
            workspace: &tree,
        };
        let value = execution_value(&fields);
        let r = store.put_record("WorkspaceExecution", value).unwrap();
        assert_eq!(blob_text(&store, &r), EXECUTION);
        assert_eq!(
            (r.hex(), r.size),
            ("cbd4f77e63ef7a0d0df9b83ef9e6e49c54ef067913c3c9f544192f0936940226", 1513)
        );
        let with_env = execution_value(&ExecutionFields {
            environment_revision_id: Some("rev-1"),
            execution_id: "e",
            session_id: "s",
            state: ManagedState::Failed,
            ..fields
        });
        assert_eq!(with_env["environmentRevisionId"], "rev-1");
    }
}
