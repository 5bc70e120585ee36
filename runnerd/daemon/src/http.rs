//! The HTTP/1.1 face (contract §1): TCP or a Unix socket, hyper with a header-read
//! timeout, a 2,000,000-byte body limit enforced while reading, JSON + `\n` answers with the
//! original's headers (hyper adds `Date` to every response), and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes_compat::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{
    AUTHORIZATION, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, RETRY_AFTER,
};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

use crate::api::stream::ReplyBody;
use crate::api::{self, ApiRequest, ApiResponse, error::ApiError};
use crate::app::App;
use crate::auth::{self, Gate};
use crate::memory::{self, Activity};

mod bytes_compat {
    pub use hyper::body::Bytes;
}

/// The original's request body limit.
pub const BODY_LIMIT: usize = 2_000_000;
/// A body must arrive within this time once its head has.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// In-flight requests get this long to finish after SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    /// `owned`: we bound it and remove the path at stop (not so for one systemd passed).
    Unix {
        listener: UnixListener,
        path: PathBuf,
        owned: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("could not listen on {address}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not prepare the socket directory {path}")]
    SocketDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Listener {
    /// TCP on `host:port` (port 0: ephemeral).
    pub async fn tcp(host: &str, port: u16) -> Result<Listener, ListenError> {
        let address = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        TcpListener::bind(&address)
            .await
            .map(Listener::Tcp)
            .map_err(|source| ListenError::Bind { address, source })
    }

    /// A Unix socket: parent directory 0700 (created if missing), a stale socket removed,
    /// the socket 0600.
    pub fn unix(path: &Path) -> Result<Listener, ListenError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            let dir_err = |source| ListenError::SocketDir { path: parent.to_owned(), source };
            if !parent.exists() {
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(parent).map_err(dir_err)?;
            }
        }
        let bind_err = |source| ListenError::Bind { address: format!("unix:{}", path.display()), source };
        match std::fs::symlink_metadata(path) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                std::fs::remove_file(path).map_err(bind_err)?
            }
            _ => {}
        }
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(bind_err)?;
        Ok(Listener::Unix { listener, path: path.to_owned(), owned: true })
    }

    /// The listener systemd passed (socket activation), if any: a stream socket, TCP or
    /// Unix. Activation wins over the configured address, as the unit says where to listen.
    pub fn from_activation() -> Result<Option<Listener>, ListenError> {
        let mut fds = common::systemd::take_listen_fds();
        if fds.is_empty() {
            return Ok(None);
        }
        let fd = fds.swap_remove(0);
        let err =
            |source| ListenError::Bind { address: "the socket systemd passed (LISTEN_FDS)".into(), source };
        use nix::sys::socket::{AddressFamily, SockaddrLike, SockaddrStorage, getsockname};
        let family = getsockname::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd))
            .ok()
            .and_then(|a| a.family());
        let is_unix = family == Some(AddressFamily::Unix);
        if is_unix {
            let std = std::os::unix::net::UnixListener::from(fd);
            std.set_nonblocking(true).map_err(err)?;
            let path =
                std.local_addr().ok().and_then(|a| a.as_pathname().map(Path::to_owned)).unwrap_or_default();
            return Ok(Some(Listener::Unix {
                listener: UnixListener::from_std(std).map_err(err)?,
                path,
                owned: false,
            }));
        }
        let std = std::net::TcpListener::from(fd);
        std.set_nonblocking(true).map_err(err)?;
        Ok(Some(Listener::Tcp(TcpListener::from_std(std).map_err(err)?)))
    }

    /// What the start-up line prints: `http://HOST:PORT` or `unix:PATH`.
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => format!("http://{a}"),
                Err(_) => "http://?".to_owned(),
            },
            Listener::Unix { path, .. } => format!("unix:{}", path.display()),
        }
    }
}

fn respond(status: u16, body: String, retry_after: Option<u64>) -> Response<ReplyBody> {
    let mut text = body;
    text.push('\n');
    let mut response = Response::new(ReplyBody::Full(Some(Bytes::from(text))));
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

/// A streamed answer (a download, or a large JSON result): `no-store`, `nosniff`, and a
/// length when it is known.
fn respond_download(status: u16, download: api::stream::Download) -> Response<ReplyBody> {
    let content_type = download.content_type;
    let mut response = Response::new(ReplyBody::Stream(download.rx));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if let Some(len) = download.content_length {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(len));
    }
    response
}

