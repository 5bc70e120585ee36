//! The host↔guest protocol of the microvm backend: one virtio-serial port carries frames of
//! `u32` little-endian length + a postcard-encoded message.
//!
//! Host → guest: [`HostMsg::Run`] once, then [`HostMsg::Stdin`] chunks and
//! [`HostMsg::StdinEnd`]. Guest → host: [`GuestMsg::Ready`] once booted, then output chunks,
//! then exactly one [`GuestMsg::Exit`] (or [`GuestMsg::Failed`]) as the last frame.
//!
//! The host trusts the guest with nothing but what it may report: every frame is bounded
//! ([`MAX_FRAME`], refused from its header before any body is buffered), output chunks are
//! bounded ([`MAX_CHUNK`]), an exit record must be one code *or* one signal in range
//! ([`ExitRecord::check`]), and anything out of order ends the VM ([`HostSide`]).
//!
//! A run with egress (`domain-allowlist`) has a second port, [`EGRESS_PORT_NAME`], with its
//! own messages: the guest's bridge multiplexes its loopback proxy connections over it as
//! streams ([`EgressUp`], [`EgressDown`]), each with a credit window ([`EGRESS_WINDOW`]) in
//! both directions, so neither side ever buffers more than the window per stream and one
//! stalled connection never blocks the others. Without egress the port does not exist.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Bumped when a message changes shape; the host refuses a guest of another version.
pub const PROTOCOL: u16 = 5;
/// The largest frame body either side accepts. The host's `Run` (argv, environment,
/// identity files) must fit; output travels in [`MAX_CHUNK`] pieces well below it.
pub const MAX_FRAME: usize = 256 * 1024;
/// The largest output or input chunk in one frame.
pub const MAX_CHUNK: usize = 64 * 1024;
/// The longest failure text the host keeps from the guest.
pub const MAX_TEXT: usize = 4096;
/// The virtio-serial port's name (`virtserialport,name=…`).
pub const PORT_NAME: &str = "org.sciencediscovery.agent";
/// The egress port's name; present only in a VM whose run has egress.
pub const EGRESS_PORT_NAME: &str = "org.sciencediscovery.egress";
/// The most egress streams open at once (the guest's bridge admits no more connections; the
/// host takes one more `Open` as a breach).
pub const EGRESS_MAX_STREAMS: usize = 64;
/// Bytes one side may send on a stream beyond what the other acknowledged ([`EgressUp::Ack`],
/// [`EgressDown::Ack`]).
pub const EGRESS_WINDOW: usize = 128 * 1024;

/// Guest → host on the egress port. Stream ids are strictly increasing and never reused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EgressUp {
    /// A proxy client connected to the guest's bridge: connect one to the gateway.
    Open { id: u32 },
    /// Bytes from the client (1..=[`MAX_CHUNK`], within the window).
    Data { id: u32, bytes: Vec<u8> },
    /// `bytes` of the host's data were written to the client: the host may send that many more.
    Ack { id: u32, bytes: u32 },
    /// The client sent its end (or is gone): no more data on this stream from the guest.
    Close { id: u32 },
}

/// Host → guest on the egress port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EgressDown {
    /// The gateway could not be reached: the bridge answers its client 502.
    OpenFailed { id: u32 },
    /// Bytes from the gateway (1..=[`MAX_CHUNK`], within the window).
    Data { id: u32, bytes: Vec<u8> },
    /// `bytes` of the guest's data were written to the gateway.
    Ack { id: u32, bytes: u32 },
    /// The gateway sent its end: no more data on this stream from the host.
    Close { id: u32 },
    /// The gateway's connection failed (a read error such as a reset): what the client got
    /// is incomplete, so the bridge resets its connection instead of ending it cleanly.
    Reset { id: u32 },
}

/// What the host sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostMsg {
    Run(Box<RunRequest>),
    Stdin(Vec<u8>),
    StdinEnd,
}

