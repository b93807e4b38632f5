//! The shard core: a sans-IO state machine that owns one shard's chunks, optimizer state, versions,
//! exactly-once bookkeeping and (on shard 0) the coordinator's membership.
//!
//! It is driven only by [`ShardCore::handle`] (one request frame in, one reply frame out) and
//! [`ShardCore::tick`]; time is an argument (`now`, any monotonic origin), never read from a clock.
//! The QUIC service, the simulator and the tests all drive this same type.

use crate::modes::{LrRamp, Mode, ModeConfig, StragglerDetector};
use crate::sparse::{Eviction, SparseTable, TableConfig};
use gaps_common::layout::sparse_owner;
use gaps_common::layout::{ChunkId, Layout};
use gaps_common::rng::{mix, Rng};
use gaps_common::wire::{
    words_to_ids, Ack, ChunkVersion, ClusterMap, ErrorCode, Frame, Heartbeat, HeartbeatAck, Leave, Message, Pull,
    PullReply, Push, Register, RegisterShard, Role, RuleInfo, ShardAddr, SparsePull, SparsePullReply, SparsePush,
    Stats, PROTOCOL_VERSION,
};
use gaps_kernels::{Bufs, Hyper, PushScalars, Rule};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// How far ahead of the last contiguous applied sequence number a push may be.
pub const SEQ_WINDOW: u64 = 4096;

/// How the shard initialises its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Init {
    /// Seed of the initializer (each chunk draws from its own stream, so the value of a parameter does
    /// not depend on the number of shards).
    pub seed: u64,
    /// Standard deviation of the normal initializer; 0 gives zeros.
    pub std: f32,
}

/// How the shard keeps its sparse embedding tables.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseSettings {
    /// Update rule of embedding rows (no per-worker state, no look-ahead).
    pub rule: Rule,
    /// Its hyper-parameters (learning rate and so on).
    pub hyper: Hyper,
    /// Standard deviation of the rows' normal initializer.
    pub init_std: f32,
    /// Create a row only after its id was seen this many times.
    pub admit_after: u32,
    /// Memory budget of all tables of this shard together, bytes (split evenly over the tables).
    pub memory_budget: Option<u64>,
    /// Eviction policy.
    pub eviction: Eviction,
}

impl Default for SparseSettings {
    fn default() -> Self {
        SparseSettings {
            rule: Rule::Adagrad,
            hyper: Hyper { lr: 0.05, momentum: 0.0, ..Hyper::default() },
            init_std: 0.01,
            admit_after: 0,
            memory_budget: None,
            eviction: Eviction::Lru,
        }
    }
}

/// Static configuration of one shard.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// This shard's index.
    pub shard: u32,
    /// Number of shards in the cluster.
    pub num_shards: u32,
    /// The model's dense tensors.
    pub layout: Layout,
    /// The update rule.
    pub rule: Rule,
    /// Its hyper-parameters.
    pub hyper: Hyper,
    /// Parameter initializer.
    pub init: Init,
    /// Worker lease (coordinator only): a worker silent this long is dropped from the live set.
    pub lease: Duration,
    /// This shard's address as clients should use it (reported in the cluster map).
    pub advertise: String,
    /// Cluster epoch (coordinator only; other shards learn it when they join).
    pub epoch: u64,
    /// Threads a large push may use (0: one per available core).
    pub threads: usize,
    /// Sparse tables (the layout lists them).
    pub sparse: SparseSettings,
    /// Training mode and its policies.
    pub modes: ModeConfig,
}

/// Why the core refused a request. Each maps to an [`ErrorCode`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// See [`ErrorCode::WrongShape`].
    #[error("{0}")]
    WrongShape(String),
    /// See [`ErrorCode::NonFinite`].
    #[error("gradient for chunk {tensor}/{chunk} holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
        /// Element inside the chunk.
        index: usize,
        /// The offending value, printed.
        value: String,
    },
    /// See [`ErrorCode::NotOwner`].
    #[error("chunk {tensor}/{chunk} belongs to shard {owner}, not to shard {me}")]
    NotOwner {
        /// Tensor index.
        tensor: u32,
        /// Chunk index.
        chunk: u32,
        /// Its owner.
        owner: u32,
        /// This shard.
        me: u32,
    },
    /// See [`ErrorCode::StaleEpoch`].
    #[error("request carries cluster epoch {got}, the cluster is at epoch {current}: fetch a new cluster map")]
    StaleEpoch {
        /// Epoch in the request.
        got: u64,
        /// This shard's epoch.
        current: u64,
    },
    /// See [`ErrorCode::ClusterIncomplete`].
    #[error("{0}")]
    ClusterIncomplete(String),
    /// See [`ErrorCode::Misconfigured`].
    #[error("{0}")]
    Misconfigured(String),
    /// See [`ErrorCode::NotRegistered`].
    #[error("{0}")]
    NotRegistered(String),
    /// See [`ErrorCode::SequenceWindow`].
    #[error("{0}")]
    SequenceWindow(String),
    /// See [`ErrorCode::UnknownKind`].
    #[error("a {0} message is not a request")]
    NotARequest(&'static str),
    /// A sparse row belongs to another shard; see [`ErrorCode::NotOwner`].
    #[error("row {id} of table {table} belongs to shard {owner}, not to shard {me}")]
    RowNotOwned {
        /// Table.
        table: u32,
        /// Row id.
        id: u64,
        /// Its owner.
        owner: u32,
        /// This shard.
        me: u32,
    },
    /// The update could not be applied on the device; see [`ErrorCode::Internal`].
    #[error("applying the update: {0}")]
    Device(String),
}

impl ShardError {
    /// The wire code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            ShardError::WrongShape(_) => ErrorCode::WrongShape,
            ShardError::NonFinite { .. } => ErrorCode::NonFinite,
            ShardError::NotOwner { .. } => ErrorCode::NotOwner,
            ShardError::StaleEpoch { .. } => ErrorCode::StaleEpoch,
            ShardError::ClusterIncomplete(_) => ErrorCode::ClusterIncomplete,
            ShardError::Misconfigured(_) => ErrorCode::Misconfigured,
            ShardError::NotRegistered(_) => ErrorCode::NotRegistered,
            ShardError::SequenceWindow(_) => ErrorCode::SequenceWindow,
            ShardError::NotARequest(_) => ErrorCode::UnknownKind,
            ShardError::Device(_) => ErrorCode::Internal,
            ShardError::RowNotOwned { .. } => ErrorCode::NotOwner,
        }
    }
}

