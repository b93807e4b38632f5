//! The data dealer of dynamic data sharding (the coordinator's): the training input cut into splits, dealt
//! one at a time to whichever worker asks, each under a grant that ends when its worker reports it finished
//! or gives it back (it left, its lease expired, the cluster rolled back). A split given back goes to the
//! front of the queue and is dealt again under a new grant; every split is finished once per data epoch.
//! Fast workers ask more often, so they train on more of the data: the run is no longer as slow as the
//! slowest worker's fixed share.
//!
//! Sans-IO like the rest of the core: the file scan that cuts a file into line-aligned splits is the
//! caller's ([`SplitTable`] is its result); the dealer only counts.

use crate::checkpoint::{CheckpointError, Reader, Writer};
use gaps_common::wire::{DataSplit, GrantLease};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// One split of a file: a line-aligned byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileSplit {
    /// Index of the file in [`SplitTable::files`].
    pub file: u32,
    /// The 1-based number of its first line in the file.
    pub first_line: u64,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// Lines in the range.
    pub lines: u64,
}

/// What the dealer deals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitTable {
    /// Files cut into splits, in file order (every epoch deals these).
    Files {
        /// The files, as the coordinator names them (workers map an index to their own `--data` list).
        files: Vec<String>,
        /// The splits.
        splits: Vec<FileSplit>,
    },
    /// Synthetic data: split `i` of an endless stream is samples `[i·n, (i+1)·n)`.
    Synthetic {
        /// Samples per split.
        samples_per_split: u64,
    },
}

impl SplitTable {
    /// Splits in one data epoch (synthetic data: `u32::MAX`, never reached in practice).
    pub fn per_epoch(&self) -> u64 {
        match self {
            SplitTable::Files { splits, .. } => splits.len() as u64,
            // Synthetic splits stay below the evaluation range (sample indices from 2^62).
            SplitTable::Synthetic { samples_per_split } => {
                u64::from(u32::MAX).min((1u64 << 62) / (*samples_per_split).max(1))
            }
        }
    }

    /// A fingerprint of the cut (a checkpoint's dealer state only fits the same cut).
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        match self {
            SplitTable::Files { files, splits } => {
                eat(1);
                eat(files.len() as u64);
                for s in splits {
                    for x in [u64::from(s.file), s.first_line, s.start, s.end, s.lines] {
                        eat(x);
                    }
                }
            }
            SplitTable::Synthetic { samples_per_split } => {
                eat(2);
                eat(*samples_per_split);
            }
        }
        h
    }

    fn split(&self, key: u64, grant: u64) -> DataSplit {
        let index = key & 0xffff_ffff;
        match self {
            SplitTable::Files { splits, .. } => {
                let s = splits[index as usize];
                DataSplit {
                    grant,
                    key,
                    file: s.file,
                    first_line: s.first_line,
                    start: s.start,
                    end: s.end,
                    lines: s.lines,
                }
            }
            SplitTable::Synthetic { samples_per_split: n } => {
                // Each data epoch of synthetic data would be the same samples again; there is only one.
                let start = index.saturating_mul(*n);
                DataSplit { grant, key, file: 0, first_line: 0, start, end: start.saturating_add(*n), lines: *n }
            }
        }
    }
}

/// The dealer's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DealerConfig {
    /// The splits.
    pub table: SplitTable,
    /// Data epochs to deal (None: no end).
    pub epochs: Option<u64>,
    /// Grants are numbered from at least this (the service passes its start time in the high 32 bits, so a
    /// restarted coordinator never hands out a number its previous life did).
    pub grant_floor: u64,
}

/// One change of a dealer's state, numbered in the order made: what the coordinator's journal records
/// (`gaps-server` writes one line per change next to its checkpoints), so that a coordinator restored from a
/// checkpoint in async mode, where the cluster does not go back with it, continues the epoch where it was
/// rather than dealing again the splits finished since its checkpoint ([`Dealer::replay`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DealerOp {
    /// [`Dealer::deal`] with the finished grant it was given, and the grant it dealt (None: none left).
    Deal {
        /// The change's number (the dealer's count of changes after it).
        op: u64,
        /// The asking worker.
        worker: u32,
        /// The grant reported finished, as passed to the dealer.
        finished: Option<u64>,
        /// The grant dealt.
        grant: Option<u64>,
    },
    /// [`Dealer::give_back`] that gave back at least one split.
    GiveBack {
        /// The change's number.
        op: u64,
        /// The worker whose splits went back.
        worker: u32,
    },
    /// [`Dealer::raise_grant_floor`] after a restore: grants are numbered from here on.
    Floor {
        /// The change's number.
        op: u64,
        /// The next grant number.
        next_grant: u64,
    },
}