/// The one command a VM runs, decided by runnerd as for the bwrap form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Absolute, inside the guest's root.
    pub cwd: String,
    /// Where the workspace share is mounted (the bwrap form's path).
    pub workspace: String,
    /// The workspace's read-only parent share, if any, and where it goes.
    pub workspace_parent: Option<String>,
    pub uid: u32,
    pub gid: u32,
    /// Shares present besides `/usr` and the workspace.
    pub science_env: bool,
    pub skills: bool,
    /// The operator's python-packages share, if any, and where it goes (read-only).
    pub python_packages: Option<String>,
    /// Host interpreter paths hidden from the command (the bwrap form's masks).
    pub masks: Vec<String>,
    /// `/tmp`'s size in bytes.
    pub tmp_bytes: u64,
    /// The most processes the user may have (the request's `pids`; 0: unlimited).
    pub pids: u64,
    /// The largest file the command may write (the workspace quota; 0: unlimited).
    pub fsize: u64,
    /// `/etc/passwd` and `/etc/group` as the bwrap form writes them.
    pub passwd: Vec<u8>,
    pub group: Vec<u8>,
    /// With egress: the loopback port the guest's bridge listens on before the command
    /// starts (the proxy variables in `env` name it); the egress port exists then only.
    pub egress_port: Option<u16>,
}

/// What the guest sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestMsg {
    Ready {
        protocol: u16,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(ExitRecord),
    /// The command could not be started (a share would not mount, exec failed).
    Failed(String),
}

/// How the command ended, as the guest reports it; [`ExitRecord::check`] decides whether
/// the host believes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The guest kernel's OOM killer ran during the command.
    pub oom_killed: bool,
}

/// A checked exit record. `oom`: the guest kernel's OOM killer ran during the command (it
/// may have killed a child the command then reported, as a cgroup's counter would say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code { code: u8, oom: bool },
    Signal { signal: u8, oom: bool },
}

