//! Request authentication exactly as the original (contract §1.3, §1.4), plus our replay
//! cache (api.md improvement 2). Pure functions of the request's headers, body and the
//! clock, so every rule is table-tested.

use std::collections::HashMap;
use std::sync::Mutex;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::config::MAX_SAFE_INTEGER;

/// Constant-time equality (the length is not secret).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `Authorization: Bearer <token>`: the prefix exactly, one space, the token byte for byte.
pub fn bearer_ok(header: Option<&[u8]>, token: &str) -> bool {
    match header.and_then(|h| h.strip_prefix(b"Bearer ")) {
        Some(presented) => constant_time_eq(presented, token.as_bytes()),
        None => false,
    }
}

/// More than one `Authorization` header arrived (how many).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0} Authorization headers; exactly one is accepted")]
pub struct DuplicateAuthorization(pub usize);

/// The one `Authorization` header of a request, if any. Ours (issue #15): two are refused,
/// where the original's Node server kept the first. A proxy or client that appends a second
/// token must not have either one silently chosen.
pub fn single_authorization<'a>(presented: &[&'a [u8]]) -> Result<Option<&'a [u8]>, DuplicateAuthorization> {
    match presented {
        [] => Ok(None),
        [one] => Ok(Some(one)),
        many => Err(DuplicateAuthorization(many.len())),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// `hex(HMAC-SHA256(token, "<timestamp>\n<hex sha256(body)>"))`, as the original client signs.
pub fn sign(token: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).expect("HMAC takes keys of any length");
    mac.update(timestamp.as_bytes());
    mac.update(b"\n");
    mac.update(sha256_hex(body).as_bytes());
    hex(&mac.finalize().into_bytes())
}

/// Why a signature was refused. All but `Replayed` answer the original's 401 text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    Missing,
    BadTimestamp,
    BadFormat,
    OutsideWindow,
    Mismatch,
    Replayed,
}

impl SignatureError {
    /// A stable reason for the audit log.
    pub fn reason(self) -> &'static str {
        match self {
            SignatureError::Missing => "signature headers missing",
            SignatureError::BadTimestamp => "timestamp is not a safe integer of milliseconds",
            SignatureError::BadFormat => "signature is not 64 lowercase hex characters",
            SignatureError::OutsideWindow => "timestamp outside the freshness window",
            SignatureError::Mismatch => "signature does not match",
            SignatureError::Replayed => "signature already used",
        }
    }
}

/// Checks the two signature headers against `body` at `now_ms`.
pub fn verify(
    token: &str,
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now_ms: u64,
    max_age_ms: u64,
) -> Result<(), SignatureError> {
    let (Some(timestamp), Some(signature)) = (timestamp, signature) else {
        return Err(SignatureError::Missing);
    };
    if timestamp.is_empty() || !timestamp.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SignatureError::BadTimestamp);
    }
    let ts = timestamp
        .parse::<u64>()
        .ok()
        .filter(|t| *t <= MAX_SAFE_INTEGER)
        .ok_or(SignatureError::BadTimestamp)?;
    if signature.len() != 64 || !signature.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(SignatureError::BadFormat);
    }
    if now_ms.abs_diff(ts) > max_age_ms {
        return Err(SignatureError::OutsideWindow);
    }
    let expected = sign(token, timestamp, body);
    if !constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
        return Err(SignatureError::Mismatch);
    }
    Ok(())
}

/// Who may call: the bearer token every route but `/health` needs, and the replay cache of
/// the signed routes. The HTTP layer's alone (the engine never sees a credential).
#[derive(Debug)]
pub struct Gate {
    pub token: crate::token::Token,
    pub replays: ReplayCache,
}

impl Gate {
    pub fn new(token: crate::token::Token) -> Gate {
        Gate { token, replays: ReplayCache::default() }
    }
}

/// Signatures accepted within the window: the same one again is a replay. Entries expire
/// when their timestamp leaves the window (after that the window check refuses them).
#[derive(Debug, Default)]
pub struct ReplayCache {
    seen: Mutex<HashMap<String, u64>>,
}

/// Above this many live entries, expired ones are swept on insert.
const SWEEP_ABOVE: usize = 4096;

