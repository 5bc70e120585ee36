//! The client side, one code path for every case: connect (TCP or the gateway's Unix
//! socket), optionally CONNECT through a proxy, then `GET` and read the whole response in
//! 128 KiB reads. Only how the first byte stream is obtained differs between cases.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use anyhow::{Context, bail};

/// Every read of the client is at most this many bytes.
pub const READ_BUFFER: usize = 128 * 1024;
/// A response or CONNECT head larger than this is refused.
const MAX_HEAD: usize = 16 * 1024;

/// How a case reaches the upstream.
#[derive(Debug, Clone)]
pub enum Route {
    /// (a) TCP straight to the upstream on 127.0.0.1.
    Direct { upstream_port: u16 },
    /// (b) egressd's gateway socket, `CONNECT bench.test:<port>`.
    Gateway { socket: PathBuf, upstream_port: u16 },
    /// (c) tinyproxy on 127.0.0.1, `CONNECT localhost:<port>`.
    Tinyproxy { proxy_port: u16, upstream_port: u16 },
}

impl Route {
    /// The authority the request names (the `Host` header; CONNECT's target for proxies).
    fn authority(&self) -> String {
        match self {
            Route::Direct { upstream_port } => format!("127.0.0.1:{upstream_port}"),
            Route::Gateway { upstream_port, .. } => format!("{}:{upstream_port}", super::BENCH_NAME),
            Route::Tinyproxy { upstream_port, .. } => format!("localhost:{upstream_port}"),
        }
    }
}

#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The status and `Content-Length` of a response head (`head` ends with the blank line).
pub fn parse_head(head: &[u8]) -> anyhow::Result<(u16, Option<u64>)> {
    let text = std::str::from_utf8(head).context("the response head is not UTF-8")?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        bail!("malformed status line {status_line:?}")
    };
    if !version.starts_with("HTTP/1.") {
        bail!("not an HTTP/1 status line: {status_line:?}");
    }
    let status = code.parse().with_context(|| format!("malformed status line {status_line:?}"))?;
    let mut length = None;
    for line in lines {
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = Some(value.trim().parse().with_context(|| format!("bad Content-Length {value:?}"))?);
        }
    }
    Ok((status, length))
}

/// One client connection with its read buffer; `buf[start..end]` holds bytes read past the
/// last head.
#[derive(Debug)]
pub struct Conn {
    stream: Stream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Conn {
    /// Connects per `route`; through a proxy, returns once the tunnel is established.
    pub fn open(route: &Route) -> anyhow::Result<Conn> {
        let tcp = |port| -> anyhow::Result<Stream> {
            let s = TcpStream::connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
                .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
            s.set_nodelay(true)?;
            Ok(Stream::Tcp(s))
        };
        let stream = match route {
            Route::Direct { upstream_port } => tcp(*upstream_port)?,
            Route::Gateway { socket, .. } => Stream::Unix(
                UnixStream::connect(socket).with_context(|| format!("connecting to {}", socket.display()))?,
            ),
            Route::Tinyproxy { proxy_port, .. } => tcp(*proxy_port)?,
        };
        let mut conn = Conn { stream, buf: vec![0u8; READ_BUFFER], start: 0, end: 0 };
        if !matches!(route, Route::Direct { .. }) {
            let authority = route.authority();
            let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
            conn.stream.write_all(request.as_bytes()).context("sending CONNECT")?;
            let (status, _) = conn.read_head().context("reading the CONNECT answer")?;
            if status != 200 {
                bail!("CONNECT {authority} answered {status}");
            }
        }
        Ok(conn)
    }

    /// Reads up to and including the blank line; returns the head's status and length.
    fn read_head(&mut self) -> anyhow::Result<(u16, Option<u64>)> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        loop {
            if let Some(i) = self.buf[..self.end].windows(4).position(|w| w == b"\r\n\r\n") {
                let parsed = parse_head(&self.buf[..i + 4]);
                self.start = i + 4;
                return parsed;
            }
            if self.end >= MAX_HEAD {
                bail!("no end of head within {MAX_HEAD} bytes");
            }
            let n = self.stream.read(&mut self.buf[self.end..])?;
            if n == 0 {
                bail!("the connection closed before a complete head");
            }
            self.end += n;
        }
    }

    /// `GET path` and the whole response; returns the body's length (checked against
    /// `Content-Length`).
    pub fn get(&mut self, path: &str) -> anyhow::Result<u64> {
        let request = format!("GET {path} HTTP/1.1\r\nHost: upstream\r\nConnection: close\r\n\r\n");
        self.stream.write_all(request.as_bytes()).context("sending the request")?;
        let (status, length) = self.read_head().context("reading the response head")?;
        let length = length.context("the response has no Content-Length")?;
        if status != 200 {
            bail!("GET {path} answered {status}");
        }
        let mut got = (self.end - self.start) as u64;
        (self.start, self.end) = (0, 0);
        while got < length {
            let n = self.stream.read(&mut self.buf)?;
            if n == 0 {
                bail!("the body ended after {got} of {length} bytes");
            }
            got += n as u64;
        }
        if got != length {
            bail!("{got} body bytes where Content-Length says {length}");
        }
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads() {
        let ok = b"HTTP/1.1 200 OK\r\nContent-Type: x\r\ncontent-length:  42 \r\n\r\n";
        assert_eq!(parse_head(ok).unwrap(), (200, Some(42)));
        let tinyproxy = b"HTTP/1.0 200 Connection established\r\nProxy-agent: tinyproxy/1.11.1\r\n\r\n";
        assert_eq!(parse_head(tinyproxy).unwrap(), (200, None));
        assert_eq!(parse_head(b"HTTP/1.1 403 Forbidden\r\n\r\n").unwrap(), (403, None));
        for bad in [
            &b"SSH-2.0\r\n\r\n"[..],
            b"HTTP/1.1 abc\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        ] {
            assert!(parse_head(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
