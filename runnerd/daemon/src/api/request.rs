//! Reading a request body (contract §2A), the HTTP layer's side of the engine's typed
//! request: the JSON helpers every route uses, the contract's field table ([`FIELDS`]), and
//! the route-level checks of an execution in the original's order (`kernelMode`, `language`,
//! every field's type), then [`parse`] into `exec::request::ExecRequest` — the engine is handed
//! typed fields, never the JSON.

use serde_json::{Map, Value};

use crate::config::MAX_SAFE_INTEGER;
pub use crate::exec::request::Route;
use crate::exec::request::{ExecRequest, NetworkAccess, NetworkMode, WorkspaceRef, code_required};
use crate::exec::{EngineError, ErrorCode};
use crate::sandbox::Language;

pub type Object = Map<String, Value>;

/// Parses a request body; the original answers any parse failure with 400.
pub fn parse_object(body: &[u8]) -> Result<Object, EngineError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        EngineError::invalid(ErrorCode::InvalidJson, format!("Request body is not valid JSON: {e}"))
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(EngineError::invalid(ErrorCode::InvalidJson, "Request body must be a JSON object")),
    }
}

/// A string field; anything else (absent, null, a number) reads as absent.
pub fn string<'a>(obj: &'a Object, name: &str) -> Option<&'a str> {
    obj.get(name).and_then(Value::as_str)
}

/// Whether `text` holds a control character (C0, DEL, C1) or a Unicode line or paragraph
/// separator: what could start a forged line in a text log.
pub fn has_control(text: &str) -> bool {
    text.chars().any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
}

/// Ours (issue #14): identifiers go into every audit event, so one holding a newline could
/// forge a line in a text sink. No correct caller sends one; refuse it with a clear 400.
pub fn refuse_control(field: &str, value: &str) -> Result<(), EngineError> {
    if has_control(value) {
        return Err(EngineError::invalid(
            ErrorCode::InvalidIdentifier,
            format!("{field} must not contain control characters (newlines, tabs, escapes)"),
        ));
    }
    Ok(())
}

/// JavaScript truthiness, for the fields the original tests with `if (x)`.
pub fn is_truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}

/// A non-blank string field.
pub fn non_blank<'a>(obj: &'a Object, name: &str) -> Option<&'a str> {
    string(obj, name).filter(|s| !s.trim().is_empty())
}

/// Step 3 of the original's order: only an absent `kernelMode` or `"ephemeral"` passes.
pub fn require_ephemeral(obj: &Object) -> Result<(), EngineError> {
    match obj.get("kernelMode") {
        None => Ok(()),
        Some(Value::String(s)) if s == "ephemeral" => Ok(()),
        Some(_) => Err(EngineError::invalid(
            ErrorCode::PersistentKernelRefused,
            "Runner executions must be ephemeral; persistent runtimes are no longer supported. Use managed Shell Execution for background tasks",
        )),
    }
}

/// The language of a request on `route` (`/execute`: `language`, default python).
pub fn language(route: Route, obj: &Object) -> Result<Language, EngineError> {
    match route {
        Route::ExecuteShell | Route::ShellExecutions => Ok(Language::Shell),
        Route::Execute => match obj.get("language") {
            None | Some(Value::Null) => Ok(Language::Python),
            Some(Value::String(s)) if s == "python" => Ok(Language::Python),
            Some(Value::String(s)) if s == "r" => Ok(Language::R),
            Some(other) => Err(EngineError::invalid(
                ErrorCode::UnsupportedLanguage,
                format!("Unsupported language {other}; use \"python\" or \"r\""),
            )),
        },
    }
}

/// The JSON type a field must have when present (`null` reads as absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    String,
    Bool,
    Object,
    Array,
    /// An array of strings.
    Strings,
    /// A non-negative safe integer ([`limit`]).
    Limit,
    /// An array of non-negative integer device indices.
    Devices,
}

/// Which routes read a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    All,
    /// `/execute-shell` and `/shell-executions`.
    Shell,
    /// `/execute` only.
    Python,
    /// The synchronous routes (`/shell-executions` forces `executionTimeoutMs` to 0).
    Sync,
}

