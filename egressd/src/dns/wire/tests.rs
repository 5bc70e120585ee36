use super::*;

fn a(s: &str) -> RData {
    RData::A(s.parse().unwrap())
}

fn aaaa(s: &str) -> RData {
    RData::Aaaa(s.parse().unwrap())
}

fn cname(s: &str) -> RData {
    RData::Cname(s.to_owned())
}

fn rec(name: &str, data: RData) -> Record {
    Record { name: name.to_owned(), ttl: 300, data }
}

fn response(qname: &str, qtype: u16, answers: Vec<Record>) -> Response {
    Response { id: 0x1234, truncated: false, rcode: RCODE_NOERROR, qname: qname.to_owned(), qtype, answers }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// A name of `len` characters made of 63-byte labels (the last one shorter).
fn long_name(len: usize) -> String {
    let mut name = String::new();
    while name.len() < len {
        if !name.is_empty() {
            name.push('.');
        }
        let room = (len - name.len()).min(63);
        name.push_str(&"a".repeat(room));
    }
    name
}

/// A small deterministic generator, so the garbage tests are reproducible.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn dns_encode_query_bytes() {
    let got = encode_query(0xBEEF, "example.com", RecordType::Aaaa).unwrap();
    let want: &[u8] = &[
        0xBE, 0xEF, // id
        0x01, 0x00, // RD only
        0, 1, 0, 0, 0, 0, 0, 0, // one question
        7, b'e', b'x', b'a', b'm', b'p', b'l', b'e', 3, b'c', b'o', b'm', 0, // name, FQDN
        0, 28, // AAAA
        0, 1, // IN
    ];
    assert_eq!(got, want);
}

#[test]
fn dns_query_name_validation_table() {
    let cases: Vec<(String, Result<(), WireError>)> = vec![
        ("example.com".into(), Ok(())),
        ("example.com.".into(), Ok(())),
        ("a".into(), Ok(())),
        ("_srv.x-y.example".into(), Ok(())),
        ("".into(), Err(WireError::EmptyName)),
        (".".into(), Err(WireError::EmptyName)),
        (".example".into(), Err(WireError::EmptyLabel)),
        ("a..example".into(), Err(WireError::EmptyLabel)),
        ("example..".into(), Err(WireError::EmptyLabel)),
        (format!("{}.com", "a".repeat(63)), Ok(())),
        (format!("{}.com", "a".repeat(64)), Err(WireError::LabelTooLong { len: 64 })),
        (long_name(253), Ok(())),
        (format!("{}.", long_name(253)), Ok(())),
        (long_name(254), Err(WireError::NameTooLong)),
        (long_name(1000), Err(WireError::NameTooLong)),
        ("exa mple.com".into(), Err(WireError::BadCharacter { ch: ' ' })),
        ("bücher.example".into(), Err(WireError::BadCharacter { ch: 'ü' })),
        ("a\\046b.example".into(), Err(WireError::BadCharacter { ch: '\\' })),
        ("a\0.example".into(), Err(WireError::BadCharacter { ch: '\0' })),
    ];
    for (name, want) in cases {
        let got = encode_query(1, &name, RecordType::A).map(|_| ());
        assert_eq!(got, want, "{name:?}");
    }
}

#[test]
fn dns_query_round_trip_through_parse_query() {
    for (name, qtype) in [("example.com", RecordType::A), ("www.example.com.", RecordType::Aaaa)] {
        let msg = encode_query(42, name, qtype).unwrap();
        let q = parse_query(&msg).unwrap();
        assert_eq!(q, Question { id: 42, name: name.trim_end_matches('.').to_owned(), qtype: qtype.code() });
        // A query is not a response.
        assert_eq!(parse_response(&msg), Err(WireError::NotAResponse));
    }
}

#[test]
fn dns_parse_query_rejects_responses_and_odd_queries() {
    let q = Question { id: 7, name: "example.com".into(), qtype: TYPE_A };
    assert_eq!(parse_query(&encode_answer(&q, &[], 0, 0)), Err(WireError::NotAQuery));
    let mut msg = encode_query(7, "example.com", RecordType::A).unwrap();
    msg[2] |= 0x28; // opcode 5 (UPDATE)
    assert_eq!(parse_query(&msg), Err(WireError::Opcode(5)));
    let mut msg = encode_query(7, "example.com", RecordType::A).unwrap();
    msg[5] = 2;
    assert!(parse_query(&msg).is_err());
    let mut msg = encode_query(7, "example.com", RecordType::A).unwrap();
    let n = msg.len();
    msg[n - 1] = 3; // class CH
    assert_eq!(parse_query(&msg), Err(WireError::Class(3)));
}

