//! Moving bytes: a message body by its framing (so that nothing after it — a pipelined
//! second request — ever reaches the upstream), and a tunnel both ways with an idle timeout
//! and byte counts for the audit record.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::head::Framing;

/// Read buffer of the connections' buffered readers: room for a request or response head;
/// larger reads (bodies) bypass it.
pub const RELAY_BUFFER: usize = 16 * 1024;
/// What body copies move per read.
const COPY_BUFFER: usize = 64 * 1024;
/// A chunk-size or trailer line longer than this is malformed.
const MAX_LINE: usize = 4096;

fn invalid(msg: &'static str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// Copies exactly `n` bytes.
async fn copy_exact(
    r: &mut (impl AsyncRead + Unpin),
    w: &mut (impl AsyncWrite + Unpin),
    mut n: u64,
) -> std::io::Result<u64> {
    let total = n;
    let mut buf = vec![0u8; COPY_BUFFER];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        let got = r.read(&mut buf[..want]).await?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        w.write_all(&buf[..got]).await?;
        n -= got as u64;
    }
    Ok(total)
}

async fn read_line(r: &mut (impl AsyncBufRead + Unpin), line: &mut Vec<u8>) -> std::io::Result<()> {
    line.clear();
    let n = (&mut *r).take(MAX_LINE as u64 + 1).read_until(b'\n', line).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if n > MAX_LINE || !line.ends_with(b"\n") {
        return Err(invalid("a chunked body line is too long"));
    }
    Ok(())
}

/// The size in a chunk-size line (`1a;ext=1\r\n`).
pub fn chunk_size(line: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(line).ok()?;
    let size = text.trim_end_matches(['\r', '\n']).split(';').next()?.trim();
    if size.is_empty() || size.len() > 15 || !size.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(size, 16).ok()
}

/// Copies one chunked body, re-encoded canonically: `<hex size>\r\n<data>\r\n` per chunk and
/// a final `0\r\n\r\n`. Extensions and trailers are dropped, so odd spellings (bare CR,
/// padded sizes, extensions) that another parser might read differently never travel on.
async fn copy_chunked(
    r: &mut (impl AsyncBufRead + Unpin),
    w: &mut (impl AsyncWrite + Unpin),
) -> std::io::Result<u64> {
    let mut total = 0;
    let mut line = Vec::with_capacity(64);
    loop {
        read_line(r, &mut line).await?;
        let size = chunk_size(&line).ok_or_else(|| invalid("a chunk size is not hexadecimal"))?;
        if size == 0 {
            // Trailers end at the first empty line; none is forwarded.
            loop {
                read_line(r, &mut line).await?;
                if line == b"\r\n" || line == b"\n" {
                    break;
                }
            }
            w.write_all(b"0\r\n\r\n").await?;
            return Ok(total + 5);
        }
        let head = format!("{size:x}\r\n");
        w.write_all(head.as_bytes()).await?;
        total += head.len() as u64 + copy_exact(r, w, size).await?;
        read_line(r, &mut line).await?;
        if line != b"\r\n" && line != b"\n" {
            return Err(invalid("a chunk is longer than its size says"));
        }
        w.write_all(b"\r\n").await?;
        total += 2;
    }
}

/// Copies one body by its framing; `UntilClose` copies to end of file.
pub async fn copy_body(
    r: &mut (impl AsyncBufRead + Unpin),
    w: &mut (impl AsyncWrite + Unpin),
    framing: Framing,
) -> std::io::Result<u64> {
    let n = match framing {
        Framing::None => 0,
        Framing::Length(n) => copy_exact(r, w, n).await?,
        Framing::Chunked => copy_chunked(r, w).await?,
        Framing::UntilClose => tokio::io::copy_buf(r, w).await?,
    };
    w.flush().await?;
    Ok(n)
}

/// Bytes moved by a relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Sandbox → upstream.
    pub up: u64,
    /// Upstream → sandbox.
    pub down: u64,
    pub idle_timeout: bool,
}

async fn pump(
    mut r: impl AsyncRead + Unpin,
    mut w: impl AsyncWrite + Unpin,
    count: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            // Half-close: the other direction may still be talking.
            let _ = w.shutdown().await;
            return Ok(());
        }
        w.write_all(&buf[..n]).await?;
        count.fetch_add(n as u64, Ordering::Relaxed);
        activity.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// Runs `work` until it finishes (`false`) or nothing moved for `idle` (`true`); the pumps