/// The answer to a field of the wrong type: the contract's text for that field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Text {
    Fixed(&'static str),
    /// `<the field's dotted path> <this>`, for fields whose type the contract names without
    /// a text of its own.
    Typed(&'static str),
    /// `<Label> code is required`.
    CodeRequired,
    /// The mounts text of the route's language.
    Mounts,
    /// `Execution ID is required`, or `Invalid Execution ID` on `/shell-executions`.
    ExecutionId,
}

/// One typed field of an execution request (contract §2A's field table, `PermissionEpoch`).
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub path: &'static [&'static str],
    pub kind: Kind,
    pub on: On,
    pub code: ErrorCode,
    pub text: Text,
}

const OUTSIDE_ROOTS: &str =
    "Runner workspace must be inside the configured projects or remote-workspaces directory";
const NOT_A_STRING: &str = "must be a string";

const fn field(path: &'static [&'static str], kind: Kind, on: On, code: ErrorCode, text: Text) -> Field {
    Field { path, kind, on, code, text }
}

/// Ours (issue #15): every field the contract types is checked for its type before anything
/// touches the disk. The original reads a number `cwd` as no `cwd` at all (and runs in
/// `/workspace`); here it answers 400 with the field's own text. `kernelIdleTimeoutMs` is
/// accepted and ignored, as in the original; `kernelMode` and `language` have their checks.
pub const FIELDS: &[Field] = &[
    field(
        &["agentId"],
        Kind::String,
        On::All,
        ErrorCode::AgentIdRequired,
        Text::Fixed("Agent ID is required"),
    ),
    field(&["code"], Kind::String, On::All, ErrorCode::CodeRequired, Text::CodeRequired),
    field(&["executionId"], Kind::String, On::All, ErrorCode::ExecutionIdRequired, Text::ExecutionId),
    field(&["permissionEpoch"], Kind::Object, On::All, ErrorCode::InvalidMounts, Text::Mounts),
    field(&["permissionEpoch", "mounts"], Kind::Array, On::All, ErrorCode::InvalidMounts, Text::Mounts),
    field(
        &["permissionEpoch", "sessionId"],
        Kind::String,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed(NOT_A_STRING),
    ),
    field(
        &["permissionEpoch", "environmentRevisionId"],
        Kind::String,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed(NOT_A_STRING),
    ),
    field(
        &["permissionEpoch", "networkPolicy"],
        Kind::String,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed(NOT_A_STRING),
    ),
    field(
        &["permissionEpoch", "networkAccess"],
        Kind::Object,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed("must be an object"),
    ),
    field(
        &["permissionEpoch", "networkAccess", "mode"],
        Kind::String,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed(NOT_A_STRING),
    ),
    field(
        &["permissionEpoch", "networkAccess", "revision"],
        Kind::String,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed(NOT_A_STRING),
    ),
    field(
        &["permissionEpoch", "networkAccess", "allowedDomains"],
        Kind::Strings,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed("must be an array of strings"),
    ),
    field(
        &["permissionEpoch", "networkAccess", "allowPrivateNetwork"],
        Kind::Bool,
        On::All,
        ErrorCode::InvalidFieldType,
        Text::Typed("must be a boolean"),
    ),
    field(
        &["workspaceRoot"],
        Kind::String,
        On::All,
        ErrorCode::WorkspaceOutsideRoots,
        Text::Fixed(OUTSIDE_ROOTS),
    ),
    field(
        &["runnerWorkspaceKey"],
        Kind::String,
        On::All,
        ErrorCode::InvalidWorkspaceKey,
        Text::Fixed("Invalid remote workspace key"),
    ),
    field(
        &["readOnlyWorkspaceRoot"],
        Kind::String,
        On::All,
        ErrorCode::WorkspaceOutsideRoots,
        Text::Fixed(OUTSIDE_ROOTS),
    ),
    // Ours (issue #36): the isolation backend, `bwrap` or `microvm`.
    field(&["isolation"], Kind::String, On::All, ErrorCode::InvalidIsolation, Text::Typed(NOT_A_STRING)),
    field(
        &["skillPackagesRoot"],
        Kind::String,
        On::All,
        ErrorCode::WorkspaceOutsideRoots,
        Text::Fixed(OUTSIDE_ROOTS),
    ),
    field(
        &["cwd"],
        Kind::String,
        On::Shell,
        ErrorCode::InvalidCwd,
        Text::Fixed("cwd must be workspace-relative"),
    ),
    field(
        &["environmentId"],
        Kind::String,
        On::Shell,
        ErrorCode::CapabilityUnavailable,
        Text::Fixed("Scientific environments are unavailable"),
    ),
    field(
        &["environmentRevisionId"],
        Kind::String,
        On::Python,
        ErrorCode::UnknownEnvironmentRevision,
        Text::Fixed("Unknown environment revision; select a current environment"),
    ),
    field(
        &["executionTimeoutMs"],
        Kind::Limit,
        On::Sync,
        ErrorCode::InvalidLimit,
        Text::Fixed(TIMEOUT_ERROR),
    ),
    field(
        &["maxOutputBytes"],
        Kind::Limit,
        On::All,
        ErrorCode::InvalidLimit,
        Text::Fixed("maxOutputBytes must be a non-negative integer number of bytes"),
    ),
    field(
        &["maxWorkspaceBytes"],
        Kind::Limit,
        On::All,
        ErrorCode::InvalidLimit,
        Text::Fixed("maxWorkspaceBytes must be a non-negative integer number of bytes"),
    ),
    field(
        &["sandboxEgressProxy"],
        Kind::Object,
        On::All,
        ErrorCode::InvalidEgressProxy,
        Text::Fixed("sandboxEgressProxy.mode must be \"direct\", \"environment\" or \"url\""),
    ),
    field(
        &["npuDevices"],
        Kind::Devices,
        On::All,
        ErrorCode::InvalidAccelerators,
        Text::Fixed("npuDevices must be an array of non-negative integer device indices"),
    ),
    field(
        &["gpuDevices"],
        Kind::Devices,
        On::All,
        ErrorCode::InvalidAccelerators,
        Text::Fixed("gpuDevices must be an array of non-negative integer device indices"),
    ),
    field(
        &["resourceLimits"],
        Kind::Object,
        On::All,
        ErrorCode::InvalidResourceLimits,
        Text::Fixed("resourceLimits must be an object with memoryBytes, pids, cpu or tmpBytes"),
    ),
];

