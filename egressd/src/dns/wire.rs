//! DNS messages on the wire (RFC 1035 §4), as pure functions over byte slices.
//!
//! Both halves live here: the client half (`encode_query`, `check_reply`, `parse_response`) is
//! what [`StubResolver`](super::StubResolver) sends and accepts, and the server half
//! (`parse_query`, `encode_answer`, `encode_response`) is what the fake nameservers in tests are
//! built from, so both sides of every test speak exactly the format this module defines.
//!
//! Decoding is written for hostile input, because anyone who can reach the resolver's UDP port
//! can send it bytes: every read is bounds-checked and returns [`WireError`] instead of
//! panicking, and a compression pointer must land strictly before the start of the name segment
//! that led to it, so a chain of pointers always shrinks towards offset 0 and cannot loop.
//!
//! Names are text with `.` between labels and no trailing dot. A decoded label byte that is not a
//! printable ASCII character, or is `.` or `\`, is written as `\DDD` (the RFC 1035 master-file
//! escape), so a decoded name never looks like a different name. Queries accept only plain
//! printable ASCII (the proxy hands over normalised host names); the server half also accepts
//! the escapes, so it can re-encode any name it decoded.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Bytes in the fixed message header.
pub const HEADER_LEN: usize = 12;
/// The Internet class, the only one egressd asks about or accepts.
pub const CLASS_IN: u16 = 1;
/// Record type codes (RFC 1035 §3.2.2, RFC 3596).
pub const TYPE_A: u16 = 1;
pub const TYPE_CNAME: u16 = 5;
pub const TYPE_AAAA: u16 = 28;
/// Response codes (RFC 1035 §4.1.1).
pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_NOTIMP: u8 = 4;
pub const RCODE_REFUSED: u8 = 5;
/// The longest label, and the longest name in text form (255 bytes on the wire).
pub const MAX_LABEL_LEN: usize = 63;
pub const MAX_NAME_LEN: usize = 253;
/// How many CNAME links [`Response::addresses`] follows before giving up.
pub const MAX_CNAME_DEPTH: usize = 8;

const MAX_NAME_WIRE_LEN: usize = MAX_NAME_LEN + 2;
const MAX_MESSAGE_LEN: usize = u16::MAX as usize;
const MAX_POINTER_TARGET: usize = 0x3FFF;

const FLAG_QR: u16 = 0x8000;
const OPCODE_MASK: u16 = 0x7800;
const FLAG_TC: u16 = 0x0200;
const FLAG_RD: u16 = 0x0100;
const FLAG_RA: u16 = 0x0080;
const RCODE_MASK: u16 = 0x000F;

/// The address record types egressd asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordType {
    A,
    Aaaa,
}

impl RecordType {
    /// The type code on the wire.
    pub const fn code(self) -> u16 {
        match self {
            RecordType::A => TYPE_A,
            RecordType::Aaaa => TYPE_AAAA,
        }
    }
}

impl std::fmt::Display for RecordType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RecordType::A => "A",
            RecordType::Aaaa => "AAAA",
        })
    }
}

/// The conventional name of a response code, for messages.
pub fn rcode_name(rcode: u8) -> &'static str {
    match rcode {
        RCODE_NOERROR => "NOERROR",
        RCODE_FORMERR => "FORMERR",
        RCODE_SERVFAIL => "SERVFAIL",
        RCODE_NXDOMAIN => "NXDOMAIN",
        RCODE_NOTIMP => "NOTIMP",
        RCODE_REFUSED => "REFUSED",
        _ => "an unusual response code",
    }
}

