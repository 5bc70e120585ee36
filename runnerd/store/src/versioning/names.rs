//! Small encodings the store's names are made of: base64url entry names, UUID v4 temp and
//! export names, SHA-256 hex digests and the per-workspace head ref name.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use super::VersionError;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// RFC 4648 §5 base64url without `=` padding, as tree entry names and symlink targets are stored.
pub fn b64url_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// Strict inverse of [`b64url_encode`]: no padding, no foreign characters, and unused trailing
/// bits must be zero, so every byte string has exactly one accepted spelling.
pub fn b64url_decode(text: &str) -> Result<Vec<u8>, VersionError> {
    let bad = || VersionError::Base64(text.to_string());
    if text.len() % 4 == 1 {
        return Err(bad());
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.as_bytes().chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            let v = ALPHABET.iter().position(|a| a == c).ok_or_else(bad)? as u32;
            n |= v << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        let keep = chunk.len() - 1;
        if bytes[keep..].iter().any(|b| *b != 0) {
            return Err(bad());
        }
        out.extend_from_slice(&bytes[..keep]);
    }
    Ok(out)
}

/// A random (version 4) UUID, lowercase, 36 characters.
pub fn new_uuid_v4() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        b = fallback_random();
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// Uniqueness without the OS random source (which practically never fails): these names only
/// need to be distinct, so time, pid and a process-wide counter hashed together suffice.
fn fallback_random() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seed =
        format!("{}:{}:{}", nanos.as_nanos(), std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    let digest = Sha256::digest(seed.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    b
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// `workspaces/<hex(sha256(root))>/head`. The hash input is the UTF-8 of the canonical root
/// string; like Node, non-UTF-8 bytes become U+FFFD (avoid such roots).
pub fn workspace_head_name(canonical_root: &Path) -> String {
    let text = canonical_root.as_os_str().to_string_lossy();
    format!("workspaces/{}/head", sha256_hex(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_table() {
        let cases: &[(&[u8], &str)] = &[
            (b"", ""),
            (b"README.md", "UkVBRE1FLm1k"),
            (b"data", "ZGF0YQ"),
            (b"empty", "ZW1wdHk"),
            (b"link", "bGluaw"),
            (b"run.sh", "cnVuLnNo"),
            (b"x.csv", "eC5jc3Y"),
            (b"\xff", "_w"),
            (b"\xfb\xff\xbf", "-_-_"),
            (b"f", "Zg"),
            (b"fo", "Zm8"),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg"),
        ];
        for (bytes, text) in cases {
            assert_eq!(b64url_encode(bytes), *text);
            assert_eq!(b64url_decode(text).unwrap(), *bytes, "{text}");
        }
    }

    #[test]
    fn base64url_rejects_non_canonical_text() {
        for text in ["Z", "Zg==", "Zh", "Z+8", "Zm9/", "Zm 9"] {
            assert!(b64url_decode(text).is_err(), "{text}");
        }
    }

    #[test]
    fn base64url_round_trips_every_byte() {
        let all: Vec<u8> = (0..=255u8).collect();
        for len in 0..all.len() {
            assert_eq!(b64url_decode(&b64url_encode(&all[..len])).unwrap(), &all[..len]);
        }
    }

    #[test]
    fn uuid_shape() {
        let a = new_uuid_v4();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"));
        assert!(a.chars().all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)));
        assert_ne!(a, new_uuid_v4());
    }

    #[test]
    fn digests_and_head_name() {
        assert_eq!(sha256_hex(b""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(
            sha256_hex(b"hello\n"),
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        assert_eq!(
            workspace_head_name(Path::new("/srv/sd-data/remote-workspaces/project-1/session-1")),
            "workspaces/a4a7686a94446f5d656e37e92ba1dcf4b0b00a48a1e588d6d5554ea53c5ea9f4/head"
        );
    }
}
