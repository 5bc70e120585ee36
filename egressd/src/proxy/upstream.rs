//! Dialling: the vetted address directly, or through the deployment's outbound proxy
//! (internals §3.7). What the sandbox learns of a failure never names the proxy, its
//! address or its credentials; the audit record names the proxy's endpoint only.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use common::egress::route::ProxyEndpoint;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::body::RELAY_BUFFER;
use super::head::{self, HeadError};
use crate::dns::Resolve;

/// How long an upstream proxy may take to answer a CONNECT (the original's constant).
pub const PROXY_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("no connection within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Connect(std::io::Error),
    #[error("the outbound proxy's name could not be resolved")]
    ProxyName,
    #[error("the outbound proxy did not answer the CONNECT within {0:?}")]
    ProxyTimeout(Duration),
    #[error("the outbound proxy closed the connection before completing the CONNECT")]
    ProxyClosed,
    #[error("the outbound proxy answered the CONNECT with status {0}")]
    ProxyStatus(u16),
    #[error("the outbound proxy's answer is not HTTP")]
    ProxyMalformed(#[source] HeadError),
    #[error("writing to the outbound proxy failed")]
    ProxyWrite(#[source] std::io::Error),
}

impl DialError {
    /// 504 for timeouts, 502 for everything else.
    pub fn status(&self) -> u16 {
        match self {
            DialError::Timeout(_) | DialError::ProxyTimeout(_) => 504,
            _ => 502,
        }
    }
}

/// An upstream connection, read side buffered (it may already hold bytes).
#[derive(Debug)]
pub struct Upstream {
    pub read: BufReader<OwnedReadHalf>,
    pub write: OwnedWriteHalf,
    pub peer: SocketAddr,
}

impl Upstream {
    fn new(stream: TcpStream) -> Upstream {
        let _ = stream.set_nodelay(true);
        let peer = stream.peer_addr().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let (r, w) = stream.into_split();
        Upstream { read: BufReader::with_capacity(RELAY_BUFFER, r), write: w, peer }
    }
}

/// Connects to exactly `addr` (already vetted).
pub async fn direct(addr: SocketAddr, timeout: Duration) -> Result<Upstream, DialError> {
    match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => Ok(Upstream::new(s)),
        Ok(Err(e)) => Err(DialError::Connect(e)),
        Err(_) => Err(DialError::Timeout(timeout)),
    }
}

/// Connects to the outbound proxy (its name, if any, resolved with our resolver; the
/// operator chose it, so its address is not classified).
pub async fn to_proxy(
    ep: &ProxyEndpoint,
    resolver: &dyn Resolve,
    timeout: Duration,
) -> Result<Upstream, DialError> {
    let host = ep.host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = match host.parse() {
        Ok(ip) => ip,
        Err(_) => {
            let found = tokio::time::timeout(timeout, resolver.lookup(host)).await;
            match found {
                Ok(Ok(addrs)) if !addrs.is_empty() => addrs[0],
                _ => return Err(DialError::ProxyName),
            }
        }
    };
    direct(SocketAddr::new(ip, ep.port), timeout).await
}

/// The CONNECT request sent to an outbound proxy.
pub fn connect_request(ep: &ProxyEndpoint, host: &str, port: u16) -> Vec<u8> {
    let authority = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let mut out = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n");
    if let Some(auth) = &ep.authorization {
        out.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
    }
    out.push_str("Proxy-Connection: keep-alive\r\n\r\n");
    out.into_bytes()
}

/// Opens a tunnel to `host:port` through the proxy. Bytes the proxy sends after its 200
/// stay in the returned reader and reach the sandbox first.
pub async fn tunnel_via_proxy(
    ep: &ProxyEndpoint,
    host: &str,
    port: u16,
    resolver: &dyn Resolve,
    connect_timeout: Duration,
) -> Result<Upstream, DialError> {
    let mut up = to_proxy(ep, resolver, connect_timeout).await?;
    let handshake = async {
        up.write.write_all(&connect_request(ep, host, port)).await.map_err(DialError::ProxyWrite)?;
        let answer = head::read_head(&mut up.read, head::parse_response).await;
        match answer {
            Ok(h) if h.status == 200 => Ok(()),
            Ok(h) => Err(DialError::ProxyStatus(h.status)),
            Err(HeadError::Closed) => Err(DialError::ProxyClosed),
            Err(e) => Err(DialError::ProxyMalformed(e)),
        }
    };
    match tokio::time::timeout(PROXY_HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(())) => Ok(up),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(DialError::ProxyTimeout(PROXY_HANDSHAKE_TIMEOUT)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connect_request_carries_credentials_only_to_the_proxy() {
        let ep =
            ProxyEndpoint { host: "proxy.corp".into(), port: 3128, authorization: Some("Basic cmU=".into()) };
        let text = String::from_utf8(connect_request(&ep, "pypi.org", 443)).unwrap();
        assert_eq!(
            text,
            "CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nProxy-Authorization: Basic cmU=\r\nProxy-Connection: keep-alive\r\n\r\n"
        );
    }

    #[test]
    fn timeouts_are_504_and_the_rest_502() {
        assert_eq!(DialError::Timeout(Duration::from_secs(1)).status(), 504);
        assert_eq!(DialError::ProxyStatus(407).status(), 502);
        assert_eq!(DialError::Connect(std::io::ErrorKind::ConnectionRefused.into()).status(), 502);
    }
}