impl ReplayCache {
    /// Records `signature` (valid until `expires_ms`); `false` if it was already recorded.
    pub fn first_use(&self, signature: &str, now_ms: u64, expires_ms: u64) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > SWEEP_ABOVE {
            seen.retain(|_, exp| *exp >= now_ms);
        }
        match seen.get(signature) {
            Some(exp) if *exp >= now_ms => false,
            _ => {
                seen.insert(signature.to_owned(), expires_ms);
                true
            }
        }
    }

    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "runner-test-token";
    const NOW: u64 = 1_800_000_000_000;

    #[test]
    fn bearer_table() {
        let cases: &[(Option<&[u8]>, bool)] = &[
            (Some(b"Bearer runner-test-token"), true),
            (Some(b"bearer runner-test-token"), false),
            (Some(b"Bearer  runner-test-token"), false),
            (Some(b"Bearer runner-test-token "), false),
            (Some(b"Bearer runner-test-toke"), false),
            (Some(b"Basic runner-test-token"), false),
            (Some(b"runner-test-token"), false),
            (Some(b""), false),
            (None, false),
        ];
        for (header, ok) in cases {
            assert_eq!(bearer_ok(*header, TOKEN), *ok, "{:?}", header.map(String::from_utf8_lossy));
        }
    }

    #[test]
    fn authorization_header_count_table() {
        let good: &[u8] = b"Bearer runner-test-token";
        let other: &[u8] = b"Bearer x";
        type Case<'a> = (&'a [&'a [u8]], Result<Option<&'a [u8]>, DuplicateAuthorization>);
        let cases: &[Case] = &[
            (&[], Ok(None)),
            (&[good], Ok(Some(good))),
            (&[good, other], Err(DuplicateAuthorization(2))),
            (&[other, good], Err(DuplicateAuthorization(2))),
            (&[good, good], Err(DuplicateAuthorization(2))),
            (&[good, other, good], Err(DuplicateAuthorization(3))),
        ];
        for (presented, expected) in cases {
            assert_eq!(single_authorization(presented), *expected, "{} headers", presented.len());
        }
    }

    #[test]
    fn known_vector() {
        // sha256("{}") and the HMAC over "<ts>\n<hash>", computed independently.
        assert_eq!(sha256_hex(b"{}"), "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a");
        let sig = sign("k", "1", b"{}");
        assert_eq!(sig.len(), 64);
        assert_eq!(sig, sign("k", "1", b"{}"));
        assert_ne!(sig, sign("k", "2", b"{}"));
        assert_ne!(sig, sign("k2", "1", b"{}"));
    }

    #[test]
    fn signature_table() {
        let body = br#"{"code":"true"}"#;
        let ts = NOW.to_string();
        let good = sign(TOKEN, &ts, body);
        let old = (NOW - 31_000).to_string();
        let future = (NOW + 31_000).to_string();
        let edge = (NOW - 29_000).to_string();
        let edge_future = (NOW + 29_000).to_string();
        type Case<'a> = (Option<String>, Option<String>, &'a [u8], Result<(), SignatureError>);
        let cases: Vec<Case> = vec![
            (Some(ts.clone()), Some(good.clone()), body, Ok(())),
            (Some(edge.clone()), Some(sign(TOKEN, &edge, body)), body, Ok(())),
            (Some(edge_future.clone()), Some(sign(TOKEN, &edge_future, body)), body, Ok(())),
            (Some(old.clone()), Some(sign(TOKEN, &old, body)), body, Err(SignatureError::OutsideWindow)),
            (
                Some(future.clone()),
                Some(sign(TOKEN, &future, body)),
                body,
                Err(SignatureError::OutsideWindow),
            ),
            (None, Some(good.clone()), body, Err(SignatureError::Missing)),
            (Some(ts.clone()), None, body, Err(SignatureError::Missing)),
            (
                Some(format!("{}", NOW / 1000)),
                Some(sign(TOKEN, &format!("{}", NOW / 1000), body)),
                body,
                Err(SignatureError::OutsideWindow),
            ),
            (Some("12a".into()), Some(good.clone()), body, Err(SignatureError::BadTimestamp)),
            (Some("-1".into()), Some(good.clone()), body, Err(SignatureError::BadTimestamp)),
            (Some("".into()), Some(good.clone()), body, Err(SignatureError::BadTimestamp)),
            (
                Some("99999999999999999999".into()),
                Some(good.clone()),
                body,
                Err(SignatureError::BadTimestamp),
            ),
            (Some(ts.clone()), Some(good.to_uppercase()), body, Err(SignatureError::BadFormat)),
            (Some(ts.clone()), Some(good[..63].to_owned()), body, Err(SignatureError::BadFormat)),
            (Some(ts.clone()), Some(format!("{good}0")), body, Err(SignatureError::BadFormat)),
            (Some(ts.clone()), Some(good.clone()), br#"{"code":"false"}"#, Err(SignatureError::Mismatch)),
            (Some(ts.clone()), Some(sign("other-token", &ts, body)), body, Err(SignatureError::Mismatch)),
        ];
        for (i, (t, s, b, expected)) in cases.into_iter().enumerate() {
            assert_eq!(verify(TOKEN, t.as_deref(), s.as_deref(), b, NOW, 30_000), expected, "case {i}");
        }
    }

    #[test]
    fn replays_are_refused_until_the_window_passes() {
        let cache = ReplayCache::default();
        assert!(cache.first_use("sig-a", NOW, NOW + 30_000));
        assert!(!cache.first_use("sig-a", NOW + 1, NOW + 30_000));
        assert!(cache.first_use("sig-b", NOW + 1, NOW + 30_001));
        // After expiry the window check refuses the signature anyway; the cache forgets it.
        assert!(cache.first_use("sig-a", NOW + 30_001, NOW + 60_001));
    }

    #[test]
    fn the_cache_sweeps_expired_entries() {
        let cache = ReplayCache::default();
        for i in 0..(SWEEP_ABOVE + 10) {
            cache.first_use(&format!("s{i}"), NOW, NOW + 1);
        }
        cache.first_use("late", NOW + 10, NOW + 100);
        assert_eq!(cache.len(), 1);
    }
}
