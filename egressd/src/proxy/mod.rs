//! The proxy spoken on each gateway socket (R-NET-3, internals §3.6): CONNECT and
//! absolute-form HTTP/1.1, decided on the request target's authority alone (never on
//! `Host`), with the original's status codes and `X-Sandbox-Network` reasons.
//!
//! One request per connection: after a plain request's response the connection closes, and
//! a CONNECT becomes a tunnel. Bytes the client sends after its head (a TLS hello pipelined
//! behind the CONNECT, or a smuggled second request) stay unread until the verdict, and for
//! plain requests only the body its framing announces is ever forwarded.

pub mod body;
pub mod decide;
pub mod head;
pub mod reply;
pub mod splice;
pub mod upstream;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::egress::origin::Scheme;
// The verdict on a connection, as egressd records and counts it (`decide::Verdict` is the
// policy's answer on a target).
use common::egress::protocol::Verdict as Decision;
use common::egress::route::{self, ProxySetting, Route};
use common::egress::target::{self, Host, Target};
use tokio::io::{AsyncBufRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::dns::Resolve;
use crate::own::OwnAddresses;
use body::RELAY_BUFFER;
use decide::{Policy, Verdict};
use head::{Framing, HeadError, RequestHead};
use upstream::{DialError, Upstream};

/// What every connection of every gateway shares.
#[derive(Debug)]
pub struct Shared {
    pub resolver: Arc<dyn Resolve>,
    pub own: OwnAddresses,
    pub header_timeout: Duration,
    pub connect_timeout: Duration,
    pub dns_timeout: Duration,
    pub tunnel_idle: Duration,
}

/// What happened on one connection: the audit record's fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub method: String,
    pub host: String,
    pub port: u16,
    /// `allowed`, `denied`, `malformed`, `failed` (allowed but the upstream failed), or
    /// `no_request` (the client closed or timed out before a complete head).
    pub decision: Decision,
    pub reason: String,
    pub address: Option<IpAddr>,
    /// The outbound proxy's endpoint label, when one was used (never its credentials).
    pub proxy: Option<String>,
    pub status: u16,
    /// Bytes sandbox → upstream and upstream → sandbox (bodies and tunnel data).
    pub up: u64,
    pub down: u64,
}

impl Record {
    fn refuse(&mut self, decision: Decision, status: u16, reason: impl Into<String>) {
        self.decision = decision;
        self.status = status;
        self.reason = reason.into();
    }
}

/// Serves one gateway connection and returns its record.
pub async fn serve(stream: UnixStream, policy: &Policy, setting: &ProxySetting, shared: &Shared) -> Record {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::with_capacity(RELAY_BUFFER, r);
    let mut rec = Record::default();
    let head = match tokio::time::timeout(shared.header_timeout, head::read_head(&mut r, head::parse_request))
        .await
    {
        Ok(Ok(head)) => head,
        Ok(Err(HeadError::Closed)) => {
            rec.refuse(
                Decision::NoRequest,
                0,
                "the client closed the connection before a complete request head",
            );
            return rec;
        }
        Err(_) => {
            let reason = HeadError::Timeout(shared.header_timeout).to_string();
            let _ = w.write_all(&reply::plain(400, &format!("Sandbox network access: {reason}"))).await;
            rec.refuse(Decision::NoRequest, 400, reason);
            return rec;
        }
        Ok(Err(e)) => {
            let reason = format!("Sandbox network access could not read the request: {e}");
            let _ = w.write_all(&reply::plain(400, &reason)).await;
            rec.refuse(Decision::Malformed, 400, reason);
            return rec;
        }
    };
    rec.method = head.method.clone();
    if head.method.eq_ignore_ascii_case("CONNECT") {
        connect(head, r, w, policy, setting, shared, &mut rec).await;
    } else {
        plain(head, r, w, policy, setting, shared, &mut rec).await;
    }
    rec
}

fn describe(t: &Target) -> String {
    t.host_text()
}

async fn verdict(policy: &Policy, scheme: Scheme, t: &Target, shared: &Shared) -> Verdict {
    let own = shared.own.get();
    decide::decide(policy, scheme, t, &*shared.resolver, &own, shared.dns_timeout).await
}

/// The name to dial or hand to a proxy: `decide` allows names only.
fn name_of(t: &Target) -> &str {
    match &t.host {
        Host::Name(n) => n,
        Host::Ip(_) | Host::NumericName(_) => "",
    }
}

