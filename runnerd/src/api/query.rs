//! Query strings read the way `URLSearchParams` reads them: `&`-separated pairs, the first
//! `=` splits name from value, `+` is a space, percent escapes decoded (a bad escape is kept
//! as written), and `get` answers the first occurrence.

/// The first value of `name`, decoded.
pub fn get(query: Option<&str>, name: &str) -> Option<String> {
    let query = query?;
    query.split('&').filter(|p| !p.is_empty()).find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

/// `application/x-www-form-urlencoded` decoding of one component.
pub fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `encodeURIComponent`: everything but `A-Z a-z 0-9 - _ . ! ~ * ' ( )` percent-encoded.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let odd = "a b/c:d&e=f%é";
        assert_eq!(encode(odd), "a%20b%2Fc%3Ad%26e%3Df%25%C3%A9");
        assert_eq!(get(Some(&format!("k={}", encode(odd))), "k").as_deref(), Some(odd));
    }
}
