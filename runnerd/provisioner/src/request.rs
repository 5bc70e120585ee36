//! Reading the one JSON [`Request`] runnerd writes on stdin, bounded by
//! [`MAX_REQUEST_BYTES`] so that a runaway writer cannot grow the provisioner's memory.

use std::io::Read;

use common::provision::{MAX_REQUEST_BYTES, Request};

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the request could not be read from stdin")]
    Read(#[source] std::io::Error),
    #[error("the request is larger than {MAX_REQUEST_BYTES} bytes")]
    TooLarge,
    #[error("the request is not a valid provisioning request")]
    Parse(#[source] serde_json::Error),
}

/// Reads at most [`MAX_REQUEST_BYTES`] (one more to tell "too large" apart) and parses them.
pub fn read(input: impl Read) -> Result<Request, RequestError> {
    let mut bytes = Vec::new();
    input.take(MAX_REQUEST_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(RequestError::Read)?;
    parse(&bytes)
}

/// The pure half of [`read`].
pub fn parse(bytes: &[u8]) -> Result<Request, RequestError> {
    if bytes.len() > MAX_REQUEST_BYTES {
        return Err(RequestError::TooLarge);
    }
    serde_json::from_slice(bytes).map_err(RequestError::Parse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::provision::Op;

    #[test]
    fn table() {
        let ok = br#"{"op":{"kind":"list"},"prefix":"/p","channels":[],"cacheDir":"/c","offline":true,"stage":{"kind":"fetch"}}"#;
        let request = parse(ok).expect("valid");
        assert_eq!(request.op, Op::List);
        assert!(request.offline);
        assert!(matches!(parse(b"{}"), Err(RequestError::Parse(_))));
        assert!(matches!(parse(b""), Err(RequestError::Parse(_))));
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert!(matches!(parse(&big), Err(RequestError::TooLarge)));
        assert!(matches!(read(&big[..]), Err(RequestError::TooLarge)));
    }
}
