//! Messages that observe and steer a shard: statistics, checkpoints and rollback, authentication, the data
//! dealer, initialization and table scans.

use super::*;

/// Ask a shard for its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct StatsRequest;

/// A shard's counters since it started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Encode, Decode)]
pub struct Stats {
    /// Shard index.
    pub shard: u32,
    /// Cluster epoch as the shard knows it (0 before it joined).
    pub epoch: u64,
    /// Pushes applied (each `(worker, seq)` once).
    pub pushes_applied: u64,
    /// Retried pushes acknowledged without applying them again.
    pub pushes_duplicate: u64,
    /// Pushes refused with an error (nothing applied).
    pub pushes_rejected: u64,
    /// Pulls served.
    pub pulls: u64,
    /// Tensor payload bytes received.
    pub payload_bytes_in: u64,
    /// Tensor payload bytes sent.
    pub payload_bytes_out: u64,
    /// Sum of staleness τ over applied chunk updates.
    pub staleness_sum: u64,
    /// Number of applied chunk updates (the denominator of the mean staleness).
    pub staleness_count: u64,
    /// Largest staleness seen.
    pub staleness_max: u64,
    /// Workers holding a lease (coordinator only; 0 elsewhere).
    pub live_workers: u32,
    /// Workers ever registered (coordinator only).
    pub registered_workers: u32,
    /// Sparse rows held.
    pub table_rows: u64,
    /// Bytes held by sparse tables (rows, metadata, index).
    pub table_bytes: u64,
    /// Sparse rows evicted.
    pub table_evicted: u64,
    /// Sparse row updates dropped (row not admitted, or evicted since the pull).
    pub sparse_dropped: u64,
    /// The mode in force (0 async, 1 sync, 2 gba, 3 ssp).
    pub mode: u8,
    /// Mode switches so far.
    pub mode_switches: u64,
    /// Synchronous steps applied.
    pub steps_sync: u64,
    /// GBA steps applied.
    pub steps_gba: u64,
    /// Gradients dropped as too stale (sync: computed on an earlier step; gba: beyond the threshold).
    pub dropped_stale: u64,
    /// The learning-rate multiplier of the last applied update, in thousandths.
    pub lr_multiplier_milli: u32,
    /// The smallest push count of a live worker (bounded staleness).
    pub ssp_min_clock: u64,
    /// Synchronous and GBA steps applied (what [`Ack::wait_for_step`] waits for).
    pub global_step: u64,
    /// Embedding-row gradients dropped as too stale in sync or gba (per row).
    pub rows_dropped_stale: u64,
    /// The newest two mode decisions this shard knows.
    pub decisions: ModeDecisions,
    /// The mode switches this shard carried out, oldest first (the last 64).
    pub switches: Vec<ModeSwitchRecord>,
    /// Gradients dropped because they were computed in the mode before a switch and are too stale for
    /// the new one (also counted in `dropped_stale`). (Added in protocol 10.)
    pub pushes_dropped_at_switch: u64,
    /// Pushes this shard applied although its ledger held their `(worker, seq)` already: 0 unless the
    /// exactly-once gate failed. (Added in protocol 11, as the next field; keep them last.)
    pub pushes_applied_twice: u64,
    /// Pushes applied per worker as the shard's state holds them now (after a restore: what the restored
    /// state holds), ascending worker ids. A worker's acknowledged pushes beyond its count here were lost.
    pub applied_by_worker: Vec<WorkerApplied>,
    /// Replicated shards (`--replicas` ≥ 2): log entries the slowest in-sync backup of this process's
    /// log had not applied when asked, and the most since the process started (0 without backups). Filled
    /// by the serving process, not the core. (Added in protocol 15.)
    pub replica_lag_entries: u64,
    /// See [`Self::replica_lag_entries`].
    pub replica_lag_peak: u64,
    /// Replicated shards: the copies this process made of the shard for each of its backups since it
    /// started serving it (re-replication), backup order. Filled by the serving process. (Added in
    /// protocol 17.)
    pub replica_copies: Vec<ReplicaCopy>,
}

