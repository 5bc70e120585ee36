//! The arithmetic of the figures: percentiles, medians, throughput. Pure functions.

use std::time::Duration;

/// The nearest-rank percentile (`p` in 0..=100) of `sorted`, which must be sorted
/// ascending; `None` when empty. p50 of [1, 2, 3, 4] is 2, p99 of 100 samples is the 99th.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The median of `values` (the mean of the middle two when their count is even); `None`
/// when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// Megabytes (10^6 bytes) per second.
pub fn mb_per_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / 1e6 / took.as_secs_f64().max(1e-9)
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// p50/p90/p99 of one case's round trips, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Latency {
    pub fn of(mut samples: Vec<Duration>) -> Option<Latency> {
        samples.sort();
        let at = |p| percentile(&samples, p).map(ms);
        let mean = ms(samples.iter().sum::<Duration>()) / samples.len().max(1) as f64;
        Some(Latency { p50: at(50.0)?, p90: at(90.0)?, p99: at(99.0)?, mean })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&n| Duration::from_micros(n)).collect()
    }

    #[test]
    fn nearest_rank_percentiles() {
        let four = us(&[1, 2, 3, 4]);
        let hundred: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let cases: &[(&[Duration], f64, Option<u64>)] = &[
            (&four, 50.0, Some(2)),
            (&four, 75.0, Some(3)),
            (&four, 99.0, Some(4)),
            (&four, 0.0, Some(1)),
            (&four, 100.0, Some(4)),
            (&hundred, 50.0, Some(50)),
            (&hundred, 90.0, Some(90)),
            (&hundred, 99.0, Some(99)),
            (&us(&[7]), 99.0, Some(7)),
            (&[], 50.0, None),
        ];
        for (samples, p, want) in cases {
            let got = percentile(samples, *p).map(|d| d.as_micros() as u64);
            assert_eq!(got, *want, "p{p} of {} samples", samples.len());
        }
    }

    #[test]
    fn medians_and_rates() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(mb_per_s(2_000_000, Duration::from_secs(2)), 1.0);
        let l = Latency::of(us(&[400, 100, 300, 200])).unwrap();
        assert_eq!((l.p50, l.p90, l.p99, l.mean), (0.2, 0.4, 0.4, 0.25));
        assert!(Latency::of(Vec::new()).is_none());
    }
}