impl DealerOp {
    /// The change's number.
    pub fn op(&self) -> u64 {
        match self {
            DealerOp::Deal { op, .. } | DealerOp::GiveBack { op, .. } | DealerOp::Floor { op, .. } => *op,
        }
    }

    /// One journal line (no newline): `deal OP WORKER FINISHED|- GRANT|-`, `back OP WORKER` or
    /// `floor OP NEXT_GRANT`.
    pub fn to_line(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |g| g.to_string());
        match self {
            DealerOp::Deal { op, worker, finished, grant } => {
                format!("deal {op} {worker} {} {}", opt(*finished), opt(*grant))
            }
            DealerOp::GiveBack { op, worker } => format!("back {op} {worker}"),
            DealerOp::Floor { op, next_grant } => format!("floor {op} {next_grant}"),
        }
    }

    /// Reads a line written by [`DealerOp::to_line`]; None for anything else (a torn last line included).
    pub fn parse(line: &str) -> Option<DealerOp> {
        let words: Vec<&str> = line.split_ascii_whitespace().collect();
        let opt = |w: &str| if w == "-" { Some(None) } else { w.parse::<u64>().ok().map(Some) };
        match words[..] {
            ["deal", op, worker, finished, grant] => Some(DealerOp::Deal {
                op: op.parse().ok()?,
                worker: worker.parse().ok()?,
                finished: opt(finished)?,
                grant: opt(grant)?,
            }),
            ["back", op, worker] => Some(DealerOp::GiveBack { op: op.parse().ok()?, worker: worker.parse().ok()? }),
            ["floor", op, next] => Some(DealerOp::Floor { op: op.parse().ok()?, next_grant: next.parse().ok()? }),
            _ => None,
        }
    }
}

/// Most finished and abandoned grants remembered (for [`gaps_common::wire::DataStatus`]); older ones are
/// only counted.
pub const GRANT_LOG: usize = 1 << 18;

/// The dealer. See the module documentation.
#[derive(Debug, Clone)]
pub struct Dealer {
    cfg: DealerConfig,
    /// The data epoch being dealt.
    epoch: u64,
    /// The next never-dealt split index of `epoch`.
    next_fresh: u64,
    /// Splits given back, dealt before fresh ones (front first).
    pending: VecDeque<u64>,
    /// Grants on loan: grant → (split key, worker).
    leased: BTreeMap<u64, (u64, u32)>,
    /// Splits finished, all epochs together.
    done: u64,
    next_grant: u64,
    /// Finished grants, oldest first: (grant, split).
    completed: VecDeque<(u64, u64)>,
    /// Grants that ended unfinished, oldest first.
    abandoned: VecDeque<u64>,
    /// The grants of `completed` and `abandoned` (membership without a scan).
    known: BTreeSet<u64>,
    /// Splits given back.
    returned: u64,
    /// Changes made so far ([`DealerOp`] numbers).
    ops: u64,
    /// Changes not yet taken by [`Dealer::take_journal`] (only while journaling).
    journal: Vec<DealerOp>,
    journaling: bool,
}

impl Dealer {
    /// A dealer at the start of the first epoch.
    pub fn new(cfg: DealerConfig) -> Self {
        let next_grant = cfg.grant_floor.max(1);
        Dealer {
            cfg,
            epoch: 0,
            next_fresh: 0,
            pending: VecDeque::new(),
            leased: BTreeMap::new(),
            done: 0,
            next_grant,
            completed: VecDeque::new(),
            abandoned: VecDeque::new(),
            known: BTreeSet::new(),
            returned: 0,
            ops: 0,
            journal: Vec::new(),
            journaling: false,
        }
    }

    /// Keeps every change from now on for [`Dealer::take_journal`].
    pub fn set_journaling(&mut self, on: bool) {
        self.journaling = on;
        if !on {
            self.journal.clear();
        }
    }

    /// The changes made since the last call (while journaling), in order.
    pub fn take_journal(&mut self) -> Vec<DealerOp> {
        std::mem::take(&mut self.journal)
    }

    /// Changes made so far (written with the state into checkpoints).
    pub fn ops(&self) -> u64 {
        self.ops
    }

