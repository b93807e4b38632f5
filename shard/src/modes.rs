//! Training modes and the policies that steer them: the straggler detector (with hysteresis) behind
//! `auto`, and the learning-rate multiplier that follows the number of live workers (Dynamic mini-batch
//! SGD). Pure functions of what they are told; the shard core feeds them and applies their decisions.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// How a shard applies dense gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Every push is applied on arrival (with the rule's staleness correction).
    Async,
    /// Global-batch BSP: one update per step, averaging one gradient from every live worker; workers wait
    /// for the step before pulling again. A worker whose lease expires is dropped from the step.
    Sync,
    /// Global Batch Aggregation: one update per K gradients (K = live workers, the synchronous global
    /// batch), from whichever workers send them; gradients staler than the threshold are dropped.
    Gba,
    /// Bounded staleness: asynchronous, but a worker more than `--ssp-bound` pushes ahead of the slowest
    /// live worker waits.
    Ssp,
    /// `sync` while no worker straggles, `gba` while one does.
    Auto,
}

impl Mode {
    /// Wire code of an active mode (reported in stats).
    pub fn code(self) -> u8 {
        match self {
            Mode::Async => 0,
            Mode::Sync => 1,
            Mode::Gba => 2,
            Mode::Ssp => 3,
            Mode::Auto => 4,
        }
    }

    /// The mode of a wire code.
    pub fn from_code(code: u8) -> Option<Mode> {
        [Mode::Async, Mode::Sync, Mode::Gba, Mode::Ssp, Mode::Auto].into_iter().find(|m| m.code() == code)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

gaps_common::named_variants!(Mode, "mode", String, |m: String| m, {
    Async => "async",
    Sync => "sync",
    Gba => "gba",
    Ssp => "ssp",
    Auto => "auto",
});

/// Settings of the modes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModeConfig {
    /// The configured mode.
    pub mode: Mode,
    /// GBA: gradients more than this many global steps stale are dropped.
    pub gba_threshold: u64,
    /// GBA: pulls read the step in progress as if it were applied now with the gradients it has (see
    /// `docs/stragglers.md`); false: the values of the last applied step (GBA as published).
    pub gba_lookahead: bool,
    /// GBA: a push-pull that leaves the step short waits for it while the missing gradients are expected
    /// from other workers within this fraction of the pusher's own step time (0: never; see
    /// `core::hold`).
    pub gba_hold: f64,
    /// SSP: how many pushes a worker may run ahead of the slowest live worker.
    pub ssp_bound: u64,
    /// Steps over which the learning-rate multiplier moves to a new value; None = 8 × the ratio of the new
    /// value to the current one when growing, and at once when shrinking.
    pub lr_ramp_steps: Option<u64>,
    /// A worker straggles when its compute time exceeds this multiple of the median...
    pub straggler_enter: f64,
    /// ...and stops straggling when it falls below this multiple (hysteresis).
    pub straggler_exit: f64,
    /// Reports a worker needs before the detector judges it.
    pub min_observations: u32,
    /// Consecutive judgments (one per report of the worker) that must agree before a worker becomes a
    /// straggler or stops being one: a few slow steps on a loaded machine change nothing.
    pub straggler_persist: u32,
    /// `auto` stays at least this long in a mode before it switches again.
    pub min_mode_time: std::time::Duration,
    /// Step times are compared with the median worker's or this many milliseconds, whichever is more: a
    /// worker 3 ms slower than a 1 ms median costs a step 3 ms, no reason to give up synchronous training.
    pub straggler_floor_ms: f64,
}

impl Default for ModeConfig {
    fn default() -> Self {
        ModeConfig {
            mode: Mode::Async,
            gba_threshold: 4,
            gba_lookahead: true,
            gba_hold: 0.5,
            ssp_bound: 3,
            lr_ramp_steps: None,
            straggler_enter: 2.0,
            straggler_exit: 1.3,
            min_observations: 3,
            straggler_persist: DEFAULT_STRAGGLER_PERSIST,
            min_mode_time: DEFAULT_MIN_MODE_TIME,
            straggler_floor_ms: DEFAULT_STRAGGLER_FLOOR_MS,
        }
    }
}

/// Default of [`ModeConfig::straggler_persist`].
pub const DEFAULT_STRAGGLER_PERSIST: u32 = 4;
/// Default of [`ModeConfig::straggler_floor_ms`].
pub const DEFAULT_STRAGGLER_FLOOR_MS: f64 = 5.0;
/// Default of [`ModeConfig::min_mode_time`].
pub const DEFAULT_MIN_MODE_TIME: std::time::Duration = std::time::Duration::from_secs(2);
/// Compute times a worker's window holds: the detector judges the window's median, so a burst of fewer
/// than half this many slow steps moves nothing.
pub const DETECTOR_WINDOW: usize = 5;

/// One worker's record: its last [`DETECTOR_WINDOW`] compute times, how many it reported, and how many
/// judgments in a row went against its current standing.
#[derive(Debug, Clone, Default)]
struct WorkerTimes {
    window: std::collections::VecDeque<f64>,
    reports: u32,
    /// Consecutive judgments, since its last report, that said the opposite of its standing.
    against: u32,
    /// Whether the last judgment counted was after a new report (one vote per report).
    fresh: bool,
}

impl WorkerTimes {
    fn median(&self) -> f64 {
        let mut v: Vec<f64> = self.window.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
    }
}

/// Tracks each worker's compute time per step (the median of its last [`DETECTOR_WINDOW`] reports) and who
/// straggles: a worker whose median exceeds `straggler_enter` × the median over workers (or
/// `straggler_floor_ms`, whichever is more) for `straggler_persist` of its reports in a row, until its
/// median stays below `straggler_exit` × for as many.
#[derive(Debug, Clone, Default)]
pub struct StragglerDetector {
    times: BTreeMap<u32, WorkerTimes>,
    stragglers: BTreeSet<u32>,
    /// Why the set of stragglers last changed.
    last_change: Vec<String>,
}

impl StragglerDetector {
    /// Writes everything the detector holds (a backup's copy continues it exactly).
    pub(crate) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        w.u64(self.times.len() as u64);
        for (worker, t) in &self.times {
            w.u32(*worker);
            w.u64(t.window.len() as u64);
            for v in &t.window {
                w.f64(*v);
            }
            w.u32(t.reports);
            w.u32(t.against);
            w.u8(u8::from(t.fresh));
        }
        w.u32s(&self.stragglers.iter().copied().collect::<Vec<_>>());
        w.u64(self.last_change.len() as u64);
        for why in &self.last_change {
            w.str(why);
        }
    }

