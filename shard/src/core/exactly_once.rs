//! The exactly-once gate: per worker, an anti-replay window of recent sequence numbers; a push seen before
//! is acknowledged again, not applied again, and a refused or abandoned number never blocks later ones.

use super::*;

/// How many of a worker's most recent sequence numbers the shard remembers. A retry must arrive before its
/// worker made this many newer pushes to the shard (clients retry at once, with a handful in flight).
pub const SEQ_WINDOW: u64 = 4096;

/// Exactly-once bookkeeping for one worker: an anti-replay window (as in IPsec), the highest sequence
/// number applied and which of the [`SEQ_WINDOW`] numbers up to it were applied, in a ring of bits.
///
/// A number above the window is new; one inside it is new unless its bit is set; one below it is refused as
/// too old to tell. A number that was refused, or abandoned by its client after failed retries, is never
/// set and simply ages out: it can never block later pushes. Numbers may jump ahead (after a restore, the
/// shard may be behind its clients). 512 bytes per worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SeqWindow {
    highest: u64,
    bits: Vec<u64>,
}

impl Default for SeqWindow {
    fn default() -> Self {
        SeqWindow { highest: 0, bits: vec![0; (SEQ_WINDOW / 64) as usize] }
    }
}

/// What the window says about a sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seen {
    New,
    Applied,
    TooOld,
}

impl SeqWindow {
    fn bit(seq: u64) -> (usize, u64) {
        let slot = seq % SEQ_WINDOW;
        ((slot / 64) as usize, 1u64 << (slot % 64))
    }

    pub(super) fn check(&self, seq: u64) -> Seen {
        if seq + SEQ_WINDOW <= self.highest {
            return Seen::TooOld;
        }
        if seq > self.highest {
            return Seen::New;
        }
        let (word, mask) = Self::bit(seq);
        if self.bits[word] & mask != 0 {
            Seen::Applied
        } else {
            Seen::New
        }
    }

    pub(super) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        w.u64(self.highest);
        w.u64s(&self.bits);
    }

    pub(super) fn read_from(r: &mut crate::checkpoint::Reader<'_>) -> Result<Self, crate::checkpoint::CheckpointError> {
        let highest = r.u64()?;
        let bits = r.u64s("sequence window")?;
        if bits.len() as u64 != SEQ_WINDOW / 64 {
            return Err(crate::checkpoint::CheckpointError::Mismatch(format!(
                "a sequence window of {} bits, this shard keeps {SEQ_WINDOW}",
                bits.len() * 64
            )));
        }
        Ok(SeqWindow { highest, bits })
    }

    /// Records `seq` as applied (it must have been [`Seen::New`]).
    pub(super) fn insert(&mut self, seq: u64) {
        if seq > self.highest {
            // Slide: the numbers between the old and the new highest were not applied (yet).
            if seq - self.highest >= SEQ_WINDOW {
                self.bits.iter_mut().for_each(|w| *w = 0);
            } else {
                for skipped in self.highest + 1..seq {
                    let (word, mask) = Self::bit(skipped);
                    self.bits[word] &= !mask;
                }
            }
            self.highest = seq;
        }
        let (word, mask) = Self::bit(seq);
        self.bits[word] |= mask;
    }
}

impl ShardCore {
    /// True when `worker`'s push `seq` was applied here (a part of it sent again is a duplicate).
    pub fn push_applied(&self, worker: u32, seq: u64) -> bool {
        self.seqs.get(&worker).is_some_and(|w| w.check(seq) == Seen::Applied)
    }

    /// The exactly-once gate shared by dense and sparse pushes: checks the epoch and the sequence window;
    /// returns the acknowledgement of a push applied before (not applied again), or None for a new one.
    pub(super) fn check_push(&mut self, epoch: u64, worker: u32, seq: u64) -> Result<Option<Frame>, ShardError> {
        self.check_epoch(epoch)?;
        if seq == 0 {
            return Err(ShardError::SequenceWindow("sequence numbers start at 1".into()));
        }
        match self.seqs.entry(worker).or_default().check(seq) {
            Seen::New => {}
            Seen::Applied => {
                self.stats.pushes_duplicate += 1;
                return Ok(Some(Frame::new(Message::Ack(Ack { seq, duplicate: true, decisions: self.decisions, ..Ack::default() }))));
            }
            Seen::TooOld => {
                return Err(ShardError::SequenceWindow(format!(
                    "sequence number {seq} of worker {worker} is more than {SEQ_WINDOW} behind its newest push: too old to tell whether it was applied"
                )))
            }
        }
        Ok(None)
    }
}
