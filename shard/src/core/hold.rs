//! GBA's short hold: a push-pull whose gradient did not complete the step is answered once the step
//! completes, when the gradients it still misses are expected from other workers sooner than a fraction of
//! the pusher's own step time — so workers of equal speed compute on the applied step, as in `sync`, while
//! nobody is held for a worker not due within that window (a straggler's gradient rarely is: only when its
//! next push happens to fall inside the window is anyone held for it, and then briefly).
//!
//! The shard predicts when each live worker's next dense push arrives from the times of its last pushes (an
//! average interval), never from a clock the worker reports. A held worker pushes nothing until it is
//! answered, so it is not counted on to fill the step. A wrong prediction costs the held worker at most the
//! hold's bound; the step's content is the same whatever is held (a hold only changes what a pull reads).
//! The state is not checkpointed (a restored shard learns the intervals again within a few pushes); a
//! backup's copy carries it, so that a backup answers every request as its primary did.

use std::collections::BTreeMap;
use std::time::Duration;

/// Weight of a new interval in a worker's average.
const ALPHA: f64 = 0.25;

/// A hold is never longer than this, whatever a worker's step time.
pub const MAX_HOLD: Duration = Duration::from_secs(1);

/// When a worker's dense pushes arrive.
#[derive(Debug, Clone, Copy)]
struct Arrivals {
    last: Duration,
    /// Average time between two of its pushes; None until it has pushed twice.
    interval: Option<f64>,
}

/// The hold's state: per live worker its arrivals, the workers held now (until when), and the hold the
/// last push-pull asked for.
#[derive(Debug, Default)]
pub(crate) struct GbaHold {
    arrivals: BTreeMap<u32, Arrivals>,
    held: BTreeMap<u32, Duration>,
    asked: Option<Duration>,
}

impl GbaHold {
    /// A dense push of `worker` arrived at `now`.
    pub(crate) fn observe(&mut self, worker: u32, now: Duration) {
        self.held.remove(&worker);
        let a = self.arrivals.entry(worker).or_insert(Arrivals { last: now, interval: None });
        if now < a.last {
            // A clock that started again (a copy whose host has been up for less time than its primary's
            // clock): go on from now, keeping the interval.
            a.last = now;
        } else if now > a.last {
            let gap = (now - a.last).as_secs_f64();
            a.interval = Some(a.interval.map_or(gap, |i| i + ALPHA * (gap - i)));
            a.last = now;
        }
    }

    /// `worker` left (lease expired or deregistered).
    pub(crate) fn forget(&mut self, worker: u32) {
        self.arrivals.remove(&worker);
        self.held.remove(&worker);
    }

    /// The step completed: every held worker is answered.
    pub(crate) fn step_completed(&mut self) {
        self.held.clear();
    }

    /// Decides whether `worker`'s push-pull, which left the step `missing` gradients short, is held, and
    /// until when: only when at least `missing` other live workers (`live`), not held themselves, are each
    /// expected to push within `fraction` of `worker`'s own interval from `now`. The answer is also kept for
    /// [`Self::take`].
    pub(crate) fn decide(
        &mut self,
        worker: u32,
        missing: usize,
        live: impl Iterator<Item = u32>,
        fraction: f64,
        now: Duration,
    ) -> Option<Duration> {
        self.asked = None;
        self.held.retain(|_, until| *until > now);
        if fraction <= 0.0 || missing == 0 {
            return None;
        }
        let own = self.arrivals.get(&worker)?.interval?;
        let secs = own * fraction;
        if !secs.is_finite() || secs <= 0.0 {
            return None;
        }
        let bound = Duration::from_secs_f64(secs.min(MAX_HOLD.as_secs_f64()));
        let horizon = (now + bound).as_secs_f64();
        let now_s = now.as_secs_f64();
        let expected = live
            .filter(|w| *w != worker && !self.held.contains_key(w))
            .filter_map(|w| {
                let a = self.arrivals.get(&w)?;
                let next = a.last.as_secs_f64() + a.interval?;
                // A worker overdue by more than its own interval is not counted on (gone quiet, or leaving).
                (next + a.interval? >= now_s && next <= horizon).then_some(())
            })
            .count();
        if expected < missing {
            return None;
        }
        let until = now + bound;
        self.held.insert(worker, until);
        self.asked = Some(until);
        Some(until)
    }

    /// Forgets an answer [`Self::take`] was not asked for (a backup replaying requests never asks): each
    /// request starts without one.
    pub(crate) fn clear_asked(&mut self) {
        self.asked = None;
    }

    /// Whether the last decision asked for a hold (not yet taken).
    pub(crate) fn asked(&self) -> bool {
        self.asked.is_some()
    }

    /// The hold the last decision asked for (once).
    pub(crate) fn take(&mut self) -> Option<Duration> {
        self.asked.take()
    }