/// Something the core wants the embedding service to log or export.
#[derive(Debug, Clone, PartialEq)]
pub enum CoreEvent {
    /// A worker registered.
    WorkerJoined(u32),
    /// A worker left on its own.
    WorkerLeft(u32),
    /// A worker's lease expired.
    WorkerExpired(u32),
    /// A shard joined the cluster.
    ShardJoined(u32),
    /// The training mode changed.
    ModeSwitch {
        /// Mode before.
        from: Mode,
        /// Mode after.
        to: Mode,
        /// Why.
        reason: String,
    },
    /// The learning-rate multiplier starts moving toward a new value because the live worker count changed.
    LrRamp {
        /// Live workers now.
        workers: u32,
        /// The multiplier it moves to.
        target: f64,
    },
}

/// One owned chunk: its parameters, optimizer state (planes of `len` floats) and update count.
#[derive(Debug)]
struct ChunkSlot {
    /// The tensor the chunk belongs to.
    tensor: u32,
    params: Vec<f32>,
    /// The rule's shared planes.
    shared: Vec<f32>,
    /// The rule's per-worker planes, created on a worker's first push (only for rules that have them).
    workers: HashMap<u32, Vec<f32>>,
    /// Number of updates applied to this chunk: the per-parameter last-update version (every element of a
    /// dense chunk is updated by the same pushes, so one counter per chunk is exact for all of them).
    version: u64,
}

/// Exactly-once bookkeeping for one worker: every seq ≤ `contiguous` was applied, plus those in `above`.
#[derive(Debug, Default)]
struct SeqWindow {
    contiguous: u64,
    above: BTreeSet<u64>,
}

impl SeqWindow {
    fn applied(&self, seq: u64) -> bool {
        seq <= self.contiguous || self.above.contains(&seq)
    }

    fn insert(&mut self, seq: u64) {
        self.above.insert(seq);
        while self.above.remove(&(self.contiguous + 1)) {
            self.contiguous += 1;
        }
    }
}

/// Coordinator state (shard 0 only): shard addresses and worker leases.
#[derive(Debug, Default)]
struct Coordinator {
    shard_addrs: BTreeMap<u32, String>,
    next_worker: u32,
    /// Every worker id ever handed out.
    registered: u32,
}

/// The state machine of one shard.
#[derive(Debug)]
pub struct ShardCore {
    cfg: ShardConfig,
    epoch: u64,
    /// First global chunk index of each tensor.
    chunk_base: Vec<u64>,
    /// Owned chunks; the chunk with global index g is at `slots[g / num_shards]`.
    slots: Vec<ChunkSlot>,
    /// Elements over all owned chunks.
    owned_elems: usize,
    /// Pushes applied per tensor on this shard (the tensor's global version).
    tensor_versions: Vec<u64>,
    seqs: HashMap<u32, SeqWindow>,
    coordinator: Option<Coordinator>,
    stats: Stats,
    /// Multiplier of the configured learning rate (schedules, elastic ramps).
    lr_scale: f32,
    /// Sparse tables, layout order.
    tables: Vec<SparseTable>,
    /// Live workers (by heartbeat, registration or push) and the time their lease ends.
    leases: BTreeMap<u32, Duration>,
    /// The mode in force (never `Auto`: auto runs `Sync` or `Gba`).
    active: Mode,
    /// Synchronous modes: summed gradients per slot (allocated on first use) and how many were summed.
    accum: Vec<Vec<f32>>,
    accum_counts: Vec<u32>,
    /// Gradients in the current step, and which workers sent them.
    accum_pushes: u32,
    contributors: BTreeSet<u32>,
    /// Aggregated updates applied (sync and gba steps).
    global_step: u64,
    detector: StragglerDetector,
    ramp: LrRamp,
    /// Pushes per worker (bounded staleness).
    clocks: BTreeMap<u32, u64>,
    /// The learning-rate multiplier of the last applied update.
    last_multiplier: f64,
    /// The GPU that applies updates, when `--device` chose one.
    device: Option<std::sync::Arc<gaps_kernels::cuda::CudaDevice>>,
    /// Largest learning rate used so far (Gap-Aware's η_max).
    lr_max: f32,
    threads: usize,
}