impl ExitRecord {
    /// One exit code in 0..=255 or one signal in 1..=64, nothing else. The OOM flag is the
    /// guest kernel's counter: a guest can only mislead its own result with it.
    pub fn check(self) -> Result<Exit, WireError> {
        let oom = self.oom_killed;
        match (self.code, self.signal) {
            (Some(code), None) if (0..=255).contains(&code) => Ok(Exit::Code { code: code as u8, oom }),
            (None, Some(signal)) if (1..=64).contains(&signal) => {
                Ok(Exit::Signal { signal: signal as u8, oom })
            }
            _ => Err(WireError::BadExit(self)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("a frame announced {0} bytes, more than the {MAX_FRAME} allowed")]
    Oversized(usize),
    #[error("a frame's body is not a message of this protocol")]
    Malformed(#[source] postcard::Error),
    #[error("a message could not be encoded")]
    Encode(#[source] postcard::Error),
    #[error("an output chunk of {0} bytes exceeds the {MAX_CHUNK} allowed")]
    ChunkTooLarge(usize),
    #[error("the exit record is neither one exit code nor one signal: {0:?}")]
    BadExit(ExitRecord),
    #[error("the guest speaks protocol {0}, not {PROTOCOL}")]
    Version(u16),
    #[error("the guest sent {0} out of order")]
    OutOfOrder(&'static str),
}

/// One frame: the body's length (`u32` LE) and the postcard body.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    let body = postcard::to_stdvec(msg).map_err(WireError::Encode)?;
    if body.len() > MAX_FRAME {
        return Err(WireError::Oversized(body.len()));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Splits a byte stream into messages. Holds at most one partial frame: a header that
/// announces more than [`MAX_FRAME`] is refused before its body is read.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`: decoded frames are not moved out one by one
    /// (a flood of tiny frames would cost a move of everything behind each), the consumed
    /// prefix goes once per [`Decoder::feed`].
    at: usize,
}

impl Decoder {
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.at);
        self.at = 0;
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete message, `None` until one is complete.
    pub fn next_msg<T: DeserializeOwned>(&mut self) -> Result<Option<T>, WireError> {
        let rest = &self.buf[self.at..];
        let Some(header) = rest.get(..4) else { return Ok(None) };
        let len = u32::from_le_bytes(header.try_into().expect("four bytes")) as usize;
        if len > MAX_FRAME {
            return Err(WireError::Oversized(len));
        }
        if rest.len() < 4 + len {
            return Ok(None);
        }
        let msg = postcard::from_bytes(&rest[4..4 + len]).map_err(WireError::Malformed);
        self.at += 4 + len;
        msg.map(Some)
    }

    /// Bytes held that are not yet a message.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.at
    }
}

/// What the host does with one guest message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Ready,
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(Exit),
    Failed(String),
}

/// The host's view of the guest's side of the conversation: `Ready` first, output, then
/// one final `Exit` or `Failed` and nothing after it. Pure; the backend ends the VM on any
/// error.
#[derive(Debug, Default)]
pub struct HostSide {
    ready: bool,
    done: bool,
}

impl HostSide {
    pub fn accept(&mut self, msg: GuestMsg) -> Result<Event, WireError> {
        if self.done {
            return Err(WireError::OutOfOrder("a message after its exit"));
        }
        match msg {
            GuestMsg::Ready { protocol } if !self.ready => {
                if protocol != PROTOCOL {
                    return Err(WireError::Version(protocol));
                }
                self.ready = true;
                Ok(Event::Ready)
            }
            GuestMsg::Ready { .. } => Err(WireError::OutOfOrder("a second ready")),
            _ if !self.ready => Err(WireError::OutOfOrder("a message before ready")),
            GuestMsg::Stdout(b) | GuestMsg::Stderr(b) if b.len() > MAX_CHUNK => {
                Err(WireError::ChunkTooLarge(b.len()))
            }
            // Output costs the guest at least a byte a frame: a flood of empty frames would
            // cost the host work the output budget never counts.
            GuestMsg::Stdout(b) | GuestMsg::Stderr(b) if b.is_empty() => {
                Err(WireError::OutOfOrder("an empty output chunk"))
            }
            GuestMsg::Stdout(b) => Ok(Event::Stdout(b)),
            GuestMsg::Stderr(b) => Ok(Event::Stderr(b)),
            GuestMsg::Exit(record) => {
                let exit = record.check()?;
                self.done = true;
                Ok(Event::Exit(exit))
            }
            GuestMsg::Failed(mut text) => {
                self.done = true;
                if text.len() > MAX_TEXT {
                    let mut end = MAX_TEXT;
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    text.truncate(end);
                }
                Ok(Event::Failed(text))
            }
        }
    }

    /// Whether the final message came.
    pub fn done(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> RunRequest {
        RunRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: "/workspace".into(),
            workspace: "/workspace".into(),
            workspace_parent: None,
            uid: 1000,
            gid: 1000,
            science_env: false,
            skills: true,
            python_packages: Some("/opt/sciencediscovery-python-packages".into()),
            masks: vec![],
            tmp_bytes: 1 << 20,
            pids: 64,
            fsize: 0,
            passwd: b"sandbox:x:1000:1000::/workspace:/bin/sh\n".to_vec(),
            group: b"sandbox:x:1000:\n".to_vec(),
            egress_port: Some(18118),
        }
    }

    #[test]
    fn messages_round_trip_in_pieces() {
        let msgs =
            vec![HostMsg::Run(Box::new(request())), HostMsg::Stdin(b"input".to_vec()), HostMsg::StdinEnd];
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| encode(m).unwrap()).collect();
        let mut d = Decoder::default();
        let mut got = Vec::new();
        // One byte at a time: partial headers and bodies wait for the rest.
        for b in bytes {
            d.feed(&[b]);
            while let Some(m) = d.next_msg::<HostMsg>().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, msgs);
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn a_flood_of_small_frames_decodes_from_one_buffer_and_empty_output_is_refused() {
        // Many frames in one feed are read in place (no move of what is behind each), and
        // the consumed prefix goes at the next feed.
        let one = encode(&GuestMsg::Stdout(b"x".to_vec())).unwrap();
        let mut d = Decoder::default();
        d.feed(&one.repeat(10_000));
        let mut side = HostSide::default();
        side.accept(GuestMsg::Ready { protocol: PROTOCOL }).unwrap();
        let mut n = 0;
        while let Some(m) = d.next_msg::<GuestMsg>().unwrap() {
            assert_eq!(side.accept(m).unwrap(), Event::Stdout(b"x".to_vec()));
            n += 1;
        }
        assert_eq!((n, d.pending()), (10_000, 0));
        d.feed(&one);
        assert_eq!((d.pending(), d.buf.len()), (one.len(), one.len()), "the consumed prefix stayed");
        for empty in [GuestMsg::Stdout(Vec::new()), GuestMsg::Stderr(Vec::new())] {
            assert!(matches!(side.accept(empty), Err(WireError::OutOfOrder(_))));
        }
    }

    #[test]
    fn an_oversized_header_is_refused_before_its_body() {
        let mut d = Decoder::default();
        d.feed(&((MAX_FRAME as u32) + 1).to_le_bytes());
        assert!(matches!(d.next_msg::<GuestMsg>(), Err(WireError::Oversized(n)) if n == MAX_FRAME + 1));
        let mut d = Decoder::default();
        d.feed(&u32::MAX.to_le_bytes());
        assert!(matches!(d.next_msg::<GuestMsg>(), Err(WireError::Oversized(_))));
        // Exactly the limit is a frame like any other (it waits for its body).
        let mut d = Decoder::default();
        d.feed(&(MAX_FRAME as u32).to_le_bytes());
        assert!(matches!(d.next_msg::<GuestMsg>(), Ok(None)));
    }

    #[test]
    fn garbage_bodies_are_malformed() {
        let mut d = Decoder::default();
        d.feed(&[3, 0, 0, 0, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_msg::<GuestMsg>(), Err(WireError::Malformed(_))));
        // A truncated body inside a complete frame (variant 1 = Stdout, length 10, 2 bytes).
        let mut d = Decoder::default();
        d.feed(&[4, 0, 0, 0, 1, 10, b'a', b'b']);
        assert!(matches!(d.next_msg::<GuestMsg>(), Err(WireError::Malformed(_))));
    }

    #[test]
    fn exit_records_are_checked() {
        let r = |code, signal, oom| ExitRecord { code, signal, oom_killed: oom };
        let table = [
            (r(Some(0), None, false), Some(Exit::Code { code: 0, oom: false })),
            (r(Some(255), None, false), Some(Exit::Code { code: 255, oom: false })),
            (r(Some(256), None, false), None),
            (r(Some(-1), None, false), None),
            (r(None, Some(9), true), Some(Exit::Signal { signal: 9, oom: true })),
            (r(None, Some(15), false), Some(Exit::Signal { signal: 15, oom: false })),
            (r(None, Some(0), false), None),
            (r(None, Some(65), false), None),
            (r(Some(0), Some(9), false), None),
            (r(None, None, false), None),
            // A child OOM-killed, the command exiting 1 because of it.
            (r(Some(1), None, true), Some(Exit::Code { code: 1, oom: true })),
        ];
        for (record, want) in table {
            assert_eq!(record.check().ok(), want, "{record:?}");
        }
    }

    #[test]
    fn the_host_side_enforces_the_order() {
        let exit = GuestMsg::Exit(ExitRecord { code: Some(3), signal: None, oom_killed: false });
        let mut h = HostSide::default();
        assert!(matches!(h.accept(GuestMsg::Stdout(b"x".to_vec())), Err(WireError::OutOfOrder(_))));
        let mut h = HostSide::default();
        assert!(matches!(h.accept(GuestMsg::Ready { protocol: PROTOCOL + 1 }), Err(WireError::Version(_))));
        let mut h = HostSide::default();
        assert_eq!(h.accept(GuestMsg::Ready { protocol: PROTOCOL }).unwrap(), Event::Ready);
        assert!(matches!(h.accept(GuestMsg::Ready { protocol: PROTOCOL }), Err(WireError::OutOfOrder(_))));
        assert_eq!(h.accept(GuestMsg::Stderr(b"e".to_vec())).unwrap(), Event::Stderr(b"e".to_vec()));
        let big = vec![0; MAX_CHUNK + 1];
        assert!(matches!(h.accept(GuestMsg::Stdout(big)), Err(WireError::ChunkTooLarge(_))));
        let bad = GuestMsg::Exit(ExitRecord { code: Some(1), signal: Some(9), oom_killed: false });
        assert!(matches!(h.accept(bad), Err(WireError::BadExit(_))));
        assert!(!h.done());
        assert_eq!(h.accept(exit.clone()).unwrap(), Event::Exit(Exit::Code { code: 3, oom: false }));
        // A flood after the exit is refused, not believed.
        assert!(matches!(h.accept(exit), Err(WireError::OutOfOrder(_))));
        assert!(matches!(h.accept(GuestMsg::Stdout(b"late".to_vec())), Err(WireError::OutOfOrder(_))));
    }

    #[test]
    fn a_long_failure_text_is_cut_on_a_character_boundary() {
        let mut h = HostSide::default();
        h.accept(GuestMsg::Ready { protocol: PROTOCOL }).unwrap();
        let Event::Failed(text) = h.accept(GuestMsg::Failed("é".repeat(MAX_TEXT))).unwrap() else {
            panic!("not a failure")
        };
        assert!(text.len() <= MAX_TEXT && text.chars().all(|c| c == 'é'));
    }

    #[test]
    fn a_request_too_large_for_a_frame_is_not_encoded() {
        let mut r = request();
        r.env = vec![("X".into(), "y".repeat(MAX_FRAME))];
        assert!(matches!(encode(&HostMsg::Run(Box::new(r))), Err(WireError::Oversized(_))));
    }
}
