//! Where a worker's training batches come from: its fixed share of the data (`--data-sharding static`), or
//! the splits the coordinator deals it one at a time (`dynamic`). A batch never mixes two splits: the last
//! batch of a split is short, and each dense push is tagged with the split its samples came from, so every
//! shard can count what was trained per split.

use crate::client::Client;
use crate::criteo::{DataSpec, LineError, Sample, SplitSamples, SyntheticCriteo, TrainingStream};
use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{DataSplit, DataTag};
use std::sync::Arc;

/// The next batch and where it came from.
#[derive(Debug)]
pub struct Batch {
    /// The samples (empty: the data is used up).
    pub samples: Vec<Sample>,
    /// The split they came from (dynamic sharding).
    pub tag: Option<DataTag>,
}

/// A worker's source of batches.
#[derive(Debug)]
pub enum Feed {
    /// The worker's fixed share.
    Static(Box<TrainingStream>),
    /// Dealt splits.
    Dealt(Box<Dealt>),
}

/// Dynamic sharding: the split being trained and what is known of the dealing.
#[derive(Debug)]
pub struct Dealt {
    spec: DataSpec,
    synthetic: Option<Arc<SyntheticCriteo>>,
    current: Option<(DataSplit, SplitSamples)>,
    /// A split whose every batch was pushed, to report with the next request.
    finished: Option<u64>,
    /// The dealer has nothing more.
    done: bool,
    /// The client's rollback count when the current split was dealt (a cluster rollback drops it).
    rollbacks: u64,
    /// Splits dealt to this worker.
    pub splits: u64,
    /// The highest data epoch dealt to this worker (0-based).
    pub last_epoch: u64,
    bad_lines: u64,
    first_errors: Vec<LineError>,
}

impl Feed {
    /// The fixed share `part` of `parts` of `spec`, for `epochs` passes over a file.
    pub fn fixed(spec: &DataSpec, part: u64, parts: u64, epochs: Option<u64>) -> Result<Self> {
        let stream =
            TrainingStream::new(spec, part, parts).and_then(|s| s.with_epochs(epochs)).map_err(|e| anyhow!(e))?;
        Ok(Feed::Static(Box::new(stream)))
    }

    /// Splits of `spec` dealt by the coordinator.
    pub fn dealt(spec: &DataSpec) -> Self {
        let synthetic = match spec {
            DataSpec::Synthetic { seed } => Some(SyntheticCriteo::shared(*seed)),
            DataSpec::Files(_) => None,
        };
        Feed::Dealt(Box::new(Dealt {
            spec: spec.clone(),
            synthetic,
            current: None,
            finished: None,
            done: false,
            rollbacks: 0,
            splits: 0,
            last_epoch: 0,
            bad_lines: 0,
            first_errors: Vec::new(),
        }))
    }

    /// The next batch of up to `n` samples from what this worker holds, without asking anyone: a static
    /// share's next samples, or the rest of the current split. `None`: the current split is used up (or none
    /// is held) and [`Feed::next_dealt`] must ask for the next one, once the pushes of this split are
    /// acknowledged.
    pub fn next_local(&mut self, n: usize) -> Result<Option<Batch>> {
        match self {
            Feed::Static(stream) => {
                Ok(Some(Batch { samples: stream.next_batch(n).map_err(|e| anyhow!(e))?, tag: None }))
            }
            Feed::Dealt(d) => d.next_local(n),
        }
    }

    /// The next batch, asking the dealer for a new split where the current one is used up (after
    /// reporting it finished). Empty when the data is used up.
    pub async fn next_dealt(&mut self, client: &Client, n: usize) -> Result<Batch> {
        loop {
            if let Some(batch) = self.next_local(n)? {
                return Ok(batch);
            }
            let Feed::Dealt(d) = self else { unreachable!("a static feed always has a batch") };
            if d.done {
                return Ok(Batch { samples: Vec::new(), tag: None });
            }
            d.deal(client).await?;
        }
    }

    /// Bad lines met so far.
    pub fn bad_lines(&self) -> u64 {
        match self {
            Feed::Static(s) => s.bad_lines,
            Feed::Dealt(d) => {
                d.bad_lines
                    + d.current.as_ref().filter(|(split, _)| split.key >> 32 == 0).map_or(0, |(_, s)| s.bad_lines())
            }
        }
    }

