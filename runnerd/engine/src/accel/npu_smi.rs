//! Parsing `npu-smi info` (readings) and `npu-smi info -m` (identity) by the original's
//! rules (internals §4.2), and joining the two. Pure functions over the tool's text, so
//! every rule is table-tested against the reference fixtures.

use super::{NpuDevice, Num};

/// One chip's identity from `npu-smi info -m`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub card_id: u32,
    pub chip_id: u32,
    pub logic_id: u32,
    /// As printed (`Ascend 910B3`); the join strips the prefix.
    pub chip_name: String,
}

/// `/[A-Za-z]/`: an ASCII letter (a chip name always carries one).
fn has_letter(s: &str) -> bool {
    s.chars().any(|c| c.is_ascii_alphabetic())
}

/// A reading as JavaScript's `Number(text)` reads it, kept only when finite (the original's
/// `parseNumber`): decimals with an optional sign and exponent, `0x`/`0o`/`0b` integers;
/// `NA`, `-`, `inf` and the like are no reading at all.
pub fn js_number(text: &str) -> Option<f64> {
    let t = text.trim();
    if t.is_empty() {
        return None;
    }
    let radix = match t.get(..2) {
        Some("0x" | "0X") => Some(16),
        Some("0o" | "0O") => Some(8),
        Some("0b" | "0B") => Some(2),
        _ => None,
    };
    if let Some(radix) = radix {
        let digits = &t[2..];
        if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        return digits
            .chars()
            .try_fold(0f64, |n, c| Some(n * f64::from(radix) + f64::from(c.to_digit(radix)?)));
    }
    // Rust also reads `inf`/`nan`/`infinity`; JavaScript reads none of those (and its
    // `Infinity` is not finite), so only the characters of a decimal number pass.
    if !t.chars().all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-')) {
        return None;
    }
    t.parse::<f64>().ok().filter(|n| n.is_finite())
}

fn all_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// A board row's first cell: `^(\d+)\s+(\S.*?)\s*$` → (NPU id, name).
fn board_cell(cell: &str) -> Option<(u32, &str)> {
    let digits = cell.len() - cell.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 {
        return None;
    }
    let rest = &cell[digits..];
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let name = rest.trim();
    (!name.is_empty()).then(|| (cell[..digits].parse().ok(), name)).and_then(|(id, n)| Some((id?, n)))
}

/// A chip row's third cell, matched as the original's
/// `^(\S+)\s+(\S+)\s*/\s*(\S+)\s+(\S+)\s*/\s*(\S+)\s*$`
/// (`aiCore  memUsed / memTotal  hbmUsed / hbmTotal`) → (aiCore, hbmUsed, hbmTotal), each a
/// reading only where it is a number. `None` when the cell has another shape. The two
/// separating slashes are tried as the regex's greedy backtracking would: latest first.
fn chip_readings(cell: &str) -> Option<(Option<f64>, Option<f64>, Option<f64>)> {
    let cell = cell.trim();
    let slashes: Vec<usize> = cell.match_indices('/').map(|(i, _)| i).collect();
    for (a, &p1) in slashes.iter().enumerate().rev() {
        let left: Vec<&str> = cell[..p1].split_whitespace().collect();
        if left.len() != 2 {
            continue;
        }
        for &p2 in slashes[a + 1..].iter().rev() {
            let mid: Vec<&str> = cell[p1 + 1..p2].split_whitespace().collect();
            let right: Vec<&str> = cell[p2 + 1..].split_whitespace().collect();
            if mid.len() == 2 && right.len() == 1 {
                return Some((js_number(left[0]), js_number(mid[1]), js_number(right[0])));
            }
        }
    }
    None
}

