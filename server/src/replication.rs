//! Replicated shards (`--replicas R`, docs/replication.md), step 2: the log a primary keeps of every
//! request that changes its state, shipped in order to the backups of its shard on other shard processes,
//! and replies held until every live backup has applied their request.
//!
//! - **Primary.** [`Log`] is written by the core's actor thread: before the core handles a request that
//!   changes state ([`changes_state`]) and at every tick it appends a [`LogEntry`] (the request as the core
//!   gets it and the clock it gets), numbered from 1, and the reply carries the entry's index. The RPC task
//!   sends the reply only once every live backup acknowledged that index ([`Log::wait`]). One shipping task
//!   per backup ([`ship`]) finds the backup's address in the cluster map, copies a snapshot of the core to
//!   it (`ShardCore::copy_state`, taken by the actor between two entries), then sends the entries that
//!   accumulated while the previous batch was in flight, one batch at a time. A backup counts as live
//!   (replies wait for it) once it has caught up, and the coordinator is told; one that fails or answers late
//!   (`--replica-ack-timeout`) stops counting only once the coordinator has taken it out of the shard's
//!   in-sync set ([`ReplicaReport`]), and is then copied a new snapshot.
//! - **Backup.** [`Backups`] holds a copy per shard this process backs up (shard `i`'s copies live on the
//!   processes of its [`ring`], `i … i+R−1` mod the shard count, except the one serving it): it restores
//!   the snapshot and handles the entries strictly in order, as the primary did; it answers with the last
//!   index applied. A copy whose primary went silent is taken over by its process with the coordinator's
//!   leave (the service's `watch_primaries`), which fences the old primary.
//!
//! Since a shard is a deterministic state machine, a backup that applied entry `n` holds what the primary
//! held after it (`shard/tests/replica.rs`, `server/tests/replication.rs`).

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{ErrorCode, Frame, Limits, Message, ReplicaAck, ReplicaAppend, ReplicaReport, ReplicaSnapshot};
use gaps_shard::replica::{changes_state, Entry, LogEntry};
use gaps_shard::{ShardConfig, ShardCore};
use gaps_transport::net::{self, Bytes, RpcError};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tracing::{info, warn};

/// How long a primary waits for a backup's answer to a batch before it drops the backup from the live set.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(2);
/// A backup whose primary sent nothing for this long asks the coordinator to take its shard over (the primary
/// logs a tick every 250 ms, so a live one is never that silent).
pub const DEFAULT_FAILOVER_AFTER: Duration = Duration::from_secs(1);
/// Bytes of a snapshot sent in one request.
const SNAPSHOT_PIECE: usize = 4 << 20;
/// A batch of entries is cut once it holds this many bytes (or entries).
const BATCH_BYTES: u64 = 4 << 20;
const BATCH_ENTRIES: usize = 4096;
/// How long a shipping task waits for a new entry before it checks that it is still wanted.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// How long a shipping task waits before it tries a backup again after a failure.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The shard processes that ever hold shard `shard` among `num_shards` with `replicas` copies of each: its
/// own and the next `replicas − 1` round the ring.
pub fn ring(shard: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    (0..replicas.min(num_shards)).map(|k| (shard + k) % num_shards).collect()
}

/// The backups of shard `shard` while process `serving` serves it: the rest of its ring.
pub fn backups_of(shard: u32, serving: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    ring(shard, num_shards, replicas).into_iter().filter(|p| *p != serving).collect()
}

/// The shards whose backup process `process` is.
pub fn backed_up_by(process: u32, num_shards: u32, replicas: u32) -> Vec<u32> {
    (1..replicas).map(|k| (process + num_shards - k % num_shards) % num_shards).collect()
}

/// Checks `--replicas` against the cluster: every copy of a shard on another process.
pub fn check_replicas(replicas: u32, num_shards: u32) -> Result<()> {
    if replicas == 0 {
        bail!("--replicas must be at least 1 (1: no backups)");
    }
    if replicas > num_shards {
        bail!(
            "--replicas {replicas} needs at least {replicas} shard processes (each copy of a shard lives on another \
             one); this cluster has {num_shards}"
        );
    }
    Ok(())
}

/// One backup as the primary's log sees it.
#[derive(Debug, Clone, Copy)]
struct Follower {
    /// The last entry it acknowledged (the snapshot's index before its first answer).
    applied: u64,
    /// Whether replies wait for it (it has caught up since its snapshot).
    live: bool,
}

#[derive(Debug, Default)]
struct LogInner {
    /// Index of the next entry.
    next: u64,
    /// Entries not yet acknowledged by every follower, in order (indices contiguous).
    entries: VecDeque<(u64, Bytes)>,
    bytes: u64,
    /// Backup process → its state; entries are logged only while there is one.
    followers: BTreeMap<u32, Follower>,
    /// Backup process → how it was copied (kept when it is dropped: a new snapshot adds to it), and when its
    /// last snapshot was taken while it has not caught up since.
    copies: BTreeMap<u32, (gaps_common::wire::ReplicaCopy, Option<std::time::Instant>)>,
}

/// A primary's log (see the module's text).
#[derive(Debug)]
pub struct Log {
    shard: u32,
    /// Set once the coordinator said another process serves the shard now: nothing more is acknowledged.
    fenced: std::sync::atomic::AtomicBool,
    /// Test hook: nothing is shipped while set (replies wait).
    held: std::sync::atomic::AtomicBool,
    inner: Mutex<LogInner>,
    /// The last entry every live backup applied (`u64::MAX` while none is live: replies do not wait).
    acked: watch::Sender<u64>,
    /// The last entry logged.
    logged: watch::Sender<u64>,
    /// Bytes of entries the log holds at most: past it, backups still catching up are dropped and, while one
    /// that counts lags, requests are refused as busy.
    cap_bytes: u64,
    metrics: ReplicaMetrics,
    /// Entries the slowest in-sync backup had not applied, now and at most so far (measured as backups
    /// acknowledge).
    lag_now: std::sync::atomic::AtomicU64,
    lag_peak: std::sync::atomic::AtomicU64,
    /// Backups found dead by a probe (the coordinator's, before a takeover): their shipping tasks stop
    /// waiting for an answer at once, and the backup leaves as one that timed out would.
    suspects: watch::Sender<Vec<u32>>,
}

#[derive(Debug)]
struct ReplicaMetrics {
    lag: metrics::Gauge,
    log_bytes: metrics::Gauge,
    live: metrics::Gauge,
    dropped: metrics::Counter,
    /// Snapshots taken for backups, and bytes of the ones being sent not sent yet (re-replication).
    snapshots: metrics::Counter,
    copy_left: metrics::Gauge,
}

