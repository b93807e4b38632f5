//! The gaps wire protocol.
//!
//! One RPC is one QUIC bidirectional stream: the client writes one request frame and finishes the stream;
//! the server answers with one reply frame and finishes. A frame is
//!
//! ```text
//! [kind: u8][header_len: u32 LE][header: bincode-2, header_len bytes][payload: little-endian values]
//! ```
//!
//! The header is the only part encoded with bincode; tensors travel as raw little-endian values whose
//! count and format are implied by the header: the payload is a sequence of sections
//! ([`Message::payload_sections`]), each `f32` or, for a dense chunk whose tensor says so, a 16-bit format
//! ([`WireDtype`]: bfloat16 or half). Receivers decode every section into `f32` ([`PayloadDecoder`]).
//! Every length is checked against [`Limits`] before anything is allocated, and a header must be consumed
//! exactly.
//!
//! This module and [`crate::quorum`] (shard 0's configuration and the messages that choose it) hold the only
//! types of the project that derive bincode's `Encode`/`Decode`.

use crate::dtype::WireDtype;
use crate::layout::{ChunkId, Layout};
use crate::quorum::{ConfigAccept, ConfigAccepted, ConfigPrepare, ConfigPromise, ConfigRefused, CoordinatorConfig};
use bincode::{Decode, Encode};

/// Protocol version carried by registrations; a peer with another version is refused.
pub const PROTOCOL_VERSION: u16 = 18;
/// Bytes before the header: the kind byte and the header length.
pub const FRAME_PREFIX_LEN: usize = 5;
/// Hard upper bound on an encoded header (also the bincode decode limit).
pub const MAX_HEADER_BYTES: u32 = 1 << 20;
/// Default upper bound on a frame's tensor payload (1 GiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: u64 = 1 << 30;

/// Bounds applied to every incoming frame before allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted header, in bytes (at most [`MAX_HEADER_BYTES`]).
    pub max_header_bytes: u32,
    /// Largest accepted tensor payload, in bytes.
    pub max_payload_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_header_bytes: MAX_HEADER_BYTES, max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES }
    }
}

/// Everything that can be wrong with a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The frame ended before the declared length.
    #[error("truncated frame: needed {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the frame declared.
        needed: u64,
        /// Bytes that arrived.
        got: u64,
    },
    /// The header length exceeds the limit.
    #[error("header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLarge {
        /// Declared length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The payload length implied by the header exceeds the limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// Implied length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The kind byte names no message.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The header does not decode as the message its kind names.
    #[error("malformed header: {0}")]
    BadHeader(String),
    /// The number of payload elements differs from what the header declares.
    #[error("payload has {got} elements, header declares {expected}")]
    ElementCountMismatch {
        /// Declared by the header.
        expected: u64,
        /// Present.
        got: u64,
    },
    /// Bytes follow the end of the frame.
    #[error("{0} unexpected bytes after the end of the frame")]
    TrailingBytes(u64),
    /// The transport failed while reading or writing.
    #[error("transport error: {0}")]
    Io(String),
}

/// Why a request was refused; carried by [`ErrorReply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Encode, Decode)]
pub enum ErrorCode {
    /// The frame could not be decoded.
    Malformed,
    /// The frame's kind is unknown or not valid as a request.
    UnknownKind,
    /// A length exceeded a limit.
    TooLarge,
    /// A tensor/chunk reference or element count does not match the layout.
    WrongShape,
    /// A gradient holds NaN or ±Inf.
    NonFinite,
    /// The chunk belongs to another shard.
    NotOwner,
    /// The request carries an out-of-date cluster epoch.
    StaleEpoch,
    /// Not every shard has joined the cluster yet.
    ClusterIncomplete,
    /// The peer's configuration contradicts the cluster's (layout, shard count, protocol).
    Misconfigured,
    /// The worker id is unknown to this coordinator, or the request needs the coordinator.
    NotRegistered,
    /// The sequence number is too old to tell whether it was applied (or zero).
    SequenceWindow,
    /// The server is shutting down.
    ShuttingDown,
    /// An internal failure; the message says what.
    Internal,
    /// The push was computed on versions this shard has not reached: it was restored from a checkpoint
    /// taken before them. The gradient is stale; pull again.
    ReadAhead,
    /// A checkpoint was asked for at a synchronous step this shard has already passed.
    TooLate,
    /// The peer's certificate or credential does not allow this request.
    Unauthorized,
    /// The server had no room for the request's bytes in time (its in-flight memory budget was taken by
    /// other requests); nothing of it was applied, and the same request may be sent again after a pause.
    Busy,
    /// This process no longer serves the shard (a backup took it over): nothing was applied; fetch the map
    /// again and send the request where it says. (Added in protocol 13.)
    Moved,
}

/// The role a registering client asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub enum Role {
    /// A training worker: gets a worker id and a lease.
    Worker,
    /// A read-only client (evaluation, `gaps local`, benches): gets the map, no id, no lease.
    Observer,
}

/// A client asks the coordinator to join.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Register {
    /// The client's [`PROTOCOL_VERSION`].
    pub protocol: u16,
    /// Worker or observer.
    pub role: Role,
    /// Free-form name for logs.
    pub name: String,
}

/// A non-coordinator shard announces itself to the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct RegisterShard {
    /// The shard's [`PROTOCOL_VERSION`].
    pub protocol: u16,
    /// The shard's index.
    pub shard: u32,
    /// The cluster size the shard was configured with.
    pub num_shards: u32,
    /// Address clients should use to reach the shard.
    pub addr: String,
    /// [`Layout::fingerprint`] of the shard's model.
    pub layout_fingerprint: u64,
}

/// One shard's address.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ShardAddr {
    /// Shard index.
    pub index: u32,
    /// `host:port`.
    pub addr: String,
    /// The shard process serving it, whose certificate the server holds: the shard's own index, or the
    /// backup that took it over (replicated shards). (Added in protocol 13.)
    pub process: u32,
    /// The shard's replica epoch: how many times a backup took it over.
    pub epoch: u64,
    /// The processes whose copy of the shard is in sync (replies wait for them), as the coordinator last
    /// heard; empty without replicas. (Added in protocol 14.)
    pub backups: Vec<u32>,
}

/// The update rule as workers need to know it (DANA-Slim's worker half, which pushes echo their reads).
#[derive(Debug, Clone, PartialEq, Encode, Decode)]
pub struct RuleInfo {
    /// The rule's `--rule` name.
    pub name: String,
    /// Momentum γ.
    pub momentum: f32,
    /// Weight decay λ.
    pub weight_decay: f32,
    /// The `--sparse-rule` name applied to embedding rows.
    pub sparse: String,
}

/// Read rows of one sparse table. Payload: the ids as u64 little-endian (two 32-bit words each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct SparsePull {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// Table index.
    pub table: u32,
    /// Number of ids.
    pub count: u32,
    /// Create missing rows (training); false reads initial values without storing (evaluation).
    pub create: bool,
}

/// Answer to [`SparsePull`]. Payload: one u32 version word per id, then `count × dim` row values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct SparsePullReply {
    /// Table index.
    pub table: u32,
    /// Rows.
    pub count: u32,
    /// Floats per row.
    pub dim: u32,
}

/// A sparse gradient, exactly once per `(worker, seq)` like [`Push`] (the same sequence numbers). Payload:
/// ids (two words each), the versions read (one word each), `count × dim` gradient values, and with
/// `echo_read` the `count × dim` row values the gradients were computed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct SparsePush {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// Worker id.
    pub worker: u32,
    /// Sequence number (shared with dense pushes to the same shard).
    pub seq: u64,
    /// Table index.
    pub table: u32,
    /// Rows (distinct ids).
    pub count: u32,
    /// Floats per row.
    pub dim: u32,
    /// The read rows follow the gradients.
    pub echo_read: bool,
}

/// Packs u64 ids into payload words (low word first).
pub fn ids_to_words(ids: &[u64], out: &mut Vec<f32>) {
    for id in ids {
        out.push(f32::from_bits(*id as u32));
        out.push(f32::from_bits((*id >> 32) as u32));
    }
}

/// Unpacks u64 ids from payload words.
pub fn words_to_ids(words: &[f32]) -> Vec<u64> {
    words.chunks_exact(2).map(|w| u64::from(w[0].to_bits()) | u64::from(w[1].to_bits()) << 32).collect()
}

