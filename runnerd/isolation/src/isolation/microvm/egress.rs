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
//! acknowledgement only covers bytes sent. A breach ends the egress channel (runnerd drops
//! its end; the guest's connections fail), not the run. The windows keep every queue
//! bounded — per stream at most a window each way, whatever the guest does — so the port is
//! read without ever waiting on a stream, and one stalled connection stalls only itself.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use runner_guest_agent::wire::{
    self, Decoder, EGRESS_MAX_STREAMS, EGRESS_WINDOW, EgressDown, EgressUp, MAX_CHUNK, WireError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{Semaphore, mpsc};
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
    /// Bytes sent to the guest that it has not acknowledged.
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

    /// `len` of the gateway's bytes go to the guest; `false`: the stream is gone.
    pub fn sent(&mut self, id: u32, len: usize) -> bool {
        self.live.get_mut(&id).map(|e| e.outstanding += len).is_some()
    }

    /// The host's `Close` or `OpenFailed` goes out (`false`: the stream was gone already);
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
    Ok(Some(Channel { host, gateway }))
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
        let gateway = self.gateway;
        Ok(Serving(tokio::spawn(async move {
            if let Err(e) = relay(port, gateway).await {
                tracing::warn!(event = "microvm_egress_closed", error = %common::error_chain(&e));
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
}

/// A live stream's handles in the relay.
#[derive(Debug)]
struct Stream {
    /// The guest's bytes to its gateway connection; dropped at the guest's `Close`.
    to_gateway: Option<mpsc::UnboundedSender<Vec<u8>>>,
    /// How much more the gateway's side may send the guest.
    credit: Arc<Semaphore>,
}

/// Relays the egress port `port` until it ends (`Ok`) or the guest breaks the protocol.
/// Every stream's connection ends with it (its tasks are aborted).
pub async fn relay(port: UnixStream, gateway: Gateway) -> Result<(), EgressError> {
    let gateway = Arc::new(gateway);
    let (mut rd, mut wr) = port.into_split();
    let (out, mut out_rx) = mpsc::unbounded_channel::<EgressDown>();
    let writer = async move {
        while let Some(msg) = out_rx.recv().await {
            let frame = wire::encode(&msg).map_err(EgressError::Wire)?;
            wr.write_all(&frame).await.map_err(EgressError::Io)?;
        }
        Ok::<(), EgressError>(())
    };
    tokio::pin!(writer);
    let (events, mut events_rx) = mpsc::unbounded_channel::<Event>();
    let mut table = Table::default();
    let mut streams: HashMap<u32, Stream> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut decoder = Decoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            r = &mut writer => return r,
            r = rd.read(&mut buf) => {
                let n = match r {
                    Ok(0) => return Ok(()),
                    Ok(n) => n,
                    Err(e) => return Err(EgressError::Io(e)),
                };
                decoder.feed(&buf[..n]);
                while let Some(msg) = decoder.next_msg::<EgressUp>().map_err(EgressError::Wire)? {
                    match msg {
                        EgressUp::Open { id } => {
                            table.open(id).map_err(EgressError::Breach)?;
                            let (tx, rx) = mpsc::unbounded_channel();
                            let credit = Arc::new(Semaphore::new(EGRESS_WINDOW));
                            streams.insert(id, Stream { to_gateway: Some(tx), credit: credit.clone() });
                            tasks.spawn(stream(id, gateway.clone(), rx, credit, events.clone()));
                        }
                        EgressUp::Data { id, bytes } => {
                            table.data(id, bytes.len()).map_err(EgressError::Breach)?;
                            if let Some(tx) = streams.get(&id).and_then(|s| s.to_gateway.as_ref()) {
                                // A stream whose connection failed drops it: the guest was told.
                                let _ = tx.send(bytes);
                            }
                        }
                        EgressUp::Ack { id, bytes } => {
                            table.ack(id, bytes).map_err(EgressError::Breach)?;
                            if let Some(s) = streams.get(&id) {
                                s.credit.add_permits(bytes as usize);
                            }
                        }
                        EgressUp::Close { id } => {
                            if table.guest_close(id).map_err(EgressError::Breach)? {
                                streams.remove(&id);
                            } else if let Some(s) = streams.get_mut(&id) {
                                s.to_gateway = None;
                            }
                        }
                    }
                }
            }
            Some(event) = events_rx.recv() => match event {
                Event::Written(id, n) => {
                    if table.written(id, n) {
                        let _ = out.send(EgressDown::Ack { id, bytes: n as u32 });
                    }
                }
                Event::Down(id, bytes) => {
                    if table.sent(id, bytes.len()) {
                        let _ = out.send(EgressDown::Data { id, bytes });
                    }
                }
                Event::Eof(id) | Event::Failed(id) => {
                    let failed = matches!(event, Event::Failed(_));
                    if table.host_close(id) {
                        let _ = out.send(if failed { EgressDown::OpenFailed { id } } else { EgressDown::Close { id } });
                    }
                    if !table.live.contains_key(&id) {
                        streams.remove(&id);
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
    mut from_guest: mpsc::UnboundedReceiver<Vec<u8>>,
    credit: Arc<Semaphore>,
    events: mpsc::UnboundedSender<Event>,
) {
    let conn = match gateway.connect().await {
        Ok(c) => c,
        Err(_) => {
            let _ = events.send(Event::Failed(id));
            return;
        }
    };
    let (mut r, mut w) = conn.into_split();
    let up = async {
        let mut open = true;
        while let Some(bytes) = from_guest.recv().await {
            open = open && w.write_all(&bytes).await.is_ok();
            let _ = events.send(Event::Written(id, bytes.len()));
        }
        if open {
            let _ = w.shutdown().await;
        }
    };
    let down = async {
        let mut buf = vec![0u8; MAX_CHUNK];
        loop {
            let Ok(permit) = credit.acquire().await else { break };
            let room = (credit.available_permits() + 1).min(MAX_CHUNK);
            let n = match r.read(&mut buf[..room]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            permit.forget();
            // Only this task takes permits: the rest of the `room` counted is still there.
            if let Ok(more) = credit.try_acquire_many((n - 1) as u32) {
                more.forget();
            }
            let _ = events.send(Event::Down(id, buf[..n].to_vec()));
        }
        let _ = events.send(Event::Eof(id));
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests;
