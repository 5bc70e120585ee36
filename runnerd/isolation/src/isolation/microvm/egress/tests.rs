use std::time::Duration;

use tokio::net::UnixListener;

use super::*;

#[test]
fn the_table_admits_only_what_the_protocol_allows() {
    // (step, expected) applied in order to one table.
    enum Op {
        Open(u32),
        Data(u32, usize),
        Ack(u32, u32),
        GuestClose(u32),
        Delivered(u32, usize),
        Written(u32, usize),
        HostClose(u32),
    }
    use Op::*;
    let w = EGRESS_WINDOW;
    let table: Vec<(Op, Result<(), Breach>)> = vec![
        (Open(3), Ok(())),
        (Open(3), Err(Breach::Reopened(3))),
        (Open(2), Err(Breach::Reopened(2))),
        (Data(4, 1), Err(Breach::Unknown(4))),
        (Data(3, 0), Err(Breach::Chunk(0))),
        (Data(3, MAX_CHUNK + 1), Err(Breach::Chunk(MAX_CHUNK + 1))),
        (Data(3, MAX_CHUNK), Ok(())),
        (Data(3, w - MAX_CHUNK), Ok(())),
        // The window is full until the gateway took some.
        (Data(3, 1), Err(Breach::Window(3))),
        (Written(3, 10), Ok(())),
        (Data(3, 10), Ok(())),
        (Data(3, 1), Err(Breach::Window(3))),
        // Acknowledgements cover only what was written to the port (queued is not enough).
        (Ack(3, 1), Err(Breach::Ack(3, 1))),
        (Delivered(3, 100), Ok(())),
        (Ack(3, 0), Err(Breach::Ack(3, 0))),
        (Ack(3, 60), Ok(())),
        (Ack(3, 41), Err(Breach::Ack(3, 41))),
        (Ack(3, 40), Ok(())),
        (GuestClose(3), Ok(())),
        (Data(3, 1), Err(Breach::AfterClose(3))),
        (GuestClose(3), Err(Breach::AfterClose(3))),
        // The host's close ends it; then it is unknown, and never reopened.
        (HostClose(3), Ok(())),
        (Data(3, 1), Err(Breach::Unknown(3))),
        (GuestClose(3), Err(Breach::Unknown(3))),
        // A late acknowledgement of a stream that existed is dropped; of one that never did, not.
        (Ack(3, 1), Ok(())),
        (Ack(4, 1), Err(Breach::Unknown(4))),
        (Open(3), Err(Breach::Reopened(3))),
        // A stream the host closed first still takes the guest's data until its close.
        (Open(7), Ok(())),
        (HostClose(7), Ok(())),
        (Data(7, 5), Ok(())),
        (GuestClose(7), Ok(())),
        (Data(7, 5), Err(Breach::Unknown(7))),
    ];
    let mut t = Table::default();
    for (i, (op, want)) in table.into_iter().enumerate() {
        let got = match op {
            Open(id) => t.open(id),
            Data(id, n) => t.data(id, n),
            Ack(id, n) => t.ack(id, n),
            GuestClose(id) => t.guest_close(id).map(drop),
            Delivered(id, n) => {
                assert!(t.delivered(id, n));
                Ok(())
            }
            Written(id, n) => {
                assert!(t.written(id, n));
                Ok(())
            }
            HostClose(id) => {
                assert!(t.host_close(id));
                Ok(())
            }
        };
        assert_eq!(got, want, "step {i}");
    }
    assert_eq!(t.open_streams(), 0);
    // At most EGRESS_MAX_STREAMS open; a closed one makes room.
    let mut t = Table::default();
    for id in 0..EGRESS_MAX_STREAMS as u32 {
        t.open(id).unwrap();
    }
    assert_eq!(t.open(1000), Err(Breach::TooMany));
    t.guest_close(0).unwrap();
    assert!(t.host_close(0));
    assert!(!t.host_close(0), "closed once");
    t.open(1000).unwrap();
}