#[test]
fn dns_response_round_trip_with_compression() {
    let original = Response {
        id: 0xABCD,
        truncated: true,
        rcode: RCODE_NOERROR,
        qname: "www.Example.com".into(),
        qtype: TYPE_A,
        answers: vec![
            rec("www.Example.com", cname("cdn.example.com")),
            rec("cdn.example.com", cname("edge.cdn.example.net")),
            rec("edge.cdn.example.net", a("192.0.2.1")),
            rec("edge.cdn.example.net", aaaa("2001:db8::1")),
            Record {
                name: "edge.cdn.example.net".into(),
                ttl: 0,
                data: RData::Other { rtype: 16, data: b"\x05hello".to_vec() },
            },
        ],
    };
    let msg = encode_response(&original).unwrap();
    assert_eq!(parse_response(&msg).unwrap(), original);

    // Repeated suffixes were written as pointers: the message is much shorter than the names.
    let uncompressed: usize = 12
        + original.qname.len()
        + 2
        + 4
        + original.answers.iter().map(|r| r.name.len() + 2 + 10).sum::<usize>();
    assert!(msg.len() < uncompressed, "{} >= {uncompressed}", msg.len());
    assert!(msg.iter().any(|&b| b & 0xC0 == 0xC0));
}

#[test]
fn dns_label_bytes_that_are_not_plain_text_are_escaped() {
    // A label "a.b" (one label with a dot byte) must not read as two labels.
    let mut msg = Writer::new();
    msg.header(1, FLAG_QR, 1, 0);
    msg.name(&[b"a.b".to_vec(), b"\\x\x01".to_vec(), b"com".to_vec()]);
    msg.u16(TYPE_A);
    msg.u16(CLASS_IN);
    let parsed = parse_response(&msg.buf).unwrap();
    assert_eq!(parsed.qname, "a\\046b.\\092x\\001.com");
    assert!(!same_name(&parsed.qname, "a.b.x.com"));
    // The server half re-encodes the escapes to the same bytes.
    assert_eq!(encode_response(&parsed).unwrap()[12..], msg.buf[12..]);
}

