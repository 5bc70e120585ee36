//! runnerd as a client of another runnerd (issue #34): the source of a move asks the target
//! which objects it lacks, streams them, and asks it to commit. Nodes of one fleet share the
//! bearer token; every request is signed as the execution routes are (HMAC over the
//! timestamp and the body, or, for the object stream, over its query: the streamed bytes are
//! verified by their digests instead).

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Request;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::api::stream::ReplyBody;
use crate::transfer::outgoing::Progress;
use crate::transfer::protocol;
use crate::versioning::Ref;
use crate::writer::Versions;

/// How long connecting to a peer may take.
const CONNECT: Duration = Duration::from_secs(10);
/// How long a JSON exchange may take (a commit materializes the whole tree on the target).
const EXCHANGE: Duration = Duration::from_secs(3600);
const CHUNK: usize = 256 * 1024;
/// The most a peer's answer may hold (a `missing` list of 10,000 refs is ~1.5 MB).
const ANSWER_LIMIT: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("could not connect to {0}")]
    Connect(String, #[source] std::io::Error),
    #[error("{0} did not answer in time")]
    Timeout(String),
    #[error("the HTTP exchange with {0} failed")]
    Http(String, #[source] hyper::Error),
    /// The peer answered, and refused (its status, code and text).
    #[error("{url} answered {status}: {message} ({code})")]
    Refused { url: String, status: u16, code: String, message: String },
    #[error("an object could not be read from this node's store")]
    Local(#[source] crate::versioning::VersionError),
    #[error("the task reading the objects failed: {0}")]
    Task(String),
    /// The peer answered 2xx with something a runnerd does not say.
    #[error("{0} is not a runnerd that took the transfer: {1}")]
    Answer(String, String),
}

/// Another runnerd, by its base URL (`http://host:port`).
#[derive(Debug, Clone)]
pub struct Peer {
    pub url: String,
    authority: String,
    token: Arc<str>,
}

impl Peer {
    /// `url` is a normalised node URL ([`protocol::node_url`]).
    pub fn new(url: &str, token: &str) -> Peer {
        let authority = url.strip_prefix("http://").unwrap_or(url).to_owned();
        Peer { url: url.to_owned(), authority, token: token.into() }
    }

    async fn exchange(&self, request: Request<ReplyBody>) -> Result<(u16, Value), PeerError> {
        let url = self.url.clone();
        let stream = tokio::time::timeout(CONNECT, tokio::net::TcpStream::connect(&self.authority))
            .await
            .map_err(|_| PeerError::Timeout(url.clone()))?
            .map_err(|e| PeerError::Connect(url.clone(), e))?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| PeerError::Http(url.clone(), e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let answered = async {
            let response = sender.send_request(request).await.map_err(|e| PeerError::Http(url.clone(), e))?;
            let status = response.status().as_u16();
            let body = http_body_util::Limited::new(response.into_body(), ANSWER_LIMIT)
                .collect()
                .await
                .map_err(|e| PeerError::Answer(url.clone(), format!("its answer could not be read: {e}")))?
                .to_bytes();
            Ok::<_, PeerError>((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
        };
        let (status, body) =
            tokio::time::timeout(EXCHANGE, answered).await.map_err(|_| PeerError::Timeout(url.clone()))??;
        if !(200..300).contains(&status) {
            let text = |k: &str| body.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
            return Err(PeerError::Refused { url, status, code: text("code"), message: text("error") });
        }
        Ok((status, body))
    }

    fn request(
        &self,
        method: &str,
        path_and_query: &str,
        signed: &[u8],
        body: ReplyBody,
    ) -> Request<ReplyBody> {
        let ts = crate::timefmt::now_ms().to_string();
        let signature = crate::auth::sign(&self.token, &ts, signed);
        Request::builder()
            .method(method)
            .uri(path_and_query)
            .header("host", &self.authority)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .header("x-science-execution-timestamp", ts)
            .header("x-science-execution-signature", signature)
            .body(body)
            .expect("a request of valid parts")
    }

    /// A signed `POST` of a JSON object.
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, PeerError> {
        // Each request its own bytes: two alike signed in one millisecond would share a
        // signature, and the peer's replay check would refuse the second.
        let mut body = body.clone();
        body["requestId"] = Value::String(crate::versioning::names::new_uuid_v4());
        let raw = Bytes::from(body.to_string());
        let request = self.request("POST", path, &raw, ReplyBody::Full(Some(raw.clone())));
        Ok(self.exchange(request).await?.1)
    }

    /// A `GET` with the bearer token.
    pub async fn get(&self, path_and_query: &str) -> Result<Value, PeerError> {
        // The signature headers ride along; a route that is not signed ignores them.
        let request = self.request("GET", path_and_query, b"", ReplyBody::Full(None));
        Ok(self.exchange(request).await?.1)
    }

    /// The refs of `objects` the peer lacks, asked in bounded batches. Only what was asked
    /// counts, each once: a peer cannot make this node read other objects.
    pub async fn missing(&self, objects: &[Ref]) -> Result<Vec<Ref>, PeerError> {
        let mut lacking = Vec::new();
        for batch in objects.chunks(protocol::MAX_ASKED) {
            let answer =
                self.post("/workspace-transfer/missing", &serde_json::json!({"objects": batch})).await?;
            let list = answer.get("missing").and_then(Value::as_array).ok_or_else(|| {
                PeerError::Answer(self.url.clone(), "its answer has no `missing` list".into())
            })?;
            let mut asked: std::collections::HashSet<&Ref> = batch.iter().collect();
            for r in list.iter().filter_map(|v| Ref::from_value(v).ok()) {
                if let Some(r) = asked.take(&r) {
                    lacking.push(r.clone());
                }
            }
        }
        Ok(lacking)
    }

    /// Streams `objects` from this node's store in one request: frame headers and bytes,
    /// each object read through the verifying reader (a damaged local object stops the
    /// stream rather than reach the peer). `progress` counts what was handed to the socket.
    pub async fn send_objects(
        &self,
        versions: Arc<Versions>,
        objects: Vec<Ref>,
        progress: Arc<Progress>,
    ) -> Result<Value, PeerError> {
        let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
        let reading = tokio::task::spawn_blocking(move || -> Result<(), PeerError> {
            for object in objects {
                let header = Bytes::from(protocol::frame_header(&object));
                if tx.blocking_send(Ok(header)).is_err() {
                    return Ok(());
                }
                let mut reader = versions.store().open_reader(&object).map_err(PeerError::Local)?;
                let mut buf = vec![0u8; CHUNK];
                loop {
                    let n = match reader.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                            return Err(PeerError::Local(crate::versioning::VersionError::Integrity));
                        }
                    };
                    if tx.blocking_send(Ok(Bytes::copy_from_slice(&buf[..n]))).is_err() {
                        return Ok(());
                    }
                    progress.bytes_sent.fetch_add(n as u64, Ordering::Relaxed);
                }
                progress.objects_sent.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        });
        let query = format!("/workspace-transfer/objects?stream={}", crate::versioning::names::new_uuid_v4());
        let request = self.request("POST", &query, query.as_bytes(), ReplyBody::Stream(rx));
        let answered = self.exchange(request).await;
        reading.await.unwrap_or_else(|e| Err(PeerError::Task(e.to_string())))?;
        Ok(answered?.1)
    }
}