    /// Reads what [`Self::write_to`] wrote.
    pub(crate) fn read_from(r: &mut crate::checkpoint::Reader<'_>) -> Result<Self, crate::checkpoint::CheckpointError> {
        let corrupt = || crate::checkpoint::CheckpointError::Corrupt("straggler detector".into());
        let mut d = StragglerDetector::default();
        for _ in 0..r.u64()? {
            let worker = r.u32()?;
            let n = r.u64()?;
            if n > DETECTOR_WINDOW as u64 {
                return Err(corrupt());
            }
            let mut window = std::collections::VecDeque::new();
            for _ in 0..n {
                window.push_back(r.f64()?);
            }
            let (reports, against, fresh) = (r.u32()?, r.u32()?, r.u8()? == 1);
            d.times.insert(worker, WorkerTimes { window, reports, against, fresh });
        }
        d.stragglers = r.u32s("stragglers")?.into_iter().collect();
        for _ in 0..r.u64()? {
            d.last_change.push(r.str("straggler reasons")?);
        }
        Ok(d)
    }

    /// Records one step's compute time of `worker`.
    pub fn observe(&mut self, worker: u32, compute_ms: f64) {
        let e = self.times.entry(worker).or_default();
        if e.window.len() == DETECTOR_WINDOW {
            e.window.pop_front();
        }
        e.window.push_back(compute_ms);
        e.reports = e.reports.saturating_add(1);
        e.fresh = true;
    }

    /// Forgets a worker that left.
    pub fn forget(&mut self, worker: u32) {
        self.times.remove(&worker);
        if self.stragglers.remove(&worker) {
            self.last_change = vec![format!("straggler worker {worker} left")];
        }
    }

    /// Re-judges every live worker against the median; returns why the set of stragglers changed, if it
    /// did. Each worker's new report counts once toward the `straggler_persist` judgments in a row.
    pub fn judge(&mut self, live: &BTreeSet<u32>, cfg: &ModeConfig) -> Vec<String> {
        let mut medians: Vec<f64> = self
            .times
            .iter()
            .filter(|(w, t)| live.contains(w) && t.reports >= cfg.min_observations)
            .map(|(_, t)| t.median())
            .collect();
        let mut reasons: Vec<String> = self
            .stragglers
            .iter()
            .filter(|w| !live.contains(w))
            .map(|w| format!("straggler worker {w} left"))
            .collect();
        self.stragglers.retain(|w| live.contains(w));
        if !reasons.is_empty() {
            self.last_change = reasons.clone();
        }
        if medians.len() < 2 {
            return reasons;
        }
        medians.sort_by(f64::total_cmp);
        let median = medians[(medians.len() - 1) / 2].max(cfg.straggler_floor_ms).max(1e-3);
        let persist = cfg.straggler_persist.max(1);
        for (w, t) in &mut self.times {
            if !live.contains(w) || t.reports < cfg.min_observations || !t.fresh {
                continue;
            }
            t.fresh = false;
            let m = t.median();
            let ratio = m / median;
            let straggling = self.stragglers.contains(w);
            let against = if straggling { ratio < cfg.straggler_exit } else { ratio > cfg.straggler_enter };
            t.against = if against { t.against + 1 } else { 0 };
            if t.against < persist {
                continue;
            }
            t.against = 0;
            if straggling {
                self.stragglers.remove(w);
                reasons.push(format!(
                    "worker {w} recovered: {m:.0} ms per step, {ratio:.1}x the median {median:.0} ms, {persist} reports in a row"
                ));
            } else {
                self.stragglers.insert(*w);
                reasons.push(format!(
                    "worker {w} takes {m:.0} ms per step, {ratio:.1}x the median {median:.0} ms, {persist} reports in a row"
                ));
            }
        }
        if !reasons.is_empty() {
            self.last_change = reasons.clone();
        }
        reasons
    }