impl On {
    fn includes(self, route: Route) -> bool {
        match self {
            On::All => true,
            On::Shell => route != Route::Execute,
            On::Python => route == Route::Execute,
            On::Sync => route != Route::ShellExecutions,
        }
    }
}

impl Kind {
    /// Whether `v` (never `null` here) has this type.
    fn admits(self, v: &Value) -> bool {
        let index =
            |v: &Value| v.as_u64().is_some() || v.as_f64().is_some_and(|f| f >= 0.0 && f.fract() == 0.0);
        match self {
            Kind::String => v.is_string(),
            Kind::Bool => v.is_boolean(),
            Kind::Object => v.is_object(),
            Kind::Array => v.is_array(),
            Kind::Strings => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            Kind::Limit => v.is_number(),
            Kind::Devices => v.as_array().is_some_and(|a| a.iter().all(index)),
        }
    }
}

/// The first field of `obj` that `route` reads and that has the wrong type, answered with
/// its text. Pure: the table test and the HTTP table test both drive it.
pub fn check_fields(route: Route, language: Language, obj: &Object) -> Result<(), EngineError> {
    for f in FIELDS.iter().filter(|f| f.on.includes(route)) {
        let (first, rest) = f.path.split_first().expect("paths are never empty");
        let mut value = obj.get(*first);
        for name in rest {
            // A parent of the wrong type has its own row; an absent one hides its children.
            value = value.and_then(|v| v.as_object()).and_then(|o| o.get(*name));
        }
        let Some(value) = value.filter(|v| !v.is_null()) else { continue };
        if let (Kind::Limit, Text::Fixed(text)) = (f.kind, f.text) {
            // The range as well as the type (limits are top-level fields): one rule for the
            // synchronous and the managed routes.
            limit(obj, first, 0, text)?;
            continue;
        }
        if f.kind.admits(value) {
            continue;
        }
        let message = match f.text {
            Text::Fixed(t) => t.to_owned(),
            Text::Typed(t) => format!("{} {t}", f.path.join(".")),
            Text::CodeRequired => code_required(language).to_owned(),
            Text::Mounts => crate::exec::request::mounts_text(language).to_owned(),
            Text::ExecutionId if route == Route::ShellExecutions => "Invalid Execution ID".to_owned(),
            Text::ExecutionId => "Execution ID is required".to_owned(),
        };
        let code = match (f.text, route) {
            (Text::ExecutionId, Route::ShellExecutions) => ErrorCode::InvalidExecutionId,
            _ => f.code,
        };
        return Err(EngineError::invalid(code, message));
    }
    for path in IDENTIFIERS {
        // `/shell-executions` refuses any id outside its pattern with the contract's own text.
        if route == Route::ShellExecutions && *path == ["executionId"] {
            continue;
        }
        let found = match path {
            [one] => obj.get(*one),
            [first, second] => obj.get(*first).and_then(|v| v.get(*second)),
            _ => None,
        };
        // A blank one (whitespace, `\t\n` included) is answered later with the contract's
        // "… is required".
        if let Some(text) = found.and_then(Value::as_str).filter(|t| !t.trim().is_empty()) {
            refuse_control(&path.join("."), text)?;
        }
    }
    Ok(())
}

