//! Where things live in the bucket (issue #34), and the head document. Pure.
//!
//! * `<prefix>objects/<pool>/<hex>`: an object of the version store, under its digest, so a
//!   second copy is never sent and any node can fetch by the refs its records name.
//! * `<prefix>heads/<Ident::object_name()>.json`: the workspace's replicated head —
//!   `{"ident":{…},"head":Ref,"epoch":N,"node":URL,"committedAtMs":N}`. A restore reads it;
//!   the epoch orders copies, so a node with an older epoch never overwrites it.

use serde_json::{Value, json};

use crate::transfer::Ident;
use crate::versioning::Ref;

/// Why a head document is refused.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("the head document is not JSON")]
    Json(#[source] serde_json::Error),
    #[error("the head document lacks {0} or has it of the wrong type")]
    Field(&'static str),
    #[error("the head document's ident is not a workspace name")]
    Ident(#[source] crate::transfer::IdentError),
    #[error("the head document's head is not a valid ref")]
    Head(#[source] crate::versioning::VersionError),
    #[error("the head document names {found}, but it is stored as {expected}'s")]
    Elsewhere { expected: String, found: String },
}

/// `<prefix>objects/<pool>/<hex>`.
pub fn object_key(prefix: &str, r: &Ref) -> String {
    format!("{prefix}objects/{}/{}", r.pool.as_str(), r.hex())
}

/// `<prefix>heads/<kind>/<name>.json`.
pub fn head_key(prefix: &str, ident: &Ident) -> String {
    format!("{prefix}heads/{}.json", ident.object_name())
}

/// A workspace's replicated head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadDoc {
    pub ident: Ident,
    pub head: Ref,
    /// The epoch of the copy that wrote it (0: never moved or restored).
    pub epoch: u64,
    /// The URL of the node that wrote it.
    pub node: String,
    pub committed_at_ms: u64,
}

impl HeadDoc {
    pub fn to_json(&self) -> Value {
        json!({
            "ident": self.ident.to_json(),
            "head": self.head.to_value(),
            "epoch": self.epoch,
            "node": self.node,
            "committedAtMs": self.committed_at_ms,
        })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // A Value always serializes.
        serde_json::to_vec_pretty(&self.to_json()).unwrap_or_default()
    }

    /// The document stored for `expected` (its ident must be that one).
    pub fn parse(bytes: &[u8], expected: &Ident) -> Result<HeadDoc, LayoutError> {
        let v: Value = serde_json::from_slice(bytes).map_err(LayoutError::Json)?;
        let ident = v.get("ident").and_then(Value::as_object).ok_or(LayoutError::Field("ident"))?;
        let ident = Ident::from_json(ident).map_err(LayoutError::Ident)?;
        if &ident != expected {
            return Err(LayoutError::Elsewhere { expected: expected.to_string(), found: ident.to_string() });
        }
        let head =
            Ref::from_value(v.get("head").ok_or(LayoutError::Field("head"))?).map_err(LayoutError::Head)?;
        let number = |name: &'static str| v.get(name).and_then(Value::as_u64).ok_or(LayoutError::Field(name));
        Ok(HeadDoc {
            ident,
            head,
            epoch: number("epoch")?,
            node: v.get("node").and_then(Value::as_str).ok_or(LayoutError::Field("node"))?.to_owned(),
            committed_at_ms: number("committedAtMs")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::versioning::Pool;

    fn head() -> Ref {
        Ref::new(Pool::AgentState, &"ab".repeat(32), 12, crate::versioning::RECORD_MEDIA_TYPE)
    }

    #[test]
    fn keys() {
        let blob = Ref::new(Pool::Data, &"0f".repeat(32), 3, "application/octet-stream");
        assert_eq!(object_key("", &blob), format!("objects/data/{}", "0f".repeat(32)));
        assert_eq!(object_key("r/", &head()), format!("r/objects/agent-state/{}", "ab".repeat(32)));
        assert_eq!(head_key("r/", &Ident::Remote("p/s".into())), "r/heads/remote/p/s.json");
        assert_eq!(head_key("", &Ident::Project("a".into())), "heads/project/a.json");
    }

    #[test]
    fn head_documents_round_trip_and_refuse() {
        let ident = Ident::Remote("p/s".into());
        let doc = HeadDoc {
            ident: ident.clone(),
            head: head(),
            epoch: 3,
            node: "http://n1:4311".into(),
            committed_at_ms: 9,
        };
        let text = doc.to_bytes();
        assert_eq!(HeadDoc::parse(&text, &ident).unwrap(), doc);
        let json: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(json["ident"], json!({"workspace": "p/s"}));
        assert_eq!(json["committedAtMs"], 9);
        let other = Ident::Remote("p/t".into());
        assert!(matches!(HeadDoc::parse(&text, &other), Err(LayoutError::Elsewhere { .. })));
        let mut broken = json.clone();
        broken["epoch"] = json!("3");
        let broken = serde_json::to_vec(&broken).unwrap();
        assert!(matches!(HeadDoc::parse(&broken, &ident), Err(LayoutError::Field("epoch"))));
        assert!(matches!(HeadDoc::parse(b"{", &ident), Err(LayoutError::Json(_))));
    }
}
