//! The primary's log: every request that changes the shard's state, numbered, kept until every live
//! backup applied it, and the replies waiting for that.

use super::*;

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
    pub(super) acked: watch::Sender<u64>,
    /// The last entry logged.
    pub(super) logged: watch::Sender<u64>,
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
    pub(super) suspects: watch::Sender<Vec<u32>>,
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
    pub(super) fn snapshot_progress(&self, backup: u32, sent: u64, total: u64, piece: u64) {
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
    pub(super) fn is_live(&self, backup: u32) -> bool {
        self.lock().followers.get(&backup).is_some_and(|f| f.live)
    }

    /// The backups that count, but `except`.
    pub(super) fn live_set(&self, except: Option<u32>) -> Vec<u32> {
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
    pub(super) fn acknowledged(&self, backup: u32, applied: u64) -> bool {
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
    pub(super) fn batch(&self, backup: u32, after: u64) -> Result<Vec<(u64, Bytes)>, ()> {
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