/// The coordinator's answer to a registration: everything needed to route.
#[derive(Debug, Clone, PartialEq, Encode, Decode)]
pub struct ClusterMap {
    /// Identifies this incarnation of the cluster; requests with another epoch are refused.
    pub epoch: u64,
    /// The id given to a registering worker (None for observers and shards).
    pub worker_id: Option<u32>,
    /// Number of shards.
    pub num_shards: u32,
    /// Every shard's address, index order.
    pub shards: Vec<ShardAddr>,
    /// The model's dense tensors.
    pub layout: Layout,
    /// A worker that sends no heartbeat for this long is considered gone (milliseconds).
    pub lease_ms: u32,
    /// The registering worker's credential ([`Authenticate`] it on every other shard); None for observers.
    pub token: Option<Token>,
    /// The cluster's credential key, given only to a joining shard (so it can check workers' tokens).
    pub auth_key: Option<Token>,
    /// The update rule the shards apply.
    pub rule: RuleInfo,
    /// Copies of each shard the cluster keeps (`--replicas`; 1: none): with more, a client whose request
    /// waits long asks the coordinator whether a backup took the shard over. (Added in protocol 13.)
    pub replicas: u32,
    /// Shard processes that serve no shard (theirs was taken over while they were down; they keep copies
    /// of other shards): index = the process, addr = where it listens. (Added in protocol 13.)
    pub spare: Vec<ShardAddr>,
}

impl ClusterMap {
    /// Where each shard process listens, process order (see [`process_addrs`]).
    pub fn process_addrs(&self) -> Vec<(u32, String)> {
        process_addrs(&self.shards, &self.spare)
    }
}

/// Where each shard process listens, process order, from a map's shards and spare processes: its address as
/// a spare where it joined as one (its own endpoint, which keeps its copies of other shards — even where it
/// was granted its own shard back, served then on an endpoint of its own), else its own shard's address while
/// it serves it (a process whose shard was taken over and that is not back is missing).
pub fn process_addrs(shards: &[ShardAddr], spare: &[ShardAddr]) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = spare.iter().map(|s| (s.index, s.addr.clone())).collect();
    for s in shards.iter().filter(|s| s.process == s.index) {
        if !out.iter().any(|(p, _)| *p == s.index) {
            out.push((s.index, s.addr.clone()));
        }
    }
    out.sort();
    out
}

/// Read a set of chunks.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Pull {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// Chunks to read (all must belong to the addressed shard).
    pub chunks: Vec<ChunkId>,
}

/// One chunk in a reply: its version and length; its values follow in the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ChunkVersion {
    /// Which chunk.
    pub id: ChunkId,
    /// Number of updates applied to this chunk so far.
    pub version: u64,
    /// Elements of this chunk in the payload.
    pub len: u32,
    /// How the values travel (the tensor's wire format on the replying shard).
    pub dtype: WireDtype,
}

/// Answer to [`Pull`]; payload = the chunks' values, in order.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct PullReply {
    /// Chunks in payload order.
    pub chunks: Vec<ChunkVersion>,
}

/// One chunk of a gradient push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct PushChunk {
    /// Which chunk.
    pub id: ChunkId,
    /// The chunk version the gradient was computed on (from the pull).
    pub read_version: u64,
    /// Elements of this chunk in the payload.
    pub len: u32,
    /// The payload also carries, after all gradients, the parameter values this chunk's gradient was
    /// computed on; required exactly for the chunks whose tensor's rule measures drift.
    pub echo: bool,
    /// How this chunk's gradient (and echo) travel; any format is accepted, the shard keeps f32.
    pub dtype: WireDtype,
}

/// A gradient; payload = the chunks' gradients, in order, then the read echo of the chunks that carry one
/// (in the same order). Applied exactly once per `(worker, seq)`.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Push {
    /// Cluster epoch of the client's map.
    pub epoch: u64,
    /// Worker id from the cluster map.
    pub worker: u32,
    /// Per (worker, shard) sequence number, starting at 1 and increasing by one per push.
    pub seq: u64,
    /// The chunks, in payload order.
    pub chunks: Vec<PushChunk>,
    /// The worker's cost of a step as this shard should judge it, in milliseconds (0: unknown): the time it
    /// spent computing this gradient plus two round trips (a pull and a push) on its connection to this
    /// shard, so that a slow link makes a straggler as a slow processor does. Feeds the straggler detector.
    /// Barrier waits are not in it (a synchronous step's wait would make every worker look as slow as the
    /// slowest).
    pub compute_ms: u32,
    /// The worker's step: how many dense pushes it made before this one (the same number goes to every
    /// shard; a worker pushes to every shard every step, with no chunks where it has none to send).
    pub step: u64,
    /// The newest two mode decisions the worker knows (from any shard's answers), so that every shard
    /// learns a decision before the step it takes effect at.
    pub decisions: ModeDecisions,
    /// Where the step's samples came from, under dynamic data sharding (None: a fixed share of the data,
    /// or no data at all). Every shard counts the samples per grant ([`DataStatus`]).
    pub data: Option<DataTag>,
}

/// The samples of one step: all from one dealt split ([`DataSplit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct DataTag {
    /// The grant the split was dealt under ([`DataSplit::grant`]).
    pub grant: u64,
    /// The split's key ([`DataSplit::key`]).
    pub split: u64,
    /// Samples of the split in this step.
    pub samples: u32,
}

/// Answer to [`Message::PushPull`]: the push's acknowledgement and, where the worker may go on at once, the
/// values a pull of the pushed chunks reads right after the push was applied (or found a duplicate);
/// payload = those values, in order, as for a [`PullReply`].
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct PushPullReply {
    /// The push's acknowledgement, as [`Message::Push`] gets it.
    pub ack: Ack,
    /// Every chunk of the push in payload order, or none: when the ack asks the worker to wait (a
    /// synchronous step or bounded staleness), or the read failed, the worker pulls on its own.
    pub chunks: Vec<ChunkVersion>,
}

/// Most parts one striped push may be cut into.
pub const MAX_PUSH_PARTS: u16 = 64;

/// One part of a push striped over several connections to one shard: `push` holds this part's chunks (its
/// payload is their gradients, then their echoes, as for a whole [`Push`]) and every other field of the
/// whole push, the same in every part. The shard applies the push once, when all `parts` parts of
/// `(worker, seq)` are there, as if it had come whole (chunks in part order); every part is answered with
/// the whole push's reply. A part of a push applied before is answered as a duplicate.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct PushPart {
    /// This part's index, below `parts`.
    pub part: u16,
    /// How many parts the push was cut into (2 to [`MAX_PUSH_PARTS`]).
    pub parts: u16,
    /// The push, with this part's chunks only.
    pub push: Push,
}

/// A cluster-wide mode decision of the coordinator under `--mode auto`: from worker step `from_step` on,
/// every shard runs `mode`. Numbered: a larger `number` supersedes a smaller one. Number 0 is the start
/// (no decision yet: `auto` starts in sync).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub struct ModeDecision {
    /// Sequence number of the decision (0: none yet).
    pub number: u64,
    /// The mode's wire code (see `gaps_shard::modes::Mode::code`).
    pub mode: u8,
    /// First worker step run in `mode`.
    pub from_step: u64,
}

/// The newest two decisions someone knows: the latest and the one before it (enough to know the mode of
/// any step from the latest's predecessor on, since the coordinator decides again only once its latest
/// decision is in force).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub struct ModeDecisions {
    /// The newest.
    pub latest: ModeDecision,
    /// The one before it (number 0 when there is none).
    pub previous: ModeDecision,
}

impl ModeDecisions {
    /// Only the start: mode `mode` from step 0, no decision made.
    pub fn start(mode: u8) -> Self {
        let start = ModeDecision { number: 0, mode, from_step: 0 };
        ModeDecisions { latest: start, previous: start }
    }

    /// Keeps the newest two of these and `other`'s.
    pub fn merge(&mut self, other: &ModeDecisions) {
        let mut all = [self.latest, self.previous, other.latest, other.previous];
        all.sort_by_key(|d| std::cmp::Reverse(d.number));
        self.latest = all[0];
        self.previous = all.iter().copied().find(|d| d.number < all[0].number).unwrap_or(all[0]);
    }

