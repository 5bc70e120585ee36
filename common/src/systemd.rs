//! The two systemd protocols the daemons speak, without libsystemd: readiness
//! (`sd_notify`, a datagram to `$NOTIFY_SOCKET`) and socket activation (`$LISTEN_FDS`
//! descriptors from fd 3 on). Both are no-ops outside systemd.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// Where `$NOTIFY_SOCKET` points: a path, or an abstract name (`@name`).
pub fn notify_address(value: &str) -> io::Result<SocketAddr> {
    match value.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None if value.starts_with('/') => SocketAddr::from_pathname(value),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET {value:?} is neither a path nor @abstract"),
        )),
    }
}

/// Sends `state` (e.g. `READY=1\nSTATUS=listening`) to the service manager; `Ok(false)`
/// when not started by one.
pub fn notify(state: &str) -> io::Result<bool> {
    let Some(value) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(false) };
    let addr = notify_address(&value.to_string_lossy())?;
    let socket = UnixDatagram::unbound()?;
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(true)
}

/// How many descriptors systemd passed to *this* process, from the variables' values.
pub fn listen_fds_count(listen_pid: Option<&str>, listen_fds: Option<&str>, pid: u32) -> usize {
    match (
        listen_pid.and_then(|p| p.trim().parse::<u32>().ok()),
        listen_fds.and_then(|n| n.trim().parse().ok()),
    ) {
        (Some(p), Some(n)) if p == pid => n,
        _ => 0,
    }
}

/// Takes the descriptors passed by socket activation (close-on-exec set on each). The
/// variables stay: `LISTEN_PID` names this process, so a child never mistakes them for its
/// own (and sandbox-init and bwrap start with empty environments anyway). Call once.
pub fn take_listen_fds() -> Vec<OwnedFd> {
    let pid = std::process::id();
    let n = listen_fds_count(
        std::env::var("LISTEN_PID").ok().as_deref(),
        std::env::var("LISTEN_FDS").ok().as_deref(),
        pid,
    );
    (0..n as RawFd)
        .filter_map(|i| {
            let fd = LISTEN_FDS_START + i;
            // A number that is not open (EBADF: LISTEN_FDS overstated) is not ours to own.
            // SAFETY: F_SETFD on a descriptor systemd passed us; no memory involved.
            crate::sys::cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }).ok()?;
            // SAFETY: systemd passed ownership of fds 3..3+n to this process (LISTEN_PID
            // matched); each is wrapped exactly once.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_fds_are_ours_only_when_the_pid_matches() {
        assert_eq!(listen_fds_count(Some("42"), Some("1"), 42), 1);
        assert_eq!(listen_fds_count(Some("42"), Some("2"), 43), 0);
        assert_eq!(listen_fds_count(None, Some("1"), 42), 0);
        assert_eq!(listen_fds_count(Some("42"), Some("x"), 42), 0);
    }

    #[test]
    fn notify_reaches_a_datagram_socket_by_path_and_by_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).unwrap();
        let addr = notify_address(path.to_str().unwrap()).unwrap();
        UnixDatagram::unbound().unwrap().send_to_addr(b"READY=1", &addr).unwrap();
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        let name = format!("sd-notify-test-{}", std::process::id());
        let abstract_addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let receiver = UnixDatagram::bind_addr(&abstract_addr).unwrap();
        UnixDatagram::unbound()
            .unwrap()
            .send_to_addr(b"READY=1", &notify_address(&format!("@{name}")).unwrap())
            .unwrap();
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        assert!(notify_address("relative").is_err());
    }
}
