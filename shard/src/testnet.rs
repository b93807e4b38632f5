//! An in-memory cluster on a virtual clock, for tests: shards are [`ShardCore`]s, workers small state
//! machines that speak the wire protocol (register, pull, push with sequence numbers sent again until
//! acknowledged, wait for synchronous steps, heartbeats, leave), joined by a network that delays and loses
//! messages and can cut two nodes apart.
//!
//! What it leaves out of `gaps-worker` and `gaps-server`: a step here is a `Pull` then a `Push` (not the
//! real worker's `PushPull`), a step wait is polled every millisecond with `WaitStep { max_wait_ms: 0 }` (the
//! service's held waits and GBA's held push-pulls live in its actor thread, not in the core), and there is
//! no TLS, striping or replication. The end-to-end versions over real processes stay in
//! `cli/tests/local.rs` and `cli/tests/netns.rs`. Shards are killed and restarted from their newest
//! checkpoint, workers killed and added, workers slowed for a while — at virtual times. Every draw comes
//! from one seed and every event has a place in one queue: a run is reproducible to the message, on any
//! machine under any load (no wall clock is read).
//!
//! The model the workers train is a quadratic bowl over the layout's one dense tensor (loss
//! ½·Σ(wᵢ − tᵢ)², gradient w − t plus seeded noise), enough to see training go on through faults.

use crate::modes::{Mode, ModeConfig};
use crate::schedule::{CheckpointSchedule, Due};
use crate::{Init, ShardConfig, ShardCore};
use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::rng::Rng;
use gaps_common::wire::Frame;
use gaps_common::wire::{
    ErrorCode, Heartbeat, Leave, Message, ModeDecisions, ModeSwitchRecord, Pull, Push, PushChunk, Register, Role,
    Stats, WaitStep, PROTOCOL_VERSION,
};
use gaps_kernels::Hyper;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

/// A shard's configuration for tests over `layout` at `epoch`: shard 0 of 1, the momentum rule (lr 0.05,
/// γ 0.9), parameters drawn with seed 4 and σ 0.1, a 60 s lease; tests change what they need
/// (`ShardConfig { shard: 1, ..config(layout, epoch) }`). The fuzz targets and the shard's tests build theirs
/// from it.
pub fn config(layout: Layout, epoch: u64) -> ShardConfig {
    ShardConfig {
        rule: gaps_kernels::Rule::Momentum,
        hyper: Hyper { lr: 0.05, momentum: 0.9, ..Hyper::default() },
        init: Init { seed: 4, std: 0.1 },
        lease: Duration::from_secs(60),
        advertise: "test:1".into(),
        epoch,
        ..ShardConfig::new(layout)
    }
}

/// Elements of a chunk of the one dense tensor.
const CHUNK: u32 = 16;

/// Who sends and receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Node {
    /// Shard `i` (0: the coordinator).
    Shard(u32),
    /// The `i`-th worker started (added ones count on).
    Worker(usize),
}

/// What happens at a virtual time.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// The shard's process dies: its state is gone, and every message that reaches it while it is down.
    KillShard(u32),
    /// The shard starts again from its newest checkpoint (fresh and joined again when it has none; shard 0
    /// without a checkpoint starts a new cluster the others do not join again).
    RestartShard(u32),
    /// The worker's process dies; what it sent is still on the wire.
    KillWorker(usize),
    /// A new worker starts and registers.
    AddWorker,
    /// The worker computes `factor` times slower until `until`.
    Slow { worker: usize, factor: f64, until: Duration },
    /// No message passes between the two nodes (either way) until [`Fault::Heal`].
    Cut(Node, Node),
    /// Every cut is mended.
    Heal,
}