#[test]
fn the_bridge_prefix_is_the_bwrap_forms_own() {
    use crate::sandbox::argv::{self, BwrapSpec, EgressMount, ProcMode, SandboxShape};
    let host = crate::sandbox::HostRuntime::default();
    let ws = crate::sandbox::WorkspaceLayout::new("/data/projects/p/ws".into(), None);
    let mount = EgressMount { bridge: "/b".into(), gateway_socket: "/s".into(), gateway_fd: None };
    let mut spec = BwrapSpec::new(
        SandboxShape { proc_mode: ProcMode::New, disable_userns: false },
        &host,
        &ws,
        crate::sandbox::Language::Shell,
    );
    let plain = argv::build(&spec).command;
    spec.egress = Some(&mount);
    let with = argv::build(&spec);
    let (command, port) = super::super::request::without_bridge(&with.command).expect("the bridge prefix");
    assert_eq!((command, port), (plain.clone(), common::egress::protocol::BRIDGE_PORT));
    let proxies: Vec<_> = with.env.iter().filter(|(k, _)| k.to_lowercase().ends_with("_proxy")).collect();
    assert_eq!(proxies.len(), 4, "{:?}", with.env);
    assert!(proxies.iter().all(|(_, v)| v == &format!("http://127.0.0.1:{port}")));
    assert_eq!(super::super::request::without_bridge(&plain), None);
}

/// A gateway stand-in: echoes each connection back until its end, then closes. Returns the
/// listener's path.
fn echo_gateway(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("0123456789abcdef");
    let listener = UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    path
}

/// The guest's side of the port, scripted.
struct Guest {
    rd: tokio::net::unix::OwnedReadHalf,
    wr: tokio::net::unix::OwnedWriteHalf,
    decoder: Decoder,
}

impl Guest {
    async fn send(&mut self, msgs: &[EgressUp]) {
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| wire::encode(m).unwrap()).collect();
        self.wr.write_all(&bytes).await.unwrap();
    }

    /// The next frame, `None` at the port's end or after `wait` without one.
    async fn next(&mut self, wait: Duration) -> Option<EgressDown> {
        let mut buf = [0u8; 16 * 1024];
        loop {
            if let Some(m) = self.decoder.next_msg::<EgressDown>().unwrap() {
                return Some(m);
            }
            match tokio::time::timeout(wait, self.rd.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => self.decoder.feed(&buf[..n]),
                _ => return None,
            }
        }
    }

    /// Frames until `done` says so, acknowledging data as it comes; the bytes per stream.
    async fn collect(&mut self, mut done: impl FnMut(&EgressDown) -> bool) -> HashMap<u32, Vec<u8>> {
        let mut got: HashMap<u32, Vec<u8>> = HashMap::new();
        while let Some(m) = self.next(Duration::from_secs(10)).await {
            if let EgressDown::Data { id, bytes } = &m {
                got.entry(*id).or_default().extend_from_slice(bytes);
                self.send(&[EgressUp::Ack { id: *id, bytes: bytes.len() as u32 }]).await;
            }
            if done(&m) {
                break;
            }
        }
        got
    }
}

fn start(gateway: Gateway) -> (Guest, JoinHandle<Result<(), EgressError>>) {
    let (host, guest) = UnixStream::pair().unwrap();
    let relay = tokio::spawn(relay(host, gateway));
    let (rd, wr) = guest.into_split();
    (Guest { rd, wr, decoder: Decoder::default() }, relay)
}

fn o_path(path: &std::path::Path) -> OwnedFd {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .unwrap();
    OwnedFd::from(f)
}

