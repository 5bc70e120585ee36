//! The one download client, built lazily: only when a remote channel or package is actually
//! fetched. Building a reqwest client loads the platform's CA certificates (and the installer
//! panics when there are none, even for `file://` packages), so an offline run, or one that
//! only uses `file://` channels and the cache, never builds one and never opens a socket.
//!
//! When built, it uses rustls (ring) with the system store (`SSL_CERT_FILE` honoured by the
//! platform verifier) and reqwest's own reading of `HTTPS_PROXY`/`HTTP_PROXY`/`NO_PROXY`:
//! inside runnerd's sandbox those point at the egress bridge on loopback.

use rattler_networking::LazyClient;
use reqwest_middleware::ClientWithMiddleware;

/// Whether the client may be built at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    Online,
    /// `offline: true`: every fetch must be served from `file://` or the cache.
    Offline,
}

const USER_AGENT: &str = concat!("runner-provisioner/", env!("CARGO_PKG_VERSION"));

/// A client that is built on first use. Offline, first use is a bug in this binary (every
/// remote fetch is answered from the cache before rattler is asked), so it panics loudly
/// rather than open a socket that the sandbox's seccomp filter would refuse anyway.
pub fn lazy_client(network: Network) -> LazyClient {
    LazyClient::new(move || {
        assert!(
            network == Network::Online,
            "runner-provisioner: a network client was requested in an offline run"
        );
        // reqwest's `rustls-no-provider`: ring is the crypto, installed once per process
        // (aws-lc-rs, rattler's default, is a cmake build of its own on 2-core CI). An
        // error only says it is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .build()
            .unwrap_or_else(|err| panic!("runner-provisioner: the HTTP client could not be built: {err}"));
        ClientWithMiddleware::from(client)
    })
}