/// `npu-smi info`: one device per chip row, carrying its board's readings, with
/// `hostIndex = cardId` (the join with `-m` replaces it by the logic id).
pub fn parse_info(text: &str) -> Vec<NpuDevice> {
    struct Board {
        card: u32,
        name: String,
        health: String,
        power: Option<f64>,
        temp: Option<f64>,
    }
    let mut board: Option<Board> = None;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.contains("Process id") {
            break;
        }
        if !line.starts_with('|') {
            continue;
        }
        let parts: Vec<&str> = line.split('|').collect();
        if parts.len() < 2 {
            continue;
        }
        let cells: Vec<&str> = parts[1..parts.len() - 1].iter().map(|c| c.trim()).collect();
        if cells.len() < 3 {
            continue;
        }
        if let Some((card, name)) = board_cell(cells[0]).filter(|(_, n)| has_letter(n)) {
            let t: Vec<&str> = cells[2].split_whitespace().collect();
            let (power, temp) = if t.len() >= 3 { (js_number(t[0]), js_number(t[1])) } else { (None, None) };
            board = Some(Board { card, name: name.to_owned(), health: cells[1].to_owned(), power, temp });
        } else if all_digits(cells[0]) {
            let Some(b) = &board else { continue };
            let Ok(chip) = cells[0].parse::<u32>() else { continue };
            // A chip row whose readings do not parse is still a chip: listed without them.
            let (ai_core, hbm_used, hbm_total) = chip_readings(cells[2]).unwrap_or((None, None, None));
            out.push(NpuDevice {
                ai_core_percent: ai_core.map(Num),
                bus_id: Some(cells[1].to_owned()).filter(|s| !s.is_empty()),
                card_id: Some(b.card),
                chip_id: Some(chip),
                chip_name: b.name.clone(),
                health: b.health.clone(),
                hbm_percent: None,
                hbm_total_mb: hbm_total.map(Num),
                hbm_used_mb: hbm_used.map(Num),
                host_index: b.card,
                power_watts: b.power.map(Num),
                sandbox_usable: false,
                sandbox_unusable_reason: None,
                temperature_celsius: b.temp.map(Num),
            });
        }
    }
    out
}

/// `npu-smi info -m`: columns split on runs of two or more blanks (`/\s{2,}/`: a single
/// tab or space does not split); the Mcu rows (logic id `-`) and rows without a chip name
/// are skipped.
pub fn parse_mapping(text: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    for line in text.split('\n') {
        let cols = split_wide(line.trim());
        if cols.len() < 4 {
            continue;
        }
        let id =
            |c: &str| js_number(c).filter(|n| n.fract() == 0.0 && *n >= 0.0 && *n <= f64::from(u32::MAX));
        let (Some(card_id), Some(chip_id), Some(logic_id)) = (id(cols[0]), id(cols[1]), id(cols[2])) else {
            continue;
        };
        let name = cols[3..].join(" ").trim().to_owned();
        if !has_letter(&name) {
            continue;
        }
        out.push(Mapping {
            card_id: card_id as u32,
            chip_id: chip_id as u32,
            logic_id: logic_id as u32,
            chip_name: name,
        });
    }
    out
}

/// Splits on runs of two or more whitespace characters, dropping empty cells.
fn split_wide(line: &str) -> Vec<&str> {
    let mut cols = Vec::new();
    let mut start = 0;
    let mut run_start: Option<usize> = None;
    let mut run_len = 0;
    for (i, c) in line.char_indices() {
        if c.is_whitespace() {
            if run_start.is_none() {
                run_start = Some(i);
                run_len = 0;
            }
            run_len += 1;
            continue;
        }
        if let Some(r) = run_start.take()
            && run_len >= 2
        {
            cols.push(line[start..r].trim());
            start = i;
        }
    }
    cols.push(line[start..].trim());
    cols.retain(|c| !c.is_empty());
    cols
}

/// `Ascend` and the blanks after it are not part of the chip name (`/^Ascend\s+/`).
pub fn strip_vendor(name: &str) -> &str {
    match name.strip_prefix("Ascend") {
        Some(rest) if rest.starts_with(char::is_whitespace) => rest.trim_start(),
        _ => name,
    }
}

