//! The TCP side: a loopback listener whose connections are relayed byte for byte to the
//! egress gateway's Unix socket, two threads per connection, with a cap on how many run.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::socket::{self, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, sockopt};

/// Pending connections the kernel queues before `accept`.
const BACKLOG: i32 = 128;
/// Read size of each relay direction.
const BUFFER_SIZE: usize = 64 * 1024;
/// Relay threads only copy; their buffers live on the heap.
const RELAY_STACK_SIZE: usize = 256 * 1024;
/// How long a refused client may take to finish sending what it had started to send.
const REFUSAL_DRAIN: Duration = Duration::from_millis(500);
/// At most this much of a refused client's request is read and discarded.
const REFUSAL_DRAIN_LIMIT: usize = 1 << 20;
/// Diagnostics from the relay go to the workload's stderr: at most one line this often.
const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Pause after an `accept` failure such as EMFILE, so that the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The answer to a client when the gateway's socket does not accept connections.
pub(crate) const BAD_GATEWAY: &str = "HTTP/1.1 502 Bad Gateway\r\n\
    Content-Length: 0\r\n\
    Connection: close\r\n\
    X-Sandbox-Network: the sandbox egress gateway is unreachable (egressd is not running or has restarted); \
    if egressd restarted, this sandbox's gateway is gone for good: run the execution again\r\n\
    \r\n";

/// The answer to a client beyond the connection cap.
pub(crate) fn too_many_connections(limit: usize) -> String {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\n\
         Content-Length: 0\r\n\
         Connection: close\r\n\
         X-Sandbox-Network: the sandbox already has {limit} connections open through the egress bridge; \
         close some and try again\r\n\
         \r\n"
    )
}

/// What went wrong on the relay side.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelayError {
    #[error("cannot listen on {addr} for the sandbox's proxy clients")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the accept thread")]
    AcceptThread(#[source] io::Error),
    #[error("gateway unreachable: {}", path.display())]
    GatewayUnreachable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot accept a connection")]
    Accept(#[source] io::Error),
    #[error("cannot start a relay thread; the connection was closed")]
    RelayThread(#[source] io::Error),
}

/// Binds `addr` with SO_REUSEADDR and a backlog of 128. The socket is close-on-exec from its
/// creation, so a workload started later never inherits it.
pub(crate) fn listen(addr: SocketAddr) -> Result<TcpListener, RelayError> {
    let fail = |e: nix::Error| RelayError::Listen { addr, source: e.into() };
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).map_err(fail)?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(fail)?;
    socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr)).map_err(fail)?;
    socket::listen(&fd, Backlog::new(BACKLOG).map_err(fail)?).map_err(fail)?;
    Ok(TcpListener::from(fd))
}

/// Accepts on `listener` for the rest of the process's life, on a thread of its own.
pub(crate) fn start(
    listener: TcpListener,
    gateway: PathBuf,
    max_connections: usize,
) -> Result<(), RelayError> {
    let relay = Arc::new(Relay {
        gateway,
        slots: Arc::new(Slots::new(max_connections)),
        reports: RateLimit::new(REPORT_INTERVAL),
    });
    thread::Builder::new()
        .name("egress-accept".into())
        .spawn(move || relay.accept_loop(&listener))
        .map(drop)
        .map_err(RelayError::AcceptThread)
}

#[derive(Debug)]
struct Relay {
    gateway: PathBuf,
    slots: Arc<Slots>,
    reports: RateLimit,
}

impl Relay {
    fn accept_loop(self: Arc<Self>, listener: &TcpListener) {
        loop {
            match listener.accept() {
                Ok((client, _)) => self.admit(client),
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
                Err(e) => {
                    self.report(&RelayError::Accept(e));
                    thread::sleep(ACCEPT_BACKOFF);
                }
            }
        }
    }

