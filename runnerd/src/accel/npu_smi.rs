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

fn has_letter(s: &str) -> bool {
    s.chars().any(|c| c.is_alphabetic())
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

/// A chip row's third cell: `aiCore  memUsed / memTotal  hbmUsed / hbmTotal`.
fn chip_readings(cell: &str) -> Option<(Option<f64>, Option<u64>, Option<u64>)> {
    let spaced = cell.replace('/', " / ");
    let t: Vec<&str> = spaced.split_whitespace().collect();
    if t.len() != 7 || t[2] != "/" || t[5] != "/" {
        return None;
    }
    Some((t[0].parse().ok(), t[4].parse().ok(), t[6].parse().ok()))
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
            let (power, temp) =
                if t.len() >= 3 { (t[0].parse().ok(), t[1].parse().ok()) } else { (None, None) };
            board = Some(Board { card, name: name.to_owned(), health: cells[1].to_owned(), power, temp });
        } else if all_digits(cells[0]) {
            let (Some(b), Some((ai_core, hbm_used, hbm_total))) = (&board, chip_readings(cells[2])) else {
                continue;
            };
            let Ok(chip) = cells[0].parse::<u32>() else { continue };
            out.push(NpuDevice {
                ai_core_percent: ai_core.map(Num),
                bus_id: Some(cells[1].to_owned()).filter(|s| !s.is_empty()),
                card_id: Some(b.card),
                chip_id: Some(chip),
                chip_name: b.name.clone(),
                health: Some(b.health.clone()),
                hbm_percent: None,
                hbm_total_mb: hbm_total,
                hbm_used_mb: hbm_used,
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

/// `npu-smi info -m`: columns split on runs of two or more blanks; the Mcu rows (logic id
/// `-`) and rows without a chip name are skipped.
pub fn parse_mapping(text: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    for line in text.lines() {
        let cols = split_wide(line.trim());
        if cols.len() < 4 {
            continue;
        }
        let (Ok(card_id), Ok(chip_id), Ok(logic_id)) =
            (cols[0].parse::<u32>(), cols[1].parse::<u32>(), cols[2].parse::<u32>())
        else {
            continue;
        };
        let name = cols[3..].join(" ");
        if !has_letter(&name) {
            continue;
        }
        out.push(Mapping { card_id, chip_id, logic_id, chip_name: name });
    }
    out
}

/// Splits on tabs and on runs of two or more spaces.
fn split_wide(line: &str) -> Vec<String> {
    let mut cols = Vec::new();
    let mut cur = String::new();
    let mut spaces = 0;
    for c in line.chars() {
        if c == '\t' || (c == ' ' && spaces >= 1) {
            spaces = 2;
            continue;
        }
        if c == ' ' {
            spaces = 1;
            continue;
        }
        if spaces >= 2 && !cur.is_empty() {
            cols.push(std::mem::take(&mut cur));
        } else if spaces == 1 {
            cur.push(' ');
        }
        spaces = 0;
        cur.push(c);
    }
    if !cur.is_empty() {
        cols.push(cur);
    }
    cols
}

/// The `Ascend ` prefix is not part of the chip name.
pub fn strip_vendor(name: &str) -> String {
    name.strip_prefix("Ascend ").unwrap_or(name).trim().to_owned()
}

/// Joins readings and identity on (cardId, chipId): `hostIndex` becomes the logic id, and a
/// chip listed by `-m` without readings still appears. Without a mapping the readings stand
/// alone (`hostIndex = cardId`).
pub fn join(readings: Vec<NpuDevice>, mapping: &[Mapping]) -> Vec<NpuDevice> {
    if mapping.is_empty() {
        return readings;
    }
    let mut out: Vec<NpuDevice> = mapping
        .iter()
        .map(|m| {
            let found =
                readings.iter().find(|d| d.card_id == Some(m.card_id) && d.chip_id == Some(m.chip_id));
            let mut d =
                found.cloned().unwrap_or_else(|| NpuDevice::bare(m.logic_id, strip_vendor(&m.chip_name)));
            d.card_id = Some(m.card_id);
            d.chip_id = Some(m.chip_id);
            d.host_index = m.logic_id;
            d.chip_name = strip_vendor(&m.chip_name);
            d
        })
        .collect();
    out.sort_by_key(|d| d.host_index);
    out
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
            (5, Some(Num(12.0)), Some(60156))
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
            "| 0     910B3  | OK | 1 2 3 |\n| 0 | bus | not / a / reading |\n",
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
        assert!(
            d.iter().all(|d| d.temperature_celsius == Some(Num(52.0)) && d.health.as_deref() == Some("OK"))
        );
        assert_eq!(
            d.iter().map(|d| d.host_index).collect::<Vec<_>>(),
            [0, 0],
            "readings alone: hostIndex = card"
        );
        let mapping = parse_mapping("0  0  0  Ascend 910C\n0  1  1  Ascend 910C\n0  2  -  Mcu\n");
        let j = join(d, &mapping);
        let got: Vec<(u32, Option<u64>, &str)> =
            j.iter().map(|d| (d.host_index, d.hbm_used_mb, d.chip_name.as_str())).collect();
        assert_eq!(got, [(0, Some(1024), "910C"), (1, Some(2048), "910C")]);
    }

    #[test]
    fn join_keeps_mapped_chips_without_readings_and_renames_by_logic_id() {
        let readings = parse_info(INFO_910B3); // cards 0 and 5
        let mapping = parse_mapping("0  0  3  Ascend 910B3\n5  0  7  Ascend 910B3\n6  0  9  Ascend 310P3\n");
        let j = join(readings, &mapping);
        let got: Vec<(u32, Option<u32>, Option<u64>, &str)> =
            j.iter().map(|d| (d.host_index, d.card_id, d.hbm_used_mb, d.chip_name.as_str())).collect();
        assert_eq!(
            got,
            [
                (3, Some(0), Some(3445), "910B3"),
                (7, Some(5), Some(60156), "910B3"),
                (9, Some(6), None, "310P3")
            ]
        );
    }
}