/// Joins readings and identity on (cardId, chipId), in the mapping's order: `hostIndex`
/// becomes the logic id, and a chip listed by `-m` without readings still appears (with
/// an empty health). Without a mapping the readings stand alone (`hostIndex = cardId`).
pub fn join(readings: Vec<NpuDevice>, mapping: &[Mapping]) -> Vec<NpuDevice> {
    if mapping.is_empty() {
        return readings;
    }
    mapping
        .iter()
        .map(|m| {
            let found =
                readings.iter().find(|d| d.card_id == Some(m.card_id) && d.chip_id == Some(m.chip_id));
            let mut d = found.cloned().unwrap_or_else(|| NpuDevice::bare(m.logic_id, String::new()));
            let name = strip_vendor(&m.chip_name);
            if !name.is_empty() {
                d.chip_name = name.to_owned();
            }
            d.card_id = Some(m.card_id);
            d.chip_id = Some(m.chip_id);
            d.host_index = m.logic_id;
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub const INFO_910B3: &str = include_str!("fixtures/npu-smi-info-910b3.txt");
    pub const MAPPING_910B3: &str = "\tNPU ID    Chip ID    Chip Logic ID    Chip Name\n\t0         0          0                Ascend 910B3\n\t0         1          -                Mcu\n\t1         0          1                Ascend 910B3\n\t1         1          -                Mcu\n";

    #[test]
    fn info_of_the_8_card_910b3_host() {
        let d = parse_info(INFO_910B3);
        assert_eq!(d.len(), 2);
        let want0 = serde_json::json!({"aiCorePercent":0,"busId":"0000:C1:00.0","cardId":0,"chipId":0,"chipName":"910B3","health":"OK","hbmTotalMb":65536,"hbmUsedMb":3445,"hostIndex":0,"powerWatts":102.8,"sandboxUsable":false,"temperatureCelsius":45});
        assert_eq!(serde_json::to_value(&d[0]).unwrap(), want0);
        assert!(serde_json::to_string(&d[0]).unwrap().contains("\"aiCorePercent\":0,"), "0, not 0.0");
        assert_eq!(
            (d[1].host_index, d[1].ai_core_percent, d[1].hbm_used_mb),
            (5, Some(Num(12.0)), Some(Num(60156.0)))
        );
        assert_eq!(d[1].bus_id.as_deref(), Some("0000:02:00.0"));
    }

    #[test]
    fn garbage_and_driver_errors_give_nothing() {
        for text in [
            "dcmi model initialized failed\n",
            "",
            "| x | y |\n",
            "| 0 | 0000:C1:00.0 | 30 0 / 0 1024 / 65536 |\n", // a chip row without a board
            "| NPU   Name | Health | Power(W) Temp(C) |\n+====+\n",
        ] {
            assert_eq!(parse_info(text), vec![], "{text:?}");
        }
    }

    #[test]
    fn mapping_rules() {
        let m = parse_mapping(MAPPING_910B3);
        let got: Vec<(u32, u32, &str, u32)> =
            m.iter().map(|m| (m.card_id, m.chip_id, m.chip_name.as_str(), m.logic_id)).collect();
        assert_eq!(got, [(0, 0, "Ascend 910B3", 0), (1, 0, "Ascend 910B3", 1)]);
        let dual = "NPU ID  Chip ID  Chip Logic ID  Chip Name\n0  0  0  Ascend 910C\n0  1  1  Ascend 910C\n0  2  -  Mcu\n1  0  2  Ascend 910C\n1  1  3  Ascend 910C\n";
        let ids: Vec<[u32; 3]> =
            parse_mapping(dual).iter().map(|m| [m.card_id, m.chip_id, m.logic_id]).collect();
        assert_eq!(ids, [[0, 0, 0], [0, 1, 1], [1, 0, 2], [1, 1, 3]]);
        for bad in ["0  0  0  1234", "0  0  0", "x  0  0  Ascend 910B3", "0 0 0 Ascend"] {
            assert_eq!(parse_mapping(bad), vec![], "{bad:?}");
        }
    }

    #[test]
    fn dual_die_910c_readings_and_join() {
        let table = "| 0     910C  | OK | 210.8  52  0 / 0 |\n| 0 | 0000:C1:00.0 | 30 0 / 0 1024 / 65536 |\n| 1 | 0000:C1:00.1 | 70 0 / 0 2048 / 65536 |\n";
        let d = parse_info(table);
        assert_eq!(d.len(), 2);
        assert!(d.iter().all(|d| d.temperature_celsius == Some(Num(52.0)) && d.health == "OK"));
        assert_eq!(
            d.iter().map(|d| d.host_index).collect::<Vec<_>>(),
            [0, 0],
            "readings alone: hostIndex = card"
        );
        let mapping = parse_mapping("0  0  0  Ascend 910C\n0  1  1  Ascend 910C\n0  2  -  Mcu\n");
        let j = join(d, &mapping);
        let got: Vec<(u32, Option<Num>, &str)> =
            j.iter().map(|d| (d.host_index, d.hbm_used_mb, d.chip_name.as_str())).collect();
        assert_eq!(got, [(0, Some(Num(1024.0)), "910C"), (1, Some(Num(2048.0)), "910C")]);
    }

    #[test]
    fn join_keeps_mapped_chips_without_readings_in_the_mappings_order() {
        let readings = parse_info(INFO_910B3); // cards 0 and 5
        // Not sorted by logic id: the original keeps the mapping's order.
        let mapping = parse_mapping("6  0  9  Ascend 310P3\n0  0  3  Ascend 910B3\n5  0  7  Ascend 910B3\n");
        let j = join(readings, &mapping);
        type Row<'a> = (u32, Option<u32>, Option<Num>, &'a str, &'a str);
        let got: Vec<Row> = j
            .iter()
            .map(|d| (d.host_index, d.card_id, d.hbm_used_mb, d.chip_name.as_str(), d.health.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (9, Some(6), None, "310P3", ""),
                (3, Some(0), Some(Num(3445.0)), "910B3", "OK"),
                (7, Some(5), Some(Num(60156.0)), "910B3", "OK")
            ]
        );
        // A chip without readings still carries `health: ""` (the original's `?? ""`).
        let v = serde_json::to_value(&j[0]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"cardId":6,"chipId":0,"chipName":"310P3","health":"","hostIndex":9,"sandboxUsable":false})
        );
    }

    #[test]
    fn a_chip_row_whose_readings_do_not_parse_is_still_listed() {
        let d = parse_info("| 0     910B3  | OK | 1 2 3 |\n| 0 | bus | not / a / reading |\n");
        assert_eq!(d.len(), 1);
        let v = serde_json::to_value(&d[0]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"busId":"bus","cardId":0,"chipId":0,"chipName":"910B3","health":"OK","hostIndex":0,"powerWatts":1,"sandboxUsable":false,"temperatureCelsius":2})
        );
    }

    #[test]
    fn chip_readings_follow_the_originals_pattern() {
        type Want = Option<(Option<f64>, Option<f64>, Option<f64>)>;
        let cases: &[(&str, Want)] = &[
            ("0           0    / 0          3445 / 65536", Some((Some(0.0), Some(3445.0), Some(65536.0)))),
            ("12          0    / 0          60156/ 65536", Some((Some(12.0), Some(60156.0), Some(65536.0)))),
            ("30 0/0 1024/65536", Some((Some(30.0), Some(1024.0), Some(65536.0)))),
            ("NA 0 / 0 NA / 65536", Some((None, None, Some(65536.0)))),
            ("1.5 0 / 0 10.25 / 20", Some((Some(1.5), Some(10.25), Some(20.0)))),
            ("inf 0 / 0 nan / 0x10", Some((None, None, Some(16.0)))),
            // `\S+` may hold a slash: the last workable slashes separate.
            ("0/1 0 / 0 3 / 4", Some((None, Some(3.0), Some(4.0)))),
            ("not / a / reading", None),
            ("1 2 3", None),
            ("0 0 / 0 1 / 2 3", None),
            ("", None),
        ];
        for (cell, want) in cases {
            assert_eq!(&chip_readings(cell), want, "{cell:?}");
        }
    }

    #[test]
    fn numbers_read_as_javascript_number_does_and_only_finite_ones() {
        let cases: &[(&str, Option<f64>)] = &[
            ("102.8", Some(102.8)),
            ("45", Some(45.0)),
            ("-3", Some(-3.0)),
            ("+5", Some(5.0)),
            ("1e3", Some(1000.0)),
            (".5", Some(0.5)),
            ("0x1F", Some(31.0)),
            ("0b11", Some(3.0)),
            ("0o7", Some(7.0)),
            ("NA", None),
            ("-", None),
            ("", None),
            ("inf", None),
            ("Infinity", None),
            ("NaN", None),
            ("1e999", None),
            ("0x", None),
            ("12W", None),
        ];
        for (text, want) in cases {
            assert_eq!(js_number(text), *want, "{text:?}");
        }
    }

    #[test]
    fn mapping_columns_split_only_on_runs_of_two_or_more_blanks() {
        type Case<'a> = (&'a str, &'a [(u32, u32, u32, &'a str)]);
        let cases: &[Case] = &[
            ("\t0         0          0                Ascend 910B3   \n", &[(0, 0, 0, "Ascend 910B3")]),
            ("0 \t0\t 0  Ascend 910B3\n", &[(0, 0, 0, "Ascend 910B3")]),
            // A single tab or space does not separate columns.
            ("0\t0\t0\tAscend 910B3\n", &[]),
            ("0 0 0 Ascend 910B3\n", &[]),
            ("1.0  0  2  Ascend 910C\n", &[(1, 0, 2, "Ascend 910C")]),
            ("0  0  -1  Ascend 910C\n", &[]),
            ("0  0  2  Ascend  910C  rev1\n", &[(0, 0, 2, "Ascend 910C rev1")]),
            ("0  0  2  九一零\n", &[]),
        ];
        for (text, want) in cases {
            let got: Vec<(u32, u32, u32, String)> = parse_mapping(text)
                .into_iter()
                .map(|m| (m.card_id, m.chip_id, m.logic_id, m.chip_name))
                .collect();
            let want: Vec<(u32, u32, u32, String)> =
                want.iter().map(|(a, b, c, n)| (*a, *b, *c, (*n).to_owned())).collect();
            assert_eq!(got, want, "{text:?}");
        }
        let names = ["Ascend 910B3", "Ascend\t910B3", "910B3", "Ascend", "Ascender 1"];
        let stripped: Vec<&str> = names.iter().map(|n| strip_vendor(n)).collect();
        assert_eq!(stripped, ["910B3", "910B3", "910B3", "Ascend", "Ascender 1"]);
    }
}