    /// Why the set of stragglers last changed (empty before it first did).
    pub fn last_change(&self) -> &[String] {
        &self.last_change
    }

    /// The current stragglers.
    pub fn stragglers(&self) -> &BTreeSet<u32> {
        &self.stragglers
    }
}

/// The learning-rate multiplier of the synchronous modes: linear scaling by the live worker count relative
/// to the count at the start, reached by a linear ramp after every change.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrRamp {
    reference: Option<u32>,
    workers: u32,
    from: f64,
    to: f64,
    start: u64,
    len: u64,
}

impl Default for LrRamp {
    fn default() -> Self {
        LrRamp { reference: None, workers: 0, from: 1.0, to: 1.0, start: 0, len: 0 }
    }
}

impl LrRamp {
    /// The multiplier at global step `step`.
    pub fn multiplier(&self, step: u64) -> f64 {
        if self.len == 0 || step >= self.start + self.len {
            return self.to;
        }
        self.from + (self.to - self.from) * (step - self.start) as f64 / self.len as f64
    }

    /// The multiplier the ramp is heading to.
    pub fn target(&self) -> f64 {
        self.to
    }

    /// Training starts: the live count now is the reference (multiplier 1). Later calls change nothing.
    pub fn fix_reference(&mut self) {
        if self.reference.is_none() && self.workers > 0 {
            self.reference = Some(self.workers);
        }
    }

    /// Tells the ramp how many workers are live at `step`. Before training starts this only records the
    /// count; afterwards a change starts a ramp toward live / reference. Returns true when a ramp started.
    pub fn set_workers(&mut self, live: u32, step: u64, ramp_steps: Option<u64>) -> bool {
        if live == 0 || live == self.workers {
            return false;
        }
        let Some(reference) = self.reference else {
            self.workers = live;
            return false;
        };
        let current = self.multiplier(step);
        let target = f64::from(live) / f64::from(reference);
        // The length follows the whole change still ahead (target over where the multiplier is now), so
        // workers that join one by one get the same ramp as a group that joins at once.
        let ratio = target / current.max(f64::MIN_POSITIVE);
        self.from = current;
        self.to = target;
        self.start = step;
        self.len = ramp_steps.unwrap_or(if ratio > 1.0 { (8.0 * ratio).round() as u64 } else { 0 });
        self.workers = live;
        true
    }
}

