//! HTTP/1.1 message heads: reading them within a size and time bound, parsing them with
//! `httparse`, and the pure rules for what crosses the proxy (hop-by-hop headers, body
//! framing). Nothing here resolves or dials.

use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The most a request or response head may take (the original's handshake limit).
pub const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error("the client did not send a complete request head within {0:?}")]
    Timeout(Duration),
    #[error("the head exceeds {MAX_HEAD} bytes")]
    TooLarge,
    #[error("the head is not valid HTTP/1.1: {0}")]
    Malformed(String),
    #[error("the connection closed before a complete head")]
    Closed,
    #[error("reading the head failed")]
    Io(#[source] std::io::Error),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
    /// `1` for HTTP/1.1, `0` for HTTP/1.0.
    pub version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub reason: String,
    pub version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
}

fn owned_headers(headers: &[httparse::Header<'_>]) -> Vec<(String, Vec<u8>)> {
    headers.iter().map(|h| (h.name.to_owned(), h.value.to_vec())).collect()
}

/// Parses a request head at the start of `buf`: `Ok(None)` while incomplete, else the head
/// and its length (bytes after it are the body or pipelined data).
pub fn parse_request(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => Ok(Some((
            RequestHead {
                method: req.method.unwrap_or_default().to_owned(),
                target: req.path.unwrap_or_default().to_owned(),
                version: req.version.unwrap_or(1),
                headers: owned_headers(req.headers),
            },
            len,
        ))),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(HeadError::Malformed(e.to_string())),
    }
}

/// Like [`parse_request`], for a response.
pub fn parse_response(buf: &[u8]) -> Result<Option<(ResponseHead, usize)>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => Ok(Some((
            ResponseHead {
                status: resp.code.unwrap_or(0),
                reason: resp.reason.unwrap_or_default().to_owned(),
                version: resp.version.unwrap_or(1),
                headers: owned_headers(resp.headers),
            },
            len,
        ))),
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(HeadError::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(HeadError::Malformed(e.to_string())),
    }
}

/// Reads a head from a buffered reader, consuming exactly the head: whatever follows (a
/// body, pipelined bytes, tunnel data) stays in the reader, unread, until the caller decides.
pub async fn read_head<T>(
    r: &mut (impl AsyncBufRead + Unpin),
    parse: impl Fn(&[u8]) -> Result<Option<(T, usize)>, HeadError>,
) -> Result<T, HeadError> {
    let mut acc: Vec<u8> = Vec::new();
    loop {
        let avail = r.fill_buf().await.map_err(HeadError::Io)?;
        if avail.is_empty() {
            return Err(HeadError::Closed);
        }
        let before = acc.len();
        let take = avail.len().min(MAX_HEAD - before);
        acc.extend_from_slice(&avail[..take]);
        // Parse only when the new bytes (with the three before them) may end a head: a head
        // trickled in byte by byte must not cost one full parse per byte.
        let window = &acc[before.saturating_sub(3)..];
        let may_end = window.windows(2).any(|w| w == b"\n\n") || window.windows(3).any(|w| w == b"\n\r\n");
        let parsed = if may_end || acc.len() >= MAX_HEAD { parse(&acc)? } else { None };
        match parsed {
            Some((head, len)) => {
                r.consume(len - before);
                return Ok(head);
            }
            None if acc.len() >= MAX_HEAD => return Err(HeadError::TooLarge),
            None => r.consume(take),
        }
    }
}

/// Headers that describe one hop, never forwarded (RFC 9110 §7.6.1), plus the proxy's own
/// credentials and `Host`, which the proxy writes itself from the target.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
    "host",
];

/// Headers that decide where a message ends: never dropped because `Connection` names them
/// (that would let a body the proxy framed one way be read another way upstream — a second,
/// unvetted request smuggled inside the first).
const FRAMING: [&str; 2] = ["content-length", "transfer-encoding"];

/// The headers that cross the proxy: hop-by-hop ones, `Proxy-*` ones, `Host`, and every
/// header named in `Connection` except the framing ones are dropped.
pub fn end_to_end(headers: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let named: Vec<String> = headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, v)| {
            String::from_utf8_lossy(v).split(',').map(|t| t.trim().to_ascii_lowercase()).collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty())
        .collect();
    headers
        .iter()
        .filter(|(n, _)| {
            let lower = n.to_ascii_lowercase();
            !HOP_BY_HOP.contains(&lower.as_str())
                && !lower.starts_with("proxy-")
                && (FRAMING.contains(&lower.as_str()) || !named.contains(&lower))
        })
        .cloned()
        .collect()
}

