//! One output budget shared by stdout and stderr (internals §2.6, contract "Output
//! truncation"): first come, first served; a stream that overflows keeps its head and its
//! tail around the original's marker, and the two streams never exceed the budget together.
//!
//! What the budget counts is what the answer will hold (issues #14 hole 4 and #32,
//! [`counted_len`]): the text after UTF-8 decoding (invalid bytes become U+FFFD, 3 bytes), a
//! control character as its JSON escape (`\x01` is the 6 bytes `\u0001`), ordinary text
//! (newlines, tabs, quotes included) byte for byte as the original counts it. So
//! `maxOutputBytes` bounds the answer's `stdout` + `stderr` as sent (at most twice it, for
//! text made of newlines or quotes), not the bytes the sandbox wrote, and ordinary text is
//! cut exactly where the original cuts it. The text is kept decoded, in chunks of at most [`CHUNK`]
//! bytes (never a buffer doubled and copied, never one big concatenation), and is escaped
//! only as the answer is streamed ([`OutputText`] is `Display`; serde's `collect_str`
//! writes it escaped piece by piece).
//!
//! Every chunk is taken from one server-wide [`OutputPool`] and given back when the text
//! is dropped (the answer sent, or the client gone). When the pool is exhausted a stream is
//! cut where it stands, with the same marker naming the bytes it kept, and the sandbox goes
//! on; output never fails a run and never blocks one. Differences from the original: a
//! control character counts as its escape and an invalid byte as U+FFFD (binary output is cut
//! sooner than the original's byte count would), and the ceiling can cut a stream below its
//! budget.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

pub use super::pool::{FLOOR, Held, OutputPool};

/// Which stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Receives the sandbox's output as it arrives.
pub trait OutputSink: Send {
    fn write(&mut self, stream: Stream, bytes: &[u8]);

    /// `Some` while the sink holds more than it should (a managed run's log rows not yet
    /// written): the launcher waits for that notification, at most [`BACKLOG_WAIT`] at a
    /// time, before it reads on; meanwhile the sandbox waits on its full pipe.
    fn backlog(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }
}

/// The longest one wait for a sink's backlog (a sink that cannot drain, e.g. a failing
/// database, slows the run down but never stops it).
pub const BACKLOG_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The largest piece of kept text (one allocation, taken from the pool as a whole).
pub const CHUNK: usize = 64 * 1024;
/// The first chunk of a stream is this small; chunks double up to [`CHUNK`].
const FIRST_CHUNK: usize = 256;

/// The marker the original runner inserts where output was cut.
pub fn marker(budget: u64) -> String {
    format!(
        "\n...[output truncated: exceeded {budget} bytes; set SCIENCE_AGENT_MAX_OUTPUT_BYTES=0 to disable]...\n"
    )
}

/// The bytes serde_json writes for one byte of UTF-8 text inside a string: `"` and `\`
/// backslashed, the control characters `\b \f \n \r \t` short, the others `\u00XX`, every
/// other byte (multi-byte characters included) as it is.
pub fn escaped(b: u8) -> ([u8; 6], usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let short = |c: u8| ([b'\\', c, 0, 0, 0, 0], 2);
    match b {
        b'"' => short(b'"'),
        b'\\' => short(b'\\'),
        0x08 => short(b'b'),
        0x0C => short(b'f'),
        b'\n' => short(b'n'),
        b'\r' => short(b'r'),
        b'\t' => short(b't'),
        0x00..=0x1F => ([b'\\', b'u', b'0', b'0', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]], 6),
        _ => ([b, 0, 0, 0, 0, 0], 1),
    }
}

/// How many bytes `b` takes in a JSON string ([`escaped`]).
pub fn json_len(b: u8) -> usize {
    match b {
        b'"' | b'\\' | 0x08 | 0x0C | b'\n' | b'\r' | b'\t' => 2,
        0x00..=0x1F => 6,
        _ => 1,
    }
}

/// How many bytes `s` takes inside a JSON string.
pub fn json_len_str(s: &str) -> usize {
    s.bytes().map(json_len).sum()
}

