//! The shard core: a sans-IO state machine that owns one shard's chunks, optimizer state, versions,
//! exactly-once bookkeeping and (on shard 0) the coordinator's membership.
//!
//! It is driven only by [`ShardCore::handle`] (one request frame in, one reply frame out) and
//! [`ShardCore::tick`]; time is an argument (`now`, any monotonic origin), never read from a clock.
//! The QUIC service, the simulator and the tests all drive this same type.

mod config;
mod data;
mod dense;
mod events;
mod exactly_once;
mod hold;
mod membership;
mod resident;
mod snapshot;
mod sparse_rpc;
mod steps;
mod worker_step;
pub use worker_step::append_reply_values;

pub use config::*;
pub use events::*;
pub use snapshot::CheckpointInfo;

use crate::modes::{LrRamp, Mode, ModeConfig, StragglerDetector};
use crate::sparse::{Eviction, SparseTable, TableConfig};
use dense::Planned;
pub use exactly_once::SEQ_WINDOW;
use exactly_once::{AppliedSeqs, SeqWindow};
use gaps_common::layout::sparse_owner;
use gaps_common::layout::{ChunkId, Layout};
use gaps_common::rng::{mix, Rng};
use gaps_common::wire::{
    words_to_ids, Ack, ChunkVersion, ClusterMap, ErrorCode, Frame, Heartbeat, HeartbeatAck, Leave, Message,
    ModeDecision, ModeDecisions, ModeSwitchRecord, Pull, PullReply, Push, PushPullReply, Register, RegisterShard, Role,
    RuleInfo, ShardAddr, SparsePull, SparsePullReply, SparsePush, Stats, WorkerApplied, PROTOCOL_VERSION,
};
use gaps_common::wire::{Promote, ReplicaEpoch, ReplicaReport, Request};
use gaps_kernels::{Bufs, Hyper, PushScalars, Rule};
use membership::Coordinator;
pub use membership::RESTART_ID_GAP;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use steps::RowAccum;

/// One owned chunk: its parameters, optimizer state (planes of `len` floats) and update count.
#[derive(Debug)]
struct ChunkSlot {
    /// The tensor the chunk belongs to.
    tensor: u32,
    /// Floats in the chunk.
    len: usize,
    /// The parameters (empty while the state is resident on a device). Shared with the replies that are
    /// still sending them ([`ShardCore::set_shared_replies`]): an update writes into its own copy when a
    /// reply holds them (copy on write), so a reply never sees a later update.
    params: Arc<Vec<f32>>,
    /// The rule's shared planes (empty while the state is resident on a device).
    shared: Vec<f32>,
    /// The rule's per-worker planes, created on a worker's first push (only for rules that have them);
    /// while the state is resident on a device, an empty marker per worker whose plane the device holds.
    workers: HashMap<u32, Vec<f32>>,
    /// Number of updates applied to this chunk: the per-parameter last-update version (every element of a
    /// dense chunk is updated by the same pushes, so one counter per chunk is exact for all of them).
    version: u64,
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
    /// Exactly-once: each worker's window of sequence numbers and its ledger of pushes applied.
    once: exactly_once::ExactlyOnce,
    coordinator: Option<Coordinator>,
    stats: Stats,
    /// The learning rate's multipliers and η_max.
    lr: LrState,
    /// Sparse tables, layout order.
    tables: Vec<SparseTable>,
    /// The live workers and their clocks.
    members: Members,
    /// The latest time the core was driven with.
    clock: Duration,
    /// The mode in force and how it came to be: decisions, switches, the straggler detector.
    mode: steps::ModeState,
    /// The synchronous step in progress (sync and gba) and the count of steps applied.
    step: steps::StepState,
    /// Seconds of the last request or tick (rows touched by a step's update are stamped with it).
    now_s: u32,
    /// The device holding the dense state, when it was made resident ([`ShardCore::make_resident`]).
    resident: Option<Box<dyn gaps_kernels::resident::ResidentState>>,
    /// Which worker holds which stripe of the resident worker arena.
    stripes: resident::WorkerStripes,
    /// How pull replies are made: packed 16-bit sections, shared parameter buffers, the last reply's views.
    replies: dense::ReplyOptions,
    /// Each tensor's rule and hyper-parameters (the shard's flags with the layout's overrides).
    tensor_rules: Vec<(Rule, Hyper)>,
    /// Each table's rule and hyper-parameters.
    table_rules: Vec<(Rule, Hyper)>,
    threads: usize,
    /// Dynamic data sharding: samples accepted per grant, and how many grants' counts were dropped.
    data: data::GrantCounts,
    /// The coordinator's data dealer ([`Self::set_dealer`]).
    dealer: Option<crate::dealer::Dealer>,
    /// A restored checkpoint's dealer section, read once the dealer's settings are known.
    restored_dealer: Option<(u32, Vec<u8>)>,
}

