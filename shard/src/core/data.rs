//! Dynamic data sharding in the core: the coordinator's dealer ([`crate::dealer`]) answers split requests,
//! gets back the splits of workers that leave or expire, and goes back with the cluster to a checkpoint;
//! every shard counts the samples of accepted pushes per grant, so that whether each line was trained once
//! can be read from the shards rather than from the workers' own reports.

use super::*;
use crate::checkpoint::{CheckpointError, Reader, Writer};
use crate::dealer::{Dealer, DealerConfig};
use gaps_common::wire::{DataStatus, DataTag, DealerStatus, GrantCount, SplitGrant, SplitRequest, DATA_STATUS_PAGE};

/// Grants whose sample counts a shard keeps at most; beyond, the oldest grant's count is dropped (and
/// counted), so a worker cannot grow a shard's memory without bound by inventing grants.
pub const MAX_GRANT_COUNTS: usize = 1 << 20;

/// Samples accepted per grant on one shard, and the grants in the order they were first counted (the
/// oldest are dropped first when there are too many).
#[derive(Debug, Clone, Default)]
pub(super) struct GrantCounts {
    counts: BTreeMap<u64, (u64, u64)>,
    order: VecDeque<u64>,
    evicted: u64,
}

impl GrantCounts {
    fn add(&mut self, tag: DataTag) {
        let entry = self.counts.entry(tag.grant).or_insert_with(|| {
            self.order.push_back(tag.grant);
            (tag.split, 0)
        });
        entry.1 = entry.1.saturating_add(u64::from(tag.samples));
        while self.counts.len() > MAX_GRANT_COUNTS {
            match self.order.pop_front() {
                Some(oldest) => {
                    self.counts.remove(&oldest);
                    self.evicted += 1;
                }
                None => break,
            }
        }
    }

    fn samples(&self, grant: u64) -> u64 {
        self.counts.get(&grant).map_or(0, |(_, n)| *n)
    }

    /// Written in the order the grants were first counted.
    pub(super) fn write_to(&self, w: &mut Writer) {
        w.u64(self.evicted);
        let rows: Vec<u64> =
            self.order.iter().filter_map(|g| self.counts.get(g).map(|(k, n)| [*g, *k, *n])).flatten().collect();
        w.u64s(&rows);
    }

    pub(super) fn read_from(r: &mut Reader<'_>) -> Result<Self, CheckpointError> {
        let evicted = r.u64()?;
        let raw = r.u64s("grant counts")?;
        if raw.len() % 3 != 0 || raw.len() / 3 > MAX_GRANT_COUNTS {
            return Err(CheckpointError::Corrupt("grant counts".into()));
        }
        let mut out = GrantCounts { evicted, ..GrantCounts::default() };
        for c in raw.chunks_exact(3) {
            if out.counts.insert(c[0], (c[1], c[2])).is_some() {
                return Err(CheckpointError::Corrupt("grant counts: a grant twice".into()));
            }
            out.order.push_back(c[0]);
        }
        Ok(out)
    }
}

impl ShardCore {
    /// Deals the training data from this coordinator (dynamic data sharding). A checkpoint this core was
    /// restored from continues its dealer where it was when it fits `cfg` (the same cut of the same data);
    /// splits on loan then are dealt again (what their holders trained since is not in the model). Only the
    /// coordinator deals; the error says why a configuration or checkpoint does not fit.
    pub fn set_dealer(&mut self, cfg: DealerConfig) -> Result<(), String> {
        self.set_dealer_replaying(cfg, None).map(|_| ())
    }

    /// [`Self::set_dealer`] for a coordinator that journals its dealer (`journal` Some: async mode, where
    /// the cluster does not go back with the coordinator). A restored dealer first makes again the changes
    /// the journal recorded after its checkpoint ([`Dealer::replay`]), so that splits finished since are not
    /// dealt again; every change from then on (the splits on loan given back included) is kept for
    /// [`Self::take_dealer_journal`]. Returns the changes made again — with the checkpoint, the state to
    /// journal from — or why the journal was not used (it does not continue the checkpoint: the dealer then
    /// starts from the checkpoint, as without a journal).
    pub fn set_dealer_replaying(
        &mut self,
        cfg: DealerConfig,
        journal: Option<&[crate::dealer::DealerOp]>,
    ) -> Result<Result<Vec<crate::dealer::DealerOp>, String>, String> {
        if self.coordinator.is_none() {
            return Err(format!("shard {} is not the coordinator; only shard 0 deals data", self.cfg.shard));
        }
        let mut replayed = Ok(Vec::new());
        let dealer = match self.restored_dealer.take() {
            Some((format, bytes)) => {
                let mut r = Reader::section(&bytes, format);
                let mut d = Dealer::read_from(cfg, &mut r).map_err(|e| format!("the checkpoint's data dealer: {e}"))?;
                r.finish().map_err(|e| format!("the checkpoint's data dealer: {e}"))?;
                if let Some(journal) = journal {
                    let from = d.ops();
                    replayed = d.replay(journal).map(|made| {
                        journal.iter().filter(|c| c.op() > from && c.op() <= from + made).copied().collect()
                    });
                }
                d.set_journaling(journal.is_some());
                d.raise_grant_floor();
                d.give_back_all();
                d
            }
            None => {
                let mut d = Dealer::new(cfg);
                d.set_journaling(journal.is_some());
                d
            }
        };
        self.dealer = Some(dealer);
        Ok(replayed)
    }