    /// Adds a new latest decision.
    pub fn push(&mut self, decision: ModeDecision) {
        self.previous = self.latest;
        self.latest = decision;
    }

    /// The decision in force at worker step `step`, if one of the two is.
    pub fn in_force(&self, step: u64) -> Option<ModeDecision> {
        [self.latest, self.previous].into_iter().find(|d| step >= d.from_step)
    }
}

/// One switch of the cluster's mode, as the coordinator decided it and a shard carried it out.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ModeSwitchRecord {
    /// The decision's number.
    pub number: u64,
    /// Mode code before.
    pub from: u8,
    /// Mode code after.
    pub to: u8,
    /// First worker step run in the new mode.
    pub from_step: u64,
    /// The shard's global step (synchronous steps applied) when it switched.
    pub at_global_step: u64,
    /// Why the coordinator decided it (empty on shards that learned the decision from a worker).
    pub reason: String,
}

/// Acknowledges a push.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Encode, Decode)]
pub struct Ack {
    /// The acknowledged sequence number.
    pub seq: u64,
    /// True when this `(worker, seq)` had been applied before and was not applied again.
    pub duplicate: bool,
    /// Largest staleness τ over the push's chunks (0 for duplicates).
    pub max_staleness: u64,
    /// Synchronous step not complete yet: pull again only once the shard's global step (synchronous steps
    /// applied, [`Stats::global_step`]) reaches this (0: go on).
    pub wait_for_step: u64,
    /// Bounded staleness: go on only once the slowest live worker's clock reaches this (0: go on).
    pub wait_for_clock: u64,
    /// The newest two mode decisions this shard knows (the worker passes them on to the other shards).
    pub decisions: ModeDecisions,
}

/// A typed refusal, answered on the request's stream.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ErrorReply {
    /// Machine-readable reason.
    pub code: ErrorCode,
    /// Human-readable explanation.
    pub message: String,
}

/// A worker renews its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Heartbeat {
    /// The worker id.
    pub worker: u32,
}

/// A worker leaves the job for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct Leave {
    /// The worker id.
    pub worker: u32,
}

/// Answer to [`Heartbeat`] and [`Leave`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct HeartbeatAck {
    /// Cluster epoch.
    pub epoch: u64,
    /// Workers holding a lease.
    pub live_workers: u32,
}

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

/// A piece of a snapshot of shard `shard`'s state as of its log entry `index`, sent by the shard's primary
/// to a backup (replicated shards, docs/replication.md): `bytes` bytes of the snapshot from `offset`, of
/// `total`, packed four to a payload word ([`bytes_to_words`]). The backup answers each piece with
/// [`ReplicaAck`]; the last one's carries `index` once the snapshot is restored. (Added in protocol 12.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaSnapshot {
    /// The shard replicated.
    pub shard: u32,
    /// The last log entry the snapshot holds.
    pub index: u64,
    /// Where this piece starts in the snapshot.
    pub offset: u64,
    /// The snapshot's length in bytes.
    pub total: u64,
    /// This piece's length in bytes.
    pub bytes: u32,
}

/// Entries of shard `shard`'s log from index `first` on, in order, sent by the primary to a backup: entry
/// `k` is `lens[k]` bytes (`gaps_shard::replica::LogEntry`), the entries one after the other packed four
/// bytes to a payload word ([`bytes_to_words`]). (Added in protocol 12.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaAppend {
    /// The shard replicated.
    pub shard: u32,
    /// The first entry's index.
    pub first: u64,
    /// Each entry's length in bytes.
    pub lens: Vec<u32>,
}

/// A backup's answer to [`ReplicaSnapshot`] and [`ReplicaAppend`]: the last log entry of `shard` it has
/// applied (0 after a snapshot piece that is not the last). (Added in protocol 12.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaAck {
    /// The shard replicated.
    pub shard: u32,
    /// The last entry applied.
    pub applied: u64,
}

impl ReplicaAppend {
    /// Bytes of the entries together.
    pub fn total_bytes(&self) -> u64 {
        self.lens.iter().map(|&n| u64::from(n)).sum()
    }
}

/// Packs bytes into payload words, four to a word (little-endian; the last word padded with zeros).
pub fn bytes_to_words(bytes: &[u8], out: &mut Vec<f32>) {
    out.reserve(bytes.len().div_ceil(4));
    for c in bytes.chunks(4) {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        out.push(f32::from_bits(u32::from_le_bytes(w)));
    }
}

/// The first `len` bytes packed in `words` by [`bytes_to_words`]; None when the words hold fewer.
pub fn words_to_bytes(words: &[f32], len: u64) -> Option<Vec<u8>> {
    let len = usize::try_from(len).ok()?;
    if words.len().checked_mul(4)? < len {
        return None;
    }
    let mut out = Vec::with_capacity(len);
    for w in words {
        out.extend_from_slice(&w.to_bits().to_le_bytes());
        if out.len() >= len {
            break;
        }
    }
    out.truncate(len);
    Some(out)
}

/// A primary's report to the coordinator (replicated shards): process `process` serves shard `shard` under
/// replica epoch `epoch`, and its replies wait for the backup processes `in_sync`, which therefore hold
/// every request it acknowledged. Sent after a backup starts counting and before one stops. The coordinator
/// refuses it ([`ErrorCode::Moved`]) when the shard is served under another epoch: this primary was replaced
/// and answers nothing more. (Added in protocol 13.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaReport {
    /// The shard.
    pub shard: u32,
    /// The process serving it (the sender).
    pub process: u32,
    /// The replica epoch it serves under.
    pub epoch: u64,
    /// Its backups in sync.
    pub in_sync: Vec<u32>,
}

/// A backup's request to the coordinator to take over shard `shard`, whose primary went silent: process
/// `process`, in sync under replica epoch `epoch`, serves its copy at `addr` from epoch `epoch + 1`.
/// (Added in protocol 13.)
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Promote {
    /// The shard.
    pub shard: u32,
    /// The backup process (the sender).
    pub process: u32,
    /// The replica epoch its copy was in sync under.
    pub epoch: u64,
    /// Where it serves the shard.
    pub addr: String,
}

/// The coordinator's answer to [`ReplicaReport`] and [`Promote`]: the shard's replica epoch now.
/// (Added in protocol 13.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct ReplicaEpoch {
    /// The shard.
    pub shard: u32,
    /// Its replica epoch.
    pub epoch: u64,
}

/// Any peer's question to any shard process: where is the coordinator (shard 0) served now? Answered with
/// [`Message::CoordinatorAt`]: the last configuration of shard 0 the process knows chosen (version 0, process
/// 0 at the address the process was given, where a majority does not choose it), and the shards it holds
/// copies of. (Added in protocol 16; the answer's copies in 18.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Encode, Decode)]
pub struct CoordinatorWhere {
    /// The version of shard 0's configuration the asker knows (for the answerer's logs).
    pub known: u64,
}

/// A shard process's answer to [`Message::CoordinatorWhere`] (protocol 18): where it knows the coordinator
/// to be, and which shards it holds a copy of in memory — none while it starts. A process serving shard 0
/// that starts again takes this as proof that a backup of its last configuration holds nothing it lacks.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct CoordinatorAt {
    /// The last configuration of shard 0 the process knows chosen.
    pub config: CoordinatorConfig,
    /// The shards whose copies the process holds (taken from their primaries since it started), sorted.
    pub copies: Vec<u32>,
    /// The process is starting: it answers only where the coordinator is and its part in choosing shard 0's
    /// configuration.
    pub starting: bool,
}