/// Who trains on this shard: an owned part of [`ShardCore`] (the lease holders and clocks are in its
/// checkpoints).
#[derive(Debug, Default)]
struct Members {
    /// Live workers (by heartbeat, registration or push) and the time their lease ends.
    leases: BTreeMap<u32, Duration>,
    /// Pushes per worker (bounded staleness).
    clocks: BTreeMap<u32, u64>,
    /// Workers that said they leave: a heartbeat or split request of theirs that arrives after the `Leave`
    /// — sent before it on another connection — renews no lease. Ids are never handed out twice, so a
    /// worker that comes back has a new one. Carried to a backup's copy and through a rollback; a shard
    /// restarted from a checkpoint starts without it.
    left: Departed,
}

/// How many departed workers a shard remembers ([`Departed`]): the earliest departures are dropped first.
const LEFT_REMEMBERED: usize = 1 << 16;

/// The workers that left, the newest [`LEFT_REMEMBERED`] departures, in the order they left.
#[derive(Debug, Default)]
pub(crate) struct Departed {
    ids: std::collections::BTreeSet<u32>,
    order: std::collections::VecDeque<u32>,
}

impl Departed {
    /// Records that `worker` left (forgetting the earliest departure beyond the bound).
    pub(crate) fn insert(&mut self, worker: u32) {
        if self.ids.insert(worker) {
            self.order.push_back(worker);
            if self.order.len() > LEFT_REMEMBERED {
                if let Some(earliest) = self.order.pop_front() {
                    self.ids.remove(&earliest);
                }
            }
        }
    }

    /// Whether `worker` left.
    pub(crate) fn contains(&self, worker: u32) -> bool {
        self.ids.contains(&worker)
    }

    /// The departures, earliest first.
    pub(crate) fn in_order(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.order.iter().copied()
    }
}

/// What sets the learning rate beyond each rule's own η: an owned part of [`ShardCore`] (in its checkpoints).
#[derive(Debug)]
struct LrState {
    /// Multiplier of the configured learning rate (schedules, warm-up; [`ShardCore::set_lr_scale`]).
    scale: f32,
    /// Largest learning rate used so far per tensor (Gap-Aware's η_max).
    max: Vec<f32>,
    /// The elastic multiplier of the last applied update (reported in the counters).
    last_multiplier: f64,
    /// The elastic ramp as workers join and leave (Dynamic mini-batch SGD), in the synchronous modes.
    ramp: LrRamp,
}

