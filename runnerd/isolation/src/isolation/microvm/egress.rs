//! Egress for a microvm (`domain-allowlist`, issue #36): the guest has no NIC and no
//! resolver; its only way out is a second virtio-serial port ([`wire::EGRESS_PORT_NAME`]),
//! present only when the run has egress, backed by a socket pair whose other end runnerd
//! holds here. The guest agent's bridge listens on the guest's loopback where the proxy
//! variables point and sends each connection as a stream of [`EgressUp`] frames; for each
//! `Open` runnerd connects to the execution's lease socket on egressd's gateway, by the
//! descriptor it checked ([`crate::isolation::Egress::gateway`]) through
//! `/proc/self/fd/N`, and relays both ways. egressd decides everything (allowlist, DNS,
//! addresses, caps) exactly as for a bwrap sandbox; a VM only changes who connects to the
//! lease socket: runnerd itself (the lease is acquired for runnerd's uid under microvm).
//!
//! Nothing the guest sends is believed beyond the protocol ([`Table`], pure): frames are
//! bounded by the decoder, stream ids only increase, at most [`EGRESS_MAX_STREAMS`] are
//! open, data is 1..=[`MAX_CHUNK`] bytes within the stream's window ([`EGRESS_WINDOW`]), an
//! acknowledgement only covers bytes already written to the port. A breach ends the egress
//! channel (runnerd drops its end; the guest's connections fail), not the run.
//!
//! What runnerd holds for a VM is bounded whatever the guest does, including never reading
//! its port:
//! - frames for the guest wait in one [`Outbox`] of at most [`OUTBOX_MAX`] bytes (64 KiB of
//!   room plus one frame): acknowledgements are coalesced into one count per stream, and
//!   while the outbox is full the relay only writes the port — it reads neither the port nor
//!   the streams' events, so a guest that stops reading stalls its own egress, nothing more;
//! - the streams' events to the relay: at most 16 in flight, each at most [`MAX_CHUNK`];
//! - per stream, the guest's bytes not yet written to the gateway: one buffer of at most a
//!   window (however small the frames), and the gateway's bytes not yet acknowledged: at most
//!   a window, counted from when they reach the port, so an acknowledgement of bytes still
//!   queued is a breach, not credit.
//!
//! While the outbox has room the port is read without waiting on any stream, and one
//! stalled connection stalls only itself.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use runner_guest_agent::wire::{
    self, Decoder, EGRESS_MAX_STREAMS, EGRESS_WINDOW, EgressDown, EgressUp, MAX_CHUNK, WireError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};