    fn record(&mut self, op: impl FnOnce(u64) -> DealerOp) {
        self.ops += 1;
        if self.journaling {
            self.journal.push(op(self.ops));
        }
    }

    /// Makes again, on this dealer (restored from a checkpoint), the journal's changes made after it (those
    /// numbered above [`Dealer::ops`]), in order. All or nothing: a journal that does not continue this
    /// state (a gap in the numbers, a grant dealt that differs) changes nothing and says why. Returns how
    /// many changes were made again.
    pub fn replay(&mut self, journal: &[DealerOp]) -> Result<u64, String> {
        let before = self.clone();
        let journaling = std::mem::replace(&mut self.journaling, false);
        let mut made = 0;
        let mut outcome = Ok(());
        for change in journal.iter().filter(|c| c.op() > before.ops) {
            if change.op() != self.ops + 1 {
                outcome = Err(format!("the journal goes from change {} to {}", self.ops, change.op()));
                break;
            }
            match *change {
                DealerOp::Deal { worker, finished, grant, .. } => {
                    let (split, _) = self.deal(worker, finished);
                    if split.map(|s| s.grant) != grant {
                        outcome = Err(format!(
                            "change {} dealt grant {:?} then, {:?} now",
                            change.op(),
                            grant,
                            split.map(|s| s.grant)
                        ));
                        break;
                    }
                }
                DealerOp::GiveBack { worker, .. } => {
                    if self.give_back(worker) == 0 {
                        outcome = Err(format!("change {}: worker {worker} held no split", change.op()));
                        break;
                    }
                }
                DealerOp::Floor { next_grant, .. } => {
                    if next_grant < self.next_grant {
                        outcome = Err(format!(
                            "change {}: grants from {next_grant}, below the next one, {}",
                            change.op(),
                            self.next_grant
                        ));
                        break;
                    }
                    self.next_grant = next_grant;
                    self.ops += 1;
                }
            }
            made += 1;
        }
        if let Err(e) = outcome {
            *self = before;
            self.journaling = journaling;
            return Err(e);
        }
        self.journaling = journaling;
        Ok(made)
    }

    /// Grants from here on are numbered from at least the settings' floor (after a restore and replay:
    /// the replayed grants keep their numbers, new ones never reuse a number of the previous life).
    pub fn raise_grant_floor(&mut self) {
        let next_grant = self.next_grant.max(self.cfg.grant_floor).max(1);
        if next_grant != self.next_grant {
            self.next_grant = next_grant;
            // Journaled: a later restore from the same checkpoint deals the grants of this life again
            // under the same numbers.
            self.record(|op| DealerOp::Floor { op, next_grant });
        }
    }

    fn log_completed(&mut self, grant: u64, key: u64) {
        if self.completed.len() >= GRANT_LOG {
            if let Some((old, _)) = self.completed.pop_front() {
                self.known.remove(&old);
            }
        }
        self.completed.push_back((grant, key));
        self.known.insert(grant);
    }

    fn log_abandoned(&mut self, grant: u64) {
        if self.abandoned.len() >= GRANT_LOG {
            if let Some(old) = self.abandoned.pop_front() {
                self.known.remove(&old);
            }
        }
        self.abandoned.push_back(grant);
        self.known.insert(grant);
    }

    /// Whether `worker` holds `grant` now.
    pub fn holds(&self, worker: u32, grant: u64) -> bool {
        self.leased.get(&grant).is_some_and(|(_, w)| *w == worker)
    }

    /// After the cluster went back to a checkpoint: this dealer (restored from it) numbers its grants on from
    /// where `before` (the dealer before the rollback) was, so no number is dealt twice, and counts the
    /// grants `before` had on loan that the checkpoint does not know as abandoned (their holders' pushes
    /// since count as replayed).
    pub fn continue_after(&mut self, before: &Dealer) {
        self.next_grant = self.next_grant.max(before.next_grant);
        let unknown: Vec<u64> =
            before.leased.keys().filter(|g| !self.leased.contains_key(g) && !self.known.contains(g)).copied().collect();
        for g in unknown {
            self.log_abandoned(g);
        }
    }

    /// The settings.
    pub fn config(&self) -> &DealerConfig {
        &self.cfg
    }

