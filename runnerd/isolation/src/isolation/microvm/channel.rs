//! runnerd's side of the conversation with the guest agent, over runnerd's end of the
//! socket pair whose other end is QEMU's virtio-serial chardev.
//!
//! It sends the run request and the input, and reads the guest's frames into the job's
//! [`OutputSink`] until the one final message. Every frame goes through
//! [`wire::HostSide`]: a guest that breaks the protocol (an oversized frame, a bad exit
//! record, anything after its exit) gets a [`Verdict::Refused`] and its VM is ended by the
//! caller; nothing it said after that is believed.

use runner_guest_agent::wire::{
    self, Decoder, Event, Exit, GuestMsg, HostMsg, HostSide, RunRequest, WireError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::launch::output::BACKLOG_WAIT;
use crate::launch::{OutputSink, Stream};

/// How the conversation ended.
#[derive(Debug)]
pub enum Verdict {
    /// The guest reported the command's end.
    Exit(Exit),
    /// The guest could not start the command.
    Failed(String),
    /// The guest broke the protocol.
    Refused(WireError),
    /// The channel closed (QEMU ended) before a final message; `ready`: the guest had booted.
    Closed { ready: bool },
    /// The channel itself failed.
    Io(std::io::Error),
}

/// runnerd's end of one VM's agent channel, and what the guest said on it so far.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    side: HostSide,
    decoder: Decoder,
    ready: bool,
}

impl Channel {
    pub fn new(stream: UnixStream) -> Channel {
        Channel { stream, side: HostSide::default(), decoder: Decoder::default(), ready: false }
    }

    /// Waits for the guest's `Ready` (a VM booted ahead, or the KVM probe's); anything else
    /// the guest says first, or the channel's end, is the verdict.
    pub async fn ready(&mut self) -> Result<(), Verdict> {
        let mut buf = [0u8; 1024];
        loop {
            match self.decoder.next_msg::<GuestMsg>() {
                Err(e) => return Err(Verdict::Refused(e)),
                Ok(Some(msg)) => {
                    return match self.side.accept(msg) {
                        Ok(Event::Ready) => {
                            self.ready = true;
                            Ok(())
                        }
                        // Before `Ready` the side accepts nothing else.
                        Ok(_) => Err(Verdict::Refused(WireError::OutOfOrder("a message before ready"))),
                        Err(e) => Err(Verdict::Refused(e)),
                    };
                }
                Ok(None) => {}
            }
            match self.stream.read(&mut buf).await {
                Ok(0) => return Err(Verdict::Closed { ready: false }),
                Ok(n) => self.decoder.feed(&buf[..n]),
                Err(e) => return Err(Verdict::Io(e)),
            }
        }
    }

    /// Runs the conversation to its final message or the channel's end: the request and
    /// the input sent, the guest's output into `sink`.
    pub async fn converse(self, request: RunRequest, stdin: Vec<u8>, sink: &mut dyn OutputSink) -> Verdict {
        let Channel { stream, mut side, mut decoder, mut ready } = self;
        let (mut rd, mut wr) = stream.into_split();
        let write = async move {
            let mut frames = vec![HostMsg::Run(Box::new(request))];
            frames.extend(stdin.chunks(wire::MAX_CHUNK).map(|c| HostMsg::Stdin(c.to_vec())));
            frames.push(HostMsg::StdinEnd);
            for msg in frames {
                let frame = wire::encode(&msg)?;
                wr.write_all(&frame).await.map_err(|_| WireError::OutOfOrder("a closed channel"))?;
            }
            // Kept open: closing our end would disconnect the port, and the guest's writes
            // would then block.
            std::future::pending::<()>().await;
            Ok::<(), WireError>(())
        };
        tokio::pin!(write);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // The frames in hand first (a booted VM's decoder may hold some already).
            loop {
                let msg = match decoder.next_msg::<GuestMsg>() {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => return Verdict::Refused(e),
                };
                match side.accept(msg) {
                    Ok(Event::Ready) => ready = true,
                    Ok(Event::Stdout(b)) => sink.write(Stream::Stdout, &b),
                    Ok(Event::Stderr(b)) => sink.write(Stream::Stderr, &b),
                    Ok(Event::Exit(exit)) => return Verdict::Exit(exit),
                    Ok(Event::Failed(text)) => return Verdict::Failed(text),
                    Err(e) => return Verdict::Refused(e),
                }
            }
            // A sink with a backlog is let drain before the next read (as the launcher
            // does); meanwhile the guest waits on a full channel.
            while let Some(drained) = sink.backlog() {
                let notified = drained.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if sink.backlog().is_none() || tokio::time::timeout(BACKLOG_WAIT, notified).await.is_err() {
                    break;
                }
            }
            let n = tokio::select! {
                r = &mut write => match r {
                    // A request too large for a frame: the guest never hears of it.
                    Err(e) => return Verdict::Refused(e),
                    Ok(()) => continue,
                },
                r = rd.read(&mut buf) => match r {
                    Ok(0) => return Verdict::Closed { ready },
                    Ok(n) => n,
                    Err(e) => return Verdict::Io(e),
                },
            };
            decoder.feed(&buf[..n]);
            // One read's frames, then the runtime's other tasks get their turn.
            tokio::task::yield_now().await;
        }
    }
}

