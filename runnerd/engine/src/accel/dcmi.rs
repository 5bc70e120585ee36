//! Machine state from the Ascend driver's DCMI library (R-NPU-4), loaded with `dlopen` from
//! a configurable path: no host Python, nothing compiled against the driver. The original
//! ran a Python ctypes script; the calls and units are the same (internals §4.2): one
//! `dcmi_init`, the card list, then per chip its logic id, chip name, health, AI-core and
//! HBM utilisation, temperature, power (tenths of a watt) and HBM size/usage (MB).
//!
//! Any failure of the library, its initialisation or the card list yields an error, and the
//! caller falls back to `npu-smi`. The library stays loaded for the life of the process
//! (vendor libraries are not written to be unloaded); calls are serialized.

use std::ffi::{CStr, CString, c_int, c_uint, c_ulonglong, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::{NpuDevice, Num};

/// The driver's library, where the original loads it from.
pub const DEFAULT_LIBRARY: &str = "/usr/local/Ascend/driver/lib64/driver/libdcmi.so";
/// `dcmi_get_card_num_list` is asked for at most this many cards.
pub const MAX_CARDS: usize = 64;
const UTIL_AICORE: c_int = 2;
const UTIL_HBM: c_int = 6;

/// One chip as DCMI reports it (also the JSON form the tests feed the translation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DcmiChip {
    pub card_id: u32,
    pub chip_id: u32,
    pub logic_id: u32,
    pub chip_name: String,
    /// 0 is healthy.
    pub health: Option<u32>,
    pub ai_core_percent: Option<u32>,
    pub hbm_percent: Option<u32>,
    pub temperature: Option<i32>,
    pub power_deciwatts: Option<i32>,
    pub hbm_total_mb: Option<u64>,
    pub hbm_used_mb: Option<u64>,
}

impl DcmiChip {
    /// The inventory's form: health 0 → `OK`, else `Alarm`; power in watts.
    pub fn to_device(&self) -> NpuDevice {
        // The name as the driver gives it (the original strips no prefix here).
        let mut d = NpuDevice::bare(self.logic_id, self.chip_name.clone());
        d.card_id = Some(self.card_id);
        d.chip_id = Some(self.chip_id);
        d.health = match self.health {
            Some(0) => "OK".to_owned(),
            Some(_) => "Alarm".to_owned(),
            None => String::new(),
        };
        d.ai_core_percent = self.ai_core_percent.map(|v| Num(f64::from(v)));
        d.hbm_percent = self.hbm_percent.map(|v| Num(f64::from(v)));
        d.temperature_celsius = self.temperature.map(|v| Num(f64::from(v)));
        d.power_watts = self.power_deciwatts.map(|v| Num(f64::from(v) / 10.0));
        d.hbm_total_mb = self.hbm_total_mb.map(|v| Num(v as f64));
        d.hbm_used_mb = self.hbm_used_mb.map(|v| Num(v as f64));
        d
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DcmiError {
    #[error("the DCMI library {path} could not be loaded: {reason}")]
    Load { path: String, reason: String },
    #[error("the DCMI library has no symbol {0}")]
    Symbol(&'static str),
    #[error("another DCMI read is still running")]
    Busy,
    #[error("DCMI call {call} failed with code {code}")]
    Call { call: &'static str, code: i32 },
}

type InitFn = unsafe extern "C" fn() -> c_int;
type CardListFn = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type DevNumFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type LogicIdFn = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type ChipInfoFn = unsafe extern "C" fn(c_int, c_int, *mut ChipInfo) -> c_int;
type UintFn = unsafe extern "C" fn(c_int, c_int, *mut c_uint) -> c_int;
type UtilFn = unsafe extern "C" fn(c_int, c_int, c_int, *mut c_uint) -> c_int;
type IntFn = unsafe extern "C" fn(c_int, c_int, *mut c_int) -> c_int;
type HbmFn = unsafe extern "C" fn(c_int, c_int, *mut HbmInfo) -> c_int;

/// `struct dcmi_chip_info_v2`: chip_type[32], chip_name[32], chip_ver[32], aicore_cnt,
/// npu_name[32]; with spare room should a driver write a longer struct.
#[repr(C)]
struct ChipInfo {
    chip_type: [u8; 32],
    chip_name: [u8; 32],
    chip_ver: [u8; 32],
    aicore_cnt: c_uint,
    npu_name: [u8; 32],
    spare: [u8; 512],
}

/// `struct dcmi_hbm_info`, with spare room.
#[repr(C)]
struct HbmInfo {
    memory_size: c_ulonglong,
    freq: c_uint,
    memory_usage: c_ulonglong,
    temp: c_int,
    bandwith_util_rate: c_uint,
    spare: [u8; 256],
}

/// DCMI is not documented as thread-safe: one reader at a time.
static CALLS: Mutex<()> = Mutex::new(());

struct Library(*mut c_void);

impl Library {
    fn open(path: &Path) -> Result<Library, DcmiError> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| DcmiError::Load {
            path: path.display().to_string(),
            reason: "the path contains a NUL byte".into(),
        })?;
        // SAFETY: a valid C string; the handle is never closed (see the module comment).
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a thread-local message or NULL.
            let err = unsafe { libc::dlerror() };
            let reason = if err.is_null() {
                "unknown error".to_owned()
            } else {
                // SAFETY: non-NULL dlerror results are NUL-terminated strings.
                unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned()
            };
            return Err(DcmiError::Load { path: path.display().to_string(), reason });
        }
        Ok(Library(handle))
    }

    /// The symbol `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be the symbol's real C signature.
    unsafe fn get<F: Copy>(&self, name: &'static str) -> Result<F, DcmiError> {
        let c = CString::new(name).map_err(|_| DcmiError::Symbol(name))?;
        // SAFETY: the handle is a live dlopen handle and `c` a valid C string.
        let sym = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        if sym.is_null() {
            return Err(DcmiError::Symbol(name));
        }
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: the caller names the symbol's real signature; F is a function pointer
        // type of pointer size (asserted above).
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&sym) })
    }
}

