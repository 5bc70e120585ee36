//! A stand-in for journald in tests: a datagram socket bound in a scratch directory that a
//! daemon sees as `/run/systemd/journal/socket` (the fixed path `tracing-journald` sends to),
//! because the daemon is started under `bwrap --dev-bind / / --tmpfs /run/systemd --bind
//! <dir> /run/systemd/journal` (a private mount namespace; no root needed). Every datagram is
//! kept and parsed as the journal native protocol
//! (<https://systemd.io/JOURNAL_NATIVE_PROTOCOL/>), including the large-event form: no data,
//! one sealed memfd passed with SCM_RIGHTS.

use std::fmt::Write as _;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{bwrap, scratch_dir};

/// One journal entry as a daemon sent it: fields in order (a name may repeat).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub fields: Vec<(String, Vec<u8>)>,
    /// Whether it came in a memfd (a payload too large for one datagram).
    pub via_memfd: bool,
    /// For a memfd: whether it was sealed against writes, growth and shrinking, as journald
    /// requires before it maps one.
    pub sealed: bool,
}

impl Record {
    /// The first value of `name`, as text (lossy).
    pub fn get(&self, name: &str) -> Option<String> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// `EVENT`, or empty.
    pub fn event(&self) -> String {
        self.get("EVENT").unwrap_or_default()
    }

    /// `NAME=value` lines, for failure messages (long values shortened).
    pub fn text(&self) -> String {
        let mut out = String::new();
        for (k, v) in &self.fields {
            let v = String::from_utf8_lossy(v);
            let v = if v.len() > 200 {
                format!("{}… ({} bytes)", v.chars().take(200).collect::<String>(), v.len())
            } else {
                v.into_owned()
            };
            let _ = write!(out, "{k}={v} ");
        }
        out
    }
}

/// Whether `name` is a field name journald accepts from a client: `A-Z`, `0-9` and `_`, not
/// starting with a digit or `_` (those are the trusted fields journald adds), at most 64 bytes.
pub fn valid_field_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(|c: char| c.is_ascii_digit() || c == '_')
        && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses one native-protocol payload: `NAME=value\n` lines, or `NAME\n` followed by a
/// little-endian u64 length, that many bytes (newlines allowed) and `\n`; an empty line ends
/// an entry. An empty payload (what `tracing-journald` sends at start to test the socket)
/// holds no entry.
pub fn parse(payload: &[u8]) -> Result<Vec<Record>, String> {
    let mut records = Vec::new();
    let mut current = Record::default();
    let mut rest = payload;
    while !rest.is_empty() {
        let nl = rest.iter().position(|&b| b == b'\n').ok_or("a line without its newline")?;
        let line = &rest[..nl];
        rest = &rest[nl + 1..];
        if line.is_empty() {
            if !current.fields.is_empty() {
                records.push(std::mem::take(&mut current));
            }
            continue;
        }
        let (name, value) = match line.iter().position(|&b| b == b'=') {
            Some(eq) => (&line[..eq], line[eq + 1..].to_vec()),
            None => {
                if rest.len() < 8 {
                    return Err(format!(
                        "{:?}: no length after a binary field name",
                        String::from_utf8_lossy(line)
                    ));
                }
                let len = u64::from_le_bytes(rest[..8].try_into().unwrap_or_default()) as usize;
                rest = &rest[8..];
                if rest.len() < len + 1 || rest[len] != b'\n' {
                    return Err(format!(
                        "{:?}: value shorter than its length {len}",
                        String::from_utf8_lossy(line)
                    ));
                }
                let value = rest[..len].to_vec();
                rest = &rest[len + 1..];
                (line, value)
            }
        };
        let name =
            String::from_utf8(name.to_vec()).map_err(|_| "a field name that is not UTF-8".to_owned())?;
        if !valid_field_name(&name) {
            return Err(format!("{name:?} is not a valid journal field name"));
        }
        current.fields.push((name, value));
    }
    if !current.fields.is_empty() {
        records.push(current);
    }
    Ok(records)
}