/// Every message of the protocol. The kind byte on the wire is [`Message::kind`].
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Kind 1.
    Register(Register),
    /// Kind 2.
    RegisterShard(RegisterShard),
    /// Kind 3.
    ClusterMap(ClusterMap),
    /// Kind 4.
    Pull(Pull),
    /// Kind 5 (carries a payload).
    PullReply(PullReply),
    /// Kind 6 (carries a payload).
    Push(Push),
    /// Kind 7.
    Ack(Ack),
    /// Kind 8.
    Error(ErrorReply),
    /// Kind 9.
    Heartbeat(Heartbeat),
    /// Kind 10.
    HeartbeatAck(HeartbeatAck),
    /// Kind 11.
    StatsRequest(StatsRequest),
    /// Kind 12.
    Stats(Stats),
    /// Kind 13.
    Leave(Leave),
    /// Kind 14 (carries ids).
    SparsePull(SparsePull),
    /// Kind 15 (carries versions and rows).
    SparsePullReply(SparsePullReply),
    /// Kind 16 (carries ids, versions, gradients, optionally rows).
    SparsePush(SparsePush),
    /// Kind 17.
    CheckpointRequest(CheckpointRequest),
    /// Kind 18.
    CheckpointDone(CheckpointDone),
    /// Kind 19.
    Authenticate(Authenticate),
    /// Kind 20.
    Authenticated(Authenticated),
    /// Kind 21 (carries a payload).
    PushPart(PushPart),
    /// Kind 22 (carries a payload): a [`Push`] answered with the pushed chunks' new values, saving the
    /// worker the pull that would follow it.
    PushPull(Push),
    /// Kind 23 (carries a payload).
    PushPullReply(PushPullReply),
    /// Kind 24.
    Rollback(Rollback),
    /// Kind 25.
    RollbackReply(RollbackReply),
    /// Kind 26.
    SplitRequest(SplitRequest),
    /// Kind 27.
    SplitGrant(SplitGrant),
    /// Kind 28.
    DataStatusRequest(DataStatusRequest),
    /// Kind 29.
    DataStatus(DataStatus),
    /// Kind 30 (answered with [`Message::Stats`]).
    WaitStep(WaitStep),
    /// A model's own initial values for untouched dense chunks.
    Initialize(Initialize),
    /// Answer to [`Message::Initialize`].
    Initialized(Initialized),
    /// A page of a table's rows (export).
    TableScan(TableScan),
    /// Answer to [`Message::TableScan`].
    TableRows(TableRows),
    /// Rows loaded into a table (import).
    TableLoad(TableLoad),
    /// Answer to [`Message::TableLoad`].
    TableLoaded(TableLoaded),
    /// A piece of a snapshot, primary to backup.
    ReplicaSnapshot(ReplicaSnapshot),
    /// Log entries, primary to backup.
    ReplicaAppend(ReplicaAppend),
    /// A backup's answer to both.
    ReplicaAck(ReplicaAck),
    /// A primary's backups in sync, to the coordinator.
    ReplicaReport(ReplicaReport),
    /// A backup taking over its shard, to the coordinator.
    Promote(Promote),
    /// The coordinator's answer to both.
    ReplicaEpoch(ReplicaEpoch),
    /// Choosing shard 0's configuration ([`crate::quorum`], protocol 16), phase 1, proposer to acceptor.
    ConfigPrepare(ConfigPrepare),
    /// An acceptor's promise.
    ConfigPromise(ConfigPromise),
    /// Phase 2, proposer to acceptor.
    ConfigAccept(ConfigAccept),
    /// An acceptor accepted.
    ConfigAccepted(ConfigAccepted),
    /// An acceptor refused, with what it knows.
    ConfigRefused(ConfigRefused),
    /// A configuration chosen (to every process), and an acceptor's answer to it: the last it knows.
    ConfigChosen(CoordinatorConfig),
    /// Where the coordinator is, asked of any shard process.
    CoordinatorWhere(CoordinatorWhere),
    /// The answer to [`Message::CoordinatorWhere`].
    CoordinatorAt(CoordinatorAt),
}

/// Defines `kind()`, header encoding and kind-directed decoding for every variant in one place.
macro_rules! message_kinds {
    ($($kind:literal => $variant:ident),* $(,)?) => {
        impl Message {
            /// The kind byte of this message on the wire.
            pub fn kind(&self) -> u8 {
                match self { $(Message::$variant(_) => $kind,)* }
            }

            /// True when `kind` names a message of this protocol.
            pub fn is_known_kind(kind: u8) -> bool {
                [$($kind),*].contains(&kind)
            }

            fn encode_body(&self, out: &mut Vec<u8>) -> Result<usize, bincode::error::EncodeError> {
                match self { $(Message::$variant(m) => bincode::encode_into_std_write(m, out, config()),)* }
            }

            fn decode_body(kind: u8, bytes: &[u8]) -> Result<(Message, usize), WireError> {
                let bad = |e: bincode::error::DecodeError| WireError::BadHeader(e.to_string());
                match kind {
                    $($kind => {
                        let (m, used) = bincode::decode_from_slice(bytes, config()).map_err(bad)?;
                        Ok((Message::$variant(m), used))
                    })*
                    other => Err(WireError::UnknownKind(other)),
                }
            }
        }
    };
}

message_kinds! {
    1 => Register, 2 => RegisterShard, 3 => ClusterMap, 4 => Pull, 5 => PullReply, 6 => Push, 7 => Ack,
    8 => Error, 9 => Heartbeat, 10 => HeartbeatAck, 11 => StatsRequest, 12 => Stats, 13 => Leave,
    14 => SparsePull, 15 => SparsePullReply, 16 => SparsePush, 17 => CheckpointRequest, 18 => CheckpointDone,
    19 => Authenticate, 20 => Authenticated, 21 => PushPart, 22 => PushPull, 23 => PushPullReply,
    24 => Rollback, 25 => RollbackReply, 26 => SplitRequest, 27 => SplitGrant, 28 => DataStatusRequest,
    29 => DataStatus, 30 => WaitStep, 31 => Initialize, 32 => Initialized,
    33 => TableScan, 34 => TableRows, 35 => TableLoad, 36 => TableLoaded,
    37 => ReplicaSnapshot, 38 => ReplicaAppend, 39 => ReplicaAck, 40 => ReplicaReport, 41 => Promote,
    42 => ReplicaEpoch, 43 => ConfigPrepare, 44 => ConfigPromise, 45 => ConfigAccept, 46 => ConfigAccepted,
    47 => ConfigRefused, 48 => ConfigChosen, 49 => CoordinatorWhere, 50 => CoordinatorAt,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_variable_int_encoding()
        .with_limit::<{ MAX_HEADER_BYTES as usize }>()
}

impl Message {
    /// The payload's sections in order: `(values, format)`. Sparse payloads and everything else are f32.
    pub fn payload_sections(&self) -> Vec<(u64, WireDtype)> {
        match self {
            Message::PullReply(PullReply { chunks }) | Message::PushPullReply(PushPullReply { chunks, .. }) => {
                chunks.iter().map(|c| (u64::from(c.len), c.dtype)).collect()
            }
            Message::Push(p) | Message::PushPull(p) | Message::PushPart(PushPart { push: p, .. }) => {
                let grads = p.chunks.iter().map(|c| (u64::from(c.len), c.dtype));
                grads.chain(p.chunks.iter().filter(|c| c.echo).map(|c| (u64::from(c.len), c.dtype))).collect()
            }
            other => match other.payload_elems() {
                0 => Vec::new(),
                n => vec![(n, WireDtype::F32)],
            },
        }
    }

    /// Bytes of payload on the wire (each section's values times its format's size).
    pub fn payload_bytes(&self) -> u64 {
        match self {
            Message::PullReply(_)
            | Message::PushPullReply(_)
            | Message::Push(_)
            | Message::PushPull(_)
            | Message::PushPart(_) => self
                .payload_sections()
                .iter()
                .fold(0u64, |sum, (n, d)| sum.saturating_add(n.saturating_mul(d.bytes() as u64))),
            other => other.payload_elems().saturating_mul(4),
        }
    }

    /// Number of payload values this header declares (sum of the chunk lengths), whatever their format;
    /// receivers hold them as f32.
    pub fn payload_elems(&self) -> u64 {
        match self {
            Message::PullReply(PullReply { chunks }) | Message::PushPullReply(PushPullReply { chunks, .. }) => {
                chunks.iter().map(|c| u64::from(c.len)).sum()
            }
            Message::Push(p) | Message::PushPull(p) | Message::PushPart(PushPart { push: p, .. }) => {
                p.chunks.iter().map(|c| u64::from(c.len) * (1 + u64::from(c.echo))).sum()
            }
            Message::SparsePull(p) => 2 * u64::from(p.count),
            Message::SparsePullReply(r) => u64::from(r.count) * (1 + u64::from(r.dim)),
            Message::SparsePush(p) => u64::from(p.count) * (3 + u64::from(p.dim) * (1 + u64::from(p.echo_read))),
            Message::Initialize(i) => i.chunks.iter().map(|c| u64::from(c.len)).sum(),
            Message::TableRows(r) => u64::from(r.count) * (2 + u64::from(r.dim)),
            Message::TableLoad(r) => u64::from(r.count) * (2 + u64::from(r.dim)),
            Message::ReplicaSnapshot(r) => u64::from(r.bytes).div_ceil(4),
            Message::ReplicaAppend(r) => r.total_bytes().div_ceil(4),
            _ => 0,
        }
    }