    /// Writes the arrivals and holds for a backup's copy ([`super::ShardCore::copy_state`]), so that the
    /// copy decides as this core does.
    pub(crate) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        w.u64(self.arrivals.len() as u64);
        for (worker, a) in &self.arrivals {
            w.u32(*worker);
            w.u64(nanos(a.last));
            w.u64(a.interval.map_or(u64::MAX, f64::to_bits));
        }
        w.u64(self.held.len() as u64);
        for (worker, until) in &self.held {
            w.u32(*worker);
            w.u64(nanos(*until));
        }
    }

    /// Reads what [`Self::write_to`] wrote.
    pub(crate) fn read_from(r: &mut crate::checkpoint::Reader<'_>) -> Result<Self, crate::checkpoint::CheckpointError> {
        let mut hold = GbaHold::default();
        for _ in 0..r.u64()? {
            let worker = r.u32()?;
            let last = Duration::from_nanos(r.u64()?);
            let interval = match r.u64()? {
                u64::MAX => None,
                bits => Some(f64::from_bits(bits)).filter(|i| i.is_finite() && *i >= 0.0),
            };
            hold.arrivals.insert(worker, Arrivals { last, interval });
        }
        for _ in 0..r.u64()? {
            let worker = r.u32()?;
            hold.held.insert(worker, Duration::from_nanos(r.u64()?));
        }
        Ok(hold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Workers 0–2 push every 10 ms from 0 to 40 ms (at +w ms); worker 3 every 40 ms, at 3 and 43.
    fn steady(h: &mut GbaHold) {
        for round in 0..5u64 {
            for w in 0..3u32 {
                h.observe(w, ms(round * 10 + u64::from(w)));
            }
        }
        h.observe(3, ms(3));
        h.observe(3, ms(43));
    }

    #[test]
    fn equal_workers_are_held_for_the_step_and_released_with_it() {
        let mut h = GbaHold::default();
        steady(&mut h);
        // Worker 0 pushes at 50: two gradients missing, workers 1 and 2 due at 51 and 52, within 5 ms.
        h.observe(0, ms(50));
        assert_eq!(h.decide(0, 2, 0..4, 0.5, ms(50)), Some(ms(55)));
        assert_eq!(h.take(), Some(ms(55)));
        assert_eq!(h.take(), None, "asked once");
        // Worker 1: one missing, worker 2 due; worker 0 is held and not counted on.
        h.observe(1, ms(51));
        assert_eq!(h.decide(1, 1, 0..4, 0.5, ms(51)), Some(ms(56)));
        h.step_completed();
        assert!(h.held.is_empty());
    }

    #[test]
    fn nobody_is_held_for_a_straggler() {
        let mut h = GbaHold::default();
        steady(&mut h);
        // Three missing at 50: 1 and 2 are due, the straggler (worker 3) only at 83.
        h.observe(0, ms(50));
        assert_eq!(h.decide(0, 3, 0..4, 0.5, ms(50)), None);
        // At 52 one is missing: worker 0 is due at 60, 1 at 61, 3 at 83, none within 5 ms.
        h.observe(1, ms(51));
        h.observe(2, ms(52));
        assert_eq!(h.decide(2, 1, 0..4, 0.5, ms(52)), None);
        // At 80, workers 0 and 1 are overdue by more than their interval and not counted on; the straggler
        // is due at 83.
        assert_eq!(h.decide(2, 2, 0..4, 0.5, ms(80)), None);
        assert_eq!(h.decide(2, 1, 0..4, 0.5, ms(80)), Some(ms(85)));
    }

    #[test]
    fn no_hold_without_a_measured_interval_or_with_a_zero_fraction() {
        let mut h = GbaHold::default();
        h.observe(0, ms(1));
        h.observe(1, ms(1));
        assert_eq!(h.decide(0, 1, 0..2, 0.5, ms(1)), None, "intervals not measured yet");
        steady(&mut h);
        h.observe(0, ms(50));
        assert_eq!(h.decide(0, 2, 0..4, 0.0, ms(50)), None);
        h.forget(1);
        // Worker 1 is gone: two missing, only worker 2 due.
        assert_eq!(h.decide(0, 2, 0..4, 0.5, ms(50)), None);
    }

    /// A hold that saw these pushes: (worker, milliseconds).
    fn observed(pushes: &[(u32, u64)]) -> GbaHold {
        let mut h = GbaHold::default();
        for &(worker, at) in pushes {
            h.observe(worker, ms(at));
        }
        h
    }

    #[test]
    fn a_hold_is_bounded() {
        let mut h = observed(&[(0, 0), (0, 10_000), (1, 8_500), (1, 9_500)]);
        assert_eq!(h.decide(0, 1, 0..2, 1.0, ms(10_000)), Some(ms(10_000) + MAX_HOLD));
        // A fraction that is not a number, or infinite, holds nothing and does not panic.
        assert_eq!(h.decide(0, 1, 0..2, f64::NAN, ms(10_000)), None);
        assert_eq!(h.decide(0, 1, 0..2, f64::INFINITY, ms(10_000)), None);
    }

    #[test]
    fn a_clock_that_starts_again_is_followed() {
        let mut h = observed(&[(0, 5_000), (0, 5_010), (1, 5_000), (1, 5_010)]);
        // The clock restarts near 0: pushes count from there instead of waiting for 5 s to pass.
        h.observe(0, ms(20));
        h.observe(1, ms(21));
        h.observe(0, ms(30));
        assert_eq!(h.decide(0, 1, 0..2, 0.5, ms(30)), Some(ms(35)), "worker 1 is due at 31");
    }
}
