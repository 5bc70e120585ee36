//! AlphaFold3 intent (internals §4.7): a workload with `rejectAf3Intent` refuses a
//! configuration that names AF3 directories or flags (`af3_dir`, `af3_model_dir`,
//! `af3_db_dir`, `model_dir`, `db_dir`, `use_af3`) or whose text values mention `af3` or
//! `alphafold`. The broker never runs AF3, whatever a configuration asks.

use serde_json::Value;

const KEYS: [&str; 6] = ["af3_dir", "af3_model_dir", "af3_db_dir", "model_dir", "db_dir", "use_af3"];

/// Where the configuration shows AF3 intent (`key` or `key.sub[2]`), if anywhere.
pub fn intent(config: &Value) -> Option<String> {
    walk(config, "")
}

fn set(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::String(s) => !s.trim().is_empty(),
        _ => true,
    }
}

fn walk(v: &Value, at: &str) -> Option<String> {
    match v {
        Value::Object(map) => map.iter().find_map(|(k, child)| {
            let here = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
            if KEYS.contains(&k.as_str()) && set(child) {
                return Some(here);
            }
            walk(child, &here)
        }),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, c)| walk(c, &format!("{at}[{i}]"))),
        Value::String(s) => {
            let lower = s.to_ascii_lowercase();
            (lower.contains("af3") || lower.contains("alphafold")).then(|| at.to_owned())
        }
        _ => None,
    }
}

/// The refusal, worded as the original's (`/only exposes antibody\.protenix\.v1/`).
pub fn refusal(workload: &str, at: &str) -> String {
    format!(
        "NPU workload {workload} only exposes {workload}; the configuration asks for AlphaFold3 ({at}), which the NPU broker does not run"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn intent_table() {
        let cases = [
            (json!({"seeds": [1], "name": "ab-1"}), None),
            (json!({"af3_dir": "/opt/af3"}), Some("af3_dir")),
            (json!({"use_af3": true}), Some("use_af3")),
            (json!({"use_af3": false, "model_dir": ""}), None),
            (json!({"db_dir": "/data/db"}), Some("db_dir")),
            (json!({"job": {"engine": "AlphaFold-3"}}), Some("job.engine")),
            (json!({"job": {"engine": "protenix"}}), None),
            (json!({"job": {"engine": "AlphaFold3"}}), Some("job.engine")),
            (json!({"runs": [{"tool": "protenix"}, {"tool": "af3"}]}), Some("runs[1].tool")),
            (json!({"note": "AF3 weights"}), Some("note")),
        ];
        for (config, want) in cases {
            assert_eq!(intent(&config).as_deref(), want, "{config}");
        }
        assert!(refusal("antibody.protenix.v1", "af3_dir").contains("only exposes antibody.protenix.v1"));
    }
}