/// The seeded chaos schedule of a two-shard, four-worker job (what `chaos` tests run, here and with real
/// processes): shard 1 killed and restarted, then shard 0 (the coordinator), worker 3 killed and a worker
/// added, each at a time drawn from `seed` within the job's first few seconds.
pub fn chaos_schedule(seed: u64) -> Vec<(Duration, Fault)> {
    let mut rng = Rng::new(seed);
    let mut draw = |lo: u64, hi: u64| lo + rng.below(hi - lo);
    let kill1 = draw(700, 1300);
    let back1 = kill1 + draw(400, 1000);
    let kill_worker = draw(1500, 2500);
    let add_worker = draw(2000, 3000);
    let kill0 = back1 + draw(800, 1500);
    let back0 = kill0 + draw(400, 1000);
    let ms = Duration::from_millis;
    vec![
        (ms(kill1), Fault::KillShard(1)),
        (ms(back1), Fault::RestartShard(1)),
        (ms(kill0), Fault::KillShard(0)),
        (ms(back0), Fault::RestartShard(0)),
        (ms(kill_worker), Fault::KillWorker(3)),
        (ms(add_worker), Fault::AddWorker),
    ]
}

/// A cluster to build.
#[derive(Clone, Debug)]
pub struct Spec {
    pub shards: u32,
    pub workers: usize,
    pub mode: Mode,
    /// Steps each worker trains.
    pub steps: u64,
    pub seed: u64,
    /// A worker's compute time per step (±10 %, drawn).
    pub compute: Duration,
    /// One-way delay of a message, and up to `jitter` more (drawn).
    pub delay: Duration,
    pub jitter: Duration,
    /// The probability that a message is lost.
    pub loss: f64,
    pub lease: Duration,
    /// Every shard writes a checkpoint this often (None: never).
    pub checkpoint_every: Option<Duration>,
    /// How long a worker waits for a reply before it sends the request again.
    pub retry_after: Duration,
    /// Dense parameters (one tensor, chunks of 16).
    pub params: u64,
    pub lr: f32,
}

impl Spec {
    /// `workers` workers on `shards` shards in `mode`, 10 ms steps, 0.2 ms links, nothing lost.
    pub fn new(shards: u32, workers: usize, mode: Mode, steps: u64, seed: u64) -> Self {
        Spec {
            shards,
            workers,
            mode,
            steps,
            seed,
            compute: Duration::from_millis(10),
            delay: Duration::from_micros(200),
            jitter: Duration::from_micros(100),
            loss: 0.0,
            lease: Duration::from_secs(2),
            checkpoint_every: None,
            retry_after: Duration::from_millis(200),
            params: 64,
            lr: 0.05,
        }
    }

    fn shard_config(&self, shard: u32) -> ShardConfig {
        let layout = Layout::new(vec![TensorSpec::new("w", self.params)], CHUNK).expect("a valid layout");
        let hyper = Hyper { lr: self.lr, momentum: 0.0, ..Hyper::default() };
        ShardConfig {
            shard,
            num_shards: self.shards,
            hyper,
            init: Init { seed: self.seed, std: 0.0 },
            lease: self.lease,
            advertise: format!("shard-{shard}"),
            modes: ModeConfig { mode: self.mode, ..ModeConfig::default() },
            ..ShardConfig::new(layout)
        }
    }
}

/// What a run ends with.
#[derive(Clone, Debug)]
pub struct Report {
    /// The virtual time the last worker finished at.
    pub now: Duration,
    /// Each shard's counters at the end (all shards are up at the end).
    pub stats: Vec<Stats>,
    /// Each shard's mode switches.
    pub switches: Vec<Vec<ModeSwitchRecord>>,
    pub pushes_sent: u64,
    pub pushes_acknowledged: u64,
    /// Sent by a worker that was killed and never acknowledged to it.
    pub pushes_unconfirmed: u64,
    /// Applied, by the shards' ledgers (what their state holds).
    pub pushes_applied: u64,
    /// Acknowledged but not in the shard's ledger (lost with a crash), per worker and shard.
    pub pushes_lost: u64,
    /// In a shard's ledger but never acknowledged to a worker that lived to the end, per worker and shard
    /// (must be 0: a shard applies nothing it does not answer, and an answer is never lost here unless
    /// `loss` is set).
    pub pushes_applied_unacknowledged: u64,
    pub pushes_applied_twice: u64,
    /// Refused by a restored shard as computed on parameters it no longer has.
    pub stale_after_restore: u64,
    pub workers_final: usize,
    /// Every worker's id, in the order they started.
    pub worker_ids: Vec<u32>,
    /// Why shards refused heartbeats (a worker the shard does not know).
    pub heartbeats_refused: Vec<String>,
    pub initial_loss: f64,
    pub final_loss: f64,
    /// When each shard took each of its checkpoints (virtual time): the coordinator's cluster checkpoints
    /// and those a shard took on its own schedule ([`crate::schedule`]).
    pub checkpoints_at: Vec<Vec<Duration>>,
}