/// How a serving process copied its shard to one backup (see [`Stats::replica_copies`]): a snapshot, then
/// the log from the snapshot's index until the backup caught up and counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaCopy {
    /// The backup's shard process.
    pub backup: u32,
    /// Snapshots taken for it (the first, and one after each time it was dropped).
    pub snapshots: u64,
    /// Bytes of snapshots sent to it, whole ones and the one in progress.
    pub bytes_sent: u64,
    /// The snapshot being sent now: its size, and how much of it is sent (0 and 0: none).
    pub copying_total: u64,
    pub copying_sent: u64,
    /// Whether replies wait for it now (it caught up).
    pub live: bool,
    /// The longest the shard's core paused to take one of its snapshots, in microseconds.
    pub pause_peak_us: u64,
    /// The longest from a snapshot taken until the backup caught up and counted, in milliseconds.
    pub catch_up_peak_ms: u64,
}

/// One worker's pushes applied by a shard (see [`Stats::applied_by_worker`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub struct WorkerApplied {
    /// The worker id.
    pub worker: u32,
    /// Its pushes applied (distinct sequence numbers).
    pub applied: u64,
}

/// When a shard takes a checkpoint it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum CheckpointAt {
    /// At once, whatever the shard is doing (a partial synchronous step is saved as it is).
    Now,
    /// At the next point where no synchronous or GBA step is partly accumulated (at once in async modes
    /// and when one is not).
    Quiescent,
    /// Right after synchronous step N completes (N steps applied, none partly accumulated). A shard that
    /// is already past it refuses with [`ErrorCode::TooLate`].
    Step(u64),
}

/// Ask a shard to write a checkpoint (answered by its service, not its core).
///
/// Sent to shard 0 with `id` 0 it starts a **cluster** checkpoint: the coordinator picks the id and the
/// point (a synchronous step in `sync`, the next quiescent point otherwise), asks every shard for it, and
/// answers with all of their files. With a non-zero id (the coordinator's request to each shard, or an
/// operator's to one shard) only the receiving shard writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct CheckpointRequest {
    /// The checkpoint's id (0: the receiver picks one).
    pub id: u64,
    /// When to take it.
    pub at: CheckpointAt,
}

/// What a [`Rollback`] asks for: the steps of returning the whole cluster to one checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum RollbackStage {
    /// From a shard that restarted from checkpoint `id`, to the coordinator: return the cluster to the
    /// newest checkpoint, no newer than `id`, that every shard holds.
    Restored,
    /// From the coordinator to a shard: which intact checkpoints no newer than `id` do you hold?
    List,
    /// From the coordinator to a shard: restore checkpoint `id` now, in place, keeping the live workers.
    Apply,
}

/// Consistent recovery (answered by the service, not the core): see [`RollbackStage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Rollback {
    /// The checkpoint id the stage is about.
    pub id: u64,
    /// What is asked.
    pub stage: RollbackStage,
}

/// Answer to [`Rollback`].
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct RollbackReply {
    /// The answering shard.
    pub shard: u32,
    /// `List`: the intact checkpoint ids held, newest first (at most [`MAX_ROLLBACK_IDS`]); otherwise the
    /// one id the shard (`Apply`) or the cluster (`Restored`) returned to.
    pub held: Vec<u64>,
    /// The synchronous step the shard is at (after the rollback, for `Apply` and `Restored`).
    pub step: u64,
}

/// Most checkpoint ids a [`RollbackReply`] lists.
pub const MAX_ROLLBACK_IDS: usize = 64;

/// One shard's file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ShardCheckpoint {
    /// The shard.
    pub shard: u32,
    /// The snapshot file on the shard's machine.
    pub path: String,
    /// Synchronous/GBA steps the shard had applied when it took the snapshot.
    pub step: u64,
}

/// A checkpoint was written (by every shard listed).
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct CheckpointDone {
    /// The checkpoint's id.
    pub id: u64,
    /// Each shard's file, shard order.
    pub shards: Vec<ShardCheckpoint>,
}

