//! Output for the command lines. A reader that has gone away (`runnerctl health | head -1`)
//! is not an error to report: the process ends quietly with status 0 instead of panicking in
//! `println!` ("failed printing to stdout: Broken pipe", exit 101). Rust ignores SIGPIPE, so
//! the closed pipe arrives here as `EPIPE`.

use std::io::{self, Write};

/// Writes `bytes` to stdout and flushes them: a closed pipe is an `EPIPE` error here.
pub fn print(bytes: &[u8]) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    stdout.write_all(bytes)?;
    stdout.flush()
}

/// Whether `e` says that the reader closed the pipe.
pub fn is_broken_pipe(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::BrokenPipe
}

/// Prints `text` (help, a version, a report) and answers the exit status: `status`, or 0
/// when the reader went away, or 1 when stdout failed otherwise (said on stderr, if it can).
pub fn print_status(text: &str, status: i32) -> i32 {
    match print(text.as_bytes()) {
        Ok(()) => status,
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            let _ = writeln!(io::stderr(), "could not write to stdout: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_closed_pipe_is_quiet() {
        assert!(is_broken_pipe(&io::Error::from(io::ErrorKind::BrokenPipe)));
        assert!(is_broken_pipe(&io::Error::from_raw_os_error(libc::EPIPE)));
        assert!(!is_broken_pipe(&io::Error::from_raw_os_error(libc::ENOSPC)));
    }
}