struct ShardSlot {
    cfg: ShardConfig,
    core: Option<ShardCore>,
    /// When the core started: its clock reads from there.
    started: Duration,
    newest_checkpoint: Option<Vec<u8>>,
    /// Its periodic checkpoint schedule, the service's own ([`CheckpointSchedule`]), and which start of the
    /// shard it belongs to (a timer of an earlier start is dropped).
    schedule: Option<CheckpointSchedule>,
    generation: u64,
    /// Every time it took a checkpoint.
    checkpoints_at: Vec<Duration>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Registering,
    Pulling,
    Computing,
    Pushing,
    Waiting,
    Done,
    Dead,
}

/// A request waiting for its reply: sent again after `retry_after` with the same contents.
struct Outstanding {
    tag: u64,
    frame: Frame,
}

struct Worker {
    id: u32,
    epoch: u64,
    phase: Phase,
    step: u64,
    decisions: Option<ModeDecisions>,
    params: Vec<f32>,
    versions: BTreeMap<ChunkId, u64>,
    out: BTreeMap<u32, Outstanding>,
    /// Per shard: the next sequence number, pushes acknowledged, the wait for a step an ack asked for.
    next_seq: Vec<u64>,
    acked: Vec<u64>,
    waits: BTreeMap<u32, (u64, u64)>,
    sent: u64,
    stale_after_restore: u64,
    /// When the worker began waiting for a step.
    waiting_since: Duration,
    slow: Option<(f64, Duration)>,
}

impl Worker {
    /// Keeps the newest two of the decisions known and a shard's (as the client does).
    fn learn(&mut self, decisions: &ModeDecisions) {
        match self.decisions.as_mut() {
            Some(d) => d.merge(decisions),
            None => self.decisions = Some(*decisions),
        }
    }
}

/// Copies a pull reply's chunks (`payload` in their order) into the model's values.
fn read_chunks(chunks: &[gaps_common::wire::ChunkVersion], payload: &[f32], params: &mut [f32]) {
    let mut at = 0;
    for c in chunks {
        let (start, len) = ((c.id.chunk * CHUNK) as usize, c.len as usize);
        params[start..start + len].copy_from_slice(&payload[at..at + len]);
        at += len;
    }
}

enum Event {
    Deliver { from: Node, to: Node, tag: u64, frame: Box<Frame> },
    Retry { worker: usize, shard: u32, tag: u64 },
    Computed { worker: usize, step: u64 },
    Heartbeat { worker: usize },
    Tick,
    Checkpoint { shard: u32, generation: u64 },
    Fault(Fault),
}

/// The cluster (see the module's documentation).
pub struct Cluster {
    spec: Spec,
    now: Duration,
    rng: Rng,
    shards: Vec<ShardSlot>,
    workers: Vec<Worker>,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    events: BTreeMap<u64, Event>,
    order: u64,
    cut: BTreeSet<(Node, Node)>,
    target: Vec<f32>,
    unconfirmed: u64,
    checkpoints: u64,
    heartbeats_refused: Vec<String>,
}

