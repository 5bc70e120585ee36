//! Query strings read the way `URLSearchParams` reads them: `&`-separated pairs, the first
//! `=` splits name from value, `+` is a space, percent escapes decoded (a bad escape is kept
//! as written), and `get` answers the first occurrence. [`get_strict`] is the same reading
//! with every bad escape refused, for values that name files (issue #15).

/// The first value of `name`, decoded.
pub fn get(query: Option<&str>, name: &str) -> Option<String> {
    let query = query?;
    query.split('&').filter(|p| !p.is_empty()).find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

/// Why a query value was refused by [`get_strict`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error("query parameter {name} has a `%` not followed by two hex digits")]
    BadEscape { name: String },
    #[error("query parameter {name} does not decode to UTF-8")]
    NotUtf8 { name: String },
}

/// The first value of `name`, decoded with no repair: a `%` that does not start two hex
/// digits, or bytes that are not UTF-8 (`%ff`, `%fe`, an overlong `%c0%af`, a lone
/// surrogate), refuse the value. `URLSearchParams` keeps the first as written and turns the
/// second into U+FFFD, so `path=%ff` and `path=%fe` would name one file; a correct client
/// (`encodeURIComponent`) never sends either.
pub fn get_strict(query: Option<&str>, name: &str) -> Result<Option<String>, QueryError> {
    let Some(query) = query else { return Ok(None) };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if decode(k) != name {
            continue;
        }
        let bytes = decode_bytes(v).ok_or_else(|| QueryError::BadEscape { name: name.to_owned() })?;
        return String::from_utf8(bytes).map(Some).map_err(|_| QueryError::NotUtf8 { name: name.to_owned() });
    }
    Ok(None)
}

/// The bytes of one component (`+` a space), or `None` at a malformed escape.
fn decode_bytes(s: &str) -> Option<Vec<u8>> {
    percent_bytes(s, true, true)
}

/// `application/x-www-form-urlencoded` decoding of one component.
pub fn decode(s: &str) -> String {
    let bytes = percent_bytes(s, true, false).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `decodeURIComponent` for path parameters: `+` stays, invalid sequences are kept as
/// written, and a result that is not UTF-8 leaves the text as it came.
pub fn decode_path(s: &str) -> String {
    let bytes = percent_bytes(s, false, false).unwrap_or_default();
    String::from_utf8(bytes).unwrap_or_else(|_| s.to_owned())
}

/// The one percent-decoder: `%XY` becomes its byte, `+` a space when `plus_is_space`. A
/// malformed escape is kept as written, or with `strict` makes the whole result `None`.
fn percent_bytes(s: &str, plus_is_space: bool, strict: bool) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus_is_space => out.push(b' '),
            b'%' => match (bytes.get(i + 1).and_then(|b| hex(*b)), bytes.get(i + 2).and_then(|b| hex(*b))) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                    continue;
                }
                _ if strict => return None,
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    Some(out)
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three readings of one decoder: path parameters, lenient and strict query values.
    #[test]
    fn one_decoder_three_readings() {
        for (text, path, lenient, strict) in [
            ("a+b%20c", "a+b c", "a b c", Some("a b c")),
            ("%E8%AE%AD", "训", "训", Some("训")),
            ("bad%zz", "bad%zz", "bad%zz", None),
            ("tail%4", "tail%4", "tail%4", None),
            ("%FF", "%FF", "\u{fffd}", Some("\u{fffd}")),
        ] {
            assert_eq!(decode_path(text), path, "{text}");
            assert_eq!(decode(text), lenient, "{text}");
            let strict_text = decode_bytes(text).map(|b| String::from_utf8_lossy(&b).into_owned());
            assert_eq!(strict_text.as_deref(), strict, "{text}");
        }
    }

    #[test]
    fn reads_like_urlsearchparams() {
        let q = Some("sessionId=s%201&agentId=subagent%3Aone&cursor=&x=a+b&sessionId=second&bad=%zz&tail=%4");
        assert_eq!(get(q, "sessionId").as_deref(), Some("s 1"));
        assert_eq!(get(q, "agentId").as_deref(), Some("subagent:one"));
        assert_eq!(get(q, "cursor").as_deref(), Some(""));
        assert_eq!(get(q, "x").as_deref(), Some("a b"));
        assert_eq!(get(q, "bad").as_deref(), Some("%zz"));
        assert_eq!(get(q, "tail").as_deref(), Some("%4"));
        assert_eq!(get(q, "missing"), None);
        assert_eq!(get(None, "x"), None);
        assert_eq!(get(Some("flag"), "flag").as_deref(), Some(""));
        // What `encodeURIComponent` (runnerctl's `client::encode`) makes of an odd value.
        let odd = "a b/c:d&e=f%é";
        assert_eq!(get(Some("k=a%20b%2Fc%3Ad%26e%3Df%25%C3%A9"), "k").as_deref(), Some(odd));
    }

    #[test]
    fn strict_reading_refuses_what_urlsearchparams_would_repair() {
        let bad = |name: &str| QueryError::BadEscape { name: name.into() };
        let not_utf8 = |name: &str| QueryError::NotUtf8 { name: name.into() };
        let cases: &[(&str, Result<Option<&str>, QueryError>)] = &[
            ("path=a%2Fb", Ok(Some("a/b"))),
            ("path=a+b", Ok(Some("a b"))),
            ("path=%E8%AE%AD", Ok(Some("训"))),
            ("path=", Ok(Some(""))),
            ("other=%ff", Ok(None)),
            ("path=ok&path=%ff", Ok(Some("ok"))),
            ("path=%ff", Err(not_utf8("path"))),
            ("path=%fe", Err(not_utf8("path"))),
            ("path=%FF%FE", Err(not_utf8("path"))),
            ("path=%c0%af", Err(not_utf8("path"))),
            ("path=%e0%80%af", Err(not_utf8("path"))),
            ("path=%ed%a0%80", Err(not_utf8("path"))),
            ("path=%E8%AE", Err(not_utf8("path"))),
            ("path=%zz", Err(bad("path"))),
            ("path=a%2", Err(bad("path"))),
            ("path=a%", Err(bad("path"))),
            ("path=%g0", Err(bad("path"))),
        ];
        for (q, expected) in cases {
            assert_eq!(
                get_strict(Some(q), "path").as_ref().map(|o| o.as_deref()),
                expected.as_ref().map(|o| *o),
                "{q}"
            );
        }
        assert_eq!(get_strict(None, "path"), Ok(None));
        // The lenient reading still answers as URLSearchParams does.
        assert_eq!(get(Some("path=%ff"), "path").as_deref(), Some("\u{fffd}"));
    }
}