    /// Deals `worker` its next split, after recording `finished` (a grant of this worker whose every batch
    /// it pushed). Any other grant the worker holds is given back. Returns the split (None: nothing is left
    /// to deal, every epoch is dealt) and whether `finished` was accepted as this worker's.
    pub fn deal(&mut self, worker: u32, finished: Option<u64>) -> (Option<DataSplit>, bool) {
        let accepted = match finished {
            Some(g) => match self.leased.get(&g) {
                Some((key, holder)) if *holder == worker => {
                    let key = *key;
                    self.leased.remove(&g);
                    self.done += 1;
                    self.log_completed(g, key);
                    true
                }
                // Not this worker's (given back after its lease expired, or dealt before the coordinator
                // went back to a checkpoint): what it trained counts as replayed. Only a number this dealer
                // has dealt, that nobody holds and no log knows, is recorded (a worker cannot enter another's
                // grant, or a future one).
                Some(_) => false,
                None => {
                    if g < self.next_grant && !self.known.contains(&g) {
                        self.log_abandoned(g);
                    }
                    false
                }
            },
            None => false,
        };
        let given = self.give_back_quietly(worker);
        let dealt = self.next_key().map(|key| {
            let grant = self.next_grant;
            self.next_grant += 1;
            self.leased.insert(grant, (key, worker));
            self.cfg.table.split(key, grant)
        });
        let grant = dealt.map(|s| s.grant);
        // A request that reports nothing, gives nothing back and is dealt nothing (a worker asking again at
        // the end while others finish their splits) changes nothing: not a change to journal.
        if finished.is_some() || given > 0 || grant.is_some() {
            self.record(|op| DealerOp::Deal { op, worker, finished, grant });
        }
        (dealt, accepted)
    }

    fn next_key(&mut self) -> Option<u64> {
        if let Some(key) = self.pending.pop_front() {
            return Some(key);
        }
        let per_epoch = self.cfg.table.per_epoch();
        if per_epoch == 0 {
            return None;
        }
        if self.next_fresh >= per_epoch {
            if self.cfg.epochs.is_some_and(|e| self.epoch + 1 >= e) {
                return None;
            }
            self.epoch += 1;
            self.next_fresh = 0;
        }
        let key = (self.epoch << 32) | self.next_fresh;
        self.next_fresh += 1;
        Some(key)
    }

    /// Gives back every split `worker` holds (it left, its lease expired, or it asked for another one).
    pub fn give_back(&mut self, worker: u32) -> usize {
        let given = self.give_back_quietly(worker);
        if given > 0 {
            self.record(|op| DealerOp::GiveBack { op, worker });
        }
        given
    }

    /// [`Dealer::give_back`] as part of another change (not a change of its own).
    fn give_back_quietly(&mut self, worker: u32) -> usize {
        let mine: Vec<u64> = self.leased.iter().filter(|(_, (_, w))| *w == worker).map(|(g, _)| *g).collect();
        for g in mine.iter().rev() {
            if let Some((key, _)) = self.leased.remove(g) {
                self.pending.push_front(key);
                self.log_abandoned(*g);
                self.returned += 1;
            }
        }
        mine.len()
    }

    /// Gives back every split on loan (the cluster went back to a checkpoint: what was trained under them
    /// since is gone from the model, and their holders are told to drop them).
    pub fn give_back_all(&mut self) {
        let workers: Vec<u32> = self.leased.values().map(|(_, w)| *w).collect();
        for w in workers {
            self.give_back(w);
        }
    }

    /// Every epoch dealt and every split finished.
    pub fn finished(&self) -> bool {
        self.cfg.epochs.is_some_and(|e| self.epoch + 1 >= e)
            && self.next_fresh >= self.cfg.table.per_epoch()
            && self.pending.is_empty()
            && self.leased.is_empty()
    }

    /// The data epoch being dealt.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Splits finished so far.
    pub fn splits_done(&self) -> u64 {
        self.done
    }

    /// Splits waiting to be dealt again.
    pub fn splits_pending(&self) -> u64 {
        self.pending.len() as u64
    }

    /// Splits given back so far.
    pub fn splits_returned(&self) -> u64 {
        self.returned
    }

    /// Grants on loan.
    pub fn leases(&self) -> Vec<GrantLease> {
        self.leased.iter().map(|(g, (key, w))| GrantLease { grant: *g, split: *key, worker: *w }).collect()
    }

    /// Finished grants `(grant, split)` remembered, oldest first.
    pub fn completed(&self) -> impl Iterator<Item = &(u64, u64)> {
        self.completed.iter()
    }

