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

/// Exactly-once bookkeeping, per worker: the window of sequence numbers that decides duplicates, and the
/// ledger of pushes applied here (checkpointed; kept after the worker leaves). One part of [`ShardCore`]'s
/// state.
#[derive(Debug, Default)]
pub(super) struct ExactlyOnce {
    pub(super) seqs: HashMap<u32, SeqWindow>,
    pub(super) ledger: HashMap<u32, AppliedSeqs>,
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
        if seq.saturating_add(SEQ_WINDOW) <= self.highest {
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
        self.once.seqs.get(&worker).is_some_and(|w| w.check(seq) == Seen::Applied)
    }

    /// Whether a push of `worker` numbered `seq` in `epoch` would be new (true) or a duplicate (false), or why
    /// it is refused: the exactly-once gate's verdict without its effects (see [`Self::check_push`]).
    pub(super) fn push_is_new(&self, epoch: u64, worker: u32, seq: u64) -> Result<bool, ShardError> {
        self.check_epoch(epoch)?;
        if seq == 0 {
            return Err(ShardError::SequenceWindow("sequence numbers start at 1".into()));
        }
        match self.once.seqs.get(&worker).map_or(Seen::New, |w| w.check(seq)) {
            Seen::New => Ok(true),
            Seen::Applied => Ok(false),
            Seen::TooOld => Err(ShardError::SequenceWindow(format!(
                "sequence number {seq} of worker {worker} is more than {SEQ_WINDOW} behind its newest push: too old to tell whether it was applied"
            ))),
        }
    }

    /// The exactly-once gate shared by dense and sparse pushes: checks the epoch and the sequence window;
    /// returns the acknowledgement of a push applied before (not applied again), or None for a new one.
    pub(super) fn check_push(&mut self, epoch: u64, worker: u32, seq: u64) -> Result<Option<Frame>, ShardError> {
        if self.push_is_new(epoch, worker, seq)? {
            // A worker's window exists from its first push on.
            self.once.seqs.entry(worker).or_default();
            return Ok(None);
        }
        self.stats.pushes_duplicate += 1;
        Ok(Some(Frame::new(Message::Ack(Ack {
            seq,
            duplicate: true,
            decisions: self.mode.decisions,
            ..Ack::default()
        }))))
    }
}

/// The ledger of one worker's pushes on this shard: every sequence number applied, as sorted, disjoint
/// ranges, and how many pushes were applied. It is kept apart from the [`SeqWindow`] gate, so that a gate that
/// let a push through twice shows in [`Stats::pushes_applied_twice`], and it goes back with the model at a
/// restore, so `applied` is what the current state holds of the worker's pushes (what a crash lost is the
/// acknowledged pushes the ledger lacks).
///
/// Bounded: ranges wholly older than the gate's window (whose numbers the gate refuses as too old to tell)
/// are merged into one, so a worker costs at most about `SEQ_WINDOW / 2` ranges, a handful in practice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct AppliedSeqs {
    /// Pushes applied (distinct numbers, as the gate lets only new ones through).
    applied: u64,
    /// Applied numbers as inclusive ranges, ascending and not touching.
    ranges: Vec<(u64, u64)>,
}

/// Workers whose ledgers a shard keeps (the oldest departed one's is forgotten beyond it).
pub const LEDGER_WORKERS: usize = 16_384;

/// Ranges a ledger keeps before it merges those below the window.
const LEDGER_COMPACT_AT: usize = 64;

impl AppliedSeqs {
    /// Records `seq` as applied; false when it was recorded before (a push applied twice).
    pub(super) fn insert(&mut self, seq: u64) -> bool {
        self.applied += 1;
        // The common case: the next number after the newest.
        let at = self.ranges.partition_point(|&(_, end)| end < seq);
        if let Some(&(start, _)) = self.ranges.get(at) {
            if start <= seq {
                return false;
            }
        }
        let joins_before = at > 0 && self.ranges[at - 1].1.checked_add(1) == Some(seq);
        let joins_after = self.ranges.get(at).is_some_and(|&(start, _)| Some(start) == seq.checked_add(1));
        match (joins_before, joins_after) {
            (true, true) => {
                self.ranges[at - 1].1 = self.ranges[at].1;
                self.ranges.remove(at);
            }
            (true, false) => self.ranges[at - 1].1 = seq,
            (false, true) => self.ranges[at].0 = seq,
            (false, false) => self.ranges.insert(at, (seq, seq)),
        }
        if self.ranges.len() > LEDGER_COMPACT_AT {
            self.compact();
        }
        true
    }

    /// Merges the ranges that end below the window into one (their gaps are numbers the gate no longer lets
    /// through, so they can never be applied and need no record).
    fn compact(&mut self) {
        let newest = self.ranges.last().map_or(0, |r| r.1);
        let old = self.ranges.partition_point(|&(_, end)| end.saturating_add(SEQ_WINDOW) <= newest);
        if old > 1 {
            let end = self.ranges[old - 1].1;
            self.ranges[0].1 = end;
            self.ranges.drain(1..old);
        }
    }