    fn admit(self: &Arc<Self>, client: TcpStream) {
        let Some(slot) = Slots::try_acquire(&self.slots) else {
            // No thread for it: answer from here without waiting for the rest of its request.
            refuse(&client, too_many_connections(self.slots.limit).as_bytes(), Drain::Available);
            return;
        };
        let relay = Arc::clone(self);
        let spawned = thread::Builder::new().name("egress-relay".into()).stack_size(RELAY_STACK_SIZE).spawn(
            move || {
                let _slot = slot;
                relay.serve(client);
            },
        );
        if let Err(e) = spawned {
            self.report(&RelayError::RelayThread(e));
        }
    }

    fn serve(&self, client: TcpStream) {
        let gateway = match UnixStream::connect(&self.gateway) {
            Ok(gateway) => gateway,
            Err(source) => {
                self.report(&RelayError::GatewayUnreachable { path: self.gateway.clone(), source });
                refuse(&client, BAD_GATEWAY.as_bytes(), Drain::UpTo(REFUSAL_DRAIN));
                return;
            }
        };
        // Relayed bytes are already segmented by whoever wrote them; do not hold them back.
        let _ = client.set_nodelay(true);
        let outcome = thread::scope(|scope| {
            let upstream = thread::Builder::new()
                .name("egress-relay-up".into())
                .stack_size(RELAY_STACK_SIZE)
                .spawn_scoped(scope, || pump(&client, &gateway))?;
            pump(&gateway, &client);
            let _ = upstream.join();
            Ok(())
        });
        if let Err(e) = outcome {
            let _ = client.shutdown(Shutdown::Both);
            self.report(&RelayError::RelayThread(e));
        }
    }

    fn report(&self, error: &RelayError) {
        if self.reports.allow(Instant::now()) {
            super::say(&common::error_chain(error));
        }
    }
}

/// Stream sockets that can be half-closed.
trait HalfClose {
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
}

impl HalfClose for &TcpStream {
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
}

impl HalfClose for &UnixStream {
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
}