impl Log {
    /// An empty log of shard `shard` holding at most `cap_bytes` of entries not yet acknowledged.
    pub fn new(shard: u32, cap_bytes: u64) -> Self {
        let label = shard.to_string();
        Log {
            shard,
            fenced: std::sync::atomic::AtomicBool::new(false),
            held: std::sync::atomic::AtomicBool::new(false),
            inner: Mutex::new(LogInner { next: 1, ..LogInner::default() }),
            acked: watch::Sender::new(u64::MAX),
            logged: watch::Sender::new(0),
            cap_bytes,
            metrics: ReplicaMetrics {
                lag: metrics::gauge!("gaps_replica_lag_entries", "shard" => label.clone()),
                log_bytes: metrics::gauge!("gaps_replica_log_bytes", "shard" => label.clone()),
                live: metrics::gauge!("gaps_replica_live_backups", "shard" => label.clone()),
                dropped: metrics::counter!("gaps_replica_dropped_total", "shard" => label.clone()),
                snapshots: metrics::counter!("gaps_replica_snapshots_total", "shard" => label.clone()),
                copy_left: metrics::gauge!("gaps_replica_copy_bytes_left", "shard" => label),
            },
            lag_now: std::sync::atomic::AtomicU64::new(0),
            lag_peak: std::sync::atomic::AtomicU64::new(0),
            suspects: watch::Sender::new(Vec::new()),
        }
    }

    /// A snapshot for `backup` was taken, pausing the core for `pause`.
    pub fn snapshot_taken(&self, backup: u32, pause: Duration) {
        let mut inner = self.lock();
        let (copy, since) = inner.copies.entry(backup).or_default();
        copy.backup = backup;
        copy.snapshots += 1;
        (copy.copying_sent, copy.copying_total) = (0, 0);
        copy.pause_peak_us = copy.pause_peak_us.max(pause.as_micros().min(u128::from(u64::MAX)) as u64);
        *since = Some(std::time::Instant::now());
        self.metrics.snapshots.increment(1);
    }

    /// `sent` bytes of the `total` of `backup`'s snapshot are sent (`sent == total`: the whole of it).
    fn snapshot_progress(&self, backup: u32, sent: u64, total: u64, piece: u64) {
        let mut inner = self.lock();
        let (copy, _) = inner.copies.entry(backup).or_default();
        copy.bytes_sent += piece;
        (copy.copying_sent, copy.copying_total) = if sent >= total { (0, 0) } else { (sent, total) };
        self.copies_changed(&inner);
    }

    /// Publishes the bytes of copies under way not sent yet.
    fn copies_changed(&self, inner: &LogInner) {
        let left: u64 = inner.copies.values().map(|(c, _)| c.copying_total.saturating_sub(c.copying_sent)).sum();
        self.metrics.copy_left.set(left as f64);
    }

    /// How each backup was copied (see [`gaps_common::wire::Stats::replica_copies`]).
    pub fn copies(&self) -> Vec<gaps_common::wire::ReplicaCopy> {
        let inner = self.lock();
        inner
            .copies
            .iter()
            .map(|(b, (c, _))| gaps_common::wire::ReplicaCopy {
                live: inner.followers.get(b).is_some_and(|f| f.live),
                ..*c
            })
            .collect()
    }

    /// Backup `backup` did not answer a probe: its shipping task gives up waiting for it now rather than at
    /// the ack timeout (it leaves the live set the usual way: where the coordinator or a majority must agree,
    /// only once they did).
    pub fn suspect(&self, backup: u32) {
        self.suspects.send_if_modified(|s| {
            let new = !s.contains(&backup);
            if new {
                s.push(backup);
            }
            new
        });
    }