/// What one byte of decoded text costs against the output budget (issue #32): ordinary text
/// (printable UTF-8, newlines, tabs, carriage returns, quotes and backslashes) one per byte,
/// as the original counts it, so text is cut exactly where the original cuts it; any other
/// control character what the answer spends on it (`\u0001` is 6 bytes, `\b` and `\f` are
/// 2). An invalid byte was decoded to U+FFFD, 3 bytes. So the answer's `stdout` + `stderr`
/// is at most the budget, or up to twice it where the text is made of the five ordinary
/// characters JSON writes as two bytes; never the 6x a control-byte flood would make.
pub fn counted_len(b: u8) -> usize {
    match b {
        b'\n' | b'\t' | b'\r' | b'"' | b'\\' => 1,
        _ => json_len(b),
    }
}

/// What `s` costs against the budget ([`counted_len`]).
pub fn counted_len_str(s: &str) -> usize {
    s.bytes().map(counted_len).sum()
}

/// The end of the longest prefix of `s` that costs at most `limit`, on a character
/// boundary.
fn prefix_within(s: &str, limit: usize) -> usize {
    let mut counted = 0;
    for (i, b) in s.bytes().enumerate() {
        counted += counted_len(b);
        if counted > limit {
            let mut end = i;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            return end;
        }
    }
    s.len()
}

/// The start of the longest suffix of `s` that costs at most `limit`.
fn suffix_within(s: &str, limit: usize) -> usize {
    let mut counted = 0;
    let mut start = s.len();
    for (i, c) in s.char_indices().rev() {
        let l = if c.is_ascii() { counted_len(c as u8) } else { c.len_utf8() };
        if counted + l > limit {
            break;
        }
        counted += l;
        start = i;
    }
    start
}