/// Copies `from` to `to` until end of file, which is passed on as a half-close. A failure in
/// either direction ends both, so that the other direction's thread wakes up and ends too.
fn pump<F, T>(mut from: F, mut to: T)
where
    F: Read + HalfClose,
    T: Write + HalfClose,
{
    let mut buffer = vec![0u8; BUFFER_SIZE];
    loop {
        match from.read(&mut buffer) {
            Ok(0) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// How much of a refused client's pending request to read before closing.
#[derive(Debug, Clone, Copy)]
enum Drain {
    /// Only what has already arrived.
    Available,
    /// Until the client closes, or for at most this long.
    UpTo(Duration),
}

/// Answers `response` and closes. Closing a socket with unread input makes the kernel reset
/// the connection, which can destroy the answer before the client reads it; so the client's
/// request is read and discarded first.
fn refuse(client: &TcpStream, response: &[u8], drain: Drain) {
    let mut client = client;
    let _ = client.set_write_timeout(Some(REFUSAL_DRAIN));
    let _ = client.write_all(response);
    let _ = client.shutdown(Shutdown::Write);
    let ready = match drain {
        Drain::Available => client.set_nonblocking(true),
        Drain::UpTo(limit) => client.set_read_timeout(Some(limit)),
    };
    if ready.is_err() {
        return;
    }
    let mut buffer = [0u8; 4096];
    let mut discarded = 0;
    while discarded < REFUSAL_DRAIN_LIMIT {
        match client.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => discarded += n,
        }
    }
}

/// Counts relayed connections against a limit.
#[derive(Debug)]
struct Slots {
    limit: usize,
    active: AtomicUsize,
}

/// One taken slot, given back when dropped.
#[derive(Debug)]
struct Slot(Arc<Slots>);

impl Slots {
    fn new(limit: usize) -> Slots {
        Slots { limit, active: AtomicUsize::new(0) }
    }

    fn try_acquire(slots: &Arc<Slots>) -> Option<Slot> {
        slots
            .active
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < slots.limit).then_some(n + 1))
            .ok()
            .map(|_| Slot(Arc::clone(slots)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Lets one event through per interval.
#[derive(Debug)]
struct RateLimit {
    interval: Duration,
    last: Mutex<Option<Instant>>,
}

impl RateLimit {
    fn new(interval: Duration) -> RateLimit {
        RateLimit { interval, last: Mutex::new(None) }
    }

    fn allow(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match *last {
            Some(then) if now.saturating_duration_since(then) < self.interval => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a refusal as an HTTP client would.
    fn parse(text: &str) -> (u16, Vec<(String, String)>, usize) {
        let mut headers = [httparse::EMPTY_HEADER; 8];
        let mut response = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(len) = response.parse(text.as_bytes()).expect("valid HTTP") else {
            panic!("incomplete response: {text:?}");
        };
        let headers = response
            .headers
            .iter()
            .map(|h| (h.name.to_owned(), String::from_utf8(h.value.to_vec()).expect("UTF-8 header")))
            .collect();
        (response.code.expect("status code"), headers, len)
    }

    #[test]
    fn refusals_are_complete_http_responses() {
        let too_many = too_many_connections(256);
        let table: [(&str, u16, &str); 2] = [
            (
                BAD_GATEWAY,
                502,
                "the sandbox egress gateway is unreachable (egressd is not running or has restarted); \
                 if egressd restarted, this sandbox's gateway is gone for good: run the execution again",
            ),
            (
                &too_many,
                503,
                "the sandbox already has 256 connections open through the egress bridge; close some and try again",
            ),
        ];
        for (text, code, reason) in table {
            let (parsed_code, headers, len) = parse(text);
            assert_eq!(parsed_code, code, "{text:?}");
            assert_eq!(len, text.len(), "nothing after the head: {text:?}");
            let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
            assert_eq!(header("Content-Length"), Some("0"));
            assert_eq!(header("Connection"), Some("close"));
            assert_eq!(header("X-Sandbox-Network"), Some(reason));
        }
    }

    #[test]
    fn bad_gateway_is_byte_exact() {
        assert_eq!(
            BAD_GATEWAY,
            "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\nX-Sandbox-Network: the \
             sandbox egress gateway is unreachable (egressd is not running or has restarted); if egressd \
             restarted, this sandbox's gateway is gone for good: run the execution again\r\n\r\n"
        );
    }

    #[test]
    fn slots_cap_and_come_back() {
        let slots = Arc::new(Slots::new(2));
        let a = Slots::try_acquire(&slots).expect("first");
        let b = Slots::try_acquire(&slots).expect("second");
        assert!(Slots::try_acquire(&slots).is_none(), "third admitted over a limit of two");
        drop(a);
        let c = Slots::try_acquire(&slots).expect("a released slot is reusable");
        drop((b, c));
        assert_eq!(slots.active.load(Ordering::Acquire), 0);
    }

    #[test]
    fn rate_limit_lets_one_line_per_interval() {
        let limit = RateLimit::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let table =
            [(0, true), (1, false), (999, false), (1000, true), (1500, false), (2000, true), (5000, true)];
        for (at, allowed) in table {
            assert_eq!(limit.allow(ms(at)), allowed, "at {at} ms");
        }
        // A clock that seems to go backwards (threads racing to report) lets nothing extra through.
        assert!(!limit.allow(ms(4000)));
    }

    #[test]
    fn pump_passes_end_of_file_on_as_a_half_close() {
        let (a, mut a_peer) = UnixStream::pair().expect("socketpair");
        let (b, mut b_peer) = UnixStream::pair().expect("socketpair");
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let writer = {
            let payload = payload.clone();
            thread::spawn(move || {
                a_peer.write_all(&payload).expect("write");
                a_peer.shutdown(Shutdown::Write).expect("half-close");
                // The reverse direction is still open.
                let mut back = Vec::new();
                a_peer.read_to_end(&mut back).expect("read back");
                back
            })
        };
        let pumper = thread::spawn(move || pump(&a, &b));
        let mut received = Vec::new();
        b_peer.read_to_end(&mut received).expect("read relayed");
        assert_eq!(received, payload);
        pumper.join().expect("pump");
        drop(b_peer);
        assert_eq!(writer.join().expect("writer"), b"", "the unrelayed direction stays untouched");
    }
}
