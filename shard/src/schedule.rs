//! When a shard takes its periodic checkpoints, as a sans-IO schedule: the caller waits until
//! [`CheckpointSchedule::next_deadline`] (a time since the shard started, as quinn-proto's `poll_timeout`
//! gives one), then asks [`CheckpointSchedule::poll`] what is due and takes it. The service drives it with
//! tokio's timers, the test network (`testnet`) with its virtual clock: both run this same code.
//!
//! The coordinator (shard 0) takes a *cluster* checkpoint every interval (it asks every shard for one with
//! the same id, see docs/guide/recovery.md). Every other shard follows that schedule and takes one of its own
//! only when none came for twice the interval: the coordinator is down, or keeps no schedule.

use std::time::Duration;

/// What [`CheckpointSchedule::poll`] says is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// The coordinator's turn: a cluster checkpoint, one id for every shard.
    Cluster,
    /// A shard other than the coordinator heard nothing for twice the interval: a checkpoint of its own.
    Own,
}

/// One shard's periodic checkpoint schedule (see the module's documentation).
#[derive(Clone, Debug)]
pub struct CheckpointSchedule {
    every: Duration,
    next: Duration,
    coordinator: bool,
}

impl CheckpointSchedule {
    /// The schedule of shard `shard` taking a checkpoint every `every` (at least a millisecond), the first
    /// one interval after `now`.
    pub fn new(shard: u32, every: Duration, now: Duration) -> Self {
        let every = every.max(Duration::from_millis(1));
        CheckpointSchedule { every, next: now + every, coordinator: shard == 0 }
    }

    /// When to call [`Self::poll`] next (time since the shard started).
    pub fn next_deadline(&self) -> Duration {
        self.next
    }

    /// What is due at `now`, the shard's newest checkpoint (its own or the coordinator's) taken at `last`.
    /// Before the deadline nothing is; at or after it the deadline moves on by whole intervals past `now`
    /// (intervals missed while a checkpoint took long are not taken in a burst: one is due at once, then the
    /// schedule goes on from the next deadline on the grid).
    pub fn poll(&mut self, now: Duration, last: Duration) -> Option<Due> {
        if now < self.next {
            return None;
        }
        let missed = ((now - self.next).as_nanos() / self.every.as_nanos()) as u32;
        self.next += self.every * (missed + 1);
        if self.coordinator {
            Some(Due::Cluster)
        } else if now.saturating_sub(last) >= 2 * self.every {
            Some(Due::Own)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_coordinator_takes_one_every_interval_and_skips_what_it_missed() {
        let mut s = CheckpointSchedule::new(0, ms(500), ms(100));
        assert_eq!(s.next_deadline(), ms(600));
        assert_eq!(s.poll(ms(599), ms(0)), None);
        assert_eq!(s.poll(ms(600), ms(0)), Some(Due::Cluster));
        assert_eq!(s.next_deadline(), ms(1100));
        // Late by two and a half intervals: one checkpoint, and the next deadline is the next on the grid.
        assert_eq!(s.poll(ms(2350), ms(600)), Some(Due::Cluster));
        assert_eq!(s.next_deadline(), ms(2600));
        assert_eq!(s.poll(ms(2400), ms(2350)), None, "not due again before its deadline");
    }

    #[test]
    fn another_shard_takes_its_own_only_when_the_coordinator_is_silent_for_two_intervals() {
        let mut s = CheckpointSchedule::new(1, ms(500), ms(0));
        // The coordinator's checkpoints came: nothing of its own.
        assert_eq!(s.poll(ms(500), ms(500)), None);
        assert_eq!(s.poll(ms(1000), ms(1000)), None);
        // The last came at 1 s: at 1.5 s one interval passed, at 2 s two did.
        assert_eq!(s.poll(ms(1500), ms(1000)), None);
        assert_eq!(s.poll(ms(2000), ms(1000)), Some(Due::Own));
        assert_eq!(s.poll(ms(2500), ms(2000)), None);
        assert_eq!(s.poll(ms(3000), ms(2000)), Some(Due::Own));
        // A zero interval is a millisecond, not a loop that never ends.
        let mut z = CheckpointSchedule::new(0, Duration::ZERO, ms(0));
        assert_eq!(z.poll(ms(5), ms(0)), Some(Due::Cluster));
        assert_eq!(z.next_deadline(), ms(6));
    }
}
