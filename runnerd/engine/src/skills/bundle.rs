//! The pure half of skill packages (contract §5.2): a `SkillPackageBundle` (or the manifest
//! kept next to a published package) checked field by field, its ids and hashes computed
//! exactly as the original does, and the path policy. No I/O here.
//!
//! * A package's `hash` is sha256 over `"<len(path)>:<path>:<size>:" + bytes` for each of
//!   its files, sorted by path. `len` and the sort are JavaScript's (UTF-16 code units), so a
//!   non-ASCII path hashes as the original's does.
//! * The bundle `id` is sha256 of `JSON.stringify` of `[{hash,id,revision,version}]`
//!   sorted by skill id.

use std::collections::BTreeSet;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::versioning::names::hex;

/// The file every skill must carry at its top.
pub const SKILL_MD: &str = "SKILL.md";
/// Ours: the most files, and the longest path, a bundle may name (the original has neither;
/// the 64 MiB body bounds both in practice).
pub const MAX_FILES: usize = 10_000;
pub const MAX_PATH_BYTES: usize = 1024;
/// Ours (issue #32): the most directories publishing a bundle may make (each skill's own and
/// every directory its files' paths name), and the most names in a file's path. Checked on
/// the bundle, before anything is written: paths alone let a 35 KiB bundle make 16,041
/// directories, a 12 MB one millions. Manifests of packages already published are not held
/// to them (they stay readable and deletable).
pub const MAX_DIRECTORIES: usize = 1_000;
pub const MAX_DEPTH: usize = 16;
const TOO_DEEP: &str = "the path has more than 16 names (a bundle's limit): flatten the skill's directories";
const MAX_SEGMENT_BYTES: usize = 255;

/// Why a bundle or a manifest is refused. The words `metadata`, `path` and `integrity` are
/// the ones the original's messages carry (contract §7 item 41).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BundleError {
    #[error("Invalid skill package metadata: {0}")]
    Metadata(String),
    #[error("Invalid skill package path {path:?} in skill {skill:?}: {why}")]
    Path { skill: String, path: String, why: &'static str },
    #[error("Skill package integrity check failed: {0}")]
    Integrity(String),
    #[error("Skill {0:?} has no SKILL.md")]
    MissingSkillMd(String),
}

/// One file of a skill; `content` is `None` for a manifest (the bytes are on disk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillFile {
    pub path: String,
    pub size: u64,
    pub hash: String,
    pub content: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skill {
    pub id: String,
    pub revision: u64,
    pub version: String,
    pub hash: String,
    /// Sorted by path (JavaScript order).
    pub files: Vec<SkillFile>,
}

/// A checked bundle: skills sorted by id, unique, each with its `SKILL.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub skills: Vec<Skill>,
}

/// Whether the bundle carries its bytes (a POST) or names them only (the manifest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    Inline,
    OnDisk,
}

fn meta(m: impl Into<String>) -> BundleError {
    BundleError::Metadata(m.into())
}

/// `^[a-z0-9]+(-[a-z0-9]+)*$`.
pub fn valid_skill_id(id: &str) -> bool {
    !id.is_empty()
        && id.split('-').all(|part| {
            !part.is_empty() && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        })
}

