//! The tunnel's data path without copies through egressd: each direction moves bytes
//! socket → pipe → socket with `splice(2)`, so the kernel hands pages along instead of
//! egressd reading them into a buffer and writing them out again. Measured on the bulk
//! benchmark (`scripts/bench egress`); a direction whose sockets the kernel cannot splice
//! (EINVAL on the first call) falls back to the copying pump in [`super::body`].

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::sys::cvt;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{TcpStream, UnixStream, tcp, unix};

use super::body::{Moved, until_idle};

/// Bytes asked of one splice; the pipe holds 64 KiB unless the kernel grants more.
const CHUNK: usize = 256 * 1024;

/// A tokio socket we can wait on and splice from or to.
pub trait Spliceable: AsFd {
    fn ready(&self, interest: Interest) -> impl Future<Output = io::Result<()>>;
    fn attempt(&self, interest: Interest, f: impl FnOnce() -> io::Result<usize>) -> io::Result<usize>;
}

impl Spliceable for TcpStream {
    async fn ready(&self, interest: Interest) -> io::Result<()> {
        TcpStream::ready(self, interest).await.map(drop)
    }
    fn attempt(&self, interest: Interest, f: impl FnOnce() -> io::Result<usize>) -> io::Result<usize> {
        self.try_io(interest, f)
    }
}

impl Spliceable for UnixStream {
    async fn ready(&self, interest: Interest) -> io::Result<()> {
        UnixStream::ready(self, interest).await.map(drop)
    }
    fn attempt(&self, interest: Interest, f: impl FnOnce() -> io::Result<usize>) -> io::Result<usize> {
        self.try_io(interest, f)
    }
}

fn splice(from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the duration of the call (borrowed); null
    // offsets are what splice requires for pipes and sockets; no memory is passed.
    let n = cvt(unsafe {
        libc::splice(
            from.as_raw_fd(),
            std::ptr::null_mut(),
            to.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    })?;
    Ok(n.unsigned_abs())
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
        .map_err(io::Error::from)?;
    // Best effort: a bigger pipe means fewer wake-ups; the per-user pipe quota may refuse
    // (EPERM), and the default size works.
    // SAFETY: F_SETPIPE_SZ takes an int argument and no memory.
    let _ = cvt(unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, CHUNK as libc::c_int) });
    Ok((r, w))
}

/// Receives into `buf`'s spare capacity (no zeroing) and extends it by what arrived.
fn recv(fd: BorrowedFd<'_>, buf: &mut Vec<u8>) -> io::Result<usize> {
    let spare = buf.spare_capacity_mut();
    // SAFETY: `spare` is valid for writes of `spare.len()` bytes for the duration of the call.
    let n = cvt(unsafe {
        libc::recv(fd.as_raw_fd(), spare.as_mut_ptr().cast(), spare.len(), libc::MSG_DONTWAIT)
    })?
    .unsigned_abs();
    // SAFETY: the kernel initialised the first `n` bytes of the spare capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Ok(n)
}

fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call.
    let n = cvt(unsafe {
        libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    })?;
    Ok(n.unsigned_abs())
}

fn shutdown_write(fd: BorrowedFd<'_>) {
    // Ignored: ENOTCONN means the peer is already gone, and the relay ends either way.
    // SAFETY: shutdown on a socket we borrow; no memory is passed.
    let _ = cvt(unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_WR) });
}

/// After a failure in one direction: end both sockets, so the other direction wakes up
/// instead of waiting for the idle timeout.
fn shutdown_both(a: BorrowedFd<'_>, b: BorrowedFd<'_>) {
    for fd in [a, b] {
        // SAFETY: shutdown on a socket we borrow; no memory is passed. Ignored as above.
        let _ = cvt(unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) });
    }
}

/// Why a direction's pump stopped.
enum Stop {
    Done,
    /// Copying found a bulk transfer: switch to splicing.
    Upgrade,
    /// The first splice was refused: nothing moved, the caller copies instead.
    Unsupported,
    Failed,
}

/// One direction: `src` → pipe → `dst`, until end of file (then `dst` is half-closed).
async fn splice_pump<S: Spliceable, D: Spliceable>(
    src: &S,
    dst: &D,
    count: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
) -> Stop {
    let Ok((pipe_r, pipe_w)) = pipe() else { return Stop::Unsupported };
    let mut in_pipe = 0usize;
    let mut first = true;
    loop {
        if in_pipe == 0 {
            if src.ready(Interest::READABLE).await.is_err() {
                return Stop::Failed;
            }
            match src.attempt(Interest::READABLE, || splice(src.as_fd(), pipe_w.as_fd(), CHUNK)) {
                Ok(0) => {
                    shutdown_write(dst.as_fd());
                    return Stop::Done;
                }
                Ok(n) => in_pipe = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) if first && matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                    return Stop::Unsupported;
                }
                Err(_) => return Stop::Failed,
            }
            first = false;
        }
        if dst.ready(Interest::WRITABLE).await.is_err() {
            return Stop::Failed;
        }
        match dst.attempt(Interest::WRITABLE, || splice(pipe_r.as_fd(), dst.as_fd(), in_pipe)) {
            Ok(n) => {
                in_pipe -= n;
                count.fetch_add(n as u64, Ordering::Relaxed);
                activity.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return Stop::Failed,
        }
    }
}

