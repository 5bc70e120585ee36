//! One output budget shared by stdout and stderr (internals §2.6, contract "Output
//! truncation"): first come, first served; a stream that overflows keeps its head and its
//! tail around a marker, and the two rendered streams never exceed the budget together.
//! Memory stays bounded by the budget however much the sandbox writes.

use std::collections::VecDeque;

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Receives the sandbox's output as it arrives.
pub trait OutputSink: Send {
    fn write(&mut self, stream: Stream, bytes: &[u8]);
}

/// The marker the original runner inserts where output was cut.
pub fn marker(budget: u64) -> String {
    format!(
        "\n...[output truncated: exceeded {budget} bytes; set SCIENCE_AGENT_MAX_OUTPUT_BYTES=0 to disable]...\n"
    )
}

#[derive(Debug, Default)]
struct StreamBuf {
    /// Everything so far while not truncated; the kept head once truncated.
    head: Vec<u8>,
    /// The most recent bytes, once truncated.
    tail: VecDeque<u8>,
    /// Set at the first overflow: the rendered size of this stream from then on.
    cap: Option<usize>,
    tail_cap: usize,
}

impl StreamBuf {
    fn rendered_len(&self) -> usize {
        self.cap.unwrap_or(self.head.len())
    }
}

/// Collects both streams under one budget (`None` or 0: unlimited).
#[derive(Debug)]
pub struct OutputBudget {
    budget: Option<u64>,
    marker: String,
    streams: [StreamBuf; 2],
}

/// The rendered result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectedOutput {
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

impl OutputBudget {
    pub fn new(budget: u64) -> Self {
        let budget = (budget > 0).then_some(budget);
        OutputBudget { budget, marker: budget.map(marker).unwrap_or_default(), streams: Default::default() }
    }

    fn index(stream: Stream) -> usize {
        match stream {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        }
    }

    pub fn push(&mut self, stream: Stream, bytes: &[u8]) {
        let i = Self::index(stream);
        let Some(budget) = self.budget else {
            self.streams[i].head.extend_from_slice(bytes);
            return;
        };
        let other = self.streams[1 - i].rendered_len();
        let marker_len = self.marker.len();
        let s = &mut self.streams[i];
        if s.cap.is_some() {
            push_tail(&mut s.tail, s.tail_cap, bytes);
            return;
        }
        let room = usize::try_from(budget).unwrap_or(usize::MAX).saturating_sub(other);
        if s.head.len() + bytes.len() <= room {
            s.head.extend_from_slice(bytes);
            return;
        }
        // First overflow: this stream's size is fixed at `room` from now on.
        s.cap = Some(room);
        if marker_len >= room {
            s.head.clear();
            s.tail_cap = 0;
            return;
        }
        let head_keep = (room - marker_len) / 2;
        s.tail_cap = room - marker_len - head_keep;
        let mut all = std::mem::take(&mut s.head);
        all.extend_from_slice(bytes);
        push_tail(&mut s.tail, s.tail_cap, &all[head_keep.min(all.len())..]);
        all.truncate(head_keep);
        s.head = all;
    }

    pub fn truncated(&self) -> bool {
        self.streams.iter().any(|s| s.cap.is_some())
    }

    pub fn finish(self) -> CollectedOutput {
        let truncated = self.truncated();
        let [out, err] = self.streams;
        CollectedOutput { stdout: render(out, &self.marker), stderr: render(err, &self.marker), truncated }
    }
}

impl OutputSink for OutputBudget {
    fn write(&mut self, stream: Stream, bytes: &[u8]) {
        self.push(stream, bytes);
    }
}

fn push_tail(tail: &mut VecDeque<u8>, cap: usize, bytes: &[u8]) {
    let bytes = &bytes[bytes.len().saturating_sub(cap)..];
    let overflow = (tail.len() + bytes.len()).saturating_sub(cap);
    tail.drain(..overflow);
    tail.extend(bytes);
}

/// Text of one stream. Cuts are moved to character boundaries (a split character would
/// become a 3-byte replacement and break the budget); invalid bytes the program wrote
/// itself are replaced.
fn render(s: StreamBuf, marker: &str) -> String {
    let Some(cap) = s.cap else {
        // Replacement characters can outgrow the bytes they replace; the share stays fixed.
        let share = s.head.len();
        return clamp(String::from_utf8_lossy(&s.head).into_owned(), share);
    };
    if marker.len() >= cap {
        let mut end = cap;
        while !marker.is_char_boundary(end) {
            end -= 1;
        }
        return marker[..end].to_owned();
    }
    let head = utf8_prefix(&s.head);
    let tail: Vec<u8> = s.tail.into_iter().collect();
    let tail = utf8_suffix(&tail);
    let mut text = String::with_capacity(cap);
    text.push_str(&String::from_utf8_lossy(head));
    text.push_str(marker);
    text.push_str(&String::from_utf8_lossy(tail));
    clamp(text, cap)
}

