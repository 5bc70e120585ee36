//! Live logs of managed executions (contract §3 "Logs"): each stream is decoded by a
//! streaming UTF-8 decoder (a character split across reads is joined; invalid sequences
//! become U+FFFD, W3C maximal-subpart style; an incomplete tail is never flushed), cut to
//! the retention budget in bytes across both streams, and split into rows of at most
//! 4096 code points. Pure: the rows are stored by [`super::db`].

use crate::launch::Stream;

/// Code points per stored row.
pub const ROW_CHARS: usize = 4096;
/// Rows per page of `GET …/logs`.
pub const PAGE_ROWS: usize = 4;

/// One stored log row (its cursor is assigned when stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRow {
    pub stream: Stream,
    pub text: String,
}

pub fn stream_name(stream: Stream) -> &'static str {
    match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

/// The streaming UTF-8 decoder the result budget uses too.
pub use crate::launch::Utf8Stream;

/// Retention across both streams, in bytes (`0` = unlimited).
#[derive(Debug)]
pub struct Retention {
    remaining: Option<u64>,
    truncated: bool,
    decoders: [Utf8Stream; 2],
}

impl Retention {
    pub fn new(budget: u64) -> Retention {
        Retention {
            remaining: (budget > 0).then_some(budget),
            truncated: false,
            decoders: Default::default(),
        }
    }

    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Takes what fits the budget, decodes it and splits it into rows. The returned flag
    /// is `true` the first time bytes are dropped.
    pub fn push(&mut self, stream: Stream, bytes: &[u8]) -> (Vec<LogRow>, bool) {
        let mut newly_truncated = false;
        let kept = match self.remaining.as_mut() {
            None => bytes,
            Some(remaining) => {
                let take = (*remaining).min(bytes.len() as u64) as usize;
                *remaining -= take as u64;
                if take < bytes.len() && !self.truncated {
                    self.truncated = true;
                    newly_truncated = true;
                }
                &bytes[..take]
            }
        };
        if kept.is_empty() {
            return (Vec::new(), newly_truncated);
        }
        let i = match stream {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        };
        let text = self.decoders[i].decode(kept);
        (split_rows(stream, &text), newly_truncated)
    }
}

/// Splits text into rows of at most [`ROW_CHARS`] code points.
pub fn split_rows(stream: Stream, text: &str) -> Vec<LogRow> {
    let mut rows = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == ROW_CHARS {
            rows.push(LogRow { stream, text: text[start..i].to_owned() });
            start = i;
            count = 0;
        }
        count += 1;
    }
    if start < text.len() {
        rows.push(LogRow { stream, text: text[start..].to_owned() });
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_multibyte_characters_are_joined() {
        let bytes = "训练中\n".as_bytes();
        for cut in 0..=bytes.len() {
            let mut d = Utf8Stream::default();
            let text = d.decode(&bytes[..cut]) + &d.decode(&bytes[cut..]);
            assert_eq!(text, "训练中\n", "cut at {cut}");
        }
        // Byte by byte.
        let mut d = Utf8Stream::default();
        let text: String = bytes.iter().map(|b| d.decode(std::slice::from_ref(b))).collect();
        assert_eq!(text, "训练中\n");
    }

    #[test]
    fn invalid_sequences_become_replacement_characters_and_a_tail_waits() {
        let mut d = Utf8Stream::default();
        for (input, want) in [
            (&b"a\xffb"[..], "a\u{FFFD}b"),
            (b"\xe8\xae", ""),   // incomplete: kept
            (b"x", "\u{FFFD}x"), // completed by an invalid byte: one replacement
            (b"\xf0\x9f\x98\x80", "😀"),
            (b"\xc0\xaf", "\u{FFFD}\u{FFFD}"), // overlong: each byte replaced
            (b"\xe8", ""),                     // never flushed at the end
        ] {
            assert_eq!(d.decode(input), want, "{input:?}");
        }
    }

    #[test]
    fn rows_hold_at_most_4096_code_points() {
        let text = "é".repeat(ROW_CHARS * 2 + 5);
        let rows = split_rows(Stream::Stdout, &text);
        let lens: Vec<usize> = rows.iter().map(|r| r.text.chars().count()).collect();
        assert_eq!(lens, vec![ROW_CHARS, ROW_CHARS, 5]);
        assert!(split_rows(Stream::Stdout, "").is_empty());
    }

    #[test]
    fn retention_keeps_exactly_the_budget_across_streams() {
        let mut r = Retention::new(25_000);
        let mut kept = 0;
        let mut flagged = 0;
        for i in 0..30 {
            let stream = if i % 2 == 0 { Stream::Stdout } else { Stream::Stderr };
            let (rows, first) = r.push(stream, &[b'x'; 1000]);
            kept += rows.iter().map(|row| row.text.len()).sum::<usize>();
            flagged += usize::from(first);
        }
        assert_eq!((kept, flagged, r.truncated()), (25_000, 1, true));
        let mut unlimited = Retention::new(0);
        assert_eq!(unlimited.push(Stream::Stdout, &[b'y'; 5000]).0.len(), 2);
        assert!(!unlimited.truncated());
    }
}