    /// Continues the dealer of the checkpoint this core was restored from exactly as it was — splits on loan
    /// stay on loan, grants keep their numbering, nothing journaled — for a backup's copy of the
    /// coordinator (`gaps-server --replicas`), which must hold what its primary holds. `cfg` is the
    /// primary's dealer settings (None where this process has none: refused if the checkpoint deals data).
    pub fn set_dealer_as_copy(&mut self, cfg: Option<DealerConfig>) -> Result<(), String> {
        let Some((format, bytes)) = self.restored_dealer.take() else { return Ok(()) };
        let cfg = cfg.ok_or("the coordinator deals data: start its backups with the same --data")?;
        let mut r = Reader::section(&bytes, format);
        let d = Dealer::read_from(cfg, &mut r).map_err(|e| format!("the checkpoint's data dealer: {e}"))?;
        r.finish().map_err(|e| format!("the checkpoint's data dealer: {e}"))?;
        self.dealer = Some(d);
        Ok(())
    }

    /// Stops keeping the dealer's changes (the journal could not be written).
    pub fn stop_dealer_journal(&mut self) {
        if let Some(d) = self.dealer.as_mut() {
            d.set_journaling(false);
        }
    }

    /// The dealer's changes since the last call, in order (empty unless journaling).
    pub fn take_dealer_journal(&mut self) -> Vec<crate::dealer::DealerOp> {
        self.dealer.as_mut().map(|d| d.take_journal()).unwrap_or_default()
    }

    /// The dealer, if this coordinator deals data.
    pub fn dealer(&self) -> Option<&Dealer> {
        self.dealer.as_ref()
    }

    /// A worker asks the coordinator's dealer for its next split ([`coordinator_only`]).
    pub(super) fn split_request(
        &mut self,
        r: &SplitRequest,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        self.check_epoch(r.epoch)?;
        // A request renews the worker's lease as a heartbeat does (one that expired while the coordinator
        // restarted comes back).
        self.renew_lease(r.worker, now, events)?;
        let Some(dealer) = self.dealer.as_mut() else {
            return Err(ShardError::Misconfigured(
                "this cluster deals no data: start the coordinator with --data to shard data dynamically, or the \
                 workers with --data-sharding static"
                    .into(),
            ));
        };
        // A finished grant this worker does not hold is taken as a replay only where this shard counted
        // samples under it (someone trained it); an invented number changes nothing.
        let finished = r.finished.filter(|g| dealer.holds(r.worker, *g) || self.data.counts.contains_key(g));
        let (split, finished_accepted) = dealer.deal(r.worker, finished);
        let files = match &dealer.config().table {
            crate::dealer::SplitTable::Files { files, .. } => files.len() as u32,
            crate::dealer::SplitTable::Synthetic { .. } => 0,
        };
        Ok(Frame::new(Message::SplitGrant(SplitGrant { split, files, finished_accepted })))
    }

    /// Counts an accepted push's samples under its grant.
    pub(super) fn count_samples(&mut self, tag: Option<DataTag>) {
        if let Some(tag) = tag {
            self.data.add(tag);
        }
    }

    /// A departed worker's splits go back to the dealer's queue.
    pub(super) fn data_worker_gone(&mut self, worker: u32) {
        if let Some(d) = self.dealer.as_mut() {
            d.give_back(worker);
        }
    }

    /// Samples trained under grants that ended unfinished, as this shard counted them.
    pub fn samples_replayed(&self) -> u64 {
        self.dealer.as_ref().map_or(0, |d| d.abandoned().map(|g| self.data.samples(*g)).sum())
    }

    /// This shard's per-grant counts after `after` (one page), and the dealer's state on the coordinator.
    pub fn data_status(&self, after: u64) -> DataStatus {
        use std::ops::Bound::{Excluded, Unbounded};
        let mut counts: Vec<GrantCount> = self
            .data
            .counts
            .range((Excluded(after), Unbounded))
            .take(DATA_STATUS_PAGE + 1)
            .map(|(g, (k, n))| GrantCount { grant: *g, split: *k, samples: *n })
            .collect();
        let (mut completed, mut abandoned): (Vec<(u64, u64)>, Vec<u64>) = match &self.dealer {
            Some(d) => (
                d.completed().filter(|(g, _)| *g > after).copied().collect(),
                d.abandoned().filter(|g| **g > after).copied().collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        completed.sort_unstable();
        abandoned.sort_unstable();
        // A page ends at the first grant where one of the lists is cut; every list stops there.
        let cut = [
            counts.get(DATA_STATUS_PAGE - 1).map(|c| c.grant).filter(|_| counts.len() > DATA_STATUS_PAGE),
            completed.get(DATA_STATUS_PAGE - 1).map(|c| c.0).filter(|_| completed.len() > DATA_STATUS_PAGE),
            abandoned.get(DATA_STATUS_PAGE - 1).copied().filter(|_| abandoned.len() > DATA_STATUS_PAGE),
        ]
        .into_iter()
        .flatten()
        .min();
        if let Some(cut) = cut {
            counts.retain(|c| c.grant <= cut);
            completed.retain(|c| c.0 <= cut);
            abandoned.retain(|g| *g <= cut);
        }
        let dealer = self.dealer.as_ref().map(|d| DealerStatus {
            data_epoch: d.epoch(),
            epochs: d.config().epochs.unwrap_or(0),
            splits_per_epoch: match d.config().table {
                crate::dealer::SplitTable::Files { .. } => d.config().table.per_epoch(),
                crate::dealer::SplitTable::Synthetic { .. } => 0,
            },
            splits_done: d.splits_done(),
            splits_pending: d.splits_pending(),
            splits_returned: d.splits_returned(),
            samples_replayed: self.samples_replayed(),
            finished: d.finished(),
            leased: d.leases().into_iter().take(DATA_STATUS_PAGE).collect(),
            completed,
            abandoned,
        });
        DataStatus { shard: self.cfg.shard, counts, next_after: cut, counts_evicted: self.data.evicted, dealer }
    }
}
