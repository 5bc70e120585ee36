//! The synchronous execution request, read field by field from the JSON object the way
//! the original's handlers read it (contract §2A), with its exact error texts.

use serde_json::{Map, Value};

use crate::api::error::ApiError;
use crate::config::MAX_SAFE_INTEGER;
use crate::sandbox::Language;

pub type Object = Map<String, Value>;

/// Parses a request body; the original answers any parse failure with 400.
pub fn parse_object(body: &[u8]) -> Result<Object, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("Request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(ApiError::bad_request("invalid_json", "Request body must be a JSON object")),
    }
}

/// A string field; anything else (absent, null, a number) reads as absent.
pub fn string<'a>(obj: &'a Object, name: &str) -> Option<&'a str> {
    obj.get(name).and_then(Value::as_str)
}

/// A non-blank string field.
/// Whether `text` holds a control character (C0, DEL, C1) or a Unicode line or paragraph
/// separator: what could start a forged line in a text log.
pub fn has_control(text: &str) -> bool {
    text.chars().any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
}

/// Ours (issue #14): identifiers go into every audit event, so one holding a newline could
/// forge a line in a text sink. No correct caller sends one; refuse it with a clear 400.
pub fn refuse_control(field: &str, value: &str) -> Result<(), ApiError> {
    if has_control(value) {
        return Err(ApiError::bad_request(
            "invalid_identifier",
            format!("{field} must not contain control characters (newlines, tabs, escapes)"),
        ));
    }
    Ok(())
}

pub fn non_blank<'a>(obj: &'a Object, name: &str) -> Option<&'a str> {
    string(obj, name).filter(|s| !s.trim().is_empty())
}

/// Step 3 of the original's order: only an absent `kernelMode` or `"ephemeral"` passes.
pub fn require_ephemeral(obj: &Object) -> Result<(), ApiError> {
    match obj.get("kernelMode") {
        None => Ok(()),
        Some(Value::String(s)) if s == "ephemeral" => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "persistent_kernel_refused",
            "Runner executions must be ephemeral; persistent runtimes are no longer supported. Use managed Shell Execution for background tasks",
        )),
    }
}

/// Which route asked: its language and error labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    ExecuteShell,
    Execute,
}

/// The language of a request on `route` (`/execute`: `language`, default python).
pub fn language(route: Route, obj: &Object) -> Result<Language, ApiError> {
    match route {
        Route::ExecuteShell => Ok(Language::Shell),
        Route::Execute => match obj.get("language") {
            None | Some(Value::Null) => Ok(Language::Python),
            Some(Value::String(s)) if s == "python" => Ok(Language::Python),
            Some(Value::String(s)) if s == "r" => Ok(Language::R),
            Some(other) => Err(ApiError::bad_request(
                "unsupported_language",
                format!("Unsupported language {other}; use \"python\" or \"r\""),
            )),
        },
    }
}

/// `permissionEpoch.mounts` must be exactly `[{source:"workspace", mode:"read-write"}]`.
pub fn require_single_workspace_mount(obj: &Object, language: Language) -> Result<(), ApiError> {
    let mounts = obj.get("permissionEpoch").and_then(|e| e.get("mounts")).and_then(Value::as_array);
    let ok = matches!(mounts.map(Vec::as_slice), Some([m])
        if m.get("source").and_then(Value::as_str) == Some("workspace")
            && m.get("mode").and_then(Value::as_str) == Some("read-write"));
    if ok {
        return Ok(());
    }
    let message = match language {
        Language::Shell => "Shell execution accepts exactly one read-write workspace mount",
        Language::Python | Language::R => "M1 runner accepts exactly one read-write workspace mount",
    };
    Err(ApiError::bad_request("invalid_mounts", message))
}

/// A per-request limit: absent or null → the configured default; otherwise a non-negative
/// safe integer (`1.0` counts, as in JavaScript).
pub fn limit(obj: &Object, name: &str, default: u64, error: &str) -> Result<u64, ApiError> {
    let invalid = || ApiError::bad_request("invalid_limit", error);
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

pub fn bytes_error(label: &str) -> String {
    format!("{label} must be a non-negative integer number of bytes")
}

/// The network access a request's permission epoch grants (contract §2A "Network policy"):
/// `networkAccess` only if its mode equals `networkPolicy`, else none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetworkAccess {
    pub mode: String,
    pub revision: String,
    /// Strings only; anything else in the array is dropped (egressd skips entries that do
    /// not parse, as the original's matcher does).
    pub allowed_domains: Vec<String>,
    pub allow_private_network: bool,
}

impl NetworkAccess {
    fn none() -> NetworkAccess {
        NetworkAccess { mode: "none".into(), revision: "none".into(), ..NetworkAccess::default() }
    }
}

pub fn network_access(obj: &Object) -> NetworkAccess {
    let epoch = obj.get("permissionEpoch");
    let policy = epoch.and_then(|e| e.get("networkPolicy")).and_then(Value::as_str);
    let access = epoch.and_then(|e| e.get("networkAccess"));
    match (policy, access) {
        (Some(policy), Some(access)) if access.get("mode").and_then(Value::as_str) == Some(policy) => {
            NetworkAccess {
                mode: policy.to_owned(),
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let e = refuse_control("executionId", "a\nWARN forged").unwrap_err();
        assert_eq!(e.status, 400);
    }
    use serde_json::json;

    fn obj(v: Value) -> Object {
        v.as_object().unwrap().clone()
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
                assert!(e.message.contains("persistent runtimes are no longer supported"));
            }
        }
    }

    #[test]
    fn mounts_table() {
        let good = json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-write"}]}});
        assert!(require_single_workspace_mount(&obj(good), Language::Shell).is_ok());
        let bad = [
            json!({}),
            json!({"permissionEpoch": {}}),
            json!({"permissionEpoch": {"mounts": []}}),
            json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-only"}]}}),
            json!({"permissionEpoch": {"mounts": [{"source": "workspace", "mode": "read-write"}, {"source": "workspace", "mode": "read-write"}]}}),
            json!({"permissionEpoch": {"mounts": [{"source": "home", "mode": "read-write"}]}}),
        ];
        for b in bad {
            let e = require_single_workspace_mount(&obj(b.clone()), Language::Shell).unwrap_err();
            assert_eq!(e.message, "Shell execution accepts exactly one read-write workspace mount", "{b}");
            let e = require_single_workspace_mount(&obj(b), Language::Python).unwrap_err();
            assert_eq!(e.message, "M1 runner accepts exactly one read-write workspace mount");
        }
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
                assert_eq!(e.message, TIMEOUT_ERROR);
            }
        }
        assert_eq!(
            bytes_error("maxOutputBytes"),
            "maxOutputBytes must be a non-negative integer number of bytes"
        );
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