/// store the time of their last transfer (ms since `start`) in `activity`.
pub async fn until_idle(
    work: impl std::future::Future<Output = ()>,
    activity: &AtomicU64,
    start: Instant,
    idle: Duration,
) -> bool {
    let watchdog = async {
        let tick = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
        loop {
            tokio::time::sleep(tick).await;
            let last = Duration::from_millis(activity.load(Ordering::Relaxed));
            if start.elapsed().saturating_sub(last) >= idle {
                return;
            }
        }
    };
    tokio::select! {
        _ = work => false,
        _ = watchdog => true,
    }
}

/// Relays both ways until both sides finish, either side fails, or nothing moved for `idle`.
/// Readers may be buffered: bytes they already hold go first. (Tunnels between real sockets
/// use [`super::splice::tunnel`]; this generic form serves tests and other streams.)
pub async fn relay(
    client_read: impl AsyncRead + Unpin,
    client_write: impl AsyncWrite + Unpin,
    upstream_read: impl AsyncRead + Unpin,
    upstream_write: impl AsyncWrite + Unpin,
    idle: Duration,
) -> Moved {
    let start = Instant::now();
    let (up, down, activity) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let both = async {
        let _ = tokio::join!(
            pump(client_read, upstream_write, &up, &activity, start),
            pump(upstream_read, client_write, &down, &activity, start)
        );
    };
    let idle_timeout = until_idle(both, &activity, start, idle).await;
    Moved { up: up.load(Ordering::Relaxed), down: down.load(Ordering::Relaxed), idle_timeout }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::BufReader;

    #[test]
    fn chunk_sizes() {
        assert_eq!(chunk_size(b"1a\r\n"), Some(26));
        assert_eq!(chunk_size(b"0\r\n"), Some(0));
        assert_eq!(chunk_size(b"A;name=v\r\n"), Some(10));
        assert_eq!(chunk_size(b"\r\n"), None);
        assert_eq!(chunk_size(b"-1\r\n"), None);
        assert_eq!(chunk_size(b"0x10\r\n"), None);
        assert_eq!(chunk_size(b"ffffffffffffffff\r\n"), None);
    }

    #[tokio::test]
    async fn a_chunked_body_stops_at_its_end_and_leaves_what_follows() {
        let raw = b"005;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\nGET http://evil.example/ HTTP/1.1\r\n\r\n";
        let mut r = BufReader::new(&raw[..]);
        let mut out = Vec::new();
        let n = copy_body(&mut r, &mut out, Framing::Chunked).await.unwrap();
        assert_eq!(out, b"5\r\nhello\r\n0\r\n\r\n", "re-encoded: no extension, no trailer");
        assert_eq!(n as usize, out.len());
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert!(rest.starts_with(b"GET http://evil.example/"));
    }

    #[tokio::test]
    async fn malformed_chunks_fail() {
        for raw in [&b"zz\r\nhello\r\n0\r\n\r\n"[..], b"3\r\nhello\r\n0\r\n\r\n", b"5\r\nhel"] {
            let mut out = Vec::new();
            assert!(
                copy_body(&mut BufReader::new(raw), &mut out, Framing::Chunked).await.is_err(),
                "{raw:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_length_body_copies_exactly() {
        let raw = b"abcdefGET /";
        let mut r = BufReader::new(&raw[..]);
        let mut out = Vec::new();
        copy_body(&mut r, &mut out, Framing::Length(6)).await.unwrap();
        assert_eq!(out, b"abcdef");
        let mut short = BufReader::new(&b"abc"[..]);
        assert!(copy_body(&mut short, &mut Vec::new(), Framing::Length(6)).await.is_err());
    }

    #[tokio::test]
    async fn relay_counts_both_ways_and_times_out_when_idle() {
        let (client, mut client_peer) = tokio::io::duplex(1 << 16);
        let (upstream, mut upstream_peer) = tokio::io::duplex(1 << 16);
        let (cr, cw) = tokio::io::split(client);
        let (ur, uw) = tokio::io::split(upstream);
        let task = tokio::spawn(relay(cr, cw, ur, uw, Duration::from_millis(200)));
        client_peer.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        upstream_peer.read_exact(&mut buf).await.unwrap();
        upstream_peer.write_all(b"pong!").await.unwrap();
        let mut buf = [0u8; 5];
        client_peer.read_exact(&mut buf).await.unwrap();
        // Nothing more moves: the watchdog ends it.
        let moved = task.await.unwrap();
        assert_eq!(moved, Moved { up: 4, down: 5, idle_timeout: true });
    }
}