    /// Shorthand for an [`ErrorReply`].
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Message {
        Message::Error(ErrorReply { code, message: message.into() })
    }
}

/// A decoded frame: header message plus tensor payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// The header.
    pub msg: Message,
    /// The tensor payload (empty for messages without one).
    pub payload: Vec<f32>,
}

impl Frame {
    /// A frame without payload.
    pub fn new(msg: Message) -> Frame {
        Frame { msg, payload: Vec::new() }
    }
}

/// Encodes the prefix and header of a frame whose payload has `payload_elems` elements.
pub fn encode_header(msg: &Message, payload_elems: usize) -> Result<Vec<u8>, WireError> {
    let declared = msg.payload_elems();
    if declared != payload_elems as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: payload_elems as u64 });
    }
    let mut out = vec![msg.kind(), 0, 0, 0, 0];
    let len = msg.encode_body(&mut out).map_err(|e| WireError::BadHeader(e.to_string()))?;
    if len as u64 > u64::from(MAX_HEADER_BYTES) {
        return Err(WireError::HeaderTooLarge { len: len as u64, max: u64::from(MAX_HEADER_BYTES) });
    }
    out[1..5].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Encodes a whole frame into one buffer (prefix, header, payload).
pub fn encode_frame(frame: &Frame) -> Result<Vec<u8>, WireError> {
    let mut out = encode_header(&frame.msg, frame.payload.len())?;
    for part in encode_payload(&frame.msg, &frame.payload)? {
        out.extend_from_slice(&part);
    }
    Ok(out)
}

/// The wire bytes of `values`, the whole payload of `msg`, section by section: f32 sections as views of
/// `values` (no copy on little-endian hosts), 16-bit ones converted.
pub fn encode_payload<'v>(msg: &Message, values: &'v [f32]) -> Result<Vec<std::borrow::Cow<'v, [u8]>>, WireError> {
    let sections = msg.payload_sections();
    let declared: u64 = sections.iter().map(|(n, _)| n).sum();
    if declared != values.len() as u64 {
        return Err(WireError::ElementCountMismatch { expected: declared, got: values.len() as u64 });
    }
    let mut parts: Vec<std::borrow::Cow<'v, [u8]>> = Vec::new();
    let mut at = 0usize;
    let mut f32_run = 0usize;
    for (n, dtype) in sections {
        let n = n as usize;
        if dtype == WireDtype::F32 {
            f32_run += n;
        } else {
            if f32_run > 0 {
                parts.push(f32s_to_le_bytes(&values[at - f32_run..at]));
                f32_run = 0;
            }
            parts.push(std::borrow::Cow::Owned(crate::dtype::encode_bulk(dtype, &values[at..at + n])));
        }
        at += n;
    }
    if f32_run > 0 {
        parts.push(f32s_to_le_bytes(&values[at - f32_run..at]));
    }
    Ok(parts)
}

/// Decodes a payload arriving in byte pieces of any length and alignment into f32 values, section by
/// section (see [`Message::payload_sections`]). Whole runs of values are handed to the caller's `emit` in
/// their wire format; a value split across pieces is kept until it is complete.
#[derive(Debug)]
pub struct PayloadDecoder {
    sections: Vec<(u64, WireDtype)>,
    section: usize,
    left: u64,
    carry: [u8; 4],
    carry_len: usize,
    bytes_left: u64,
}

impl PayloadDecoder {
    /// A decoder for the payload `msg` announces.
    pub fn new(msg: &Message) -> Self {
        let sections: Vec<(u64, WireDtype)> = msg.payload_sections().into_iter().filter(|(n, _)| *n > 0).collect();
        let left = sections.first().map_or(0, |s| s.0);
        PayloadDecoder { sections, section: 0, left, carry: [0; 4], carry_len: 0, bytes_left: msg.payload_bytes() }
    }

    /// Payload bytes still to come.
    pub fn bytes_missing(&self) -> u64 {
        self.bytes_left
    }

    /// True once the whole payload was decoded.
    pub fn is_done(&self) -> bool {
        self.bytes_left == 0
    }

    /// Consumes `bytes` (anything beyond the payload is ignored) and calls `emit(format, bytes)` for each run
    /// of whole values, in payload order.
    pub fn feed(&mut self, bytes: &[u8], emit: &mut impl FnMut(WireDtype, &[u8])) {
        let mut bytes = &bytes[..bytes.len().min(usize::try_from(self.bytes_left).unwrap_or(usize::MAX))];
        while !bytes.is_empty() {
            while self.left == 0 {
                self.section += 1;
                match self.sections.get(self.section) {
                    Some(section) => self.left = section.0,
                    // Only a byte count that disagrees with the sections (it saturated) gets here.
                    None => {
                        self.bytes_left = 0;
                        return;
                    }
                }
            }
            let dtype = self.sections[self.section].1;
            let width = dtype.bytes();
            if self.carry_len > 0 {
                let take = (width - self.carry_len).min(bytes.len());
                self.carry[self.carry_len..self.carry_len + take].copy_from_slice(&bytes[..take]);
                self.carry_len += take;
                self.bytes_left -= take as u64;
                bytes = &bytes[take..];
                if self.carry_len == width {
                    emit(dtype, &self.carry[..width]);
                    self.carry_len = 0;
                    self.left -= 1;
                }
                continue;
            }
            let whole = ((bytes.len() / width) as u64).min(self.left) as usize;
            if whole > 0 {
                emit(dtype, &bytes[..whole * width]);
                self.left -= whole as u64;
                self.bytes_left -= (whole * width) as u64;
                bytes = &bytes[whole * width..];
            } else {
                self.carry[..bytes.len()].copy_from_slice(bytes);
                self.carry_len = bytes.len();
                self.bytes_left -= bytes.len() as u64;
                bytes = &[];
            }
        }
    }
}

/// Checks a frame prefix and returns `(kind, header_len)`; the header length is bounded here.
pub fn parse_prefix(prefix: &[u8; FRAME_PREFIX_LEN], limits: &Limits) -> Result<(u8, usize), WireError> {
    let kind = prefix[0];
    if !Message::is_known_kind(kind) {
        return Err(WireError::UnknownKind(kind));
    }
    let len = u32::from_le_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
    let max = limits.max_header_bytes.min(MAX_HEADER_BYTES);
    if len > max {
        return Err(WireError::HeaderTooLarge { len: u64::from(len), max: u64::from(max) });
    }
    Ok((kind, len as usize))
}

/// Decodes a header of the given kind, which must be consumed exactly, and bounds the payload it implies.
pub fn decode_header(kind: u8, header: &[u8], limits: &Limits) -> Result<Message, WireError> {
    let (msg, used) = Message::decode_body(kind, header)?;
    if used != header.len() {
        return Err(WireError::BadHeader(format!("{} unused bytes in the header", header.len() - used)));
    }
    let bytes = msg.payload_elems().saturating_mul(4);
    if bytes > limits.max_payload_bytes {
        return Err(WireError::PayloadTooLarge { len: bytes, max: limits.max_payload_bytes });
    }
    Ok(msg)
}

/// Decodes one complete frame from a buffer that must hold exactly one frame.
pub fn decode_frame(buf: &[u8], limits: &Limits) -> Result<Frame, WireError> {
    let truncated = |needed: usize| WireError::Truncated { needed: needed as u64, got: buf.len() as u64 };
    let prefix: &[u8; FRAME_PREFIX_LEN] =
        buf.get(..FRAME_PREFIX_LEN).and_then(|p| p.try_into().ok()).ok_or(truncated(FRAME_PREFIX_LEN))?;
    let (kind, header_len) = parse_prefix(prefix, limits)?;
    let header_end = FRAME_PREFIX_LEN + header_len;
    let header = buf.get(FRAME_PREFIX_LEN..header_end).ok_or(truncated(header_end))?;
    let msg = decode_header(kind, header, limits)?;
    let payload_bytes = msg.payload_bytes() as usize;
    let rest = &buf[header_end..];
    if rest.len() < payload_bytes {
        return Err(truncated(header_end + payload_bytes));
    }
    if rest.len() > payload_bytes {
        return Err(WireError::TrailingBytes((rest.len() - payload_bytes) as u64));
    }
    Ok(Frame { payload: decode_payload(&msg, rest), msg })
}