/// A worker's credential: an HMAC over the cluster epoch, its id and its certificate's identity, made by
/// the coordinator at registration. Only the registrant (holding that certificate) can use it.
pub type Token = [u8; 32];

/// Binds the connection it arrives on to a worker: pushes, heartbeats and leaves on a connection are
/// accepted only for the worker it was authenticated as (the connection a worker registered on is bound
/// already).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Authenticate {
    /// The worker id.
    pub worker: u32,
    /// Its credential from the coordinator's [`ClusterMap`].
    pub token: Token,
}

/// The connection is now bound to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Authenticated {
    /// The worker id.
    pub worker: u32,
}

/// A worker asks the coordinator for its next split of the training data (dynamic data sharding). Any
/// split it holds other than `finished` is given back unfinished (it returns to the queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct SplitRequest {
    /// Cluster epoch of the worker's map.
    pub epoch: u64,
    /// The worker id.
    pub worker: u32,
    /// The grant whose every batch this worker pushed and had acknowledged, if any.
    pub finished: Option<u64>,
}

/// One dealt split: a range of lines of one file, or a range of synthetic sample indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct DataSplit {
    /// This deal's unique number (a split dealt again gets a new one).
    pub grant: u64,
    /// The split: `data epoch << 32 | index in the epoch`.
    pub key: u64,
    /// Index of the file in the dealer's list (0 for synthetic data).
    pub file: u32,
    /// Files: the 1-based number of the split's first line in its file. Synthetic: 0.
    pub first_line: u64,
    /// Files: the byte range `[start, end)` (line-aligned). Synthetic: the sample indices `[start, end)`.
    pub start: u64,
    /// See `start`.
    pub end: u64,
    /// Files: lines in the range (held-out and bad lines included). Synthetic: samples.
    pub lines: u64,
}

/// Answer to [`SplitRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct SplitGrant {
    /// The next split (None: every epoch is dealt; the worker is done).
    pub split: Option<DataSplit>,
    /// Files the dealer deals from (0: synthetic data).
    pub files: u32,
    /// Whether `finished` of the request was accepted as this worker's (false: it was not the worker's,
    /// e.g. given back after its lease expired; its samples count as replayed).
    pub finished_accepted: bool,
}

/// Ask a shard for its per-grant sample counts (and, the coordinator, for its dealer's state): the
/// grants after `after_grant`, in order, a page at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct DataStatusRequest {
    /// Only grants above this (0: from the start).
    pub after_grant: u64,
}

/// Samples a shard accepted in pushes tagged with one grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct GrantCount {
    /// The grant.
    pub grant: u64,
    /// Its split's key.
    pub split: u64,
    /// Samples (each accepted push once; duplicates not counted).
    pub samples: u64,
}

/// A split on loan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct GrantLease {
    /// The grant.
    pub grant: u64,
    /// Its split's key.
    pub split: u64,
    /// The worker holding it.
    pub worker: u32,
}

/// Most entries of each list in one [`DataStatus`] page.
pub const DATA_STATUS_PAGE: usize = 4096;

/// The coordinator's dealer, as [`DataStatus`] reports it.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct DealerStatus {
    /// The data epoch being dealt (0-based).
    pub data_epoch: u64,
    /// Epochs to deal (0: no end).
    pub epochs: u64,
    /// Splits in one epoch (0: synthetic data, no end).
    pub splits_per_epoch: u64,
    /// Splits finished, all epochs together.
    pub splits_done: u64,
    /// Splits waiting to be dealt again (given back unfinished).
    pub splits_pending: u64,
    /// Splits given back unfinished so far (dead, departed or rolled-back holders).
    pub splits_returned: u64,
    /// Samples trained under grants that did not finish (counted by this shard's pushes): trained again.
    pub samples_replayed: u64,
    /// Every epoch dealt and finished.
    pub finished: bool,
    /// Splits on loan now.
    pub leased: Vec<GrantLease>,
    /// This page's finished grants (after the request's `after_grant`, in order): `(grant, split)`.
    pub completed: Vec<(u64, u64)>,
    /// This page's abandoned grants (given back unfinished), in order.
    pub abandoned: Vec<u64>,
}

