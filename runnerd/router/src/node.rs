//! The router's HTTP client to its nodes: one pooled hyper client for forwarding callers'
//! requests byte for byte, and small bounded JSON questions of the router's own (load,
//! `where`, `list`, drain, push, restore), signed with the shared token like any caller's.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every body the router sends or answers with.
pub type Body = BoxBody<Bytes, BoxError>;

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|e: Infallible| match e {}).boxed()
}

/// A streamed body passed through.
pub fn streamed(incoming: Incoming) -> Body {
    incoming.map_err(|e| Box::new(e) as BoxError).boxed()
}

/// How long a node may take to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes of a node's answer to one of the router's own questions.
const ANSWER_LIMIT: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Nothing reached the node (refused, unreachable, connect timeout): safe to retry
    /// elsewhere.
    #[error("could not connect to {url}")]
    Connect {
        url: String,
        #[source]
        source: BoxError,
    },
    /// The request may have reached the node: never retried.
    #[error("{url} failed during the request")]
    Request {
        url: String,
        #[source]
        source: BoxError,
    },
    #[error("{url} did not answer within {0:?}", .after)]
    Timeout { url: String, after: Duration },
    #[error("{url} answered {status} without JSON")]
    NotJson { url: String, status: u16 },
}

impl NodeError {
    pub fn retryable(&self) -> bool {
        matches!(self, NodeError::Connect { .. })
    }
}

/// The client every request to a node goes through.
#[derive(Debug, Clone)]
pub struct NodeClient {
    http: Client<HttpConnector, Body>,
    token: String,
}

impl NodeClient {
    pub fn new(token: String) -> NodeClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(64)
            .build(connector);
        NodeClient { http, token }
    }

    /// Sends `req` (its URI already the node's) and answers the node's response head with its
    /// body unread.
    pub async fn send(&self, url: &str, req: Request<Body>) -> Result<Response<Incoming>, NodeError> {
        self.http.request(req).await.map_err(|e| {
            if e.is_connect() {
                NodeError::Connect { url: url.to_owned(), source: Box::new(e) }
            } else {
                NodeError::Request { url: url.to_owned(), source: Box::new(e) }
            }
        })
    }

    fn request(
        &self,
        method: &str,
        url: &str,
        path_query: &str,
        body: Option<&Value>,
    ) -> Result<Request<Body>, NodeError> {
        let bytes = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("{url}{path_query}"))
            .header(hyper::header::AUTHORIZATION, format!("Bearer {}", self.token));
        if method == "POST" {
            let ts = common::timefmt::now_ms().to_string();
            let signature = runnerd::auth::sign(&self.token, &ts, &bytes);
            builder = builder
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .header("x-science-execution-timestamp", ts)
                .header("x-science-execution-signature", signature);
        }
        builder.body(full(bytes)).map_err(|e| NodeError::Request { url: url.to_owned(), source: Box::new(e) })
    }

    /// One of the router's own questions: `GET` or a signed `POST` of JSON, answered with
    /// the status and the JSON, within `timeout`.
    pub async fn json(
        &self,
        method: &str,
        url: &str,
        path_query: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<(u16, Value), NodeError> {
        let req = self.request(method, url, path_query, body)?;
        let answer = async {
            let response = self.send(url, req).await?;
            let status = response.status().as_u16();
            let bytes = Limited::new(response.into_body(), ANSWER_LIMIT)
                .collect()
                .await
                .map_err(|source| NodeError::Request { url: url.to_owned(), source })?
                .to_bytes();
            let value = serde_json::from_slice(&bytes)
                .map_err(|_| NodeError::NotJson { url: url.to_owned(), status })?;
            Ok((status, value))
        };
        tokio::time::timeout(timeout, answer)
            .await
            .unwrap_or_else(|_| Err(NodeError::Timeout { url: url.to_owned(), after: timeout }))
    }
}

/// A body of ours read whole, at most `limit` bytes.
pub async fn collect(mut body: Body, limit: usize) -> Result<Bytes, String> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(format!("more than {limit} bytes"));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(out))
}