/// A request's headers with its framing written by the proxy: whatever framing headers the
/// client sent are replaced by the one matching the framing the proxy enforces.
pub fn with_framing(headers: Vec<(String, Vec<u8>)>, framing: Framing) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> =
        headers.into_iter().filter(|(n, _)| !FRAMING.iter().any(|f| n.eq_ignore_ascii_case(f))).collect();
    match framing {
        Framing::Length(n) => out.push(("Content-Length".into(), n.to_string().into_bytes())),
        Framing::Chunked => out.push(("Transfer-Encoding".into(), b"chunked".to_vec())),
        Framing::None | Framing::UntilClose => {}
    }
    out
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
    /// A response without length: the body ends when the server closes.
    UntilClose,
}

fn values<'a>(headers: &'a [(String, Vec<u8>)], name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
    headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
}

fn content_length(headers: &[(String, Vec<u8>)]) -> Result<Option<u64>, &'static str> {
    let mut found: Option<u64> = None;
    for v in values(headers, "content-length") {
        for part in String::from_utf8_lossy(v).split(',') {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err("Content-Length is not a number");
            }
            let n: u64 = part.parse().map_err(|_| "Content-Length is out of range")?;
            if found.is_some_and(|f| f != n) {
                return Err("Content-Length values disagree");
            }
            found = Some(n);
        }
    }
    Ok(found)
}

fn transfer_coding(headers: &[(String, Vec<u8>)]) -> Option<String> {
    let all: Vec<String> = values(headers, "transfer-encoding")
        .flat_map(|v| {
            String::from_utf8_lossy(v).split(',').map(|t| t.trim().to_ascii_lowercase()).collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty())
        .collect();
    all.last().cloned()
}

/// The request body's framing; ambiguous framings (both `Transfer-Encoding` and
/// `Content-Length`, or a coding other than chunked last) are refused, because a proxy and
/// a server that read them differently let one request smuggle another.
pub fn request_framing(headers: &[(String, Vec<u8>)]) -> Result<Framing, &'static str> {
    let length = content_length(headers)?;
    match (transfer_coding(headers), length) {
        (Some(_), Some(_)) => Err("a request may not carry both Transfer-Encoding and Content-Length"),
        (Some(coding), None) if coding == "chunked" => Ok(Framing::Chunked),
        (Some(_), None) => Err("a request's Transfer-Encoding must end in chunked"),
        (None, Some(0)) | (None, None) => Ok(Framing::None),
        (None, Some(n)) => Ok(Framing::Length(n)),
    }
}

/// The response body's framing (RFC 9112 §6.3).
pub fn response_framing(request_method: &str, status: u16, headers: &[(String, Vec<u8>)]) -> Framing {
    if request_method.eq_ignore_ascii_case("HEAD")
        || (100..200).contains(&status)
        || status == 204
        || status == 304
    {
        return Framing::None;
    }
    match transfer_coding(headers) {
        Some(c) if c == "chunked" => return Framing::Chunked,
        Some(_) => return Framing::UntilClose,
        None => {}
    }
    match content_length(headers) {
        Ok(Some(0)) => Framing::None,
        Ok(Some(n)) => Framing::Length(n),
        _ => Framing::UntilClose,
    }
}

