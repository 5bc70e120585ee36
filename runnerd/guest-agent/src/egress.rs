//! The guest's egress bridge (issue #36): a run with `domain-allowlist` egress gets a proxy
//! on the guest's own loopback (`127.0.0.1:<egress_port>`, where the proxy variables point,
//! as the bwrap form's `egress-bridge` does), whose connections travel as streams over the
//! second virtio-serial port ([`wire::EGRESS_PORT_NAME`]) to runnerd, which connects each to
//! egressd's gateway. The guest has no NIC and no resolver: a name is resolved by egressd,
//! after its allowlist, or not at all.
//!
//! Std threads only (PID 1 is a static binary without a runtime). [`prepare`] binds the
//! listener before the command starts, while the agent is still single-threaded (the command
//! is forked after it); [`Bridge::start`] then starts:
//! - one acceptor, which admits at most [`wire::EGRESS_MAX_STREAMS`] connections (503
//!   beyond, as the bridge does) and sends `Open` for each;
//! - per connection, an *up* thread (client → host, never more than the host's credit
//!   ahead) and a *down* thread (host → client, acknowledging what the client took; at the
//!   host's `Reset` the client's connection is reset, so a truncated answer never looks whole);
//! - one port reader, which hands the host's frames to the connections without blocking.
//!
//! Frames to the host are written under one lock, each whole. The host trusts nothing here;
//! the guest believes the host, but a frame it cannot read ends the bridge (every connection
//! closed, new ones answered 502), never the agent.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::wire::{self, Decoder, EGRESS_MAX_STREAMS, EGRESS_WINDOW, EgressDown, EgressUp, MAX_CHUNK};

/// The answer to a client when runnerd could not reach egressd (the bridge's own words).
const BAD_GATEWAY: &[u8] = b"HTTP/1.1 502 Bad Gateway\r\n\
    Content-Length: 0\r\n\
    Connection: close\r\n\
    X-Sandbox-Network: the sandbox egress gateway is unreachable (egressd is not running or has restarted); \
    run the execution again\r\n\
    \r\n";

/// How long a refused client may take to finish sending what it had started to send.
const REFUSAL_DRAIN: Duration = Duration::from_millis(500);
/// At most this much of a refused client's request is read and dropped.
const REFUSAL_DRAIN_LIMIT: usize = 1 << 20;
/// Relay threads only copy; their buffers are on the heap.
const STACK: usize = 128 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("could not listen on 127.0.0.1:{port} for the command's proxy clients")]
    Listen {
        port: u16,
        #[source]
        source: io::Error,
    },
    #[error("could not duplicate the egress port")]
    Port(#[source] io::Error),
    #[error("could not start the egress bridge's threads")]
    Thread(#[source] io::Error),
}

/// The listener and the port, before any thread runs.
#[derive(Debug)]
pub struct Bridge {
    listener: TcpListener,
    port: File,
}

/// Binds the loopback listener (close-on-exec: the command never inherits it) for the
/// already opened egress `port`.
pub fn prepare(port: File, tcp_port: u16) -> Result<Bridge, EgressError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, tcp_port))
        .map_err(|source| EgressError::Listen { port: tcp_port, source })?;
    Ok(Bridge { listener, port })
}

impl Bridge {
    /// Starts the acceptor and the port reader; connections queued since [`prepare`] are
    /// accepted now.
    pub fn start(self) -> Result<(), EgressError> {
        let reader = self.port.try_clone().map_err(EgressError::Port)?;
        let hub = Arc::new(Hub {
            port: Mutex::new(self.port),
            conns: Mutex::default(),
            dead: AtomicBool::new(false),
        });
        let h = hub.clone();
        spawn("egress-port", move || h.read_port(reader))?;
        let listener = self.listener;
        spawn("egress-accept", move || hub.accept_loop(&listener))?;
        Ok(())
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), EgressError> {
    std::thread::Builder::new()
        .name(name.into())
        .stack_size(STACK)
        .spawn(f)
        .map(drop)
        .map_err(EgressError::Thread)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug)]
struct Hub {
    /// The port's write side: one whole frame at a time.
    port: Mutex<File>,
    conns: Mutex<HashMap<u32, Arc<Conn>>>,
    /// The port failed or the host sent what cannot be read: nothing more goes through.
    dead: AtomicBool,
}

#[derive(Debug)]
struct Conn {
    tcp: TcpStream,
    state: Mutex<ConnState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct ConnState {
    /// Bytes the up thread may still send before the host acknowledges more.
    credit: usize,
    /// The host's bytes not yet written to the client (at most the window: the host's own
    /// credit keeps it so).
    queue: VecDeque<Vec<u8>>,
    /// The host sent `Close` or `OpenFailed`: nothing more comes.
    host_closed: bool,
    /// The host sent `OpenFailed`.
    failed: bool,
    /// The host sent `Reset`: the client's connection is reset, not ended.
    reset: bool,
    /// Up and down threads that have finished; the second removes the connection.
    finished: u8,
}

impl Hub {
    fn dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    fn send(&self, msg: &EgressUp) -> io::Result<()> {
        if self.dead() {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        }
        let frame = wire::encode(msg).map_err(io::Error::other)?;
        lock(&self.port).write_all(&frame)
    }