/// The ids that go into every audit event of an execution: refused with control characters
/// (issue #14) on all three execution routes, before any of them is recorded.
const IDENTIFIERS: [&[&str]; 3] = [&["executionId"], &["permissionEpoch", "sessionId"], &["agentId"]];

/// `permissionEpoch.mounts` is exactly `[{source:"workspace", mode:"read-write"}]`.
pub fn single_workspace_mount(obj: &Object) -> bool {
    let mounts = obj.get("permissionEpoch").and_then(|e| e.get("mounts")).and_then(Value::as_array);
    matches!(mounts.map(Vec::as_slice), Some([m])
        if m.get("source").and_then(Value::as_str) == Some("workspace")
            && m.get("mode").and_then(Value::as_str) == Some("read-write"))
}

/// A per-request limit: absent or null → the configured default; otherwise a non-negative
/// safe integer (`1.0` counts, as in JavaScript).
pub fn limit(obj: &Object, name: &str, default: u64, error: &str) -> Result<u64, EngineError> {
    let invalid = || EngineError::invalid(ErrorCode::InvalidLimit, error);
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => {
            if let Some(v) = n.as_u64() {
                return if v <= MAX_SAFE_INTEGER { Ok(v) } else { Err(invalid()) };
            }
            match n.as_f64() {
                Some(f) if f >= 0.0 && f.fract() == 0.0 && f <= MAX_SAFE_INTEGER as f64 => Ok(f as u64),
                _ => Err(invalid()),
            }
        }
        Some(_) => Err(invalid()),
    }
}

pub const TIMEOUT_ERROR: &str = "Execution timeout must be a non-negative integer number of milliseconds";

pub fn network_access(obj: &Object) -> NetworkAccess {
    let epoch = obj.get("permissionEpoch");
    let policy = epoch.and_then(|e| e.get("networkPolicy")).and_then(Value::as_str);
    let access = epoch.and_then(|e| e.get("networkAccess"));
    match (policy, access) {
        (Some(policy), Some(access)) if access.get("mode").and_then(Value::as_str) == Some(policy) => {
            NetworkAccess {
                mode: NetworkMode::parse(policy),
                revision: access.get("revision").and_then(Value::as_str).unwrap_or("none").to_owned(),
                allowed_domains: access
                    .get("allowedDomains")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                    .unwrap_or_default(),
                allow_private_network: access
                    .get("allowPrivateNetwork")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            }
        }
        _ => NetworkAccess::none(),
    }
}