#[test]
fn dns_compression_pointer_table() {
    // Header with one question, then a hand-built name region at offset 12.
    fn msg(name: &[u8]) -> Vec<u8> {
        let mut m = vec![0, 1, 0x80, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        m.extend_from_slice(name);
        m.extend_from_slice(&[0, 1, 0, 1]);
        m
    }
    let cases: Vec<(&str, Vec<u8>, Result<&str, WireError>)> = vec![
        ("plain", msg(b"\x01a\x00"), Ok("a")),
        ("pointer to itself", msg(b"\xC0\x0C"), Err(WireError::BadPointer { at: 12, target: 12 })),
        ("forward pointer", msg(b"\xC0\x0E\x01a\x00"), Err(WireError::BadPointer { at: 12, target: 14 })),
        (
            "label then pointer back to its own start",
            msg(b"\x01a\xC0\x0C"),
            Err(WireError::BadPointer { at: 14, target: 12 }),
        ),
        (
            "pointer into the header",
            msg(b"\xC0\x00"),
            // Offset 0 holds 0x00: the root name, which is allowed to be pointed at.
            Ok("."),
        ),
        ("pointer past the end", msg(b"\xFF\xFF"), Err(WireError::BadPointer { at: 12, target: 0x3FFF })),
        ("extended label type", msg(b"\x41a\x00"), Err(WireError::BadLabelType { at: 12, bits: 0x40 })),
        ("reserved label type", msg(b"\x81a\x00"), Err(WireError::BadLabelType { at: 12, bits: 0x80 })),
        ("label runs off the end", msg(b"\x3Fabc"), Err(trunc_name(12 + 4 + 4))),
    ];
    for (what, m, want) in cases {
        let got = parse_response(&m).map(|r| r.qname);
        assert_eq!(got.as_deref().map_err(Clone::clone), want, "{what}");
    }
}

fn trunc_name(len: usize) -> WireError {
    WireError::Truncated { what: "a name", len }
}

#[test]
fn dns_pointer_chains_that_go_backwards_are_followed() {
    // q: "example.com" at 12; answer 1 owner: "www" + ptr(12); answer 2 owner: ptr(answer 1).
    let mut w = Writer::new();
    w.header(9, FLAG_QR, 1, 2);
    w.name(&[b"example".to_vec(), b"com".to_vec()]);
    w.u16(TYPE_A);
    w.u16(CLASS_IN);
    let first_owner = w.buf.len();
    w.buf.extend_from_slice(b"\x03www\xC0\x0C");
    w.buf.extend_from_slice(&[0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 192, 0, 2, 1]);
    w.buf.extend_from_slice(&[0xC0, first_owner as u8]);
    w.buf.extend_from_slice(&[0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 192, 0, 2, 2]);
    let parsed = parse_response(&w.buf).unwrap();
    assert_eq!(parsed.answers[0].name, "www.example.com");
    assert_eq!(parsed.answers[1].name, "www.example.com");
    assert_eq!(parsed.answers[1].data, a("192.0.2.2"));
}

#[test]
fn dns_name_longer_than_255_on_the_wire_is_rejected_when_decoding() {
    // Four 63-byte labels plus one more: 5 * 64 + 1 > 255.
    let mut m = vec![0, 1, 0x80, 0, 0, 1, 0, 0, 0, 0, 0, 0];
    for _ in 0..5 {
        m.push(63);
        m.extend_from_slice(&[b'a'; 63]);
    }
    m.push(0);
    m.extend_from_slice(&[0, 1, 0, 1]);
    assert_eq!(parse_response(&m), Err(WireError::NameTooLong));
}

#[test]
fn dns_every_truncation_is_an_error() {
    let full = encode_response(&Response {
        id: 3,
        truncated: false,
        rcode: 0,
        qname: "a.example".into(),
        qtype: TYPE_A,
        answers: vec![
            rec("a.example", cname("b.example")),
            rec("b.example", a("192.0.2.1")),
            rec("b.example", aaaa("2001:db8::1")),
        ],
    })
    .unwrap();
    assert!(parse_response(&full).is_ok());
    for len in 0..full.len() {
        let cut = &full[..len];
        assert!(parse_response(cut).is_err(), "prefix of {len} bytes parsed");
        if len < 12 + 11 + 4 {
            assert!(check_reply(cut, 3, "a.example", RecordType::A).is_err());
            assert!(parse_query(cut).is_err());
        }
    }
}

#[test]
fn dns_garbage_and_mutations_never_panic() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for _ in 0..20_000 {
        let len = (rng.next() % 96) as usize;
        let mut buf: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if len >= 12 && rng.next() % 2 == 0 {
            // Plausible counts make the parser walk further into the garbage.
            buf[4..12].copy_from_slice(&[0, 1, 0, 3, 0, 0, 0, 0]);
            buf[2] |= 0x80;
        }
        let _ = parse_response(&buf).map(|r| r.addresses());
        let _ = parse_query(&buf);
        let _ = check_reply(&buf, 1, "example.com", RecordType::A);
    }

    let valid = encode_response(&response(
        "www.example.com",
        TYPE_A,
        vec![rec("www.example.com", cname("edge.example.net")), rec("edge.example.net", a("192.0.2.7"))],
    ))
    .unwrap();
    for at in 0..valid.len() {
        for value in [0x00, 0x01, 0x3F, 0x40, 0x7F, 0x80, 0xC0, 0xC0 | 0x0C, 0xFF] {
            let mut m = valid.clone();
            m[at] = value;
            let _ = parse_response(&m).map(|r| r.addresses());
            let _ = parse_query(&m);
        }
    }
}

#[test]
fn dns_check_reply_table() {
    let good = encode_response(&response("www.example.com", TYPE_A, vec![])).unwrap();
    let with = |edit: fn(&mut Vec<u8>)| {
        let mut m = good.clone();
        edit(&mut m);
        m
    };
    let mixed_case = encode_response(&response("WWW.Example.COM", TYPE_A, vec![])).unwrap();
    let other_name = encode_response(&response("www.example.org", TYPE_A, vec![])).unwrap();
    let other_type = encode_response(&response("www.example.com", TYPE_AAAA, vec![])).unwrap();
    let query = encode_query(0x1234, "www.example.com", RecordType::A).unwrap();

    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("the reply", good.clone(), true),
        ("case differs", mixed_case, true),
        ("wrong id", with(|m| m[1] ^= 1), false),
        ("QR clear", with(|m| m[2] &= 0x7F), false),
        ("opcode not QUERY", with(|m| m[2] |= 0x10), false),
        ("no question", with(|m| m[5] = 0), false),
        ("two questions", with(|m| m[5] = 2), false),
        ("other name", other_name, false),
        ("other type", other_type, false),
        ("class CH", with(|m| *m.last_mut().unwrap() = 3), false),
        ("our own query reflected", query, false),
        ("empty", vec![], false),
    ];
    for (what, msg, ok) in cases {
        let got = check_reply(&msg, 0x1234, "www.example.com", RecordType::A);
        assert_eq!(got.is_ok(), ok, "{what}: {got:?}");
    }
}