    fn accept_loop(self: Arc<Self>, listener: &TcpListener) {
        let mut next_id: u32 = 0;
        loop {
            let tcp = match listener.accept() {
                Ok((tcp, _)) => tcp,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if self.dead() || next_id == u32::MAX {
                let _ = (&tcp).write_all(BAD_GATEWAY);
                continue;
            }
            let mut conns = lock(&self.conns);
            if conns.len() >= EGRESS_MAX_STREAMS {
                drop(conns);
                let _ = (&tcp).write_all(too_many(EGRESS_MAX_STREAMS).as_bytes());
                continue;
            }
            let id = next_id;
            next_id += 1;
            let Ok(peer) = tcp.try_clone() else { continue };
            let conn = Arc::new(Conn {
                tcp: peer,
                state: Mutex::new(ConnState { credit: EGRESS_WINDOW, ..ConnState::default() }),
                changed: Condvar::new(),
            });
            conns.insert(id, conn.clone());
            drop(conns);
            // `Open` before any of its data: the up thread starts after it was sent.
            if self.send(&EgressUp::Open { id }).is_err() {
                lock(&self.conns).remove(&id);
                let _ = (&tcp).write_all(BAD_GATEWAY);
                continue;
            }
            let (hub, c) = (self.clone(), conn.clone());
            let up = spawn("egress-up", move || hub.up(id, &c));
            let (hub, c) = (self.clone(), conn.clone());
            let down = spawn("egress-down", move || hub.down(id, &c));
            if up.is_err() || down.is_err() {
                // The one that started ends on the shut socket; the host hears Close.
                let _ = tcp.shutdown(Shutdown::Both);
                let mut st = lock(&conn.state);
                st.finished += u8::from(up.is_err()) + u8::from(down.is_err());
                st.failed = true;
                conn.changed.notify_all();
                if up.is_err() {
                    let _ = self.send(&EgressUp::Close { id });
                }
            }
        }
    }

    /// Client → host, within the host's credit; `Close` at the client's end.
    fn up(&self, id: u32, conn: &Conn) {
        let mut buf = vec![0u8; MAX_CHUNK];
        loop {
            let credit = {
                let mut st = lock(&conn.state);
                while st.credit == 0 && !st.failed && !st.reset && !self.dead() {
                    st = conn.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
                if st.failed || st.reset || self.dead() {
                    break;
                }
                st.credit
            };
            let n = match (&conn.tcp).read(&mut buf[..credit.min(MAX_CHUNK)]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            lock(&conn.state).credit -= n;
            if self.send(&EgressUp::Data { id, bytes: buf[..n].to_vec() }).is_err() {
                break;
            }
        }
        let _ = self.send(&EgressUp::Close { id });
        self.finished(id, conn);
    }

    /// Host → client, acknowledging each chunk; the client's write side shut at the host's
    /// end, a reset at the host's `Reset`, or a 502 when the host could not reach the gateway.
    fn down(&self, id: u32, conn: &Conn) {
        let mut client_gone = false;
        loop {
            let next = {
                let mut st = lock(&conn.state);
                while st.queue.is_empty() && !st.host_closed && !self.dead() {
                    st = conn.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
                st.queue.pop_front()
            };
            let Some(bytes) = next else { break };
            // A client that left still has its data acknowledged, so the host's side of
            // the stream runs to its end instead of waiting on a window.
            client_gone = client_gone || (&conn.tcp).write_all(&bytes).is_err();
            let _ = self.send(&EgressUp::Ack { id, bytes: bytes.len() as u32 });
        }
        let (failed, reset) = {
            let st = lock(&conn.state);
            (st.failed, st.reset)
        };
        if reset && !self.dead() {
            // The client gets ECONNRESET, never a clean end of a truncated answer: with a zero
            // linger the socket's close (the connection's last handle, dropped once both
            // threads finished) sends RST; shutting the read side ends the up thread's read.
            let _ = abort_on_close(&conn.tcp);
            let _ = conn.tcp.shutdown(Shutdown::Read);
        } else if failed || self.dead() {
            // Answered, then what the client had started to send is read and dropped for a
            // moment, so that closing does not reset the connection before it reads the 502.
            let _ = (&conn.tcp).write_all(BAD_GATEWAY);
            let _ = conn.tcp.shutdown(Shutdown::Write);
            let _ = conn.tcp.set_read_timeout(Some(REFUSAL_DRAIN));
            let mut sink = [0u8; 4096];
            let mut left = REFUSAL_DRAIN_LIMIT;
            while let Ok(n @ 1..) = (&conn.tcp).read(&mut sink) {
                left = left.saturating_sub(n);
                if left == 0 {
                    break;
                }
            }
            let _ = conn.tcp.shutdown(Shutdown::Both);
        } else {
            let _ = conn.tcp.shutdown(Shutdown::Write);
        }
        self.finished(id, conn);
    }

    fn finished(&self, id: u32, conn: &Conn) {
        let mut st = lock(&conn.state);
        st.finished += 1;
        conn.changed.notify_all();
        if st.finished >= 2 {
            drop(st);
            lock(&self.conns).remove(&id);
        }
    }

    /// Hands the host's frames to the connections; at the port's end or a frame it cannot
    /// read, ends every connection.
    fn read_port(&self, mut port: File) {
        let mut decoder = Decoder::default();
        let mut buf = vec![0u8; 64 * 1024];
        let mut heard = false;
        'port: loop {
            match port.read(&mut buf) {
                // A virtio-serial read returns 0 while the host's end is not connected:
                // before the host said anything that may be the start; after, it left.
                Ok(0) if !heard => std::thread::sleep(Duration::from_millis(20)),
                Ok(0) => break,
                Ok(n) => {
                    heard = true;
                    decoder.feed(&buf[..n]);
                    loop {
                        match decoder.next_msg::<EgressDown>() {
                            Ok(Some(msg)) => self.dispatch(msg),
                            Ok(None) => break,
                            Err(_) => break 'port,
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.dead.store(true, Ordering::SeqCst);
        for conn in lock(&self.conns).values() {
            let _st = lock(&conn.state);
            conn.changed.notify_all();
        }
    }

    fn dispatch(&self, msg: EgressDown) {
        let id = match &msg {
            EgressDown::OpenFailed { id }
            | EgressDown::Data { id, .. }
            | EgressDown::Ack { id, .. }
            | EgressDown::Close { id }
            | EgressDown::Reset { id } => *id,
        };
        let Some(conn) = lock(&self.conns).get(&id).cloned() else { return };
        let mut st = lock(&conn.state);
        match msg {
            EgressDown::Data { bytes, .. } => st.queue.push_back(bytes),
            EgressDown::Ack { bytes, .. } => st.credit = st.credit.saturating_add(bytes as usize),
            EgressDown::Close { .. } => st.host_closed = true,
            EgressDown::OpenFailed { .. } => {
                st.host_closed = true;
                st.failed = true;
            }
            EgressDown::Reset { .. } => {
                st.host_closed = true;
                st.reset = true;
            }
        }
        conn.changed.notify_all();
    }
}

/// Makes `tcp`'s close send RST (`SO_LINGER` on with a zero timeout) instead of FIN.
fn abort_on_close(tcp: &TcpStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: `tcp` is an open socket for the call; the option value is a valid `linger` of
    // the length passed, read only during the call.
    let r = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if r == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// The answer beyond the connection cap (the bridge's own words).
fn too_many(limit: usize) -> String {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\n\
         Content-Length: 0\r\n\
         Connection: close\r\n\
         X-Sandbox-Network: the sandbox already has {limit} connections open through the egress bridge; \
         close some and try again\r\n\
         \r\n"
    )
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// The host's end of a bridge started on an ephemeral port, and that port.
    struct Host {
        port: UnixStream,
        decoder: Decoder,
        tcp: u16,
    }

    impl Host {
        fn start() -> Host {
            let (host, guest) = UnixStream::pair().unwrap();
            let bridge = prepare(File::from(OwnedFd::from(guest)), 0).unwrap();
            let tcp = bridge.listener.local_addr().unwrap().port();
            bridge.start().unwrap();
            Host { port: host, decoder: Decoder::default(), tcp }
        }

        fn send(&mut self, msg: &EgressDown) {
            self.port.write_all(&wire::encode(msg).unwrap()).unwrap();
        }

        /// The next frame, `None` after `wait` without one.
        fn next(&mut self, wait: Duration) -> Option<EgressUp> {
            self.port.set_read_timeout(Some(wait)).unwrap();
            let mut buf = [0u8; 64 * 1024];
            loop {
                if let Some(m) = self.decoder.next_msg::<EgressUp>().unwrap() {
                    return Some(m);
                }
                match self.port.read(&mut buf) {
                    Ok(n) if n > 0 => self.decoder.feed(&buf[..n]),
                    _ => return None,
                }
            }
        }

        fn expect(&mut self) -> EgressUp {
            self.next(Duration::from_secs(10)).expect("a frame from the guest")
        }

        fn client(&self) -> TcpStream {
            let c = TcpStream::connect((Ipv4Addr::LOCALHOST, self.tcp)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c
        }
    }

    fn read_all(mut c: &TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        got
    }

    #[test]
    fn a_connection_is_a_stream_both_ways_and_closes_each_side() {
        let mut host = Host::start();
        let client = host.client();
        assert_eq!(host.expect(), EgressUp::Open { id: 0 });
        (&client).write_all(b"GET http://x/ HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(
            host.expect(),
            EgressUp::Data { id: 0, bytes: b"GET http://x/ HTTP/1.1\r\n\r\n".to_vec() }
        );
        host.send(&EgressDown::Data { id: 0, bytes: b"HTTP/1.1 200 OK\r\n\r\nok".to_vec() });
        host.send(&EgressDown::Close { id: 0 });
        assert_eq!(read_all(&client), b"HTTP/1.1 200 OK\r\n\r\nok");
        assert_eq!(host.expect(), EgressUp::Ack { id: 0, bytes: 21 });
        drop(client);
        assert_eq!(host.expect(), EgressUp::Close { id: 0 });
        // The next connection is a new stream.
        let _second = host.client();
        assert_eq!(host.expect(), EgressUp::Open { id: 1 });
    }

    #[test]
    fn a_reset_reaches_the_client_as_a_reset_not_an_end() {
        let mut host = Host::start();
        let client = host.client();
        assert_eq!(host.expect(), EgressUp::Open { id: 0 });
        host.send(&EgressDown::Data {
            id: 0,
            bytes: b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\npart".to_vec(),
        });
        host.send(&EgressDown::Reset { id: 0 });
        let mut got = Vec::new();
        let err = (&client).read_to_end(&mut got).expect_err("not a clean end");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
        assert!(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\npart".starts_with(&got), "{got:?}");
        // The host hears the data taken and the stream's end from the guest's side too.
        loop {
            match host.expect() {
                EgressUp::Ack { id: 0, .. } => {}
                EgressUp::Close { id: 0 } => break,
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn the_guest_sends_no_more_than_the_window_until_the_host_acknowledges() {
        let mut host = Host::start();
        let client = host.client();
        assert_eq!(host.expect(), EgressUp::Open { id: 0 });
        let writer = std::thread::spawn({
            let c = client.try_clone().unwrap();
            move || (&c).write_all(&vec![b'u'; 3 * EGRESS_WINDOW])
        });
        let mut got = 0;
        while let Some(m) = host.next(Duration::from_millis(500)) {
            let EgressUp::Data { bytes, .. } = m else { panic!("{m:?}") };
            got += bytes.len();
        }
        assert_eq!(got, EGRESS_WINDOW, "exactly one window before an acknowledgement");
        host.send(&EgressDown::Ack { id: 0, bytes: 100 });
        let mut more = 0;
        while let Some(EgressUp::Data { bytes, .. }) = host.next(Duration::from_millis(500)) {
            more += bytes.len();
        }
        assert_eq!(more, 100);
        host.send(&EgressDown::Ack { id: 0, bytes: (3 * EGRESS_WINDOW) as u32 });
        while got + more < 3 * EGRESS_WINDOW {
            let EgressUp::Data { bytes, .. } = host.expect() else { panic!("data") };
            more += bytes.len();
        }
        writer.join().unwrap().unwrap();
    }

    #[test]
    fn an_unreachable_gateway_is_a_502_and_the_cap_a_503() {
        let mut host = Host::start();
        let client = host.client();
        assert_eq!(host.expect(), EgressUp::Open { id: 0 });
        (&client).write_all(b"GET http://x/ HTTP/1.1\r\n\r\n").unwrap();
        host.send(&EgressDown::OpenFailed { id: 0 });
        let answer = String::from_utf8(read_all(&client)).unwrap();
        assert!(answer.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{answer}");
        // Its end is reported like any other.
        loop {
            match host.expect() {
                EgressUp::Close { id: 0 } => break,
                EgressUp::Data { id: 0, .. } => {}
                other => panic!("{other:?}"),
            }
        }
        // The refused connection counts until its down thread finished (after the client
        // left): one answered 503 meanwhile is tried again.
        drop(client);
        let mut held = Vec::new();
        while held.len() < EGRESS_MAX_STREAMS {
            let c = host.client();
            match host.next(Duration::from_secs(5)) {
                Some(m) => {
                    assert_eq!(m, EgressUp::Open { id: held.len() as u32 + 1 });
                    held.push(c);
                }
                None => {
                    let answer = String::from_utf8(read_all(&c)).unwrap();
                    assert!(answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{answer}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        let over = host.client();
        let answer = String::from_utf8(read_all(&over)).unwrap();
        assert!(answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{answer}");
        drop(held);
    }
}