/// Runs one conversation with a VM that has not said `Ready` yet ([`Channel::converse`]).
pub async fn converse(
    stream: UnixStream,
    request: RunRequest,
    stdin: Vec<u8>,
    sink: &mut dyn OutputSink,
) -> Verdict {
    Channel::new(stream).converse(request, stdin, sink).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use runner_guest_agent::wire::ExitRecord;

    #[derive(Default)]
    struct Collect(Vec<(Stream, Vec<u8>)>);
    impl OutputSink for Collect {
        fn write(&mut self, stream: Stream, bytes: &[u8]) {
            self.0.push((stream, bytes.to_vec()));
        }
    }

    fn request() -> RunRequest {
        RunRequest {
            argv: vec!["/bin/true".into()],
            env: vec![],
            cwd: "/workspace".into(),
            workspace: "/workspace".into(),
            workspace_parent: None,
            uid: 1000,
            gid: 1000,
            science_env: false,
            skills: false,
            python_packages: None,
            masks: vec![],
            tmp_bytes: 1 << 20,
            pids: 0,
            fsize: 0,
            passwd: vec![],
            group: vec![],
            egress_port: None,
        }
    }

    /// Runs a conversation against a scripted guest that sends `frames` raw.
    async fn against(frames: Vec<u8>) -> (Verdict, Collect, Vec<HostMsg>) {
        let (host, guest) = UnixStream::pair().unwrap();
        let guest = tokio::spawn(async move {
            let (mut rd, mut wr) = guest.into_split();
            let _ = wr.write_all(&frames).await;
            let mut got = Decoder::default();
            let mut msgs = Vec::new();
            let mut buf = [0u8; 4096];
            // Reads what the host sent until it stops (the host keeps its end open).
            while let Ok(Ok(n)) =
                tokio::time::timeout(std::time::Duration::from_millis(200), rd.read(&mut buf)).await
            {
                if n == 0 {
                    break;
                }
                got.feed(&buf[..n]);
                while let Ok(Some(m)) = got.next_msg::<HostMsg>() {
                    msgs.push(m);
                }
            }
            drop(wr);
            msgs
        });
        let mut sink = Collect::default();
        let verdict = converse(host, request(), b"input".to_vec(), &mut sink).await;
        (verdict, sink, guest.await.unwrap())
    }

    fn frames(msgs: &[GuestMsg]) -> Vec<u8> {
        msgs.iter().flat_map(|m| wire::encode(m).unwrap()).collect()
    }

    #[tokio::test]
    async fn output_and_exit_arrive_and_the_request_and_input_are_sent() {
        let ready = GuestMsg::Ready { protocol: wire::PROTOCOL };
        let exit = GuestMsg::Exit(ExitRecord { code: Some(7), signal: None, oom_killed: false });
        let (v, sink, sent) = against(frames(&[
            ready,
            GuestMsg::Stdout(b"out".to_vec()),
            GuestMsg::Stderr(b"err".to_vec()),
            exit,
        ]))
        .await;
        assert!(matches!(v, Verdict::Exit(Exit::Code { code: 7, oom: false })), "{v:?}");
        assert_eq!(sink.0, vec![(Stream::Stdout, b"out".to_vec()), (Stream::Stderr, b"err".to_vec())]);
        assert_eq!(
            sent,
            vec![HostMsg::Run(Box::new(request())), HostMsg::Stdin(b"input".to_vec()), HostMsg::StdinEnd]
        );
    }

    #[tokio::test]
    async fn hostile_frames_are_refused() {
        let ready = frames(&[GuestMsg::Ready { protocol: wire::PROTOCOL }]);
        // An oversized header: refused before any body arrives.
        let mut oversized = ready.clone();
        oversized.extend_from_slice(&u32::MAX.to_le_bytes());
        let (v, sink, _) = against(oversized).await;
        assert!(matches!(v, Verdict::Refused(WireError::Oversized(_))), "{v:?}");
        assert!(sink.0.is_empty());
        // A bad exit record.
        let mut bad = ready.clone();
        bad.extend(frames(&[GuestMsg::Exit(ExitRecord {
            code: Some(0),
            signal: Some(9),
            oom_killed: true,
        })]));
        assert!(matches!(against(bad).await.0, Verdict::Refused(WireError::BadExit(_))));
        // Garbage.
        let mut garbage = ready.clone();
        garbage.extend_from_slice(&[8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(against(garbage).await.0, Verdict::Refused(WireError::Malformed(_))));
        // Output before ready.
        let early = frames(&[GuestMsg::Stdout(b"x".to_vec())]);
        assert!(matches!(against(early).await.0, Verdict::Refused(WireError::OutOfOrder(_))));
    }

    #[tokio::test]
    async fn a_flood_of_output_ends_in_the_sink_and_a_silent_close_is_not_an_exit() {
        let mut msgs = vec![GuestMsg::Ready { protocol: wire::PROTOCOL }];
        msgs.extend((0..2000).map(|_| GuestMsg::Stdout(vec![b'x'; 1000])));
        let (v, sink, _) = against(frames(&msgs)).await;
        assert!(matches!(v, Verdict::Closed { ready: true }), "{v:?}");
        assert_eq!(sink.0.iter().map(|(_, b)| b.len()).sum::<usize>(), 2_000_000);
    }
}
