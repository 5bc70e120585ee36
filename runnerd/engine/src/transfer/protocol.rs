//! What two runnerd say to each other when a workspace moves (issue #34), as pure parsing and
//! formatting: the requests' JSON bodies and the object stream's frame headers. Every bound
//! is here, so a hostile peer is refused before anything is read or written.

use serde_json::{Map, Value};

use super::ident::{Ident, IdentError};
use crate::versioning::{Pool, Ref};

/// The node URLs a push may target (`transfer_peers`; unset: any).
pub const PEERS_VAR: &str = "SCIENCE_AGENT_TRANSFER_PEERS";

/// The most refs one `missing` question may carry (a 2,000,000-byte body holds ~12,000).
pub const MAX_ASKED: usize = 10_000;
/// The most bytes one object in a stream may declare: the store's own bound on a file is
/// the workspace quota, checked by the target's import; this only refuses absurd headers.
pub const MAX_OBJECT: u64 = 1 << 46;
/// The highest epoch: what the placement database stores (an SQLite integer) and a move can
/// still raise.
pub const MAX_EPOCH: u64 = i64::MAX as u64 - 1;
/// A frame header's longest line: `agent-state <64 hex> <20 digits>\n`.
pub const MAX_HEADER: usize = 100;

/// Why a transfer request is refused as sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("the request body must be a JSON object")]
    NotObject,
    #[error(transparent)]
    Ident(#[from] IdentError),
    #[error("`{0}` is missing or not a valid object ref")]
    BadRef(&'static str),
    #[error("`objects` must be an array of at most {MAX_ASKED} object refs")]
    BadList,
    #[error("`epoch` must be a positive integer below 2^63 - 1")]
    BadEpoch,
    #[error("`{0}` must be an http:// URL of a runnerd (host:port)")]
    BadUrl(&'static str),
    #[error("`version` must be a record digest (sha256:<64 lowercase hex>)")]
    BadVersion,
    #[error("an object frame header must be `<pool> <64 lowercase hex> <size>`")]
    BadFrame,
}

/// The JSON object of a request body.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ProtocolError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(ProtocolError::NotObject),
    }
}

fn a_ref(obj: &Map<String, Value>, name: &'static str) -> Result<Ref, ProtocolError> {
    let value = obj.get(name).ok_or(ProtocolError::BadRef(name))?;
    Ref::from_value(value).map_err(|_| ProtocolError::BadRef(name))
}

/// `POST /workspace-transfer/missing`: which of these objects does the target lack?
pub fn asked(obj: &Map<String, Value>) -> Result<Vec<Ref>, ProtocolError> {
    let list = obj.get("objects").and_then(Value::as_array).ok_or(ProtocolError::BadList)?;
    if list.len() > MAX_ASKED {
        return Err(ProtocolError::BadList);
    }
    list.iter().map(|v| Ref::from_value(v).map_err(|_| ProtocolError::BadList)).collect()
}

/// `POST /workspace-transfer/commit`: make `head` this node's copy of `ident` at `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRequest {
    pub ident: Ident,
    pub head: Ref,
    pub epoch: u64,
    /// The node it came from (for the log and the answer).
    pub from: String,
}

pub fn commit_request(obj: &Map<String, Value>) -> Result<CommitRequest, ProtocolError> {
    let ident = Ident::from_json(obj)?;
    let head = a_ref(obj, "head")?;
    if head.pool != Pool::AgentState || !head.is_record() {
        return Err(ProtocolError::BadRef("head"));
    }
    let epoch = obj
        .get("epoch")
        .and_then(Value::as_u64)
        .filter(|e| *e > 0 && *e <= MAX_EPOCH)
        .ok_or(ProtocolError::BadEpoch)?;
    // Informational (the log, the answer): a name this node cannot parse is dropped.
    let from = obj.get("from").and_then(Value::as_str).and_then(node_url).unwrap_or_default();
    Ok(CommitRequest { ident, head, epoch, from })
}

/// `POST /workspace-transfer/push`: send `ident` to the runnerd at `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRequest {
    pub ident: Ident,
    pub to: String,
}

pub fn push_request(obj: &Map<String, Value>) -> Result<PushRequest, ProtocolError> {
    let ident = Ident::from_json(obj)?;
    let to = obj.get("to").and_then(Value::as_str).and_then(node_url).ok_or(ProtocolError::BadUrl("to"))?;
    Ok(PushRequest { ident, to })
}

/// `POST /workspace-transfer/restore`: `version` (a head record's digest) or the latest, from
/// this node's history or from the object store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreRequest {
    pub ident: Ident,
    pub version: Option<String>,
    pub from_store: bool,
}

pub fn restore_request(obj: &Map<String, Value>) -> Result<RestoreRequest, ProtocolError> {
    let ident = Ident::from_json(obj)?;
    let version = match obj.get("version") {
        None | Some(Value::Null) => None,
        Some(Value::String(v)) if is_digest(v) => Some(v.clone()),
        Some(_) => return Err(ProtocolError::BadVersion),
    };
    let from_store = obj.get("fromStore").and_then(Value::as_bool).unwrap_or(false);
    Ok(RestoreRequest { ident, version, from_store })
}

/// `sha256:<64 lowercase hex>`.
pub fn is_digest(text: &str) -> bool {
    text.strip_prefix("sha256:").is_some_and(is_hex64)
}