impl ShardCore {
    /// Builds a shard and initialises its chunks. Shard 0 is the coordinator.
    pub fn new(cfg: ShardConfig) -> Result<Self, ShardError> {
        cfg.layout.validate().map_err(|e| ShardError::Misconfigured(e.to_string()))?;
        cfg.hyper.validate().map_err(|e| ShardError::Misconfigured(e.to_string()))?;
        if cfg.num_shards == 0 || cfg.shard >= cfg.num_shards {
            return Err(ShardError::Misconfigured(format!(
                "shard index {} is outside 0..{} shards",
                cfg.shard, cfg.num_shards
            )));
        }
        let mut chunk_base = Vec::with_capacity(cfg.layout.tensors.len());
        let mut base = 0u64;
        for t in 0..cfg.layout.tensors.len() as u32 {
            chunk_base.push(base);
            base += u64::from(cfg.layout.num_chunks(t));
        }
        let shared_planes = cfg.rule.layout().shared_planes;
        let mut slots = Vec::new();
        for id in cfg.layout.chunks_of_shard(cfg.shard, cfg.num_shards) {
            let range = cfg.layout.chunk_range(id).map_err(|e| ShardError::Misconfigured(e.to_string()))?;
            let global = chunk_base[id.tensor as usize] + u64::from(id.chunk);
            let params = if cfg.init.std == 0.0 {
                vec![0.0; range.len()]
            } else {
                let mut rng = Rng::new(mix(cfg.init.seed, global));
                (0..range.len()).map(|_| (rng.normal() * f64::from(cfg.init.std)) as f32).collect()
            };
            slots.push(ChunkSlot {
                tensor: id.tensor,
                shared: vec![0.0; params.len() * shared_planes],
                params,
                workers: HashMap::new(),
                version: 0,
            });
        }
        let is_coordinator = cfg.shard == 0;
        let mut coordinator = is_coordinator.then(Coordinator::default);
        if let Some(c) = coordinator.as_mut() {
            c.shard_addrs.insert(0, cfg.advertise.clone());
        }
        let epoch = if is_coordinator { cfg.epoch } else { 0 };
        let stats = Stats { shard: cfg.shard, epoch, ..Stats::default() };
        let tensor_versions = vec![0; cfg.layout.tensors.len()];
        let threads = match cfg.threads {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        };
        let lr_max = cfg.hyper.lr;
        cfg.sparse.hyper.validate().map_err(|e| ShardError::Misconfigured(format!("sparse rule: {e}")))?;
        let per_table_budget = cfg.sparse.memory_budget.map(|b| b / cfg.layout.tables.len().max(1) as u64);
        let tables = cfg
            .layout
            .tables
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                SparseTable::new(TableConfig {
                    table: i as u32,
                    dim: spec.dim,
                    rule: cfg.sparse.rule,
                    init_std: cfg.sparse.init_std,
                    seed: cfg.init.seed,
                    admit_after: cfg.sparse.admit_after,
                    memory_budget: per_table_budget,
                    eviction: cfg.sparse.eviction,
                })
                .map_err(|e| ShardError::Misconfigured(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let active = match cfg.modes.mode {
            Mode::Auto => Mode::Sync,
            m => m,
        };
        let n_slots = slots.len();
        let owned_elems = slots.iter().map(|s| s.params.len()).sum();
        Ok(ShardCore {
            owned_elems,
            tables,
            leases: BTreeMap::new(),
            active,
            accum: vec![Vec::new(); n_slots],
            accum_counts: vec![0; n_slots],
            accum_pushes: 0,
            contributors: BTreeSet::new(),
            global_step: 0,
            detector: StragglerDetector::default(),
            ramp: LrRamp::default(),
            clocks: BTreeMap::new(),
            last_multiplier: 1.0,
            cfg,
            epoch,
            chunk_base,
            slots,
            tensor_versions,
            seqs: HashMap::new(),
            coordinator,
            stats,
            lr_scale: 1.0,
            lr_max,
            threads,
            device: None,
        })
    }

    /// Applies updates on this GPU from now on (None: the CPU). Each push's chunks are copied to the GPU,
    /// updated there and copied back; the shard's state stays in host memory.
    pub fn set_device(&mut self, device: Option<std::sync::Arc<gaps_kernels::cuda::CudaDevice>>) {
        self.device = device;
    }

    /// Elements over all dense chunks this shard owns.
    pub fn owned_elems(&self) -> usize {
        self.owned_elems
    }

    /// The learning rate in force: the configured η times the schedule's multiplier and, in the
    /// synchronous modes, the elastic multiplier (live workers relative to the start, ramped).
    pub fn lr(&self) -> f32 {
        self.cfg.hyper.lr * self.lr_scale * self.lr_multiplier() as f32
    }

    /// The elastic learning-rate multiplier in force (1 outside the synchronous modes).
    pub fn lr_multiplier(&self) -> f64 {
        match self.active {
            Mode::Sync | Mode::Gba => self.ramp.multiplier(self.global_step),
            _ => 1.0,
        }
    }

    /// The mode in force.
    pub fn active_mode(&self) -> Mode {
        self.active
    }

    /// Sets the learning-rate multiplier (warm-up, schedules, elastic ramps). Non-finite or non-positive
    /// values are refused.
    pub fn set_lr_scale(&mut self, scale: f32) -> Result<(), ShardError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(ShardError::Misconfigured(format!("learning-rate multiplier must be positive, got {scale}")));
        }
        self.lr_scale = scale;
        Ok(())
    }

    /// Floats of optimizer state held per worker over all owned chunks (0 for rules without per-worker
    /// state), for reporting memory.
    pub fn worker_state_floats(&self) -> usize {
        self.slots.iter().map(|s| s.workers.values().map(Vec::len).sum::<usize>()).sum()
    }

    /// This shard's configuration.
    pub fn config(&self) -> &ShardConfig {
        &self.cfg
    }

