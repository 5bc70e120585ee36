//! A client for runnerd's HTTP API that behaves like the original `RunnerClient` (contract
//! §6): Bearer on every request, signed execution routes (milliseconds timestamp, HMAC over
//! `<ts>\n<sha256(body)>`), and a clock offset learnt from every response's `Date` header.
//! Used by `runnerctl`, by the benchmarks (`runnerd/bench`) and by the integration tests,
//! which also need its raw request path to send malformed and hostile requests.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;

use common::timefmt;
use runnerd::auth;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`
    Tcp(String),
    Unix(PathBuf),
}

impl Endpoint {
    /// `http://host:port`, `host:port` or `unix:/path`.
    pub fn parse(text: &str) -> Endpoint {
        if let Some(path) = text.strip_prefix("unix:") {
            return Endpoint::Unix(PathBuf::from(path));
        }
        let rest = text.strip_prefix("http://").unwrap_or(text);
        Endpoint::Tcp(rest.trim_end_matches('/').to_owned())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("could not connect to runnerd at {0:?}")]
    Connect(Endpoint, #[source] std::io::Error),
    #[error("the HTTP exchange with runnerd failed")]
    Http(#[source] hyper::Error),
    #[error("the request could not be built")]
    Build(#[source] hyper::http::Error),
}

/// A complete answer.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Debug)]
pub struct RunnerClient {
    endpoint: Endpoint,
    token: String,
    clock_offset_ms: AtomicI64,
}

impl RunnerClient {
    pub fn new(endpoint: Endpoint, token: impl Into<String>) -> RunnerClient {
        RunnerClient { endpoint, token: token.into(), clock_offset_ms: AtomicI64::new(0) }
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// One request on a fresh connection, headers exactly as given (nothing added).
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, String)],
        body: Vec<u8>,
    ) -> Result<Reply, ClientError> {
        let sent_at = timefmt::now_ms() as i64;
        let mut builder = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).unwrap_or(Method::GET))
            .uri(path)
            .header("host", "runnerd");
        for (k, v) in headers {
            builder = builder.header(*k, v);
        }
        let request = builder.body(Full::new(Bytes::from(body))).map_err(ClientError::Build)?;
        let response = match &self.endpoint {
            Endpoint::Tcp(addr) => {
                let stream = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| ClientError::Connect(self.endpoint.clone(), e))?;
                let _ = stream.set_nodelay(true);
                send(TokioIo::new(stream), request).await?
            }
            Endpoint::Unix(path) => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| ClientError::Connect(self.endpoint.clone(), e))?;
                send(TokioIo::new(stream), request).await?
            }
        };
        let received_at = timefmt::now_ms() as i64;
        if let Some(date) = response.header("date").and_then(|d| httpdate::parse_http_date(d).ok()) {
            let server_ms =
                date.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
            let previous = self.clock_offset_ms.load(Ordering::Relaxed);
            self.clock_offset_ms
                .store(learnt_offset(previous, sent_at, received_at, server_ms), Ordering::Relaxed);
        }
        Ok(response)
    }

    pub fn bearer(&self) -> (&'static str, String) {
        ("authorization", format!("Bearer {}", self.token))
    }

    pub async fn get(&self, path: &str) -> Result<Reply, ClientError> {
        self.raw("GET", path, &[self.bearer()], Vec::new()).await
    }

    /// A request with the bearer token and a raw body (file uploads, deletes).
    pub async fn send_bytes(
        &self,
        method: &str,
        path: &str,
        extra: &[(&str, String)],
        body: Vec<u8>,
    ) -> Result<Reply, ClientError> {
        let mut headers = vec![self.bearer()];
        headers.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
        self.raw(method, path, &headers, body).await
    }

    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> Result<Reply, ClientError> {
        let headers = [self.bearer(), ("content-type", "application/json".to_owned())];
        self.raw("POST", path, &headers, body.to_string().into_bytes()).await
    }

    /// The signature headers for `body`, with the timestamp on the server's clock.
    pub fn signature_headers(&self, body: &[u8]) -> [(&'static str, String); 2] {
        let ts = (timefmt::now_ms() as i64 + self.clock_offset_ms.load(Ordering::Relaxed)).to_string();
        let signature = auth::sign(&self.token, &ts, body);
        [("x-science-execution-timestamp", ts), ("x-science-execution-signature", signature)]
    }

    /// A signed POST, as the original client sends `/execute`, `/execute-shell`, ….
    pub async fn post_signed(&self, path: &str, body: &serde_json::Value) -> Result<Reply, ClientError> {
        let raw = body.to_string().into_bytes();
        let [ts, sig] = self.signature_headers(&raw);
        let headers = [self.bearer(), ("content-type", "application/json".to_owned()), ts, sig];
        self.raw("POST", path, &headers, raw).await
    }
}

