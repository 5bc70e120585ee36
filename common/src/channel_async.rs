//! [`crate::channel`]'s framing over tokio streams, for the daemons' control sockets
//! (sandbox-init stays synchronous and does not build this).

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::channel::{ChannelError, decode_payload, encode_frame, frame_len};
use crate::plan::PROTOCOL_VERSION;

/// Writes one message with the current protocol version.
pub async fn write_message<T: Serialize>(
    w: &mut (impl AsyncWrite + Unpin),
    msg: &T,
) -> Result<(), ChannelError> {
    let frame = encode_frame(PROTOCOL_VERSION, msg)?;
    w.write_all(&frame).await.map_err(ChannelError::Write)?;
    w.flush().await.map_err(ChannelError::Write)
}

/// Reads one message. End-of-file before the first byte is [`ChannelError::Closed`].
pub async fn read_message<T: DeserializeOwned>(r: &mut (impl AsyncRead + Unpin)) -> Result<T, ChannelError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]).await {
            Ok(0) if got == 0 => return Err(ChannelError::Closed),
            Ok(0) => return Err(ChannelError::Read(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) => return Err(ChannelError::Read(e)),
        }
    }
    let mut payload = vec![0u8; frame_len(header)?];
    r.read_exact(&mut payload).await.map_err(ChannelError::Read)?;
    decode_payload(&payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_frame_written_async_reads_back_sync_and_async() {
        let mut buf = Vec::new();
        write_message(&mut buf, &("hello".to_owned(), 7u32)).await.unwrap();
        let sync: (String, u32) = crate::channel::read_message(&mut buf.as_slice()).unwrap();
        assert_eq!(sync, ("hello".to_owned(), 7));
        let back: (String, u32) = read_message(&mut buf.as_slice()).await.unwrap();
        assert_eq!(back, ("hello".to_owned(), 7));
        let empty: &[u8] = &[];
        assert!(matches!(read_message::<u32>(&mut &*empty).await, Err(ChannelError::Closed)));
    }
}
