//! Measured straggler profiles: `gaps sim --profile step_times.csv` replays a real cluster's per-worker
//! times per step instead of the Gamma model.
//!
//! The file is what `gaps-worker --step-log` and `gaps local --step-log` write: one line per step,
//! `worker,seconds`, with an optional `worker,seconds` header; blank lines and lines starting with `#` are
//! skipped. The profile keeps each worker's measured times, in the order of their worker ids. Simulated
//! worker `w` replays profiled worker `w mod K` (K workers in the file): each of its batches takes a time
//! drawn uniformly, with the run's seed, from that worker's measurements (a bootstrap of its distribution),
//! so a sweep over more workers than were measured repeats the measured mix of fast and slow machines.

use anyhow::{bail, Context, Result};
use gaps_common::rng::Rng;
use std::collections::BTreeMap;
use std::path::Path;

/// Lines longer than this are refused (a step log's lines are a few dozen bytes).
const MAX_LINE: usize = 256;

/// Per-worker measured times per step, in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// (worker id from the file, its times), by worker id.
    workers: Vec<(u64, Vec<f64>)>,
}

/// One profiled worker's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerTimes {
    /// The worker id in the file.
    pub worker: u64,
    /// Steps measured.
    pub steps: usize,
    /// Mean seconds per step.
    pub mean: f64,
    /// Median seconds per step.
    pub median: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Profile {
    /// Reads a step log.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the profile {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in the profile {}", path.display()))
    }

    /// Parses a step log's text; every bad line is an error naming its line number.
    pub fn parse(text: &str) -> Result<Self> {
        let mut by_worker: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.len() > MAX_LINE {
                bail!("line {line_no}: {} bytes, longer than a step log's lines ({MAX_LINE} at most)", line.len());
            }
            let mut fields = line.split(',').map(str::trim);
            let (Some(w), Some(s), None) = (fields.next(), fields.next(), fields.next()) else {
                bail!("line {line_no}: expected `worker,seconds`, got {line:?}");
            };
            if i == 0 && w.eq_ignore_ascii_case("worker") && s.eq_ignore_ascii_case("seconds") {
                continue;
            }
            let worker: u64 = w.parse().with_context(|| format!("line {line_no}: {w:?} is not a worker id"))?;
            let seconds: f64 =
                s.parse().with_context(|| format!("line {line_no}: {s:?} is not a number of seconds"))?;
            if !(seconds.is_finite() && seconds > 0.0) {
                bail!("line {line_no}: a step takes a positive, finite time, got {seconds}");
            }
            by_worker.entry(worker).or_default().push(seconds);
        }
        if by_worker.is_empty() {
            bail!("no step times (expected lines `worker,seconds`)");
        }
        Ok(Profile { workers: by_worker.into_iter().collect() })
    }

    /// Profiled workers.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// True when no worker was profiled (never, for a parsed profile).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The time of one batch of simulated worker `slot`: a draw from profiled worker `slot mod K`.
    pub fn draw(&self, slot: usize, rng: &mut Rng) -> f64 {
        let times = &self.workers[slot % self.workers.len()].1;
        times[rng.below(times.len() as u64) as usize]
    }

    /// Mean time per step over every measured step.
    pub fn mean(&self) -> f64 {
        let (sum, n) =
            self.workers.iter().fold((0.0, 0usize), |(s, n), (_, t)| (s + t.iter().sum::<f64>(), n + t.len()));
        sum / n.max(1) as f64
    }

    /// Each profiled worker's figures, by worker id.
    pub fn summary(&self) -> Vec<WorkerTimes> {
        self.workers
            .iter()
            .map(|(worker, times)| {
                let mut sorted = times.clone();
                sorted.sort_by(f64::total_cmp);
                let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
                WorkerTimes {
                    worker: *worker,
                    steps: times.len(),
                    mean: times.iter().sum::<f64>() / times.len() as f64,
                    median: at(0.5),
                    p99: at(0.99),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_step_log_and_replays_each_worker() {
        let text = "worker,seconds\n0,0.010\n1,0.040\n\n# a comment\n0,0.012\n1,0.044\n0,0.011\n";
        let p = Profile::parse(text).expect("a valid log");
        assert_eq!(p.len(), 2);
        let s = p.summary();
        assert_eq!((s[0].worker, s[0].steps, s[1].steps), (0, 3, 2));
        assert!((s[0].mean - 0.011).abs() < 1e-12 && (s[1].median - 0.044).abs() < 1e-12, "{s:?}");
        let mut rng = Rng::new(7);
        // Slot 3 replays worker 1 (3 mod 2): every draw is one of its two measurements.
        for _ in 0..100 {
            let t = p.draw(3, &mut rng);
            assert!(t == 0.040 || t == 0.044, "{t}");
        }
        let drawn: Vec<f64> = (0..200).map(|_| p.draw(0, &mut rng)).collect();
        for v in [0.010, 0.011, 0.012] {
            assert!(drawn.contains(&v), "the bootstrap never drew {v}");
        }
    }

    #[test]
    fn refuses_bad_lines_with_their_number() {
        for (text, needle) in [
            ("0,0.1\n1;0.2\n", "line 2"),
            ("0,0.1\nx,0.2\n", "not a worker id"),
            ("0,abc\n", "not a number"),
            ("0,-1\n", "positive"),
            ("0,NaN\n", "positive"),
            ("0,inf\n", "positive"),
            ("0,0.1,3\n", "expected `worker,seconds`"),
            ("worker,seconds\n", "no step times"),
            ("", "no step times"),
            ("1,0.1\nworker,seconds\n", "line 2"),
        ] {
            let err = format!("{:#}", Profile::parse(text).expect_err("a bad log"));
            assert!(err.contains(needle), "{text:?}: {err}");
        }
        let long = format!("0,{}\n", "1".repeat(300));
        assert!(format!("{:#}", Profile::parse(&long).expect_err("a long line")).contains("longer"));
    }
}
