//! Pools and object refs (`ObjectRef`/`DataRef`/`AgentStateRef` in the original).

use std::fmt;

use serde::de::Error as _;
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use super::{RECORD_MEDIA_TYPE, VersionError, jcs};

/// JavaScript's `Number.MAX_SAFE_INTEGER`: sizes must be safe integers to survive the API.
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// The two blob pools; each is a standalone OCI image layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pool {
    /// Workspace file contents.
    Data,
    /// Records, logs, code and other state.
    AgentState,
}

impl Pool {
    /// The pool's name in refs, which is also its directory name.
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Data => "data",
            Pool::AgentState => "agent-state",
        }
    }

    pub fn parse(text: &str) -> Option<Pool> {
        match text {
            "data" => Some(Pool::Data),
            "agent-state" => Some(Pool::AgentState),
            _ => None,
        }
    }

    /// The pool a read falls back to when the blob is not in this one.
    pub fn other(self) -> Pool {
        match self {
            Pool::Data => Pool::AgentState,
            Pool::AgentState => Pool::Data,
        }
    }
}

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A pointer to an immutable blob: `{pool, digest: "sha256:<hex>", size, mediaType}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ref {
    pub pool: Pool,
    pub digest: String,
    pub size: u64,
    pub media_type: String,
}

impl Ref {
    /// The ref of content with lowercase hex digest `hex`.
    pub fn new(pool: Pool, hex: &str, size: u64, media_type: &str) -> Ref {
        Ref { pool, digest: format!("sha256:{hex}"), size, media_type: media_type.to_string() }
    }

    /// Exactly the four keys; key order does not matter since hashing goes through JCS.
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert("pool".into(), Value::from(self.pool.as_str()));
        map.insert("digest".into(), Value::from(self.digest.as_str()));
        map.insert("size".into(), Value::from(self.size));
        map.insert("mediaType".into(), Value::from(self.media_type.as_str()));
        Value::Object(map)
    }

    /// The original's `assertRef`: known pool, `sha256:` plus 64 lowercase hex, a safe
    /// non-negative integer size and a non-empty mediaType. Other keys are ignored, as there.
    pub fn from_value(v: &Value) -> Result<Ref, VersionError> {
        let obj = v.as_object().ok_or(VersionError::InvalidRef)?;
        let pool =
            obj.get("pool").and_then(Value::as_str).and_then(Pool::parse).ok_or(VersionError::InvalidRef)?;
        let digest = obj.get("digest").and_then(Value::as_str).ok_or(VersionError::InvalidRef)?;
        let size = obj.get("size").and_then(safe_size).ok_or(VersionError::InvalidRef)?;
        let media_type = obj.get("mediaType").and_then(Value::as_str).ok_or(VersionError::InvalidRef)?;
        let r = Ref { pool, digest: digest.to_string(), size, media_type: media_type.to_string() };
        r.validate()?;
        Ok(r)
    }

    /// The `assertRef` rules for a ref built in Rust (its fields are public). Reads check this
    /// before touching the disk, so a digest can never smuggle a path.
    pub fn validate(&self) -> Result<(), VersionError> {
        let hex_ok = self.digest.strip_prefix("sha256:").is_some_and(|h| {
            h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if hex_ok && self.size <= MAX_SAFE_INTEGER && !self.media_type.is_empty() {
            Ok(())
        } else {
            Err(VersionError::InvalidRef)
        }
    }

    /// Validates and additionally requires `pool`, as the original's pool-specific APIs do.
    pub fn require_pool(&self, pool: Pool) -> Result<(), VersionError> {
        self.validate()?;
        if self.pool == pool { Ok(()) } else { Err(VersionError::InvalidRef) }
    }

    /// True for refs to records (which must live in the agent-state pool).
    pub fn is_record(&self) -> bool {
        self.media_type == RECORD_MEDIA_TYPE
    }

    /// The JCS text `{"digest":…,"mediaType":…,"pool":…,"size":N}`: the identity used for
    /// dependency de-duplication, the refs database and compare-and-swap.
    pub fn jcs(&self) -> String {
        let mut out = String::from("{\"digest\":");
        jcs::write_string(&mut out, &self.digest);
        out.push_str(",\"mediaType\":");
        jcs::write_string(&mut out, &self.media_type);
        out.push_str(",\"pool\":\"");
        out.push_str(self.pool.as_str());
        out.push_str("\",\"size\":");
        out.push_str(&self.size.to_string());
        out.push('}');
        out
    }

    /// The digest without its `sha256:` prefix, which is the blob's file name.
    pub fn hex(&self) -> &str {
        self.digest.strip_prefix("sha256:").unwrap_or(&self.digest)
    }
}

/// `Number.isSafeInteger(x) && x >= 0`: also accepts `5.0`, which JavaScript cannot tell from `5`.
fn safe_size(v: &Value) -> Option<u64> {
    if let Some(u) = v.as_u64() {
        return (u <= MAX_SAFE_INTEGER).then_some(u);
    }
    let f = v.as_f64()?;
    (f >= 0.0 && f.fract() == 0.0 && f <= MAX_SAFE_INTEGER as f64).then_some(f as u64)
}

impl Serialize for Ref {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(4))?;
        map.serialize_entry("pool", self.pool.as_str())?;
        map.serialize_entry("digest", &self.digest)?;
        map.serialize_entry("size", &self.size)?;
        map.serialize_entry("mediaType", &self.media_type)?;
        map.end()
    }
}

impl<'de> Deserialize<'de> for Ref {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Ref, D::Error> {
        let v = Value::deserialize(deserializer)?;
        Ref::from_value(&v).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HEX: &str = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";

    #[test]
    fn jcs_text_matches_the_canonical_encoder() {
        let r = Ref::new(Pool::Data, HEX, 6, "application/octet-stream");
        assert_eq!(
            r.jcs(),
            format!(
                r#"{{"digest":"sha256:{HEX}","mediaType":"application/octet-stream","pool":"data","size":6}}"#
            )
        );
        assert_eq!(r.jcs(), jcs::canonicalize(&r.to_value()).unwrap());
        assert_eq!(r.to_value().as_object().unwrap().len(), 4);
        assert_eq!(r.hex(), HEX);
        assert_eq!(Ref::from_value(&r.to_value()).unwrap(), r);
    }

    #[test]
    fn assert_ref_table() {
        let d = format!("sha256:{HEX}");
        let good = [
            json!({"pool": "data", "digest": d, "size": 0, "mediaType": "x"}),
            json!({"pool": "agent-state", "digest": d, "size": 9007199254740991u64, "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": 5.0, "mediaType": "x", "extra": 1}),
        ];
        for v in &good {
            assert!(Ref::from_value(v).is_ok(), "{v}");
        }
        let upper = format!("sha256:{}", HEX.to_uppercase());
        let bad = [
            json!({"pool": "other", "digest": d, "size": 0, "mediaType": "x"}),
            json!({"pool": "data", "digest": upper, "size": 0, "mediaType": "x"}),
            json!({"pool": "data", "digest": HEX, "size": 0, "mediaType": "x"}),
            json!({"pool": "data", "digest": format!("{d}0"), "size": 0, "mediaType": "x"}),
            json!({"pool": "data", "digest": "sha256:../../etc/passwd", "size": 0, "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": -1, "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": 1.5, "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": 9007199254740992u64, "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": "1", "mediaType": "x"}),
            json!({"pool": "data", "digest": d, "size": 1, "mediaType": ""}),
            json!({"pool": "data", "digest": d, "size": 1}),
            json!([1]),
        ];
        for v in &bad {
            let e = Ref::from_value(v).unwrap_err();
            assert_eq!(e.to_string(), "Invalid or cross-pool reference", "{v}");
        }
    }

    #[test]
    fn serde_round_trip_and_pool_requirement() {
        let r = Ref::new(Pool::AgentState, HEX, 6, RECORD_MEDIA_TYPE);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"pool":"agent-state","digest":"sha256:{HEX}","size":6,"mediaType":"{RECORD_MEDIA_TYPE}"}}"#
            )
        );
        assert_eq!(serde_json::from_str::<Ref>(&text).unwrap(), r);
        assert!(serde_json::from_str::<Ref>(r#"{"pool":"data"}"#).is_err());
        assert!(r.require_pool(Pool::AgentState).is_ok());
        assert!(r.require_pool(Pool::Data).unwrap_err().to_string().contains("cross-pool"));
    }
}