fn is_hex64(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A runnerd's base URL, normalised to `http://host:port` (no path, query or user info): the
/// only form a node is named by, so one node has one name in fences and answers.
pub fn node_url(text: &str) -> Option<String> {
    let rest = text.trim().strip_prefix("http://")?.trim_end_matches('/');
    let ok = !rest.is_empty()
        && rest.len() <= 255
        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
        && rest
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    ok.then(|| format!("http://{rest}"))
}

/// One object's frame header in an object stream: `<pool> <hex> <size>\n`.
pub fn frame_header(r: &Ref) -> String {
    format!("{} {} {}\n", r.pool.as_str(), r.hex(), r.size)
}

/// Parses a frame header (without its newline) into the ref it announces. The mediaType is
/// not part of an object's identity on disk (pool and digest are); records are recognised
/// by the closure check when the head is committed, not here.
pub fn parse_frame(line: &str) -> Result<Ref, ProtocolError> {
    let mut parts = line.split(' ');
    let (Some(pool), Some(hex), Some(size), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ProtocolError::BadFrame);
    };
    let pool = Pool::parse(pool).ok_or(ProtocolError::BadFrame)?;
    let size: u64 = size
        .parse()
        .ok()
        .filter(|n| *n <= MAX_OBJECT && size.bytes().all(|b| b.is_ascii_digit()))
        .ok_or(ProtocolError::BadFrame)?;
    if !is_hex64(hex) {
        return Err(ProtocolError::BadFrame);
    }
    Ok(Ref::new(pool, hex, size, crate::versioning::OCTET_STREAM))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HEX: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn record() -> Value {
        json!({"pool": "agent-state", "digest": format!("sha256:{HEX}"), "size": 0,
               "mediaType": "application/vnd.sciencediscovery.record.v1+json"})
    }

    #[test]
    fn node_urls() {
        let cases = [
            ("http://127.0.0.1:4311", Some("http://127.0.0.1:4311")),
            (" http://node-2.example:80/ ", Some("http://node-2.example:80")),
            ("http://[::1]:4311", Some("http://[::1]:4311")),
            ("https://a:1", None),
            ("http://a", None),
            ("http://a:0", None),
            ("http://a:1/path", None),
            ("http://user@a:1", None),
            ("http://:1", None),
            ("127.0.0.1:4311", None),
        ];
        for (text, want) in cases {
            assert_eq!(node_url(text).as_deref(), want, "{text}");
        }
    }

    #[test]
    fn frames_round_trip_and_refuse_junk() {
        let r = Ref::new(Pool::Data, HEX, 12, crate::versioning::OCTET_STREAM);
        let line = frame_header(&r);
        assert_eq!(parse_frame(line.trim_end()).unwrap(), r);
        assert!(line.len() <= MAX_HEADER);
        for bad in [
            "",
            "data",
            &format!("data {HEX}"),
            &format!("other {HEX} 1"),
            &format!("data {} 1", HEX.to_uppercase()),
            &format!("data {HEX} -1"),
            &format!("data {HEX} +1"),
            &format!("data {HEX} 1 extra"),
            &format!("data {HEX} 99999999999999999999"),
            "data ../../etc/passwd 1",
        ] {
            assert_eq!(parse_frame(bad), Err(ProtocolError::BadFrame), "{bad}");
        }
    }

    #[test]
    fn commit_requests() {
        let good = json!({"workspace": "p/s", "head": record(), "epoch": 3, "from": "http://a:1"});
        let parsed = commit_request(good.as_object().unwrap()).unwrap();
        assert_eq!((parsed.epoch, parsed.from.as_str()), (3, "http://a:1"));
        let mut data_head = record();
        data_head["pool"] = json!("data");
        let bad = [
            json!({"head": record(), "epoch": 1}),
            json!({"workspace": "p", "epoch": 1}),
            json!({"workspace": "p", "head": data_head, "epoch": 1}),
            json!({"workspace": "p", "head": record(), "epoch": 0}),
            json!({"workspace": "p", "head": record(), "epoch": -1}),
            json!({"workspace": "p", "head": record(), "epoch": u64::MAX}),
        ];
        for body in bad {
            assert!(commit_request(body.as_object().unwrap()).is_err(), "{body}");
        }
    }

    #[test]
    fn asked_lists_are_bounded() {
        let one = json!({"objects": [record()]});
        assert_eq!(asked(one.as_object().unwrap()).unwrap().len(), 1);
        let many = json!({"objects": vec![record(); MAX_ASKED + 1]});
        assert_eq!(asked(many.as_object().unwrap()), Err(ProtocolError::BadList));
        let junk = json!({"objects": [{"pool": "data"}]});
        assert_eq!(asked(junk.as_object().unwrap()), Err(ProtocolError::BadList));
    }

    #[test]
    fn restore_and_push_requests() {
        let r = json!({"workspace": "k", "version": format!("sha256:{HEX}"), "fromStore": true});
        let parsed = restore_request(r.as_object().unwrap()).unwrap();
        assert!(parsed.from_store && parsed.version.is_some());
        let bad = json!({"workspace": "k", "version": "latest"});
        assert_eq!(restore_request(bad.as_object().unwrap()), Err(ProtocolError::BadVersion));
        let p = json!({"project": "a/b", "to": "http://10.0.0.2:4311/"});
        assert_eq!(push_request(p.as_object().unwrap()).unwrap().to, "http://10.0.0.2:4311");
        let p = json!({"workspace": "k", "to": "file:///etc"});
        assert_eq!(push_request(p.as_object().unwrap()), Err(ProtocolError::BadUrl("to")));
    }
}
