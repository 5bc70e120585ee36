//! The workload whitelist (internals §4.7): `{"workloads":[{id, label, description,
//! phase:"builtin"|"project", command:{program, args[]}, requiredInputs?, rejectAf3Intent?}]}`,
//! validated whole when npu-brokerd starts (a bad file stops it with the workload and field
//! named), and the built-in defaults when no file is configured.

use serde_json::{Map, Value, json};

use crate::template::{self, Expr, Piece};

/// One allowlisted workload, its argv already parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub id: String,
    pub label: String,
    pub description: String,
    pub phase: String,
    pub program: Vec<Piece>,
    pub args: Vec<Vec<Piece>>,
    /// Inferred from `${input:X}` (only `configPath` exists).
    pub required_inputs: Vec<String>,
    /// Set when `${managedPython}` appears.
    pub requires_environment_revision: bool,
    pub reject_af3_intent: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WhitelistError {
    #[error("the workload whitelist is not valid JSON: {0}")]
    Json(String),
    #[error("the workload whitelist must be an object with a \"workloads\" array")]
    Shape,
    #[error("workload #{index}: {message}")]
    Field { index: usize, message: String },
    #[error("workload id {0:?} appears more than once")]
    Duplicate(String),
    #[error("workload {id}: {field}")]
    Template {
        id: String,
        field: String,
        #[source]
        source: template::TemplateError,
    },
}

/// `^[a-z0-9][a-z0-9._-]*$`.
pub fn valid_id(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'))
}

/// Parses and validates a whitelist file's text.
pub fn parse(text: &str) -> Result<Vec<Workload>, WhitelistError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| WhitelistError::Json(e.to_string()))?;
    let list = doc.get("workloads").and_then(Value::as_array).ok_or(WhitelistError::Shape)?;
    let mut out: Vec<Workload> = Vec::with_capacity(list.len());
    for (index, entry) in list.iter().enumerate() {
        let w = workload(index, entry)?;
        if out.iter().any(|o| o.id == w.id) {
            return Err(WhitelistError::Duplicate(w.id));
        }
        out.push(w);
    }
    Ok(out)
}

fn workload(index: usize, entry: &Value) -> Result<Workload, WhitelistError> {
    let field = |message: String| WhitelistError::Field { index, message };
    let obj = entry.as_object().ok_or_else(|| field("must be an object".into()))?;
    let text = |name: &str| -> Result<String, WhitelistError> {
        obj.get(name)
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
            .map(str::to_owned)
            .ok_or_else(|| field(format!("{name} must be a non-empty string")))
    };
    let id = text("id")?;
    if !valid_id(&id) {
        return Err(field(format!("id {id:?} must match ^[a-z0-9][a-z0-9._-]*$")));
    }
    let label = text("label")?;
    let description = text("description")?;
    let phase = text("phase")?;
    if phase != "builtin" && phase != "project" {
        return Err(field(format!("phase must be \"builtin\" or \"project\", not {phase:?}")));
    }
    let (program, args) = command(index, obj)?;
    let reject_af3_intent = match obj.get("rejectAf3Intent") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(field("rejectAf3Intent must be true or false".into())),
    };
    if let Some(v) = obj.get("requiredInputs") {
        let ok = v.as_array().is_some_and(|a| a.iter().all(|i| i.as_str() == Some("configPath")));
        if !ok {
            return Err(field("requiredInputs may only list \"configPath\"".into()));
        }
    }
    let parse = |name: String, t: &str| {
        template::parse(t).map_err(|source| WhitelistError::Template { id: id.clone(), field: name, source })
    };
    let program = parse("command.program".into(), program)?;
    let args = args
        .iter()
        .enumerate()
        .map(|(i, a)| parse(format!("command.args[{i}]"), a))
        .collect::<Result<Vec<_>, _>>()?;
    let (required_inputs, requires_environment_revision) = requirements(&program, &args);
    Ok(Workload {
        id,
        label,
        description,
        phase,
        program,
        args,
        required_inputs,
        requires_environment_revision,
        reject_af3_intent,
    })
}

/// `command`'s program and args, as written (templates not parsed yet).
fn command(index: usize, obj: &Map<String, Value>) -> Result<(&str, Vec<&str>), WhitelistError> {
    let field = |message: String| WhitelistError::Field { index, message };
    let command = obj
        .get("command")
        .and_then(Value::as_object)
        .ok_or_else(|| field("command must be an object".into()))?;
    let program = command
        .get("program")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| field("command.program must be a non-empty string".into()))?;
    let args: Vec<&str> = match command.get("args") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().ok_or_else(|| field("command.args must be an array of strings".into())))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(field("command.args must be an array of strings".into())),
    };
    Ok((program, args))
}

/// The inputs the templates name (in order, once each) and whether they use the managed
/// Python (so a job must name an environment revision).
fn requirements(program: &[Piece], args: &[Vec<Piece>]) -> (Vec<String>, bool) {
    let exprs: Vec<&Expr> = template::expressions(program)
        .into_iter()
        .chain(args.iter().flat_map(|a| template::expressions(a)))
        .collect();
    let mut required_inputs: Vec<String> = Vec::new();
    for e in &exprs {
        if let Expr::Input(name) = e
            && !required_inputs.contains(name)
        {
            required_inputs.push(name.clone());
        }
    }
    let requires_environment_revision = exprs.iter().any(|e| matches!(e, Expr::ManagedPython));
    (required_inputs, requires_environment_revision)
}