/// Why a name could not be encoded or a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the name is empty")]
    EmptyName,
    #[error("the name has an empty label (a leading dot or two dots in a row)")]
    EmptyLabel,
    #[error("a label is {len} bytes long; DNS allows at most 63")]
    LabelTooLong { len: usize },
    #[error("the name is longer than the 253 characters DNS can carry")]
    NameTooLong,
    #[error("the name contains {ch:?}; a query name must be printable ASCII without `\\`")]
    BadCharacter { ch: char },
    #[error("the name has a `\\` escape that is not `\\DDD` (0-255) or `\\` and one ASCII character")]
    BadEscape,
    #[error("the {len}-byte message ends inside {what}")]
    Truncated { what: &'static str, len: usize },
    #[error(
        "the compression pointer at offset {at} points to offset {target}, which is not before \
         the name it continues (a possible loop)"
    )]
    BadPointer { at: usize, target: usize },
    #[error("the label at offset {at} has type bits {bits:#04x}, neither a plain label nor a pointer")]
    BadLabelType { at: usize, bits: u8 },
    #[error("the message ID is {got}, not the {want} that was sent")]
    IdMismatch { got: u16, want: u16 },
    #[error("the message is a query (QR bit clear), not a response")]
    NotAResponse,
    #[error("the message is a response (QR bit set), not a query")]
    NotAQuery,
    #[error("opcode {0} is not a standard query")]
    Opcode(u8),
    #[error("the message carries {0} questions; exactly one is expected")]
    QuestionCount(u16),
    #[error(
        "the question is {got_name} type {got_type}, not the {want_name} type {want_type} that was asked"
    )]
    QuestionMismatch { got_name: String, got_type: u16, want_name: String, want_type: u16 },
    #[error("the question class is {0}, not IN (1)")]
    Class(u16),
    #[error("a type {rtype} record carries {len} bytes of data; it must carry {want}")]
    RdataLength { rtype: u16, len: usize, want: usize },
    #[error("the CNAME chain starting at {name} is longer than 8 links")]
    CnameChainTooLong { name: String },
    #[error("the CNAME chain starting at {name} loops back to {at}")]
    CnameLoop { name: String, at: String },
    #[error("the message would carry {0} answers; at most 65535 fit")]
    TooManyRecords(usize),
    #[error("the message would be {0} bytes; DNS carries at most 65535")]
    MessageTooLong(usize),
}

/// The one question of a query, as a nameserver sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub id: u16,
    pub name: String,
    pub qtype: u16,
}

/// A decoded response: its header, its one question and its answer section.
///
/// The authority and additional sections are not decoded: a stub resolver asking for addresses
/// has no use for them, and not reading them means not trusting them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub id: u16,
    /// The TC bit: the answer did not fit in the datagram and must be asked again over TCP.
    pub truncated: bool,
    pub rcode: u8,
    pub qname: String,
    pub qtype: u16,
    /// IN-class answer records in message order; other classes are dropped when decoding.
    pub answers: Vec<Record>,
}

/// One resource record of the answer section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub name: String,
    pub ttl: u32,
    pub data: RData,
}

/// Record data, decoded for the types a stub resolver follows and kept raw for the rest.
///
/// `Other` is re-encoded byte for byte, so names compressed inside it would point elsewhere in
/// a re-encoded message; nothing here needs such records beyond skipping them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RData {
    A(Ipv4Addr),
    Aaaa(Ipv6Addr),
    Cname(String),
    Other { rtype: u16, data: Vec<u8> },
}

impl RData {
    /// The record type code on the wire.
    pub fn rtype(&self) -> u16 {
        match self {
            RData::A(_) => TYPE_A,
            RData::Aaaa(_) => TYPE_AAAA,
            RData::Cname(_) => TYPE_CNAME,
            RData::Other { rtype, .. } => *rtype,
        }
    }
}

impl Response {
    /// The addresses that answer the question: records of the question's type owned by the
    /// question's name or by a name the answer section's CNAME chain reaches from it, in answer
    /// order, without duplicates.
    ///
    /// Records owned by any other name are ignored: a nameserver (or whoever forged the reply)
    /// does not get to attach addresses to names nobody asked about. The chain is followed at
    /// most [`MAX_CNAME_DEPTH`] links, and a loop is an error rather than an empty answer.
    /// An empty result means the name exists without addresses of that type (or the chain
    /// ends outside the answer section, which a recursive resolver does not do).
    pub fn addresses(&self) -> Result<Vec<IpAddr>, WireError> {
        let mut chain: Vec<&str> = vec![self.qname.as_str()];
        loop {
            let current = chain[chain.len() - 1];
            let next = self.answers.iter().find_map(|r| match &r.data {
                RData::Cname(target) if same_name(&r.name, current) => Some(target.as_str()),
                _ => None,
            });
            let Some(next) = next else { break };
            if let Some(seen) = chain.iter().find(|n| same_name(n, next)) {
                return Err(WireError::CnameLoop { name: self.qname.clone(), at: (*seen).to_owned() });
            }
            if chain.len() > MAX_CNAME_DEPTH {
                return Err(WireError::CnameChainTooLong { name: self.qname.clone() });
            }
            chain.push(next);
        }

        let mut out: Vec<IpAddr> = Vec::new();
        for record in &self.answers {
            let ip = match (&record.data, self.qtype) {
                (RData::A(ip), TYPE_A) => IpAddr::V4(*ip),
                (RData::Aaaa(ip), TYPE_AAAA) => IpAddr::V6(*ip),
                _ => continue,
            };
            if chain.iter().any(|n| same_name(n, &record.name)) && !out.contains(&ip) {
                out.push(ip);
            }
        }
        Ok(out)
    }
}