/// 64 lowercase hex digits (a package id or a sha256).
pub fn is_hex64(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The path policy: relative, `/`-separated, no empty, `.` or `..` segment, no `\` and no
/// NUL. Returns the segments.
pub fn path_segments(path: &str) -> Result<Vec<&str>, &'static str> {
    if path.is_empty() {
        return Err("the path is empty");
    }
    if path.len() > MAX_PATH_BYTES {
        return Err("the path is too long");
    }
    if path.contains('\0') {
        return Err("the path contains NUL");
    }
    if path.contains('\\') {
        return Err("the path contains a backslash");
    }
    if path.starts_with('/') {
        return Err("the path is absolute");
    }
    let segments: Vec<&str> = path.split('/').collect();
    for s in &segments {
        match *s {
            "" => return Err("the path has an empty segment"),
            "." | ".." => return Err("the path has a . or .. segment"),
            s if s.len() > MAX_SEGMENT_BYTES => return Err("a path segment is too long"),
            _ => {}
        }
    }
    Ok(segments)
}

/// JavaScript's default string order (UTF-16 code units).
fn js_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// The package hash of `(path, bytes)` pairs (any order).
pub fn package_hash<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> String {
    let mut files: Vec<(&str, &[u8])> = files.into_iter().collect();
    files.sort_by(|a, b| js_cmp(a.0, b.0));
    let mut h = Sha256::new();
    for (path, bytes) in files {
        h.update(frame(path, bytes.len() as u64).as_bytes());
        h.update(bytes);
    }
    hex(&h.finalize())
}

/// What precedes a file's bytes in the package hash: `"<len(path)>:<path>:<size>:"`.
pub fn frame(path: &str, size: u64) -> String {
    format!("{}:{}:{}:", path.encode_utf16().count(), path, size)
}

/// The bundle id of its skills (any order).
pub fn bundle_id(skills: &[Skill]) -> String {
    let mut refs: Vec<&Skill> = skills.iter().collect();
    refs.sort_by(|a, b| js_cmp(&a.id, &b.id));
    // serde_json's maps are sorted, and `hash,id,revision,version` is also the original's
    // insertion order; JSON.stringify and serde_json escape strings alike.
    let list: Vec<Value> = refs
        .iter()
        .map(|s| json!({"hash": s.hash, "id": s.id, "revision": s.revision, "version": s.version}))
        .collect();
    hex(&Sha256::digest(Value::Array(list).to_string().as_bytes()))
}

/// Checks a bundle (or a manifest) and, for [`Content::Inline`], decodes and verifies every
/// file's bytes against its size and hash and each skill's bytes against its package hash.
pub fn parse(value: &Value, content: Content) -> Result<Bundle, BundleError> {
    let skills =
        value.get("skills").and_then(Value::as_array).ok_or_else(|| meta("skills must be an array"))?;
    if skills.is_empty() {
        return Err(meta("skills must not be empty"));
    }
    let mut out: Vec<Skill> = Vec::with_capacity(skills.len());
    let mut total_files = 0usize;
    for s in skills {
        let skill = parse_skill(s, content)?;
        total_files += skill.files.len();
        if total_files > MAX_FILES {
            return Err(meta(format!("a bundle may hold at most {MAX_FILES} files")));
        }
        out.push(skill);
    }
    if content == Content::Inline && directories(&out, MAX_DIRECTORIES) > MAX_DIRECTORIES {
        return Err(meta(format!(
            "a bundle may make at most {MAX_DIRECTORIES} directories (one per skill and one per directory its files' paths name), this one more: flatten the skills' directories or publish them as several packages"
        )));
    }
    out.sort_by(|a, b| js_cmp(&a.id, &b.id));
    if let Some(w) = out.windows(2).find(|w| w[0].id == w[1].id) {
        return Err(meta(format!("duplicate skill id {:?}", w[0].id)));
    }
    Ok(Bundle { skills: out })
}

fn parse_skill(s: &Value, content: Content) -> Result<Skill, BundleError> {
    let id = s.get("id").and_then(Value::as_str).ok_or_else(|| meta("a skill id must be a string"))?;
    if !valid_skill_id(id) {
        return Err(meta(format!("skill id {id:?} must match ^[a-z0-9]+(-[a-z0-9]+)*$")));
    }
    let revision = s
        .get("revision")
        .and_then(Value::as_u64)
        .filter(|r| *r >= 1)
        .ok_or_else(|| meta(format!("skill {id:?}: revision must be an integer of at least 1")))?;
    let version = s
        .get("version")
        .and_then(Value::as_str)
        .ok_or_else(|| meta(format!("skill {id:?}: version must be a string")))?;
    let hash = s
        .get("hash")
        .and_then(Value::as_str)
        .filter(|h| is_hex64(h))
        .ok_or_else(|| meta(format!("skill {id:?}: hash must be 64 lowercase hex digits")))?;
    let files = s
        .get("files")
        .and_then(Value::as_array)
        .ok_or_else(|| meta(format!("skill {id:?}: files must be an array")))?;
    let mut parsed = Vec::with_capacity(files.len());
    for f in files {
        parsed.push(parse_file(id, f, content)?);
    }
    parsed.sort_by(|a, b| js_cmp(&a.path, &b.path));
    check_tree(id, &parsed)?;
    if !parsed.iter().any(|f| f.path == SKILL_MD) {
        return Err(BundleError::MissingSkillMd(id.to_owned()));
    }
    if content == Content::Inline {
        let computed =
            package_hash(parsed.iter().map(|f| (f.path.as_str(), f.content.as_deref().unwrap_or_default())));
        if computed != hash {
            return Err(BundleError::Integrity(format!(
                "skill {id:?}: the package hash does not match its files"
            )));
        }
    }
    Ok(Skill {
        id: id.to_owned(),
        revision,
        version: version.to_owned(),
        hash: hash.to_owned(),
        files: parsed,
    })
}

fn parse_file(skill: &str, f: &Value, content: Content) -> Result<SkillFile, BundleError> {
    let path = f
        .get("path")
        .and_then(Value::as_str)
        .ok_or_else(|| meta(format!("skill {skill:?}: a file path must be a string")))?;
    let segments = path_segments(path).map_err(|why| BundleError::Path {
        skill: skill.to_owned(),
        path: path.to_owned(),
        why,
    })?;
    if content == Content::Inline && segments.len() > MAX_DEPTH {
        return Err(BundleError::Path { skill: skill.to_owned(), path: path.to_owned(), why: TOO_DEEP });
    }
    let size = f
        .get("size")
        .and_then(Value::as_u64)
        .ok_or_else(|| meta(format!("skill {skill:?}: {path:?}: size must be a non-negative integer")))?;
    let hash =
        f.get("hash").and_then(Value::as_str).filter(|h| is_hex64(h)).ok_or_else(|| {
            meta(format!("skill {skill:?}: {path:?}: hash must be 64 lowercase hex digits"))
        })?;
    let bytes = match content {
        Content::OnDisk => None,
        Content::Inline => {
            let text = f
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| meta(format!("skill {skill:?}: {path:?}: content must be a base64 string")))?;
            let corrupt = || {
                BundleError::Integrity(format!("skill {skill:?}: {path:?}: the content is not valid base64"))
            };
            let bytes = base64_decode(text).ok_or_else(corrupt)?;
            // Only the canonical form (padded, no stray bits), as the original checks by
            // encoding again: two texts must never stand for the same bytes.
            if common::egress::route::base64(&bytes) != text {
                return Err(BundleError::Integrity(format!(
                    "skill {skill:?}: {path:?}: the content is not canonical base64"
                )));
            }
            if bytes.len() as u64 != size {
                return Err(BundleError::Integrity(format!(
                    "skill {skill:?}: {path:?}: the content is not {size} bytes"
                )));
            }
            if hex(&Sha256::digest(&bytes)) != hash {
                return Err(BundleError::Integrity(format!(
                    "skill {skill:?}: {path:?}: the content does not match its hash"
                )));
            }
            Some(bytes)
        }
    };
    Ok(SkillFile { path: path.to_owned(), size, hash: hash.to_owned(), content: bytes })
}

/// No path twice, and no file where another path needs a directory (`a` and `a/b`).
/// `files` is sorted.
fn check_tree(skill: &str, files: &[SkillFile]) -> Result<(), BundleError> {
    let paths: BTreeSet<&str> = files.iter().map(|f| f.path.as_str()).collect();
    if paths.len() != files.len() {
        let dup =
            files.windows(2).find(|w| w[0].path == w[1].path).map(|w| w[0].path.clone()).unwrap_or_default();
        return Err(BundleError::Path {
            skill: skill.to_owned(),
            path: dup,
            why: "the path is listed twice",
        });
    }
    for f in files {
        let mut prefix = String::new();
        for seg in f.path.split('/').collect::<Vec<_>>().iter().rev().skip(1).rev() {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(seg);
            if paths.contains(prefix.as_str()) {
                return Err(BundleError::Path {
                    skill: skill.to_owned(),
                    path: f.path.clone(),
                    why: "a file of the same skill is named like one of its directories",
                });
            }
        }
    }
    Ok(())
}

/// How many directories publishing `skills` makes: one per skill, and one per distinct
/// directory its files' paths name (`a/b/f` names `a` and `a/b`). Counting stops once past
/// `limit`, so a hostile bundle costs no more than the limit to count.
pub fn directories(skills: &[Skill], limit: usize) -> usize {
    let mut total = 0;
    for skill in skills {
        total += 1;
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        for f in &skill.files {
            let mut end = 0;
            while let Some(slash) = f.path[end..].find('/') {
                end += slash;
                if seen.insert(&f.path[..end]) {
                    total += 1;
                }
                if total > limit {
                    return total;
                }
                end += 1;
            }
        }
    }
    total
}

/// The manifest kept with a published package: the bundle without its bytes.
pub fn manifest(bundle: &Bundle) -> Value {
    let skills: Vec<Value> = bundle
        .skills
        .iter()
        .map(|s| {
            let files: Vec<Value> =
                s.files.iter().map(|f| json!({"path": f.path, "size": f.size, "hash": f.hash})).collect();
            json!({"id": s.id, "revision": s.revision, "version": s.version, "hash": s.hash, "files": files})
        })
        .collect();
    json!({"skills": skills})
}

/// A skill read from local files: its id and its `(path, bytes)`.
pub type LocalSkill = (String, Vec<(String, Vec<u8>)>);

/// A `SkillPackageBundle` for `(skill id, [(path, bytes)])` pairs, every skill at
/// `revision` / `version` (what `runnerctl skills push` sends).
pub fn bundle_of(skills: &[LocalSkill], revision: u64, version: &str) -> Value {
    let skills: Vec<Value> = skills
        .iter()
        .map(|(id, files)| {
            let hash = package_hash(files.iter().map(|(p, b)| (p.as_str(), b.as_slice())));
            let files: Vec<Value> = files
                .iter()
                .map(|(p, b)| {
                    json!({"path": p, "size": b.len(), "hash": hex(&Sha256::digest(b)), "content": common::egress::route::base64(b)})
                })
                .collect();
            json!({"id": id, "revision": revision, "version": version, "hash": hash, "files": files})
        })
        .collect();
    json!({"skills": skills})
}

/// Standard base64 (RFC 4648 §4), padding optional; `None` on any other character.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let body = text.trim_end_matches('=');
    if text.len() - body.len() > 2 || body.len() % 4 == 1 {
        return None;
    }
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.as_bytes().chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::egress::route::base64;

    fn file(path: &str, bytes: &[u8]) -> Value {
        json!({"path": path, "size": bytes.len(), "hash": hex(&Sha256::digest(bytes)), "content": base64(bytes)})
    }

    fn skill(id: &str, files: &[(&str, &[u8])]) -> Value {
        json!({
            "id": id, "revision": 1, "version": "1.0",
            "hash": package_hash(files.iter().map(|(p, b)| (*p, *b))),
            "files": files.iter().map(|(p, b)| file(p, b)).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn package_hash_is_the_originals_framing() {
        let mut h = Sha256::new();
        h.update(b"8:SKILL.md:2:hi");
        h.update(b"5:b/c.t:0:");
        // Sorted by path: "SKILL.md" < "b/c.t".
        assert_eq!(package_hash([("b/c.t", &b""[..]), ("SKILL.md", &b"hi"[..])]), hex(&h.finalize()));
        // len counts UTF-16 units: "é" is one, not two bytes.
        let mut h = Sha256::new();
        h.update("1:é:1:x".as_bytes());
        assert_eq!(package_hash([("é", &b"x"[..])]), hex(&h.finalize()));
    }

    #[test]
    fn bundle_id_is_sha256_of_the_sorted_json() {
        let b = parse(
            &json!({"skills": [skill("zeta", &[("SKILL.md", b"z")]), skill("alpha", &[("SKILL.md", b"a")])]}),
            Content::Inline,
        )
        .unwrap();
        let text = format!(
            r#"[{{"hash":"{}","id":"alpha","revision":1,"version":"1.0"}},{{"hash":"{}","id":"zeta","revision":1,"version":"1.0"}}]"#,
            package_hash([("SKILL.md", &b"a"[..])]),
            package_hash([("SKILL.md", &b"z"[..])])
        );
        assert_eq!(bundle_id(&b.skills), hex(&Sha256::digest(text.as_bytes())));
        assert_eq!(b.skills[0].id, "alpha");
    }

    #[test]
    fn path_table() {
        for ok in ["SKILL.md", "scripts/run.sh", "a/b/c", ".hidden", "a..b"] {
            assert!(path_segments(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "../escape", "/absolute", "a//b", "a/./b", "a\\b", "a\0b", "a/", "a/..", "."] {
            assert!(path_segments(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn skill_id_table() {
        for ok in ["a", "abc-123", "x1-y2-z3"] {
            assert!(valid_skill_id(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "a--b", "A", "a_b", "a.b", "é"] {
            assert!(!valid_skill_id(bad), "{bad}");
        }
    }

    #[test]
    fn refusals_name_their_kind() {
        let good = skill("demo", &[("SKILL.md", b"# demo"), ("run.sh", b"exit 7")]);
        let with = |f: &dyn Fn(&mut Value)| {
            let mut s = good.clone();
            f(&mut s);
            parse(&json!({"skills": [s]}), Content::Inline).unwrap_err().to_string()
        };
        assert!(parse(&json!({"skills": [good.clone()]}), Content::Inline).is_ok());
        assert!(with(&|s| s["hash"] = json!("0".repeat(64))).contains("integrity"));
        assert!(with(&|s| s["files"][1]["content"] = json!(base64(b"exit 8"))).contains("integrity"));
        assert!(with(&|s| s["files"][1]["content"] = json!("!!!")).contains("integrity"));
        // Non-canonical encodings of the right bytes (hash and size still match): unpadded,
        // and with stray low bits.
        let padded = skill("demo", &[("SKILL.md", b"# demo"), ("run.sh", b"exit 77")]);
        let canonical = padded["files"][1]["content"].as_str().unwrap().to_owned();
        assert!(canonical.ends_with('='), "{canonical}");
        assert!(parse(&json!({"skills": [padded.clone()]}), Content::Inline).is_ok());
        let unpadded = canonical.trim_end_matches('=').to_owned();
        let mut stray = canonical.clone().into_bytes();
        let last = stray.iter().rposition(|b| *b != b'=').unwrap();
        stray[last] += 1;
        let stray = String::from_utf8(stray).unwrap();
        for text in [unpadded, stray] {
            assert_eq!(
                base64_decode(&text).as_deref(),
                Some(&b"exit 77"[..]),
                "{text} decodes to the same bytes"
            );
            let mut s = padded.clone();
            s["files"][1]["content"] = json!(text);
            let e = parse(&json!({"skills": [s]}), Content::Inline).unwrap_err().to_string();
            assert!(e.contains("integrity") && e.contains("canonical"), "{e}");
        }
        assert!(with(&|s| s["files"][1]["size"] = json!(99)).contains("integrity"));
        assert!(with(&|s| s["files"][1]["path"] = json!("../escape")).contains("path"));
        assert!(with(&|s| s["files"][1]["path"] = json!("SKILL.md")).contains("path"));
        assert!(with(&|s| s["revision"] = json!(0)).contains("metadata"));
        assert!(with(&|s| s["id"] = json!("Bad")).contains("metadata"));
        assert!(with(&|s| s["files"][0]["path"] = json!("README.md")).contains("SKILL.md"));
        let dup = parse(&json!({"skills": [good.clone(), good.clone()]}), Content::Inline).unwrap_err();
        assert!(dup.to_string().contains("metadata"), "{dup}");
        let nested = skill("n", &[("SKILL.md", b"x"), ("a", b"1"), ("a/b", b"2")]);
        assert!(
            parse(&json!({"skills": [nested]}), Content::Inline).unwrap_err().to_string().contains("path")
        );
    }

    fn parsed(files: &[&str]) -> Skill {
        let files = files
            .iter()
            .map(|p| SkillFile { path: (*p).to_owned(), size: 0, hash: String::new(), content: None })
            .collect();
        Skill { id: "s".into(), revision: 1, version: "1".into(), hash: String::new(), files }
    }

    #[test]
    fn directory_table() {
        let cases: &[(&[&[&str]], usize)] = &[
            (&[&["SKILL.md"]], 1),
            (&[&["SKILL.md", "a/x", "a/y", "a/b/z"]], 3),
            (&[&["SKILL.md", "a/b/c/d/e"]], 5),
            (&[&["SKILL.md", "ab/x", "a/x", "a/b/x"]], 4),
            // Two skills: each its own directory, and `a` in each.
            (&[&["SKILL.md", "a/x"], &["SKILL.md", "a/y"]], 4),
        ];
        for (skills, want) in cases {
            let skills: Vec<Skill> = skills.iter().map(|f| parsed(f)).collect();
            assert_eq!(directories(&skills, usize::MAX), *want, "{skills:?}");
        }
        // Counting stops just past the limit.
        let wide: Vec<String> = (0..5000).map(|i| format!("d{i}/f")).collect();
        let wide: Vec<&str> = wide.iter().map(String::as_str).collect();
        assert_eq!(directories(&[parsed(&wide)], 10), 11);
    }

    #[test]
    fn deep_or_wide_bundles_are_refused_and_old_manifests_still_read() {
        let deep_path = vec!["d"; MAX_DEPTH + 1].join("/");
        let fits_path = vec!["d"; MAX_DEPTH].join("/");
        let ok = skill("demo", &[("SKILL.md", b"x"), (&fits_path, b"y")]);
        assert!(parse(&json!({"skills": [ok]}), Content::Inline).is_ok());
        let deep = skill("demo", &[("SKILL.md", b"x"), (&deep_path, b"y")]);
        let e = parse(&json!({"skills": [deep.clone()]}), Content::Inline).unwrap_err().to_string();
        assert!(e.contains("path") && e.contains(&MAX_DEPTH.to_string()), "{e}");
        // A package published before the limits: its manifest is still read.
        let mut manifest = deep.clone();
        for f in manifest["files"].as_array_mut().unwrap() {
            f.as_object_mut().unwrap().remove("content");
        }
        assert!(parse(&json!({"skills": [manifest]}), Content::OnDisk).is_ok());

        let names: Vec<String> = (0..MAX_DIRECTORIES).map(|i| format!("d{i}/f")).collect();
        let mut files: Vec<(&str, &[u8])> = vec![("SKILL.md", b"x")];
        files.extend(names.iter().map(|n| (n.as_str(), &b""[..])));
        // The skill's own directory and 1000 more: one too many.
        let wide = skill("wide", &files);
        let e = parse(&json!({"skills": [wide]}), Content::Inline).unwrap_err().to_string();
        assert!(e.contains("metadata") && e.contains("at most 1000 directories"), "{e}");
        let fits = skill("wide", &files[..files.len() - 1]);
        assert!(parse(&json!({"skills": [fits]}), Content::Inline).is_ok());
    }

    #[test]
    fn a_manifest_round_trips_without_bytes() {
        let b =
            parse(&json!({"skills": [skill("demo", &[("SKILL.md", b"# demo")])]}), Content::Inline).unwrap();
        let m = parse(&manifest(&b), Content::OnDisk).unwrap();
        assert_eq!(bundle_id(&m.skills), bundle_id(&b.skills));
        assert!(m.skills[0].files[0].content.is_none());
    }

    #[test]
    fn a_built_bundle_passes_its_own_checks() {
        let files =
            vec![("SKILL.md".to_owned(), b"# x".to_vec()), ("bin/run.sh".to_owned(), b"exit 7".to_vec())];
        let value = bundle_of(&[("x".to_owned(), files)], 1, "local");
        let b = parse(&value, Content::Inline).unwrap();
        assert_eq!(b.skills[0].files.len(), 2);
        assert_eq!(
            b.skills[0].hash,
            package_hash([("SKILL.md", &b"# x"[..]), ("bin/run.sh", &b"exit 7"[..])])
        );
    }

    #[test]
    fn base64_decodes_what_base64_encodes() {
        for data in [&b""[..], b"a", b"ab", b"abc", b"\xff\x00\x80abcd"] {
            assert_eq!(base64_decode(&base64(data)).as_deref(), Some(data));
        }
        assert_eq!(base64_decode("YWJj"), Some(b"abc".to_vec()));
        assert!(base64_decode("Y").is_none());
        assert!(base64_decode("YW=j").is_none());
    }
}