fn from_result(result: Result<ApiResponse, ApiError>) -> Response<ReplyBody> {
    match result {
        Ok(ApiResponse { status, download: Some(d), .. }) => respond_download(status, d),
        Ok(ok) => respond(ok.status, ok.body, None),
        Err(e) => respond(e.status, e.body_json(), e.retry_after),
    }
}

fn too_large(limit: usize) -> ApiError {
    ApiError::bad_request("body_too_large", format!("Request body exceeds the {limit} byte limit"))
}

/// How long, and how much, a refused body is read and thrown away before its connection
/// closes (see `handle`): enough for what a client has in flight, bounded against one that
/// keeps sending.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: u64 = 8 << 20;

pub async fn discard(mut body: Incoming) {
    use http_body_util::BodyExt;
    let mut seen = 0u64;
    let _ = tokio::time::timeout(LINGER, async {
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, |d| d.len() as u64);
            if seen > LINGER_BYTES {
                break;
            }
        }
    })
    .await;
}

/// Whether `Content-Length` announces more than the route's limit ([`api::body_limit`]). A
/// length that does not parse is left to hyper, which refuses it while reading the head.
pub fn announced_over_limit(headers: &hyper::HeaderMap, limit: usize) -> bool {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|len| len > limit as u64)
}

/// Sends `true` when dropped before [`ClientWatch::done`]: hyper drops a request's future
/// when its connection closes, which is how a client disconnect reaches the execution.
struct ClientWatch {
    tx: watch::Sender<bool>,
    done: bool,
}

impl ClientWatch {
    fn done(mut self) {
        self.done = true;
    }
}

impl Drop for ClientWatch {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(true);
        }
    }
}

async fn handle(app: Arc<App>, gate: Arc<Gate>, req: Request<Incoming>, peer: String) -> Response<ReplyBody> {
    let method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    if api::is_health(&method, &path) {
        let h = api::health(&app).await;
        return respond(h.status, h.body, None);
    }
    let header = |name: &str| req.headers().get(name).map(|v| v.as_bytes().to_vec());
    if let Err(e) = authorize(&gate, &req, &method, &path, &peer) {
        return from_result(Err(e));
    }
    let text = |name: &str| header(name).and_then(|v| String::from_utf8(v).ok());
    let (timestamp, signature) =
        (text("x-science-execution-timestamp"), text("x-science-execution-signature"));
    let query = req.uri().query().map(str::to_owned);
    let (parts, incoming) = req.into_parts();
    let headers = parts.headers;
    // File uploads stream to disk (any size, bounded by the workspace quota); every other
    // body is read whole under the original's limit.
    let (upload, incoming) =
        if api::streams_upload(&method, &path) { (Some(incoming), None) } else { (None, Some(incoming)) };
    let limit = api::body_limit(&method, &path);
    let body = match read_body(incoming, &headers, limit).await {
        Ok(body) => body,
        Err(response) => return *response,
    };
    let (tx, rx) = watch::channel(false);
    let watch = ClientWatch { tx, done: false };
    let (log_method, log_path, log_peer) = (method.clone(), path.clone(), peer.clone());
    let request = ApiRequest { method, path, query, peer, timestamp, signature, body, headers, upload };
    let result = api::handle(app, &gate, request, rx).await;
    watch.done();
    match &result {
        Ok(ok) => {
            tracing::info!(event = "request", method = %log_method, path = %log_path, peer = %log_peer, status = ok.status)
        }
        Err(e) => {
            tracing::info!(event = "request", method = %log_method, path = %log_path, peer = %log_peer, status = e.status, code = e.code, error = %e.message)
        }
    }
    from_result(result)
}

/// The request's one `Authorization` header, checked.
fn authorize(
    gate: &Gate,
    req: &Request<Incoming>,
    method: &str,
    path: &str,
    peer: &str,
) -> Result<(), ApiError> {
    // Ours (issue #15): two `Authorization` headers are refused, never "the first wins".
    let presented: Vec<&[u8]> = req.headers().get_all(AUTHORIZATION).iter().map(|v| v.as_bytes()).collect();
    let authorization = match auth::single_authorization(&presented) {
        Ok(one) => one,
        Err(auth::DuplicateAuthorization(count)) => {
            tracing::warn!(event = "auth_failed", reason = "duplicate authorization headers", count, method = %method, path = %path, peer = %peer);
            return Err(ApiError::with_status(
                401,
                "duplicate_authorization",
                "Unauthorized: send exactly one Authorization header",
            ));
        }
    };
    api::authorize(gate, authorization, method, path, peer)
}