/// Encodes a standard query for `name` with recursion desired.
///
/// The name is checked first (printable ASCII, labels of 1-63 bytes, at most 253 characters,
/// one optional trailing dot), so a name DNS cannot carry is an error and no message exists to
/// be sent. It is always encoded as a fully qualified name: there are no search domains.
pub fn encode_query(id: u16, name: &str, qtype: RecordType) -> Result<Vec<u8>, WireError> {
    let labels = name_labels(name, Text::Plain)?;
    let mut w = Writer::new();
    w.header(id, FLAG_RD, 1, 0);
    w.name(&labels);
    w.u16(qtype.code());
    w.u16(CLASS_IN);
    Ok(w.buf)
}

/// Checks that `msg` is the reply to the query `id` for `name`/`qtype`, reading only the header
/// and the question.
///
/// A datagram that fails this check is not the reply and is ignored by the resolver (it may be
/// a stale reply or a spoofing attempt); one that passes and then fails [`parse_response`] is a
/// broken reply from the nameserver. Names compare case-insensitively (RFC 4343), so servers
/// and forwarders that randomise or preserve case are accepted.
pub fn check_reply(msg: &[u8], id: u16, name: &str, qtype: RecordType) -> Result<(), WireError> {
    let header = Header::parse(msg)?;
    if header.id != id {
        return Err(WireError::IdMismatch { got: header.id, want: id });
    }
    if !header.is_response() {
        return Err(WireError::NotAResponse);
    }
    header.standard_opcode()?;
    if header.qdcount != 1 {
        return Err(WireError::QuestionCount(header.qdcount));
    }
    let mut r = Reader::new(msg, HEADER_LEN);
    let (got_name, got_type) = r.question()?;
    if got_type != qtype.code() || !same_name(&got_name, name) {
        return Err(WireError::QuestionMismatch {
            got_name,
            got_type,
            want_name: name.to_owned(),
            want_type: qtype.code(),
        });
    }
    Ok(())
}

/// Decodes a response: header, its single IN question, and the answer section.
pub fn parse_response(msg: &[u8]) -> Result<Response, WireError> {
    let header = Header::parse(msg)?;
    if !header.is_response() {
        return Err(WireError::NotAResponse);
    }
    header.standard_opcode()?;
    if header.qdcount != 1 {
        return Err(WireError::QuestionCount(header.qdcount));
    }
    let mut r = Reader::new(msg, HEADER_LEN);
    let (qname, qtype) = r.question()?;
    let mut answers = Vec::new();
    for _ in 0..header.ancount {
        if let Some(record) = r.record()? {
            answers.push(record);
        }
    }
    Ok(Response {
        id: header.id,
        truncated: header.flags & FLAG_TC != 0,
        rcode: (header.flags & RCODE_MASK) as u8,
        qname,
        qtype,
        answers,
    })
}

/// Decodes a query as a nameserver receives it: a standard query with one IN question.
pub fn parse_query(msg: &[u8]) -> Result<Question, WireError> {
    let header = Header::parse(msg)?;
    if header.is_response() {
        return Err(WireError::NotAQuery);
    }
    header.standard_opcode()?;
    if header.qdcount != 1 {
        return Err(WireError::QuestionCount(header.qdcount));
    }
    let (name, qtype) = Reader::new(msg, HEADER_LEN).question()?;
    Ok(Question { id: header.id, name, qtype })
}

