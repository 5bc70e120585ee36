//! The bucket (issue #34): an S3-compatible store reached with `object_store`'s
//! `AmazonS3Builder` (path-style requests, the configured region and credentials), with
//! short timeouts and few retries, so an unreachable store is a clear error in seconds and
//! the replicator's own backoff decides when to try again.
//!
//! Objects go up streamed from the local version store (one request for a small object,
//! multipart in [`PART_BYTES`] parts for a big one: memory stays bounded) and come down
//! streamed into [`Store::put_verified`], which publishes nothing whose size or digest is
//! wrong.

use std::collections::HashSet;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};

use super::layout::{self, HeadDoc};
use super::settings::ReplicaSettings;
use crate::transfer::Ident;
use crate::versioning::{Ref, VersionError};
use crate::writer::Versions;

/// Objects up to this size go in one request; bigger ones in parts of this size (S3 wants
/// parts of at least 5 MiB but the last). Also the most one transfer holds in memory.
pub const PART_BYTES: usize = 8 << 20;
/// Chunks of a download in flight between the network and the verifying writer.
const DOWNLOAD_CHUNKS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot set up the object store client for {endpoint}")]
    Build {
        endpoint: String,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("the object store at {endpoint} failed to {what} {key}")]
    Store {
        endpoint: String,
        what: &'static str,
        key: String,
        #[source]
        source: Box<object_store::Error>,
    },
    #[error("the object store has no {key}: the bucket lacks an object the workspace's head reaches")]
    Missing { key: String },
    #[error("the head document {key} cannot be used")]
    Head {
        key: String,
        #[source]
        source: Box<layout::LayoutError>,
    },
    #[error("the local version store could not {what} {digest}")]
    Local {
        what: &'static str,
        digest: String,
        #[source]
        source: Box<VersionError>,
    },
    #[error("reading the local object {digest} failed")]
    Read {
        digest: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a blocking task of the transfer failed")]
    Task(#[source] crate::blocking::Panicked),
    #[error("the verifying writer of a download stopped")]
    Writer(#[source] tokio::task::JoinError),
}

/// What [`Bucket::fetch_closure`] brought.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Objects downloaded and stored.
    pub objects: u64,
    pub bytes: u64,
    /// Objects of the closure that were here already.
    pub present: u64,
}

/// The configured bucket.
#[derive(Debug, Clone)]
pub struct Bucket {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    endpoint: String,
}

/// rustls's process-wide provider: ring, as the provisioner uses (reqwest is built without
/// a provider of its own). Installing it twice is harmless.
fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Bucket {
    /// A client of the bucket `settings` name; `credentials` as [`super::settings::secret`]
    /// read them (`None`: unsigned requests). Makes no request.
    pub fn connect(
        settings: &ReplicaSettings,
        credentials: Option<(String, String)>,
    ) -> Result<Bucket, ClientError> {
        install_tls_provider();
        let options = ClientOptions::new()
            .with_allow_http(settings.endpoint.starts_with("http://"))
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(60));
        let retry = RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(1),
                base: 2.0,
            },
            max_retries: 2,
            retry_timeout: Duration::from_secs(10),
        };
        let mut builder = AmazonS3Builder::new()
            .with_endpoint(&settings.endpoint)
            .with_bucket_name(&settings.bucket)
            .with_region(&settings.region)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(settings.endpoint.starts_with("http://"))
            .with_client_options(options)
            .with_retry(retry);
        builder = match credentials {
            Some((id, secret)) => builder.with_access_key_id(id).with_secret_access_key(secret),
            None => builder.with_skip_signature(true),
        };
        let store = builder.build().map_err(|source| ClientError::Build {
            endpoint: settings.endpoint.clone(),
            source: Box::new(source),
        })?;
        Ok(Bucket {
            store: Arc::new(store),
            prefix: settings.prefix.clone(),
            endpoint: settings.endpoint.clone(),
        })
    }

    /// The underlying store (tests list the bucket through it).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn failed(&self, what: &'static str, key: &str) -> impl FnOnce(object_store::Error) -> ClientError {
        let (endpoint, key) = (self.endpoint.clone(), key.to_owned());
        move |source| ClientError::Store { endpoint, what, key, source: Box::new(source) }
    }

    /// Whether the bucket holds the object `r`.
    pub async fn has_object(&self, r: &Ref) -> Result<bool, ClientError> {
        let key = layout::object_key(&self.prefix, r);
        match self.store.head(&Key::from(key.as_str())).await {
            Ok(meta) => Ok(meta.size == r.size),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.failed("look up", &key)(e)),
        }
    }

    /// The record `digest` (`sha256:<hex>`) as the bucket holds it: its ref, sized from the
    /// object's metadata (a named version to restore), or none when the bucket lacks it.
    pub async fn record_ref(&self, digest: &str) -> Result<Option<Ref>, ClientError> {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let probe =
            Ref::new(crate::versioning::Pool::AgentState, hex, 0, crate::versioning::RECORD_MEDIA_TYPE);
        let key = layout::object_key(&self.prefix, &probe);
        match self.store.head(&Key::from(key.as_str())).await {
            Ok(meta) => Ok(Some(Ref { size: meta.size, ..probe })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.failed("look up", &key)(e)),
        }
    }

    /// Sends the object `r` from the local store; answers the bytes sent.
    pub async fn put_object(&self, versions: &Arc<Versions>, r: &Ref) -> Result<u64, ClientError> {
        let key = layout::object_key(&self.prefix, r);
        let location = Key::from(key.as_str());
        let local = |what: &'static str| {
            let digest = r.digest.clone();
            move |source| ClientError::Local { what, digest, source: Box::new(source) }
        };
        if r.size <= PART_BYTES as u64 {
            let (v, r2) = (versions.clone(), r.clone());
            let bytes = crate::blocking::run(move || v.store().read(&r2))
                .await
                .map_err(ClientError::Task)?
                .map_err(local("read"))?;
            self.store.put(&location, PutPayload::from(bytes)).await.map_err(self.failed("store", &key))?;
            return Ok(r.size);
        }
        let (v, r2) = (versions.clone(), r.clone());
        let mut reader = crate::blocking::run(move || v.store().open_reader(&r2))
            .await
            .map_err(ClientError::Task)?
            .map_err(local("open"))?;
        let mut upload = self
            .store
            .put_multipart(&location)
            .await
            .map_err(self.failed("start a multipart upload of", &key))?;
        let sent = async {
            loop {
                let (back, chunk) = crate::blocking::run(move || {
                    let mut chunk = Vec::with_capacity(PART_BYTES);
                    let read = (&mut reader).take(PART_BYTES as u64).read_to_end(&mut chunk);
                    (reader, read.map(|_| chunk))
                })
                .await
                .map_err(ClientError::Task)?;
                reader = back;
                let chunk = chunk.map_err(|source| ClientError::Read { digest: r.digest.clone(), source })?;
                if chunk.is_empty() {
                    break;
                }
                upload
                    .put_part(PutPayload::from(chunk))
                    .await
                    .map_err(self.failed("send a part of", &key))?;
            }
            upload.complete().await.map_err(self.failed("complete the upload of", &key))
        }
        .await;
        match sent {
            Ok(_) => Ok(r.size),
            Err(e) => {
                let _ = upload.abort().await;
                Err(e)
            }
        }
    }

    /// The workspace's head document, if the bucket has one.
    pub async fn read_head(&self, ident: &Ident) -> Result<Option<HeadDoc>, ClientError> {
        let key = layout::head_key(&self.prefix, ident);
        let got = match self.store.get(&Key::from(key.as_str())).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.failed("read", &key)(e)),
        };
        let bytes = got.bytes().await.map_err(self.failed("read", &key))?;
        HeadDoc::parse(&bytes, ident)
            .map(Some)
            .map_err(|source| ClientError::Head { key, source: Box::new(source) })
    }

    /// Writes the workspace's head document (over any before it: the caller checked epochs).
    pub async fn write_head(&self, doc: &HeadDoc) -> Result<(), ClientError> {
        let key = layout::head_key(&self.prefix, &doc.ident);
        let payload = PutPayload::from(doc.to_bytes());
        self.store.put(&Key::from(key.as_str()), payload).await.map_err(self.failed("write", &key))?;
        Ok(())
    }

    /// Downloads every object of `head`'s closure the local store lacks, each verified as it
    /// is stored; a record is stored before it is read for what it names. Iterative; an
    /// object the bucket lacks is an error naming it (what arrived before stays: each object
    /// is whole and verified, and nothing points at it until a head does).
    pub async fn fetch_closure(&self, versions: &Arc<Versions>, head: &Ref) -> Result<Fetched, ClientError> {
        let mut fetched = Fetched::default();
        let mut seen: HashSet<Ref> = HashSet::new();
        let mut stack = vec![head.clone()];
        while let Some(r) = stack.pop() {
            if !seen.insert(r.clone()) {
                continue;
            }
            if versions.store().has(&r) {
                fetched.present += 1;
            } else {
                self.fetch_object(versions, &r).await?;
                fetched.objects += 1;
                fetched.bytes += r.size;
            }
            if r.is_record() {
                let (v, r2) = (versions.clone(), r.clone());
                let record = crate::blocking::run(move || v.store().read_record(&r2, None))
                    .await
                    .map_err(ClientError::Task)?
                    .map_err(|source| ClientError::Local {
                        what: "read the record",
                        digest: r.digest.clone(),
                        source: Box::new(source),
                    })?;
                stack.extend(record.dependencies.into_iter().filter(|d| !seen.contains(d)));
            }
        }
        Ok(fetched)
    }

    /// One object, streamed from the bucket into [`Store::put_verified`].
    ///
    /// [`Store::put_verified`]: crate::versioning::Store::put_verified
    async fn fetch_object(&self, versions: &Arc<Versions>, r: &Ref) -> Result<(), ClientError> {
        let key = layout::object_key(&self.prefix, r);
        let got = match self.store.get(&Key::from(key.as_str())).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Err(ClientError::Missing { key }),
            Err(e) => return Err(self.failed("read", &key)(e)),
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(DOWNLOAD_CHUNKS);
        let (v, r2) = (versions.clone(), r.clone());
        // Its own thread: the verifying writer blocks on chunks this task sends.
        let writer = tokio::task::spawn_blocking(move || {
            let mut reader = ChannelReader { rx, current: Bytes::new() };
            v.store().put_verified(&r2, &mut reader)
        });
        let mut stream = got.into_stream();
        let mut network: Option<object_store::Error> = None;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(chunk) => Ok(chunk),
                Err(e) => {
                    let text = e.to_string();
                    network = Some(e);
                    Err(std::io::Error::other(text))
                }
            };
            let last = chunk.is_err();
            if tx.send(chunk).await.is_err() || last {
                break;
            }
        }
        drop(tx);
        let stored = writer.await.map_err(ClientError::Writer)?;
        if let Some(e) = network {
            return Err(self.failed("read", &key)(e));
        }
        stored.map_err(|source| ClientError::Local {
            what: "store",
            digest: r.digest.clone(),
            source: Box::new(source),
        })?;
        Ok(())
    }
}

/// A blocking reader of the chunks a download sends.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    current: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                Some(chunk) => self.current = chunk?,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}