/// Each tensor's and each table's rule with its hyper-parameters, as the layout names them over the
/// shard's defaults; a table's rule may keep no per-worker state or look-ahead.
#[allow(clippy::type_complexity)]
fn resolve_rules(cfg: &ShardConfig) -> Result<(Vec<(Rule, Hyper)>, Vec<(Rule, Hyper)>), ShardError> {
    let tensor_rules = cfg
        .layout
        .tensors
        .iter()
        .map(|t| {
            cfg.hyper
                .resolve(cfg.rule, &t.rule)
                .map_err(|e| ShardError::Misconfigured(format!("tensor {:?}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let table_rules = cfg
        .layout
        .tables
        .iter()
        .map(|t| {
            let (rule, hyper) = cfg
                .sparse
                .hyper
                .resolve(cfg.sparse.rule, &t.rule)
                .map_err(|e| ShardError::Misconfigured(format!("table {:?}: {e}", t.name)))?;
            let l = rule.layout();
            if l.worker_planes > 0 || l.lookahead || l.worker_momentum {
                return Err(ShardError::Misconfigured(format!(
                    "table {:?}: rule {rule} keeps state per worker or a look-ahead, which embedding rows cannot have",
                    t.name
                )));
            }
            Ok((rule, hyper))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((tensor_rules, table_rules))
}

/// The chunk slots this shard owns, initialized (`chunk_base`: each tensor's first global chunk number).
fn new_slots(
    cfg: &ShardConfig,
    chunk_base: &[u64],
    tensor_rules: &[(Rule, Hyper)],
) -> Result<Vec<ChunkSlot>, ShardError> {
    let mut slots = Vec::new();
    for id in cfg.layout.chunks_of_shard(cfg.shard, cfg.num_shards) {
        let range = cfg.layout.chunk_range(id).map_err(|e| ShardError::Misconfigured(e.to_string()))?;
        let global = chunk_base[id.tensor as usize] + u64::from(id.chunk);
        let params = cfg.init.chunk(global, range.len());
        slots.push(ChunkSlot {
            tensor: id.tensor,
            len: params.len(),
            shared: vec![0.0; params.len() * tensor_rules[id.tensor as usize].0.layout().shared_planes],
            params: Arc::new(params),
            workers: HashMap::new(),
            version: 0,
        });
    }
    Ok(slots)
}

/// The embedding tables, the memory budget shared evenly among them.
fn new_tables(cfg: &ShardConfig, table_rules: &[(Rule, Hyper)]) -> Result<Vec<SparseTable>, ShardError> {
    let per_table_budget = cfg.sparse.memory_budget.map(|b| b / cfg.layout.tables.len().max(1) as u64);
    cfg.layout
        .tables
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            SparseTable::new(TableConfig {
                table: i as u32,
                dim: spec.dim,
                rule: table_rules[i].0,
                init_std: cfg.sparse.init_std,
                adagrad_init: cfg.sparse.adagrad_init,
                seed: cfg.init.seed,
                admit_after: cfg.sparse.admit_after,
                memory_budget: per_table_budget,
                eviction: cfg.sparse.eviction,
            })
            .map_err(|e| ShardError::Misconfigured(e.to_string()))
        })
        .collect()
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
        let (tensor_rules, table_rules) = resolve_rules(&cfg)?;
        let slots = new_slots(&cfg, &chunk_base, &tensor_rules)?;
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
        let lr_max = tensor_rules.iter().map(|(_, h)| h.lr).collect();
        cfg.sparse.hyper.validate().map_err(|e| ShardError::Misconfigured(format!("sparse rule: {e}")))?;
        let tables = new_tables(&cfg, &table_rules)?;
        let active = match cfg.modes.mode {
            Mode::Auto => Mode::Sync,
            m => m,
        };
        let n_slots = slots.len();
        let owned_elems = slots.iter().map(|s| s.len).sum();
        let row_accum = cfg.layout.tables.iter().map(|t| RowAccum::new(t.dim as usize)).collect();
        Ok(ShardCore {
            replies: dense::ReplyOptions::default(),
            once: exactly_once::ExactlyOnce::default(),
            mode: steps::ModeState::new(active),
            now_s: 0,
            owned_elems,
            tables,
            members: Members::default(),
            clock: Duration::ZERO,
            step: steps::StepState::new(n_slots, row_accum),
            cfg,
            epoch,
            chunk_base,
            slots,
            tensor_versions,
            coordinator,
            stats,
            lr: LrState { scale: 1.0, max: lr_max, last_multiplier: 1.0, ramp: LrRamp::default() },
            tensor_rules,
            table_rules,
            threads,
            resident: None,
            stripes: resident::WorkerStripes::default(),
            data: data::GrantCounts::default(),
            dealer: None,
            restored_dealer: None,
        })
    }

    /// With `on`, a reply that reads plain parameters in f32 (a pull or a push-pull of chunks whose rule has
    /// no look-ahead, the state on the host) carries no payload of its own: it shares the chunks' parameter
    /// buffers, handed out by [`Self::take_reply_views`] right after the request, instead of copying them
    /// on the core's thread. The next update of a chunk a reply still holds writes into a fresh copy. Off
    /// by default (in-process callers read the payload).
    pub fn set_shared_replies(&mut self, on: bool) {
        self.replies.shared_replies = on;
    }

    /// The parameter buffers the last request's reply shares instead of a payload (see
    /// [`Self::set_shared_replies`]): the whole payload, in order, or nothing.
    pub fn take_reply_views(&mut self) -> Vec<Arc<Vec<f32>>> {
        std::mem::take(&mut self.replies.reply_views)
    }

    /// Until when the last push-pull is to be held for its GBA step (the caller holds the reply and answers
    /// it with a pull once the step is applied or the time is up; see `hold`), or None: answer now. Asked
    /// once per push-pull.
    pub fn take_gba_hold(&mut self) -> Option<Duration> {
        self.step.gba_hold.take()
    }

    /// With `on`, a pull reply that has a 16-bit section carries its payload packed for the wire
    /// ([`gaps_common::dtype::Packer`]: each run of one format from a new slot, 16-bit values two to a
    /// slot), converted straight from the parameters, instead of one f32 per value; the embedding service
    /// sends such a payload as it is. Off by default (in-process callers read f32 values).
    pub fn set_packed_replies(&mut self, on: bool) {
        self.replies.packed_replies = on;
    }

    /// Elements over all dense chunks this shard owns.
    pub fn owned_elems(&self) -> usize {
        self.owned_elems
    }

    /// The learning rate in force: the configured η times the schedule's multiplier and, in the
    /// synchronous modes, the elastic multiplier (live workers relative to the start, ramped).
    pub fn lr(&self) -> f32 {
        self.scaled_lr(self.cfg.hyper.lr)
    }

    /// The learning rate in force for tensor `tensor` (its own η, or the shard's, times the multipliers).
    pub fn tensor_lr(&self, tensor: u32) -> f32 {
        self.scaled_lr(self.tensor_rules.get(tensor as usize).map_or(self.cfg.hyper.lr, |(_, h)| h.lr))
    }

    /// `base` times the schedule's and the elastic multipliers.
    fn scaled_lr(&self, base: f32) -> f32 {
        base * self.lr.scale * self.lr_multiplier() as f32
    }

    /// The rule and hyper-parameters tensor `tensor` is updated with.
    pub fn tensor_rule(&self, tensor: u32) -> Option<(Rule, Hyper)> {
        self.tensor_rules.get(tensor as usize).copied()
    }

    /// True when some tensor's rule needs the read parameters echoed with a push.
    pub fn needs_read(&self) -> bool {
        self.tensor_rules.iter().any(|(r, _)| r.layout().needs_read)
    }

    /// The elastic learning-rate multiplier in force (1 outside the synchronous modes).
    pub fn lr_multiplier(&self) -> f64 {
        match self.mode.active {
            Mode::Sync | Mode::Gba => self.lr.ramp.multiplier(self.step.global_step),
            _ => 1.0,
        }
    }

    /// The mode in force.
    pub fn active_mode(&self) -> Mode {
        self.mode.active
    }

    /// Sets the learning-rate multiplier (warm-up, schedules, elastic ramps). Non-finite or non-positive
    /// values are refused.
    pub fn set_lr_scale(&mut self, scale: f32) -> Result<(), ShardError> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(ShardError::Misconfigured(format!("learning-rate multiplier must be positive, got {scale}")));
        }
        self.lr.scale = scale;
        self.step.ahead_values.clear();
        Ok(())
    }

    /// Floats of optimizer state held per worker over all owned chunks (0 for rules without per-worker
    /// state), for reporting memory.
    pub fn worker_state_floats(&self) -> usize {
        let planes = |s: &ChunkSlot| self.tensor_rules[s.tensor as usize].0.layout().worker_planes * s.len;
        self.slots.iter().map(|s| s.workers.len() * planes(s)).sum()
    }

    /// This shard's configuration.
    pub fn config(&self) -> &ShardConfig {
        &self.cfg
    }

    /// The cluster epoch this shard serves (0 until a non-coordinator shard joined).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether what `wait` waits for has come: the global step and the slowest live worker's clock.
    pub fn wait_satisfied(&self, wait: &gaps_common::wire::WaitStep) -> bool {
        self.step.global_step >= wait.step && self.min_clock() >= wait.clock
    }

    /// Zeroes the counters that reads move (`pulls`, bytes in and out): what a primary's state differs from a
    /// backup's by, which handles only the primary's log (`crate::replica`; tests compare checkpoints).
    #[doc(hidden)]
    pub fn forget_read_counters(&mut self) {
        self.stats.pulls = 0;
        self.stats.payload_bytes_in = 0;
        self.stats.payload_bytes_out = 0;
    }

    /// Counters since start.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.epoch = self.epoch;
        s.live_workers = self.members.leases.len() as u32;
        if let Some(c) = &self.coordinator {
            s.registered_workers = c.registered;
        }
        s.mode = self.mode.active.code();
        s.lr_multiplier_milli = (self.lr.last_multiplier * 1000.0).round().clamp(0.0, f64::from(u32::MAX)) as u32;
        s.ssp_min_clock = self.min_clock();
        s.global_step = self.step.global_step;
        s.decisions = self.mode.decisions;
        s.switches = self.mode.switches.iter().cloned().collect();
        s.applied_by_worker = self.applied_by_worker();
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

    /// Synchronous and GBA steps applied so far.
    pub fn global_step(&self) -> u64 {
        self.step.global_step
    }

    /// True while a synchronous or GBA step has gradients accumulated but not yet applied.
    pub fn step_in_progress(&self) -> bool {
        self.step.accum_pushes > 0 || self.step.row_accum.iter().any(|a| !a.is_empty())
    }

    /// The newest two mode decisions this shard knows.
    pub fn decisions(&self) -> ModeDecisions {
        self.mode.decisions
    }

    /// The mode switches this shard carried out, oldest first (the last 64).
    pub fn switches(&self) -> impl Iterator<Item = &ModeSwitchRecord> {
        self.mode.switches.iter()
    }

    /// Workers holding a lease with this shard.
    pub fn live_workers(&self) -> usize {
        self.members.leases.len()
    }

    /// The live workers as the update rules' worker count (at least 1).
    pub(crate) fn worker_count(&self) -> u32 {
        u32::try_from(self.live_workers()).unwrap_or(u32::MAX).max(1)
    }

    /// Where a checkpoint asked for at `at` stands: taken now, later, or never (the shard is past the step).
    pub fn checkpoint_readiness(&self, at: gaps_common::wire::CheckpointAt) -> Readiness {
        use gaps_common::wire::CheckpointAt;
        let quiet = !self.step_in_progress();
        match at {
            CheckpointAt::Now => Readiness::Ready,
            CheckpointAt::Quiescent if quiet => Readiness::Ready,
            CheckpointAt::Quiescent => Readiness::Later,
            CheckpointAt::Step(n) if self.step.global_step > n || (self.step.global_step == n && !quiet) => {
                Readiness::Never(self.step.global_step)
            }
            // No live worker can complete the steps up to it.
            CheckpointAt::Step(n) if self.step.global_step < n && quiet && self.members.leases.is_empty() => {
                Readiness::Never(self.step.global_step)
            }
            CheckpointAt::Step(n) if self.step.global_step == n => Readiness::Ready,
            CheckpointAt::Step(_) => Readiness::Later,
        }
    }

    /// The other shards (coordinator only: the shards that joined it), shard order: where each is served and
    /// by which shard process (the one whose certificate it answers with; another than its own once a
    /// backup took it over).
    pub fn peer_shards(&self) -> Vec<PeerShard> {
        let Some(c) = self.coordinator.as_ref() else { return Vec::new() };
        c.shard_addrs
            .iter()
            .filter(|(i, _)| **i != self.cfg.shard)
            .map(|(i, a)| PeerShard { index: *i, addr: a.clone(), process: c.replica_set(*i).process })
            .collect()
    }

    /// Handles one request and returns the reply frame (an error reply when the request is refused; a
    /// refused request changes nothing).
    pub fn handle(&mut self, req: Frame, now: Duration) -> (Frame, Vec<CoreEvent>) {
        self.handle_checked(req, now, false)
    }

    /// [`Self::handle`] for a request whose payload the caller already found free of NaN and ±∞
    /// (`finite`: checked while it was decoded, as the service does), so that a dense push is not scanned a
    /// second time. With `finite` false the core checks, as `handle` does.
    pub fn handle_checked(&mut self, req: Frame, now: Duration, finite: bool) -> (Frame, Vec<CoreEvent>) {
        let mut events = Vec::new();
        self.replies.reply_views.clear();
        self.step.gba_hold.clear_asked();
        let Frame { msg, payload } = req;
        self.stats.payload_bytes_in += payload.len() as u64 * 4;
        self.now_s = now.as_secs().min(u64::from(u32::MAX)) as u32;
        let (result, is_push) = match msg.into_request() {
            Ok(request) => {
                let is_push = request.is_push();
                (self.serve(request, &payload, finite, now, &mut events), is_push)
            }
            // An answer sent as a request changes nothing.
            Err(reply) => (Err(ShardError::NotARequest(reply.name())), false),
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
        // Values declared (a packed reply holds fewer slots), four bytes each as the receiver holds them.
        self.stats.payload_bytes_out += reply.msg.payload_elems() * 4;
        // The request's payload was only read; a very large one is recycled for the next request.
        gaps_common::buffers::give(payload);
        (reply, events)
    }

    /// One request, to the part of the core that answers it (those only the coordinator serves refused
    /// by any other shard first).
    fn serve(
        &mut self,
        request: Request,
        payload: &[f32],
        finite: bool,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        let now_s = self.now_s;
        if coordinator_only(&request) {
            self.coordinator()?;
        }
        match request {
            Request::Pull(p) => self.pull(&p),
            Request::Push(p) => self.push(&p, payload, finite, now, events),
            Request::PushPull(p) => self.push_pull(&p, payload, finite, now, events),
            Request::Step(s) => self.worker_step(&s, (payload, finite), now, events),
            // A part of a push applied before is acknowledged as a duplicate; new parts are put together by
            // the service (`crate::stripes`), which hands the core whole pushes.
            Request::PushPart(p) => match self.check_push(p.push.epoch, p.push.worker, p.push.seq) {
                Ok(Some(mut duplicate)) => {
                    if let Message::Ack(ack) = &mut duplicate.msg {
                        self.duplicate_waits(p.push.worker, ack);
                    }
                    Ok(duplicate)
                }
                Ok(None) => Err(ShardError::Misconfigured(
                    "parts of a striped push are put together by the shard service; the core takes whole pushes".into(),
                )),
                Err(e) => Err(e),
            },
            Request::SparsePull(p) => self.sparse_pull(&p, payload, now_s),
            Request::SparsePush(p) => self.sparse_push(&p, payload, now_s),
            Request::Register(r) => self.register(&r, now, events),
            Request::RegisterShard(r) => self.register_shard(&r, events),
            Request::Heartbeat(h) => self.heartbeat(h, now, events),
            Request::Leave(l) => self.leave(l, events),
            Request::SplitRequest(r) => self.split_request(&r, now, events),
            Request::DataStatusRequest(r) => Ok(Frame::new(Message::DataStatus(self.data_status(r.after_grant)))),
            Request::Initialize(i) => self.initialize(&i, payload),
            Request::TableScan(r) => self.table_scan(&r),
            Request::TableLoad(r) => self.table_load(&r, payload, now_s),
            // The core answers at once; the service holds the request until `wait_satisfied`.
            Request::StatsRequest(_) | Request::WaitStep(_) => Ok(Frame::new(Message::Stats(self.stats()))),
            // Files are the service's business: a core on its own cannot write one.
            Request::CheckpointRequest(_) => {
                Err(ShardError::Misconfigured("checkpoints are written by the shard service, not the core".into()))
            }
            Request::Rollback(_) => {
                Err(ShardError::Misconfigured("rollbacks are run by the shard service, not the core".into()))
            }
            // Replication is between shard services; a core is replicated by being fed its primary's log.
            Request::ReplicaSnapshot(_) | Request::ReplicaAppend(_) => {
                Err(ShardError::Misconfigured("replication is run by the shard service, not the core".into()))
            }
            Request::ReplicaReport(r) => self.replica_report(&r, events),
            Request::Promote(p) => self.promote(&p, events),
            // Shard 0's configuration is chosen by the shard processes, outside any core.
            Request::ConfigPrepare(_)
            | Request::ConfigAccept(_)
            | Request::ConfigChosen(_)
            | Request::CoordinatorWhere(_) => Err(ShardError::Misconfigured(
                "shard 0's configuration is chosen by the shard service, not the core".into(),
            )),
            // Credentials are checked by the service, which knows the connection's certificate.
            Request::Authenticate(_) => {
                Err(ShardError::Misconfigured("credentials are checked by the shard service, not the core".into()))
            }
        }
    }

    /// Expires worker leases and idle sparse rows (TTL eviction). Returns what changed.
    pub fn tick(&mut self, now: Duration) -> Vec<CoreEvent> {
        let now_s = now.as_secs().min(u64::from(u32::MAX)) as u32;
        self.now_s = now_s;
        for t in &mut self.tables {
            t.tick(now_s);
        }
        self.clock = self.clock.max(now);
        let expired: Vec<u32> =
            self.members.leases.iter().filter(|(_, until)| **until <= now).map(|(w, _)| *w).collect();
        let mut events: Vec<CoreEvent> = Vec::new();
        for w in &expired {
            self.members.leases.remove(w);
            self.forget_worker(*w, &mut events);
            events.push(CoreEvent::WorkerExpired(*w));
        }
        if !expired.is_empty() {
            self.membership_changed(&mut events);
        }
        // A step that has waited a lease for workers that push nothing (they only heartbeat, or stalled)
        // completes without them.
        if self.mode.active == Mode::Sync && self.step_ready() {
            if let Err(e) = self.complete_step() {
                events.push(CoreEvent::DeviceFault(format!("completing a step without an idle worker: {e}")));
            }
        }
        events
    }

    /// Replaces the values of an owned chunk (restoring a checkpoint, or a model-specific initializer such
    /// as the simulator's He initialisation). The chunk's version and optimizer state are kept.
    pub fn overwrite(&mut self, id: ChunkId, values: &[f32]) -> Result<(), ShardError> {
        let slot = self.slot_index(id)?;
        let len = self.slots[slot].len;
        if values.len() != len {
            return Err(ShardError::WrongShape(format!("chunk has {len} elements, got {}", values.len())));
        }
        if gaps_common::dtype::first_non_finite(values).is_some() {
            return Err(ShardError::WrongShape("initial values must be finite".into()));
        }
        match self.resident.as_mut() {
            None => Arc::make_mut(&mut self.slots[slot].params).copy_from_slice(values),
            Some(r) => r.load_params(slot, values).map_err(|e| ShardError::Device(e.to_string()))?,
        }
        self.step.ahead_values.remove(&slot);
        Ok(())
    }

    /// Values of an owned chunk (for tests, checkpoints and evaluation inside the process): borrowed from the
    /// host, or copied back from the device holding the state.
    pub fn chunk_values(&self, id: ChunkId) -> Result<std::borrow::Cow<'_, [f32]>, ShardError> {
        let slot = self.slot_index(id)?;
        if self.resident.is_none() {
            return Ok(std::borrow::Cow::Borrowed(&self.slots[slot].params[..]));
        }
        let mut out = Vec::with_capacity(self.slots[slot].len);
        self.read_params_into(slot, &mut out)?;
        Ok(std::borrow::Cow::Owned(out))
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
}

/// Whether only the coordinator (shard 0's server) serves `request`: registrations of workers and shards,
/// the dealer's splits, replica reports and takeovers.
fn coordinator_only(request: &Request) -> bool {
    matches!(
        request,
        Request::Register(_)
            | Request::RegisterShard(_)
            | Request::SplitRequest(_)
            | Request::ReplicaReport(_)
            | Request::Promote(_)
    )
}