#[test]
fn dns_cname_chain_table() {
    let chain = |links: usize| -> Vec<Record> {
        let mut records: Vec<Record> = (0..links)
            .map(|i| {
                let owner = if i == 0 { "q.example".to_owned() } else { format!("c{i}.example") };
                rec(&owner, cname(&format!("c{}.example", i + 1)))
            })
            .collect();
        records.push(rec(&format!("c{links}.example"), a("192.0.2.99")));
        records
    };
    type Want = Result<Vec<IpAddr>, WireError>;
    let cases: Vec<(&str, u16, Vec<Record>, Want)> = vec![
        (
            "direct answers in order, duplicates dropped",
            TYPE_A,
            vec![
                rec("q.example", a("192.0.2.2")),
                rec("q.example", a("192.0.2.1")),
                rec("q.example", a("192.0.2.2")),
            ],
            Ok(ips(&["192.0.2.2", "192.0.2.1"])),
        ),
        (
            "chain of two",
            TYPE_A,
            vec![
                rec("q.example", cname("mid.example")),
                rec("mid.example", cname("end.example")),
                rec("end.example", a("192.0.2.3")),
            ],
            Ok(ips(&["192.0.2.3"])),
        ),
        (
            "chain records out of order",
            TYPE_A,
            vec![
                rec("end.example", a("192.0.2.3")),
                rec("mid.example", cname("end.example")),
                rec("q.example", cname("mid.example")),
            ],
            Ok(ips(&["192.0.2.3"])),
        ),
        (
            "owner case differs",
            TYPE_AAAA,
            vec![rec("Q.Example", cname("END.example")), rec("end.EXAMPLE", aaaa("2001:db8::3"))],
            Ok(ips(&["2001:db8::3"])),
        ),
        (
            "records for names off the chain are ignored",
            TYPE_A,
            vec![
                rec("q.example", cname("end.example")),
                rec("bank.example", a("10.0.0.1")),
                rec("end.example", a("192.0.2.3")),
                rec("q.example.evil", a("10.0.0.2")),
            ],
            Ok(ips(&["192.0.2.3"])),
        ),
        (
            "the wrong type is ignored",
            TYPE_A,
            vec![rec("q.example", aaaa("2001:db8::1")), rec("q.example", a("192.0.2.1"))],
            Ok(ips(&["192.0.2.1"])),
        ),
        (
            "chain ends outside the answer",
            TYPE_A,
            vec![rec("q.example", cname("elsewhere.example"))],
            Ok(vec![]),
        ),
        ("eight links", TYPE_A, chain(8), Ok(ips(&["192.0.2.99"]))),
        ("nine links", TYPE_A, chain(9), Err(WireError::CnameChainTooLong { name: "q.example".into() })),
        (
            "loop",
            TYPE_A,
            vec![
                rec("q.example", cname("b.example")),
                rec("b.example", cname("q.example")),
                rec("q.example", a("192.0.2.1")),
            ],
            Err(WireError::CnameLoop { name: "q.example".into(), at: "q.example".into() }),
        ),
        (
            "self loop",
            TYPE_A,
            vec![rec("q.example", cname("Q.example"))],
            Err(WireError::CnameLoop { name: "q.example".into(), at: "q.example".into() }),
        ),
    ];
    for (what, qtype, answers, want) in cases {
        let r = response("q.example", qtype, answers);
        assert_eq!(r.addresses(), want, "{what}");
        // The same holds after a trip over the wire.
        let back = parse_response(&encode_response(&r).unwrap()).unwrap();
        assert_eq!(back.addresses(), want, "{what} (re-parsed)");
    }
}

