//! The router's HTTP front: the same checks as runnerd's, in the same order and with the
//! same answers (runnerd's own functions: `/health` before auth, exactly one `Authorization`,
//! the bearer, the body limit of each route, the execution signature and its replay cache),
//! then [`crate::route`]. A body is read whole only where runnerd reads it whole; file
//! uploads stream through to the node.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CACHE_CONTROL, CONNECTION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use runnerd::api::ApiRequest;
use runnerd::api::error::ApiError;
use tokio::net::TcpListener;

use crate::node::{Body, full};
use crate::route::Router;

/// How long a client may take to send its request head, and then its body (runnerd's).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
const BODY_TIMEOUT: Duration = runnerd::http_limits::BODY_TIMEOUT;
/// Connections served at once, as runnerd (more wait in the kernel's accept queue): the
/// router's own descriptors, two per forwarded request, stay bounded.
const MAX_CONNECTIONS: usize = runnerd::http_limits::MAX_CONNECTIONS;

/// A JSON answer of the router's own, shaped like runnerd's (a trailing newline, no-store).
pub fn json(status: u16, body: &serde_json::Value) -> Response<Body> {
    respond(status, body.to_string(), None)
}

/// An error answer, shaped like runnerd's (`{"error", "code"}`, `Retry-After` when given).
pub fn error(e: &ApiError) -> Response<Body> {
    respond(e.status, e.body_json(), e.retry_after)
}

fn respond(status: u16, mut text: String, retry_after: Option<u64>) -> Response<Body> {
    text.push('\n');
    let mut response = Response::new(full(text));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    headers.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if let Some(secs) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

fn too_large(limit: usize) -> ApiError {
    ApiError::bad_request("body_too_large", format!("Request body exceeds the {limit} byte limit"))
}

/// A request as the router received it: the head, and the body read whole or still to stream.
#[derive(Debug)]
pub struct Call {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: hyper::HeaderMap,
    pub body: Received,
    pub peer: String,
}

/// The body: read whole (`Bytes`, what runnerd reads whole) or a streamed upload.
#[derive(Debug)]
pub enum Received {
    Whole(bytes::Bytes),
    Stream(Incoming),
    /// A streamed body already sent to a node (it cannot be sent again).
    Spent,
}

/// Serves `listener` until `stopping` turns true.
pub async fn serve(
    listener: TcpListener,
    router: Arc<Router>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stopping.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(event = "accept_failed", error = %e);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopping.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let peer = peer.to_string();
        let service = service_fn(move |req| {
            let (router, peer) = (router.clone(), peer.clone());
            async move { Ok::<_, std::convert::Infallible>(handle(router, req, peer).await) }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), graceful.shutdown()).await;
}

async fn handle(router: Arc<Router>, req: Request<Incoming>, peer: String) -> Response<Body> {
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    if runnerd::api::is_health(&method, &path) {
        return router.health().await;
    }
    let presented: Vec<&[u8]> = req.headers().get_all(AUTHORIZATION).iter().map(|v| v.as_bytes()).collect();
    let authorized = match runnerd::auth::single_authorization(&presented) {
        Err(_) => Err(ApiError::with_status(
            401,
            "duplicate_authorization",
            "Unauthorized: send exactly one Authorization header",
        )),
        Ok(one) => runnerd::api::authorize(&router.gate, one, &method, &path, &peer),
    };
    if let Err(e) = authorized {
        return error(&e);
    }
    let query = req.uri().query().map(str::to_owned);
    let (parts, incoming) = req.into_parts();
    let body = if runnerd::api::streams_upload(&method, &path) {
        Received::Stream(incoming)
    } else {
        let limit = runnerd::api::body_limit(&method, &path);
        if runnerd::http_limits::announced_over_limit(&parts.headers, limit) {
            tokio::spawn(runnerd::http_limits::discard(incoming));
            let mut response = error(&too_large(limit));
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            return response;
        }
        match tokio::time::timeout(BODY_TIMEOUT, Limited::new(incoming, limit).collect()).await {
            Ok(Ok(collected)) => Received::Whole(collected.to_bytes()),
            Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                return error(&too_large(limit));
            }
            Ok(Err(e)) => {
                return error(&ApiError::bad_request(
                    "body_unreadable",
                    format!("Request body could not be read: {e}"),
                ));
            }
            Err(_) => {
                let message = format!("Request body was not received within {} s", BODY_TIMEOUT.as_secs());
                return error(&ApiError::bad_request("body_timeout", message));
            }
        }
    };
    // The fleet's own changes (drain, undrain) are signed like every other change.
    let fleet_change = method == "POST" && path.starts_with("/fleet/");
    if runnerd::api::signed(&method, &path) || fleet_change {
        let text = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let check = ApiRequest {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            peer: peer.clone(),
            timestamp: text("x-science-execution-timestamp"),
            signature: text("x-science-execution-signature"),
            body: match &body {
                Received::Whole(b) => b.to_vec(),
                Received::Stream(_) | Received::Spent => Vec::new(),
            },
            headers: hyper::HeaderMap::new(),
            upload: None,
        };
        if let Err(e) =
            runnerd::api::verify_signature(router.config.signature_max_age_ms, &router.gate, &check)
        {
            return error(&e);
        }
    }
    let request = Call { method, path, query, headers: parts.headers, body, peer };
    router.route(request).await
}
