//! A shard's request record (`--record-requests DIR`, hidden; for tests of replication): every request and
//! tick that changes the shard's state, in the order its core handled them, each with the index the
//! replica log gave it, plus the points a replay needs — the state the process started serving from, where
//! a backup started following, where a checkpoint was taken, where a rollback replaced the state. A record
//! is written by the core's thread one item per write (a process killed mid-run loses at most the item in
//! flight).
//!
//! [`replay`] (`gaps server … --replay-records A,B --replay-checkpoint FILE`) applies the records of one
//! shard's successive serving processes (the primary's, then the copy's that took it over) to a fresh core
//! and checks that the copy that took over started from exactly the primary's entries up to the last it
//! had (its snapshot and log), and that the final state equals the checkpoint's: the model a fail-over
//! leaves is the replay of what was acknowledged, each request once, in order.

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{Frame, Limits};
use gaps_shard::replica::{changes_state, Entry, LogEntry};
use gaps_shard::{ShardConfig, ShardCore};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

const MAGIC: &[u8; 8] = b"GAPSREC1";

/// One item of a record.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// The state this process started serving the shard from (`ShardCore::copy_state`), and the replica-log
    /// index of its primary's that it continues (0 for a process serving its own shard).
    Start { process: u32, index: u64, state: Vec<u8> },
    /// A request or tick as the core handled it, with the replica log's index (0: not logged).
    Entry(Vec<u8>),
    /// Backup `backup` started following the log from a snapshot holding every entry up to `index`.
    Followed { backup: u32, index: u64 },
    /// A checkpoint with this id was taken here.
    Checkpoint { id: u64 },
    /// A rollback replaced the state here.
    Replaced,
}

/// Writes one shard's record (see the module's text).
#[derive(Debug)]
pub struct Recorder {
    file: std::fs::File,
    path: PathBuf,
}

impl Recorder {
    /// A new record of shard `shard` served by process `process` in `dir` (a fresh file: `shard-S-process-P.rec`,
    /// or with `-N` added when that exists), starting from `core`'s state as the continuation of index `index`.
    pub fn create(dir: &Path, shard: u32, process: u32, index: u64, core: &ShardCore) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut n = 0u32;
        let (file, path) = loop {
            let name = match n {
                0 => format!("shard-{shard}-process-{process}.rec"),
                n => format!("shard-{shard}-process-{process}-{n}.rec"),
            };
            let path = dir.join(name);
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (file, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            }
        };
        let mut rec = Recorder { file, path };
        rec.file.write_all(MAGIC).with_context(|| format!("writing {}", rec.path.display()))?;
        let state = core.copy_state().map_err(|e| anyhow!("copying the state to record: {e}"))?;
        rec.write(&Item::Start { process, index, state })?;
        Ok(rec)
    }

    /// Where the record goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records a request the core is about to handle (only those that change its state, as the log).
    pub fn request(&mut self, index: u64, now: Duration, frame: &Frame) {
        if changes_state(&frame.msg) {
            self.entry(LogEntry { index, entry: Entry::Request { now, frame: Box::new(frame.clone()) } });
        }
    }

    /// Records a tick.
    pub fn tick(&mut self, index: u64, now: Duration) {
        self.entry(LogEntry { index, entry: Entry::Tick { now } });
    }

    fn entry(&mut self, entry: LogEntry) {
        match entry.encode() {
            Ok(bytes) => {
                let written = self.write_parts(2, &[&bytes]);
                self.log_failure(written);
            }
            Err(e) => tracing::warn!(path = %self.path.display(), %e, "a request could not be recorded"),
        }
    }

    /// Records a point a replay needs (a backup following, a checkpoint, a rollback).
    pub fn item(&mut self, item: &Item) {
        let written = self.write(item);
        self.log_failure(written);
    }

    fn log_failure(&self, written: Result<()>) {
        if let Err(e) = written {
            tracing::warn!(path = %self.path.display(), error = format!("{e:#}"), "the request record is incomplete");
        }
    }

    fn write(&mut self, item: &Item) -> Result<()> {
        match item {
            Item::Start { process, index, state } => {
                self.write_parts(1, &[&process.to_le_bytes(), &index.to_le_bytes(), state])
            }
            Item::Entry(bytes) => self.write_parts(2, &[bytes]),
            Item::Followed { backup, index } => self.write_parts(3, &[&backup.to_le_bytes(), &index.to_le_bytes()]),
            Item::Checkpoint { id } => self.write_parts(4, &[&id.to_le_bytes()]),
            Item::Replaced => self.write_parts(5, &[]),
        }
    }

    /// One item: its kind, its length, then `parts` one after the other, in one write.
    fn write_parts(&mut self, kind: u8, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mut out = Vec::with_capacity(9 + len);
        out.push(kind);
        out.extend_from_slice(&(len as u64).to_le_bytes());
        parts.iter().for_each(|p| out.extend_from_slice(p));
        self.file.write_all(&out).with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Reads a record; an item cut short at the end (the process was killed while writing it) ends it.
pub fn read(path: &Path) -> Result<Vec<Item>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let rest = bytes.strip_prefix(&MAGIC[..]).with_context(|| format!("{} is not a request record", path.display()))?;
    let mut items = Vec::new();
    let mut at = 0usize;
    let word = |b: &[u8], at: usize| -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(w)
    };
    while at + 9 <= rest.len() {
        let kind = rest[at];
        let len = usize::try_from(word(rest, at + 1)).unwrap_or(usize::MAX);
        let Some(body) = rest.get(at + 9..).and_then(|b| b.get(..len)) else { break };
        at += 9 + len;
        let bad = || anyhow!("{}: a malformed item of kind {kind}", path.display());
        items.push(match kind {
            1 if body.len() >= 12 => Item::Start {
                process: u32::from_le_bytes(body[..4].try_into().map_err(|_| bad())?),
                index: word(body, 4),
                state: body[12..].to_vec(),
            },
            2 => Item::Entry(body.to_vec()),
            3 if body.len() == 12 => Item::Followed {
                backup: u32::from_le_bytes(body[..4].try_into().map_err(|_| bad())?),
                index: word(body, 4),
            },
            4 if body.len() == 8 => Item::Checkpoint { id: word(body, 0) },
            5 if body.is_empty() => Item::Replaced,
            _ => return Err(bad()),
        });
    }
    Ok(items)
}