    /// Pushes applied.
    pub(super) fn applied(&self) -> u64 {
        self.applied
    }

    pub(super) fn write_to(&self, w: &mut crate::checkpoint::Writer) {
        w.u64(self.applied);
        let flat: Vec<u64> = self.ranges.iter().flat_map(|&(a, b)| [a, b]).collect();
        w.u64s(&flat);
    }

    pub(super) fn read_from(r: &mut crate::checkpoint::Reader<'_>) -> Result<Self, crate::checkpoint::CheckpointError> {
        let applied = r.u64()?;
        let flat = r.u64s("push ledger")?;
        let corrupt = || crate::checkpoint::CheckpointError::Corrupt("push ledger".into());
        if flat.len() % 2 != 0 || flat.len() > 2 * (SEQ_WINDOW as usize + LEDGER_COMPACT_AT) {
            return Err(corrupt());
        }
        let ranges: Vec<(u64, u64)> = flat.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        let ordered = ranges.iter().all(|&(a, b)| a <= b)
            && ranges.windows(2).all(|p| p[0].1.checked_add(1).is_some_and(|next| next < p[1].0));
        if !ordered {
            return Err(corrupt());
        }
        Ok(AppliedSeqs { applied, ranges })
    }
}

impl ShardCore {
    /// Records that `worker`'s push `seq` was applied (or summed into a step): in the gate's window and in
    /// the worker's ledger; a number the ledger already held is counted as applied twice.
    pub(super) fn record_applied(&mut self, worker: u32, seq: u64) {
        self.stats.pushes_applied += 1;
        if let Some(window) = self.once.seqs.get_mut(&worker) {
            window.insert(seq);
        }
        if !self.once.ledger.contains_key(&worker) && self.once.ledger.len() >= LEDGER_WORKERS {
            // A long elastic run: forget the ledger of the oldest departed worker.
            let oldest = self.once.ledger.keys().copied().filter(|w| !self.members.leases.contains_key(w)).min();
            if let Some(oldest) = oldest {
                self.once.ledger.remove(&oldest);
            }
        }
        if !self.once.ledger.entry(worker).or_default().insert(seq) {
            self.stats.pushes_applied_twice += 1;
        }
    }

    /// Pushes applied per worker as this shard's state holds them (ascending worker ids).
    pub(super) fn applied_by_worker(&self) -> Vec<WorkerApplied> {
        let mut out: Vec<WorkerApplied> =
            self.once.ledger.iter().map(|(&worker, l)| WorkerApplied { worker, applied: l.applied() }).collect();
        out.sort_by_key(|w| w.worker);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_keeps_each_number_once_and_stays_small() {
        let mut l = AppliedSeqs::default();
        for seq in 1..=10_000 {
            assert!(l.insert(seq));
        }
        assert_eq!((l.applied(), l.ranges.len()), (10_000, 1));
        assert!(!l.insert(5_000), "a number applied before");
        assert_eq!(l.applied(), 10_001);
        // Gaps (lost or refused pushes) and late arrivals.
        assert!(l.insert(10_005));
        assert!(l.insert(10_003));
        assert!(l.insert(10_004));
        assert_eq!(l.ranges, vec![(1, 10_000), (10_003, 10_005)]);
        assert!(l.insert(10_002) && l.insert(10_001));
        assert_eq!(l.ranges, vec![(1, 10_005)]);
        // Every other number for a long while: old gaps are merged, recent ones are kept.
        let mut l = AppliedSeqs::default();
        for seq in (1..200_000).step_by(2) {
            assert!(l.insert(seq));
        }
        assert!(l.ranges.len() <= SEQ_WINDOW as usize / 2 + LEDGER_COMPACT_AT + 1, "{}", l.ranges.len());
        assert!(l.insert(199_998), "a recent gap is still free");
        assert!(!l.insert(199_999));
    }

    #[test]
    fn a_ledger_reads_back_what_it_wrote_and_refuses_disorder() {
        let mut l = AppliedSeqs::default();
        for seq in [1, 2, 3, 7, 9, 10] {
            l.insert(seq);
        }
        let mut w = crate::checkpoint::Writer::reusing(Vec::new(), 0);
        l.write_to(&mut w);
        let back = AppliedSeqs::read_from(&mut crate::checkpoint::Reader::new(&w.buf).expect("header")).expect("read");
        assert_eq!(back, l);
        let mut w = crate::checkpoint::Writer::reusing(Vec::new(), 0);
        w.u64(3);
        w.u64s(&[5, 6, 2, 3]);
        assert!(AppliedSeqs::read_from(&mut crate::checkpoint::Reader::new(&w.buf).expect("header")).is_err());
    }
}