/// Dials per the route; returns the connection and the failure text the sandbox may see.
async fn dial(
    setting: &ProxySetting,
    t: &Target,
    address: IpAddr,
    tls: bool,
    shared: &Shared,
    rec: &mut Record,
) -> Result<Upstream, (u16, String)> {
    let name = name_of(t);
    let route = route::route_for(setting, name, t.port, tls).map_err(|e| {
        rec.reason = e.to_string();
        (502, e.sandbox_reason().to_owned())
    })?;
    let dialled: Result<Upstream, DialError> = match &route {
        Route::Direct => upstream::direct(SocketAddr::new(address, t.port), shared.connect_timeout).await,
        Route::Proxy(ep) => {
            rec.proxy = Some(ep.label());
            if tls {
                upstream::tunnel_via_proxy(ep, name, t.port, &*shared.resolver, shared.connect_timeout).await
            } else {
                upstream::to_proxy(ep, &*shared.resolver, shared.connect_timeout).await
            }
        }
    };
    dialled.map_err(|e| {
        rec.reason = common::error_chain(&e);
        let safe = match route {
            Route::Direct => format!("Sandbox network access could not reach {name}: {e}"),
            Route::Proxy(_) => format!(
                "Sandbox network access could not reach {name}:{} through this deployment's outbound route",
                t.port
            ),
        };
        (e.status(), safe)
    })
}

async fn connect(
    head: RequestHead,
    r: BufReader<tokio::net::unix::OwnedReadHalf>,
    mut w: tokio::net::unix::OwnedWriteHalf,
    policy: &Policy,
    setting: &ProxySetting,
    shared: &Shared,
    rec: &mut Record,
) {
    let t = match target::parse_connect_authority(&head.target) {
        Ok(t) => t,
        Err(e) => {
            rec.host = head.target.chars().take(256).collect();
            let _ = w.write_all(&reply::connect(400, Some(&e.to_string()))).await;
            rec.refuse(Decision::Malformed, 400, e.to_string());
            return;
        }
    };
    (rec.host, rec.port) = (describe(&t), t.port);
    let address = match verdict(policy, Scheme::Https, &t, shared).await {
        Verdict::Deny { reason } => {
            let _ = w.write_all(&reply::connect(403, Some(&reason))).await;
            rec.refuse(Decision::Denied, 403, reason);
            return;
        }
        Verdict::Allow { address } => address,
    };
    rec.address = Some(address);
    let up = match dial(setting, &t, address, true, shared, rec).await {
        Ok(up) => up,
        Err((status, safe)) => {
            let _ = w.write_all(&reply::connect(status, Some(&safe))).await;
            (rec.decision, rec.status) = (Decision::Failed, status);
            return;
        }
    };
    if w.write_all(&reply::connect(200, None)).await.is_err() {
        rec.refuse(Decision::Failed, 200, "the client went away before the tunnel opened");
        return;
    }
    (rec.decision, rec.status) = (Decision::Allowed, 200);
    let moved = splice::tunnel(r, w, up.read, up.write, shared.tunnel_idle).await;
    (rec.up, rec.down) = (moved.up, moved.down);
    if moved.idle_timeout {
        rec.reason = format!("closed after {} ms without traffic", shared.tunnel_idle.as_millis());
    }
}

/// `Host` for the upstream: the target's authority, the port only when not 80.
fn host_header(t: &Target) -> String {
    let host = match &t.host {
        Host::Ip(IpAddr::V6(v6)) => format!("[{v6}]"),
        _ => t.host_text(),
    };
    if t.port == 80 { host } else { format!("{host}:{}", t.port) }
}

/// A plain-HTTP request: admitted, its head rewritten for the upstream, then the exchange.
async fn plain(
    head: RequestHead,
    mut r: BufReader<tokio::net::unix::OwnedReadHalf>,
    mut w: tokio::net::unix::OwnedWriteHalf,
    policy: &Policy,
    setting: &ProxySetting,
    shared: &Shared,
    rec: &mut Record,
) {
    let Some((t, origin, framing, mut up)) = admit_plain(&head, &mut w, policy, setting, shared, rec).await
    else {
        return;
    };
    let upstream_head = upstream_head(&head, &t, &origin, framing, setting, rec.proxy.is_some());
    if let Err(e) = up.write.write_all(&upstream_head).await {
        let safe = format!("Sandbox network access could not reach {}: {e}", name_of(&t));
        let _ = w.write_all(&reply::plain(502, &safe)).await;
        rec.refuse(Decision::Failed, 502, safe);
        return;
    }
    (rec.decision, rec.status) = (Decision::Allowed, 0);
    let outcome = exchange(&head.method, &mut r, &mut w, &mut up, framing, shared.tunnel_idle, rec).await;
    answer_outcome(outcome, &t, &mut w, shared.tunnel_idle, rec).await;
    let _ = w.shutdown().await;
}