/// Serialises a head line and headers, ending with the blank line.
pub fn write_head(first_line: &str, headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(first_line.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn request_heads_parse_and_keep_pipelined_bytes() {
        let raw = b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n\x16\x03\x01";
        let (head, len) = parse_request(raw).unwrap().unwrap();
        assert_eq!(
            (head.method.as_str(), head.target.as_str(), head.version),
            ("CONNECT", "pypi.org:443", 1)
        );
        assert_eq!(&raw[len..], b"\x16\x03\x01");
        assert!(parse_request(b"GET http://a.example/ HTTP/1.1\r\nHost: a").unwrap().is_none());
        assert!(matches!(parse_request(b"GET\x00 / HTTP/1.1\r\n\r\n"), Err(HeadError::Malformed(_))));
        let mut huge = b"GET http://a.example/ HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD + 10, b'a');
        assert!(matches!(parse_request(&huge), Err(HeadError::TooLarge)));
    }

    #[test]
    fn hop_by_hop_and_proxy_headers_never_cross() {
        let headers = h(&[
            ("Host", "allowed.example.com"),
            ("Connection", "keep-alive, X-Secret"),
            ("X-Secret", "1"),
            ("Proxy-Authorization", "Basic abc"),
            ("Proxy-Connection", "keep-alive"),
            ("Proxy-Foo", "x"),
            ("Keep-Alive", "300"),
            ("TE", "trailers"),
            ("Upgrade", "websocket"),
            ("Accept", "*/*"),
            ("Transfer-Encoding", "chunked"),
        ]);
        let kept: Vec<String> = end_to_end(&headers).into_iter().map(|(n, _)| n).collect();
        assert_eq!(kept, vec!["Accept", "Transfer-Encoding"]);
    }

    #[test]
    fn connection_cannot_remove_the_framing_and_requests_carry_the_proxys_framing() {
        let headers = h(&[("Connection", "Content-Length, Transfer-Encoding"), ("Content-Length", "63")]);
        let kept = end_to_end(&headers);
        assert_eq!(kept, h(&[("Content-Length", "63")]));
        let framed = with_framing(h(&[("content-length", "63"), ("Accept", "*/*")]), Framing::Length(63));
        assert_eq!(framed, h(&[("Accept", "*/*"), ("Content-Length", "63")]));
        let framed = with_framing(h(&[("Transfer-Encoding", "gzip, chunked")]), Framing::Chunked);
        assert_eq!(framed, h(&[("Transfer-Encoding", "chunked")]));
        assert!(with_framing(h(&[("Content-Length", "0")]), Framing::None).is_empty());
    }

    #[test]
    fn request_framing_table() {
        type Case<'a> = (&'a [(&'a str, &'a str)], Result<Framing, ()>);
        let cases: &[Case] = &[
            (&[], Ok(Framing::None)),
            (&[("Content-Length", "0")], Ok(Framing::None)),
            (&[("Content-Length", "12")], Ok(Framing::Length(12))),
            (&[("Content-Length", "12, 12")], Ok(Framing::Length(12))),
            (&[("Content-Length", "12"), ("Content-Length", "13")], Err(())),
            (&[("Content-Length", "-1")], Err(())),
            (&[("Content-Length", "0x10")], Err(())),
            (&[("Transfer-Encoding", "chunked")], Ok(Framing::Chunked)),
            (&[("Transfer-Encoding", "gzip, chunked")], Ok(Framing::Chunked)),
            (&[("Transfer-Encoding", "chunked, gzip")], Err(())),
            (&[("Transfer-Encoding", "chunked"), ("Content-Length", "5")], Err(())),
        ];
        for (headers, expected) in cases {
            assert_eq!(request_framing(&h(headers)).map_err(|_| ()), *expected, "{headers:?}");
        }
    }

    #[test]
    fn response_framing_table() {
        assert_eq!(response_framing("HEAD", 200, &h(&[("Content-Length", "5")])), Framing::None);
        assert_eq!(response_framing("GET", 204, &[]), Framing::None);
        assert_eq!(response_framing("GET", 304, &[]), Framing::None);
        assert_eq!(response_framing("GET", 200, &h(&[("Content-Length", "5")])), Framing::Length(5));
        assert_eq!(response_framing("GET", 200, &h(&[("Transfer-Encoding", "chunked")])), Framing::Chunked);
        assert_eq!(response_framing("GET", 200, &[]), Framing::UntilClose);
    }

    #[tokio::test]
    async fn reading_a_head_leaves_what_follows_unread() {
        use tokio::io::AsyncReadExt;
        let raw = b"CONNECT a.example:443 HTTP/1.1\r\nHost: a\r\n\r\nTUNNEL";
        // A tiny buffer makes the head arrive in pieces.
        let mut r = tokio::io::BufReader::with_capacity(7, &raw[..]);
        let head = read_head(&mut r, parse_request).await.unwrap();
        assert_eq!(head.target, "a.example:443");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"TUNNEL");
        let mut closed = tokio::io::BufReader::new(&b"GET http://a.example/ HT"[..]);
        assert!(matches!(read_head(&mut closed, parse_request).await, Err(HeadError::Closed)));
    }

    #[test]
    fn heads_serialise() {
        let out = write_head("GET / HTTP/1.1", &h(&[("Host", "a.example")]));
        assert_eq!(out, b"GET / HTTP/1.1\r\nHost: a.example\r\n\r\n");
    }
}