impl Cluster {
    /// Shards joined to the coordinator and `spec.workers` workers registering at time 0.
    pub fn new(spec: Spec) -> Result<Self, String> {
        let mut shards = Vec::new();
        for s in 0..spec.shards {
            shards.push(ShardSlot {
                cfg: spec.shard_config(s),
                core: None,
                started: Duration::ZERO,
                newest_checkpoint: None,
                schedule: None,
                generation: 0,
                checkpoints_at: Vec::new(),
            });
        }
        let target = (0..spec.params).map(|i| 0.5 + 0.1 * (i % 7) as f32).collect();
        let mut cluster = Cluster {
            rng: Rng::new(spec.seed),
            now: Duration::ZERO,
            shards,
            workers: Vec::new(),
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            order: 0,
            cut: BTreeSet::new(),
            target,
            unconfirmed: 0,
            checkpoints: 0,
            heartbeats_refused: Vec::new(),
            spec,
        };
        for s in 0..cluster.spec.shards {
            cluster.start_shard(s, None)?;
        }
        for _ in 0..cluster.spec.workers {
            cluster.add_worker();
        }
        cluster.schedule(Duration::from_millis(100), Event::Tick);
        Ok(cluster)
    }

    /// `fault` happens `at` (virtual time from the start).
    pub fn at(&mut self, at: Duration, fault: Fault) {
        self.schedule(at.saturating_sub(self.now), Event::Fault(fault));
    }

    /// Runs until every live worker has trained its steps and left, or `limit` of virtual time passed (an
    /// error naming where the workers are). Restarts every shard still down at the end first.
    pub fn run(mut self, limit: Duration) -> Result<Report, String> {
        let initial_loss = self.loss_of(&vec![0.0; self.target.len()]);
        while self.workers.iter().any(|w| !matches!(w.phase, Phase::Done | Phase::Dead)) {
            let Some(Reverse((at, key))) = self.queue.pop() else { return Err("nothing left to happen".into()) };
            if at > limit {
                let phases: Vec<_> = self.workers.iter().map(|w| (w.step, w.phase)).collect();
                return Err(format!("not finished after {limit:?}: workers (step, phase) {phases:?}"));
            }
            self.now = at;
            let event = self.events.remove(&key).expect("every queued key has its event");
            self.happen(event)?;
        }
        for s in 0..self.spec.shards {
            if self.shards[s as usize].core.is_none() {
                self.restart_shard(s)?;
            }
        }
        self.report(initial_loss)
    }

    fn schedule(&mut self, after: Duration, event: Event) {
        self.order += 1;
        self.queue.push(Reverse((self.now + after, self.order)));
        self.events.insert(self.order, event);
    }

    fn send(&mut self, from: Node, to: Node, tag: u64, frame: Frame) {
        if self.cut.contains(&(from, to)) || self.cut.contains(&(to, from)) {
            return;
        }
        if self.spec.loss > 0.0 && self.rng.uniform() < self.spec.loss {
            return;
        }
        let jitter = self.spec.jitter.as_nanos() as u64;
        let extra = if jitter > 0 { self.rng.below(jitter) } else { 0 };
        self.schedule(
            self.spec.delay + Duration::from_nanos(extra),
            Event::Deliver { from, to, tag, frame: Box::new(frame) },
        );
    }