impl LrRamp {
    /// Appends the ramp to a checkpoint.
    pub(crate) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        w.u64(self.reference.map_or(0, |r| u64::from(r) + 1));
        w.u32(self.workers);
        w.f64(self.from);
        w.f64(self.to);
        w.u64(self.start);
        w.u64(self.len);
    }

    /// Reads a ramp written by [`LrRamp::write_to`].
    pub(crate) fn read_from(r: &mut crate::checkpoint::Reader<'_>) -> Result<Self, crate::checkpoint::CheckpointError> {
        let reference = match r.u64()? {
            0 => None,
            n => Some(
                u32::try_from(n - 1)
                    .map_err(|_| crate::checkpoint::CheckpointError::Corrupt("ramp reference".into()))?,
            ),
        };
        Ok(LrRamp { reference, workers: r.u32()?, from: r.f64()?, to: r.f64()?, start: r.u64()?, len: r.u64()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every worker reports once per round (worker 1 with `slow`), the detector judging after each report.
    fn rounds(d: &mut StragglerDetector, live: &BTreeSet<u32>, n: usize, slow: impl Fn(usize) -> f64) -> Vec<String> {
        let cfg = ModeConfig::default();
        let mut reasons = Vec::new();
        for r in 0..n {
            for w in 0..4 {
                d.observe(w, if w == 1 { slow(r) } else { 100.0 });
                reasons.extend(d.judge(live, &cfg));
            }
        }
        reasons
    }

    #[test]
    fn the_detector_flags_a_slow_worker_after_it_persists_and_clears_it_with_hysteresis() {
        let live: BTreeSet<u32> = (0..4).collect();
        let mut d = StragglerDetector::default();
        // Judged from its 3rd report on; 4 judgments in a row: a straggler at its 6th report, not before.
        rounds(&mut d, &live, 5, |_| 400.0);
        assert!(d.stragglers().is_empty());
        let reasons = rounds(&mut d, &live, 1, |_| 400.0);
        assert_eq!(d.stragglers().iter().copied().collect::<Vec<_>>(), vec![1]);
        assert!(reasons[0].contains("worker 1") && reasons[0].contains("in a row"), "{reasons:?}");
        // Between the thresholds nothing changes (hysteresis) ...
        assert!(rounds(&mut d, &live, 20, |_| 160.0).is_empty());
        assert!(d.stragglers().contains(&1));
        // ... and below the exit threshold it recovers.
        assert_eq!(rounds(&mut d, &live, 20, |_| 105.0).len(), 1);
        assert!(d.stragglers().is_empty());
        // A worker that left is not judged.
        d.observe(9, 1000.0);
        assert!(d.judge(&live, &ModeConfig::default()).is_empty());
    }

    #[test]
    fn bursts_of_slow_steps_on_a_loaded_machine_make_no_straggler() {
        let live: BTreeSet<u32> = (0..4).collect();
        let mut d = StragglerDetector::default();
        // Two slow steps in every five (a worker descheduled now and then): the window's median stays fast.
        assert!(rounds(&mut d, &live, 200, |r| if r % 5 < 2 { 900.0 } else { 100.0 }).is_empty());
        // A burst of three slow steps in a row: three windows in a row see a slow median, not four.
        assert!(rounds(&mut d, &live, 3, |_| 900.0).is_empty(), "{:?}", d.stragglers());
        assert!(rounds(&mut d, &live, 10, |_| 100.0).is_empty());
        assert!(d.stragglers().is_empty());
        // Against a 1 ms median, 4 ms steps are no straggler (under the 5 ms floor × 2), 12 ms ones are.
        let mut fast = StragglerDetector::default();
        let cfg = ModeConfig::default();
        for _ in 0..20 {
            for w in 0..4 {
                fast.observe(w, if w == 1 { 4.0 } else { 1.0 });
                fast.judge(&live, &cfg);
            }
        }
        assert!(fast.stragglers().is_empty());
        for _ in 0..20 {
            fast.observe(1, 12.0);
            fast.judge(&live, &cfg);
        }
        assert!(fast.stragglers().contains(&1));
        // Four in a row are a straggler (the window holds a slow median until two fast reports later).
        rounds(&mut d, &live, 4, |_| 900.0);
        rounds(&mut d, &live, 2, |_| 100.0);
        assert!(d.stragglers().contains(&1));
    }

    #[test]
    fn the_multiplier_ramps_to_the_linearly_scaled_value() {
        let mut r = LrRamp::default();
        assert!(!r.set_workers(2, 0, None), "before training starts counts are only recorded");
        assert!(!r.set_workers(4, 0, None));
        r.fix_reference();
        assert_eq!(r.multiplier(10), 1.0);
        assert!(r.set_workers(8, 100, None));
        // Doubling: 8 × 2 = 16 steps from 1 to 2.
        assert_eq!(r.multiplier(100), 1.0);
        assert!((r.multiplier(108) - 1.5).abs() < 1e-12);
        assert_eq!(r.multiplier(116), 2.0);
        // Shrinking: at once.
        assert!(r.set_workers(2, 200, None));
        assert_eq!(r.multiplier(200), 0.5);
        assert!(r.set_workers(4, 300, Some(10)));
        assert!((r.multiplier(305) - 0.75).abs() < 1e-12);
        assert!("gba".parse::<Mode>().is_ok() && "bsp".parse::<Mode>().is_err());
        assert_eq!(Mode::from_code(Mode::Gba.code()), Some(Mode::Gba));
    }

    #[test]
    fn workers_joining_one_by_one_get_the_ramp_of_a_group() {
        let (mut one_by_one, mut group) = (LrRamp::default(), LrRamp::default());
        for r in [&mut one_by_one, &mut group] {
            r.set_workers(8, 0, None);
            r.fix_reference();
        }
        for live in 9..=64 {
            one_by_one.set_workers(live, 50, None);
        }
        group.set_workers(64, 50, None);
        // 8× growth: 64 steps from 1 to 8 either way.
        for step in [50, 60, 82, 113, 114, 200] {
            assert!((one_by_one.multiplier(step) - group.multiplier(step)).abs() < 1e-9, "step {step}");
        }
        assert_eq!(group.multiplier(114), 8.0);
        assert!(group.multiplier(113) < 8.0);
    }
}
