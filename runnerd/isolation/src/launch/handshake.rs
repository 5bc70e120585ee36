//! The answer from sandbox-init: `Executing` then end-of-file (bwrap runs), `Failed`, or
//! end-of-file alone (sandbox-init died before it could say anything).

use std::os::unix::net::UnixStream;

use common::channel::{self, ChannelError};
use common::plan::{InitReport, InitStep};
use tokio::io::AsyncReadExt;

use super::LaunchError;

/// Reads frames one by one: when sandbox-init fails early it exits with our descriptors
/// still unread, the kernel then resets the connection, and only a frame already read in
/// full survives that.
pub async fn wait_for_exec(
    channel: UnixStream,
    hand_over: Result<(), ChannelError>,
    bwrap: &str,
) -> Result<(), LaunchError> {
    let read_err = |e| LaunchError::Channel(ChannelError::Read(e));
    channel.set_nonblocking(true).map_err(read_err)?;
    let mut channel = tokio::net::UnixStream::from_std(channel).map_err(read_err)?;
    let mut executing = false;
    loop {
        let mut header = [0u8; 4];
        match channel.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return match (executing, hand_over) {
                    (true, _) => Ok(()),
                    (false, Err(e)) => Err(LaunchError::Channel(e)),
                    (false, Ok(())) => Err(LaunchError::InitVanished),
                };
            }
            Err(e) if !executing && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(LaunchError::InitVanished);
            }
            Err(e) => return Err(read_err(e)),
        }
        let mut payload = vec![0u8; channel::frame_len(header).map_err(LaunchError::Channel)?];
        channel.read_exact(&mut payload).await.map_err(read_err)?;
        match channel::decode_payload::<InitReport>(&payload).map_err(LaunchError::Channel)? {
            InitReport::Executing => executing = true,
            InitReport::Failed(f) if f.step == InitStep::Exec && f.errno == libc::ENOENT => {
                return Err(LaunchError::BwrapMissing { path: bwrap.to_owned() });
            }
            InitReport::Failed(f) => return Err(LaunchError::Init(f)),
        }
    }
}