/// Everything received, and what could not be parsed.
#[derive(Debug, Default)]
struct Received {
    records: Vec<Record>,
    /// Every payload as received (datagram or memfd content), to search for what must never
    /// be logged.
    payloads: Vec<Vec<u8>>,
    errors: Vec<String>,
}

/// The test journal: its socket and the thread that reads it. Stops on drop.
#[derive(Debug)]
pub struct Journal {
    pub dir: tempfile::TempDir,
    received: Arc<Mutex<Received>>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

impl Journal {
    /// Binds `<scratch>/socket` and starts reading it.
    pub fn start() -> Journal {
        let dir = scratch_dir();
        let socket = UnixDatagram::bind(dir.path().join("socket")).expect("bind the test journal socket");
        socket.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let received: Arc<Mutex<Received>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (received, stop) = (received.clone(), stop.clone());
            std::thread::spawn(move || read_loop(&socket, &received, &stop))
        };
        Journal { dir, received, stop, reader: Some(reader) }
    }

    /// The command prefix that starts a program with this journal as its
    /// `/run/systemd/journal/socket`: the host's whole tree, except a fresh `/run/systemd`
    /// holding only `journal/` = this directory. `--die-with-parent`: killing the wrapper
    /// kills the daemon too.
    pub fn wrapper(&self) -> Vec<String> {
        journal_wrapper(self.dir.path())
    }

    pub fn records(&self) -> Vec<Record> {
        self.lock().records.clone()
    }

    /// Every payload received (datagrams and memfd contents), raw.
    pub fn payloads(&self) -> Vec<Vec<u8>> {
        self.lock().payloads.clone()
    }

    /// Payloads that were not valid native protocol.
    pub fn errors(&self) -> Vec<String> {
        self.lock().errors.clone()
    }