/// Cuts `text` to at most `limit` bytes, at a character boundary.
fn clamp(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The longest prefix that does not end inside a multi-byte character.
fn utf8_prefix(bytes: &[u8]) -> &[u8] {
    match std::str::from_utf8(bytes) {
        Ok(_) => bytes,
        Err(e) if e.error_len().is_none() => &bytes[..e.valid_up_to()],
        Err(_) => bytes,
    }
}

/// Drops continuation bytes at the start (the rest of a character cut off in front).
fn utf8_suffix(bytes: &[u8]) -> &[u8] {
    let skip = bytes.iter().take(3).take_while(|b| (**b & 0xC0) == 0x80).count();
    &bytes[skip..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(budget: u64, chunks: &[(Stream, &[u8])]) -> CollectedOutput {
        let mut b = OutputBudget::new(budget);
        for (s, c) in chunks {
            b.push(*s, c);
        }
        b.finish()
    }

    #[test]
    fn unlimited_keeps_everything() {
        let big = vec![b'x'; 100_000];
        let out = collect(0, &[(Stream::Stdout, &big), (Stream::Stderr, b"e")]);
        assert_eq!(out.stdout.len(), 100_000);
        assert_eq!(out.stderr, "e");
        assert!(!out.truncated);
    }

    #[test]
    fn within_budget_is_untouched() {
        let out = collect(10, &[(Stream::Stdout, b"abc"), (Stream::Stderr, b"de"), (Stream::Stdout, b"f")]);
        assert_eq!((out.stdout.as_str(), out.stderr.as_str(), out.truncated), ("abcf", "de", false));
    }

    #[test]
    fn overflow_keeps_head_and_tail_within_budget() {
        let budget = 2000u64;
        let m = marker(budget);
        let mut data = Vec::new();
        for i in 0..1000 {
            data.extend(format!("line {i}\n").bytes());
        }
        let out = collect(budget, &[(Stream::Stdout, &data[..3000]), (Stream::Stdout, &data[3000..])]);
        assert!(out.truncated);
        assert_eq!(out.stdout.len(), 2000);
        assert!(out.stdout.contains("output truncated"));
        let head = (2000 - m.len()) / 2;
        assert_eq!(out.stdout.as_bytes()[..head], data[..head]);
        assert!(out.stdout.ends_with("line 999\n"));
        assert_eq!(out.stdout.as_bytes()[head..head + m.len()], *m.as_bytes());
    }

    #[test]
    fn streams_share_one_budget_first_come_first_served() {
        let budget = 1000u64;
        let out = collect(
            budget,
            &[(Stream::Stderr, &[b'e'; 300]), (Stream::Stdout, &[b'o'; 5000]), (Stream::Stderr, b"late")],
        );
        // stdout got the room stderr had left (700); stderr kept going until its own overflow.
        assert_eq!(out.stdout.len(), 700);
        assert!(out.stdout.len() + out.stderr.len() <= 1000);
        assert!(out.stderr.contains("output truncated") || out.stderr.len() == 300);
    }

    #[test]
    fn room_zero_drops_the_stream() {
        let out = collect(10, &[(Stream::Stdout, &[b'o'; 10]), (Stream::Stderr, b"anything")]);
        assert_eq!(out.stdout.len(), 10);
        assert_eq!(out.stderr, "");
        assert!(out.truncated);
    }

    #[test]
    fn a_marker_longer_than_the_room_is_cut_to_it() {
        let out = collect(50, &[(Stream::Stdout, &[b'o'; 60])]);
        assert_eq!(out.stdout.len(), 50);
        assert!(marker(50).starts_with(&out.stdout));
    }

    #[test]
    fn cuts_land_on_character_boundaries() {
        let text = "é".repeat(3000); // 2 bytes each
        for budget in [300u64, 301, 302, 303] {
            let out = collect(budget, &[(Stream::Stdout, text.as_bytes())]);
            assert!(out.stdout.len() as u64 <= budget, "{budget}: {}", out.stdout.len());
            assert!(!out.stdout.contains('\u{FFFD}'), "{budget}");
        }
    }

    #[test]
    fn invalid_bytes_never_break_the_budget() {
        let binary: Vec<u8> = (0..20_000u32).map(|i| (0x80 + i % 64) as u8).collect();
        for budget in [100u64, 1000, 4096] {
            let out = collect(budget, &[(Stream::Stdout, &binary[..50]), (Stream::Stderr, &binary)]);
            assert!(out.stdout.len() + out.stderr.len() <= budget as usize, "{budget}");
        }
        // Untruncated but invalid: kept within its own byte count.
        let out = collect(1000, &[(Stream::Stdout, &binary[..30])]);
        assert!(out.stdout.len() <= 30);
    }

    #[test]
    fn many_small_chunks_equal_one_big_chunk() {
        let data: Vec<u8> = (0..50_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let whole = collect(4096, &[(Stream::Stdout, &data)]);
        let mut b = OutputBudget::new(4096);
        for chunk in data.chunks(7) {
            b.push(Stream::Stdout, chunk);
        }
        assert_eq!(b.finish(), whole);
    }
}