fn check(call: &'static str, code: c_int) -> Result<(), DcmiError> {
    if code == 0 { Ok(()) } else { Err(DcmiError::Call { call, code }) }
}

fn c_name(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Reads every chip through the library at `path`. Blocking: call it off the runtime.
pub fn read(path: &Path) -> Result<Vec<DcmiChip>, DcmiError> {
    // A read still running (a wedged driver call past its caller's timeout) is not queued
    // behind: this caller falls back to npu-smi instead.
    let _one = match CALLS.try_lock() {
        Ok(guard) => guard,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return Err(DcmiError::Busy),
    };
    let lib = Library::open(path)?;
    let api = Api::load(&lib)?;
    // SAFETY: no arguments.
    check("dcmi_init", unsafe { (api.init)() })?;
    let mut count: c_int = 0;
    let mut cards = [0 as c_int; MAX_CARDS];
    // SAFETY: `cards` has room for MAX_CARDS entries, the length we pass.
    check("dcmi_get_card_num_list", unsafe {
        (api.card_list)(&mut count, cards.as_mut_ptr(), MAX_CARDS as c_int)
    })?;
    let count = usize::try_from(count).unwrap_or(0).min(MAX_CARDS);
    let mut chips = Vec::new();
    for &card in &cards[..count] {
        let mut n: c_int = 0;
        // A card that does not answer is skipped, not the whole read (as the original).
        // SAFETY: one out-parameter we own.
        if unsafe { (api.dev_num)(card, &mut n) } != 0 {
            continue;
        }
        for chip in 0..n.max(0) {
            let mut logic: c_int = -1;
            // A chip without a logic id has no device node: skipped, not the whole read.
            // SAFETY: one out-parameter we own.
            if unsafe { (api.logic_id)(&mut logic, card, chip) } != 0 {
                continue;
            }
            let Ok(logic) = u32::try_from(logic) else { continue };
            chips.push(api.chip(card, chip, logic));
        }
    }
    Ok(chips)
}

/// The DCMI calls a read makes, looked up in a [`Library`] that outlives them.
struct Api {
    init: InitFn,
    card_list: CardListFn,
    dev_num: DevNumFn,
    logic_id: LogicIdFn,
    chip_info: ChipInfoFn,
    health: UintFn,
    util: UtilFn,
    temp: IntFn,
    power: IntFn,
    hbm: HbmFn,
}

impl Api {
    fn load(lib: &Library) -> Result<Api, DcmiError> {
        // SAFETY: each type is the DCMI API's documented C signature of its symbol.
        unsafe {
            Ok(Api {
                init: lib.get::<InitFn>("dcmi_init")?,
                card_list: lib.get::<CardListFn>("dcmi_get_card_num_list")?,
                dev_num: lib.get::<DevNumFn>("dcmi_get_device_num_in_card")?,
                logic_id: lib.get::<LogicIdFn>("dcmi_get_device_logic_id")?,
                chip_info: lib.get::<ChipInfoFn>("dcmi_get_device_chip_info_v2")?,
                health: lib.get::<UintFn>("dcmi_get_device_health")?,
                util: lib.get::<UtilFn>("dcmi_get_device_utilization_rate")?,
                temp: lib.get::<IntFn>("dcmi_get_device_temperature")?,
                power: lib.get::<IntFn>("dcmi_get_device_power_info")?,
                hbm: lib.get::<HbmFn>("dcmi_get_device_hbm_info")?,
            })
        }
    }

    /// One chip's name and readings; a call that fails leaves its field empty.
    fn chip(&self, card: c_int, chip: c_int, logic: u32) -> DcmiChip {
        // SAFETY: all-zero bytes are a valid ChipInfo (arrays and integers).
        let mut info: ChipInfo = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is at least as large as the library's struct.
        let name = if unsafe { (self.chip_info)(card, chip, &mut info) } == 0 {
            c_name(&info.chip_name)
        } else {
            String::new()
        };
        let (mut health_v, mut ai_v, mut hbm_v): (c_uint, c_uint, c_uint) = (0, 0, 0);
        let (mut temp_v, mut power_v): (c_int, c_int) = (0, 0);
        // SAFETY: one out-parameter we own.
        let health = (unsafe { (self.health)(card, chip, &mut health_v) } == 0).then_some(health_v);
        // SAFETY: one out-parameter we own.
        let ai_core = (unsafe { (self.util)(card, chip, UTIL_AICORE, &mut ai_v) } == 0).then_some(ai_v);
        // SAFETY: one out-parameter we own.
        let hbm_pct = (unsafe { (self.util)(card, chip, UTIL_HBM, &mut hbm_v) } == 0).then_some(hbm_v);
        // SAFETY: one out-parameter we own.
        let temperature = (unsafe { (self.temp)(card, chip, &mut temp_v) } == 0).then_some(temp_v);
        // SAFETY: one out-parameter we own.
        let power_dw = (unsafe { (self.power)(card, chip, &mut power_v) } == 0).then_some(power_v);
        // SAFETY: all-zero bytes are a valid HbmInfo.
        let mut h: HbmInfo = unsafe { std::mem::zeroed() };
        // SAFETY: `h` is at least as large as the library's struct.
        let hbm_ok = unsafe { (self.hbm)(card, chip, &mut h) } == 0;
        DcmiChip {
            card_id: u32::try_from(card).unwrap_or(0),
            chip_id: u32::try_from(chip).unwrap_or(0),
            logic_id: logic,
            chip_name: name,
            health,
            ai_core_percent: ai_core,
            hbm_percent: hbm_pct,
            temperature,
            power_deciwatts: power_dw,
            hbm_total_mb: hbm_ok.then_some(h.memory_size),
            hbm_used_mb: hbm_ok.then_some(h.memory_usage),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fake DCMI answer of the reference (two 910C dies on card 0).
    const FAKE_JSON: &str = r#"[
      {"cardId":0,"chipId":0,"logicId":0,"chipName":"910C","health":0,"aiCorePercent":30,"hbmPercent":12,
       "temperature":52,"powerDeciwatts":1039,"hbmTotalMb":65536,"hbmUsedMb":1024},
      {"cardId":0,"chipId":1,"logicId":1,"chipName":"Ascend 910C","health":1,"aiCorePercent":70,"hbmPercent":null,
       "temperature":53,"powerDeciwatts":1388,"hbmTotalMb":65536,"hbmUsedMb":2048}
    ]"#;

    #[test]
    fn translation_of_the_fake_dcmi_answer() {
        let chips: Vec<DcmiChip> = serde_json::from_str(FAKE_JSON).unwrap();
        let d: Vec<NpuDevice> = chips.iter().map(DcmiChip::to_device).collect();
        assert_eq!(d[0].power_watts, Some(Num(103.9)));
        assert_eq!(d[1].power_watts, Some(Num(138.8)));
        assert_eq!(d.iter().map(|d| d.health.as_str()).collect::<Vec<_>>(), ["OK", "Alarm"]);
        assert_eq!(d[1].chip_name, "Ascend 910C", "the driver's name as given, no prefix stripped");
        assert_eq!(d[1].hbm_percent, None);
        let v = serde_json::to_value(&d[0]).unwrap();
        assert_eq!(v["hostIndex"], 0);
        assert_eq!(v["hbmUsedMb"], 1024);
        assert_eq!(v["aiCorePercent"], 30);
        assert!(serde_json::to_string(&d[0]).unwrap().contains("\"powerWatts\":103.9"));
    }

    /// [`read`] refuses to queue behind a read in progress (`Busy`), and the tests of this
    /// crate run in parallel (any of them may list chips): wait for the other one here.
    fn read_when_free(path: &Path) -> Result<Vec<DcmiChip>, DcmiError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match read(path) {
                Err(DcmiError::Busy) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                other => return other,
            }
        }
    }

    #[test]
    fn a_missing_library_is_an_error_to_fall_back_from() {
        let e = read_when_free(Path::new("/nonexistent/libdcmi.so")).unwrap_err();
        assert!(matches!(e, DcmiError::Load { .. }), "{e}");
    }

    /// The real dlopen path against a fake libdcmi.so built here with `cc`.
    #[test]
    fn reads_a_fake_libdcmi_through_dlopen() {
        let dir = tempfile::tempdir().unwrap();
        let lib = super::super::test_support::build_fake_dcmi(dir.path());
        let chips = read_when_free(&lib).unwrap();
        // Card 1 (no chip count) and card 0's third chip (no logic id) are skipped, not
        // the whole read; card 2's chip has no name or health: both read as "".
        assert_eq!(chips.len(), 3);
        let d: Vec<NpuDevice> = chips.iter().map(DcmiChip::to_device).collect();
        type Row<'a> = (u32, &'a str, &'a str, Option<Num>, Option<Num>);
        let got: Vec<Row> = d
            .iter()
            .map(|d| (d.host_index, d.chip_name.as_str(), d.health.as_str(), d.power_watts, d.hbm_used_mb))
            .collect();
        assert_eq!(
            got,
            [
                (4, "910C", "OK", Some(Num(103.9)), Some(Num(1024.0))),
                (5, "910C", "Alarm", Some(Num(138.8)), Some(Num(2048.0))),
                (7, "", "", Some(Num(103.9)), Some(Num(1024.0)))
            ]
        );
        let v = serde_json::to_value(&d[2]).unwrap();
        assert_eq!((&v["health"], &v["chipName"]), (&serde_json::json!(""), &serde_json::json!("")));
        assert_eq!(d[0].ai_core_percent, Some(Num(30.0)));
        assert_eq!(d[0].hbm_percent, Some(Num(50.0)));
        assert_eq!(d[0].hbm_total_mb, Some(Num(65536.0)));
        assert_eq!(d[0].temperature_celsius, Some(Num(52.0)));
    }
}