#[tokio::test]
async fn streams_reach_the_gateway_by_its_descriptor_and_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = echo_gateway(dir.path());
    let fd = o_path(&path);
    // The path is gone: only the descriptor still names the socket.
    let moved = dir.path().join("moved");
    std::fs::rename(&path, &moved).unwrap();
    let (mut guest, relay) = start(Gateway::Fd(fd));
    let big: Vec<u8> = (0..EGRESS_WINDOW * 3).map(|i| (i % 251) as u8).collect();
    guest.send(&[EgressUp::Open { id: 1 }, EgressUp::Open { id: 5 }]).await;
    guest.send(&[EgressUp::Data { id: 1, bytes: b"hello".to_vec() }, EgressUp::Close { id: 1 }]).await;
    // Stream 5 sends three windows' worth: only within the acknowledged window at a time.
    let mut sent = 0;
    let mut closes = 0;
    let mut got: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut credit = EGRESS_WINDOW;
    while closes < 2 {
        while sent < big.len() && credit > 0 {
            let n = credit.min(MAX_CHUNK).min(big.len() - sent);
            guest.send(&[EgressUp::Data { id: 5, bytes: big[sent..sent + n].to_vec() }]).await;
            sent += n;
            credit -= n;
            if sent == big.len() {
                guest.send(&[EgressUp::Close { id: 5 }]).await;
            }
        }
        match guest.next(Duration::from_secs(10)).await.expect("a frame") {
            EgressDown::Data { id, bytes } => {
                got.entry(id).or_default().extend_from_slice(&bytes);
                guest.send(&[EgressUp::Ack { id, bytes: bytes.len() as u32 }]).await;
            }
            EgressDown::Ack { id: 5, bytes } => credit += bytes as usize,
            EgressDown::Ack { .. } => {}
            EgressDown::Close { .. } => closes += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got[&1], b"hello");
    assert_eq!(got[&5].len(), big.len());
    assert!(got[&5] == big);
    // The port's end ends the relay cleanly.
    drop(guest);
    assert!(matches!(relay.await.unwrap(), Ok(())));
}

#[tokio::test]
async fn an_unreachable_gateway_fails_the_stream_not_the_channel() {
    let dir = tempfile::tempdir().unwrap();
    let (mut guest, relay) = start(Gateway::Path(dir.path().join("nothing-here")));
    guest.send(&[EgressUp::Open { id: 0 }, EgressUp::Data { id: 0, bytes: b"GET /".to_vec() }]).await;
    assert_eq!(guest.next(Duration::from_secs(10)).await, Some(EgressDown::OpenFailed { id: 0 }));
    // Data the guest sent before it heard is taken; its close ends the stream; the next opens.
    guest.send(&[EgressUp::Data { id: 0, bytes: b"x".to_vec() }, EgressUp::Close { id: 0 }]).await;
    guest.send(&[EgressUp::Open { id: 1 }]).await;
    assert_eq!(guest.next(Duration::from_secs(10)).await, Some(EgressDown::OpenFailed { id: 1 }));
    assert!(!relay.is_finished());
}

#[tokio::test]
async fn the_gateway_sends_no_more_than_the_window_until_the_guest_acknowledges() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("0123456789abcdef");
    let listener = UnixListener::bind(&path).unwrap();
    // A gateway that answers 1 MiB at once.
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let _ = conn.write_all(&vec![b'z'; 1 << 20]).await;
        let _ = conn.shutdown().await;
        std::future::pending::<()>().await;
    });
    let (mut guest, _relay) = start(Gateway::Path(path));
    guest.send(&[EgressUp::Open { id: 9 }]).await;
    let mut got = 0;
    while let Some(m) = guest.next(Duration::from_millis(500)).await {
        match m {
            EgressDown::Data { bytes, .. } => got += bytes.len(),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, EGRESS_WINDOW, "exactly one window before any acknowledgement");
    guest.send(&[EgressUp::Ack { id: 9, bytes: 1000 }]).await;
    let mut more = 0;
    while let Some(EgressDown::Data { bytes, .. }) = guest.next(Duration::from_millis(500)).await {
        more += bytes.len();
    }
    assert_eq!(more, 1000);
    // Acknowledging everything lets the rest and the close through.
    guest.send(&[EgressUp::Ack { id: 9, bytes: (EGRESS_WINDOW) as u32 }]).await;
    let rest = guest.collect(|m| matches!(m, EgressDown::Close { .. })).await;
    assert_eq!(got + more + rest.get(&9).map_or(0, Vec::len), 1 << 20);
}