    /// The first record with `EVENT=event` matching `also`, waiting up to `timeout`; panics
    /// with everything received.
    #[track_caller]
    pub fn wait_for(&self, event: &str, also: impl Fn(&Record) -> bool, timeout: Duration) -> Record {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.lock().records.iter().find(|r| r.event() == event && also(r)) {
                return r.clone();
            }
            if Instant::now() > deadline {
                panic!(
                    "no {event} record (of the kind wanted) within {timeout:?}; received:\n{}",
                    self.dump()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every record, one a line, for failure messages.
    pub fn dump(&self) -> String {
        let r = self.lock();
        let mut out: String = r.records.iter().map(|rec| rec.text() + "\n").collect();
        for e in &r.errors {
            let _ = writeln!(out, "UNPARSED: {e}");
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

/// See [`Journal::wrapper`]. Where the host has no `/run/systemd` to mount over (and an
/// unprivileged bwrap could not create one), `/run` itself is replaced by a tmpfs with the
/// host's entries bound back in.
pub fn journal_wrapper(dir: &Path) -> Vec<String> {
    let mut args: Vec<String> =
        vec![bwrap().display().to_string(), "--dev-bind".into(), "/".into(), "/".into()];
    if Path::new("/run/systemd").is_dir() {
        args.extend(["--tmpfs".into(), "/run/systemd".into()]);
    } else {
        args.extend(["--tmpfs".into(), "/run".into()]);
        for entry in std::fs::read_dir("/run").into_iter().flatten().flatten() {
            let path = entry.path().display().to_string();
            args.extend(["--dev-bind-try".into(), path.clone(), path]);
        }
        args.extend(["--dir".into(), "/run/systemd".into()]);
    }
    args.extend([
        "--bind".into(),
        dir.display().to_string(),
        "/run/systemd/journal".into(),
        "--die-with-parent".into(),
        "--".into(),
    ]);
    args
}

/// Up to 8 MiB per datagram: more than any socket buffer lets a client send at once.
const MAX_DATAGRAM: usize = 8 << 20;

fn read_loop(socket: &UnixDatagram, received: &Mutex<Received>, stop: &AtomicBool) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    while !stop.load(Ordering::SeqCst) {
        let (n, fd) = match receive(socket.as_raw_fd(), &mut buf) {
            Ok(got) => got,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                received.lock().unwrap_or_else(|p| p.into_inner()).errors.push(format!("recvmsg: {e}"));
                continue;
            }
        };
        let (payload, via_memfd, sealed) = match fd {
            None => (buf[..n].to_vec(), false, false),
            Some(fd) => match read_memfd(fd) {
                Ok((bytes, sealed)) => (bytes, true, sealed),
                Err(e) => {
                    received.lock().unwrap_or_else(|p| p.into_inner()).errors.push(format!("memfd: {e}"));
                    continue;
                }
            },
        };
        let parsed = parse(&payload);
        let mut r = received.lock().unwrap_or_else(|p| p.into_inner());
        match parsed {
            Ok(records) => {
                r.records.extend(records.into_iter().map(|rec| Record { via_memfd, sealed, ..rec }))
            }
            Err(e) => r.errors.push(format!("{e} in {:?}", String::from_utf8_lossy(&payload))),
        }
        r.payloads.push(payload);
    }
}

/// One datagram into `buf`, and the first descriptor passed with it (others are closed).
fn receive(socket: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    // u64s: aligned for cmsghdr; room for a few descriptors.
    let mut control = [0u64; 16];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; all-zero is its empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at iov (over buf) and control, both alive and sized as declared.
    let n = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: msg was filled in by recvmsg; CMSG_FIRSTHDR/CMSG_NXTHDR stay within
    // msg_control/msg_controllen.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-null header from CMSG_FIRSTHDR/CMSG_NXTHDR is inside `control`.
        let header = unsafe { &*cmsg };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) is arithmetic on a constant.
            let data_len = header.cmsg_len as usize - unsafe { libc::CMSG_LEN(0) } as usize;
            // SAFETY: an SCM_RIGHTS header is followed by data_len bytes of descriptors.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..data_len / std::mem::size_of::<RawFd>() {
                // SAFETY: i is within the descriptors of this header; they may be unaligned.
                let fd = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel installed this descriptor for us; we own it now.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::other(format!("a datagram longer than {} bytes was truncated", buf.len())));
    }
    Ok((n as usize, fds.into_iter().next()))
}

/// A memfd's whole content (read at offset 0: the sender's write left the shared offset at
/// the end) and whether it is fully sealed.
fn read_memfd(fd: OwnedFd) -> io::Result<(Vec<u8>, bool)> {
    // SAFETY: F_GET_SEALS takes no argument and only reads the descriptor's seals.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let wanted = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    let sealed = seals >= 0 && seals & wanted == wanted;
    let file = std::fs::File::from(fd);
    let len = file.metadata()?.len() as usize;
    let mut bytes = vec![0u8; len];
    file.read_exact_at(&mut bytes, 0)?;
    Ok((bytes, sealed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_field_forms_and_entry_separators_parse() {
        let mut p = b"EVENT=listening\nADDRESS=127.0.0.1:1\n".to_vec();
        p.extend_from_slice(b"MESSAGE\n");
        p.extend_from_slice(&5u64.to_le_bytes());
        p.extend_from_slice(b"a\nb=c\n\nSECOND=1\n");
        let records = parse(&p).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].get("EVENT").as_deref(), Some("listening"));
        assert_eq!(records[0].get("MESSAGE").as_deref(), Some("a\nb=c"));
        assert_eq!(records[1].get("SECOND").as_deref(), Some("1"));
        assert!(parse(b"").unwrap().is_empty());
    }

    #[test]
    fn malformed_payloads_and_bad_names_are_errors() {
        assert!(parse(b"EVENT=x").is_err(), "no final newline");
        assert!(parse(b"MESSAGE\n\x05\0\0\0\0\0\0\0ab\n").is_err(), "short value");
        assert!(parse(b"F_event=x\n").is_err(), "lower case");
        assert!(parse(b"_PID=1\n").is_err(), "trusted field");
        assert!(valid_field_name("EXECUTION_ID") && !valid_field_name("1X") && !valid_field_name(""));
    }
}