    fn happen(&mut self, event: Event) -> Result<(), String> {
        match event {
            Event::Deliver { from, to: Node::Shard(s), tag, frame } => {
                let slot = &mut self.shards[s as usize];
                let Some(core) = slot.core.as_mut() else { return Ok(()) };
                let (reply, _) = core.handle(*frame, self.now - slot.started);
                self.send(Node::Shard(s), from, tag, reply);
            }
            // A heartbeat's answer (tag 0): only refusals are counted.
            Event::Deliver { from: Node::Shard(_), to: Node::Worker(_), tag: 0, frame } => {
                if let Message::Error(e) = frame.msg {
                    self.heartbeats_refused.push(e.message);
                }
            }
            Event::Deliver { from: Node::Shard(s), to: Node::Worker(w), tag, frame } => {
                self.on_reply(w, s, tag, *frame)?
            }
            Event::Deliver { .. } => {}
            Event::Retry { worker, shard, tag } => {
                let alive = self.workers[worker].phase != Phase::Dead;
                if let Some(o) = self.workers[worker].out.get(&shard).filter(|o| o.tag == tag && alive) {
                    let frame = o.frame.clone();
                    self.send(Node::Worker(worker), Node::Shard(shard), tag, frame);
                    self.schedule(self.spec.retry_after, Event::Retry { worker, shard, tag });
                }
            }
            Event::Computed { worker, step } => {
                if self.workers[worker].phase == Phase::Computing && self.workers[worker].step == step {
                    self.push(worker);
                }
            }
            Event::Heartbeat { worker } => {
                let w = &self.workers[worker];
                if !matches!(w.phase, Phase::Done | Phase::Dead | Phase::Registering) {
                    let id = w.id;
                    for s in 0..self.spec.shards {
                        let beat = Frame::new(Message::Heartbeat(Heartbeat { worker: id }));
                        self.send(Node::Worker(worker), Node::Shard(s), 0, beat);
                    }
                }
                if !matches!(self.workers[worker].phase, Phase::Done | Phase::Dead) {
                    self.schedule(self.spec.lease / 3, Event::Heartbeat { worker });
                }
            }
            Event::Tick => {
                for slot in &mut self.shards {
                    if let Some(core) = slot.core.as_mut() {
                        core.tick(self.now - slot.started);
                    }
                }
                self.schedule(Duration::from_millis(100), Event::Tick);
            }
            Event::Checkpoint { shard, generation } => self.scheduled_checkpoint(shard, generation)?,
            Event::Fault(fault) => self.fault(fault)?,
        }
        Ok(())
    }

    fn fault(&mut self, fault: Fault) -> Result<(), String> {
        match fault {
            Fault::KillShard(s) => self.shards[s as usize].core = None,
            Fault::RestartShard(s) => self.restart_shard(s)?,
            Fault::KillWorker(w) => {
                let worker = &mut self.workers[w];
                if !matches!(worker.phase, Phase::Done | Phase::Dead) {
                    let unanswered_pushes = worker.phase == Phase::Pushing;
                    if unanswered_pushes {
                        self.unconfirmed += worker.out.len() as u64;
                    }
                    worker.phase = Phase::Dead;
                    worker.out.clear();
                }
            }
            Fault::AddWorker => self.add_worker(),
            Fault::Slow { worker, factor, until } => {
                if let Some(w) = self.workers.get_mut(worker) {
                    w.slow = Some((factor, until));
                }
            }
            Fault::Cut(a, b) => drop(self.cut.insert((a, b))),
            Fault::Heal => self.cut.clear(),
        }
        Ok(())
    }

    fn start_shard(&mut self, s: u32, checkpoint: Option<&[u8]>) -> Result<(), String> {
        let cfg = self.shards[s as usize].cfg.clone();
        let core = match checkpoint {
            Some(bytes) => {
                let mut core = ShardCore::restore(cfg, bytes).map_err(|e| format!("restoring shard {s}: {e}"))?;
                core.restarted();
                core
            }
            None if s == 0 => ShardCore::new(cfg).map_err(|e| e.to_string())?,
            None => {
                let mut core = ShardCore::new(cfg).map_err(|e| e.to_string())?;
                let slot0 = &mut self.shards[0];
                let coordinator = slot0.core.as_mut().ok_or("shard 0 is down: nobody to join")?;
                let (reply, _) = coordinator.handle(Frame::new(core.join_request()), self.now - slot0.started);
                let Message::ClusterMap(map) = reply.msg else { return Err(format!("join refused: {:?}", reply.msg)) };
                core.joined(&map).map_err(|e| e.to_string())?;
                core
            }
        };
        let slot = &mut self.shards[s as usize];
        slot.core = Some(core);
        slot.started = self.now;
        slot.generation += 1;
        if let Some(every) = self.spec.checkpoint_every {
            let schedule = CheckpointSchedule::new(s, every, Duration::ZERO);
            let (after, generation) = (schedule.next_deadline(), slot.generation);
            slot.schedule = Some(schedule);
            self.schedule(after, Event::Checkpoint { shard: s, generation });
        }
        Ok(())
    }

