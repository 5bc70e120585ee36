//! What the bench serves itself: the upstream HTTP server every case reaches, and the DNS
//! responder egressd resolves `bench.test` through. Threads, blocking I/O.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;

use crate::dns::wire;

/// The upstream writes its bulk bodies in pieces this large.
const WRITE_CHUNK: usize = 128 * 1024;
/// The `/small` body.
pub const SMALL_BODY: &[u8] = b"ok\n";

/// What a request line asks the upstream for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    Bulk(u64),
    Small,
    Unknown,
}

/// `GET /bulk?n=N` or `GET /small`, from the request head's first line.
pub fn parse_request_line(line: &str) -> Ask {
    let mut parts = line.split(' ');
    let (Some("GET"), Some(target)) = (parts.next(), parts.next()) else { return Ask::Unknown };
    if target == "/small" {
        return Ask::Small;
    }
    match target.strip_prefix("/bulk?n=").and_then(|n| n.parse().ok()) {
        Some(n) => Ask::Bulk(n),
        None => Ask::Unknown,
    }
}

/// The HTTP/1.1 upstream on 127.0.0.1 (and on `[::1]` with the same port where it can be
/// bound, so a proxy whose `localhost` resolves to `::1` first never takes a refused dial).
/// One thread per connection, one request per connection.
#[derive(Debug)]
pub struct Upstream {
    pub port: u16,
    /// Connections accepted over IPv4 and over IPv6.
    pub accepted: Arc<[AtomicU64; 2]>,
}

impl Upstream {
    pub fn start() -> anyhow::Result<Upstream> {
        let v4 = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding the upstream on 127.0.0.1")?;
        let port = v4.local_addr()?.port();
        let accepted: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let mut listeners = vec![(v4, 0)];
        if let Ok(v6) = TcpListener::bind((Ipv6Addr::LOCALHOST, port)) {
            listeners.push((v6, 1));
        }
        for (listener, family) in listeners {
            let accepted = accepted.clone();
            std::thread::Builder::new().name("upstream-accept".into()).spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    accepted[family].fetch_add(1, Ordering::Relaxed);
                    let _ = std::thread::Builder::new().name("upstream".into()).spawn(move || serve(stream));
                }
            })?;
        }
        Ok(Upstream { port, accepted })
    }
}

fn serve(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 16 * 1024 {
            return;
        }
    }
    let text = String::from_utf8_lossy(&head);
    let first = text.lines().next().unwrap_or_default();
    let _ = match parse_request_line(first) {
        Ask::Small => {
            let mut reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                SMALL_BODY.len()
            )
            .into_bytes();
            reply.extend_from_slice(SMALL_BODY);
            stream.write_all(&reply)
        }
        Ask::Bulk(n) => send_bulk(&mut stream, n),
        Ask::Unknown => {
            stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        }
    };
}

fn send_bulk(stream: &mut TcpStream, n: u64) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes())?;
    let chunk = vec![0x5au8; WRITE_CHUNK];
    let mut left = n;
    while left > 0 {
        let take = left.min(WRITE_CHUNK as u64) as usize;
        stream.write_all(&chunk[..take])?;
        left -= take as u64;
    }
    Ok(())
}

/// A UDP DNS responder on 127.0.0.1: `name` → `address` (A only; AAAA empty), NXDOMAIN for
/// anything else.
pub fn start_dns(name: &str, address: Ipv4Addr) -> anyhow::Result<SocketAddr> {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).context("binding the DNS responder")?;
    let addr = socket.local_addr()?;
    let name = name.to_ascii_lowercase();
    std::thread::Builder::new().name("dns".into()).spawn(move || {
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf) else { return };
            let Ok(q) = wire::parse_query(&buf[..n]) else { continue };
            let answer = if q.name.eq_ignore_ascii_case(&name) {
                wire::encode_answer(&q, &[IpAddr::V4(address)], 60, wire::RCODE_NOERROR)
            } else {
                wire::encode_answer(&q, &[], 0, wire::RCODE_NXDOMAIN)
            };
            let _ = socket.send_to(&answer, from);
        }
    })?;
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines() {
        let cases = [
            ("GET /small HTTP/1.1", Ask::Small),
            ("GET /bulk?n=1048576 HTTP/1.1", Ask::Bulk(1_048_576)),
            ("GET /bulk?n=x HTTP/1.1", Ask::Unknown),
            ("POST /small HTTP/1.1", Ask::Unknown),
            ("", Ask::Unknown),
        ];
        for (line, want) in cases {
            assert_eq!(parse_request_line(line), want, "{line:?}");
        }
    }
}