/// The built-in whitelist: the original's two default workloads. Scripts are looked up in
/// the repository root (`/usr/share/sciencediscovery/npu` when packaged).
pub const DEFAULTS: &str = r#"{"workloads":[
  {"id":"npu.smoke_test","label":"NPU smoke test",
   "description":"Runs a tiny MindSpore addition on the Ascend NPU and prints the result as JSON.",
   "phase":"builtin",
   "command":{"program":"${managedPython}",
              "args":["${env:SCIENCE_AGENT_NPU_SMOKE_SCRIPT:-repo:workloads/npu-smoke-test.py}","${workspaceRoot}"]}},
  {"id":"antibody.protenix.v1","label":"Antibody structure prediction (Protenix)",
   "description":"Runs the Protenix antibody pipeline on the NPU with a workspace configuration file.",
   "phase":"builtin",
   "command":{"program":"${managedPython}",
              "args":["${repo:workloads/antibody-manager-adapter.py}","${env:SCIENCE_AGENT_NPU_PROTENIX_SCRIPT}",
                      "${input:configPath}","${workspaceRoot}"]},
   "rejectAf3Intent":true}
]}"#;

pub fn defaults() -> Vec<Workload> {
    parse(DEFAULTS).unwrap_or_default()
}

/// `NpuWorkloadDescriptor`: `{id,label,description,phase,requiresEnvironmentRevision?,requiredInputs?}`.
pub fn descriptor(w: &Workload) -> Value {
    let mut d = Map::new();
    d.insert("id".into(), json!(w.id));
    d.insert("label".into(), json!(w.label));
    d.insert("description".into(), json!(w.description));
    d.insert("phase".into(), json!(w.phase));
    if w.requires_environment_revision {
        d.insert("requiresEnvironmentRevision".into(), json!(true));
    }
    if !w.required_inputs.is_empty() {
        d.insert("requiredInputs".into(), json!(w.required_inputs));
    }
    Value::Object(d)
}

pub fn descriptors(list: &[Workload]) -> Value {
    Value::Array(list.iter().map(descriptor).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_originals_two() {
        let d = defaults();
        assert_eq!(
            d.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
            ["npu.smoke_test", "antibody.protenix.v1"]
        );
        assert_eq!(
            descriptors(&d),
            json!([
                {"id":"npu.smoke_test","label":"NPU smoke test","description":d[0].description,"phase":"builtin","requiresEnvironmentRevision":true},
                {"id":"antibody.protenix.v1","label":d[1].label,"description":d[1].description,"phase":"builtin","requiresEnvironmentRevision":true,"requiredInputs":["configPath"]},
            ])
        );
        assert!(d[1].reject_af3_intent && !d[0].reject_af3_intent);
    }

    #[test]
    fn ids() {
        for (id, ok) in [
            ("npu.smoke_test", true),
            ("0a-b_c.d", true),
            ("Upper", false),
            ("-x", false),
            ("", false),
            ("a b", false),
            ("a/b", false),
        ] {
            assert_eq!(valid_id(id), ok, "{id}");
        }
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let one = |w: &str| format!("{{\"workloads\":[{w}]}}");
        let good = r#"{"id":"project.custom.v1","label":"L","description":"D","phase":"project","command":{"program":"${python}","args":["${repo:s.py}","--config","${input:configPath}"]}}"#;
        let parsed = parse(&one(good)).unwrap();
        assert_eq!(
            descriptor(&parsed[0]),
            json!({"id":"project.custom.v1","label":"L","description":"D","phase":"project","requiredInputs":["configPath"]})
        );
        let cases: &[(&str, &str)] = &[
            ("not json", "the workload whitelist is not valid JSON"),
            ("[]", "must be an object with a \"workloads\" array"),
            (&one("1"), "workload #0: must be an object"),
            (&one(&good.replace("project.custom.v1", "Bad Id")), "workload #0: id \"Bad Id\" must match"),
            (
                &one(&good.replace("\"phase\":\"project\"", "\"phase\":\"later\"")),
                "phase must be \"builtin\" or \"project\"",
            ),
            (&one(&good.replace("\"label\":\"L\",", "")), "label must be a non-empty string"),
            (&one(&good.replace("${python}", "")), "command.program must be a non-empty string"),
            (&one(&good.replace("[\"${repo:s.py}\"", "[1")), "command.args must be an array of strings"),
            (
                &one(&good.replace("${repo:s.py}", "${shell:ls}")),
                "workload project.custom.v1: command.args[0]: unknown template expression ${shell:ls}",
            ),
            (&one(&good.replace("${input:configPath}", "${input:data}")), "only input:configPath is"),
            (
                &format!("{{\"workloads\":[{good},{good}]}}"),
                "workload id \"project.custom.v1\" appears more than once",
            ),
            (
                &one(&good.replace("\"phase\"", "\"rejectAf3Intent\":\"yes\",\"phase\"")),
                "rejectAf3Intent must be true or false",
            ),
            (
                &one(&good.replace("\"phase\"", "\"requiredInputs\":[\"other\"],\"phase\"")),
                "requiredInputs may only list",
            ),
        ];
        for (text, want) in cases {
            let err = common::error_chain(&parse(text).unwrap_err());
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