/// Encodes a nameserver's reply to `q`: the addresses of the question's type (A takes the IPv4
/// ones, AAAA the IPv6 ones, any other type none), each with `ttl` (0 is allowed: rebinding
/// tests use it), and `rcode`.
///
/// Infallible for the fake servers' convenience: if `q.name` cannot be encoded (it was built by
/// hand rather than by [`parse_query`]) the reply is a bare FORMERR header with no question.
pub fn encode_answer(q: &Question, answers: &[IpAddr], ttl: u32, rcode: u8) -> Vec<u8> {
    let records = answers
        .iter()
        .filter_map(|ip| match (ip, q.qtype) {
            (IpAddr::V4(v4), TYPE_A) => Some(RData::A(*v4)),
            (IpAddr::V6(v6), TYPE_AAAA) => Some(RData::Aaaa(*v6)),
            _ => None,
        })
        .map(|data| Record { name: q.name.clone(), ttl, data })
        .collect();
    let response = Response {
        id: q.id,
        truncated: false,
        rcode,
        qname: q.name.clone(),
        qtype: q.qtype,
        answers: records,
    };
    encode_response(&response).unwrap_or_else(|_| {
        let mut w = Writer::new();
        w.header(q.id, FLAG_QR | u16::from(RCODE_FORMERR), 0, 0);
        w.buf
    })
}

/// Encodes any response, compressing repeated name suffixes; the inverse of [`parse_response`].
///
/// Fake servers use it for what [`encode_answer`] cannot say: CNAME chains, the TC bit,
/// records for other names.
pub fn encode_response(response: &Response) -> Result<Vec<u8>, WireError> {
    if response.answers.len() > usize::from(u16::MAX) {
        return Err(WireError::TooManyRecords(response.answers.len()));
    }
    let mut flags = FLAG_QR | FLAG_RD | FLAG_RA | (u16::from(response.rcode) & RCODE_MASK);
    if response.truncated {
        flags |= FLAG_TC;
    }
    let mut w = Writer::new();
    w.header(response.id, flags, 1, response.answers.len() as u16);
    w.name(&name_labels(&response.qname, Text::Escaped)?);
    w.u16(response.qtype);
    w.u16(CLASS_IN);
    for record in &response.answers {
        w.name(&name_labels(&record.name, Text::Escaped)?);
        w.u16(record.data.rtype());
        w.u16(CLASS_IN);
        w.u32(record.ttl);
        let length_at = w.buf.len();
        w.u16(0);
        match &record.data {
            RData::A(ip) => w.buf.extend_from_slice(&ip.octets()),
            RData::Aaaa(ip) => w.buf.extend_from_slice(&ip.octets()),
            RData::Cname(target) => w.name(&name_labels(target, Text::Escaped)?),
            RData::Other { data, .. } => w.buf.extend_from_slice(data),
        }
        let rdlength = w.buf.len() - length_at - 2;
        let rdlength = u16::try_from(rdlength).map_err(|_| WireError::MessageTooLong(w.buf.len()))?;
        w.buf[length_at..length_at + 2].copy_from_slice(&rdlength.to_be_bytes());
    }
    if w.buf.len() > MAX_MESSAGE_LEN {
        return Err(WireError::MessageTooLong(w.buf.len()));
    }
    Ok(w.buf)
}

/// Whether two names in this module's text form are the same DNS name (RFC 4343: ASCII case
/// does not matter; a trailing dot does not either).
pub fn same_name(a: &str, b: &str) -> bool {
    trim_root(a).eq_ignore_ascii_case(trim_root(b))
}

fn trim_root(name: &str) -> &str {
    if name.len() > 1 { name.strip_suffix('.').unwrap_or(name) } else { name }
}

/// Which text a name may be written in: queries take only plain printable ASCII, the server
/// half also takes the `\DDD` escapes its own decoder writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Text {
    Plain,
    Escaped,
}