    /// Shard `s`'s schedule fired: the coordinator checkpoints every shard that is up (the cluster
    /// checkpoint it asks for), another shard itself when the coordinator was silent for long enough.
    fn scheduled_checkpoint(&mut self, s: u32, generation: u64) -> Result<(), String> {
        let slot = &mut self.shards[s as usize];
        if slot.generation != generation || slot.core.is_none() {
            return Ok(()); // the shard died, or started again with a schedule of its own
        }
        let last = slot.checkpoints_at.last().map_or(Duration::ZERO, |at| at.saturating_sub(slot.started));
        let since_start = self.now - slot.started;
        let Some(schedule) = slot.schedule.as_mut() else { return Ok(()) };
        let due = schedule.poll(since_start, last);
        let next = slot.started + schedule.next_deadline();
        self.schedule(next - self.now, Event::Checkpoint { shard: s, generation });
        let shards: Vec<u32> = match due {
            Some(Due::Cluster) => (0..self.spec.shards).collect(),
            Some(Due::Own) => vec![s],
            None => return Ok(()),
        };
        self.checkpoints += 1;
        for s in shards {
            let slot = &mut self.shards[s as usize];
            if let Some(core) = slot.core.as_ref() {
                slot.newest_checkpoint = Some(core.checkpoint(self.checkpoints).map_err(|e| e.to_string())?);
                slot.checkpoints_at.push(self.now);
            }
        }
        Ok(())
    }

    fn restart_shard(&mut self, s: u32) -> Result<(), String> {
        let checkpoint = self.shards[s as usize].newest_checkpoint.clone();
        self.start_shard(s, checkpoint.as_deref())
    }