/// The target, its origin-form path, the body's framing and the upstream connection of an
/// allowed request; `None` once a refusal has been answered and recorded.
async fn admit_plain(
    head: &RequestHead,
    w: &mut tokio::net::unix::OwnedWriteHalf,
    policy: &Policy,
    setting: &ProxySetting,
    shared: &Shared,
    rec: &mut Record,
) -> Option<(Target, String, Framing, Upstream)> {
    let (t, origin) = match target::parse_absolute_url(&head.target) {
        Ok(parsed) => parsed,
        Err(e) => {
            rec.host = head.target.chars().take(256).collect();
            let _ = w.write_all(&reply::plain(400, &e.to_string())).await;
            rec.refuse(Decision::Malformed, 400, e.to_string());
            return None;
        }
    };
    (rec.host, rec.port) = (describe(&t), t.port);
    let framing = match head::request_framing(&head.headers) {
        Ok(f) => f,
        Err(why) => {
            let reason = format!("Sandbox network access refuses this request: {why}");
            let _ = w.write_all(&reply::plain(400, &reason)).await;
            rec.refuse(Decision::Malformed, 400, reason);
            return None;
        }
    };
    let address = match verdict(policy, Scheme::Http, &t, shared).await {
        Verdict::Deny { reason } => {
            let _ = w.write_all(&reply::plain(403, &reason)).await;
            rec.refuse(Decision::Denied, 403, reason);
            return None;
        }
        Verdict::Allow { address } => address,
    };
    rec.address = Some(address);
    match dial(setting, &t, address, false, shared, rec).await {
        Ok(up) => Some((t, origin, framing, up)),
        Err((status, safe)) => {
            let _ = w.write_all(&reply::plain(status, &safe)).await;
            (rec.decision, rec.status) = (Decision::Failed, status);
            None
        }
    }
}

/// The request head as the upstream gets it: origin-form (absolute-form to a proxy, with
/// its authorization), `Host` first, end-to-end headers with the body's framing, and
/// `Connection: close`.
fn upstream_head(
    head: &RequestHead,
    t: &Target,
    origin: &str,
    framing: Framing,
    setting: &ProxySetting,
    via_proxy: bool,
) -> Vec<u8> {
    let host = host_header(t);
    let line = if via_proxy {
        format!("{} http://{host}{origin} HTTP/1.1", head.method)
    } else {
        format!("{} {origin} HTTP/1.1", head.method)
    };
    let mut headers = vec![("Host".to_owned(), host.clone().into_bytes())];
    headers.extend(head::with_framing(head::end_to_end(&head.headers), framing));
    if via_proxy
        && let Ok(Route::Proxy(ep)) = route::route_for(setting, name_of(t), t.port, false)
        && let Some(auth) = ep.authorization
    {
        headers.push(("Proxy-Authorization".to_owned(), auth.into_bytes()));
    }
    headers.push(("Connection".to_owned(), b"close".to_vec()));
    head::write_head(&line, &headers)
}