/// Applies the entries of `items` to `core`, in order.
fn apply(core: &mut ShardCore, items: &[Item], path: &Path) -> Result<u64> {
    let limits = Limits { max_payload_bytes: u64::MAX >> 1, ..Limits::default() };
    let mut applied = 0;
    for item in items {
        match item {
            Item::Entry(bytes) => {
                let entry =
                    LogEntry::decode(bytes, &limits).map_err(|e| anyhow!("{}: an entry: {e}", path.display()))?;
                match entry.entry {
                    Entry::Request { now, frame } => drop(core.handle(*frame, now)),
                    Entry::Tick { now } => drop(core.tick(now)),
                }
                applied += 1;
            }
            Item::Replaced => bail!("{}: a rollback replaced the state; a replay cannot cross it", path.display()),
            Item::Start { .. } | Item::Followed { .. } | Item::Checkpoint { .. } => {}
        }
    }
    Ok(applied)
}

/// A core's checkpoint without the counters reads move (what a copy's state differs from its primary's by).
fn state_bytes(core: &mut ShardCore) -> Result<Vec<u8>> {
    core.forget_read_counters();
    core.checkpoint(0).map_err(|e| anyhow!("{e}"))
}

/// Where a process that took the shard over from the record `items` started: just after the last item
/// that brought its copy to `index` (the entry with that index, or its snapshot's following point).
fn takeover_point(items: &[Item], process: u32, index: u64) -> Option<usize> {
    items.iter().rposition(|item| match item {
        Item::Entry(bytes) => index > 0 && bytes.get(..8).is_some_and(|b| b == index.to_le_bytes()),
        Item::Followed { backup, index: i } => *backup == process && *i == index,
        _ => false,
    })
}

/// What a replay found (printed as one JSON line by `gaps server --replay-records`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Replayed {
    /// Entries applied (requests and ticks).
    pub entries: u64,
    /// Pushes applied by the replayed core.
    pub pushes_applied: u64,
    /// The checkpoint the final state was found equal to, if one was given.
    pub equal_to: Option<PathBuf>,
}