/// Splits a name into wire labels, enforcing the label and name length limits.
fn name_labels(name: &str, text: Text) -> Result<Vec<Vec<u8>>, WireError> {
    let body = trim_root(name);
    if body.is_empty() || body == "." {
        return Err(WireError::EmptyName);
    }
    let mut labels = Vec::new();
    let mut label = Vec::new();
    let mut chars = body.chars();
    while let Some(ch) = chars.next() {
        match ch {
            '.' => push_label(&mut labels, std::mem::take(&mut label))?,
            '\\' if text == Text::Escaped => label.push(unescape(&mut chars)?),
            c if c.is_ascii_graphic() && c != '\\' => label.push(c as u8),
            c => return Err(WireError::BadCharacter { ch: c }),
        }
    }
    push_label(&mut labels, label)?;
    let wire_len = labels.iter().map(|l| l.len() + 1).sum::<usize>() + 1;
    if wire_len > MAX_NAME_WIRE_LEN {
        return Err(WireError::NameTooLong);
    }
    Ok(labels)
}

fn push_label(labels: &mut Vec<Vec<u8>>, label: Vec<u8>) -> Result<(), WireError> {
    if label.is_empty() {
        return Err(WireError::EmptyLabel);
    }
    if label.len() > MAX_LABEL_LEN {
        return Err(WireError::LabelTooLong { len: label.len() });
    }
    labels.push(label);
    Ok(())
}

/// Reads what follows a `\`: three decimal digits (a byte value) or one ASCII character.
fn unescape(chars: &mut std::str::Chars<'_>) -> Result<u8, WireError> {
    let first = chars.next().ok_or(WireError::BadEscape)?;
    if !first.is_ascii_digit() {
        return if first.is_ascii() && !first.is_ascii_control() {
            Ok(first as u8)
        } else {
            Err(WireError::BadEscape)
        };
    }
    let mut value = u32::from(first as u8 - b'0');
    for _ in 0..2 {
        let digit = chars.next().filter(char::is_ascii_digit).ok_or(WireError::BadEscape)?;
        value = value * 10 + u32::from(digit as u8 - b'0');
    }
    u8::try_from(value).map_err(|_| WireError::BadEscape)
}

/// Appends a decoded label's bytes, escaping any that would read as something else.
fn push_label_text(out: &mut String, label: &[u8]) {
    for &b in label {
        if b.is_ascii_graphic() && b != b'.' && b != b'\\' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("\\{b:03}"));
        }
    }
}

/// The fixed header fields this module looks at.
#[derive(Debug, Clone, Copy)]
struct Header {
    id: u16,
    flags: u16,
    qdcount: u16,
    ancount: u16,
}

impl Header {
    fn parse(msg: &[u8]) -> Result<Header, WireError> {
        let mut r = Reader::new(msg, 0);
        let id = r.u16("the header")?;
        let flags = r.u16("the header")?;
        let qdcount = r.u16("the header")?;
        let ancount = r.u16("the header")?;
        // NSCOUNT and ARCOUNT complete the header; their sections are not read.
        r.take(4, "the header")?;
        Ok(Header { id, flags, qdcount, ancount })
    }

    fn is_response(&self) -> bool {
        self.flags & FLAG_QR != 0
    }

    fn standard_opcode(&self) -> Result<(), WireError> {
        match (self.flags & OPCODE_MASK) >> 11 {
            0 => Ok(()),
            other => Err(WireError::Opcode(other as u8)),
        }
    }
}