/// Decodes a whole payload of `msg` (whose length the caller checked) into f32 values.
fn decode_payload(msg: &Message, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(msg.payload_elems() as usize);
    PayloadDecoder::new(msg).feed(bytes, &mut |dtype, run| crate::dtype::decode_extend(dtype, run, &mut out));
    out
}

/// A source of bytes that can fill a whole buffer or fail; implemented by the transports (the QUIC
/// receive stream) and by in-memory readers in tests. The transport maps its own errors into [`WireError`]
/// (an early end of stream is [`WireError::Truncated`]).
pub trait ReadExact {
    /// Fills `buf` completely.
    fn read_exact(&mut self, buf: &mut [u8]) -> impl std::future::Future<Output = Result<(), WireError>> + Send;
}

/// Reads one frame; lengths are bounded by `limits` before each allocation.
pub async fn read_frame<R: ReadExact>(source: &mut R, limits: &Limits) -> Result<Frame, WireError> {
    let msg = read_header(source, limits).await?;
    let payload = read_payload(source, &msg).await?;
    Ok(Frame { msg, payload })
}

/// Reads a frame's prefix and header; the payload it announces ([`Message::payload_elems`], bounded by
/// `limits`) follows on the stream. A server uses the split to reserve memory before reading the payload.
pub async fn read_header<R: ReadExact>(source: &mut R, limits: &Limits) -> Result<Message, WireError> {
    let mut prefix = [0u8; FRAME_PREFIX_LEN];
    source.read_exact(&mut prefix).await?;
    let (kind, header_len) = parse_prefix(&prefix, limits)?;
    let mut header = vec![0u8; header_len];
    source.read_exact(&mut header).await?;
    decode_header(kind, &header, limits)
}

/// Reads the payload `msg` announces.
pub async fn read_payload<R: ReadExact>(source: &mut R, msg: &Message) -> Result<Vec<f32>, WireError> {
    let mut bytes = vec![0u8; msg.payload_bytes() as usize];
    source.read_exact(&mut bytes).await?;
    Ok(decode_payload(msg, &bytes))
}

/// The little-endian bytes of a slice of f32 (a plain view on little-endian hosts).
pub fn f32s_to_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// f32 values from little-endian bytes (length must be a multiple of 4; extra bytes are ignored).
pub fn le_bytes_to_f32s(bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / 4;
    let mut out = vec![0f32; n];
    bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(&bytes[..n * 4]);
    from_le_in_place(&mut out);
    out
}