/// Replays the records `paths` of shard `cfg.shard` (the first process's, then each that took it over from
/// the one before) and, with `checkpoint`, checks the final state against it (see the module's text).
pub fn replay(cfg: &ShardConfig, paths: &[PathBuf], checkpoint: Option<&Path>) -> Result<Replayed> {
    let records: Vec<(PathBuf, Vec<Item>)> = paths.iter().map(|p| Ok((p.clone(), read(p)?))).collect::<Result<_>>()?;
    let Some((first_path, first)) = records.first() else { bail!("no request records to replay") };
    let Some(Item::Start { state, .. }) = first.first() else {
        bail!("{} does not start with a state", first_path.display())
    };
    let mut core = ShardCore::from_copy(cfg.clone(), state).map_err(|e| anyhow!("{}: {e}", first_path.display()))?;
    let mut entries = 0;
    for pair in records.windows(2) {
        let [(before_path, before), (path, items)] = pair else { continue };
        let Some(Item::Start { process, index, state }) = items.first() else {
            bail!("{} does not start with a state", path.display())
        };
        let cut = takeover_point(before, *process, *index).with_context(|| {
            format!("{} has no entry {index}, where process {process} took the shard over", before_path.display())
        })?;
        entries += apply(&mut core, &before[..=cut], before_path)?;
        let mut copy = ShardCore::from_copy(cfg.clone(), state).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        if state_bytes(&mut copy)? != state_bytes(&mut core)? {
            bail!(
                "process {process} took shard {} over from a state that is not the replay of {} up to entry {index}",
                cfg.shard,
                before_path.display()
            );
        }
    }
    let (last_path, last) = records.last().expect("at least one record");
    let Some(checkpoint) = checkpoint else {
        entries += apply(&mut core, last, last_path)?;
        return Ok(Replayed { entries, pushes_applied: core.stats().pushes_applied, equal_to: None });
    };
    let bytes = crate::checkpoint::load_path(checkpoint)?;
    let id = ShardCore::checkpoint_info(&bytes).map_err(|e| anyhow!("{}: {e}", checkpoint.display()))?.id;
    let at = last
        .iter()
        .position(|i| *i == Item::Checkpoint { id })
        .with_context(|| format!("{} never took checkpoint {id} ({})", last_path.display(), checkpoint.display()))?;
    entries += apply(&mut core, &last[..at], last_path)?;
    let mut restored =
        ShardCore::restore(cfg.clone(), &bytes).map_err(|e| anyhow!("restoring {}: {e}", checkpoint.display()))?;
    restored.forget_read_counters();
    core.forget_read_counters();
    let (theirs, ours) = (restored.checkpoint(id), core.checkpoint(id));
    if theirs.map_err(|e| anyhow!("{e}"))? != ours.map_err(|e| anyhow!("{e}"))? {
        let mut what = String::new();
        for id in cfg.layout.chunks_of_shard(cfg.shard, cfg.num_shards) {
            let (a, b) = (restored.chunk_values(id), core.chunk_values(id));
            if let (Ok(a), Ok(b)) = (a, b) {
                if let Some(i) = a.iter().zip(b.iter()).position(|(x, y)| x.to_bits() != y.to_bits()) {
                    what =
                        format!(": chunk {id:?} differs first at {i} ({} in the checkpoint, {} replayed)", a[i], b[i]);
                    break;
                }
            }
        }
        bail!(
            "the checkpoint {} is not the replay of the records ({entries} entries){what}; counters: {:?} against {:?}",
            checkpoint.display(),
            restored.stats(),
            core.stats()
        );
    }
    Ok(Replayed { entries, pushes_applied: core.stats().pushes_applied, equal_to: Some(checkpoint.to_path_buf()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::wire::{Message, Push, PushChunk};

    fn config() -> ShardConfig {
        crate::test_support::shard_config(0, 1, gaps_kernels::Rule::Momentum)
    }

    fn push(cfg: &ShardConfig, seq: u64) -> Frame {
        let chunks: Vec<PushChunk> = cfg
            .layout
            .chunks_of_shard(cfg.shard, cfg.num_shards)
            .into_iter()
            .map(|id| PushChunk {
                id,
                read_version: 0,
                len: cfg.layout.chunk_len(id).expect("chunk") as u32,
                echo: false,
                dtype: gaps_common::dtype::WireDtype::F32,
            })
            .collect();
        let n: usize = chunks.iter().map(|c| c.len as usize).sum();
        let msg = Message::Push(Push {
            epoch: 3,
            worker: 1,
            seq,
            chunks,
            compute_ms: 1,
            step: seq,
            decisions: Default::default(),
            data: None,
        });
        Frame { msg, payload: (0..n).map(|i| 0.01 * (i as f32 - seq as f32)).collect() }
    }

    /// A primary logs six pushes and handles a seventh unlogged (its backup dropped); its copy, taken at
    /// entry 4, takes the shard over and handles three more and a tick. The replay of both records applies
    /// the primary's first four and the copy's four; a copy claiming to continue another entry, or one the
    /// record never had, is refused.
    #[test]
    fn a_takeover_is_replayed_from_the_primarys_record_up_to_the_copys_last_entry() {
        let dir = std::env::temp_dir().join(format!("gaps-record-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = config();
        let mut primary = ShardCore::new(cfg.clone()).expect("core");
        let mut rec = Recorder::create(&dir, 0, 1, 0, &primary).expect("record");
        let mut copied = None;
        for seq in 1..=7u64 {
            let (frame, now) = (push(&cfg, seq), Duration::from_millis(10 * seq));
            rec.request(if seq < 7 { seq } else { 0 }, now, &frame);
            let (reply, _) = primary.handle(frame, now);
            assert!(matches!(reply.msg, Message::Ack(_)), "{reply:?}");
            if seq == 4 {
                copied = Some(primary.copy_state().expect("copy"));
            }
        }
        let copied = copied.expect("copied at entry 4");
        let mut copy = ShardCore::from_copy(cfg.clone(), &copied).expect("copy");
        let mut taken = Recorder::create(&dir, 0, 0, 4, &copy).expect("record");
        for seq in 8..=10u64 {
            let (frame, now) = (push(&cfg, seq), Duration::from_millis(10 * seq));
            taken.request(0, now, &frame);
            copy.handle(frame, now);
        }
        taken.tick(0, Duration::from_millis(200));
        copy.tick(Duration::from_millis(200));
        // A checkpoint of the copy here; one more push after it.
        let store = crate::checkpoint::CheckpointStore::open(&dir, 0, 2).expect("store");
        let bytes = copy.checkpoint(77).expect("checkpoint");
        let info = ShardCore::checkpoint_info(&bytes).expect("info");
        let file = store.write(&info, 0, None, true, &bytes).expect("written");
        taken.item(&Item::Checkpoint { id: 77 });
        let (frame, now) = (push(&cfg, 11), Duration::from_millis(210));
        taken.request(0, now, &frame);
        copy.handle(frame, now);
        let paths = [rec.path().to_path_buf(), taken.path().to_path_buf()];
        let replayed = replay(&cfg, &paths, None).expect("the replay");
        assert_eq!((replayed.entries, replayed.pushes_applied), (9, 8));
        assert_eq!(copy.stats().pushes_applied, 8);
        let replayed = replay(&cfg, &paths, Some(&file)).expect("the replay up to the checkpoint equals it");
        assert_eq!((replayed.entries, replayed.pushes_applied), (8, 7));
        // The same records against a checkpoint of the state one push later: not equal.
        let later = copy.checkpoint(77).expect("checkpoint");
        let file = store.write(&info, 0, None, true, &later).expect("written");
        let refused = format!("{:#}", replay(&cfg, &paths, Some(&file)).expect_err("refused"));
        assert!(refused.contains("is not the replay"), "{refused}");

        let wrong = Recorder::create(&dir, 0, 0, 5, &ShardCore::from_copy(cfg.clone(), &copied).expect("copy"));
        let paths = [rec.path().to_path_buf(), wrong.expect("record").path().to_path_buf()];
        let refused = format!("{:#}", replay(&cfg, &paths, None).expect_err("refused"));
        assert!(refused.contains("not the replay"), "{refused}");
        let never = Recorder::create(&dir, 0, 0, 9, &copy).expect("record");
        let paths = [rec.path().to_path_buf(), never.path().to_path_buf()];
        let refused = format!("{:#}", replay(&cfg, &paths, None).expect_err("refused"));
        assert!(refused.contains("has no entry 9"), "{refused}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