use super::request::Planned;
use crate::isolation::SandboxSpec;

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("the guest's egress frame was refused")]
    Wire(#[source] WireError),
    #[error("the guest broke the egress protocol")]
    Breach(#[source] Breach),
    #[error("the egress channel failed")]
    Io(#[source] io::Error),
}

/// What a guest may not do on the egress port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Breach {
    #[error("stream {0} was opened out of order (ids only increase, never reused)")]
    Reopened(u32),
    #[error("more than {EGRESS_MAX_STREAMS} streams open at once")]
    TooMany,
    #[error("stream {0} is not open")]
    Unknown(u32),
    #[error("stream {0} was used after the guest closed it")]
    AfterClose(u32),
    #[error("a chunk of {0} bytes (1 to {MAX_CHUNK} allowed)")]
    Chunk(usize),
    #[error("stream {0} sent beyond its window of {EGRESS_WINDOW} bytes")]
    Window(u32),
    #[error("stream {0} acknowledged {1} bytes it was not sent")]
    Ack(u32, u32),
}

#[derive(Debug, Default, Clone, Copy)]
struct Entry {
    guest_closed: bool,
    host_closed: bool,
    /// The guest's bytes not yet written to the gateway.
    inbound: usize,
    /// Bytes written to the port for the guest that it has not acknowledged.
    outstanding: usize,
}

/// The streams as the protocol allows them, pure: the guest's frames are checked here, the
/// host's own events counted. An entry lives until both sides closed it.
#[derive(Debug, Default)]
pub struct Table {
    last: Option<u32>,
    live: HashMap<u32, Entry>,
}

impl Table {
    fn entry(&mut self, id: u32) -> Result<&mut Entry, Breach> {
        self.live.get_mut(&id).ok_or(Breach::Unknown(id))
    }

    fn open_entry(&mut self, id: u32) -> Result<&mut Entry, Breach> {
        let e = self.entry(id)?;
        if e.guest_closed { Err(Breach::AfterClose(id)) } else { Ok(e) }
    }

    /// The guest's `Open`.
    pub fn open(&mut self, id: u32) -> Result<(), Breach> {
        if self.last.is_some_and(|last| id <= last) {
            return Err(Breach::Reopened(id));
        }
        if self.live.len() >= EGRESS_MAX_STREAMS {
            return Err(Breach::TooMany);
        }
        self.last = Some(id);
        self.live.insert(id, Entry::default());
        Ok(())
    }

    /// The guest's `Data` of `len` bytes.
    pub fn data(&mut self, id: u32, len: usize) -> Result<(), Breach> {
        let e = self.open_entry(id)?;
        if len == 0 || len > MAX_CHUNK {
            return Err(Breach::Chunk(len));
        }
        if e.inbound + len > EGRESS_WINDOW {
            return Err(Breach::Window(id));
        }
        e.inbound += len;
        Ok(())
    }

    /// The guest's `Ack` of `bytes`. A stream both sides closed may still be acknowledged
    /// (the guest writes the last data to its client after the host's close went out): such
    /// an `Ack` of a stream that existed is dropped.
    pub fn ack(&mut self, id: u32, bytes: u32) -> Result<(), Breach> {
        if !self.live.contains_key(&id) && self.last.is_some_and(|last| id <= last) {
            return Ok(());
        }
        let e = self.entry(id)?;
        if bytes == 0 || bytes as usize > e.outstanding {
            return Err(Breach::Ack(id, bytes));
        }
        e.outstanding -= bytes as usize;
        Ok(())
    }

    /// The guest's `Close`; `true` when the stream is gone now.
    pub fn guest_close(&mut self, id: u32) -> Result<bool, Breach> {
        let e = self.open_entry(id)?;
        e.guest_closed = true;
        Ok(self.reap(id))
    }

    /// `len` of the guest's bytes reached the gateway; `false`: the stream is gone.
    pub fn written(&mut self, id: u32, len: usize) -> bool {
        self.live.get_mut(&id).map(|e| e.inbound = e.inbound.saturating_sub(len)).is_some()
    }

    /// `len` of the gateway's bytes were written to the port (the frame's last byte), so the
    /// guest may acknowledge them now, not before; `false`: the stream is gone.
    pub fn delivered(&mut self, id: u32, len: usize) -> bool {
        self.live.get_mut(&id).map(|e| e.outstanding += len).is_some()
    }

    /// Whether the stream is still open on either side.
    pub fn is_live(&self, id: u32) -> bool {
        self.live.contains_key(&id)
    }

    /// The host's `Close`, `Reset` or `OpenFailed` goes out (`false`: the stream was gone already);
    /// the stream is gone once the guest closed it too.
    pub fn host_close(&mut self, id: u32) -> bool {
        match self.live.get_mut(&id) {
            Some(e) if !e.host_closed => {
                e.host_closed = true;
                self.reap(id);
                true
            }
            _ => false,
        }
    }

    fn reap(&mut self, id: u32) -> bool {
        if self.live.get(&id).is_some_and(|e| e.guest_closed && e.host_closed) {
            self.live.remove(&id);
            return true;
        }
        false
    }

    pub fn open_streams(&self) -> usize {
        self.live.len()
    }
}

/// Where the lease's gateway socket is: the descriptor runnerd checked (connected through
/// `/proc/self/fd/N`, so a path swapped since is never what is reached), or egressd's path.
#[derive(Debug)]
pub enum Gateway {
    Fd(OwnedFd),
    Path(PathBuf),
}

impl Gateway {
    async fn connect(&self) -> io::Result<UnixStream> {
        match self {
            Gateway::Fd(fd) => UnixStream::connect(format!("/proc/self/fd/{}", fd.as_raw_fd())).await,
            Gateway::Path(p) => UnixStream::connect(p).await,
        }
    }
}

/// runnerd's end of a VM's egress port, before it is served.
#[derive(Debug)]
pub struct Channel {
    host: std::os::unix::net::UnixStream,
    gateway: Gateway,
    /// The run's workspace root, to say whose channel closed.
    workspace: PathBuf,
}

/// With egress in `spec`: the egress port's socket pair, QEMU's end placed in the plan's
/// descriptor slots (`planned.egress_slot`); `None` without egress (no port at all).
pub fn open(spec: &SandboxSpec<'_>, planned: &mut Planned) -> io::Result<Option<Channel>> {
    let Some(egress) = spec.egress else { return Ok(None) };
    let gateway = match egress.gateway {
        Some(fd) => Gateway::Fd(fd.try_clone()?),
        None => Gateway::Path(egress.gateway_socket.to_owned()),
    };
    let (host, guest) = std::os::unix::net::UnixStream::pair()?;
    // The slot holds a duplicate; ours closes here, so only QEMU holds the guest's end.
    planned.egress_slot = Some(planned.slots.push(&OwnedFd::from(guest))?);
    Ok(Some(Channel { host, gateway, workspace: spec.workspace.root().to_owned() }))
}

/// The relay, running until dropped (the run's end) or the channel ends.
#[derive(Debug)]
pub struct Serving(JoinHandle<()>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Channel {
    /// Starts relaying on the runtime.
    pub fn serve(self) -> io::Result<Serving> {
        self.host.set_nonblocking(true)?;
        let port = UnixStream::from_std(self.host)?;
        let (gateway, workspace) = (self.gateway, self.workspace);
        Ok(Serving(tokio::spawn(async move {
            if let Err(e) = relay(port, gateway).await {
                tracing::warn!(
                    event = "microvm_egress_closed",
                    workspace = %workspace.display(),
                    error = %common::error_chain(&e),
                );
            }
        })))
    }
}

/// What a stream's task tells the relay.
#[derive(Debug)]
enum Event {
    /// The gateway could not be connected.
    Failed(u32),
    /// `n` of the guest's bytes were written to the gateway (or dropped: it left).
    Written(u32, usize),
    /// Bytes from the gateway.
    Down(u32, Vec<u8>),
    /// The gateway's end.
    Eof(u32),
    /// The gateway's connection failed while reading (a reset).
    Reset(u32),
}

/// The guest's bytes for one stream's gateway connection, not yet taken by its task: one
/// buffer (at most the window: [`Table::data`]), however small the guest's frames.
#[derive(Debug, Default)]
struct Inbound {
    state: std::sync::Mutex<InboundState>,
    ready: Notify,
}

#[derive(Debug, Default)]
struct InboundState {
    bytes: Vec<u8>,
    /// The guest's `Close`: nothing more comes.
    closed: bool,
}

impl Inbound {
    fn lock(&self) -> std::sync::MutexGuard<'_, InboundState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn push(&self, bytes: &[u8]) {
        self.lock().bytes.extend_from_slice(bytes);
        self.ready.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
    }

    /// Everything buffered, once there is something or the guest closed: `(bytes, closed)`.
    async fn take(&self) -> (Vec<u8>, bool) {
        loop {
            {
                let mut st = self.lock();
                if !st.bytes.is_empty() || st.closed {
                    return (std::mem::take(&mut st.bytes), st.closed);
                }
            }
            // `notify_one` keeps a permit when no one waits: a push since the check wakes this.
            self.ready.notified().await;
        }
    }
}

/// A live stream's handles in the relay.
#[derive(Debug)]
struct Stream {
    /// The guest's bytes to its gateway connection; dropped at the guest's `Close` or when
    /// the connection failed (the guest was told).
    to_gateway: Option<Arc<Inbound>>,
    /// How much more the gateway's side may send the guest.
    credit: Arc<Semaphore>,
}

/// The relay takes more work (the port's frames, the streams' events) only while fewer than
/// this many bytes wait in its [`Outbox`]; each event adds at most one frame.
pub const OUTBOX_ROOM: usize = 64 * 1024;
/// The largest frame runnerd sends: a `Data` of [`MAX_CHUNK`] with its header, variant, id
/// and length (4 + 1 + 5 + 3 bytes at most).
pub const MAX_DOWN_FRAME: usize = MAX_CHUNK + 13;
/// The most bytes an [`Outbox`] ever holds: below the room, plus one frame.
pub const OUTBOX_MAX: usize = OUTBOX_ROOM + MAX_DOWN_FRAME;
/// What an owed acknowledgement is counted as in the outbox (its largest frame, 4 + 1 + 5 + 5).
const ACK_FRAME: usize = 15;
/// Events in flight from the streams' tasks to the relay; a task waits beyond.
const EVENTS: usize = 16;

/// One encoded frame; a `Data`'s stream and length.
#[derive(Debug)]
struct Frame {
    bytes: Vec<u8>,
    data: Option<(u32, usize)>,
}

/// The frames runnerd owes the guest, pure and bounded: data and closes in order, each
/// encoded once; acknowledgements coalesced into one count per stream (a flood of one-byte
/// frames owes one `Ack`, not one per byte). Bytes are counted as written to the port when
/// their frame's last byte was ([`Outbox::wrote`]), not when queued.
#[derive(Debug, Default)]
pub struct Outbox {
    acks: HashMap<u32, u32>,
    queue: VecDeque<Frame>,
    queued: usize,
    /// The frame being written and how far.
    current: Option<(Frame, usize)>,
    /// Alternates acknowledgements with the queue, so neither starves the other.
    ack_next: bool,
    high_water: usize,
}

impl Outbox {
    /// Encoded bytes waiting (the frame being written in full) and owed acknowledgements.
    pub fn bytes(&self) -> usize {
        self.queued + self.current.as_ref().map_or(0, |(f, _)| f.bytes.len()) + self.acks.len() * ACK_FRAME
    }

    /// The most [`Outbox::bytes`] ever held.
    pub fn high_water(&self) -> usize {
        self.high_water
    }

    /// Whether the relay may take more work.
    pub fn has_room(&self) -> bool {
        self.bytes() < OUTBOX_ROOM
    }

    fn grew(&mut self) {
        self.high_water = self.high_water.max(self.bytes());
    }

    /// `bytes` of the guest's data more reached the gateway.
    pub fn ack(&mut self, id: u32, bytes: u32) {
        let owed = self.acks.entry(id).or_default();
        *owed = owed.saturating_add(bytes);
        self.grew();
    }

    /// A frame after those queued.
    pub fn push(&mut self, msg: &EgressDown) -> Result<(), WireError> {
        let frame = wire::encode(msg)?;
        let data = match msg {
            EgressDown::Data { id, bytes } => Some((*id, bytes.len())),
            _ => None,
        };
        self.queued += frame.len();
        self.queue.push_back(Frame { bytes: frame, data });
        self.grew();
        Ok(())
    }

    /// The rest of the frame to write now (empty: nothing is owed).
    pub fn pending(&mut self) -> Result<&[u8], WireError> {
        if self.current.is_none() {
            let ack =
                if self.ack_next || self.queue.is_empty() { self.acks.keys().next().copied() } else { None };
            self.ack_next = !self.ack_next;
            if let Some(id) = ack {
                let bytes = self.acks.remove(&id).unwrap_or_default();
                let frame = Frame { bytes: wire::encode(&EgressDown::Ack { id, bytes })?, data: None };
                self.current = Some((frame, 0));
            } else if let Some(frame) = self.queue.pop_front() {
                self.queued -= frame.bytes.len();
                self.current = Some((frame, 0));
            }
        }
        Ok(self.current.as_ref().map_or(&[][..], |(frame, at)| &frame.bytes[*at..]))
    }

    /// `n` bytes of [`Outbox::pending`] were written; a `Data` frame's stream and length
    /// once its last byte was.
    pub fn wrote(&mut self, n: usize) -> Option<(u32, usize)> {
        let (frame, at) = self.current.as_mut()?;
        *at += n;
        if *at < frame.bytes.len() {
            return None;
        }
        self.current.take().and_then(|(frame, _)| frame.data)
    }
}

/// Relays the egress port `port` until it ends (`Ok`) or the guest breaks the protocol.
/// Every stream's connection ends with it (its tasks are aborted).
pub async fn relay(port: UnixStream, gateway: Gateway) -> Result<(), EgressError> {
    relay_watched(port, gateway, &AtomicUsize::new(0)).await
}

/// [`relay`], keeping its outbox's high-water mark in `high_water`.
async fn relay_watched(
    port: UnixStream,
    gateway: Gateway,
    high_water: &AtomicUsize,
) -> Result<(), EgressError> {
    let gateway = Arc::new(gateway);
    let (mut rd, mut wr) = port.into_split();
    let mut outbox = Outbox::default();
    let (events, mut events_rx) = mpsc::channel::<Event>(EVENTS);
    let mut table = Table::default();
    let mut streams: HashMap<u32, Stream> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut decoder = Decoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        high_water.store(outbox.high_water(), Ordering::Relaxed);
        // While the outbox is full only the port's writer runs: the guest's frames and the
        // streams wait (in the port, in the gateway sockets) until the guest reads.
        let room = outbox.has_room();
        let pending = outbox.pending().map_err(EgressError::Wire)?;
        let writing = !pending.is_empty();
        tokio::select! {
            r = wr.write(pending), if writing => match r {
                Ok(0) => return Err(EgressError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    if let Some((id, len)) = outbox.wrote(n) {
                        table.delivered(id, len);
                    }
                }
                Err(e) => return Err(EgressError::Io(e)),
            },
            r = rd.read(&mut buf), if room => {
                let n = match r {
                    Ok(0) => return Ok(()),
                    Ok(n) => n,
                    Err(e) => return Err(EgressError::Io(e)),
                };
                decoder.feed(&buf[..n]);
                // Nothing here adds to the outbox: data goes to its stream's buffer, an
                // acknowledgement to its stream's credit.
                while let Some(msg) = decoder.next_msg::<EgressUp>().map_err(EgressError::Wire)? {
                    match msg {
                        EgressUp::Open { id } => {
                            table.open(id).map_err(EgressError::Breach)?;
                            let inbound = Arc::new(Inbound::default());
                            let credit = Arc::new(Semaphore::new(EGRESS_WINDOW));
                            streams.insert(id, Stream { to_gateway: Some(inbound.clone()), credit: credit.clone() });
                            tasks.spawn(stream(id, gateway.clone(), inbound, credit, events.clone()));
                        }
                        EgressUp::Data { id, bytes } => {
                            table.data(id, bytes.len()).map_err(EgressError::Breach)?;
                            if let Some(to) = streams.get(&id).and_then(|s| s.to_gateway.as_ref()) {
                                to.push(&bytes);
                            }
                        }
                        EgressUp::Ack { id, bytes } => {
                            table.ack(id, bytes).map_err(EgressError::Breach)?;
                            if let Some(s) = streams.get(&id) {
                                s.credit.add_permits(bytes as usize);
                            }
                        }
                        EgressUp::Close { id } => {
                            let done = table.guest_close(id).map_err(EgressError::Breach)?;
                            // Its task's half toward the gateway ends either way (it waits on
                            // this buffer: removed unclosed, the task would outlive the stream
                            // and keep its egressd connection open).
                            if let Some(to) = streams.get_mut(&id).and_then(|s| s.to_gateway.take()) {
                                to.close();
                            }
                            if done {
                                streams.remove(&id);
                            }
                        }
                    }
                }
            }
            Some(event) = events_rx.recv(), if room => match event {
                Event::Written(id, n) => {
                    if table.written(id, n) {
                        outbox.ack(id, n as u32);
                    }
                }
                Event::Down(id, bytes) => {
                    if table.is_live(id) {
                        outbox.push(&EgressDown::Data { id, bytes }).map_err(EgressError::Wire)?;
                    }
                }
                Event::Eof(id) | Event::Failed(id) | Event::Reset(id) => {
                    let failed = matches!(event, Event::Failed(_));
                    if table.host_close(id) {
                        let msg = match event {
                            Event::Failed(_) => EgressDown::OpenFailed { id },
                            Event::Reset(_) => EgressDown::Reset { id },
                            _ => EgressDown::Close { id },
                        };
                        outbox.push(&msg).map_err(EgressError::Wire)?;
                    }
                    if !table.is_live(id) {
                        streams.remove(&id);
                    } else if let Some(s) = streams.get_mut(&id).filter(|_| failed) {
                        // Its task is gone: the guest's data until its close is dropped.
                        s.to_gateway = None;
                    }
                }
            },
            // Finished stream tasks are collected as they end.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

/// One stream: its gateway connection, the guest's bytes to it, the gateway's bytes back
/// within the guest's credit.
async fn stream(
    id: u32,
    gateway: Arc<Gateway>,
    from_guest: Arc<Inbound>,
    credit: Arc<Semaphore>,
    events: mpsc::Sender<Event>,
) {
    let conn = match gateway.connect().await {
        Ok(c) => c,
        Err(_) => {
            let _ = events.send(Event::Failed(id)).await;
            return;
        }
    };
    let (mut r, mut w) = conn.into_split();
    let up = async {
        let mut open = true;
        loop {
            let (bytes, closed) = from_guest.take().await;
            if !bytes.is_empty() {
                open = open && w.write_all(&bytes).await.is_ok();
                let _ = events.send(Event::Written(id, bytes.len())).await;
            }
            if closed {
                break;
            }
        }
        if open {
            let _ = w.shutdown().await;
        }
    };
    let down = async {
        let mut buf = vec![0u8; MAX_CHUNK];
        let mut end = Event::Eof(id);
        loop {
            let Ok(permit) = credit.acquire().await else { break };
            let room = (credit.available_permits() + 1).min(MAX_CHUNK);
            let n = match r.read(&mut buf[..room]).await {
                Ok(0) => break,
                Ok(n) => n,
                // Not an end: the client must not take a truncated answer for a whole one.
                Err(_) => {
                    end = Event::Reset(id);
                    break;
                }
            };
            permit.forget();
            // Only this task takes permits: the rest of the `room` counted is still there.
            if let Ok(more) = credit.try_acquire_many((n - 1) as u32) {
                more.forget();
            }
            let _ = events.send(Event::Down(id, buf[..n].to_vec())).await;
        }
        let _ = events.send(end).await;
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests;