/// The request body up and the response down, together, until the response ends or
/// nothing moves either way for `tunnel_idle` — not a deadline for the whole exchange: a
/// long download that keeps flowing is never cut.
async fn exchange(
    method: &str,
    r: &mut BufReader<tokio::net::unix::OwnedReadHalf>,
    w: &mut tokio::net::unix::OwnedWriteHalf,
    up: &mut Upstream,
    framing: Framing,
    tunnel_idle: Duration,
    rec: &mut Record,
) -> Result<(u16, u64), ResponseError> {
    let start = std::time::Instant::now();
    let activity = std::sync::atomic::AtomicU64::new(0);
    let head_sent = std::sync::atomic::AtomicBool::new(false);
    let mut outcome: Option<Result<(u16, u64), ResponseError>> = None;
    let idle = {
        let mut up_write = Watched { inner: &mut up.write, activity: &activity, start };
        let mut client_write = Watched { inner: w, activity: &activity, start };
        let exchange = async {
            let request_body = body::copy_body(r, &mut up_write, framing);
            let response = forward_response(&mut up.read, &mut client_write, method, &head_sent);
            tokio::pin!(request_body, response);
            let mut body_done = false;
            loop {
                tokio::select! {
                    sent = &mut request_body, if !body_done => {
                        body_done = true;
                        match sent {
                            Ok(n) => rec.up = n,
                            Err(e) => rec.reason = format!("the request body could not be forwarded: {e}"),
                        }
                    }
                    got = &mut response => {
                        outcome = Some(got);
                        break;
                    }
                }
            }
        };
        body::until_idle(exchange, &activity, start, tunnel_idle).await
    };
    match (idle, outcome) {
        (false, Some(got)) => got,
        _ if !head_sent.load(std::sync::atomic::Ordering::Relaxed) => Err(ResponseError::IdleBeforeHead),
        _ => Err(ResponseError::Idle),
    }
}

/// Records how the exchange ended, answering the client when it has had no response head.
async fn answer_outcome(
    outcome: Result<(u16, u64), ResponseError>,
    t: &Target,
    w: &mut tokio::net::unix::OwnedWriteHalf,
    tunnel_idle: Duration,
    rec: &mut Record,
) {
    match outcome {
        Ok((status, n)) => (rec.status, rec.down) = (status, n),
        Err(ResponseError::BeforeHead(e)) => {
            let safe = format!("Sandbox network access could not reach {}: {e}", name_of(t));
            let _ = w.write_all(&reply::plain(502, &safe)).await;
            rec.refuse(Decision::Failed, 502, safe);
        }
        Err(ResponseError::IdleBeforeHead) => {
            let safe = format!(
                "Sandbox network access: {} did not answer within {} ms",
                name_of(t),
                tunnel_idle.as_millis()
            );
            let _ = w.write_all(&reply::plain(504, &safe)).await;
            rec.refuse(Decision::Failed, 504, safe);
        }
        Err(ResponseError::Idle) => {
            rec.reason = format!("nothing moved for {} ms; connection closed", tunnel_idle.as_millis())
        }
        Err(ResponseError::AfterHead(status, e)) => {
            rec.status = status;
            rec.reason = format!("the response body was cut short: {e}");
        }
    }
}

#[derive(Debug)]
enum ResponseError {
    BeforeHead(HeadError),
    AfterHead(u16, std::io::Error),
    IdleBeforeHead,
    Idle,
}

/// A writer that records when it last wrote (ms since `start`), for the idle timeout.
struct Watched<'a, W> {
    inner: W,
    activity: &'a std::sync::atomic::AtomicU64,
    start: std::time::Instant,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Watched<'_, W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &polled
            && *n > 0
        {
            self.activity
                .store(self.start.elapsed().as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Forwards the upstream's response (1xx interim heads included) with hop-by-hop headers
/// dropped and `Connection: close`; returns the final status and the bytes sent.
async fn forward_response(
    up: &mut (impl AsyncBufRead + Unpin),
    w: &mut (impl AsyncWrite + Unpin),
    method: &str,
    head_sent: &std::sync::atomic::AtomicBool,
) -> Result<(u16, u64), ResponseError> {
    loop {
        let resp = head::read_head(up, head::parse_response).await.map_err(ResponseError::BeforeHead)?;
        let interim = (100..200).contains(&resp.status) && resp.status != 101;
        let mut headers = head::end_to_end(&resp.headers);
        if !interim {
            headers.push(("Connection".to_owned(), b"close".to_vec()));
        }
        let line = format!("HTTP/1.1 {} {}", resp.status, resp.reason);
        let bytes = head::write_head(&line, &headers);
        w.write_all(&bytes).await.map_err(|e| ResponseError::AfterHead(resp.status, e))?;
        head_sent.store(true, std::sync::atomic::Ordering::Relaxed);
        if interim {
            continue;
        }
        let framing = if resp.status == 101 {
            Framing::None
        } else {
            head::response_framing(method, resp.status, &resp.headers)
        };
        let n =
            body::copy_body(up, w, framing).await.map_err(|e| ResponseError::AfterHead(resp.status, e))?;
        return Ok((resp.status, bytes.len() as u64 + n));
    }
}

#[cfg(test)]
mod tests;