    /// The cluster epoch this shard serves (0 until a non-coordinator shard joined).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Counters since start.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.epoch = self.epoch;
        s.live_workers = self.leases.len() as u32;
        if let Some(c) = &self.coordinator {
            s.registered_workers = c.registered;
        }
        s.mode = self.active.code();
        s.lr_multiplier_milli = (self.last_multiplier * 1000.0).round().clamp(0.0, f64::from(u32::MAX)) as u32;
        s.ssp_min_clock = self.min_clock();
        for t in &self.tables {
            let ts = t.stats();
            s.table_rows += ts.rows;
            s.table_bytes += ts.bytes;
            s.table_evicted += ts.evicted;
            s.sparse_dropped += ts.dropped_updates;
        }
        s
    }

    /// A held sparse row (tests and evaluation inside the process).
    pub fn sparse_row(&self, table: u32, id: u64) -> Option<&[f32]> {
        self.tables.get(table as usize).and_then(|t| t.row(id))
    }

    /// Pushes applied per tensor on this shard.
    pub fn tensor_versions(&self) -> &[u64] {
        &self.tensor_versions
    }

    /// The registration a non-coordinator shard sends to the coordinator.
    pub fn join_request(&self) -> Message {
        Message::RegisterShard(RegisterShard {
            protocol: PROTOCOL_VERSION,
            shard: self.cfg.shard,
            num_shards: self.cfg.num_shards,
            addr: self.cfg.advertise.clone(),
            layout_fingerprint: self.cfg.layout.fingerprint(),
        })
    }

    /// Adopts the coordinator's answer to [`ShardCore::join_request`].
    pub fn joined(&mut self, map: &ClusterMap) -> Result<(), ShardError> {
        if map.num_shards != self.cfg.num_shards || map.layout != self.cfg.layout || map.rule != self.rule_info() {
            return Err(ShardError::Misconfigured(
                "the coordinator's cluster map disagrees with this shard's configuration".into(),
            ));
        }
        self.epoch = map.epoch;
        Ok(())
    }

    /// Handles one request and returns the reply frame (an error reply when the request is refused; a
    /// refused request changes nothing).
    pub fn handle(&mut self, req: Frame, now: Duration) -> (Frame, Vec<CoreEvent>) {
        let mut events = Vec::new();
        let payload_in = req.payload.len() as u64 * 4;
        self.stats.payload_bytes_in += payload_in;
        let is_push = matches!(req.msg, Message::Push(_) | Message::SparsePush(_));
        let now_s = now.as_secs().min(u64::from(u32::MAX)) as u32;
        let result = match req.msg {
            Message::Pull(p) => self.pull(&p),
            Message::Push(p) => self.push(&p, &req.payload, now, &mut events),
            Message::SparsePull(p) => self.sparse_pull(&p, &req.payload, now_s),
            Message::SparsePush(p) => self.sparse_push(&p, &req.payload, now_s),
            Message::SparsePullReply(_) => Err(ShardError::NotARequest("sparse pull reply")),
            Message::Register(r) => self.register(&r, now, &mut events),
            Message::RegisterShard(r) => self.register_shard(&r, &mut events),
            Message::Heartbeat(h) => self.heartbeat(h, now, &mut events),
            Message::Leave(l) => self.leave(l, &mut events),
            Message::StatsRequest(_) => Ok(Frame::new(Message::Stats(self.stats()))),
            Message::ClusterMap(_) => Err(ShardError::NotARequest("cluster map")),
            Message::PullReply(_) => Err(ShardError::NotARequest("pull reply")),
            Message::Ack(_) => Err(ShardError::NotARequest("ack")),
            Message::Error(_) => Err(ShardError::NotARequest("error")),
            Message::HeartbeatAck(_) => Err(ShardError::NotARequest("heartbeat ack")),
            Message::Stats(_) => Err(ShardError::NotARequest("stats")),
        };
        let reply = match result {
            Ok(frame) => frame,
            Err(e) => {
                if is_push {
                    self.stats.pushes_rejected += 1;
                }
                Frame::new(Message::error(e.code(), e.to_string()))
            }
        };
        self.stats.payload_bytes_out += reply.payload.len() as u64 * 4;
        (reply, events)
    }

    /// Expires worker leases and idle sparse rows (TTL eviction). Returns what changed.
    pub fn tick(&mut self, now: Duration) -> Vec<CoreEvent> {
        let now_s = now.as_secs().min(u64::from(u32::MAX)) as u32;
        for t in &mut self.tables {
            t.tick(now_s);
        }
        let expired: Vec<u32> = self.leases.iter().filter(|(_, until)| **until <= now).map(|(w, _)| *w).collect();
        let mut events: Vec<CoreEvent> = Vec::new();
        for w in &expired {
            self.leases.remove(w);
            self.detector.forget(*w);
            self.clocks.remove(w);
            events.push(CoreEvent::WorkerExpired(*w));
        }
        if !expired.is_empty() {
            self.membership_changed(&mut events);
        }
        events
    }

    /// After the live set changed: move the learning-rate multiplier, re-judge stragglers, and finish a
    /// synchronous step that no longer waits for anyone (a dead worker never holds a step longer than its
    /// lease).
    fn membership_changed(&mut self, events: &mut Vec<CoreEvent>) {
        let live = self.leases.len() as u32;
        let ramped = self.ramp.set_workers(live, self.global_step, self.cfg.modes.lr_ramp_steps);
        if ramped && matches!(self.active, Mode::Sync | Mode::Gba) {
            events.push(CoreEvent::LrRamp { workers: live, target: self.ramp.target() });
        }
        self.judge(events);
        if self.step_ready() {
            // Failures here are bugs of this shard; the next push reports them.
            let _ = self.complete_step();
        }
    }

    /// Lets the detector judge the live workers and, in `auto`, switches between sync and gba.
    fn judge(&mut self, events: &mut Vec<CoreEvent>) {
        let live: BTreeSet<u32> = self.leases.keys().copied().collect();
        let reasons = self.detector.judge(&live, &self.cfg.modes);
        if self.cfg.modes.mode != Mode::Auto {
            return;
        }
        let wanted = if self.detector.stragglers().is_empty() { Mode::Sync } else { Mode::Gba };
        if wanted != self.active {
            let reason = if reasons.is_empty() { "membership changed".to_string() } else { reasons.join("; ") };
            if self.active == Mode::Gba && self.accum_pushes > 0 {
                // The partial GBA step is applied as it is; sync starts on a fresh step.
                let _ = self.complete_step();
            }
            events.push(CoreEvent::ModeSwitch { from: self.active, to: wanted, reason });
            self.active = wanted;
            self.stats.mode_switches += 1;
        }
    }

    fn min_clock(&self) -> u64 {
        self.leases.keys().map(|w| self.clocks.get(w).copied().unwrap_or(0)).min().unwrap_or(0)
    }

    /// A synchronous step is complete when every live worker contributed (sync) or K = live workers
    /// gradients arrived (gba).
    fn step_ready(&self) -> bool {
        if self.accum_pushes == 0 {
            return false;
        }
        match self.active {
            Mode::Sync => self.leases.keys().all(|w| self.contributors.contains(w)),
            Mode::Gba => self.accum_pushes as usize >= self.leases.len().max(1),
            _ => false,
        }
    }

    /// Applies the averaged accumulated gradients as one update of every chunk that received some.
    fn complete_step(&mut self) -> Result<(), ShardError> {
        let mut plan = Vec::new();
        let mut flat = Vec::new();
        for slot in 0..self.slots.len() {
            let count = self.accum_counts[slot];
            if count == 0 {
                continue;
            }
            let inv = 1.0 / count as f32;
            plan.push(Planned { slot, tensor: self.slots[slot].tensor, offset: flat.len(), staleness: 0 });
            flat.extend(self.accum[slot].iter().map(|g| g * inv));
            self.accum[slot].iter_mut().for_each(|g| *g = 0.0);
            self.accum_counts[slot] = 0;
        }
        // Rules that measure drift see none: every gradient of the step was computed on these values.
        let reads: Vec<f32> = if self.cfg.rule.layout().needs_read {
            plan.iter().flat_map(|p| self.slots[p.slot].params.iter().copied()).collect()
        } else {
            Vec::new()
        };
        let mode = self.active;
        self.apply_now(&plan, u32::MAX, &flat, &reads)?;
        self.global_step += 1;
        match mode {
            Mode::Gba => self.stats.steps_gba += 1,
            _ => self.stats.steps_sync += 1,
        }
        self.contributors.clear();
        self.accum_pushes = 0;
        Ok(())
    }

    /// A push renews its worker's lease and reports its compute time.
    fn observe_push(&mut self, worker: u32, compute_ms: u32, now: Duration, events: &mut Vec<CoreEvent>) {
        let joined = self.leases.insert(worker, now + self.cfg.lease).is_none();
        if compute_ms > 0 {
            self.detector.observe(worker, f64::from(compute_ms));
        }
        if joined {
            self.membership_changed(events);
        } else {
            self.judge(events);
        }
    }

    /// Replaces the values of an owned chunk (restoring a checkpoint, or a model-specific initializer such
    /// as the simulator's He initialisation). The chunk's version and optimizer state are kept.
    pub fn overwrite(&mut self, id: ChunkId, values: &[f32]) -> Result<(), ShardError> {
        let slot = self.slot_index(id)?;
        let params = &mut self.slots[slot].params;
        if values.len() != params.len() {
            return Err(ShardError::WrongShape(format!("chunk has {} elements, got {}", params.len(), values.len())));
        }
        if values.iter().any(|v| !v.is_finite()) {
            return Err(ShardError::WrongShape("initial values must be finite".into()));
        }
        params.copy_from_slice(values);
        Ok(())
    }

    /// Values of an owned chunk (for tests, checkpoints and evaluation inside the process).
    pub fn chunk_values(&self, id: ChunkId) -> Result<&[f32], ShardError> {
        let slot = self.slot_index(id)?;
        Ok(&self.slots[slot].params)
    }

    fn check_epoch(&self, got: u64) -> Result<(), ShardError> {
        if self.epoch == 0 {
            return Err(ShardError::ClusterIncomplete(format!(
                "shard {} has not joined the cluster yet",
                self.cfg.shard
            )));
        }
        if got != self.epoch {
            return Err(ShardError::StaleEpoch { got, current: self.epoch });
        }
        Ok(())
    }

    fn slot_index(&self, id: ChunkId) -> Result<usize, ShardError> {
        let base = self.chunk_base.get(id.tensor as usize).copied();
        let (Some(base), true) = (base, id.chunk < self.cfg.layout.num_chunks(id.tensor)) else {
            return Err(ShardError::WrongShape(format!("unknown chunk {}/{}", id.tensor, id.chunk)));
        };
        let global = base + u64::from(id.chunk);
        let n = u64::from(self.cfg.num_shards);
        let owner = (global % n) as u32;
        if owner != self.cfg.shard {
            return Err(ShardError::NotOwner { tensor: id.tensor, chunk: id.chunk, owner, me: self.cfg.shard });
        }
        Ok((global / n) as usize)
    }

    fn pull(&mut self, req: &Pull) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        let mut metas = Vec::with_capacity(req.chunks.len());
        let mut picked = Vec::with_capacity(req.chunks.len());
        let mut total = 0usize;
        for id in &req.chunks {
            let index = self.slot_index(*id)?;
            let slot = &self.slots[index];
            total += slot.params.len();
            metas.push(ChunkVersion { id: *id, version: slot.version, len: slot.params.len() as u32 });
            picked.push(index);
        }
        // A pull may name a chunk several times; keep the reply within four copies of what the shard owns.
        let owned_elems = self.owned_elems;
        if total > owned_elems.max(1) * 4 {
            return Err(ShardError::WrongShape(format!(
                "pull asks for {total} elements, more than four copies of this shard's {owned_elems}"
            )));
        }
        let mut payload = Vec::with_capacity(total);
        let lr = self.lr();
        for index in picked {
            let slot = &self.slots[index];
            gaps_kernels::pull_values(self.cfg.rule, &self.cfg.hyper, lr, &slot.params, &slot.shared, &mut payload);
        }
        self.stats.pulls += 1;
        Ok(Frame { msg: Message::PullReply(PullReply { chunks: metas }), payload })
    }

    fn push(
        &mut self,
        req: &Push,
        payload: &[f32],
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        if let Some(duplicate) = self.check_push(req.epoch, req.worker, req.seq)? {
            return Ok(duplicate);
        }
        // Validate everything before touching any state, so a refused push changes nothing.
        let rule = self.cfg.rule;
        if req.echo_read != rule.layout().needs_read {
            return Err(ShardError::WrongShape(if req.echo_read {
                format!("rule {rule} takes no echo of the read parameters")
            } else {
                format!("rule {rule} needs the parameters the gradient was computed on (echo_read)")
            }));
        }
        let grad_total: u64 = req.chunks.iter().map(|c| u64::from(c.len)).sum();
        let declared = grad_total * (1 + u64::from(req.echo_read));
        if declared != payload.len() as u64 {
            return Err(ShardError::WrongShape(format!(
                "push declares {declared} elements but carries {}",
                payload.len()
            )));
        }
        let read_base = if req.echo_read { grad_total as usize } else { 0 };
        let mut plan = Vec::with_capacity(req.chunks.len());
        let mut seen = BTreeSet::new();
        let mut offset = 0usize;
        for c in &req.chunks {
            let slot = self.slot_index(c.id)?;
            if !seen.insert(slot) {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} appears twice in one push",
                    c.id.tensor, c.id.chunk
                )));
            }
            let expected = self.slots[slot].params.len();
            if c.len as usize != expected {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} has {expected} elements, the push carries {}",
                    c.id.tensor, c.id.chunk, c.len
                )));
            }
            let mut sections = vec![&payload[offset..offset + expected]];
            if req.echo_read {
                sections.push(&payload[read_base + offset..read_base + offset + expected]);
            }
            for values in sections {
                if let Some((index, value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                    return Err(ShardError::NonFinite {
                        tensor: c.id.tensor,
                        chunk: c.id.chunk,
                        index,
                        value: value.to_string(),
                    });
                }
            }
            let version = self.slots[slot].version;
            if c.read_version > version {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} was read at version {} but is only at version {version}",
                    c.id.tensor, c.id.chunk, c.read_version
                )));
            }
            plan.push(Planned { slot, tensor: c.id.tensor, offset, staleness: version - c.read_version });
            offset += expected;
        }
        let grads = &payload[..grad_total as usize];
        let reads = if req.echo_read { &payload[read_base..] } else { &[][..] };
        self.observe_push(req.worker, req.compute_ms, now, events);
        self.ramp.fix_reference();
        let tau = plan.iter().map(|p| p.staleness).max().unwrap_or(0);
        let mut ack = Ack { seq: req.seq, max_staleness: tau, ..Ack::default() };
        match self.active {
            Mode::Sync | Mode::Gba => {
                let too_stale = match self.active {
                    Mode::Sync => tau > 0,
                    _ => tau > self.cfg.modes.gba_threshold,
                };
                if too_stale {
                    self.stats.dropped_stale += 1;
                    tracing::debug!(worker = req.worker, tau, step = self.global_step, contributors = ?self.contributors, "dropped a stale gradient");
                } else {
                    self.stats.staleness_sum += tau;
                    self.stats.staleness_count += 1;
                    self.stats.staleness_max = self.stats.staleness_max.max(tau);
                    for p in &plan {
                        let n = self.slots[p.slot].params.len();
                        let acc = &mut self.accum[p.slot];
                        if acc.is_empty() {
                            acc.resize(n, 0.0);
                        }
                        acc.iter_mut().zip(&grads[p.offset..p.offset + n]).for_each(|(a, g)| *a += g);
                        self.accum_counts[p.slot] += 1;
                    }
                    self.accum_pushes += 1;
                    self.contributors.insert(req.worker);
                    if self.step_ready() {
                        self.complete_step()?;
                    } else if self.active == Mode::Sync {
                        ack.wait_for_version = plan.first().map_or(0, |p| self.slots[p.slot].version + 1);
                    }
                }
            }
            _ => {
                self.apply_now(&plan, req.worker, grads, reads)?;
                if self.active == Mode::Ssp {
                    let clock = self.clocks.entry(req.worker).or_insert(0);
                    *clock += 1;
                    let mine = *clock;
                    if mine > self.min_clock() + self.cfg.modes.ssp_bound {
                        ack.wait_for_clock = mine - self.cfg.modes.ssp_bound;
                    }
                }
            }
        }
        self.stats.pushes_applied += 1;
        if let Some(window) = self.seqs.get_mut(&req.worker) {
            window.insert(req.seq);
        }
        Ok(Frame::new(Message::Ack(ack)))
    }

    /// The exactly-once gate shared by dense and sparse pushes: checks the epoch and the sequence window;
    /// returns the acknowledgement of a push applied before (not applied again), or None for a new one.
    fn check_push(&mut self, epoch: u64, worker: u32, seq: u64) -> Result<Option<Frame>, ShardError> {
        self.check_epoch(epoch)?;
        if seq == 0 {
            return Err(ShardError::SequenceWindow("sequence numbers start at 1".into()));
        }
        let window = self.seqs.entry(worker).or_default();
        if window.applied(seq) {
            self.stats.pushes_duplicate += 1;
            return Ok(Some(Frame::new(Message::Ack(Ack { seq, duplicate: true, ..Ack::default() }))));
        }
        if seq > window.contiguous + SEQ_WINDOW {
            return Err(ShardError::SequenceWindow(format!(
                "sequence number {seq} is more than {SEQ_WINDOW} ahead of {} (worker {worker})",
                window.contiguous
            )));
        }
        Ok(None)
    }

    /// Applies gradients to the planned chunks now, one update each (`grads` and `reads` indexed by the
    /// plan's offsets), and records versions and staleness.
    fn apply_now(&mut self, plan: &[Planned], worker: u32, grads: &[f32], reads: &[f32]) -> Result<(), ShardError> {
        let rule = self.cfg.rule;
        let lr = self.lr();
        self.last_multiplier = self.lr_multiplier();
        self.lr_max = self.lr_max.max(lr);
        let (lr_max, hyper, threads) = (self.lr_max, self.cfg.hyper, self.threads);
        let work = collect_work(&mut self.slots, plan, worker, rule);
        match &self.device {
            None => apply_work(work, rule, &hyper, lr, lr_max, grads, reads, threads),
            Some(gpu) => work.into_iter().try_for_each(|w| {
                let n = w.params.len();
                let read = if reads.is_empty() { reads } else { &reads[w.offset..w.offset + n] };
                let scalars = PushScalars { lr, lr_max, staleness: w.staleness, t: w.t };
                gpu.apply(
                    rule,
                    &hyper,
                    &scalars,
                    Bufs::from_planes(w.params, w.shared, w.worker, &grads[w.offset..w.offset + n], read),
                )
            }),
        }
        .map_err(|e| ShardError::Device(e.to_string()))?;
        let mut max_staleness = 0;
        let mut touched = BTreeSet::new();
        for p in plan {
            self.slots[p.slot].version += 1;
            touched.insert(p.tensor);
            max_staleness = max_staleness.max(p.staleness);
            self.stats.staleness_sum += p.staleness;
            self.stats.staleness_count += 1;
        }
        for t in touched {
            self.tensor_versions[t as usize] += 1;
        }
        self.stats.staleness_max = self.stats.staleness_max.max(max_staleness);
        Ok(())
    }

    /// Checks a table reference and that every id is owned here; returns the ids.
    fn sparse_ids(&self, table: u32, count: u32, words: &[f32]) -> Result<Vec<u64>, ShardError> {
        if table as usize >= self.tables.len() {
            return Err(ShardError::WrongShape(format!("unknown table {table} ({} tables)", self.tables.len())));
        }
        if words.len() < 2 * count as usize {
            return Err(ShardError::WrongShape(format!("{count} ids declared, fewer carried")));
        }
        let ids = words_to_ids(&words[..2 * count as usize]);
        let (me, n) = (self.cfg.shard, self.cfg.num_shards);
        if let Some(id) = ids.iter().find(|id| sparse_owner(table, **id, n) != me) {
            return Err(ShardError::RowNotOwned { table, id: *id, owner: sparse_owner(table, *id, n), me });
        }
        Ok(ids)
    }

    fn sparse_pull(&mut self, req: &SparsePull, payload: &[f32], now_s: u32) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        let ids = self.sparse_ids(req.table, req.count, payload)?;
        let table = &mut self.tables[req.table as usize];
        let dim = table.config().dim;
        let mut values = Vec::with_capacity(ids.len() * dim as usize);
        let mut versions = Vec::with_capacity(ids.len());
        if req.create {
            table.pull(&ids, now_s, &mut values, &mut versions);
        } else {
            table.peek(&ids, &mut values, &mut versions);
        }
        let mut out = Vec::with_capacity(ids.len() * (1 + dim as usize));
        out.extend(versions.iter().map(|v| f32::from_bits(*v)));
        out.extend_from_slice(&values);
        self.stats.pulls += 1;
        Ok(Frame {
            msg: Message::SparsePullReply(SparsePullReply { table: req.table, count: req.count, dim }),
            payload: out,
        })
    }

    fn sparse_push(&mut self, req: &SparsePush, payload: &[f32], now_s: u32) -> Result<Frame, ShardError> {
        if let Some(duplicate) = self.check_push(req.epoch, req.worker, req.seq)? {
            return Ok(duplicate);
        }
        let ids = self.sparse_ids(req.table, req.count, payload)?;
        let table_rule = self.cfg.sparse.rule;
        let dim = self.tables[req.table as usize].config().dim;
        if req.dim != dim {
            return Err(ShardError::WrongShape(format!(
                "table {} has dim {dim}, the push carries rows of {}",
                req.table, req.dim
            )));
        }
        if req.echo_read != table_rule.layout().needs_read {
            return Err(ShardError::WrongShape(format!(
                "sparse rule {table_rule} {} an echo of the read rows",
                if req.echo_read { "takes no" } else { "needs" }
            )));
        }
        let n = ids.len();
        let rows = n * dim as usize;
        let expected = 3 * n + rows * (1 + usize::from(req.echo_read));
        if payload.len() != expected {
            return Err(ShardError::WrongShape(format!(
                "sparse push carries {} words, expected {expected}",
                payload.len()
            )));
        }
        let mut distinct = std::collections::HashSet::with_capacity(n);
        if let Some(id) = ids.iter().find(|id| !distinct.insert(**id)) {
            return Err(ShardError::WrongShape(format!("id {id} appears twice in one push; aggregate per id first")));
        }
        let read_versions: Vec<u32> = payload[2 * n..3 * n].iter().map(|w| w.to_bits()).collect();
        let grads = &payload[3 * n..3 * n + rows];
        let reads = if req.echo_read { &payload[3 * n + rows..] } else { &[][..] };
        for values in [grads, reads] {
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(ShardError::NonFinite {
                    tensor: req.table,
                    chunk: (index / dim as usize) as u32,
                    index: index % dim as usize,
                    value: values[index].to_string(),
                });
            }
        }
        let hyper = self.cfg.sparse.hyper;
        let lr = hyper.lr * self.lr_scale;
        let max_staleness = self.tables[req.table as usize]
            .push(&ids, &read_versions, grads, reads, &hyper, lr, lr.max(hyper.lr), now_s)
            .map_err(|e| ShardError::WrongShape(e.to_string()))?;
        self.stats.pushes_applied += 1;
        self.stats.staleness_max = self.stats.staleness_max.max(max_staleness);
        if let Some(window) = self.seqs.get_mut(&req.worker) {
            window.insert(req.seq);
        }
        Ok(Frame::new(Message::Ack(Ack { seq: req.seq, max_staleness, ..Ack::default() })))
    }

    fn coordinator(&mut self) -> Result<&mut Coordinator, ShardError> {
        let shard = self.cfg.shard;
        self.coordinator.as_mut().ok_or_else(|| {
            ShardError::Misconfigured(format!("shard {shard} is not the coordinator; register with shard 0"))
        })
    }

    fn cluster_map(&self, worker_id: Option<u32>) -> Result<ClusterMap, ShardError> {
        let c = self.coordinator.as_ref().ok_or_else(|| ShardError::Misconfigured("not the coordinator".into()))?;
        let missing: Vec<String> =
            (0..self.cfg.num_shards).filter(|s| !c.shard_addrs.contains_key(s)).map(|s| s.to_string()).collect();
        if !missing.is_empty() {
            return Err(ShardError::ClusterIncomplete(format!(
                "cluster incomplete: shard(s) {} of {} have not registered with the coordinator",
                missing.join(", "),
                self.cfg.num_shards
            )));
        }
        Ok(ClusterMap {
            epoch: self.epoch,
            worker_id,
            num_shards: self.cfg.num_shards,
            shards: c.shard_addrs.iter().map(|(i, a)| ShardAddr { index: *i, addr: a.clone() }).collect(),
            layout: self.cfg.layout.clone(),
            lease_ms: self.cfg.lease.as_millis().min(u128::from(u32::MAX)) as u32,
            rule: self.rule_info(),
        })
    }

    fn rule_info(&self) -> RuleInfo {
        RuleInfo {
            name: self.cfg.rule.name().to_string(),
            momentum: self.cfg.hyper.momentum,
            weight_decay: self.cfg.hyper.weight_decay,
            sparse: self.cfg.sparse.rule.name().to_string(),
        }
    }

    fn register(&mut self, req: &Register, now: Duration, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        self.coordinator()?;
        if req.protocol != PROTOCOL_VERSION {
            return Err(ShardError::Misconfigured(format!(
                "client speaks protocol {}, this cluster speaks {PROTOCOL_VERSION}",
                req.protocol
            )));
        }
        // Check completeness before handing out an id, so a refused registration changes nothing.
        self.cluster_map(None)?;
        let lease = self.cfg.lease;
        let worker_id = match req.role {
            Role::Observer => None,
            Role::Worker => {
                let c = self.coordinator()?;
                let id = c.next_worker;
                c.next_worker += 1;
                c.registered += 1;
                events.push(CoreEvent::WorkerJoined(id));
                Some(id)
            }
        };
        if let Some(id) = worker_id {
            self.leases.insert(id, now + lease);
            self.membership_changed(events);
        }
        Ok(Frame::new(Message::ClusterMap(self.cluster_map(worker_id)?)))
    }

    fn register_shard(&mut self, req: &RegisterShard, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        let num_shards = self.cfg.num_shards;
        let fingerprint = self.cfg.layout.fingerprint();
        let c = self.coordinator()?;
        if req.protocol != PROTOCOL_VERSION {
            return Err(ShardError::Misconfigured(format!(
                "shard {} speaks protocol {}, the coordinator {PROTOCOL_VERSION}",
                req.shard, req.protocol
            )));
        }
        if req.num_shards != num_shards {
            return Err(ShardError::Misconfigured(format!(
                "shard {} was started with --num-shards {}, the coordinator with {num_shards}",
                req.shard, req.num_shards
            )));
        }
        if req.shard == 0 || req.shard >= num_shards {
            return Err(ShardError::Misconfigured(format!("shard index {} is not in 1..{num_shards}", req.shard)));
        }
        if req.layout_fingerprint != fingerprint {
            return Err(ShardError::Misconfigured(format!(
                "shard {} has a different model layout (fingerprint {:016x}, coordinator {fingerprint:016x}): start every shard with the same model flags",
                req.shard, req.layout_fingerprint
            )));
        }
        c.shard_addrs.insert(req.shard, req.addr.clone());
        events.push(CoreEvent::ShardJoined(req.shard));
        // The joining shard needs the epoch and layout even while other shards are still missing.
        Ok(Frame::new(Message::ClusterMap(ClusterMap {
            epoch: self.epoch,
            worker_id: None,
            num_shards,
            shards: Vec::new(),
            layout: self.cfg.layout.clone(),
            lease_ms: self.cfg.lease.as_millis().min(u128::from(u32::MAX)) as u32,
            rule: self.rule_info(),
        })))
    }

    fn heartbeat(&mut self, h: Heartbeat, now: Duration, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        // The coordinator knows every id it handed out; other shards learn workers from their heartbeats.
        if let Some(c) = &self.coordinator {
            if h.worker >= c.next_worker {
                return Err(ShardError::NotRegistered(format!("worker {} never registered", h.worker)));
            }
        }
        if self.leases.insert(h.worker, now + self.cfg.lease).is_none() {
            self.membership_changed(events);
        }
        Ok(Frame::new(Message::HeartbeatAck(HeartbeatAck {
            epoch: self.epoch,
            live_workers: self.leases.len() as u32,
        })))
    }

    fn leave(&mut self, l: Leave, events: &mut Vec<CoreEvent>) -> Result<Frame, ShardError> {
        if self.leases.remove(&l.worker).is_some() {
            self.detector.forget(l.worker);
            self.clocks.remove(&l.worker);
            events.push(CoreEvent::WorkerLeft(l.worker));
            self.membership_changed(events);
        }
        Ok(Frame::new(Message::HeartbeatAck(HeartbeatAck {
            epoch: self.epoch,
            live_workers: self.leases.len() as u32,
        })))
    }
}

