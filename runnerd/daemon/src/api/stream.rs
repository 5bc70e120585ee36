//! Bodies that are not held in memory: uploads read frame by frame into a staging file
//! (hashing as they go), and downloads fed from a blocking reader through a bounded channel.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::body::{Body, Bytes, Frame, Incoming};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Chunks in flight between the reader thread and the connection.
const DOWNLOAD_DEPTH: usize = 8;
const CHUNK: usize = 256 * 1024;
/// The longest pause allowed between two frames of an upload.
pub const UPLOAD_IDLE: Duration = Duration::from_secs(60);

/// A streamed answer: `application/octet-stream` (or JSON), with a length when known.
#[derive(Debug)]
pub struct Download {
    pub content_length: Option<u64>,
    pub content_type: &'static str,
    pub rx: mpsc::Receiver<std::io::Result<Bytes>>,
}

impl Download {
    /// A body already in memory (a `/metrics` scrape).
    pub fn from_text(text: String, content_type: &'static str) -> Download {
        let (tx, rx) = mpsc::channel(1);
        let len = text.len() as u64;
        // A fresh channel with room for one: the send cannot fail.
        let _ = tx.try_send(Ok(Bytes::from(text)));
        Download { content_length: Some(len), content_type, rx }
    }

    /// Streams `reader`, one chunk per short blocking task: a client that stops reading
    /// parks only this task, never a thread of the blocking pool. A read error ends the body
    /// with that error, which makes hyper abort the connection: the client sees a truncated
    /// transfer, never a complete-looking wrong one.
    pub fn from_reader<R: Read + Send + 'static>(reader: R, content_length: Option<u64>) -> Download {
        let (tx, rx) = mpsc::channel(DOWNLOAD_DEPTH);
        tokio::spawn(async move {
            let mut reader = Some(reader);
            while let Some(mut r) = reader.take() {
                let read = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; CHUNK];
                    let n = loop {
                        match r.read(&mut buf) {
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            other => break other,
                        }
                    };
                    (
                        r,
                        n.map(|n| {
                            buf.truncate(n);
                            buf
                        }),
                    )
                })
                .await;
                let item = match read {
                    Ok((r, Ok(buf))) if !buf.is_empty() => {
                        reader = Some(r);
                        Ok(Bytes::from(buf))
                    }
                    Ok((_, Ok(_))) => return,
                    Ok((_, Err(e))) => Err(e),
                    Err(e) => Err(std::io::Error::other(e.to_string())),
                };
                if tx.send(item).await.is_err() {
                    return;
                }
            }
        });
        Download { content_length, content_type: "application/octet-stream", rx }
    }

    /// The same stream, answered as JSON (a streamed execution result).
    pub fn json(self) -> Download {
        Download { content_type: "application/json; charset=utf-8", ..self }
    }
}

/// The response body: a whole JSON text, or a download.
#[derive(Debug)]
pub enum ReplyBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<std::io::Result<Bytes>>),
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ReplyBody::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ReplyBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ReplyBody::Full(None))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            ReplyBody::Full(Some(d)) => hyper::body::SizeHint::with_exact(d.len() as u64),
            ReplyBody::Full(None) => hyper::body::SizeHint::with_exact(0),
            ReplyBody::Stream(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// A fully received upload, staged in a private file.
#[derive(Debug)]
pub struct Staged {
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("upload exceeds {0} bytes")]
    TooLarge(u64),
    #[error("Upload stalled: no data for {} s", UPLOAD_IDLE.as_secs())]
    Stalled,
    #[error("Upload could not be read")]
    Read(#[source] hyper::Error),
    #[error("Could not stage the upload in {}", path.display())]
    Stage {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Receives `body` into a new 0600 file in `staging` (created 0700), hashing it; more than
/// `limit` bytes stops the transfer. Memory stays at one frame.
pub async fn receive(mut body: Incoming, staging: &Path, limit: Option<u64>) -> Result<Staged, UploadError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let stage_err = |source| UploadError::Stage { path: staging.to_owned(), source };
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(staging).map_err(stage_err)?;
    let path = staging.join(format!("{}.upload", crate::versioning::new_uuid_v4()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(stage_err)?;
    let mut staged = Staged { path, size: 0, sha256: String::new() };
    // Async file writes (tokio runs each on its blocking pool): a slow disk must not stall a
    // runtime thread frame after frame.
    let mut writer = tokio::io::BufWriter::with_capacity(CHUNK, tokio::fs::File::from_std(file));
    let mut hasher = Sha256::new();
    loop {
        let frame = match tokio::time::timeout(UPLOAD_IDLE, body.frame()).await {
            Err(_) => return Err(UploadError::Stalled),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UploadError::Read(e)),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        staged.size += data.len() as u64;
        if let Some(limit) = limit.filter(|l| staged.size > *l) {
            return Err(UploadError::TooLarge(limit));
        }
        hasher.update(&data);
        writer
            .write_all(&data)
            .await
            .map_err(|source| UploadError::Stage { path: staged.path.clone(), source })?;
    }
    let stage = |source| UploadError::Stage { path: staged.path.clone(), source };
    writer.flush().await.map_err(stage)?;
    writer.into_inner().sync_all().await.map_err(stage)?;
    staged.sha256 = crate::versioning::names::hex(&hasher.finalize());
    Ok(staged)
}

/// Removes uploads a previous process left half-received in the staging directory.
pub fn sweep_staging(staging: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(staging) else { return 0 };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".upload"))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}