#[tokio::test]
async fn many_streams_at_once_and_a_flood_of_small_frames() {
    let dir = tempfile::tempdir().unwrap();
    let path = echo_gateway(dir.path());
    let (mut guest, relay) = start(Gateway::Path(path));
    let n = EGRESS_MAX_STREAMS as u32;
    let mut frames: Vec<EgressUp> = (0..n).map(|id| EgressUp::Open { id }).collect();
    frames.extend((0..n).map(|id| EgressUp::Data { id, bytes: id.to_le_bytes().to_vec() }));
    // One stream gets a window's worth of one-byte frames.
    frames.extend((0..EGRESS_WINDOW - 4).map(|_| EgressUp::Data { id: 0, bytes: vec![b'.'] }));
    frames.extend((0..n).map(|id| EgressUp::Close { id }));
    guest.send(&frames).await;
    let mut closed = 0;
    let got = guest
        .collect(|m| {
            closed += u32::from(matches!(m, EgressDown::Close { .. }));
            closed == n
        })
        .await;
    assert_eq!(got.len(), n as usize);
    for id in 1..n {
        assert_eq!(got[&id], id.to_le_bytes());
    }
    assert_eq!(got[&0].len(), EGRESS_WINDOW);
    // All closed: as many new ones may open again.
    guest.send(&(n..2 * n).map(|id| EgressUp::Open { id }).collect::<Vec<_>>()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!relay.is_finished());
}

#[tokio::test]
async fn a_hostile_guest_loses_its_egress_channel() {
    let open = |id| EgressUp::Open { id };
    let data = |id, n| EgressUp::Data { id, bytes: vec![1; n] };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("oversized header", u32::MAX.to_le_bytes().to_vec()),
        ("garbage", vec![3, 0, 0, 0, 0xff, 0xff, 0xff]),
        ("reopen", [open(1), open(1)].iter().flat_map(|m| wire::encode(m).unwrap()).collect()),
        ("unknown id", wire::encode(&data(4, 1)).unwrap()),
        (
            "data after close",
            [open(1), EgressUp::Close { id: 1 }, data(1, 1)]
                .iter()
                .flat_map(|m| wire::encode(m).unwrap())
                .collect(),
        ),
        (
            "beyond the window",
            std::iter::once(open(2))
                .chain((0..=EGRESS_WINDOW / MAX_CHUNK).map(|_| data(2, MAX_CHUNK)))
                .flat_map(|m| wire::encode(&m).unwrap())
                .collect(),
        ),
        (
            "oversized chunk",
            [open(2), data(2, MAX_CHUNK + 1)].iter().flat_map(|m| wire::encode(m).unwrap()).collect(),
        ),
        (
            "ack of nothing",
            [open(2), EgressUp::Ack { id: 2, bytes: 1 }]
                .iter()
                .flat_map(|m| wire::encode(m).unwrap())
                .collect(),
        ),
        (
            "too many streams",
            (0..=EGRESS_MAX_STREAMS as u32).flat_map(|id| wire::encode(&open(id)).unwrap()).collect(),
        ),
    ];
    for (what, bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = echo_gateway(dir.path());
        let (mut guest, relay) = start(Gateway::Path(path));
        guest.wr.write_all(&bytes).await.unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(10), relay).await.expect(what).unwrap();
        assert!(matches!(ended, Err(EgressError::Breach(_) | EgressError::Wire(_))), "{what}: {ended:?}");
        // The channel is closed: the guest reads its end (after any frames already sent).
        while guest.next(Duration::from_secs(5)).await.is_some() {}
        let mut b = [0u8; 1];
        assert_eq!(guest.rd.read(&mut b).await.unwrap(), 0, "{what}");
    }
}