async fn send<T>(io: TokioIo<T>, request: Request<Full<Bytes>>) -> Result<Reply, ClientError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.map_err(ClientError::Http)?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let response = sender.send_request(request).await.map_err(ClientError::Http)?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.map_err(ClientError::Http)?.to_bytes().to_vec();
    driver.abort();
    Ok(Reply { status, headers, body })
}

/// A minimal permission epoch the runner accepts (one read-write workspace mount).
pub fn permission_epoch(session_id: &str) -> serde_json::Value {
    serde_json::json!({
        "id": format!("epoch-{session_id}"),
        "sessionId": session_id,
        "createdAt": timefmt::now_iso(),
        "environmentRevisionId": "system-python3-bwrap-v1",
        "mounts": [{"source": "workspace", "mode": "read-write"}],
        "networkPolicy": "none",
        "reason": "runnerctl",
        "secretRefs": [],
    })
}

/// A fresh, unique execution id.
pub fn new_execution_id() -> String {
    let mut bytes = [0u8; 16];
    let _ = getrandom::fill(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let h = auth::hex(&bytes);
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// `encodeURIComponent`: everything but `A-Z a-z 0-9 - _ . ! ~ * ' ( )` percent-encoded, for
/// path segments and query values (runnerd reads them as `URLSearchParams` does).
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

/// How long `runnerctl` waits for `/health` at most.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// The clock offset to keep after an exchange sent at `sent_at` and answered at
/// `received_at` (local milliseconds) whose `Date` says `date_ms`. A `Date` has one-second
/// resolution: the server read its clock, somewhere in `[date_ms, date_ms + 999]`, while the
/// exchange lasted, so the offset lies in `[date_ms - received_at, date_ms + 999 - sent_at]`.
/// `previous` is kept where it agrees with that, else moved the least that makes it agree.
/// (The original's midpoint formula, `date_ms - (sent_at + received_at) / 2`, jumps by up to
/// a second with each answer, so two bodies signed milliseconds apart by two clients could
/// carry one timestamp, and one identical body one signature, a replay to the receiver.)
fn learnt_offset(previous: i64, sent_at: i64, received_at: i64, date_ms: i64) -> i64 {
    let (lowest, highest) = (date_ms - received_at, date_ms + 999 - sent_at);
    // `max` then `min`, not `clamp`: a local clock stepped back mid-exchange makes an empty
    // range, which must not panic (the offset then ends at `highest`).
    previous.max(lowest).min(highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_moves_only_as_far_as_the_date_header_proves() {
        let second = 1_700_000_000_000_i64;
        for (previous, sent, received, date, expected, why) in [
            (0, second + 300, second + 310, second, 0, "same clocks: the date's second holds the exchange"),
            (0, second + 990, second + 1_010, second, 0, "an answer at the turn of the second"),
            (-5, second + 300, second + 310, second, -5, "a learnt offset that still agrees is kept"),
            (0, second + 300, second + 310, second + 5_000, 4_690, "a server 5 s ahead: the least move"),
            (0, second + 300, second + 310, second - 5_000, -4_301, "a server 5 s behind: the least move"),
            (4_690, second + 300, second + 310, second, 699, "a jump back is followed"),
            (0, second + 310, second + 300, second, 0, "a clock stepped back mid-exchange"),
            (0, second + 2_000, second + 300, second, -1_001, "an empty range does not panic"),
        ] {
            assert_eq!(learnt_offset(previous, sent, received, date), expected, "{why}");
        }
    }

    #[test]
    fn endpoints() {
        assert_eq!(Endpoint::parse("http://127.0.0.1:4311/"), Endpoint::Tcp("127.0.0.1:4311".into()));
        assert_eq!(Endpoint::parse("127.0.0.1:1"), Endpoint::Tcp("127.0.0.1:1".into()));
        assert_eq!(Endpoint::parse("unix:/run/r.sock"), Endpoint::Unix("/run/r.sock".into()));
    }

    #[test]
    fn encodes_as_encode_uri_component() {
        assert_eq!(encode("a b/c:d&e=f%é"), "a%20b%2Fc%3Ad%26e%3Df%25%C3%A9");
        assert_eq!(encode("A-z_0.9!~*'()"), "A-z_0.9!~*'()");
    }

    #[test]
    fn execution_ids_are_uuid_shaped_and_unique() {
        let a = new_execution_id();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert_ne!(a, new_execution_id());
    }
}