/// Converts values just read as raw little-endian bytes into native order (a no-op on little-endian hosts).
pub fn from_le_in_place(values: &mut [f32]) {
    if cfg!(target_endian = "big") {
        for v in values.iter_mut() {
            *v = f32::from_bits(u32::from_le(v.to_bits()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_travel_in_words_and_come_back_whole() {
        for len in 0..12usize {
            let bytes: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37).wrapping_add(200)).collect();
            let mut words = Vec::new();
            bytes_to_words(&bytes, &mut words);
            assert_eq!(words.len(), len.div_ceil(4));
            assert_eq!(words_to_bytes(&words, len as u64), Some(bytes.clone()));
            assert_eq!(words_to_bytes(&words, len as u64 + 4), None, "more bytes than the words hold");
        }
    }
    use crate::layout::TensorSpec;

    fn samples() -> Vec<Frame> {
        let id = ChunkId { tensor: 1, chunk: 2 };
        let layout = Layout::new(vec![TensorSpec::new("w", 10)], 4).expect("layout");
        vec![
            Frame::new(Message::Register(Register { protocol: 1, role: Role::Worker, name: "w0".into() })),
            Frame::new(Message::RegisterShard(RegisterShard {
                protocol: 1,
                shard: 1,
                num_shards: 2,
                addr: "127.0.0.1:4000".into(),
                layout_fingerprint: 42,
            })),
            Frame::new(Message::ClusterMap(ClusterMap {
                epoch: 9,
                worker_id: Some(3),
                num_shards: 1,
                shards: vec![ShardAddr {
                    index: 0,
                    addr: "127.0.0.1:1".into(),
                    process: 1,
                    epoch: 2,
                    backups: vec![2],
                }],
                layout,
                lease_ms: 5000,
                token: Some([7; 32]),
                auth_key: None,
                replicas: 2,
                spare: vec![ShardAddr { index: 1, addr: "h:2".into(), process: 1, epoch: 0, backups: vec![] }],
                rule: RuleInfo {
                    name: "gap-aware".into(),
                    momentum: 0.9,
                    weight_decay: 1e-4,
                    sparse: "adagrad".into(),
                },
            })),
            Frame::new(Message::Pull(Pull { epoch: 9, chunks: vec![id] })),
            Frame {
                msg: Message::PullReply(PullReply {
                    chunks: vec![ChunkVersion { id, version: 5, len: 3, dtype: WireDtype::F32 }],
                }),
                payload: vec![1.0, -2.5, 3.25],
            },
            Frame {
                msg: Message::PullReply(PullReply {
                    chunks: vec![
                        ChunkVersion { id, version: 5, len: 2, dtype: WireDtype::Bf16 },
                        ChunkVersion { id, version: 6, len: 1, dtype: WireDtype::F32 },
                        ChunkVersion { id, version: 7, len: 3, dtype: WireDtype::F16 },
                    ],
                }),
                payload: vec![1.0, -2.5, f32::from_bits(0x3f80_0001), 0.25, -65504.0, 6.1035156e-5],
            },
            Frame {
                msg: Message::Push(Push {
                    epoch: 9,
                    worker: 3,
                    seq: 17,
                    chunks: vec![
                        PushChunk { id, read_version: 4, len: 2, echo: true, dtype: WireDtype::Bf16 },
                        PushChunk { id, read_version: 4, len: 1, echo: false, dtype: WireDtype::F32 },
                        PushChunk { id, read_version: 4, len: 1, echo: true, dtype: WireDtype::F16 },
                    ],
                    compute_ms: 12,
                    step: 41,
                    decisions: ModeDecisions {
                        latest: ModeDecision { number: 3, mode: 2, from_step: 40 },
                        previous: ModeDecision { number: 2, mode: 1, from_step: 30 },
                    },
                    data: Some(DataTag { grant: 7 << 32 | 5, split: 1 << 32 | 3, samples: 64 }),
                }),
                // Gradients (bf16 ×2, f32, f16), then the echoes (bf16 ×2, f16): all exact in their format.
                payload: vec![0.5, f32::MIN_POSITIVE, 1.1, -3.0, -1.0, 2.0, 0.125],
            },
            Frame::new(Message::Ack(Ack {
                seq: 17,
                duplicate: true,
                max_staleness: 3,
                wait_for_step: 8,
                wait_for_clock: 2,
                decisions: ModeDecisions {
                    latest: ModeDecision { number: 2, mode: 1, from_step: 9 },
                    previous: ModeDecision::default(),
                },
            })),
            Frame::new(Message::error(ErrorCode::NonFinite, "NaN at 3")),
            Frame::new(Message::Heartbeat(Heartbeat { worker: 3 })),
            Frame::new(Message::HeartbeatAck(HeartbeatAck { epoch: 9, live_workers: 4 })),
            Frame::new(Message::StatsRequest(StatsRequest)),
            Frame::new(Message::CheckpointRequest(CheckpointRequest { id: 0, at: CheckpointAt::Step(9) })),
            Frame::new(Message::CheckpointDone(CheckpointDone {
                id: 7,
                shards: vec![ShardCheckpoint { shard: 1, path: "/ckpt/shard-1/x.bin".into(), step: 4 }],
            })),
            Frame::new(Message::Rollback(Rollback { id: 1 << 40, stage: RollbackStage::Restored })),
            Frame::new(Message::Rollback(Rollback { id: 9, stage: RollbackStage::List })),
            Frame::new(Message::Rollback(Rollback { id: 9, stage: RollbackStage::Apply })),
            Frame::new(Message::RollbackReply(RollbackReply { shard: 2, held: vec![9, 7, 3], step: 41 })),
            Frame::new(Message::SplitRequest(SplitRequest { epoch: 3, worker: 9, finished: Some(1 << 33) })),
            Frame::new(Message::SplitGrant(SplitGrant {
                split: Some(DataSplit {
                    grant: 5,
                    key: 1 << 32 | 2,
                    file: 1,
                    first_line: 2001,
                    start: 1 << 20,
                    end: 3 << 20,
                    lines: 1000,
                }),
                files: 2,
                finished_accepted: true,
            })),
            Frame::new(Message::DataStatusRequest(DataStatusRequest { after_grant: 77 })),
            Frame::new(Message::WaitStep(WaitStep { step: 12, clock: 3, max_wait_ms: 250 })),
            Frame {
                msg: Message::Initialize(Initialize {
                    epoch: 9,
                    worker: 4,
                    chunks: vec![InitChunk { id: ChunkId { tensor: 0, chunk: 1 }, len: 3 }],
                }),
                payload: vec![0.5, -1.0, 2.0],
            },
            Frame::new(Message::Initialized(Initialized { taken: 2, kept: 1 })),
            Frame::new(Message::TableScan(TableScan { epoch: 9, table: 1, cursor: 40, max_rows: 100 })),
            Frame {
                msg: Message::TableRows(TableRows { table: 1, count: 1, dim: 2, next: Some(41) }),
                payload: vec![f32::from_bits(7), f32::from_bits(0), 0.5, 0.25],
            },
            Frame {
                msg: Message::TableLoad(TableLoad { epoch: 9, worker: 3, table: 0, count: 1, dim: 1 }),
                payload: vec![f32::from_bits(9), f32::from_bits(1), -2.0],
            },
            Frame::new(Message::TableLoaded(TableLoaded { created: 1, kept: 0 })),
            Frame {
                msg: Message::ReplicaSnapshot(ReplicaSnapshot { shard: 1, index: 40, offset: 8, total: 13, bytes: 5 }),
                payload: {
                    let mut w = Vec::new();
                    bytes_to_words(&[1, 2, 3, 4, 5], &mut w);
                    w
                },
            },
            Frame {
                msg: Message::ReplicaAppend(ReplicaAppend { shard: 0, first: 41, lens: vec![3, 6] }),
                payload: {
                    let mut w = Vec::new();
                    bytes_to_words(&[9; 9], &mut w);
                    w
                },
            },
            Frame::new(Message::ReplicaAck(ReplicaAck { shard: 2, applied: u64::MAX })),
            Frame::new(Message::ReplicaReport(ReplicaReport { shard: 1, process: 2, epoch: 3, in_sync: vec![0, 4] })),
            Frame::new(Message::Promote(Promote { shard: 1, process: 0, epoch: 3, addr: "h:9".into() })),
            Frame::new(Message::ReplicaEpoch(ReplicaEpoch { shard: 1, epoch: 4 })),
            Frame::new(Message::ConfigPrepare(ConfigPrepare {
                ballot: crate::quorum::Ballot { round: 3, proposer: 1 },
                base: CoordinatorConfig { version: 2, serving: 0, addr: "h:1".into(), in_sync: vec![1, 2] },
            })),
            Frame::new(Message::ConfigPromise(ConfigPromise {
                version: 3,
                ballot: crate::quorum::Ballot { round: 3, proposer: 1 },
                accepted: Some((
                    crate::quorum::Ballot { round: 2, proposer: 0 },
                    CoordinatorConfig { version: 3, serving: 0, addr: "h:1".into(), in_sync: vec![2] },
                )),
            })),
            Frame::new(Message::ConfigAccept(ConfigAccept {
                ballot: crate::quorum::Ballot { round: 4, proposer: 1 },
                base: CoordinatorConfig { version: 2, serving: 0, addr: "h:1".into(), in_sync: vec![1] },
                value: CoordinatorConfig { version: 3, serving: 1, addr: "h:2".into(), in_sync: vec![] },
            })),
            Frame::new(Message::ConfigAccepted(ConfigAccepted {
                version: 3,
                ballot: crate::quorum::Ballot { round: 4, proposer: 1 },
            })),
            Frame::new(Message::ConfigRefused(ConfigRefused {
                promised: crate::quorum::Ballot { round: 9, proposer: 2 },
                chosen: CoordinatorConfig { version: 3, serving: 1, addr: "h:2".into(), in_sync: vec![] },
            })),
            Frame::new(Message::CoordinatorWhere(CoordinatorWhere { known: 3 })),
            Frame::new(Message::CoordinatorAt(CoordinatorAt {
                config: CoordinatorConfig { version: 4, serving: 1, addr: "h:2".into(), in_sync: vec![2] },
                copies: vec![0, 2],
                starting: false,
            })),
            Frame::new(Message::ConfigChosen(CoordinatorConfig {
                version: 4,
                serving: 1,
                addr: "h:2".into(),
                in_sync: vec![2],
            })),
            Frame::new(Message::DataStatus(DataStatus {
                shard: 1,
                counts: vec![GrantCount { grant: 78, split: 4, samples: 900 }],
                next_after: Some(78),
                counts_evicted: 2,
                dealer: Some(DealerStatus {
                    data_epoch: 1,
                    epochs: 2,
                    splits_per_epoch: 60,
                    splits_done: 61,
                    splits_pending: 1,
                    splits_returned: 3,
                    samples_replayed: 412,
                    finished: false,
                    leased: vec![GrantLease { grant: 80, split: 1 << 32 | 7, worker: 2 }],
                    completed: vec![(78, 4)],
                    abandoned: vec![79],
                }),
            })),
            Frame::new(Message::Stats(Stats {
                shard: 1,
                pushes_applied: 10,
                staleness_max: 7,
                switches: vec![ModeSwitchRecord {
                    number: 1,
                    from: 1,
                    to: 2,
                    from_step: 12,
                    at_global_step: 11,
                    reason: "worker 3 straggles".into(),
                }],
                ..Stats::default()
            })),
            Frame::new(Message::Authenticate(Authenticate { worker: 3, token: [9; 32] })),
            Frame::new(Message::Authenticated(Authenticated { worker: 3 })),
            Frame::new(Message::Leave(Leave { worker: 3 })),
            Frame {
                msg: Message::SparsePull(SparsePull { epoch: 9, table: 1, count: 2, create: true }),
                payload: {
                    let mut w = Vec::new();
                    ids_to_words(&[7, u64::MAX - 3], &mut w);
                    w
                },
            },
            Frame {
                msg: Message::SparsePullReply(SparsePullReply { table: 1, count: 1, dim: 2 }),
                payload: vec![f32::from_bits(5), 0.5, -0.5],
            },
            Frame {
                msg: Message::SparsePush(SparsePush {
                    epoch: 9,
                    worker: 3,
                    seq: 4,
                    table: 1,
                    count: 1,
                    dim: 2,
                    echo_read: true,
                }),
                payload: vec![f32::from_bits(7), 0.0, f32::from_bits(1), 0.1, 0.2, 0.5, -0.5],
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        let frames = samples();
        let kinds: std::collections::BTreeSet<u8> = frames.iter().map(|f| f.msg.kind()).collect();
        assert_eq!(kinds.len(), 47, "one sample per kind");
        for f in frames {
            let bytes = encode_frame(&f).expect("encode");
            let back = decode_frame(&bytes, &Limits::default()).expect("decode");
            // Compare payloads bit for bit: id and version words need not be valid floats.
            assert_eq!(back.msg, f.msg);
            let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&back.payload), bits(&f.payload));
        }
        let mut w = Vec::new();
        ids_to_words(&[0, 1, u64::MAX, 0x1234_5678_9abc_def0], &mut w);
        assert_eq!(words_to_ids(&w), vec![0, 1, u64::MAX, 0x1234_5678_9abc_def0]);
    }

    #[test]
    fn sixteen_bit_sections_halve_the_bytes_and_round_to_nearest() {
        let id = ChunkId { tensor: 0, chunk: 0 };
        let values = vec![1.0 + 1.0 / 128.0 + 1.0 / 512.0, 0.1, -7.3];
        for (dtype, width) in [(WireDtype::F32, 4), (WireDtype::Bf16, 2), (WireDtype::F16, 2)] {
            let msg = Message::PullReply(PullReply { chunks: vec![ChunkVersion { id, version: 1, len: 3, dtype }] });
            assert_eq!(msg.payload_bytes(), 3 * width);
            let bytes = encode_frame(&Frame { msg: msg.clone(), payload: values.clone() }).expect("encode");
            let back = decode_frame(&bytes, &Limits::default()).expect("decode");
            let mut want = values.clone();
            crate::dtype::round_trip(dtype, &mut want);
            assert_eq!(back.payload, want, "{dtype}");
        }
    }

    #[test]
    fn payloads_decode_the_same_from_pieces_of_any_size() {
        let frames = samples();
        let mut rng = crate::rng::Rng::new(11);
        for f in frames.iter().filter(|f| f.msg.payload_elems() > 0) {
            let bytes = encode_frame(f).expect("encode");
            let whole = decode_frame(&bytes, &Limits::default()).expect("decode").payload;
            let payload = &bytes[bytes.len() - f.msg.payload_bytes() as usize..];
            for _ in 0..200 {
                let mut dec = PayloadDecoder::new(&f.msg);
                let mut out = Vec::new();
                let mut rest = payload;
                while !rest.is_empty() {
                    let n = 1 + (rng.uniform() * 5.0) as usize;
                    let (piece, tail) = rest.split_at(n.min(rest.len()));
                    dec.feed(piece, &mut |dtype, run| crate::dtype::decode_extend(dtype, run, &mut out));
                    rest = tail;
                }
                assert!(dec.is_done());
                let bits = |p: &[f32]| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&whole));
            }
            // Bytes past the payload are ignored.
            let mut dec = PayloadDecoder::new(&f.msg);
            let mut count = 0;
            dec.feed(&[payload, &[1, 2, 3]].concat(), &mut |dtype, run| count += run.len() / dtype.bytes());
            assert_eq!(count as u64, f.msg.payload_elems());
        }
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        for f in samples() {
            let bytes = encode_frame(&f).expect("encode");
            for cut in 0..bytes.len() {
                let err = decode_frame(&bytes[..cut], &Limits::default()).expect_err("truncated frame must fail");
                assert!(matches!(err, WireError::Truncated { .. } | WireError::BadHeader(_)), "cut at {cut}: {err:?}");
            }
        }
    }

    #[test]
    fn over_limit_lengths_are_refused_before_allocation() {
        let mut prefix = [6u8, 0, 0, 0, 0];
        prefix[1..5].copy_from_slice(&(MAX_HEADER_BYTES + 1).to_le_bytes());
        assert!(matches!(parse_prefix(&prefix, &Limits::default()), Err(WireError::HeaderTooLarge { .. })));
        // A push header that declares 2^31 elements in one chunk group: refused by the payload limit.
        let id = ChunkId { tensor: 0, chunk: 0 };
        let push = Message::Push(Push {
            epoch: 1,
            worker: 0,
            seq: 1,
            chunks: vec![PushChunk { id, read_version: 0, len: u32::MAX, echo: false, dtype: WireDtype::F32 }; 2],
            compute_ms: 0,
            step: 0,
            decisions: Default::default(),
            data: None,
        });
        let mut bytes = vec![push.kind(), 0, 0, 0, 0];
        let len = push.encode_body(&mut bytes).expect("encode body");
        bytes[1..5].copy_from_slice(&(len as u32).to_le_bytes());
        let limits = Limits { max_header_bytes: MAX_HEADER_BYTES, max_payload_bytes: 1 << 20 };
        assert!(matches!(decode_frame(&bytes, &limits), Err(WireError::PayloadTooLarge { .. })));
        // A string length prefix far beyond the header limit is a decode error, not an allocation.
        let mut hostile = vec![1u8, 0, 0, 0, 0];
        let body = [1u8, 0, 0, 253, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f];
        hostile.extend_from_slice(&body);
        hostile[1..5].copy_from_slice(&(body.len() as u32).to_le_bytes());
        assert!(matches!(decode_frame(&hostile, &Limits::default()), Err(WireError::BadHeader(_))));
    }

    #[test]
    fn unknown_kind_wrong_count_and_trailing_bytes_are_typed_errors() {
        let mut bytes = encode_frame(&Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))).expect("encode");
        bytes[0] = 200;
        assert_eq!(decode_frame(&bytes, &Limits::default()), Err(WireError::UnknownKind(200)));
        bytes[0] = 0;
        assert_eq!(decode_frame(&bytes, &Limits::default()), Err(WireError::UnknownKind(0)));

        let id = ChunkId { tensor: 0, chunk: 0 };
        let push = Message::Push(Push {
            epoch: 1,
            worker: 0,
            seq: 1,
            chunks: vec![PushChunk { id, read_version: 0, len: 3, echo: false, dtype: WireDtype::F32 }],
            compute_ms: 0,
            step: 0,
            decisions: Default::default(),
            data: None,
        });
        assert!(matches!(
            encode_frame(&Frame { msg: push.clone(), payload: vec![1.0; 2] }),
            Err(WireError::ElementCountMismatch { expected: 3, got: 2 })
        ));
        let mut ok = encode_frame(&Frame { msg: push, payload: vec![1.0; 3] }).expect("encode");
        ok.extend_from_slice(&[0, 0, 0, 0]);
        assert_eq!(decode_frame(&ok, &Limits::default()), Err(WireError::TrailingBytes(4)));
        // A header with garbage after the message is refused.
        let mut hb = encode_frame(&Frame::new(Message::Heartbeat(Heartbeat { worker: 1 }))).expect("encode");
        hb.push(7);
        let len = u32::from_le_bytes([hb[1], hb[2], hb[3], hb[4]]) + 1;
        hb[1..5].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(decode_frame(&hb, &Limits::default()), Err(WireError::BadHeader(_))));
    }

    struct SliceReader<'a> {
        bytes: &'a [u8],
        pos: usize,
    }

    impl ReadExact for SliceReader<'_> {
        async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), WireError> {
            let end = self.pos + buf.len();
            let src = self
                .bytes
                .get(self.pos..end)
                .ok_or(WireError::Truncated { needed: end as u64, got: self.bytes.len() as u64 })?;
            buf.copy_from_slice(src);
            self.pos = end;
            Ok(())
        }
    }

    #[test]
    fn mode_decisions_keep_the_newest_two_and_name_the_mode_of_a_step() {
        let d = |number, mode, from_step| ModeDecision { number, mode, from_step };
        let mut known = ModeDecisions::start(1);
        assert_eq!(known.in_force(0), Some(d(0, 1, 0)));
        known.merge(&ModeDecisions { latest: d(2, 1, 20), previous: d(1, 2, 10) });
        assert_eq!((known.latest, known.previous), (d(2, 1, 20), d(1, 2, 10)));
        assert_eq!(known.in_force(9), None, "before both: not decided by these two");
        assert_eq!(known.in_force(10).map(|x| x.number), Some(1));
        assert_eq!(known.in_force(25).map(|x| x.number), Some(2));
        // Older news changes nothing; a newer decision pushes the latest back.
        known.merge(&ModeDecisions { latest: d(1, 2, 10), previous: d(0, 1, 0) });
        assert_eq!((known.latest.number, known.previous.number), (2, 1));
        known.push(d(3, 2, 30));
        assert_eq!((known.latest.number, known.previous.number), (3, 2));
        let mut one = ModeDecisions::start(1);
        one.merge(&ModeDecisions { latest: d(4, 2, 40), previous: d(4, 2, 40) });
        assert_eq!((one.latest.number, one.previous.number), (4, 0), "the same decision twice is one");
    }

    #[test]
    fn read_frame_reads_what_decode_frame_reads() {
        let f = samples().swap_remove(5);
        let bytes = encode_frame(&f).expect("encode");
        let mut reader = SliceReader { bytes: &bytes, pos: 0 };
        let got = block_on(read_frame(&mut reader, &Limits::default())).expect("read");
        assert_eq!(got, f);
        let mut short = SliceReader { bytes: &bytes[..bytes.len() - 1], pos: 0 };
        assert!(matches!(block_on(read_frame(&mut short, &Limits::default())), Err(WireError::Truncated { .. })));
    }

    /// Minimal executor for futures that never wait (the reader above completes synchronously).
    fn block_on<F: std::future::Future>(fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        loop {
            if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }
}