#[test]
fn dns_bad_rdata_table() {
    let base = |rtype: u16, rdata: &[u8]| {
        let mut w = Writer::new();
        w.header(1, FLAG_QR, 1, 1);
        w.name(&[b"q".to_vec()]);
        w.u16(TYPE_A);
        w.u16(CLASS_IN);
        w.name(&[b"q".to_vec()]);
        w.u16(rtype);
        w.u16(CLASS_IN);
        w.u32(60);
        w.u16(rdata.len() as u16);
        w.buf.extend_from_slice(rdata);
        w.buf
    };
    type Want = Result<Option<RData>, WireError>;
    let cases: Vec<(&str, Vec<u8>, Want)> = vec![
        ("A", base(TYPE_A, &[192, 0, 2, 1]), Ok(Some(a("192.0.2.1")))),
        (
            "A of 5 bytes",
            base(TYPE_A, &[192, 0, 2, 1, 0]),
            Err(WireError::RdataLength { rtype: TYPE_A, len: 5, want: 4 }),
        ),
        (
            "AAAA of 4 bytes",
            base(TYPE_AAAA, &[192, 0, 2, 1]),
            Err(WireError::RdataLength { rtype: TYPE_AAAA, len: 4, want: 16 }),
        ),
        ("CNAME with a pointer", base(TYPE_CNAME, b"\x01x\xC0\x0C"), Ok(Some(cname("x.q")))),
        (
            "CNAME with slack after the name",
            base(TYPE_CNAME, b"\x01x\x00\x00"),
            Err(WireError::RdataLength { rtype: TYPE_CNAME, len: 4, want: 3 }),
        ),
        ("CNAME name runs past its rdata", base(TYPE_CNAME, b"\x01x"), Err(trunc_name(12 + 7 + 12 + 2))),
        (
            "unknown type kept raw",
            base(99, b"xyz"),
            Ok(Some(RData::Other { rtype: 99, data: b"xyz".to_vec() })),
        ),
    ];
    for (what, msg, want) in cases {
        let got = parse_response(&msg).map(|r| r.answers.first().map(|rec| rec.data.clone()));
        assert_eq!(got, want, "{what}");
    }

    // A record of another class is dropped, not an error.
    let mut chaos = base(TYPE_A, &[192, 0, 2, 1]);
    let class_at = 12 + 7 + 2 + 2; // question, owner pointer, type
    chaos[class_at + 1] = 3;
    assert_eq!(parse_response(&chaos).unwrap().answers, vec![]);
}

#[test]
fn dns_encode_answer_filters_by_type() {
    let all = ips(&["192.0.2.1", "2001:db8::1", "192.0.2.2"]);
    let cases: Vec<(u16, Vec<IpAddr>)> =
        vec![(TYPE_A, ips(&["192.0.2.1", "192.0.2.2"])), (TYPE_AAAA, ips(&["2001:db8::1"])), (15, vec![])];
    for (qtype, want) in cases {
        let q = Question { id: 77, name: "host.example".into(), qtype };
        let msg = encode_answer(&q, &all, 0, RCODE_NOERROR);
        let r = parse_response(&msg).unwrap();
        assert_eq!((r.id, r.rcode, r.truncated), (77, RCODE_NOERROR, false));
        assert!(r.answers.iter().all(|rec| rec.ttl == 0));
        let got: Vec<IpAddr> = r
            .answers
            .iter()
            .filter_map(|rec| match rec.data {
                RData::A(ip) => Some(IpAddr::V4(ip)),
                RData::Aaaa(ip) => Some(IpAddr::V6(ip)),
                _ => None,
            })
            .collect();
        assert_eq!(got, want, "qtype {qtype}");
    }

    let q = Question { id: 5, name: "gone.example".into(), qtype: TYPE_A };
    let r = parse_response(&encode_answer(&q, &[], 60, RCODE_NXDOMAIN)).unwrap();
    assert_eq!((r.rcode, r.answers.len()), (RCODE_NXDOMAIN, 0));
    assert!(check_reply(&encode_answer(&q, &[], 60, 0), 5, "gone.example", RecordType::A).is_ok());

    // A hand-built question that cannot be encoded gets a bare FORMERR, not a panic.
    let bad = Question { id: 6, name: "a..b".into(), qtype: TYPE_A };
    let msg = encode_answer(&bad, &[], 0, 0);
    assert_eq!(msg.len(), HEADER_LEN);
    assert_eq!(msg[3] & 0x0F, RCODE_FORMERR);
}

#[test]
fn dns_same_name_table() {
    for (a, b, same) in [
        ("example.com", "EXAMPLE.com", true),
        ("example.com.", "example.com", true),
        ("example.com", "example.co", false),
        ("a\\046b", "a.b", false),
        (".", ".", true),
    ] {
        assert_eq!(same_name(a, b), same, "{a} vs {b}");
    }
}