    /// The first bad lines met.
    pub fn first_errors(&self) -> Vec<LineError> {
        match self {
            Feed::Static(s) => s.first_errors.clone(),
            Feed::Dealt(d) => {
                let mut all = d.first_errors.clone();
                all.extend(d.current.iter().flat_map(|(_, s)| s.first_errors().iter().cloned()));
                all.truncate(20);
                all
            }
        }
    }

    /// Passes over the data so far: a static share's, or the data epochs dealt to this worker.
    pub fn epochs_done(&self) -> f64 {
        match self {
            Feed::Static(s) => s.epochs_done(),
            Feed::Dealt(d) if d.splits == 0 => 0.0,
            Feed::Dealt(d) => (d.last_epoch + 1) as f64,
        }
    }

    /// The dealing, if dynamic.
    pub fn dealt_state(&self) -> Option<&Dealt> {
        match self {
            Feed::Dealt(d) => Some(d),
            Feed::Static(_) => None,
        }
    }

    /// After a cluster rollback, the split in hand is dropped (what was trained of it since the checkpoint
    /// is gone; the coordinator deals it again) and the next batch comes from a new one. True when a
    /// rollback was seen since the split in hand was dealt.
    pub fn follow_rollbacks(&mut self, client: &Client) -> bool {
        let Feed::Dealt(d) = self else { return false };
        let seen = client.rollbacks_seen();
        if seen == d.rollbacks {
            return false;
        }
        d.rollbacks = seen;
        d.current = None;
        d.finished = None;
        true
    }
}

impl Dealt {
    fn next_local(&mut self, n: usize) -> Result<Option<Batch>> {
        let Some((split, samples)) = self.current.as_mut() else { return Ok(None) };
        let batch = samples.next_batch(n).map_err(|e| anyhow!(e))?;
        if batch.is_empty() {
            // Used up: report it with the next request.
            let (split, samples) = self.current.take().expect("a current split");
            self.finished = Some(split.grant);
            // Bad lines are the file's: counted in the first pass only.
            if split.key >> 32 == 0 {
                self.bad_lines += samples.bad_lines();
                let room = 20usize.saturating_sub(self.first_errors.len());
                self.first_errors.extend(samples.first_errors().iter().take(room).cloned());
            }
            return Ok(None);
        }
        let tag = DataTag { grant: split.grant, split: split.key, samples: batch.len() as u32 };
        Ok(Some(Batch { samples: batch, tag: Some(tag) }))
    }

    async fn deal(&mut self, client: &Client) -> Result<()> {
        let grant =
            client.next_split_waiting(self.finished.take()).await.context("asking the coordinator for a data split")?;
        self.rollbacks = client.rollbacks_seen();
        let Some(split) = grant.split else {
            self.done = true;
            return Ok(());
        };
        let samples = match (&self.spec, &self.synthetic) {
            (DataSpec::Synthetic { .. }, Some(data)) if grant.files == 0 => {
                SplitSamples::synthetic(data.clone(), split.start, split.end)
            }
            (DataSpec::Files(paths), _) if grant.files as usize == paths.len() => {
                let path = &paths[split.file as usize % paths.len()];
                SplitSamples::file(path, split.first_line, split.start, split.end).map_err(|e| anyhow!(e))?
            }
            (DataSpec::Files(paths), _) if grant.files == 0 => {
                bail!("the coordinator deals synthetic data, this worker's --data names {} file(s)", paths.len())
            }
            (DataSpec::Files(paths), _) => bail!(
                "the coordinator deals {} data file(s), this worker's --data names {}: give every worker the \
                 coordinator's files, in the same order",
                grant.files,
                paths.len()
            ),
            (DataSpec::Synthetic { .. }, _) => {
                bail!("the coordinator deals {} data file(s), this worker's --data is synthetic", grant.files)
            }
        };
        self.splits += 1;
        self.last_epoch = self.last_epoch.max(split.key >> 32);
        self.current = Some((split, samples));
        Ok(())
    }
}