/// One validated chunk update of a push.
#[derive(Debug, Clone, Copy)]
struct Planned {
    slot: usize,
    tensor: u32,
    /// Offset of the chunk's gradient (and read echo) in its payload section.
    offset: usize,
    staleness: u64,
}

/// The mutable pieces of one chunk update, borrowed disjointly from the slots.
struct Work<'a> {
    params: &'a mut [f32],
    shared: &'a mut [f32],
    worker: &'a mut [f32],
    offset: usize,
    staleness: u64,
    t: u64,
}

/// Borrows the planned slots disjointly (creating the pushing worker's planes where the rule has them).
fn collect_work<'a>(slots: &'a mut [ChunkSlot], plan: &[Planned], worker: u32, rule: Rule) -> Vec<Work<'a>> {
    let planes = rule.layout().worker_planes;
    let wanted: HashMap<usize, Planned> = plan.iter().map(|p| (p.slot, *p)).collect();
    let mut work = Vec::with_capacity(plan.len());
    for (index, slot) in slots.iter_mut().enumerate() {
        let Some(p) = wanted.get(&index) else { continue };
        let ChunkSlot { params, shared, workers, version, .. } = slot;
        let worker: &mut [f32] = if planes == 0 {
            &mut []
        } else {
            let n = params.len();
            workers.entry(worker).or_insert_with(|| vec![0.0; planes * n])
        };
        work.push(Work { params, shared, worker, offset: p.offset, staleness: p.staleness, t: *version + 1 });
    }
    work
}