/// A streaming UTF-8 decoder for one stream: a character split across reads is joined;
/// invalid sequences become U+FFFD (W3C maximal-subpart style, as `from_utf8_lossy`); an
/// incomplete tail waits for the next read.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Decodes what can be decoded; keeps an incomplete trailing sequence for later.
    pub fn decode(&mut self, bytes: &[u8]) -> String {
        let joined;
        let mut rest: &[u8] = if self.pending.is_empty() {
            bytes
        } else {
            let mut buf = std::mem::take(&mut self.pending);
            buf.extend_from_slice(bytes);
            joined = buf;
            &joined
        };
        let mut out = String::with_capacity(rest.len());
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` was just checked by from_utf8.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &after[n..];
                        }
                        None => {
                            self.pending = after.to_vec();
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// At the end of the stream: an incomplete sequence left over becomes one U+FFFD.
    pub fn end(&mut self) -> &'static str {
        if std::mem::take(&mut self.pending).is_empty() { "" } else { "\u{FFFD}" }
    }
}

/// Text in chunks of at most [`CHUNK`] bytes, each with what it costs ([`counted_len`]);
/// `start` bytes of the front chunk are already dropped (a tail keeps dropping its oldest
/// characters).
#[derive(Debug, Default)]
struct Chunks {
    chunks: VecDeque<(String, usize)>,
    start: usize,
    /// The cost of the front chunk's dropped part.
    start_counted: usize,
    /// The cost of the text kept.
    counted: usize,
    /// Capacity of all chunks: what this text holds from the pool.
    memory: usize,
}

impl Chunks {
    /// Appends as much of `text` as the pool allows; returns the bytes appended (on a
    /// character boundary). `recycle`: when the pool is empty, reuse the oldest chunk.
    fn push(&mut self, mut text: &str, held: &mut Held, recycle: bool) -> usize {
        let total = text.len();
        while !text.is_empty() {
            let room = self.chunks.back().map_or(0, |(c, _)| c.capacity() - c.len());
            let mut end = room.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            if end == 0 {
                // The last chunk is full (or too full for the next character): a new one.
                let last = self.chunks.back().map_or(0, |(c, _)| c.capacity());
                let mut cap = text.len().clamp(FIRST_CHUNK, CHUNK).max((2 * last).min(CHUNK));
                // Near the ceiling (or within the floor) a smaller chunk may still be had.
                let taken = loop {
                    if held.take(cap) {
                        break true;
                    }
                    if cap <= FIRST_CHUNK {
                        break false;
                    }
                    cap = (cap / 2).max(FIRST_CHUNK);
                };
                if taken {
                    self.memory += cap;
                    self.chunks.push_back((String::with_capacity(cap), 0));
                } else if recycle && !self.chunks.is_empty() {
                    // The ceiling: the oldest chunk's text goes, its memory is reused.
                    let (mut old, counted) = self.chunks.pop_front().unwrap_or_default();
                    self.counted -= counted - self.start_counted;
                    (self.start, self.start_counted) = (0, 0);
                    old.clear();
                    self.chunks.push_back((old, 0));
                } else {
                    break;
                }
                continue;
            }
            let (piece, rest) = text.split_at(end);
            let counted = counted_len_str(piece);
            if let Some((c, j)) = self.chunks.back_mut() {
                c.push_str(piece);
                *j += counted;
            }
            self.counted += counted;
            text = rest;
        }
        total - text.len()
    }

    /// Drops the oldest characters until at most `limit` JSON bytes remain.
    fn keep_last(&mut self, limit: usize, held: &mut Held) {
        while self.counted > limit {
            let Some((front, front_counted)) = self.chunks.front() else { break };
            let excess = self.counted - limit;
            let remaining = front_counted - self.start_counted;
            if remaining <= excess {
                self.counted -= remaining;
                let cap = front.capacity();
                self.chunks.pop_front();
                self.memory -= cap;
                held.give(cap);
                (self.start, self.start_counted) = (0, 0);
                continue;
            }
            let rest = &front[self.start..];
            let mut dropped = 0;
            let mut cut = rest.len();
            for (i, c) in rest.char_indices() {
                if dropped >= excess {
                    cut = i;
                    break;
                }
                dropped += if c.is_ascii() { counted_len(c as u8) } else { c.len_utf8() };
            }
            self.start += cut;
            self.start_counted += dropped;
            self.counted -= dropped;
        }
    }

    /// Keeps the longest prefix within `limit` JSON bytes; returns the rest as its own
    /// chunks (moved, not copied, but for the part of the chunk where the cut falls).
    fn split_off(&mut self, limit: usize, held: &mut Held) -> Chunks {
        let mut rest = Chunks::default();
        let mut counted = 0;
        let mut index = self.chunks.len();
        for (i, (_, j)) in self.chunks.iter().enumerate() {
            if counted + j > limit {
                index = i;
                break;
            }
            counted += j;
        }
        let Some(moved) = (index < self.chunks.len()).then(|| self.chunks.split_off(index)) else {
            return rest;
        };
        for (c, j) in moved {
            rest.memory += c.capacity();
            rest.counted += j;
            rest.chunks.push_back((c, j));
        }
        self.memory -= rest.memory;
        self.counted = counted;
        // The chunk where the cut falls: its head stays here (copied into a chunk of its own).
        if let Some((front, _)) = rest.chunks.front() {
            let end = prefix_within(front, limit - counted);
            if end > 0 {
                let piece = front[..end].to_owned();
                let piece_counted = counted_len_str(&piece);
                if held.take(piece.capacity()) {
                    self.memory += piece.capacity();
                    self.counted += piece_counted;
                    self.chunks.push_back((piece, piece_counted));
                }
                rest.start = end;
                rest.start_counted = piece_counted;
                rest.counted -= piece_counted;
            }
        }
        rest
    }

    fn clear(&mut self, held: &mut Held) {
        held.give(self.memory);
        *self = Chunks::default();
    }

    fn into_pieces(self) -> impl Iterator<Item = Piece> {
        let start = self.start;
        self.chunks
            .into_iter()
            .enumerate()
            .map(move |(i, (text, _))| Piece { text, start: if i == 0 { start } else { 0 } })
    }
}

/// One stream: its decoder, the head kept from the start, and once cut, the fixed share it
/// renders to, the marker and the most recent text.
#[derive(Debug, Default)]
struct StreamBuf {
    decoder: Utf8Stream,
    head: Chunks,
    cut: Option<Cut>,
    tail: Chunks,
}

#[derive(Debug)]
struct Cut {
    /// What this stream costs from the cut on (what the other stream sees as taken).
    share: usize,
    marker: String,
    tail_limit: usize,
}

impl StreamBuf {
    fn rendered(&self) -> usize {
        self.cut.as_ref().map_or(self.head.counted, |c| c.share)
    }

    /// The first cut: the stream renders to `share` JSON bytes from now on, `text` being
    /// the piece that did not fit. The head keeps `(share - marker) / 2`, the tail the rest.
    fn cut(&mut self, share: usize, marker: String, text: &str, held: &mut Held) {
        let marker_counted = counted_len_str(&marker);
        if marker_counted >= share {
            // The marker alone, cut to the share (internals §2.6).
            let end = prefix_within(&marker, share);
            self.head.clear(held);
            self.cut = Some(Cut { share, marker: marker[..end].to_owned(), tail_limit: 0 });
            return;
        }
        let head_keep = (share - marker_counted) / 2;
        let tail_limit = share - marker_counted - head_keep;
        let text = if self.head.counted <= head_keep {
            let end = prefix_within(text, head_keep - self.head.counted);
            let pushed = self.head.push(&text[..end], held, false);
            &text[pushed..]
        } else {
            self.tail = self.head.split_off(head_keep, held);
            text
        };
        self.cut = Some(Cut { share, marker, tail_limit });
        self.push_tail(text, held);
    }

    fn push_tail(&mut self, text: &str, held: &mut Held) {
        let limit = self.cut.as_ref().map_or(0, |c| c.tail_limit);
        let text = &text[suffix_within(text, limit)..];
        self.tail.keep_last(limit - counted_len_str(text), held);
        self.tail.push(text, held, true);
        self.tail.keep_last(limit, held);
    }
}

/// Collects both streams under one budget (`None` or 0: unlimited), holding memory from a
/// pool.
#[derive(Debug)]
pub struct OutputBudget {
    budget: Option<usize>,
    marker: String,
    streams: [StreamBuf; 2],
    held: Held,
}

/// The rendered result, as strings (small outputs: probes, self-tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectedOutput {
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

/// The rendered result, as the kept text itself (no copy), holding its memory from the
/// pool until dropped.
#[derive(Debug)]
pub struct CollectedText {
    pub stdout: OutputText,
    pub stderr: OutputText,
    pub truncated: bool,
}

impl OutputBudget {
    /// A budget with a pool of its own (no ceiling but the budget).
    pub fn new(budget: u64) -> Self {
        Self::pooled(budget, &OutputPool::new(u64::MAX))
    }

    /// A budget whose memory comes from `pool`.
    pub fn pooled(budget: u64, pool: &Arc<OutputPool>) -> Self {
        let budget = (budget > 0).then_some(budget);
        OutputBudget {
            budget: budget.map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
            marker: budget.map(marker).unwrap_or_default(),
            streams: Default::default(),
            held: Held::new(pool),
        }
    }

    fn index(stream: Stream) -> usize {
        match stream {
            Stream::Stdout => 0,
            Stream::Stderr => 1,
        }
    }

    pub fn push(&mut self, stream: Stream, bytes: &[u8]) {
        let i = Self::index(stream);
        let text = self.streams[i].decoder.decode(bytes);
        self.push_text(i, &text);
    }

    fn push_text(&mut self, i: usize, text: &str) {
        if text.is_empty() {
            return;
        }
        let other = self.streams[1 - i].rendered();
        let held = &mut self.held;
        let s = &mut self.streams[i];
        if s.cut.is_some() {
            s.push_tail(text, held);
            return;
        }
        let room = self.budget.map_or(usize::MAX, |b| b.saturating_sub(other));
        let end = prefix_within(text, room.saturating_sub(s.head.counted));
        let pushed = s.head.push(&text[..end], held, false);
        if pushed == text.len() {
            return;
        }
        let rest = &text[pushed..];
        if pushed == end && end < text.len() {
            // The budget: this stream's share is the room it had.
            s.cut(room, self.marker.clone(), rest, held);
        } else {
            // The server-wide ceiling: the stream is cut at what it holds.
            let share = s.head.counted;
            s.cut(share, marker(share as u64), rest, held);
        }
    }

    pub fn truncated(&self) -> bool {
        self.streams.iter().any(|s| s.cut.is_some())
    }

    /// Bytes of memory this output holds now.
    pub fn held(&self) -> u64 {
        self.held.bytes()
    }

    /// The kept text of both streams, as it will be answered.
    pub fn finish_text(mut self) -> CollectedText {
        for i in 0..2 {
            let end = self.streams[i].decoder.end();
            self.push_text(i, end);
        }
        let truncated = self.truncated();
        let [out, err] = self.streams;
        let mut held = self.held;
        let stdout = OutputText::from_stream(out, &mut held);
        let stderr = OutputText::from_stream(err, &mut held);
        CollectedText { stdout, stderr, truncated }
    }

    /// The kept text of both streams, as strings.
    pub fn finish(self) -> CollectedOutput {
        let text = self.finish_text();
        CollectedOutput {
            stdout: text.stdout.to_string(),
            stderr: text.stderr.to_string(),
            truncated: text.truncated,
        }
    }
}

impl OutputSink for OutputBudget {
    fn write(&mut self, stream: Stream, bytes: &[u8]) {
        self.push(stream, bytes);
    }
}

/// Text kept from one chunk onwards.
#[derive(Debug, Default)]
pub struct Piece {
    text: String,
    start: usize,
}

impl Piece {
    pub fn as_str(&self) -> &str {
        &self.text[self.start..]
    }
}

/// One stream's text as the answer holds it: head, marker, tail, in pieces; `Display`s
/// (and so serializes through `collect_str`) without being joined. Holds its memory from
/// the pool until dropped.
#[derive(Debug, Default)]
pub struct OutputText {
    pieces: Vec<Piece>,
    json: usize,
    _held: Option<Held>,
}

impl OutputText {
    fn from_stream(s: StreamBuf, held: &mut Held) -> OutputText {
        let memory = s.head.memory + s.tail.memory;
        let mut pieces: Vec<Piece> = s.head.into_pieces().collect();
        if let Some(cut) = s.cut {
            pieces.push(Piece { text: cut.marker, start: 0 });
            pieces.extend(s.tail.into_pieces());
        }
        pieces.retain(|p| !p.as_str().is_empty());
        // The budget counted ordinary text as the original does: the answer's length is
        // counted once more, as JSON (one pass over what is kept, as the answer makes).
        let json = pieces.iter().map(|p| json_len_str(p.as_str())).sum();
        OutputText { pieces, json, _held: Some(held.split(memory)) }
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().map(Piece::as_str)
    }

    /// Takes what this text holds from the pool (to keep it counted while a copy is made).
    pub fn take_held(&mut self) -> Option<Held> {
        self._held.take()
    }

    /// Takes the pieces (the memory stays held by this text until it is dropped).
    pub fn take_pieces(&mut self) -> Vec<Piece> {
        std::mem::take(&mut self.pieces)
    }

    /// Bytes inside the answer's JSON string.
    pub fn json_len(&self) -> usize {
        self.json
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.iter().all(|p| p.as_str().is_empty())
    }
}

impl From<String> for OutputText {
    fn from(text: String) -> Self {
        let json = json_len_str(&text);
        OutputText { pieces: vec![Piece { text, start: 0 }], json, _held: None }
    }
}

impl fmt::Display for OutputText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.pieces().try_for_each(|p| f.write_str(p))
    }
}

impl serde::Serialize for OutputText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
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

    fn json(s: &str) -> usize {
        json_len_str(s)
    }

    /// What `s` costs against the budget.
    fn cost(s: &str) -> usize {
        counted_len_str(s)
    }

    #[test]
    fn cost_table() {
        // Ordinary text costs its bytes, as the original counts them; other control
        // characters what the answer spends on them.
        let cases: &[(&str, usize, usize)] = &[
            ("abc", 3, 3),
            ("line\n", 5, 6),
            ("a\tb\r\n", 5, 8),
            ("say \"hi\" \\o/", 12, 15),
            ("训练中", 9, 9),
            ("😀", 4, 4),
            ("\u{7f}", 1, 1),
            ("\u{1}", 6, 6),
            ("\u{0}\u{1b}[0m", 15, 15),
            ("\u{8}\u{c}", 4, 4),
            ("\u{FFFD}", 3, 3),
        ];
        for (text, counted, answered) in cases {
            assert_eq!((cost(text), json(text)), (*counted, *answered), "{text:?}");
        }
        for b in 0u8..=0x7F {
            let ordinary = b >= 0x20 || matches!(b, b'\n' | b'\t' | b'\r');
            assert_eq!(counted_len(b), if ordinary { 1 } else { json_len(b) }, "{b:#x}");
            assert!(json_len(b) <= 2 * counted_len(b), "{b:#x}: the answer is at most twice the budget");
        }
    }

    /// Text is cut where the original cuts it (internals §2.6): `seq`'s lines, newlines
    /// counted one byte each, and the head `floor((N - marker) / 2)` of the marker's bytes.
    #[test]
    fn ordinary_text_is_cut_exactly_where_the_original_cuts_it() {
        let data: String = (1..=100_000).map(|i| format!("{i}\n")).collect();
        for budget in [2000u64, 4097, 65_536] {
            let out = collect(budget, &[(Stream::Stdout, data.as_bytes())]);
            let m = marker(budget);
            let head = (budget as usize - m.len()) / 2;
            let tail = budget as usize - m.len() - head;
            let want = format!("{}{m}{}", &data[..head], &data[data.len() - tail..]);
            assert_eq!(out.stdout, want, "{budget}");
            assert_eq!(out.stdout.len() as u64, budget);
        }
    }

    /// A control-byte flood: the answer stays within the budget but for the marker's two
    /// newlines (2 bytes more each, as JSON).
    #[test]
    fn a_control_byte_flood_answers_within_the_budget() {
        let flood = vec![1u8; 1 << 20];
        for budget in [1000u64, 65_536, 300_000] {
            let mut b = OutputBudget::new(budget);
            b.push(Stream::Stdout, &flood);
            b.push(Stream::Stderr, &flood);
            let text = b.finish_text();
            let answered = (text.stdout.json_len() + text.stderr.json_len()) as u64;
            assert!(answered <= budget + 4, "{budget}: {answered}");
            assert!(answered >= budget - 12, "{budget}: the budget is used, {answered}");
        }
    }

    #[test]
    fn escaping_is_serde_jsons() {
        for b in 0u8..=0x7F {
            let text = (b as char).to_string();
            let serde = serde_json::to_string(&text).unwrap();
            let (bytes, n) = escaped(b);
            assert_eq!(&bytes[..n], &serde.as_bytes()[1..serde.len() - 1], "{b:#x}");
            assert_eq!(json_len(b), n, "{b:#x}");
        }
        for text in ["é", "训练中", "😀", "\u{FFFD}", "a\"b\\c\u{1}\u{7f}"] {
            assert_eq!(json(text), serde_json::to_string(text).unwrap().len() - 2, "{text:?}");
        }
    }

    #[test]
    fn the_answer_serializes_the_kept_text() {
        let mut b = OutputBudget::new(500);
        let data: Vec<u8> = (0..3000u32).map(|i| (i % 128) as u8).collect();
        b.push(Stream::Stdout, &data);
        b.push(Stream::Stderr, b"\xff\"x\"");
        let text = b.finish_text();
        let joined = text.stdout.to_string();
        assert_eq!(serde_json::to_string(&text.stdout).unwrap(), serde_json::to_string(&joined).unwrap());
        assert_eq!(text.stdout.json_len(), json(&joined));
        assert_eq!(text.stderr.json_len(), json(&text.stderr.to_string()));
        assert!(cost(&joined) + cost(&text.stderr.to_string()) <= 500);
        assert!(text.stdout.json_len() + text.stderr.json_len() <= 1000);
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
            data.extend(format!("line {i};").bytes());
        }
        let out = collect(budget, &[(Stream::Stdout, &data[..3000]), (Stream::Stdout, &data[3000..])]);
        assert!(out.truncated);
        assert_eq!(out.stdout.len(), 2000);
        assert!(out.stdout.contains("output truncated"));
        let head = (2000 - m.len()) / 2;
        assert_eq!(out.stdout.as_bytes()[..head], data[..head]);
        assert!(out.stdout.ends_with("line 999;"));
        assert_eq!(out.stdout.as_bytes()[head..head + m.len()], *m.as_bytes());
    }

    #[test]
    fn control_bytes_count_as_their_escapes() {
        let ones = [1u8; 1000];
        let fits = collect(6000, &[(Stream::Stdout, &ones)]);
        assert_eq!((fits.stdout.len(), fits.truncated), (1000, false));
        let cut = collect(5999, &[(Stream::Stdout, &ones)]);
        assert!(cut.truncated);
        assert!(cost(&cut.stdout) <= 5999, "{}", cost(&cut.stdout));
        assert!(cut.stdout.contains("output truncated: exceeded 5999 bytes"));
    }

    #[test]
    fn streams_share_one_budget_first_come_first_served() {
        let budget = 1000u64;
        let out = collect(
            budget,
            &[(Stream::Stderr, &[b'e'; 300]), (Stream::Stdout, &[b'o'; 5000]), (Stream::Stderr, b"late")],
        );
        // stdout got the room stderr had left (700); stderr kept going until its own overflow.
        assert_eq!(cost(&out.stdout), 700);
        assert!(cost(&out.stdout) + cost(&out.stderr) <= 1000);
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
            assert!(cost(&out.stdout) as u64 <= budget, "{budget}: {}", out.stdout.len());
            assert!(!out.stdout.contains('\u{FFFD}'), "{budget}");
        }
    }

    #[test]
    fn invalid_bytes_count_as_replacement_characters() {
        let binary: Vec<u8> = (0..20_000u32).map(|i| (0x80 + i % 64) as u8).collect();
        for budget in [100u64, 1000, 4096] {
            let out = collect(budget, &[(Stream::Stdout, &binary[..50]), (Stream::Stderr, &binary)]);
            assert!(cost(&out.stdout) + cost(&out.stderr) <= budget as usize, "{budget}");
        }
        // Untruncated: each stray byte is a U+FFFD (3 bytes), and the budget saw 90 bytes.
        let out = collect(90, &[(Stream::Stdout, &binary[..30])]);
        assert_eq!((out.stdout, out.truncated), ("\u{FFFD}".repeat(30), false));
        assert!(collect(89, &[(Stream::Stdout, &binary[..30])]).truncated);
    }

    #[test]
    fn a_character_split_across_reads_is_joined_and_a_dangling_one_replaced() {
        let bytes = "训练中".as_bytes();
        let mut b = OutputBudget::new(0);
        for byte in bytes {
            b.push(Stream::Stdout, std::slice::from_ref(byte));
        }
        b.push(Stream::Stderr, b"x\xe8\xae");
        let out = b.finish();
        assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("训练中", "x\u{FFFD}"));
    }

    #[test]
    fn many_small_chunks_equal_one_big_chunk() {
        let data: Vec<u8> = (0..200_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for budget in [4096u64, 150_000, 0] {
            let whole = collect(budget, &[(Stream::Stdout, &data)]);
            let mut b = OutputBudget::new(budget);
            for chunk in data.chunks(7) {
                b.push(Stream::Stdout, chunk);
            }
            assert_eq!(b.finish(), whole, "{budget}");
        }
    }

    #[test]
    fn memory_stays_within_the_budget() {
        let budget = 1 << 20;
        for byte in [b'x', 1u8] {
            let mut b = OutputBudget::new(budget);
            let data = vec![byte; 64 * 1024];
            for _ in 0..256 {
                b.push(Stream::Stdout, &data);
                assert!(b.held() <= budget + 2 * CHUNK as u64, "{}", b.held());
            }
            let text = b.finish_text();
            assert!(text.stdout.json_len() as u64 <= budget + 2, "the marker's newlines");
            assert!(text.stdout.to_string().ends_with(&String::from_utf8(vec![byte; 100]).unwrap()));
        }
    }

    #[test]
    fn the_pool_is_a_ceiling_and_cuts_with_the_marker() {
        let ceiling = 1 << 20;
        let pool = OutputPool::new(ceiling);
        let mut first = OutputBudget::pooled(0, &pool);
        let data = vec![b'y'; 64 * 1024];
        for _ in 0..64 {
            first.push(Stream::Stdout, &data);
            assert!(pool.used() <= ceiling);
        }
        first.push(Stream::Stdout, b"THE END");
        let text = first.finish_text();
        let stdout = text.stdout.to_string();
        assert!(text.truncated);
        assert!(text.stdout.json_len() as u64 <= ceiling);
        assert!(text.stdout.json_len() as u64 >= ceiling / 2, "{}", text.stdout.json_len());
        assert!(stdout.contains("...[output truncated: exceeded "), "the original's marker");
        assert!(stdout.ends_with("yyyTHE END"), "the tail is the newest output");
        assert!(pool.used() > 0);
        // While the first answer holds the ceiling, another execution still keeps its
        // first FLOOR bytes: small output whole, large output cut with the marker.
        let mut small = OutputBudget::pooled(0, &pool);
        small.push(Stream::Stdout, b"hello");
        let mut large = OutputBudget::pooled(0, &pool);
        large.push(Stream::Stdout, &data);
        large.push(Stream::Stdout, b"LAST");
        assert!(pool.used() <= ceiling + 2 * FLOOR as u64);
        assert_eq!(small.finish().stdout, "hello");
        let large = large.finish().stdout;
        assert!(large.contains("output truncated: exceeded "), "{large}");
        assert!(large.ends_with("LAST") && large.len() <= FLOOR, "{}", large.len());
        drop(text);
        let mut third = OutputBudget::pooled(0, &pool);
        third.push(Stream::Stdout, b"ok");
        assert_eq!(third.finish().stdout, "ok");
    }
}