    /// Grants that ended unfinished, remembered, oldest first.
    pub fn abandoned(&self) -> impl Iterator<Item = &u64> {
        self.abandoned.iter()
    }

    /// Writes the state (not the settings beyond the table's fingerprint and the epoch count).
    pub(crate) fn write_to(&self, w: &mut Writer) {
        w.u64(self.cfg.table.fingerprint());
        w.u64(self.cfg.epochs.unwrap_or(0));
        w.u64s(&[self.epoch, self.next_fresh, self.done, self.next_grant, self.returned]);
        w.u64s(&self.pending.iter().copied().collect::<Vec<_>>());
        let leased: Vec<u64> = self.leased.iter().flat_map(|(g, (k, w))| [*g, *k, u64::from(*w)]).collect();
        w.u64s(&leased);
        w.u64s(&self.completed.iter().flat_map(|(g, k)| [*g, *k]).collect::<Vec<_>>());
        w.u64s(&self.abandoned.iter().copied().collect::<Vec<_>>());
        w.u64(self.ops);
    }

    /// Reads a state written by [`Dealer::write_to`] into a dealer of `cfg`; refused when the checkpoint
    /// was cut from other data or with another split size.
    pub(crate) fn read_from(cfg: DealerConfig, r: &mut Reader<'_>) -> Result<Dealer, CheckpointError> {
        let corrupt = |what: &str| CheckpointError::Corrupt(format!("data dealer: {what}"));
        let fingerprint = r.u64()?;
        if fingerprint != cfg.table.fingerprint() {
            return Err(CheckpointError::Mismatch(
                "its data dealer cut other data into splits (another --data, --split-lines, or the file changed)"
                    .into(),
            ));
        }
        let _epochs = r.u64()?;
        let fields = r.u64s("data dealer")?;
        let [epoch, next_fresh, done, next_grant, returned] = fields[..] else { return Err(corrupt("counters")) };
        let per_epoch = cfg.table.per_epoch();
        let valid_key = |k: u64| (k & 0xffff_ffff) < per_epoch && (k >> 32) <= epoch;
        let pending: VecDeque<u64> = r.u64s("data dealer")?.into();
        if next_fresh > per_epoch || pending.iter().any(|k| !valid_key(*k)) {
            return Err(corrupt("queue"));
        }
        let raw = r.u64s("data dealer")?;
        if raw.len() % 3 != 0 {
            return Err(corrupt("leases"));
        }
        let mut leased = BTreeMap::new();
        for l in raw.chunks_exact(3) {
            let worker = u32::try_from(l[2]).map_err(|_| corrupt("leases"))?;
            if !valid_key(l[1]) {
                return Err(corrupt("leases"));
            }
            leased.insert(l[0], (l[1], worker));
        }
        let raw = r.u64s("data dealer")?;
        if raw.len() % 2 != 0 || raw.len() / 2 > GRANT_LOG {
            return Err(corrupt("finished grants"));
        }
        let completed = raw.chunks_exact(2).map(|c| (c[0], c[1])).collect();
        let abandoned: VecDeque<u64> = r.u64s("data dealer")?.into();
        if abandoned.len() > GRANT_LOG {
            return Err(corrupt("abandoned grants"));
        }
        if epoch >= 1 << 40 {
            return Err(corrupt("epoch"));
        }
        // Format 5 on: the changes made (the journal continues from there; before, none was kept).
        let ops = if r.format() >= 5 { r.u64()? } else { 0 };
        if ops >= 1 << 62 {
            return Err(corrupt("change count"));
        }
        let completed: VecDeque<(u64, u64)> = completed;
        let known = completed.iter().map(|(g, _)| *g).chain(abandoned.iter().copied()).collect();
        Ok(Dealer {
            cfg,
            epoch,
            next_fresh,
            pending,
            leased,
            done,
            next_grant,
            completed,
            abandoned,
            known,
            returned,
            ops,
            journal: Vec::new(),
            journaling: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(n: u64) -> DealerConfig {
        let splits = (0..n)
            .map(|i| FileSplit { file: 0, first_line: 1 + 10 * i, start: 100 * i, end: 100 * (i + 1), lines: 10 })
            .collect();
        DealerConfig {
            table: SplitTable::Files { files: vec!["a.tsv".into()], splits },
            epochs: Some(2),
            grant_floor: 0,
        }
    }

    #[test]
    fn every_split_is_finished_once_per_epoch_and_a_departed_workers_split_is_dealt_again() {
        let mut d = Dealer::new(files(3));
        let (a, _) = d.deal(0, None);
        let (b, _) = d.deal(1, None);
        let (a, b) = (a.expect("a split"), b.expect("a split"));
        assert_eq!((a.key, b.key, a.first_line, b.start), (0, 1, 1, 100));
        // Worker 1 dies: its split goes back to the front of the queue.
        assert_eq!(d.give_back(1), 1);
        let (next, ok) = d.deal(0, Some(a.grant));
        assert!(ok);
        let next = next.expect("split 1 again");
        assert_eq!(next.key, 1);
        assert_ne!(next.grant, b.grant, "a new grant for the second deal");
        // A late report of the dead worker's grant is not accepted.
        let (late, ok) = d.deal(1, Some(b.grant));
        assert!(!ok);
        assert_eq!(late.map(|s| s.key), Some(2));
        let mut keys = vec![];
        let mut held = vec![(0u32, next.grant), (1, late.expect("late").grant)];
        while let Some((w, g)) = held.pop() {
            if let (Some(s), true) = d.deal(w, Some(g)) {
                keys.push(s.key);
                held.push((w, s.grant));
            }
        }
        assert_eq!(keys, vec![1 << 32, (1 << 32) | 1, (1 << 32) | 2]);
        assert!(d.finished());
        assert_eq!(d.splits_done(), 6);
        assert_eq!(d.splits_returned(), 1);
        assert_eq!(d.abandoned().copied().collect::<Vec<_>>(), vec![b.grant]);
        assert_eq!(d.deal(0, None).0, None, "nothing is left");
    }

    #[test]
    fn a_finished_grant_that_is_not_the_workers_changes_nothing_it_should_not() {
        let mut d = Dealer::new(files(4));
        let (a, _) = d.deal(0, None);
        let a = a.expect("a split");
        // Worker 1 reports worker 0's grant, and a number never dealt: neither is finished nor logged.
        let (_, ok) = d.deal(1, Some(a.grant));
        assert!(!ok);
        let (_, ok) = d.deal(2, Some(a.grant + 1000));
        assert!(!ok);
        assert!(d.holds(0, a.grant));
        assert_eq!(d.abandoned().count(), 0);
        assert_eq!(d.splits_done(), 0);
        // A dealt number nobody holds any more (given back) is a replay, logged once.
        d.give_back(0);
        d.deal(0, Some(a.grant));
        assert_eq!(d.abandoned().copied().collect::<Vec<_>>(), vec![a.grant]);
    }

    /// The dealer's state as a checkpoint holds it.
    fn saved(d: &Dealer) -> Vec<u8> {
        let mut w = Writer::reusing(Vec::new(), 0);
        d.write_to(&mut w);
        w.buf
    }

    #[test]
    fn after_a_rollback_grant_numbers_go_on_and_unknown_loans_are_abandoned() {
        let mut before = Dealer::new(files(6));
        let (a, _) = before.deal(0, None);
        let saved = saved(&before);
        // After the checkpoint: two more deals.
        let (b, _) = before.deal(1, None);
        let (c, _) = before.deal(2, None);
        let mut back = Dealer::read_from(files(6), &mut Reader::new(&saved).expect("header")).expect("restore");
        back.give_back_all();
        back.continue_after(&before);
        let (next, _) = back.deal(3, None);
        let next = next.expect("a split");
        assert!(next.grant > c.expect("c").grant, "no grant number is dealt twice");
        let abandoned: Vec<u64> = back.abandoned().copied().collect();
        for g in [a.expect("a").grant, b.expect("b").grant] {
            assert!(abandoned.contains(&g), "{g} in {abandoned:?}");
        }
    }

    #[test]
    fn the_state_round_trips_and_refuses_another_cut() {
        let mut d = Dealer::new(files(4));
        let (a, _) = d.deal(3, None);
        d.deal(5, None);
        d.deal(3, a.map(|s| s.grant));
        d.give_back(5);
        let saved = saved(&d);
        let mut r = Reader::new(&saved).expect("header");
        let back = Dealer::read_from(files(4), &mut r).expect("same cut");
        assert_eq!(format!("{back:?}"), format!("{d:?}"));
        let mut r = Reader::new(&saved).expect("header");
        let err = Dealer::read_from(files(5), &mut r).expect_err("another cut");
        assert!(err.to_string().contains("--split-lines"), "{err}");
    }

    #[test]
    fn a_journal_replayed_on_the_checkpoint_continues_the_epoch_and_one_that_does_not_fit_changes_nothing() {
        let mut live = Dealer::new(files(6));
        let (a, _) = live.deal(0, None);
        let saved = saved(&live);
        // After the checkpoint, journaled: split 0 finished, others dealt, a worker gone.
        live.set_journaling(true);
        let (b, _) = live.deal(1, None);
        live.deal(0, a.map(|s| s.grant));
        live.deal(2, None);
        live.give_back(1);
        let journal = live.take_journal();
        assert_eq!(journal.len(), 4);
        assert_eq!(journal.iter().map(DealerOp::op).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        for c in &journal {
            assert_eq!(DealerOp::parse(&c.to_line()), Some(*c));
        }
        let restore = || Dealer::read_from(files(6), &mut Reader::new(&saved).expect("header")).expect("restore");
        let mut back = restore();
        assert_eq!(back.ops(), 1);
        assert_eq!(back.replay(&journal), Ok(4));
        assert_eq!(format!("{back:?}"), format!("{:?}", Dealer { journaling: false, ..live.clone() }));
        assert_eq!(back.splits_done(), 1, "split 0 stays finished: not dealt again");
        // Replaying what the checkpoint already holds, or again, changes nothing more.
        assert_eq!(back.replay(&journal), Ok(0));
        // A journal with a gap, or whose deal differs from what this state deals, is refused whole.
        let mut gap = journal.clone();
        gap.remove(1);
        let mut other = restore();
        assert!(other.replay(&gap).expect_err("a gap").contains("goes from change"));
        assert_eq!(format!("{other:?}"), format!("{:?}", restore()));
        let mut wrong = journal.clone();
        wrong[0] = DealerOp::Deal { op: 2, worker: 1, finished: None, grant: Some(b.expect("b").grant + 9) };
        assert!(other.replay(&wrong).expect_err("another grant").contains("dealt grant"));
        assert_eq!(format!("{other:?}"), format!("{:?}", restore()));
        assert_eq!(DealerOp::parse("deal 4 1 -"), None, "a torn line");
    }

    #[test]
    fn a_second_restore_from_the_same_checkpoint_replays_both_lives() {
        let floor = |life: u64| DealerConfig { grant_floor: life << 32, ..files(8) };
        let mut first = Dealer::new(floor(1));
        let (a, _) = first.deal(0, None);
        let saved = saved(&first);
        first.set_journaling(true);
        first.deal(0, a.map(|s| s.grant));
        let mut journal = first.take_journal();
        // Second life: restored from the checkpoint, the journal replayed, grants from its own floor.
        let restore = |life: u64| Dealer::read_from(floor(life), &mut Reader::new(&saved).expect("h")).expect("r");
        let mut second = restore(2);
        assert_eq!(second.replay(&journal), Ok(1));
        second.set_journaling(true);
        second.raise_grant_floor();
        second.give_back_all();
        let (c, _) = second.deal(1, None);
        assert_eq!(c.expect("c").grant, 2 << 32, "the second life numbers from its floor");
        journal.extend(second.take_journal());
        // Killed before its first checkpoint: the third life restores the same checkpoint and replays both.
        let mut third = restore(3);
        assert_eq!(third.replay(&journal), Ok(journal.len() as u64), "{journal:?}");
        let same = Dealer { cfg: third.cfg.clone(), journaling: false, ..second.clone() };
        assert_eq!(format!("{third:?}"), format!("{same:?}"), "the state of the second life, its settings apart");
        third.raise_grant_floor();
        assert_eq!(third.deal(2, None).0.expect("d").grant, 3 << 32);
    }

    #[test]
    fn synthetic_splits_are_consecutive_sample_ranges_without_end() {
        let cfg = DealerConfig {
            table: SplitTable::Synthetic { samples_per_split: 500 },
            epochs: None,
            grant_floor: 7 << 32,
        };
        let mut d = Dealer::new(cfg);
        let s: Vec<DataSplit> = (0..3).filter_map(|w| d.deal(w, None).0).collect();
        assert_eq!(s.iter().map(|s| (s.start, s.end)).collect::<Vec<_>>(), vec![(0, 500), (500, 1000), (1000, 1500)]);
        assert_eq!(s[0].grant, 7 << 32);
        assert!(!d.finished());
    }
}