    /// Entries the slowest in-sync backup (one replies wait for) had not applied: now, and at most since
    /// this log started (0 without one).
    pub fn lag(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.lag_now.load(Relaxed), self.lag_peak.load(Relaxed))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogInner> {
        // The log holds no invariant a panic elsewhere could break halfway (every change is one statement).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs a request the core is about to handle at `now`; its index (0: not logged — no backup, or a
    /// request that changes nothing). A request that cannot be logged is refused, not handled: one that
    /// does not encode as an entry (a striped push whose parts together exceed a header's limit), or any
    /// while the entries kept for backups that count exceed the log's cap (`Busy`: send it again).
    pub fn request(&self, now: Duration, frame: &Frame) -> Result<u64, (ErrorCode, String)> {
        if !changes_state(&frame.msg) {
            return Ok(0);
        }
        self.append(true, || Entry::Request { now, frame: Box::new(frame.clone()) })
    }

    /// Logs a tick at `now` (see [`Log::request`]; a tick is always logged, whatever the log holds).
    pub fn tick(&self, now: Duration) -> u64 {
        self.append(false, || Entry::Tick { now }).unwrap_or(0)
    }

    fn append(&self, capped: bool, entry: impl FnOnce() -> Entry) -> Result<u64, (ErrorCode, String)> {
        let mut inner = self.lock();
        if inner.followers.is_empty() {
            return Ok(0);
        }
        if capped && inner.bytes > self.cap_bytes && inner.followers.values().any(|f| f.live) {
            let msg = "this shard's backups are behind (its replica log is full); send the request again";
            return Err((ErrorCode::Busy, msg.into()));
        }
        let index = inner.next;
        let bytes = match (LogEntry { index, entry: entry() }).encode() {
            Ok(b) => Bytes::from(b),
            Err(e) => {
                let msg = format!("the request cannot be passed on to this shard's backups: {e}");
                return Err((ErrorCode::TooLarge, msg));
            }
        };
        inner.next += 1;
        inner.bytes += bytes.len() as u64;
        inner.entries.push_back((index, bytes));
        // Replies wait for live backups, so what they lack is bounded by the requests in flight; a backup
        // still catching up (not counted by the coordinator either) is dropped when it falls too far behind.
        if inner.bytes > self.cap_bytes {
            let behind: Vec<u32> = inner.followers.iter().filter(|(_, f)| !f.live).map(|(b, _)| *b).collect();
            if !behind.is_empty() {
                warn!(
                    shard = self.shard,
                    bytes = inner.bytes,
                    backups = ?behind,
                    "backups catching up fell further behind than the replica log holds; they copy a snapshot again"
                );
                self.metrics.dropped.increment(behind.len() as u64);
                for b in behind {
                    inner.followers.remove(&b);
                }
                self.settle(&mut inner);
                if inner.followers.is_empty() {
                    return Ok(0);
                }
            }
        }
        self.metrics.log_bytes.set(inner.bytes as f64);
        drop(inner);
        self.logged.send_replace(index);
        Ok(index)
    }

    /// Whether the coordinator said another process serves the shard now.
    pub fn fenced(&self) -> bool {
        self.fenced.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stops acknowledging anything: another process serves the shard now. Waiting replies give up.
    pub fn fence(&self) {
        if !self.fenced.swap(true, std::sync::atomic::Ordering::SeqCst) {
            warn!(
                shard = self.shard,
                "another shard process serves this shard now: this one answers nothing more for it"
            );
        }
        self.acked.send_replace(u64::MAX);
    }

    /// Whether backup `backup` counts (replies wait for it).
    fn is_live(&self, backup: u32) -> bool {
        self.lock().followers.get(&backup).is_some_and(|f| f.live)
    }

    /// The backups that count, but `except`.
    fn live_set(&self, except: Option<u32>) -> Vec<u32> {
        let inner = self.lock();
        inner.followers.iter().filter(|(b, f)| f.live && Some(**b) != except).map(|(b, _)| *b).collect()
    }

    /// Backup `backup` starts from a snapshot holding every entry logged so far (called by the actor, which
    /// took the snapshot between two entries); the index it holds.
    pub fn follow(&self, backup: u32) -> u64 {
        self.suspects.send_if_modified(|s| {
            let before = s.len();
            s.retain(|p| *p != backup);
            s.len() != before
        });
        let mut inner = self.lock();
        let at = inner.next - 1;
        inner.followers.insert(backup, Follower { applied: at, live: false });
        self.settle(&mut inner);
        at
    }

    /// Forgets every follower (the core was replaced by a rollback: their state no longer continues it);
    /// their shipping tasks copy a new snapshot.
    pub fn reset(&self) {
        let mut inner = self.lock();
        inner.followers.clear();
        for (copy, _) in inner.copies.values_mut() {
            (copy.copying_sent, copy.copying_total) = (0, 0);
        }
        self.copies_changed(&inner);
        self.settle(&mut inner);
    }

    /// Backup `backup` stops following (it failed); replies no longer wait for it.
    pub fn unfollow(&self, backup: u32) {
        let mut inner = self.lock();
        if inner.followers.remove(&backup).is_some() {
            self.metrics.dropped.increment(1);
        }
        // A copy cut short is no longer under way.
        if let Some((copy, _)) = inner.copies.get_mut(&backup) {
            (copy.copying_sent, copy.copying_total) = (0, 0);
        }
        self.copies_changed(&inner);
        self.settle(&mut inner);
    }

    /// Backup `backup` applied every entry up to `applied`; false when it no longer follows.
    fn acknowledged(&self, backup: u32, applied: u64) -> bool {
        let mut inner = self.lock();
        let next = inner.next;
        let Some(f) = inner.followers.get_mut(&backup) else { return false };
        f.applied = f.applied.max(applied);
        if !f.live && f.applied + 1 >= next {
            f.live = true;
            info!(shard = self.shard, backup, index = f.applied, "backup caught up: replies now wait for it");
            if let Some((copy, since)) = inner.copies.get_mut(&backup) {
                if let Some(t) = since.take() {
                    copy.catch_up_peak_ms = copy.catch_up_peak_ms.max(t.elapsed().as_millis() as u64);
                }
            }
        }
        self.settle(&mut inner);
        true
    }

    /// Drops the entries every follower has, and publishes what replies may go.
    fn settle(&self, inner: &mut LogInner) {
        let oldest = inner.followers.values().map(|f| f.applied).min();
        match oldest {
            None => {
                inner.entries.clear();
                inner.bytes = 0;
            }
            Some(oldest) => {
                while inner.entries.front().is_some_and(|(i, _)| *i <= oldest) {
                    if let Some((_, b)) = inner.entries.pop_front() {
                        inner.bytes -= b.len() as u64;
                    }
                }
            }
        }
        let live = inner.followers.values().filter(|f| f.live);
        let in_sync_lag =
            live.clone().map(|f| inner.next.saturating_sub(1).saturating_sub(f.applied)).max().unwrap_or(0);
        self.lag_now.store(in_sync_lag, std::sync::atomic::Ordering::Relaxed);
        self.lag_peak.fetch_max(in_sync_lag, std::sync::atomic::Ordering::Relaxed);
        // A fenced log acknowledges nothing: every waiting reply wakes, and finds it fenced.
        let acked = if self.fenced() { u64::MAX } else { live.clone().map(|f| f.applied).min().unwrap_or(u64::MAX) };
        self.metrics.live.set(live.count() as f64);
        self.metrics.lag.set(oldest.map_or(0, |o| inner.next - 1 - o) as f64);
        self.metrics.log_bytes.set(inner.bytes as f64);
        self.acked.send_replace(acked);
    }

    /// Test hook: ships nothing while `hold` (replies wait), as a slow network to the backups would.
    pub fn hold(&self, hold: bool) {
        self.held.store(hold, std::sync::atomic::Ordering::SeqCst);
    }

    /// The entries after `after` for `backup`, up to a batch; Err when it no longer follows.
    fn batch(&self, backup: u32, after: u64) -> Result<Vec<(u64, Bytes)>, ()> {
        let inner = self.lock();
        if !inner.followers.contains_key(&backup) {
            return Err(());
        }
        if self.held.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        let first = inner.entries.front().map_or(inner.next, |(i, _)| *i);
        let skip = usize::try_from(after + 1 - first.min(after + 1)).unwrap_or(usize::MAX);
        let mut out = Vec::new();
        let mut bytes = 0u64;
        for (i, b) in inner.entries.iter().skip(skip) {
            if !out.is_empty() && (bytes >= BATCH_BYTES || out.len() >= BATCH_ENTRIES) {
                break;
            }
            bytes += b.len() as u64;
            out.push((*i, b.clone()));
        }
        Ok(out)
    }

    /// Waits until every live backup applied entry `index` (0: at once); false when the shard was fenced
    /// meanwhile (the reply must not go as an acknowledgement).
    pub async fn wait(&self, index: u64) -> bool {
        if index == 0 {
            return !self.fenced();
        }
        let mut rx = self.acked.subscribe();
        let _ = rx.wait_for(|acked| *acked >= index).await;
        !self.fenced()
    }

    /// The last entry logged (0: none).
    pub fn last_index(&self) -> u64 {
        self.lock().next - 1
    }

    /// The number of backups replies wait for now.
    pub fn live_backups(&self) -> usize {
        self.lock().followers.values().filter(|f| f.live).count()
    }
}

pub use crate::link::CoordinatorLink;

/// A snapshot of the core for a backup: the log index it holds and its bytes, or why none was taken.
pub type SnapshotReply = tokio::sync::oneshot::Receiver<Result<(u64, Vec<u8>), String>>;

/// What a shipping task needs from the service.
#[allow(missing_debug_implementations)]
pub struct ShipContext {
    /// This shard's index.
    pub shard: u32,
    /// The coordinator, whose map names the backups and which hears which backups count.
    pub link: CoordinatorLink,
    pub ack_timeout: Duration,
    /// This process's index (the sender of reports) and the replica epoch it serves the shard under.
    pub process: u32,
    /// Where this shard is served (shard 0's configurations name it).
    pub advertise: String,
    pub epoch: u64,
    /// Reports to the coordinator go one at a time, so that they arrive in the order the set changed.
    pub reporting: tokio::sync::Mutex<()>,
    /// Shard 0 in a cluster that chooses its configuration by majority: its backups in sync are reported
    /// there (see [`crate::quorum`]).
    pub quorum: Option<Arc<crate::quorum::Quorum>>,
    /// Asks the core for a snapshot for `backup` (its bytes and the log index it holds).
    pub snapshot: Arc<dyn Fn(u32) -> SnapshotReply + Send + Sync>,
}

/// Keeps backup process `backup` a copy of this shard until `stop` turns true.
pub async fn ship(ctx: Arc<ShipContext>, log: Arc<Log>, backup: u32, mut stop: watch::Receiver<bool>) {
    let mut said = false;
    // Failures in a row (a backup process that stays dead is tried every second: said once a minute).
    let mut failures = 0u32;
    loop {
        let began = std::time::Instant::now();
        let outcome = tokio::select! {
            _ = stop.changed() => return,
            r = ship_once(&ctx, &log, backup, &mut said) => r,
        };
        if began.elapsed() > Duration::from_secs(10) {
            failures = 0;
        }
        if let Err(e) = &outcome {
            failures += 1;
            if failures == 1 || failures % 60 == 0 {
                warn!(
                    shard = ctx.shard,
                    backup,
                    failures,
                    error = format!("{e:#}"),
                    "replication to a backup stopped; trying again"
                );
            } else {
                tracing::debug!(
                    shard = ctx.shard,
                    backup,
                    error = format!("{e:#}"),
                    "replication to a backup failed again"
                );
            }
        }
        // A backup the coordinator counts in sync stops counting only once the coordinator knows: it must
        // never promote a copy that lacks an acknowledged request. Replies wait meanwhile.
        let released = tokio::select! {
            _ = stop.changed() => return,
            r = release(&ctx, &log, backup) => r,
        };
        if !released {
            return;
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(RETRY_AFTER) => {}
        }
    }
}

/// Stops following `backup`: at once when it did not count, after the coordinator took it out of the shard's
/// in-sync set when it did. False when the coordinator answered that another process serves the shard now
/// (this one is fenced).
async fn release(ctx: &ShipContext, log: &Log, backup: u32) -> bool {
    // Shard 0 where a majority chooses who serves it: a backup that stopped answering may have taken it over
    // (its copy refuses this process's log from then on); if the processes know so, this one is fenced.
    if let (0, Some(quorum)) = (ctx.shard, &ctx.quorum) {
        ctx.link.locate().await;
        if quorum.chosen().serving != ctx.process {
            log.fence();
            return false;
        }
    }
    // Without a majority to choose shard 0's configuration, nobody can take it over: its backups need no
    // leave.
    if (ctx.shard == 0 && ctx.quorum.is_none()) || !log.is_live(backup) {
        log.unfollow(backup);
        return true;
    }
    let mut said = false;
    loop {
        match report(ctx, log, Some(backup)).await {
            Ok(()) => return true,
            Err(Reported::Moved) => {
                log.fence();
                return false;
            }
            Err(Reported::Failed(e)) => {
                if !said {
                    warn!(
                        shard = ctx.shard,
                        backup,
                        error = format!("{e:#}"),
                        "the coordinator must hear that a backup stopped before replies go on without it; trying again"
                    );
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Why a report to the coordinator did not go through.
enum Reported {
    /// Another process serves the shard now.
    Moved,
    Failed(anyhow::Error),
}

/// Tells the coordinator which backups count now (all but `except`); on its yes, `except` stops counting
/// here before any other report can go (so a report never names a backup that no longer counts).
async fn report(ctx: &ShipContext, log: &Log, except: Option<u32>) -> Result<(), Reported> {
    let _one = ctx.reporting.lock().await;
    if let Some(quorum) = &ctx.quorum {
        let _changing = quorum.changing().await;
        let in_sync = log.live_set(except);
        return report_to_quorum(ctx, quorum, log, in_sync, except).await;
    }
    let in_sync = log.live_set(except);
    let msg =
        Message::ReplicaReport(ReplicaReport { shard: ctx.shard, process: ctx.process, epoch: ctx.epoch, in_sync });
    match ctx.link.call(&msg).await {
        Ok(Frame { msg: Message::ReplicaEpoch(_), .. }) => {
            if let Some(backup) = except {
                log.unfollow(backup);
            }
            Ok(())
        }
        Err(RpcError::Remote { code: ErrorCode::Moved, .. }) => Err(Reported::Moved),
        Ok(other) => Err(Reported::Failed(anyhow!("the coordinator answered with {}", net::kind_name(&other.msg)))),
        Err(e) => Err(Reported::Failed(anyhow!("the coordinator ({}): {e}", ctx.link.coordinator().0))),
    }
}

/// [`report`] for shard 0 when a majority of the shard processes chooses its configuration: a configuration
/// with these backups in sync, chosen; another process chosen to serve shard 0 means this one is fenced.
async fn report_to_quorum(
    ctx: &ShipContext,
    quorum: &Arc<crate::quorum::Quorum>,
    log: &Log,
    in_sync: Vec<u32>,
    except: Option<u32>,
) -> Result<(), Reported> {
    use crate::quorum::InSync;
    let peers = process_addresses(ctx).await.map_err(Reported::Failed)?;
    let addr = ctx.advertise.clone();
    match quorum.propose_in_sync(in_sync, addr, except.is_none(), &peers, &ctx.link).await {
        Ok(InSync::Chosen) => {
            if let Some(backup) = except {
                log.unfollow(backup);
            }
            Ok(())
        }
        Ok(InSync::Moved(_)) => Err(Reported::Moved),
        Ok(InSync::Other(c)) => Err(Reported::Failed(anyhow!(
            "shard 0's configuration {} was chosen with backups {:?} in sync; telling again",
            c.version,
            c.in_sync
        ))),
        Err(e) => Err(Reported::Failed(e)),
    }
}

/// Every other shard process and where it listens, from the coordinator's map (a process whose shard was
/// taken over and that is not back is left out).
async fn process_addresses(ctx: &ShipContext) -> Result<Vec<(u32, String)>> {
    let map = ctx.link.map(&format!("shard-{} quorum", ctx.shard)).await.map_err(|e| anyhow!("the map: {e}"))?;
    Ok(map.process_addrs().into_iter().filter(|(p, _)| *p != ctx.process).collect())
}

async fn ship_once(ctx: &ShipContext, log: &Log, backup: u32, said: &mut bool) -> Result<()> {
    let addr = backup_address(ctx, backup).await?;
    let conn = ctx.link.connect(&addr, backup).await.map_err(|e| anyhow!("backup {backup} at {addr}: {e}"))?;
    let (index, bytes) = (ctx.snapshot)(backup)
        .await
        .map_err(|_| anyhow!("the core stopped"))?
        .map_err(|e| anyhow!("taking a snapshot for backup {backup}: {e}"))?;
    let total = bytes.len() as u64;
    let bytes = Bytes::from(bytes);
    let mut offset = 0usize;
    loop {
        let end = (offset + SNAPSHOT_PIECE).min(bytes.len());
        let piece = bytes.slice(offset..end);
        let msg = Message::ReplicaSnapshot(ReplicaSnapshot {
            shard: ctx.shard,
            index,
            offset: offset as u64,
            total,
            bytes: piece.len() as u32,
        });
        let parts = padded(vec![piece]);
        let applied = call(ctx, &conn, &msg, &parts, ctx.ack_timeout.max(Duration::from_secs(30))).await?;
        log.snapshot_progress(backup, end as u64, total, (end - offset) as u64);
        offset = end;
        if offset >= bytes.len() {
            if applied != index {
                bail!("backup {backup} restored the snapshot at {applied}, not {index}");
            }
            break;
        }
    }
    if !*said {
        info!(shard = ctx.shard, backup, %addr, index, bytes = total, "backup holds a snapshot; shipping the log");
        *said = true;
    }
    if !log.acknowledged(backup, index) {
        bail!("the log was reset while the snapshot was copied");
    }
    let mut applied = index;
    let mut logged = log.logged.subscribe();
    // Once the backup counts, the coordinator hears of it (until then it may not promote the copy).
    let (mut reported, mut said_failure) = (ctx.shard == 0 && ctx.quorum.is_none(), false);
    loop {
        if !reported && log.is_live(backup) {
            match report(ctx, log, None).await {
                Ok(()) => reported = true,
                Err(Reported::Moved) => {
                    log.fence();
                    bail!("another process serves this shard now");
                }
                Err(Reported::Failed(e)) if !said_failure => {
                    said_failure = true;
                    warn!(
                        shard = ctx.shard,
                        backup,
                        error = format!("{e:#}"),
                        "telling the coordinator that a backup counts; trying again after each batch"
                    )
                }
                Err(Reported::Failed(_)) => {}
            }
        }
        let batch = log.batch(backup, applied).map_err(|()| anyhow!("dropped from the live set"))?;
        if batch.is_empty() {
            let _ = tokio::time::timeout(IDLE_CHECK, logged.wait_for(|l| *l > applied)).await;
            continue;
        }
        let first = batch[0].0;
        let last = batch[batch.len() - 1].0;
        if first != applied + 1 {
            bail!("the log no longer holds entry {} for backup {backup}", applied + 1);
        }
        let lens = batch.iter().map(|(_, b)| b.len() as u32).collect();
        let msg = Message::ReplicaAppend(ReplicaAppend { shard: ctx.shard, first, lens });
        let parts = padded(batch.into_iter().map(|(_, b)| b).collect());
        let mut suspected = log.suspects.subscribe();
        let got = tokio::select! {
            got = call(ctx, &conn, &msg, &parts, ctx.ack_timeout) => got?,
            _ = suspected.wait_for(|s| s.contains(&backup)) => bail!("backup {backup} did not answer a probe"),
        };
        if got != last {
            bail!("backup {backup} applied up to {got}, not {last}");
        }
        applied = last;
        if !log.acknowledged(backup, applied) {
            bail!("dropped from the live set");
        }
    }
}

/// Pads `parts` with zeros to a whole number of payload words.
fn padded(mut parts: Vec<Bytes>) -> Vec<Bytes> {
    let len: usize = parts.iter().map(Bytes::len).sum();
    let pad = len.next_multiple_of(4) - len;
    if pad > 0 {
        parts.push(Bytes::from(vec![0u8; pad]));
    }
    parts
}

async fn call(
    ctx: &ShipContext,
    conn: &quinn::Connection,
    msg: &Message,
    parts: &[Bytes],
    wait: Duration,
) -> Result<u64> {
    match net::call(conn, msg, parts, &Limits::default(), wait).await {
        Ok(Frame { msg: Message::ReplicaAck(a), .. }) if a.shard == ctx.shard => Ok(a.applied),
        Ok(other) => bail!("the backup answered with {}", net::kind_name(&other.msg)),
        Err(e) => Err(anyhow!("{e}")),
    }
}

/// Backup process `backup`'s address, from the coordinator's map (waits until every shard joined).
async fn backup_address(ctx: &ShipContext, backup: u32) -> Result<String> {
    loop {
        match map_address(ctx, backup).await {
            Err(Incomplete) => tokio::time::sleep(Duration::from_millis(200)).await,
            Ok(found) => return found,
        }
    }
}

/// The coordinator's map is not complete yet.
struct Incomplete;

async fn map_address(ctx: &ShipContext, backup: u32) -> Result<Result<String>, Incomplete> {
    Ok(match ctx.link.map(&format!("shard-{} replication", ctx.shard)).await {
        Ok(map) => map
            .process_addrs()
            .into_iter()
            .find(|(p, _)| *p == backup)
            .map(|(_, addr)| addr)
            .with_context(|| {
                format!("shard process {backup} is not in the coordinator's map (its shard was taken over and it is not back)")
            }),
        Err(RpcError::Remote { code: ErrorCode::ClusterIncomplete, .. }) => return Err(Incomplete),
        Err(e) => Err(anyhow!("the coordinator's map ({}): {e}", ctx.link.coordinator().0)),
    })
}

/// The copy of this shard was taken over here: its old primary's log is refused.
#[derive(Debug)]
struct TakenOver(u32);

impl std::fmt::Display for TakenOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {} is served by this process now (its backup took it over)", self.0)
    }
}

impl std::error::Error for TakenOver {}

/// A copy of one shard held by a backup process.
struct Replica {
    /// The shard's configuration (this process's, with the shard's index).
    cfg: ShardConfig,
    /// The coordinator's dealer settings, for a copy of shard 0 that deals data.
    data: Option<gaps_shard::dealer::DealerConfig>,
    /// The largest payload a request of this shard carries (sizes the process's frame limit).
    max_payload: u64,
    core: Option<ShardCore>,
    applied: u64,
    /// A snapshot arriving: its index and the bytes so far, of `total`.
    incoming: Option<(u64, u64, Vec<u8>)>,
    /// When the primary last sent something that continued the copy (None: no copy yet).
    heard: Option<std::time::Instant>,
    /// The primary's clock at the last entry applied (a copy that takes over continues from it).
    clock: Duration,
    /// The copy is being taken over (or was): the old primary's log is refused.
    taking_over: bool,
}

/// The copies of other shards this process keeps.
pub struct Backups {
    replicas: BTreeMap<u32, Mutex<Replica>>,
    /// The cluster's shard count and copies of each shard (who may send a shard's log: its ring).
    num_shards: u32,
    copies: u32,
    /// A copy of shard 0 may be taken over: a majority chooses its configuration ([`crate::quorum`]).
    coordinator_fails_over: bool,
}

impl std::fmt::Debug for Backups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backups").field("shards", &self.replicas.keys().collect::<Vec<_>>()).finish()
    }
}

impl Backups {
    /// Copies of `shards`, each configured as `own` with its index (and `data`, for shard 0); `limit` is the
    /// largest payload a request of a shard so configured carries, as the shard itself bounds it.
    pub fn new(
        shards: &[u32],
        own: &ShardConfig,
        copies: u32,
        data: Option<&gaps_shard::dealer::DealerConfig>,
        limit: impl Fn(&ShardConfig) -> u64,
    ) -> Self {
        let mut replicas = BTreeMap::new();
        for &shard in shards {
            let cfg = ShardConfig { shard, ..own.clone() };
            let max_payload = limit(&cfg);
            let data = if shard == 0 { data.cloned() } else { None };
            let replica = Replica {
                cfg,
                data,
                max_payload,
                core: None,
                applied: 0,
                incoming: None,
                heard: None,
                clock: Duration::ZERO,
                taking_over: false,
            };
            replicas.insert(shard, Mutex::new(replica));
        }
        let coordinator_fails_over = crate::quorum::enabled(copies, own.num_shards);
        Backups { replicas, num_shards: own.num_shards, copies, coordinator_fails_over }
    }

    /// The largest request a primary sends this process: a batch of its largest entries, or a snapshot
    /// piece.
    pub fn largest_request(&self) -> u64 {
        let entry = self.replicas.values().map(|r| r.lock().map_or(0, |r| r.max_payload)).max();
        entry
            .map_or(0, |e| e + BATCH_BYTES + u64::from(gaps_common::wire::MAX_HEADER_BYTES) + 64)
            .max(SNAPSHOT_PIECE as u64)
    }

    /// The shards copied here, each with the last entry applied (0: no snapshot yet).
    pub fn applied(&self) -> Vec<(u32, u64)> {
        self.replicas.iter().map(|(s, r)| (*s, r.lock().map_or(0, |r| r.applied))).collect()
    }

    /// The shards whose copies here hold a snapshot (a copy busy applying holds one), sorted.
    pub fn held(&self) -> Vec<u32> {
        let holds = |r: &Mutex<Replica>| r.try_lock().map_or(true, |r| r.core.is_some() || r.incoming.is_some());
        self.replicas.iter().filter(|(_, r)| holds(r)).map(|(s, _)| *s).collect()
    }

    /// Reads the copy of `shard` (tests and reports): the last entry applied and the core.
    pub fn inspect<T>(&self, shard: u32, f: impl FnOnce(u64, Option<&ShardCore>) -> T) -> Option<T> {
        let r = self.replicas.get(&shard)?.lock().ok()?;
        Some(f(r.applied, r.core.as_ref()))
    }

    /// Handles a [`Message::ReplicaSnapshot`] or [`Message::ReplicaAppend`] from shard process `sender` (its
    /// certificate says so), on a blocking thread: only a process of the shard's ring may send its log.
    pub async fn handle(self: &Arc<Self>, sender: u32, frame: Frame) -> Frame {
        let shard = match &frame.msg {
            Message::ReplicaSnapshot(s) => s.shard,
            Message::ReplicaAppend(a) => a.shard,
            _ => u32::MAX,
        };
        if !ring(shard, self.num_shards, self.copies).contains(&sender) {
            let why = format!("shard process {sender} never serves shard {shard}: it cannot send its log");
            return Frame::new(Message::error(ErrorCode::Unauthorized, why));
        }
        let this = self.clone();
        let answer = tokio::task::spawn_blocking(move || this.handle_now(frame)).await;
        Frame::new(match answer {
            Ok(Ok(ack)) => Message::ReplicaAck(ack),
            Ok(Err(e)) if e.downcast_ref::<TakenOver>().is_some() => Message::error(ErrorCode::Moved, format!("{e:#}")),
            Ok(Err(e)) => Message::error(ErrorCode::Misconfigured, format!("{e:#}")),
            Err(e) => Message::error(ErrorCode::Internal, format!("the replica's task failed: {e}")),
        })
    }

    /// The copies that hold a snapshot and whose primary sent nothing for `silence`.
    pub fn silent(&self, silence: Duration) -> Vec<u32> {
        let mut out = Vec::new();
        // The coordinator's own shard is taken over only where a majority chooses its configuration. A copy
        // busy applying is not silent.
        for (shard, r) in self.replicas.iter().filter(|(s, _)| **s != 0 || self.coordinator_fails_over) {
            let Ok(r) = r.try_lock() else { continue };
            if !r.taking_over && r.core.is_some() && r.heard.is_some_and(|t| t.elapsed() >= silence) {
                out.push(*shard);
            }
        }
        out
    }

    /// Stops applying the primary's log to the copy of `shard` (it is being taken over); false when there is
    /// no copy to take.
    pub fn begin_takeover(&self, shard: u32) -> bool {
        let Some(Ok(mut r)) = self.replicas.get(&shard).map(|r| r.try_lock()) else { return false };
        if r.core.is_none() || r.taking_over {
            return false;
        }
        r.taking_over = true;
        true
    }

    /// The coordinator refused the takeover: the copy follows its primary again (it waits for the next entry or
    /// snapshot, and is not taken over again before it went silent once more).
    pub fn abandon_takeover(&self, shard: u32) {
        if let Some(Ok(mut r)) = self.replicas.get(&shard).map(|r| r.lock()) {
            r.taking_over = false;
            r.heard = Some(std::time::Instant::now());
        }
    }

    /// The copy of `shard`, taken over: its core, the primary's clock at its last entry and that entry's
    /// index. The copy is gone from here (the primary's log is refused from now on).
    pub fn take(&self, shard: u32) -> Option<(ShardCore, Duration, u64)> {
        let mut r = self.replicas.get(&shard)?.lock().ok()?;
        r.taking_over = true;
        let (clock, applied) = (r.clock, r.applied);
        r.core.take().map(|core| (core, clock, applied))
    }

    fn handle_now(&self, frame: Frame) -> Result<ReplicaAck> {
        let shard = match &frame.msg {
            Message::ReplicaSnapshot(s) => s.shard,
            Message::ReplicaAppend(a) => a.shard,
            other => bail!("{} is not a replication request", net::kind_name(other)),
        };
        let replica =
            self.replicas.get(&shard).with_context(|| format!("this process does not back up shard {shard}"))?;
        let mut r = replica.lock().map_err(|_| anyhow!("the copy of shard {shard} is poisoned"))?;
        if r.taking_over {
            return Err(anyhow::Error::new(TakenOver(shard)));
        }
        let applied = match frame.msg {
            Message::ReplicaSnapshot(s) => r.snapshot_piece(&s, &frame.payload)?,
            Message::ReplicaAppend(a) => r.append(&a, &frame.payload)?,
            _ => unreachable!("checked above"),
        };
        Ok(ReplicaAck { shard, applied })
    }
}

impl Replica {
    fn snapshot_piece(&mut self, s: &ReplicaSnapshot, words: &[f32]) -> Result<u64> {
        let piece = gaps_common::wire::words_to_bytes(words, u64::from(s.bytes))
            .context("a snapshot piece shorter than it says")?;
        if s.offset == 0 {
            self.incoming = Some((s.index, s.total, Vec::new()));
        }
        let Some((index, total, buf)) = self.incoming.as_mut() else { bail!("a snapshot piece without its start") };
        if (*index, *total, buf.len() as u64) != (s.index, s.total, s.offset) {
            self.incoming = None;
            bail!("a snapshot piece out of order");
        }
        if s.offset + piece.len() as u64 > s.total {
            self.incoming = None;
            bail!("a snapshot piece past the snapshot's end");
        }
        buf.extend_from_slice(&piece);
        // The primary is alive while it copies (a large copy takes longer than `--failover-after`).
        self.heard = Some(std::time::Instant::now());
        if (buf.len() as u64) < *total {
            return Ok(0);
        }
        let (index, _, bytes) = self.incoming.take().expect("set above");
        let mut core =
            ShardCore::from_copy(self.cfg.clone(), &bytes).map_err(|e| anyhow!("restoring the snapshot: {e}"))?;
        core.set_dealer_as_copy(self.data.clone()).map_err(|e| anyhow!("copying shard {}: {e}", self.cfg.shard))?;
        self.core = Some(core);
        self.applied = index;
        self.heard = Some(std::time::Instant::now());
        Ok(index)
    }

    fn append(&mut self, a: &ReplicaAppend, words: &[f32]) -> Result<u64> {
        let Some(core) = self.core.as_mut() else { bail!("no snapshot yet") };
        if a.first != self.applied + 1 {
            bail!("entries from {} where {} comes next", a.first, self.applied + 1);
        }
        let bytes =
            gaps_common::wire::words_to_bytes(words, a.total_bytes()).context("entries shorter than they say")?;
        let mut at = 0usize;
        for &len in &a.lens {
            let end = at + len as usize;
            // The primary bounded the request when it read it; an entry's payload is bounded by its bytes.
            let limits = Limits { max_payload_bytes: u64::from(len), ..Limits::default() };
            let entry =
                LogEntry::decode(&bytes[at..end], &limits).map_err(|e| anyhow!("entry {}: {e}", self.applied + 1))?;
            at = end;
            if entry.index != self.applied + 1 {
                bail!("entry {} where {} comes next", entry.index, self.applied + 1);
            }
            let now = match entry.entry {
                Entry::Request { now, frame } => {
                    core.handle(*frame, now);
                    now
                }
                Entry::Tick { now } => {
                    core.tick(now);
                    now
                }
            };
            self.applied = entry.index;
            self.clock = self.clock.max(now);
        }
        self.heard = Some(std::time::Instant::now());
        Ok(self.applied)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::wire::{bytes_to_words, Heartbeat, Pull};

    fn log() -> Log {
        Log::new(0, 1 << 20)
    }

    fn heartbeat() -> Frame {
        Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))
    }

    #[test]
    fn replicas_sit_on_the_next_processes_round_the_ring() {
        assert_eq!(backups_of(2, 2, 3, 2), vec![0]);
        assert_eq!(backups_of(0, 0, 4, 3), vec![1, 2]);
        assert_eq!(backups_of(1, 0, 2, 2), vec![1], "taken over by process 0: its own process backs it up");
        assert_eq!(backed_up_by(0, 4, 3), vec![3, 2]);
        assert_eq!(backed_up_by(1, 3, 1), Vec::<u32>::new());
        for (s, n, r) in [(0, 5, 3), (4, 5, 5), (2, 3, 2)] {
            for b in backups_of(s, s, n, r) {
                assert!(backed_up_by(b, n, r).contains(&s), "{s} {n} {r}");
                assert_ne!(b, s);
            }
        }
        assert!(check_replicas(3, 2).is_err() && check_replicas(0, 2).is_err() && check_replicas(2, 2).is_ok());
    }

    #[test]
    fn nothing_is_logged_without_a_backup_and_reads_never_are() {
        let l = log();
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(0));
        assert_eq!(l.tick(Duration::ZERO), 0);
        assert_eq!(l.follow(1), 0);
        let read = Frame::new(Message::Pull(Pull { epoch: 1, chunks: vec![] }));
        assert_eq!(l.request(Duration::ZERO, &read), Ok(0), "a read");
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(1));
        assert_eq!(l.tick(Duration::from_millis(5)), 2);
    }

