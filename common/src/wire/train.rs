//! Messages of training: registration, the cluster map, dense pulls and pushes, sparse rows, mode
//! decisions, acknowledgements and heartbeats.

use super::*;

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

impl PushChunk {
    /// Chunk `id`'s gradient of `len` values computed on version `read_version`, sent as f32 without an echo.
    pub fn f32(id: ChunkId, read_version: u64, len: u32) -> Self {
        PushChunk { id, read_version, len, echo: false, dtype: WireDtype::F32 }
    }
}

impl Push {
    /// Push `seq` of `worker` in cluster `epoch`, of `chunks`: no compute time reported, step 0, no mode
    /// decisions known, no data tag (set the fields that matter with `Push { step, ..Push::new(…) }`).
    pub fn new(epoch: u64, worker: u32, seq: u64, chunks: Vec<PushChunk>) -> Self {
        Push { epoch, worker, seq, chunks, compute_ms: 0, step: 0, decisions: ModeDecisions::default(), data: None }
    }
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

/// A worker's whole step on one shard in one request (protocol 19): the gradients of its embedding rows held
/// here, applied as a [`SparsePush`] is; its dense push, answered as a [`Message::PushPull`] is (with the
/// pushed chunks' values unless the ack asks the worker to wait); then, where the worker goes on at once, the
/// rows of its next batch held here, read as a [`SparsePull`] right after the push. Payload: the rows' push
/// payload, the dense push's sections, then the next ids (two words each). The worker ids and epochs of the
/// parts must agree.
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct Step {
    /// The rows' gradients, where the step has rows on this shard (their own sequence number).
    pub rows: Option<SparsePush>,
    /// The dense push (every shard gets one every step).
    pub push: Push,
    /// The next batch's rows to read after the push, where it has rows on this shard.
    pub next_rows: Option<SparsePull>,
}

/// Answer to [`Step`]. Payload: the dense values (as a [`PushPullReply`]'s), then the next rows (as a
/// [`SparsePullReply`]'s: a version word per row, then the values).
#[derive(Debug, Clone, PartialEq, Eq, Encode, Decode)]
pub struct StepReply {
    /// The rows' acknowledgement, where the step carried rows.
    pub rows: Option<Ack>,
    /// The dense push's answer: its acknowledgement and, where the worker goes on at once, the values.
    pub push: PushPullReply,
    /// The next rows, where the step asked for them and the answer carries the dense values (a step held for
    /// a synchronous step or a GBA hold reads them when it is released); otherwise (the worker is to wait
    /// for the step itself, or the read failed) the worker pulls them itself.
    pub next_rows: Option<SparsePullReply>,
}

impl Push {
    /// Payload values: every chunk's gradient, and its echo where it carries one.
    pub fn payload_elems(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.len) * (1 + u64::from(c.echo))).sum()
    }

    /// The payload's sections: the gradients, then the echoes, each chunk in its format.
    pub fn payload_sections(&self) -> impl Iterator<Item = (u64, WireDtype)> + '_ {
        let grads = self.chunks.iter().map(|c| (u64::from(c.len), c.dtype));
        grads.chain(self.chunks.iter().filter(|c| c.echo).map(|c| (u64::from(c.len), c.dtype)))
    }
}

impl SparsePush {
    /// Payload values: ids (two words each), versions, gradients and the echoed rows.
    pub fn payload_elems(&self) -> u64 {
        u64::from(self.count).saturating_mul(3 + u64::from(self.dim) * (1 + u64::from(self.echo_read)))
    }
}

impl SparsePull {
    /// Payload values: the ids, two words each.
    pub fn payload_elems(&self) -> u64 {
        2 * u64::from(self.count)
    }
}

impl SparsePullReply {
    /// Payload values: a version word per row, then the rows.
    pub fn payload_elems(&self) -> u64 {
        u64::from(self.count) * (1 + u64::from(self.dim))
    }
}

impl Step {
    /// The payload's values: (the rows' push, the dense push, the next ids).
    pub fn payload_split(&self) -> (u64, u64, u64) {
        let rows = self.rows.as_ref().map_or(0, SparsePush::payload_elems);
        (rows, self.push.payload_elems(), self.next_rows.as_ref().map_or(0, SparsePull::payload_elems))
    }
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
