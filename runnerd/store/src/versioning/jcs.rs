//! RFC 8785 (JCS) canonical JSON as the original implements it: keys sorted by UTF-16 code
//! units, ECMAScript `JSON.stringify` string escaping and `Number.prototype.toString` numbers.
//! Record digests are taken over these bytes, so any deviation forks the store.

use std::cmp::Ordering;

use serde_json::{Number, Value};

use super::VersionError;

/// The canonical text of `v`. serde_json values cannot hold NaN, infinities or lone
/// surrogates, so the errors of the original's encoder cannot arise from a `Value`.
pub fn canonicalize(v: &Value) -> Result<String, VersionError> {
    let mut out = String::new();
    write_value(&mut out, v)?;
    Ok(out)
}

/// JavaScript's default `sort()` order: UTF-16 code units, not code points or bytes.
pub fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

fn write_value(out: &mut String, v: &Value) -> Result<(), VersionError> {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&number(n)?),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item)?;
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| cmp_utf16(a.0, b.0));
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, k);
                out.push(':');
                write_value(out, item)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

/// A JSON string literal escaped as ECMAScript `JSON.stringify` does (lowercase `\u00xx`).
pub fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Largest integer a JavaScript Number holds exactly; beyond it JS prints the rounded double.
const MAX_SAFE: u64 = 1 << 53;

fn number(n: &Number) -> Result<String, VersionError> {
    if let Some(i) = n.as_i64() {
        if i.unsigned_abs() <= MAX_SAFE {
            return Ok(i.to_string());
        }
    } else if let Some(u) = n.as_u64() {
        if u <= MAX_SAFE {
            return Ok(u.to_string());
        }
    }
    let f = n.as_f64().ok_or(VersionError::NonFinite)?;
    es_number(f)
}

/// ECMAScript `Number.prototype.toString(10)` (ECMA-262 Number::toString): Rust's `{:e}`
/// gives the same shortest round-trip digits, which are then laid out per the spec's cases.
pub fn es_number(f: f64) -> Result<String, VersionError> {
    if !f.is_finite() {
        return Err(VersionError::NonFinite);
    }
    if f == 0.0 {
        return Ok("0".to_string()); // also -0
    }
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp always writes an exponent");
    let exp: i32 = exp.parse().expect("LowerExp writes a decimal exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i32;
    let n = exp + 1;
    let mut out = String::new();
    if f < 0.0 {
        out.push('-');
    }
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        let e = n - 1;
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if e > 0 { '+' } else { '-' });
        out.push_str(&e.abs().to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn spec_vectors() {
        // §7 items 1–3.
        let v = json!({ "z": -0.0, "a": [1e30, 4.50, 2e-3, 1e-27] });
        assert_eq!(canonicalize(&v).unwrap(), r#"{"a":[1e+30,4.5,0.002,1e-27],"z":0}"#);
        let v = json!({ "10": 0, "2": 0 });
        assert_eq!(canonicalize(&v).unwrap(), r#"{"10":0,"2":0}"#);
        let v = json!({ "€": 1, "😀": 2, "\r": 3 });
        assert_eq!(canonicalize(&v).unwrap(), "{\"\\r\":3,\"€\":1,\"😀\":2}");
    }

    #[test]
    fn utf16_order_differs_from_code_points() {
        // U+FF61 sorts after U+1F600 by code point but before it by UTF-16 (0xD83D < 0xFF61).
        let v = json!({ "\u{ff61}": 1, "😀": 2 });
        assert_eq!(canonicalize(&v).unwrap(), "{\"😀\":2,\"\u{ff61}\":1}");
        assert_eq!(cmp_utf16("😀", "\u{ff61}"), Ordering::Less);
    }

    #[test]
    fn numbers() {
        let cases: &[(f64, &str)] = &[
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.5, "-1.5"),
            (4.50, "4.5"),
            (0.002, "0.002"),
            (0.000001, "0.000001"),
            (1e-7, "1e-7"),
            (1.5e-7, "1.5e-7"),
            (1e-27, "1e-27"),
            (123456789012345680000.0, "123456789012345680000"),
            (1e21, "1e+21"),
            (1.25e21, "1.25e+21"),
            (1e30, "1e+30"),
            (0.1, "0.1"),
            (100.0, "100"),
            (123.456, "123.456"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ];
        for (f, text) in cases {
            assert_eq!(es_number(*f).unwrap(), *text, "{f:e}");
        }
        assert!(es_number(f64::NAN).is_err());
        assert!(es_number(f64::INFINITY).is_err());
        // Integers beyond 2^53 print as the double JavaScript would hold.
        assert_eq!(canonicalize(&json!(u64::MAX)).unwrap(), "18446744073709552000");
        assert_eq!(canonicalize(&json!(9007199254740992u64)).unwrap(), "9007199254740992");
        assert_eq!(canonicalize(&json!(-42)).unwrap(), "-42");
    }

    #[test]
    fn strings() {
        let cases: &[(&str, &str)] = &[
            ("a\"b\\c", r#""a\"b\\c""#),
            ("\u{8}\t\n\u{c}\r", r#""\b\t\n\f\r""#),
            ("\u{0}\u{1f}", r#""\u0000\u001f""#),
            ("/\u{7f}\u{2028}\u{2029}é", "\"/\u{7f}\u{2028}\u{2029}é\""),
            ("\u{1b}", r#""\u001b""#),
        ];
        for (s, text) in cases {
            assert_eq!(canonicalize(&json!(s)).unwrap(), *text);
        }
    }

    #[test]
    fn structure_has_no_whitespace() {
        let v = json!({ "b": [true, false, null, {}], "a": [] });
        assert_eq!(canonicalize(&v).unwrap(), r#"{"a":[],"b":[true,false,null,{}]}"#);
    }
}