/// A bounds-checked cursor over a whole message (names need the whole message for pointers).
struct Reader<'a> {
    msg: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(msg: &'a [u8], pos: usize) -> Reader<'a> {
        Reader { msg, pos }
    }

    fn truncated(&self, what: &'static str) -> WireError {
        WireError::Truncated { what, len: self.msg.len() }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(self.truncated(what))?;
        let bytes = self.msg.get(self.pos..end).ok_or(self.truncated(what))?;
        self.pos = end;
        Ok(bytes)
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn name(&mut self) -> Result<String, WireError> {
        let (name, next) = read_name(self.msg, self.pos)?;
        self.pos = next;
        Ok(name)
    }

    /// A question entry: name and type; the class must be IN.
    fn question(&mut self) -> Result<(String, u16), WireError> {
        let name = self.name()?;
        let qtype = self.u16("the question")?;
        let class = self.u16("the question")?;
        if class != CLASS_IN {
            return Err(WireError::Class(class));
        }
        Ok((name, qtype))
    }

    /// One resource record; `None` for a record of another class, which is skipped.
    fn record(&mut self) -> Result<Option<Record>, WireError> {
        let name = self.name()?;
        let rtype = self.u16("a record header")?;
        let class = self.u16("a record header")?;
        let ttl = self.u32("a record header")?;
        let rdlength = usize::from(self.u16("a record header")?);
        let rdata_at = self.pos;
        let rdata = self.take(rdlength, "record data")?;
        if class != CLASS_IN {
            return Ok(None);
        }
        let fixed = |want: usize| WireError::RdataLength { rtype, len: rdlength, want };
        let data = match rtype {
            TYPE_A => RData::A(Ipv4Addr::from(<[u8; 4]>::try_from(rdata).map_err(|_| fixed(4))?)),
            TYPE_AAAA => RData::Aaaa(Ipv6Addr::from(<[u8; 16]>::try_from(rdata).map_err(|_| fixed(16))?)),
            TYPE_CNAME => {
                let (target, end) = read_name(self.msg, rdata_at)?;
                if end != rdata_at + rdlength {
                    return Err(WireError::RdataLength { rtype, len: rdlength, want: end - rdata_at });
                }
                RData::Cname(target)
            }
            _ => RData::Other { rtype, data: rdata.to_vec() },
        };
        Ok(Some(Record { name, ttl, data }))
    }
}

/// Decodes the name at `start`; returns it and the offset just past it in the original position
/// (after the first pointer, if any).
///
/// Loop-proof by construction: `floor` starts at `start` and every pointer must land strictly
/// below the current floor, which then drops to the pointer's target. Legitimate compression
/// only ever points back at earlier names, so this refuses nothing real; a crafted cycle fails
/// at its first backward-or-sideways step.
fn read_name(msg: &[u8], start: usize) -> Result<(String, usize), WireError> {
    let truncated = || WireError::Truncated { what: "a name", len: msg.len() };
    let mut text = String::new();
    let mut pos = start;
    let mut floor = start;
    let mut resume_at: Option<usize> = None;
    let mut wire_len = 1;
    loop {
        let len = *msg.get(pos).ok_or_else(truncated)?;
        match len & 0xC0 {
            0x00 if len == 0 => break,
            0x00 => {
                let len = usize::from(len);
                let label = msg.get(pos + 1..pos + 1 + len).ok_or_else(truncated)?;
                wire_len += len + 1;
                if wire_len > MAX_NAME_WIRE_LEN {
                    return Err(WireError::NameTooLong);
                }
                if !text.is_empty() {
                    text.push('.');
                }
                push_label_text(&mut text, label);
                pos += 1 + len;
            }
            0xC0 => {
                let low = *msg.get(pos + 1).ok_or_else(truncated)?;
                let target = (usize::from(len & 0x3F) << 8) | usize::from(low);
                if target >= floor {
                    return Err(WireError::BadPointer { at: pos, target });
                }
                resume_at.get_or_insert(pos + 2);
                floor = target;
                pos = target;
            }
            bits => return Err(WireError::BadLabelType { at: pos, bits }),
        }
    }
    if text.is_empty() {
        text.push('.');
    }
    Ok((text, resume_at.unwrap_or(pos + 1)))
}

/// Message builder with suffix compression (RFC 1035 §4.1.4).
struct Writer {
    buf: Vec<u8>,
    /// Name suffixes already written, and where. Matched byte for byte, not case-folded, so a
    /// decoded message reads back with the exact spelling each name was given.
    suffixes: Vec<(Vec<Vec<u8>>, u16)>,
}

impl Writer {
    fn new() -> Writer {
        Writer { buf: Vec::with_capacity(512), suffixes: Vec::new() }
    }

    fn header(&mut self, id: u16, flags: u16, qdcount: u16, ancount: u16) {
        for field in [id, flags, qdcount, ancount, 0, 0] {
            self.u16(field);
        }
    }

    fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    fn name(&mut self, labels: &[Vec<u8>]) {
        for i in 0..labels.len() {
            let suffix = &labels[i..];
            if let Some((_, at)) = self.suffixes.iter().find(|(s, _)| s == suffix) {
                self.u16(0xC000 | at);
                return;
            }
            if self.buf.len() <= MAX_POINTER_TARGET {
                self.suffixes.push((suffix.to_vec(), self.buf.len() as u16));
            }
            self.buf.push(labels[i].len() as u8);
            self.buf.extend_from_slice(&labels[i]);
        }
        self.buf.push(0);
    }
}

#[cfg(test)]
mod tests;
