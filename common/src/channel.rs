//! The framing of every internal channel: a 4-byte little-endian length, then the postcard
//! encoding of the protocol version, then the postcard encoding of the message. The version
//! is decoded on its own first, so a peer with a different layout is told so clearly instead
//! of failing to decode.
//!
//! File descriptors travel as `SCM_RIGHTS` (with `passfd`), one per message, after the frame
//! that announces them, and are received close-on-exec.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use passfd::FdPassingExt;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::plan::PROTOCOL_VERSION;

/// Upper bound of one frame's payload. A launch plan is a few kilobytes.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("the peer closed the channel")]
    Closed,
    #[error("reading from the channel failed")]
    Read(#[source] io::Error),
    #[error("writing to the channel failed")]
    Write(#[source] io::Error),
    #[error("a frame of {len} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge { len: usize },
    #[error(
        "the peer speaks internal protocol version {theirs}, this binary speaks version {ours}; \
         install runnerd and sandbox-init from the same release"
    )]
    VersionMismatch { ours: u32, theirs: u32 },
    #[error("a frame could not be decoded")]
    Decode(#[source] postcard::Error),
    #[error("a frame carries {0} bytes after its message")]
    TrailingBytes(usize),
    #[error("a message could not be encoded")]
    Encode(#[source] postcard::Error),
    #[error("passing a file descriptor failed")]
    SendFd(#[source] io::Error),
    #[error("receiving file descriptor {index} of {count} failed")]
    RecvFd {
        index: usize,
        count: usize,
        #[source]
        source: io::Error,
    },
}

/// Encodes `msg` as a complete frame (length prefix included) carrying `version`.
/// Callers use [`PROTOCOL_VERSION`]; tests use other values to provoke a mismatch.
pub fn encode_frame<T: Serialize>(version: u32, msg: &T) -> Result<Vec<u8>, ChannelError> {
    let mut payload = postcard::to_stdvec(&version).map_err(ChannelError::Encode)?;
    payload.extend(postcard::to_stdvec(msg).map_err(ChannelError::Encode)?);
    if payload.len() > MAX_FRAME {
        return Err(ChannelError::TooLarge { len: payload.len() });
    }
    let len = u32::try_from(payload.len()).map_err(|_| ChannelError::TooLarge { len: payload.len() })?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend(payload);
    Ok(frame)
}

/// The payload length announced by a frame header.
pub fn frame_len(header: [u8; 4]) -> Result<usize, ChannelError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(ChannelError::TooLarge { len });
    }
    Ok(len)
}

/// Decodes a payload (the bytes after the length prefix).
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ChannelError> {
    let (theirs, rest): (u32, _) = postcard::take_from_bytes(payload).map_err(ChannelError::Decode)?;
    if theirs != PROTOCOL_VERSION {
        return Err(ChannelError::VersionMismatch { ours: PROTOCOL_VERSION, theirs });
    }
    let (msg, rest) = postcard::take_from_bytes(rest).map_err(ChannelError::Decode)?;
    if !rest.is_empty() {
        return Err(ChannelError::TrailingBytes(rest.len()));
    }
    Ok(msg)
}

/// Writes one message with the current protocol version.
pub fn write_message<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), ChannelError> {
    let frame = encode_frame(PROTOCOL_VERSION, msg)?;
    w.write_all(&frame).map_err(ChannelError::Write)
}

/// Reads one message. End-of-file before the first byte is [`ChannelError::Closed`].
pub fn read_message<T: DeserializeOwned>(r: &mut impl Read) -> Result<T, ChannelError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(ChannelError::Closed),
            Ok(0) => return Err(ChannelError::Read(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ChannelError::Read(e)),
        }
    }
    let mut payload = vec![0u8; frame_len(header)?];
    r.read_exact(&mut payload).map_err(ChannelError::Read)?;
    decode_payload(&payload)
}