/// The request body, read whole under `limit` (`None`: an upload, streamed later, reads
/// as empty); otherwise the answer that refuses it (boxed: it is large, and rare).
async fn read_body(
    incoming: Option<Incoming>,
    headers: &hyper::HeaderMap,
    limit: usize,
) -> Result<Vec<u8>, Box<Response<ReplyBody>>> {
    Ok(match incoming {
        None => Vec::new(),
        // A body announced over the limit is refused before a byte of it is read, and the
        // connection closes. What the client already sent is read and thrown away for a
        // moment meanwhile (a lingering close): closing a socket with unread bytes resets
        // it, and the reset can destroy the answer before the client reads it.
        Some(incoming) if announced_over_limit(headers, limit) => {
            tokio::spawn(discard(incoming));
            let mut response = from_result(Err(too_large(limit)));
            response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            return Err(Box::new(response));
        }
        Some(incoming) => {
            match tokio::time::timeout(BODY_TIMEOUT, Limited::new(incoming, limit).collect()).await {
                Ok(Ok(collected)) => collected.to_bytes().to_vec(),
                Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                    return Err(Box::new(from_result(Err(too_large(limit)))));
                }
                Ok(Err(e)) => {
                    return Err(Box::new(from_result(Err(ApiError::bad_request(
                        "body_unreadable",
                        format!("Request body could not be read: {e}"),
                    )))));
                }
                Err(_) => {
                    let message =
                        format!("Request body was not received within {} s", BODY_TIMEOUT.as_secs());
                    return Err(Box::new(from_result(Err(ApiError::bad_request("body_timeout", message)))));
                }
            }
        }
    })
}

/// Connections served at once; more wait in the kernel's accept queue.
pub const MAX_CONNECTIONS: usize = 1024;

/// Counts a request as in flight until dropped (hyper drops the future of a request whose
/// client went away), for the trimmer that returns memory after load.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: &Arc<Activity>) -> InFlight {
        activity.begin();
        InFlight(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// Serves until `shutdown` completes, then lets in-flight requests finish (bounded).
pub async fn serve(app: Arc<App>, gate: Arc<Gate>, listener: Listener, shutdown: impl Future<Output = ()>) {
    let activity = Arc::new(Activity::default());
    let trimmer = tokio::spawn(memory::trimmer(activity.clone()));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(app.config.header_read_timeout).keep_alive(true);
    tokio::pin!(shutdown);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            s = slots.clone().acquire_owned() => s.expect("never closed"),
        };
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = accept(&listener) => a,
        };
        let (io, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(event = "accept_failed", error = %e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (app, gate) = (app.clone(), gate.clone());
        let activity = activity.clone();
        let service = service_fn(move |req| {
            let (app, gate) = (app.clone(), gate.clone());
            let peer = peer.clone();
            let in_flight = InFlight::new(&activity);
            async move {
                let response = handle(app, gate, req, peer).await;
                drop(in_flight);
                Ok::<_, Infallible>(response)
            }
        });
        let conn = graceful.watch(builder.serve_connection(io, service));
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    let socket = match &listener {
        Listener::Unix { path, owned: true, .. } => Some(path.clone()),
        Listener::Unix { .. } | Listener::Tcp(_) => None,
    };
    drop(listener);
    if let Some(path) = socket {
        let _ = std::fs::remove_file(path);
    }
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::warn!(event = "shutdown", detail = "in-flight requests did not finish in time");
    }
    trimmer.abort();
}

/// Either kind of connection, as one I/O type for hyper.
enum Io {
    Tcp(TokioIo<tokio::net::TcpStream>),
    Unix(TokioIo<tokio::net::UnixStream>),
}

async fn accept(listener: &Listener) -> std::io::Result<(Io, String)> {
    match listener {
        Listener::Tcp(l) => {
            let (s, a) = l.accept().await?;
            let _ = s.set_nodelay(true);
            Ok((Io::Tcp(TokioIo::new(s)), a.to_string()))
        }
        Listener::Unix { listener, .. } => {
            let (s, _) = listener.accept().await?;
            let peer =
                s.peer_cred().map(|c| format!("uid {} pid {:?}", c.uid(), c.pid())).unwrap_or_default();
            Ok((Io::Unix(TokioIo::new(s)), format!("unix ({peer})")))
        }
    }
}

impl hyper::rt::Read for Io {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Io::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for Io {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Io::Unix(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
            Io::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Io::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}