/// Copies one direction in reads of up to `chunk` bytes, on the same shared references.
/// The buffer exists only while a chunk is in flight, so an idle tunnel holds none. With
/// `upgrade`, it returns [`Stop::Upgrade`] after the first read that fills a chunk: a bulk
/// transfer is under way and worth a pipe; small exchanges never create one.
async fn copy_pump<S: Spliceable, D: Spliceable>(
    src: &S,
    dst: &D,
    chunk: usize,
    upgrade: bool,
    count: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
) -> Stop {
    loop {
        if src.ready(Interest::READABLE).await.is_err() {
            return Stop::Failed;
        }
        let mut buf = Vec::with_capacity(chunk);
        let n = match src.attempt(Interest::READABLE, || recv(src.as_fd(), &mut buf)) {
            Ok(0) => {
                shutdown_write(dst.as_fd());
                return Stop::Done;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return Stop::Failed,
        };
        let mut off = 0;
        while off < n {
            if dst.ready(Interest::WRITABLE).await.is_err() {
                return Stop::Failed;
            }
            match dst.attempt(Interest::WRITABLE, || send(dst.as_fd(), &buf[off..n])) {
                Ok(m) => off += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Stop::Failed,
            }
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        activity.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
        if upgrade && n == chunk {
            return Stop::Upgrade;
        }
    }
}

/// One direction: copied while the exchange is small, spliced once it is not, and copied
/// again where the kernel refuses to splice these sockets.
async fn direction<S: Spliceable, D: Spliceable>(
    src: &S,
    dst: &D,
    count: &AtomicU64,
    activity: &AtomicU64,
    start: Instant,
) {
    let mut stop = copy_pump(src, dst, 16 * 1024, true, count, activity, start).await;
    if let Stop::Upgrade = stop {
        stop = splice_pump(src, dst, count, activity, start).await;
    }
    if let Stop::Unsupported = stop {
        stop = copy_pump(src, dst, 64 * 1024, false, count, activity, start).await;
    }
    if let Stop::Failed = stop {
        shutdown_both(src.as_fd(), dst.as_fd());
    }
}

/// The tunnel between a sandbox's connection and the upstream: bytes the readers already
/// hold go first, then both directions are spliced, until both end, either fails, or
/// nothing moved for `idle`.
pub async fn tunnel(
    mut client_read: BufReader<unix::OwnedReadHalf>,
    mut client_write: unix::OwnedWriteHalf,
    mut upstream_read: BufReader<tcp::OwnedReadHalf>,
    mut upstream_write: tcp::OwnedWriteHalf,
    idle: Duration,
) -> Moved {
    let start = Instant::now();
    let (up, down, activity) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    // Pipelined bytes (a TLS hello behind the CONNECT; what a proxy sent after its 200).
    let early_up = client_read.buffer().to_vec();
    let early_down = upstream_read.buffer().to_vec();
    client_read.consume(early_up.len());
    upstream_read.consume(early_down.len());
    if upstream_write.write_all(&early_up).await.is_err()
        || client_write.write_all(&early_down).await.is_err()
    {
        return Moved::default();
    }
    up.fetch_add(early_up.len() as u64, Ordering::Relaxed);
    down.fetch_add(early_down.len() as u64, Ordering::Relaxed);

    let client: &UnixStream = client_read.get_ref().as_ref();
    let upstream: &TcpStream = upstream_read.get_ref().as_ref();
    let both = async {
        tokio::join!(
            direction(client, upstream, &up, &activity, start),
            direction(upstream, client, &down, &activity, start)
        );
    };
    let idle_timeout = until_idle(both, &activity, start, idle).await;
    // The write halves live until here: dropping one shuts its direction down.
    drop((client_write, upstream_write));
    Moved { up: up.load(Ordering::Relaxed), down: down.load(Ordering::Relaxed), idle_timeout }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn megabytes_cross_both_ways_with_early_bytes_first_and_half_closes() {
        let (client_end, proxy_end) = UnixStream::pair().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dialled = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        const SIZE: usize = 8 << 20;

        // The upstream echoes everything it gets, then closes.
        let echo = tokio::spawn(async move {
            let (mut r, mut w) = server.split();
            tokio::io::copy(&mut r, &mut w).await.unwrap()
        });
        let (cr, cw) = proxy_end.into_split();
        let (ur, uw) = dialled.into_split();
        let mut cr = BufReader::new(cr);
        let (mut client_r, mut client_w) = client_end.into_split();
        // Bytes pipelined before the tunnel starts sit in the proxy's reader.
        client_w.write_all(b"EARLY").await.unwrap();
        cr.fill_buf().await.unwrap();
        let tunnel = tokio::spawn(tunnel(cr, cw, BufReader::new(ur), uw, Duration::from_secs(5)));

        let payload: Vec<u8> = (0..SIZE).map(|i| (i % 251) as u8).collect();
        let writer = tokio::spawn(async move {
            client_w.write_all(&payload).await.unwrap();
            client_w.shutdown().await.unwrap();
        });
        let mut back = Vec::new();
        client_r.read_to_end(&mut back).await.unwrap();
        writer.await.unwrap();
        assert_eq!(echo.await.unwrap() as usize, SIZE + 5);
        assert_eq!(back.len(), SIZE + 5);
        assert_eq!(&back[..5], b"EARLY");
        assert!(
            back[5..].iter().enumerate().all(|(i, b)| *b == (i % 251) as u8),
            "bytes arrive intact and in order"
        );
        let moved = tunnel.await.unwrap();
        assert_eq!((moved.up, moved.down, moved.idle_timeout), ((SIZE + 5) as u64, (SIZE + 5) as u64, false));
    }
}