/// Answer to [`DataStatusRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct DataStatus {
    /// The answering shard.
    pub shard: u32,
    /// This page's counts, grant order.
    pub counts: Vec<GrantCount>,
    /// More grants follow this page: ask again with this `after_grant` (None: this was the last page).
    pub next_after: Option<u64>,
    /// Grants whose counts were dropped to bound memory (the oldest go first).
    pub counts_evicted: u64,
    /// The dealer (coordinator with dynamic data sharding only).
    pub dealer: Option<DealerStatus>,
}

/// Wait until the shard's global step reaches `step` and its slowest live worker's clock reaches `clock`
/// (what an [`Ack`] asked the worker to wait for), or at most `max_wait_ms`; answered with the shard's
/// [`Stats`] either way (the caller checks them, and sees a rollback as a step gone back). The shard holds
/// the request instead of being polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct WaitStep {
    /// The global step to wait for ([`Ack::wait_for_step`]; 0: none).
    pub step: u64,
    /// The clock to wait for ([`Ack::wait_for_clock`]; 0: none).
    pub clock: u64,
    /// The longest the shard may hold the request (it caps this at [`MAX_WAIT_STEP_MS`]).
    pub max_wait_ms: u32,
}

/// The longest a shard holds a [`WaitStep`].
pub const MAX_WAIT_STEP_MS: u32 = 1000;

/// One dense chunk of an [`Initialize`]: its id and length (elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct InitChunk {
    /// The chunk.
    pub id: ChunkId,
    /// Its elements (the payload holds this many f32 for it).
    pub len: u32,
}

/// A worker uploads a model's own initial values: every listed dense chunk that no update and no earlier
/// `Initialize` has touched takes the values carried (raw f32, chunk order); the others keep theirs — the
/// first writer wins, and every worker then pulls what won. (Added in protocol 11.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Initialize {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// The worker uploading.
    pub worker: u32,
    /// The chunks carried, payload order.
    pub chunks: Vec<InitChunk>,
}

/// Answer to [`Initialize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Initialized {
    /// Chunks that took the values carried.
    pub taken: u32,
    /// Chunks that kept theirs (set or trained before).
    pub kept: u32,
}

/// Most rows one [`TableScan`] or [`TableLoad`] carries.
pub const MAX_TABLE_PAGE: u32 = 1 << 16;

/// Reads a page of a sparse table's rows as they are stored on this shard (an export): rows from storage
/// position `cursor`, at most `max_rows` (capped at [`MAX_TABLE_PAGE`]). (Added in protocol 11.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct TableScan {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// Table index.
    pub table: u32,
    /// Where to start (0, then the previous page's `next`).
    pub cursor: u64,
    /// Rows wanted.
    pub max_rows: u32,
}

/// A page of rows: payload `count` ids (two words each, as [`ids_to_words`] writes them), then `count × dim`
/// values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct TableRows {
    /// Table index.
    pub table: u32,
    /// Rows in the page.
    pub count: u32,
    /// Floats per row.
    pub dim: u32,
    /// The cursor of the next page; None when this was the last.
    pub next: Option<u64>,
}

/// A worker loads rows into a sparse table (an import): payload `count` ids (two words each), then
/// `count × dim` values. Every id must be this shard's; a row the table holds already keeps its values.
/// (Added in protocol 11.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct TableLoad {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// The worker loading.
    pub worker: u32,
    /// Table index.
    pub table: u32,
    /// Rows carried.
    pub count: u32,
    /// Floats per row.
    pub dim: u32,
}

/// Answer to [`TableLoad`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct TableLoaded {
    /// Rows created with the values carried.
    pub created: u32,
    /// Rows that were held already (kept).
    pub kept: u32,
}