    fn add_worker(&mut self) {
        let n = self.spec.shards as usize;
        self.workers.push(Worker {
            id: 0,
            epoch: 0,
            phase: Phase::Registering,
            step: 0,
            decisions: None,
            params: vec![0.0; self.spec.params as usize],
            versions: BTreeMap::new(),
            out: BTreeMap::new(),
            next_seq: vec![1; n],
            acked: vec![0; n],
            waits: BTreeMap::new(),
            sent: 0,
            stale_after_restore: 0,
            waiting_since: Duration::ZERO,
            slow: None,
        });
        let w = self.workers.len() - 1;
        let reg = Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Worker, name: format!("w{w}") });
        self.request(w, 0, Frame::new(reg));
    }

    /// Sends `frame` to shard `s` as worker `w`'s one request there, sent again until answered.
    fn request(&mut self, w: usize, s: u32, frame: Frame) {
        self.order += 1;
        let tag = self.order;
        self.workers[w].out.insert(s, Outstanding { tag, frame: frame.clone() });
        self.send(Node::Worker(w), Node::Shard(s), tag, frame);
        self.schedule(self.spec.retry_after, Event::Retry { worker: w, shard: s, tag });
    }

    fn on_reply(&mut self, w: usize, s: u32, tag: u64, frame: Frame) -> Result<(), String> {
        let worker = &mut self.workers[w];
        if worker.out.get(&s).is_none_or(|o| o.tag != tag) || matches!(worker.phase, Phase::Done | Phase::Dead) {
            return Ok(()); // an answer to a copy sent before, or to nobody
        }
        worker.out.remove(&s);
        match (worker.phase, frame.msg) {
            (Phase::Registering, Message::ClusterMap(map)) => {
                worker.id = map.worker_id.ok_or("a worker's map carries its id")?;
                worker.epoch = map.epoch;
                self.schedule(Duration::ZERO, Event::Heartbeat { worker: w });
                self.pull(w);
            }
            (Phase::Pulling, Message::PullReply(reply)) => {
                read_chunks(&reply.chunks, &frame.payload, &mut worker.params);
                worker.versions.extend(reply.chunks.iter().map(|c| (c.id, c.version)));
                if worker.out.is_empty() {
                    self.compute(w);
                }
            }
            (Phase::Pushing, Message::Ack(ack)) => {
                worker.acked[s as usize] += 1;
                worker.learn(&ack.decisions);
                if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
                    worker.waits.insert(s, (ack.wait_for_step, ack.wait_for_clock));
                }
                if worker.out.is_empty() {
                    self.wait_or_next(w);
                }
            }
            (Phase::Waiting, Message::Stats(st)) => {
                worker.learn(&st.decisions);
                let (step, clock) = worker.waits[&s];
                // As the client: a step that does not come within three leases is an error.
                if self.now.saturating_sub(worker.waiting_since) > 3 * self.spec.lease {
                    return Err(format!("worker {w}: shard {s} did not finish step {step} within three leases"));
                }
                // Reached, or the shard went back (restored): go on.
                if (st.global_step >= step && st.ssp_min_clock >= clock) || st.global_step + 1 < step {
                    worker.waits.remove(&s);
                } else {
                    let wait = WaitStep { step, clock, max_wait_ms: 0 };
                    self.order += 1;
                    let tag = self.order;
                    let frame = Frame::new(Message::WaitStep(wait));
                    self.workers[w].out.insert(s, Outstanding { tag, frame });
                    self.schedule(Duration::from_millis(1), Event::Retry { worker: w, shard: s, tag });
                    return Ok(());
                }
                if self.workers[w].out.is_empty() {
                    self.wait_or_next(w);
                }
            }
            // A gradient computed before a shard's restore is refused and dropped, as the client does.
            (Phase::Pushing, Message::Error(e)) if e.code == ErrorCode::ReadAhead => {
                worker.stale_after_restore += 1;
                if worker.out.is_empty() {
                    self.wait_or_next(w);
                }
            }
            (_, Message::Error(e)) => {
                return Err(format!("worker {w} was refused by shard {s} in {:?}: {e:?}", worker.phase));
            }
            (phase, other) => return Err(format!("worker {w} in {phase:?} got {other:?} from shard {s}")),
        }
        Ok(())
    }

    fn pull(&mut self, w: usize) {
        self.workers[w].phase = Phase::Pulling;
        for s in 0..self.spec.shards {
            let chunks = self.shards[s as usize].cfg.layout.chunks_of_shard(s, self.spec.shards);
            let pull = Message::Pull(Pull { epoch: self.workers[w].epoch, chunks });
            self.request(w, s, Frame::new(pull));
        }
    }

    fn compute(&mut self, w: usize) {
        let base = self.spec.compute.as_secs_f64() * (0.9 + 0.2 * self.rng.uniform());
        let worker = &mut self.workers[w];
        let factor = worker.slow.filter(|(_, until)| self.now < *until).map_or(1.0, |(f, _)| f);
        worker.phase = Phase::Computing;
        let step = worker.step;
        self.schedule(Duration::from_secs_f64(base * factor), Event::Computed { worker: w, step });
    }

    fn push(&mut self, w: usize) {
        let compute_ms = (self.spec.compute.as_millis() as u32).max(1);
        let n = self.spec.shards;
        let mut frames = Vec::new();
        {
            let worker = &mut self.workers[w];
            let slow = worker.slow.filter(|(_, until)| self.now < *until).map_or(1.0, |(f, _)| f);
            for s in 0..n {
                let ids = self.shards[s as usize].cfg.layout.chunks_of_shard(s, n);
                let mut payload = Vec::new();
                let mut chunks = Vec::new();
                for id in ids {
                    let start = (id.chunk * CHUNK) as usize;
                    let len = (CHUNK as usize).min(worker.params.len() - start);
                    for i in start..start + len {
                        let noise = 0.1 * (self.rng.uniform() as f32 - 0.5);
                        payload.push(worker.params[i] - self.target[i] + noise);
                    }
                    let read_version = worker.versions.get(&id).copied().unwrap_or(0);
                    chunks.push(PushChunk::f32(id, read_version, len as u32));
                }
                let seq = worker.next_seq[s as usize];
                worker.next_seq[s as usize] += 1;
                worker.sent += 1;
                let push = Push {
                    compute_ms: (f64::from(compute_ms) * slow) as u32,
                    step: worker.step,
                    decisions: worker.decisions.unwrap_or_default(),
                    ..Push::new(worker.epoch, worker.id, seq, chunks)
                };
                frames.push((s, Frame { msg: Message::Push(push), payload }));
            }
            worker.phase = Phase::Pushing;
        }
        for (s, frame) in frames {
            self.request(w, s, frame);
        }
    }

    fn wait_or_next(&mut self, w: usize) {
        let waits: Vec<(u32, (u64, u64))> = self.workers[w].waits.iter().map(|(s, x)| (*s, *x)).collect();
        if !waits.is_empty() {
            self.workers[w].phase = Phase::Waiting;
            self.workers[w].waiting_since = self.now;
            for (s, (step, clock)) in waits {
                self.request(w, s, Frame::new(Message::WaitStep(WaitStep { step, clock, max_wait_ms: 0 })));
            }
            return;
        }
        let worker = &mut self.workers[w];
        worker.step += 1;
        if worker.step < self.spec.steps {
            self.pull(w);
            return;
        }
        worker.phase = Phase::Done;
        let id = worker.id;
        for s in 0..self.spec.shards {
            self.send(Node::Worker(w), Node::Shard(s), 0, Frame::new(Message::Leave(Leave { worker: id })));
        }
    }

    fn loss_of(&self, params: &[f32]) -> f64 {
        params.iter().zip(&self.target).map(|(w, t)| 0.5 * f64::from(w - t).powi(2)).sum()
    }

    fn report(&mut self, initial_loss: f64) -> Result<Report, String> {
        let n = self.spec.shards;
        let mut params = vec![0.0f32; self.spec.params as usize];
        let mut stats = Vec::new();
        let mut switches = Vec::new();
        for s in 0..n {
            let slot = &mut self.shards[s as usize];
            let core = slot.core.as_mut().ok_or("a shard is down at the end")?;
            let chunks = slot.cfg.layout.chunks_of_shard(s, n);
            let (reply, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: 1, chunks })), self.now - slot.started);
            let Message::PullReply(r) = reply.msg else { return Err(format!("final pull: {:?}", reply.msg)) };
            read_chunks(&r.chunks, &reply.payload, &mut params);
            stats.push(core.stats());
            switches.push(core.switches().cloned().collect());
        }
        let (mut lost, mut unacknowledged) = (0, 0);
        for (s, st) in stats.iter().enumerate() {
            for w in &self.workers {
                let applied = st.applied_by_worker.iter().find(|a| a.worker == w.id).map_or(0, |a| a.applied);
                lost += w.acked[s].saturating_sub(applied);
                if w.phase != Phase::Dead {
                    unacknowledged += applied.saturating_sub(w.acked[s]);
                }
            }
        }
        Ok(Report {
            now: self.now,
            checkpoints_at: self.shards.iter().map(|s| s.checkpoints_at.clone()).collect(),
            pushes_sent: self.workers.iter().map(|w| w.sent).sum(),
            pushes_acknowledged: self.workers.iter().map(|w| w.acked.iter().sum::<u64>()).sum(),
            pushes_unconfirmed: self.unconfirmed,
            pushes_applied: stats.iter().flat_map(|s| &s.applied_by_worker).map(|a| a.applied).sum(),
            pushes_lost: lost,
            pushes_applied_unacknowledged: unacknowledged,
            pushes_applied_twice: stats.iter().map(|s| s.pushes_applied_twice).sum(),
            stale_after_restore: self.workers.iter().map(|w| w.stale_after_restore).sum(),
            workers_final: self.workers.iter().filter(|w| w.phase == Phase::Done).count(),
            worker_ids: self.workers.iter().map(|w| w.id).collect(),
            heartbeats_refused: std::mem::take(&mut self.heartbeats_refused),
            initial_loss,
            final_loss: self.loss_of(&params),
            stats,
            switches,
        })
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let steps: Vec<u64> = self.workers.iter().map(|w| w.step).collect();
        f.debug_struct("Cluster").field("now", &self.now).field("worker_steps", &steps).finish_non_exhaustive()
    }
}