/// Sends each descriptor as its own `SCM_RIGHTS` message on the Unix socket `sock`.
pub fn send_fds(sock: BorrowedFd<'_>, fds: &[BorrowedFd<'_>]) -> Result<(), ChannelError> {
    for fd in fds {
        sock.as_raw_fd().send_fd(fd.as_raw_fd()).map_err(ChannelError::SendFd)?;
    }
    Ok(())
}

/// Receives `count` descriptors sent by [`send_fds`]; each arrives close-on-exec.
pub fn recv_fds(sock: BorrowedFd<'_>, count: usize) -> Result<Vec<OwnedFd>, ChannelError> {
    (0..count)
        .map(|index| {
            let raw =
                sock.as_raw_fd().recv_fd().map_err(|source| ChannelError::RecvFd { index, count, source })?;
            // SAFETY: recv_fd returns a descriptor the kernel just installed for us (passfd
            // has already set FD_CLOEXEC on it); nothing else owns it.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{LaunchPlan, Resource, Rlimit};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    fn plan() -> LaunchPlan {
        LaunchPlan {
            program: "/usr/bin/bwrap".into(),
            args: vec!["--die-with-parent".into(), "/usr/bin/true".into()],
            fds: vec![0, 1, 2, 3],
            rlimits: vec![Rlimit::fixed(Resource::Core, 0)],
            join_cgroups: 0,
            user: None,
            idmaps: Vec::new(),
        }
    }

    #[test]
    fn round_trip() {
        let mut buf = Vec::new();
        write_message(&mut buf, &plan()).unwrap();
        let back: LaunchPlan = read_message(&mut buf.as_slice()).unwrap();
        assert_eq!(back, plan());
    }

    #[test]
    fn version_mismatch_is_named() {
        let frame = encode_frame(PROTOCOL_VERSION + 7, &plan()).unwrap();
        let err = read_message::<LaunchPlan>(&mut frame.as_slice()).unwrap_err();
        assert!(
            matches!(err, ChannelError::VersionMismatch { theirs, .. } if theirs == PROTOCOL_VERSION + 7)
        );
        assert!(err.to_string().contains("same release"));
    }

    #[test]
    fn hostile_frames() {
        // Empty stream: closed. Truncated header, oversized length, garbage, trailing bytes.
        assert!(matches!(read_message::<LaunchPlan>(&mut &b""[..]), Err(ChannelError::Closed)));
        assert!(matches!(read_message::<LaunchPlan>(&mut &b"\x01\x00"[..]), Err(ChannelError::Read(_))));
        let huge = (MAX_FRAME as u32 + 1).to_le_bytes();
        assert!(matches!(read_message::<LaunchPlan>(&mut &huge[..]), Err(ChannelError::TooLarge { .. })));
        let garbage = [4, 0, 0, 0, PROTOCOL_VERSION as u8, 0xff, 0xff, 0xff];
        assert!(matches!(read_message::<LaunchPlan>(&mut &garbage[..]), Err(ChannelError::Decode(_))));
        let mut frame = encode_frame(PROTOCOL_VERSION, &7u32).unwrap();
        frame.push(9);
        frame[0] += 1;
        assert!(matches!(read_message::<u32>(&mut frame.as_slice()), Err(ChannelError::TrailingBytes(1))));
        let short = [10, 0, 0, 0, 1];
        assert!(matches!(read_message::<LaunchPlan>(&mut &short[..]), Err(ChannelError::Read(_))));
    }

    #[test]
    fn descriptors_arrive_close_on_exec_and_usable() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut &file, b"hello").unwrap();
        let (r, w) = UnixStream::pair().unwrap();
        write_message(&mut &a, &plan()).unwrap();
        send_fds(a.as_fd(), &[file.as_fd(), w.as_fd()]).unwrap();

        let got: LaunchPlan = read_message(&mut &b).unwrap();
        assert_eq!(got, plan());
        let fds = recv_fds(b.as_fd(), 2).unwrap();
        for fd in &fds {
            // SAFETY: fcntl(F_GETFD) only reads the flags of a descriptor we own.
            let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        }
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        std::io::Seek::rewind(&mut received).unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut received, &mut text).unwrap();
        assert_eq!(text, "hello");
        drop(r);
    }
}