/// The three workspace fields of a body (other routes name workspaces the same way):
/// `runnerWorkspaceKey`, when non-empty, wins and drops `readOnlyWorkspaceRoot`.
pub fn workspace_ref(obj: &Object) -> WorkspaceRef {
    WorkspaceRef {
        key: string(obj, "runnerWorkspaceKey").filter(|k| !k.is_empty()).map(str::to_owned),
        root: string(obj, "workspaceRoot").map(str::to_owned),
        read_only: non_blank(obj, "readOnlyWorkspaceRoot").map(str::to_owned),
    }
}

/// Reads a request body for `route`: `kernelMode` (step 3), the language, every field's
/// type and the identifiers' characters, in the original's order, then the typed request.
pub fn parse(route: Route, mut obj: Object) -> Result<ExecRequest, EngineError> {
    require_ephemeral(&obj)?;
    let language = language(route, &obj)?;
    check_fields(route, language, &obj)?;
    let code = match obj.remove("code") {
        Some(Value::String(code)) => code,
        _ => String::new(),
    };
    let owned = |obj: &Object, name: &str| string(obj, name).map(str::to_owned);
    let set = |v: Option<&Value>| v.filter(|v| !v.is_null()).cloned();
    let epoch = obj.get("permissionEpoch");
    let epoch_string =
        |name: &str| epoch.and_then(|e| e.get(name)).and_then(Value::as_str).map(str::to_owned);
    // Range-checked above on the routes that read them; elsewhere a bad value reads as unset.
    let limit_of = |name: &str| match obj.get(name) {
        None | Some(Value::Null) => None,
        Some(_) => limit(&obj, name, 0, "").ok(),
    };
    let shell = language == Language::Shell;
    Ok(ExecRequest {
        route,
        language,
        workspace: workspace_ref(&obj),
        single_workspace_mount: single_workspace_mount(&obj),
        execution_id: owned(&obj, "executionId").unwrap_or_default(),
        session_id: epoch_string("sessionId").unwrap_or_default(),
        agent_id: owned(&obj, "agentId").unwrap_or_default(),
        code,
        environment_id: non_blank(&obj, "environmentId").filter(|_| shell).map(str::to_owned),
        // Python and R alike (contract §2A: `resolveRuntime(environmentRevisionId, language)`):
        // without it an R run could only ever use starter-r, never a task environment.
        environment_revision_id: non_blank(&obj, "environmentRevisionId")
            .filter(|_| matches!(language, Language::Python | Language::R))
            .map(str::to_owned),
        epoch_environment_revision_id: epoch_string("environmentRevisionId"),
        network: network_access(&obj),
        egress_proxy: set(obj.get("sandboxEgressProxy")),
        npu_devices: set(obj.get("npuDevices")),
        gpu_devices: set(obj.get("gpuDevices")),
        skill_packages_root: owned(&obj, "skillPackagesRoot").filter(|s| !s.is_empty()),
        execution_timeout_ms: limit_of("executionTimeoutMs"),
        max_output_bytes: limit_of("maxOutputBytes"),
        max_workspace_bytes: limit_of("maxWorkspaceBytes"),
        cwd: owned(&obj, "cwd").filter(|c| shell && !c.is_empty()),
        resource_limits: set(obj.get(crate::limits::REQUEST_FIELD)),
        isolation: owned(&obj, "isolation"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::error::ApiError;
    use crate::exec::request::mounts_error;

    #[test]
    fn control_characters_table() {
        for (text, bad) in [
            ("plain-id_1.2:3", false),
            ("unicode é ü 漢字", false),
            ("line\nbreak", true),
            ("cr\r", true),
            ("tab\t", true),
            ("esc\u{1b}[31m", true),
            ("nul\0", true),
            ("del\u{7f}", true),
            ("c1\u{85}", true),
            ("ls\u{2028}", true),
        ] {
            assert_eq!(has_control(text), bad, "{text:?}");
        }
        let e = refuse_control("executionId", "a\nWARN forged").map_err(ApiError::from).unwrap_err();
        assert_eq!(e.status, 400);
        // check_fields refuses each identifier on every execution route.
        for route in [Route::Execute, Route::ExecuteShell, Route::ShellExecutions] {
            let id =
                (route != Route::ShellExecutions).then(|| ("executionId", json!({"executionId": "a\nb"})));
            for (path, body) in id.into_iter().chain([
                ("agentId", json!({"agentId": "a\rb"})),
                ("permissionEpoch.sessionId", json!({"permissionEpoch": {"sessionId": "a\u{1b}b"}})),
            ]) {
                let e = check_fields(route, Language::Shell, &obj(body)).map_err(ApiError::from).unwrap_err();
                assert_eq!(
                    (e.code, e.message.starts_with(path)),
                    ("invalid_identifier", true),
                    "{route:?} {path}"
                );
            }
            assert!(check_fields(route, Language::Shell, &obj(json!({"agentId": "main"}))).is_ok());
            // Blank ids keep the contract's "… is required", answered after the type checks.
            assert!(check_fields(route, Language::Shell, &obj(json!({"executionId": "\t\n"}))).is_ok());
        }
    }
    use serde_json::json;

    fn obj(v: Value) -> Object {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn python_and_r_runs_name_their_revision_shell_runs_do_not() {
        for (route, language, named) in [
            (Route::Execute, None, true),
            (Route::Execute, Some("python"), true),
            (Route::Execute, Some("r"), true),
            (Route::ExecuteShell, None, false),
        ] {
            let mut o = valid_request();
            o.insert("environmentRevisionId".into(), json!("rev-1"));
            if let Some(l) = language {
                o.insert("language".into(), json!(l));
            }
            let req = parse(route, o).unwrap_or_else(|e| panic!("{route:?} {language:?}: {e:?}"));
            assert_eq!(req.environment_revision_id.is_some(), named, "{route:?} {language:?}");
        }
    }

    fn valid_request() -> Object {
        obj(json!({
            "agentId": "main", "code": "true", "executionId": "id-1", "workspaceRoot": "/w",
            "permissionEpoch": {"sessionId": "s", "mounts": [{"source": "workspace", "mode": "read-write"}],
                "networkPolicy": "none"},
        }))
    }

    /// Sets `path` in `o`, creating objects on the way.
    fn set(o: &mut Object, path: &[&str], v: Value) {
        let (last, parents) = path.split_last().unwrap();
        let mut at = o;
        for p in parents {
            at = at.entry(p.to_string()).or_insert_with(|| json!({})).as_object_mut().unwrap();
        }
        at.insert(last.to_string(), v);
    }

    fn wrong_values(kind: Kind) -> Vec<Value> {
        match kind {
            Kind::String => vec![json!(5), json!(true), json!([]), json!({}), json!(["a"])],
            Kind::Bool => vec![json!("true"), json!(1), json!([])],
            Kind::Object => vec![json!(5), json!("x"), json!([]), json!(false)],
            Kind::Array => vec![json!(5), json!("x"), json!({})],
            Kind::Strings => vec![json!("a"), json!(["a", 1]), json!({})],
            Kind::Limit => vec![json!("25"), json!(true), json!(-1), json!(1.5), json!([])],
            Kind::Devices => vec![json!(0), json!("0"), json!([-1]), json!(["a"]), json!([0.5])],
        }
    }

    fn right_value(kind: Kind) -> Value {
        match kind {
            Kind::String => json!("analysis"),
            Kind::Bool => json!(false),
            Kind::Object => json!({}),
            Kind::Array => json!([]),
            Kind::Strings => json!(["pypi.org"]),
            Kind::Limit => json!(25),
            Kind::Devices => json!([0, 1.0]),
        }
    }

    #[test]
    fn typed_field_table() {
        let routes = [
            (Route::ExecuteShell, Language::Shell),
            (Route::Execute, Language::Python),
            (Route::ShellExecutions, Language::Shell),
        ];
        for (route, language) in routes {
            assert!(check_fields(route, language, &valid_request()).is_ok(), "{route:?}");
            for f in FIELDS {
                let applies = f.on.includes(route);
                for good in [right_value(f.kind), Value::Null] {
                    let mut o = valid_request();
                    set(&mut o, f.path, good.clone());
                    // Replacing a parent with `{}` or null is fine for the type check.
                    assert!(check_fields(route, language, &o).is_ok(), "{route:?} {:?} = {good}", f.path);
                }
                for bad in wrong_values(f.kind) {
                    let mut o = valid_request();
                    set(&mut o, f.path, bad.clone());
                    let r = check_fields(route, language, &o);
                    if !applies {
                        assert!(r.is_ok(), "{route:?} does not read {:?}", f.path);
                        continue;
                    }
                    let e = r.map_err(ApiError::from).expect_err(&format!("{route:?} {:?} = {bad}", f.path));
                    assert_eq!(e.status, 400);
                    let expected_code = match (f.path, route) {
                        (["executionId"], Route::ShellExecutions) => "invalid_execution_id",
                        _ => f.code.as_str(),
                    };
                    assert_eq!(e.code, expected_code, "{route:?} {:?} = {bad}", f.path);
                }
            }
        }
        // The contract's texts, spelled out for the fields it names.
        let text = |route: Route, language: Language, path: &[&str], v: Value| {
            let mut o = valid_request();
            set(&mut o, path, v);
            check_fields(route, language, &o).map_err(ApiError::from).unwrap_err().message
        };
        use Language::{Python, Shell};
        use Route::{Execute, ExecuteShell, ShellExecutions};
        let cases: &[(Route, Language, &[&str], Value, &str)] = &[
            (ExecuteShell, Shell, &["cwd"], json!(7), "cwd must be workspace-relative"),
            (ShellExecutions, Shell, &["cwd"], json!(["a"]), "cwd must be workspace-relative"),
            (ExecuteShell, Shell, &["code"], json!(1), "Shell code is required"),
            (Execute, Python, &["code"], json!({}), "Python code is required"),
            (ExecuteShell, Shell, &["agentId"], json!(1), "Agent ID is required"),
            (ExecuteShell, Shell, &["executionId"], json!(1), "Execution ID is required"),
            (ShellExecutions, Shell, &["executionId"], json!(1), "Invalid Execution ID"),
            (ExecuteShell, Shell, &["runnerWorkspaceKey"], json!(1), "Invalid remote workspace key"),
            (
                Execute,
                Python,
                &["readOnlyWorkspaceRoot"],
                json!(true),
                "Runner workspace must be inside the configured projects or remote-workspaces directory",
            ),
            (
                Execute,
                Python,
                &["permissionEpoch"],
                json!("x"),
                "M1 runner accepts exactly one read-write workspace mount",
            ),
            (
                ShellExecutions,
                Shell,
                &["permissionEpoch", "mounts"],
                json!({}),
                "Shell execution accepts exactly one read-write workspace mount",
            ),
            (ExecuteShell, Shell, &["environmentId"], json!(3), "Scientific environments are unavailable"),
            (
                Execute,
                Python,
                &["environmentRevisionId"],
                json!(3),
                "Unknown environment revision; select a current environment",
            ),
            (ExecuteShell, Shell, &["executionTimeoutMs"], json!("1"), TIMEOUT_ERROR),
            (
                ShellExecutions,
                Shell,
                &["maxOutputBytes"],
                json!(-1),
                "maxOutputBytes must be a non-negative integer number of bytes",
            ),
            (
                ExecuteShell,
                Shell,
                &["permissionEpoch", "sessionId"],
                json!(9),
                "permissionEpoch.sessionId must be a string",
            ),
            (
                ExecuteShell,
                Shell,
                &["permissionEpoch", "networkAccess", "allowedDomains"],
                json!(["a", 1]),
                "permissionEpoch.networkAccess.allowedDomains must be an array of strings",
            ),
        ];
        for (route, language, path, v, expected) in cases {
            assert_eq!(text(*route, *language, path, v.clone()), *expected, "{route:?} {path:?} = {v}");
        }
        // The managed route forces executionTimeoutMs to 0: whatever is sent is not read.
        assert!(
            check_fields(ShellExecutions, Shell, &{
                let mut o = valid_request();
                set(&mut o, &["executionTimeoutMs"], json!("soon"));
                o
            })
            .is_ok()
        );
    }

    #[test]
    fn kernel_mode_table() {
        for (v, ok) in [
            (json!({}), true),
            (json!({"kernelMode": "ephemeral"}), true),
            (json!({"kernelMode": "persistent"}), false),
            (json!({"kernelMode": null}), false),
            (json!({"kernelMode": ""}), false),
            (json!({"kernelMode": 1}), false),
        ] {
            let r = require_ephemeral(&obj(v.clone()));
            assert_eq!(r.is_ok(), ok, "{v}");
            if let Err(e) = r {
                assert!(e.to_string().contains("persistent runtimes are no longer supported"));
            }
        }
    }

    #[test]
    fn mounts_table() {
        let good = json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-write"}]}});
        assert!(single_workspace_mount(&obj(good)));
        let bad = [
            json!({}),
            json!({"permissionEpoch": {}}),
            json!({"permissionEpoch": {"mounts": []}}),
            json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-only"}]}}),
            json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-write"}, {"source": "workspace", "mode": "read-write"}]}}),
            json!({"permissionEpoch": {"mounts": [{"source": "home", "mode": "read-write"}]}}),
        ];
        for b in bad {
            assert!(!single_workspace_mount(&obj(b.clone())), "{b}");
        }
        let e = ApiError::from(mounts_error(Language::Shell));
        assert_eq!(e.message, "Shell execution accepts exactly one read-write workspace mount");
        let e = ApiError::from(mounts_error(Language::Python));
        assert_eq!(e.message, "M1 runner accepts exactly one read-write workspace mount");
    }

    #[test]
    fn limits_table() {
        let cases = [
            (json!({}), Some(7)),
            (json!({"x": null}), Some(7)),
            (json!({"x": 0}), Some(0)),
            (json!({"x": 25}), Some(25)),
            (json!({"x": 25.0}), Some(25)),
            (json!({"x": 9007199254740991u64}), Some(9007199254740991)),
            (json!({"x": 9007199254740992u64}), None),
            (json!({"x": -1}), None),
            (json!({"x": 1.5}), None),
            (json!({"x": "25"}), None),
            (json!({"x": true}), None),
        ];
        for (v, expected) in cases {
            let r = limit(&obj(v.clone()), "x", 7, TIMEOUT_ERROR);
            assert_eq!(r.as_ref().ok().copied(), expected, "{v}");
            if let Err(e) = r {
                assert_eq!(e.to_string(), TIMEOUT_ERROR);
            }
        }
    }

    #[test]
    fn languages_and_bodies() {
        assert_eq!(language(Route::Execute, &obj(json!({}))).unwrap(), Language::Python);
        assert_eq!(language(Route::Execute, &obj(json!({"language": "r"}))).unwrap(), Language::R);
        assert!(language(Route::Execute, &obj(json!({"language": "ruby"}))).is_err());
        assert_eq!(
            language(Route::ExecuteShell, &obj(json!({"language": "ruby"}))).unwrap(),
            Language::Shell
        );
        assert!(parse_object(b"{").is_err());
        assert!(parse_object(b"[]").is_err());
        assert!(parse_object(b"null").is_err());
        assert!(parse_object(b"{}").is_ok());
    }

    #[test]
    fn network_access_follows_the_epoch_only_when_modes_agree() {
        let none = NetworkAccess::none();
        assert_eq!(network_access(&obj(json!({}))), none);
        let mismatch = json!({"permissionEpoch": {"networkPolicy": "none", "networkAccess": {"mode": "domain-allowlist", "revision": "r1"}}});
        assert_eq!(network_access(&obj(mismatch)), none);
        let allow = json!({"permissionEpoch": {"networkPolicy": "domain-allowlist", "networkAccess": {
            "mode": "domain-allowlist", "revision": "r1", "allowedDomains": ["pypi.org", 7, "*.example.com"],
            "allowPrivateNetwork": true}}});
        assert_eq!(
            network_access(&obj(allow)),
            NetworkAccess {
                mode: "domain-allowlist".into(),
                revision: "r1".into(),
                allowed_domains: vec!["pypi.org".into(), "*.example.com".into()],
                allow_private_network: true,
            }
        );
    }
}