#[test]
fn the_outbox_coalesces_acknowledgements_and_counts_data_once_written() {
    // The stated sizes are the largest frames.
    assert!(
        wire::encode(&EgressDown::Data { id: u32::MAX, bytes: vec![0; MAX_CHUNK] }).unwrap().len()
            <= MAX_DOWN_FRAME
    );
    assert!(wire::encode(&EgressDown::Ack { id: u32::MAX, bytes: u32::MAX }).unwrap().len() <= ACK_FRAME);
    let mut o = Outbox::default();
    // A thousand one-byte writes to the gateway owe one acknowledgement.
    for _ in 0..1000 {
        o.ack(1, 1);
    }
    o.ack(2, 5);
    assert_eq!(o.bytes(), 2 * ACK_FRAME);
    o.push(&EgressDown::Data { id: 1, bytes: vec![7; 10] }).unwrap();
    o.push(&EgressDown::Close { id: 1 }).unwrap();
    // Written three bytes at a time: a `Data` counts only once its last byte went out.
    let mut port = Vec::new();
    let mut delivered = Vec::new();
    loop {
        let pending = o.pending().unwrap();
        if pending.is_empty() {
            break;
        }
        let n = pending.len().min(3);
        port.extend_from_slice(&pending[..n]);
        if let Some(d) = o.wrote(n) {
            delivered.push((d, port.len()));
        }
    }
    assert_eq!(o.bytes(), 0);
    let mut d = Decoder::default();
    d.feed(&port);
    let mut msgs = Vec::new();
    let mut ends = Vec::new();
    while let Some(m) = d.next_msg::<EgressDown>().unwrap() {
        msgs.push(m);
        ends.push(port.len() - d.pending());
    }
    let at = |m: &EgressDown| msgs.iter().position(|x| x == m).unwrap_or_else(|| panic!("{m:?} in {msgs:?}"));
    assert_eq!(msgs.len(), 4, "{msgs:?}");
    at(&EgressDown::Ack { id: 1, bytes: 1000 });
    at(&EgressDown::Ack { id: 2, bytes: 5 });
    let data = at(&EgressDown::Data { id: 1, bytes: vec![7; 10] });
    assert!(data < at(&EgressDown::Close { id: 1 }), "in order: {msgs:?}");
    assert_eq!(delivered, vec![((1, 10), ends[data])]);
    // Frames are taken only while there is room: the outbox never holds more than its maximum.
    while o.has_room() {
        o.push(&EgressDown::Data { id: 3, bytes: vec![0; MAX_CHUNK] }).unwrap();
        o.ack(4, 1);
    }
    assert!(o.bytes() >= OUTBOX_ROOM && o.bytes() <= OUTBOX_MAX, "{}", o.bytes());
    assert_eq!(o.high_water(), o.bytes());
}

/// The data bytes per stream in the complete frames waiting in `rd`, left there (`MSG_PEEK`).
fn peek_data(rd: &tokio::net::unix::OwnedReadHalf, buf: &mut [u8]) -> HashMap<u32, usize> {
    use std::os::fd::AsRawFd;
    let fd = AsRef::<UnixStream>::as_ref(rd).as_raw_fd();
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes and `fd` is an open socket for
    // the call; MSG_PEEK leaves the bytes in the socket, MSG_DONTWAIT never blocks.
    let n =
        unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    let mut decoder = Decoder::default();
    decoder.feed(&buf[..usize::try_from(n).unwrap_or(0)]);
    let mut seen = HashMap::new();
    while let Some(m) = decoder.next_msg::<EgressDown>().unwrap() {
        if let EgressDown::Data { id, bytes } = m {
            *seen.entry(id).or_default() += bytes.len();
        }
    }
    seen
}