/// Applies every chunk update, spread over `threads` threads when the push is large.
#[allow(clippy::too_many_arguments)]
fn apply_work(
    work: Vec<Work<'_>>,
    rule: Rule,
    hyper: &Hyper,
    lr: f32,
    lr_max: f32,
    grads: &[f32],
    reads: &[f32],
    threads: usize,
) -> Result<(), gaps_kernels::KernelError> {
    let total: usize = work.iter().map(|w| w.params.len()).sum();
    let run = |w: Work<'_>, threads: usize| {
        let n = w.params.len();
        let read = if reads.is_empty() { reads } else { &reads[w.offset..w.offset + n] };
        let scalars = PushScalars { lr, lr_max, staleness: w.staleness, t: w.t };
        let bufs = Bufs::from_planes(w.params, w.shared, w.worker, &grads[w.offset..w.offset + n], read);
        gaps_kernels::apply_par(rule, hyper, &scalars, bufs, threads)
    };
    if threads <= 1 || total < gaps_kernels::PAR_MIN_PARAMS || work.len() < threads {
        // Few chunks: each large chunk is split over the threads instead.
        return work.into_iter().try_for_each(|w| run(w, threads));
    }
    // Many chunks: deal them out to the threads, largest first, each thread taking the lightest load.
    let mut groups: Vec<(usize, Vec<Work<'_>>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    let mut work = work;
    work.sort_by_key(|w| std::cmp::Reverse(w.params.len()));
    for w in work {
        if let Some(g) = groups.iter_mut().min_by_key(|g| g.0) {
            g.0 += w.params.len();
            g.1.push(w);
        }
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            groups.into_iter().map(|(_, g)| scope.spawn(move || g.into_iter().try_for_each(|w| run(w, 1)))).collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(gaps_kernels::KernelError::Internal("an update thread panicked".into())))
        })
    })
}
