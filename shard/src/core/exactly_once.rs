//! The exactly-once gate: per worker, the highest contiguous applied sequence number plus those applied
//! out of order; a push seen before is acknowledged again, not applied again.

use super::*;

/// How far ahead of the last contiguous applied sequence number a push may be.
pub const SEQ_WINDOW: u64 = 4096;

/// Exactly-once bookkeeping for one worker: every seq ≤ `contiguous` was applied, plus those in `above`.
#[derive(Debug, Default)]
pub(super) struct SeqWindow {
    pub(super) contiguous: u64,
    pub(super) above: BTreeSet<u64>,
}

impl SeqWindow {
    pub(super) fn applied(&self, seq: u64) -> bool {
        seq <= self.contiguous || self.above.contains(&seq)
    }

    pub(super) fn insert(&mut self, seq: u64) {
        self.above.insert(seq);
        while self.above.remove(&(self.contiguous + 1)) {
            self.contiguous += 1;
        }
    }
}

impl ShardCore {
    /// The exactly-once gate shared by dense and sparse pushes: checks the epoch and the sequence window;
    /// returns the acknowledgement of a push applied before (not applied again), or None for a new one.
    pub(super) fn check_push(&mut self, epoch: u64, worker: u32, seq: u64) -> Result<Option<Frame>, ShardError> {
        self.check_epoch(epoch)?;
        if seq == 0 {
            return Err(ShardError::SequenceWindow("sequence numbers start at 1".into()));
        }
        let window = self.seqs.entry(worker).or_default();
        if window.applied(seq) {
            self.stats.pushes_duplicate += 1;
            return Ok(Some(Frame::new(Message::Ack(Ack { seq, duplicate: true, ..Ack::default() }))));
        }
        if seq > window.contiguous + SEQ_WINDOW {
            return Err(ShardError::SequenceWindow(format!(
                "sequence number {seq} is more than {SEQ_WINDOW} ahead of {} (worker {worker})",
                window.contiguous
            )));
        }
        Ok(None)
    }
}
