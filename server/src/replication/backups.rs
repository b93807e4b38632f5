//! The backup's side: a copy per shard this process backs up, restored from a snapshot and kept by the
//! primary's log, applied strictly in order; a copy whose primary went silent is taken over.

use super::*;

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
pub(super) struct Replica {
    /// The shard's configuration (this process's, with the shard's index).
    pub(super) cfg: ShardConfig,
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
    pub(super) replicas: BTreeMap<u32, Mutex<Replica>>,
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

    pub(super) fn handle_now(&self, frame: Frame) -> Result<ReplicaAck> {
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