    #[test]
    fn replies_wait_for_a_backup_once_it_caught_up_and_stop_waiting_when_it_is_dropped() {
        let l = log();
        l.follow(1);
        let first = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        // Catching up: replies do not wait for it yet.
        assert_eq!(*l.acked.borrow(), u64::MAX);
        assert_eq!(l.batch(1, 0).expect("follows").iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![first]);
        assert!(l.acknowledged(1, first));
        assert_eq!(l.live_backups(), 1);
        let second = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        assert_eq!(*l.acked.borrow(), first, "the second entry waits for the backup");
        assert_eq!(l.batch(1, first).expect("follows").len(), 1, "acknowledged entries are dropped");
        assert!(l.acknowledged(1, second));
        assert_eq!(*l.acked.borrow(), second);
        l.request(Duration::ZERO, &heartbeat()).expect("logged");
        l.unfollow(1);
        assert_eq!(*l.acked.borrow(), u64::MAX, "no live backup: nothing waits");
        assert!(l.batch(1, second).is_err() && !l.acknowledged(1, 3));
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(0), "nothing logged without a backup");
    }

    #[test]
    fn each_backups_copies_are_counted_across_drops() {
        let l = log();
        l.follow(1);
        l.snapshot_taken(1, Duration::from_micros(300));
        l.snapshot_progress(1, 40, 100, 40);
        let copying = l.copies();
        assert_eq!(copying.len(), 1);
        assert_eq!((copying[0].copying_sent, copying[0].copying_total, copying[0].live), (40, 100, false));
        l.snapshot_progress(1, 100, 100, 60);
        let first = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        assert!(l.acknowledged(1, first));
        let c = l.copies()[0];
        assert_eq!((c.snapshots, c.bytes_sent, c.copying_total, c.live, c.pause_peak_us), (1, 100, 0, true, 300));
        // Dropped, then copied again: the counts go on, the longest pause stays the longest.
        l.unfollow(1);
        assert!(!l.copies()[0].live);
        l.follow(1);
        l.snapshot_taken(1, Duration::from_micros(100));
        l.snapshot_progress(1, 100, 100, 100);
        let c = l.copies()[0];
        assert_eq!((c.backup, c.snapshots, c.bytes_sent, c.pause_peak_us), (1, 2, 200, 300));
    }

    #[test]
    fn a_backup_catching_up_further_behind_than_the_log_holds_is_dropped_a_live_one_never() {
        let l = Log::new(0, 200);
        l.follow(1);
        let mut last = 0;
        for _ in 0..20 {
            last = l.request(Duration::ZERO, &heartbeat()).expect("logged");
        }
        assert_eq!(last, 0, "the log dropped the backup catching up once it held more than its cap");
        assert!(l.batch(1, 0).is_err());
        // A live backup is only dropped with the coordinator's leave (replies wait for it meanwhile): past
        // the cap, requests are refused as busy, unhandled, until it catches up; ticks are still logged.
        let at = l.follow(2);
        assert!(l.acknowledged(2, at));
        let mut logged = Vec::new();
        let refused = loop {
            match l.request(Duration::ZERO, &heartbeat()) {
                Ok(i) => logged.push(i),
                Err(e) => break e,
            }
            assert!(logged.len() < 100, "the cap holds");
        };
        assert_eq!(refused.0, ErrorCode::Busy);
        assert_eq!(logged, (at + 1..=at + logged.len() as u64).collect::<Vec<_>>(), "in order, none skipped");
        let tick = l.tick(Duration::from_millis(1));
        assert_eq!(tick, at + logged.len() as u64 + 1);
        assert_eq!(*l.acked.borrow(), at);
        assert!(l.acknowledged(2, tick));
        assert_eq!(l.request(Duration::ZERO, &heartbeat()), Ok(tick + 1), "room again");
        l.fence();
        assert_eq!(*l.acked.borrow(), u64::MAX, "fenced: waiting replies wake up");
        assert!(l.fenced());
    }

    fn backups() -> Arc<Backups> {
        let cfg = crate::test_support::shard_config(1, 2, gaps_kernels::Rule::Sgd);
        Arc::new(Backups::new(&[0], &cfg, 2, None, |_| 1 << 20))
    }

    fn words(bytes: &[u8]) -> Vec<f32> {
        let mut w = Vec::new();
        bytes_to_words(bytes, &mut w);
        w
    }

    fn refused(b: &Backups, msg: Message, payload: Vec<f32>) -> String {
        format!("{:#}", b.handle_now(Frame { msg, payload }).expect_err("refused"))
    }

    #[test]
    fn a_backup_refuses_what_does_not_continue_its_copy() {
        let b = backups();
        let append = |first, lens: Vec<u32>| Message::ReplicaAppend(ReplicaAppend { shard: 0, first, lens });
        assert!(refused(&b, append(1, vec![]), vec![]).contains("no snapshot"));
        let other = Message::ReplicaAppend(ReplicaAppend { shard: 1, first: 1, lens: vec![] });
        assert!(refused(&b, other, vec![]).contains("does not back up shard 1"));
        let piece = |index, offset, total, bytes| {
            Message::ReplicaSnapshot(ReplicaSnapshot { shard: 0, index, offset, total, bytes })
        };
        assert!(refused(&b, piece(4, 8, 16, 8), words(&[0; 8])).contains("without its start"));
        assert!(refused(&b, piece(4, 0, 4, 8), words(&[0; 8])).contains("past the snapshot's end"));
        assert!(refused(&b, piece(4, 0, 8, 8), words(&[0; 4])).contains("shorter"));
        assert!(refused(&b, piece(4, 0, 8, 8), words(&[7; 8])).contains("restoring"), "not a checkpoint");
        // A real snapshot of shard 0, then entries in order only.
        let core =
            ShardCore::new(ShardConfig { shard: 0, ..b.replicas[&0].lock().expect("lock").cfg.clone() }).expect("core");
        let snap = core.copy_state().expect("snapshot");
        let half = snap.len() / 2;
        let total = snap.len() as u64;
        let first = b.handle_now(Frame { msg: piece(9, 0, total, half as u32), payload: words(&snap[..half]) });
        assert_eq!(first.expect("first piece").applied, 0);
        let rest = snap.len() - half;
        let last =
            b.handle_now(Frame { msg: piece(9, half as u64, total, rest as u32), payload: words(&snap[half..]) });
        assert_eq!(last.expect("last piece").applied, 9);
        assert!(refused(&b, append(11, vec![]), vec![]).contains("where 10 comes next"));
        let tick = LogEntry { index: 10, entry: Entry::Tick { now: Duration::from_secs(1) } }.encode().expect("entry");
        let wrong = LogEntry { index: 12, entry: Entry::Tick { now: Duration::from_secs(1) } }.encode().expect("entry");
        let mut both = tick.clone();
        both.extend_from_slice(&wrong);
        let lens = vec![tick.len() as u32, wrong.len() as u32];
        assert!(refused(&b, append(10, lens), words(&both)).contains("entry 12 where 11 comes next"));
        assert_eq!(b.applied(), vec![(0, 10)], "the entries before the bad one stay applied");
        let garbage = append(11, vec![3]);
        assert!(refused(&b, garbage, words(&[1, 2, 3])).contains("entry 11"));
    }
}