#[tokio::test]
async fn a_guest_that_never_reads_its_port_cannot_grow_runnerds_queue() {
    let dir = tempfile::tempdir().unwrap();
    let path = echo_gateway(dir.path());
    let (host, guest) = UnixStream::pair().unwrap();
    let high_water = Arc::new(AtomicUsize::new(0));
    let relay = tokio::spawn({
        let high_water = high_water.clone();
        async move { relay_watched(host, Gateway::Path(path), &high_water).await }
    });
    let (mut rd, mut wr) = guest.into_split();
    // Every stream floods one-byte frames (within its window: the guest never reads an
    // acknowledgement), each echoed back by the gateway; the guest reads nothing, but
    // acknowledges every byte that reached its port (peeking), so runnerd's credit allows all.
    const STREAMS: u32 = EGRESS_MAX_STREAMS as u32;
    const PER_STREAM: usize = 16 * 1024;
    let byte = |i: usize| (i % 251) as u8;
    let mut flood = (0..STREAMS).map(|id| EgressUp::Open { id }).chain(
        (0..PER_STREAM).flat_map(|i| (0..STREAMS).map(move |id| EgressUp::Data { id, bytes: vec![byte(i)] })),
    );
    let mut out: Vec<u8> = Vec::new();
    let mut acked: HashMap<u32, usize> = HashMap::new();
    let mut peek = vec![0u8; 4 << 20];
    let mut flooded = false;
    loop {
        while out.len() < 64 * 1024 {
            match flood.next() {
                Some(m) => out.extend(wire::encode(&m).unwrap()),
                None => {
                    flooded = true;
                    break;
                }
            }
        }
        for (id, n) in peek_data(&rd, &mut peek) {
            let a = acked.entry(id).or_default();
            if n > *a {
                out.extend(wire::encode(&EgressUp::Ack { id, bytes: (n - *a) as u32 }).unwrap());
                *a = n;
            }
        }
        if out.is_empty() {
            break;
        }
        // `write` is cancel-safe: a write that does not finish wrote nothing. One that waits
        // this long means runnerd stopped reading the port (time only ends the flood).
        match tokio::time::timeout(Duration::from_secs(2), wr.write(&out)).await {
            Ok(n) => drop(out.drain(..n.unwrap())),
            Err(_) => break,
        }
    }
    // Whether the flood stalled or was all taken, the echoes fill the outbox (more than the
    // port holds comes back, and nothing reads it); time only bounds the wait.
    for _ in 0..100 {
        if high_water.load(Ordering::Relaxed) >= OUTBOX_ROOM {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held = high_water.load(Ordering::Relaxed);
    eprintln!(
        "flooded everything: {flooded}; runnerd's outbox held at most {held} bytes (bound {OUTBOX_MAX})"
    );
    assert!(!relay.is_finished(), "a stalled guest only stalls");
    assert!(held <= OUTBOX_MAX, "{held} > {OUTBOX_MAX}");
    assert!(held >= OUTBOX_ROOM, "the flood filled the outbox: {held}");

    // Reading again, the guest gets everything, in order, and every stream's close.
    let (acks, mut acks_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let rest: Vec<u8> = flood.flat_map(|m| wire::encode(&m).unwrap()).collect();
    let writer = tokio::spawn(async move {
        wr.write_all(&out).await.unwrap();
        wr.write_all(&rest).await.unwrap();
        while let Some(frame) = acks_rx.recv().await {
            wr.write_all(&frame).await.unwrap();
        }
    });
    let mut got: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut decoder = Decoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut closed = 0;
    let mut closing = false;
    while closed < STREAMS {
        let msg = match decoder.next_msg::<EgressDown>().unwrap() {
            Some(m) => m,
            None => {
                let n = tokio::time::timeout(Duration::from_secs(20), rd.read(&mut buf))
                    .await
                    .expect("progress")
                    .unwrap();
                assert!(n > 0, "the relay ended: {:?}", relay.is_finished());
                decoder.feed(&buf[..n]);
                continue;
            }
        };
        match msg {
            EgressDown::Data { id, bytes } => {
                let g = got.entry(id).or_default();
                g.extend_from_slice(&bytes);
                let a = acked.entry(id).or_default();
                if g.len() > *a {
                    acks.send(wire::encode(&EgressUp::Ack { id, bytes: (g.len() - *a) as u32 }).unwrap())
                        .unwrap();
                    *a = g.len();
                }
            }
            EgressDown::Ack { .. } => {}
            EgressDown::Close { .. } => closed += 1,
            other => panic!("{other:?}"),
        }
        if !closing && got.len() == STREAMS as usize && got.values().all(|g| g.len() == PER_STREAM) {
            closing = true;
            for id in 0..STREAMS {
                acks.send(wire::encode(&EgressUp::Close { id }).unwrap()).unwrap();
            }
        }
    }
    let want: Vec<u8> = (0..PER_STREAM).map(byte).collect();
    assert!(got.values().all(|g| *g == want), "every stream's bytes came back in order");
    assert!(high_water.load(Ordering::Relaxed) <= OUTBOX_MAX);
    drop(acks);
    writer.await.unwrap();
    drop(rd);
    assert!(matches!(relay.await.unwrap(), Ok(())));
}

#[tokio::test]
async fn a_gateway_connection_that_fails_is_a_reset_not_an_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("0123456789abcdef");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    // A gateway that answers part, then closes with the request unread: a Unix socket's
    // peer then reads ECONNRESET after the data.
    std::thread::spawn(move || {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let (mut conn, _) = listener.accept().unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\npart").unwrap();
        let mut b = [0u8; 1];
        // SAFETY: `b` is valid for writes of one byte and `conn` is an open socket for the
        // call; MSG_PEEK waits for the request without taking it.
        let n = unsafe { libc::recv(conn.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
        assert_eq!(n, 1);
        drop(conn);
        std::thread::park();
    });
    let (mut guest, relay) = start(Gateway::Path(path));
    guest
        .send(&[
            EgressUp::Open { id: 2 },
            EgressUp::Data { id: 2, bytes: b"GET / HTTP/1.1\r\n\r\n".to_vec() },
        ])
        .await;
    let mut got = Vec::new();
    loop {
        match guest.next(Duration::from_secs(10)).await.expect("a frame") {
            EgressDown::Data { id: 2, bytes } => got.extend_from_slice(&bytes),
            EgressDown::Ack { id: 2, .. } => {}
            EgressDown::Reset { id: 2 } => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got, b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\npart");
    // The stream ends as after a close: the guest's close reaps it; the channel goes on.
    guest.send(&[EgressUp::Close { id: 2 }, EgressUp::Open { id: 3 }]).await;
    assert!(!relay.is_finished());
}

#[tokio::test]
async fn a_stream_the_gateway_ended_first_lets_go_of_its_gateway_at_the_guests_close() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("0123456789abcdef");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    // A gateway that answers and ends its side first (`Connection: close`), then waits for
    // the relay to end its own: the stream's task must not outlive the stream.
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut conn, _) = listener.accept().unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndone").unwrap();
        conn.shutdown(std::net::Shutdown::Write).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        seen_tx.send(conn.read_to_end(&mut rest).map(|_| rest)).unwrap();
    });
    let (mut guest, relay) = start(Gateway::Path(path));
    guest
        .send(&[
            EgressUp::Open { id: 1 },
            EgressUp::Data { id: 1, bytes: b"GET / HTTP/1.1\r\n\r\n".to_vec() },
        ])
        .await;
    loop {
        match guest.next(Duration::from_secs(10)).await.expect("a frame") {
            EgressDown::Close { id: 1 } => break,
            EgressDown::Data { id: 1, .. } | EgressDown::Ack { id: 1, .. } => {}
            other => panic!("{other:?}"),
        }
    }
    // The guest's close after the gateway's: the relay's half toward the gateway ends, so
    // the gateway reads its end (not a timeout), and the channel goes on.
    guest.send(&[EgressUp::Close { id: 1 }]).await;
    let seen = tokio::task::spawn_blocking(move || seen_rx.recv().unwrap()).await.unwrap();
    assert_eq!(seen.expect("the gateway read its end, not a timeout"), b"GET / HTTP/1.1\r\n\r\n");
    assert!(!relay.is_finished());
}

#[tokio::test]
async fn a_stalled_stream_stalls_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("0123456789abcdef");
    let listener = UnixListener::bind(&path).unwrap();
    // The first connection answers 1 MiB and never reads what it is sent; the rest echo.
    tokio::spawn(async move {
        let (mut stalled, _) = listener.accept().await.unwrap();
        tokio::spawn(async move {
            let _ = stalled.write_all(&vec![b'z'; 1 << 20]).await;
            std::future::pending::<()>().await;
        });
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = conn.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    let (mut guest, relay) = start(Gateway::Path(path));
    // Stream 1: its gateway's answer is never acknowledged by the guest, and its gateway
    // never reads: the guest sends it data within its credit until the gateway's socket is
    // full and the relay holds a whole window unacknowledged (no acknowledgement for 500 ms).
    guest.send(&[EgressUp::Open { id: 1 }]).await;
    let (mut stalled, mut up_credit, mut up_sent) = (0, EGRESS_WINDOW, 0);
    loop {
        while up_credit > 0 {
            let n = up_credit.min(MAX_CHUNK);
            guest.send(&[EgressUp::Data { id: 1, bytes: vec![b'u'; n] }]).await;
            (up_credit, up_sent) = (up_credit - n, up_sent + n);
        }
        match guest.next(Duration::from_millis(500)).await {
            Some(EgressDown::Data { id: 1, bytes }) => stalled += bytes.len(),
            Some(EgressDown::Ack { id: 1, bytes }) => up_credit += bytes as usize,
            Some(other) => panic!("{other:?}"),
            None => break,
        }
    }
    assert!(up_sent > EGRESS_WINDOW, "the gateway's socket took more than a window: {up_sent}");
    // Stream 2 meanwhile carries three windows' worth there and back.
    guest.send(&[EgressUp::Open { id: 2 }]).await;
    let big: Vec<u8> = (0..EGRESS_WINDOW * 3).map(|i| (i % 253) as u8).collect();
    let (mut sent, mut credit, mut back) = (0, EGRESS_WINDOW, Vec::new());
    let mut closed = false;
    while !closed {
        while sent < big.len() && credit > 0 {
            let n = credit.min(MAX_CHUNK).min(big.len() - sent);
            guest.send(&[EgressUp::Data { id: 2, bytes: big[sent..sent + n].to_vec() }]).await;
            (sent, credit) = (sent + n, credit - n);
            if sent == big.len() {
                guest.send(&[EgressUp::Close { id: 2 }]).await;
            }
        }
        match guest.next(Duration::from_secs(10)).await.expect("stream 2 goes on") {
            EgressDown::Data { id: 2, bytes } => {
                back.extend_from_slice(&bytes);
                guest.send(&[EgressUp::Ack { id: 2, bytes: bytes.len() as u32 }]).await;
            }
            EgressDown::Data { id: 1, bytes } => stalled += bytes.len(),
            // What the stalled gateway's socket buffer took of stream 1's window.
            EgressDown::Ack { id: 1, .. } => {}
            EgressDown::Ack { id: 2, bytes } => credit += bytes as usize,
            EgressDown::Close { id: 2 } => closed = true,
            other => panic!("{other:?}"),
        }
    }
    assert!(back == big, "stream 2 came back whole ({} of {} bytes)", back.len(), big.len());
    // Stream 1 got exactly its window and no more, and the channel lives.
    // (Until the window is in, a loaded host gets 10 s; after it, 300 ms of quiet.)
    let wait = |stalled| Duration::from_millis(if stalled >= EGRESS_WINDOW { 300 } else { 10_000 });
    while let Some(m) = guest.next(wait(stalled)).await {
        match m {
            EgressDown::Data { id: 1, bytes } => stalled += bytes.len(),
            EgressDown::Ack { id: 1, .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(stalled, EGRESS_WINDOW);
    assert!(!relay.is_finished());
}
