//! The answers the gateway writes itself, in the original's shapes (internals §3.6): CONNECT
//! answers carry the reason in `X-Sandbox-Network` and no body; plain-HTTP answers carry it
//! as a `text/plain` body too.

/// The reason phrase of the statuses the gateway produces.
fn phrase(status: u16) -> &'static str {
    match status {
        200 => "Connection Established",
        400 => "Bad Request",
        403 => "Forbidden",
        429 => "Too Many Requests",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Error",
    }
}

/// A reason made safe for a header line: printable ASCII only, bounded.
pub fn header_safe(reason: &str) -> String {
    let mut out: String =
        reason.chars().map(|c| if (' '..='~').contains(&c) { c } else { '?' }).take(512).collect();
    if reason.chars().count() > 512 {
        out.push_str("...");
    }
    out
}

fn extra_headers(status: u16) -> &'static str {
    if status == 429 { "Retry-After: 1\r\n" } else { "" }
}

/// The answer to a CONNECT: `HTTP/1.1 200 Connection Established` with nothing else on
/// success, else status, `Content-Length: 0` and the reason header.
pub fn connect(status: u16, reason: Option<&str>) -> Vec<u8> {
    if status == 200 {
        return b"HTTP/1.1 200 Connection Established\r\n\r\n".to_vec();
    }
    let mut out =
        format!("HTTP/1.1 {status} {}\r\nContent-Length: 0\r\n{}", phrase(status), extra_headers(status));
    if let Some(reason) = reason {
        out.push_str(&format!("X-Sandbox-Network: {}\r\n", header_safe(reason)));
    }
    out.push_str("\r\n");
    out.into_bytes()
}

/// An answer to a plain request, with the reason as the body (newline-terminated).
pub fn plain(status: u16, reason: &str) -> Vec<u8> {
    let body = format!("{reason}\n");
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n{}X-Sandbox-Network: {}\r\nConnection: close\r\n\r\n{body}",
        phrase(status),
        body.len(),
        extra_headers(status),
        header_safe(reason),
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_answers_are_the_originals() {
        assert_eq!(connect(200, None), b"HTTP/1.1 200 Connection Established\r\n\r\n");
        assert_eq!(
            String::from_utf8(connect(
                403,
                Some("a.example:443 is not in the sandbox network allowed domains")
            ))
            .unwrap(),
            "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nX-Sandbox-Network: a.example:443 is not in the sandbox network allowed domains\r\n\r\n"
        );
        assert!(String::from_utf8(connect(429, Some("x"))).unwrap().contains("Retry-After: 1\r\n"));
    }

    #[test]
    fn plain_answers_carry_the_reason_twice() {
        let text = String::from_utf8(plain(403, "no")).unwrap();
        assert!(text.starts_with(
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 3\r\n"
        ));
        assert!(text.ends_with("X-Sandbox-Network: no\r\nConnection: close\r\n\r\nno\n"));
    }

    #[test]
    fn reasons_cannot_split_headers() {
        assert_eq!(header_safe("a\r\nSet-Cookie: x"), "a??Set-Cookie: x");
        assert_eq!(header_safe("caf\u{e9}"), "caf?");
        assert!(header_safe(&"x".repeat(2000)).len() < 600);
    }
}
