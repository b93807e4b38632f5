//! `gaps sim`: the deterministic straggler simulator (docs/ALGORITHMS.md §1).
//!
//! N virtual workers draw their time per batch from Gamma(shape, batch/shape) (times a per-worker factor:
//! explicit straggler factors, or CVB heterogeneity); a min-heap ordered by (time, worker id) picks who
//! finishes next. Every event takes the next batch of one global shuffled order, computes the gradient on
//! the parameters that worker last received, pushes it through the real [`ShardCore`] (the same rule code
//! as `gaps-server`, with the same worker-side handling: read echo, DANA-Slim's momentum), and pulls the
//! worker's new view (θ, or the DANA look-ahead). All randomness comes from the seed, so the same flags give
//! the same output byte for byte (except `events_per_s`, a wall-clock measurement).

pub mod experiments;
pub mod profile;
pub mod sweep;
pub mod tasks;

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::config::parse_duration;
use gaps_common::dtype::WireDtype;
use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::rng::{mix, Rng};
use gaps_common::wire::{ChunkVersion, Frame, Message, Pull, Push, PushChunk};
use gaps_kernels::{Hyper, Rule};
use gaps_shard::{Init, ShardConfig, ShardCore};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tasks::Task;

/// The simulated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelChoice {
    /// Teacher–student MLP (docs/ALGORITHMS.md §7 (E1)).
    Mlp,
    /// Noisy quadratic.
    Quadratic,
    /// Logistic regression.
    Logreg,
    /// Click-through logistic regression on the synthetic Criteo data with 2^16 hashed feature buckets
    /// (metric: AUC); the bucket weights are rows of the shard's sparse table, pulled and pushed per id.
    Ctr,
    /// The same model with the bucket weights in one dense tensor (the reference of the sparse path).
    CtrDense,
}

/// How the simulated cluster trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SimMode {
    /// Every gradient is applied on arrival (the §1 event loop).
    Async,
    /// Global Batch Aggregation in the shard: one update per N gradients, stale ones dropped.
    Gba,
    /// Bounded staleness: a worker more than --ssp-bound pushes ahead of the slowest waits.
    Ssp,
    /// The shard's automatic switching: sync while no worker straggles, gba while one does.
    Auto,
    /// Global-batch synchronous SGD: each round averages one gradient per live worker, all computed on the
    /// same parameters, and applies it with the learning rate scaled linearly by the worker count; a round
    /// lasts as long as its slowest worker.
    Sync,
}

/// Flags of `gaps sim`. Every flag also reads a `GAPS_SIM_*` environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// The model to train.
    #[arg(long, env = "GAPS_SIM_MODEL", value_enum, default_value = "mlp")]
    pub model: ModelChoice,
    /// Update rule (the names of `gaps-server --rule`).
    #[arg(long, env = "GAPS_SIM_RULE", default_value = "momentum")]
    pub rule: Rule,
    /// Number of virtual workers.
    #[arg(long, env = "GAPS_SIM_WORKERS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub workers: u32,
    /// Gamma shape of the time per batch (100: near round-robin, the hard case; 1: exponential).
    #[arg(long, env = "GAPS_SIM_SHAPE", default_value_t = 100.0)]
    pub shape: f64,
    /// Seed of everything (data, initialisation, data order, timings).
    #[arg(long, env = "GAPS_SIM_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Epochs over the training set (the number of gradients does not depend on --workers).
    #[arg(long, env = "GAPS_SIM_EPOCHS", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub epochs: u32,
    /// Samples per gradient.
    #[arg(long, env = "GAPS_SIM_BATCH", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub batch: u32,
    /// Learning rate η.
    #[arg(long, env = "GAPS_SIM_LR", default_value_t = 0.05)]
    pub lr: f32,
    /// Momentum γ.
    #[arg(long, env = "GAPS_SIM_MOMENTUM", default_value_t = 0.9)]
    pub momentum: f32,
    /// Weight decay.
    #[arg(long, env = "GAPS_SIM_WEIGHT_DECAY", default_value_t = 0.0)]
    pub weight_decay: f32,
    /// DC-ASGD / DANA-DC λ.
    #[arg(long, env = "GAPS_SIM_DC_LAMBDA", default_value_t = 2.0)]
    pub dc_lambda: f32,
    /// Per-iteration linear warm-up from η/N to η over this many epochs.
    #[arg(long, env = "GAPS_SIM_WARMUP_EPOCHS", default_value_t = 2.0)]
    pub warmup_epochs: f64,
    /// Fractions of training after which η is multiplied by 0.1 (empty: constant η).
    #[arg(long, env = "GAPS_SIM_LR_DECAY_AT", value_delimiter = ',', default_value = "0.5,0.75")]
    pub lr_decay_at: Vec<f64>,
    /// Keep η constant after the warm-up (ignore --lr-decay-at).
    #[arg(long, env = "GAPS_SIM_NO_LR_DECAY")]
    pub no_lr_decay: bool,
    /// A straggler: `WORKER:FACTOR` makes that worker FACTOR times slower (repeatable).
    #[arg(long = "straggler", env = "GAPS_SIM_STRAGGLERS", value_delimiter = ',', value_parser = parse_straggler)]
    pub stragglers: Vec<(u32, f64)>,
    /// Machine heterogeneity V (CVB model): each worker's mean speed is drawn from Gamma(1/V², V²); 0 = homogeneous.
    #[arg(long, env = "GAPS_SIM_HETEROGENEITY", default_value_t = 0.0)]
    pub heterogeneity: f64,
    /// Training samples (mlp and logreg).
    #[arg(long, env = "GAPS_SIM_TRAIN", default_value_t = 16_384)]
    pub train: u32,
    /// Test samples (mlp and logreg).
    #[arg(long, env = "GAPS_SIM_TEST", default_value_t = 4096)]
    pub test: u32,
    /// Training mode.
    #[arg(long, env = "GAPS_SIM_MODE", value_enum, default_value = "async")]
    pub mode: SimMode,
    /// Elastic worker counts (sync mode): `A,B` alternates between A and B workers every --elastic-every epochs.
    #[arg(long, env = "GAPS_SIM_ELASTIC", value_delimiter = ',')]
    pub elastic: Vec<u32>,
    /// Epochs between worker-count changes.
    #[arg(long, env = "GAPS_SIM_ELASTIC_EVERY", default_value_t = 2)]
    pub elastic_every: u32,
    /// When the worker count changes by k = new/old, the learning-rate multiplier moves linearly to its new
    /// value over this many rounds (Dynamic mini-batch SGD); -1 = 8·k rounds when growing, immediate when
    /// shrinking; 0 = immediate.
    #[arg(long, env = "GAPS_SIM_LR_RAMP_STEPS", default_value_t = -1, allow_negative_numbers = true)]
    pub lr_ramp_steps: i64,
    /// GBA: gradients more than this many steps stale are dropped.
    #[arg(long, env = "GAPS_SIM_GBA_THRESHOLD", default_value_t = 4)]
    pub gba_threshold: u64,
    /// GBA (`--mode gba`): a worker whose gradient left the step short waits for the step while the missing
    /// gradients are due within this fraction of its own step time, as the server's `--gba-hold` does.
    #[arg(long, env = "GAPS_SIM_GBA_HOLD", default_value_t = 0.5)]
    pub gba_hold: f64,
    /// SSP: pushes a worker may run ahead of the slowest.
    #[arg(long, env = "GAPS_SIM_SSP_BOUND", default_value_t = 3)]
    pub ssp_bound: u64,
    /// In sync, gba and auto, multiply η by the worker count (linear scaling for the global batch).
    #[arg(long, env = "GAPS_SIM_LINEAR_SCALING", default_value_t = true, action = clap::ArgAction::Set)]
    pub linear_scaling: bool,
    /// Kill worker W at simulated time T: `W@T` (repeatable).
    #[arg(long = "kill-worker", env = "GAPS_SIM_KILL_WORKERS", value_delimiter = ',', value_parser = parse_kill)]
    pub kill_workers: Vec<(u32, f64)>,
    /// Add one worker at simulated time T (repeatable).
    #[arg(long = "add-worker", env = "GAPS_SIM_ADD_WORKERS", value_delimiter = ',')]
    pub add_workers: Vec<f64>,
    /// Write a per-event CSV log here.
    #[arg(long, env = "GAPS_SIM_CSV")]
    pub csv: Option<PathBuf>,
    /// Stop after this much real time (a guard for interactive use).
    #[arg(long, env = "GAPS_SIM_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    pub timeout: Duration,
    /// How pushed gradients (with their read echo) travel: f32, or rounded to bf16 / f16 on the wire (the
    /// shard keeps f32), to measure what a 16-bit wire does to convergence.
    #[arg(long, env = "GAPS_SIM_PUSH_DTYPE", default_value = "f32")]
    pub push_dtype: WireDtype,
    /// How pulled parameters travel (see --push-dtype).
    #[arg(long, env = "GAPS_SIM_PULL_DTYPE", default_value = "f32")]
    pub pull_dtype: WireDtype,
    /// Replay a measured straggler profile instead of the Gamma model: a step log (`worker,seconds` per
    /// line, as `gaps-worker --step-log` writes). Simulated worker w draws each batch's time from profiled
    /// worker w mod K; --straggler and --heterogeneity still multiply it; times are then in seconds.
    #[arg(long, env = "GAPS_SIM_PROFILE")]
    pub profile: Option<PathBuf>,
    /// Evaluate the test metric this many times per epoch (the curve and --target need it; 0: only at the end).
    #[arg(long, env = "GAPS_SIM_EVALS_PER_EPOCH", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub evals_per_epoch: u32,
    /// Report the simulated time at which the test metric first reaches this value (at or above it for
    /// accuracy and AUC, at or below it for the quadratic's loss); implies 2 evaluations per epoch unless
    /// --evals-per-epoch says otherwise.
    #[arg(long, env = "GAPS_SIM_TARGET")]
    pub target: Option<f64>,
    /// End with one JSON line on stdout.
    #[arg(long, env = "GAPS_JSON")]
    pub json: bool,
}

/// Parses `W@T` (T in simulated time units).
fn parse_kill(text: &str) -> Result<(u32, f64), String> {
    let (w, t) = text.split_once('@').ok_or_else(|| format!("{text:?}: expected W@T, e.g. 2@5000"))?;
    let w = w.trim().parse().map_err(|_| format!("{text:?}: {w:?} is not a worker index"))?;
    let t: f64 = t.trim().parse().map_err(|_| format!("{text:?}: {t:?} is not a time"))?;
    if !(t.is_finite() && t >= 0.0) {
        return Err(format!("{text:?}: the time must be ≥ 0"));
    }
    Ok((w, t))
}

/// Parses `WORKER:FACTOR` ([`gaps_common::config::parse_straggler`]'s grammar; a simulated straggler lasts
/// the whole run, so an end time is refused).
pub(crate) fn parse_straggler(text: &str) -> Result<(u32, f64), String> {
    match gaps_common::config::parse_straggler(text)? {
        (w, f, None) => Ok((w, f)),
        (_, _, Some(t)) => {
            Err(format!("{text:?}: a simulated straggler lasts the whole run (no end time {t:?}); use W:F"))
        }
    }
}

impl SimArgs {
    /// Defaults of every flag (for experiments and tests).
    pub fn defaults() -> Self {
        SimArgs {
            model: ModelChoice::Mlp,
            rule: Rule::Momentum,
            workers: 8,
            shape: 100.0,
            seed: 1,
            epochs: 20,
            batch: 32,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            dc_lambda: 2.0,
            warmup_epochs: 2.0,
            lr_decay_at: vec![0.5, 0.75],
            no_lr_decay: false,
            stragglers: Vec::new(),
            heterogeneity: 0.0,
            train: 16_384,
            test: 4096,
            mode: SimMode::Async,
            gba_threshold: 4,
            gba_hold: 0.5,
            ssp_bound: 3,
            linear_scaling: true,
            kill_workers: Vec::new(),
            add_workers: Vec::new(),
            elastic: Vec::new(),
            elastic_every: 2,
            lr_ramp_steps: -1,
            csv: None,
            timeout: Duration::from_secs(3600),
            push_dtype: WireDtype::F32,
            pull_dtype: WireDtype::F32,
            profile: None,
            evals_per_epoch: 0,
            target: None,
            json: false,
        }
    }

    /// Evaluations per epoch in effect (--target alone asks for 2).
    pub fn evals(&self) -> u32 {
        if self.evals_per_epoch == 0 && self.target.is_some() {
            2
        } else {
            self.evals_per_epoch
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if !(self.shape.is_finite() && self.shape > 0.0) {
            bail!("--shape must be positive, got {}", self.shape);
        }
        if !(self.heterogeneity.is_finite() && self.heterogeneity >= 0.0) {
            bail!("--heterogeneity must be ≥ 0, got {}", self.heterogeneity);
        }
        if !(self.warmup_epochs.is_finite() && self.warmup_epochs >= 0.0) {
            bail!("--warmup-epochs must be ≥ 0");
        }
        if let Some(bad) = self.lr_decay_at.iter().find(|f| !(0.0..=1.0).contains(*f)) {
            bail!("--lr-decay-at fractions must be in [0, 1], got {bad}");
        }
        let all = self.workers as usize + self.add_workers.len();
        if let Some((w, _)) = self.kill_workers.iter().find(|(w, _)| *w as usize >= all) {
            bail!("--kill-worker names worker {w}, but only {all} workers ever run");
        }
        if !self.kill_workers.is_empty() || !self.add_workers.is_empty() {
            if self.mode == SimMode::Sync {
                bail!("--kill-worker and --add-worker need an event-driven mode (async, gba, ssp or auto); sync resizes with --elastic");
            }
            if let Some(t) = self.add_workers.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
                bail!("--add-worker time must be ≥ 0, got {t}");
            }
        }
        if let Some((w, _)) = self.stragglers.iter().find(|(w, _)| *w >= self.workers) {
            bail!("--straggler names worker {w}, but there are only {} workers", self.workers);
        }
        if !self.elastic.is_empty() {
            if self.mode != SimMode::Sync {
                bail!("--elastic needs --mode sync");
            }
            if self.elastic.contains(&0) || self.elastic_every == 0 {
                bail!("--elastic worker counts and --elastic-every must be positive");
            }
        }
        if let Some(t) = self.target.filter(|t| !t.is_finite()) {
            bail!("--target must be a finite number, got {t}");
        }
        if self.batch > self.train {
            bail!("--batch {} is larger than the training set ({})", self.batch, self.train);
        }
        Ok(())
    }

    pub(crate) fn task(&self) -> Box<dyn Task> {
        match self.model {
            ModelChoice::Mlp => Box::new(tasks::Mlp::new(self.seed, self.train as usize, self.test as usize)),
            ModelChoice::Quadratic => Box::new(tasks::Quadratic::new(100, 0.5, self.seed, self.train as usize)),
            ModelChoice::Logreg => Box::new(tasks::Logreg::new(self.seed, self.train as usize, self.test as usize)),
            ModelChoice::Ctr => Box::new(tasks::Ctr::new(self.seed, self.train as usize, self.test as usize)),
            ModelChoice::CtrDense => Box::new(tasks::Ctr::dense(self.seed, self.train as usize, self.test as usize)),
        }
    }
}

/// The outcome of one simulation; its JSON line (`--json`) is this struct without the parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimReport {
    /// Rule name.
    pub rule: String,
    /// Model name.
    pub model: String,
    /// Workers.
    pub workers: u32,
    /// Gamma shape.
    pub shape: f64,
    /// Seed.
    pub seed: u64,
    /// Test accuracy % (mlp, logreg) or final loss (quadratic), at the master parameters.
    pub final_test_metric: f64,
    /// Mean training loss over the whole training set at the end.
    pub final_train_loss: f64,
    /// Mean training loss over the whole training set at the initial parameters.
    pub initial_train_loss: f64,
    /// True when a loss or parameter became non-finite (the run stopped there) or the final training loss
    /// is above the initial one.
    pub diverged: bool,
    /// Mean staleness τ over pushes.
    pub staleness_mean: f64,
    /// 99th percentile of τ.
    pub staleness_p99: u64,
    /// Mean over pushes of the mean |θ_master − θ_read| (the gap Gap-Aware penalises).
    pub gap_mean: f64,
    /// Simulated time at the last event (time units: one batch takes `batch` units on average).
    pub sim_wall_time: f64,
    /// Events (gradients applied).
    pub events: u64,
    /// Events per real second (rounded in the JSON line).
    #[serde(serialize_with = "whole")]
    pub events_per_s: f64,
    /// The master parameters at the end (not in the JSON line).
    #[serde(skip)]
    pub params: Vec<f32>,
    /// What a worker would pull at the end when it differs from `params` (the DANA look-ahead; not in the
    /// JSON line).
    #[serde(skip)]
    pub lookahead: Option<Vec<f32>>,
    /// Mode switches of the shard (auto).
    pub mode_switches: u64,
    /// Synchronous steps applied by the shard.
    pub steps_sync: u64,
    /// GBA steps applied by the shard.
    pub steps_gba: u64,
    /// Gradients dropped as too stale.
    pub dropped_stale: u64,
    /// Live workers at the end.
    pub workers_final: u32,
    /// The shard's learning-rate multiplier of the last update.
    pub lr_multiplier_final: f64,
    /// The test metric during training (--evals-per-epoch), ending with the final evaluation.
    pub curve: Vec<CurvePoint>,
    /// Simulated time at which the metric first reached --target (None: never, or no target).
    pub time_to_target: Option<f64>,
    /// Unit of the simulated times: "units" (the Gamma model: a batch takes --batch units on average) or
    /// "seconds" (a replayed --profile).
    pub time_unit: &'static str,
}

/// The simulated time of the first point of `curve` at the target: at or above it when a larger metric is
/// better, at or below it otherwise.
pub fn time_to_reach(curve: &[CurvePoint], target: f64, higher_is_better: bool) -> Option<f64> {
    let reached = |m: f64| if higher_is_better { m >= target } else { m <= target };
    curve.iter().find(|c| reached(c.metric)).map(|c| c.time)
}

/// Serializes a number rounded to a whole one.
fn whole<S: serde::Serializer>(x: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(x.round())
}

/// One evaluation of the test metric during a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CurvePoint {
    /// Epochs of gradients computed so far.
    pub epoch: f64,
    /// Simulated time.
    pub time: f64,
    /// The test metric at the master parameters.
    pub metric: f64,
}

impl SimReport {
    /// The JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\":\"the report did not encode: {e}\"}}"))
    }
}

/// A worker's next finishing time; the heap pops the earliest, ties broken by worker id.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Due {
    time: f64,
    worker: u32,
}

impl Eq for Due {}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed, so that BinaryHeap (a max-heap) pops the earliest.
        other.time.total_cmp(&self.time).then_with(|| other.worker.cmp(&self.worker))
    }
}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// What a virtual worker holds: the values it last received, their version, and (DANA-Slim) its momentum.
struct VirtualWorker {
    view: Vec<f32>,
    version: u64,
    momentum: Vec<f32>,
    seq: u64,
    /// Multiplies the mean time per batch.
    slowness: f64,
    /// The duration of the batch it is computing now.
    duration: f64,
    /// False once killed.
    alive: bool,
    /// Steps pushed.
    steps: u64,
    /// Embedding tasks: the batch this worker computes now, its rows and their versions when pulled.
    batch: Vec<u32>,
    rows: Vec<u64>,
    row_versions: Vec<u32>,
}

impl VirtualWorker {
    /// Takes the parameters for the next batch: the dense part, and for an embedding task the next batch and
    /// its rows.
    fn refresh(
        &mut self,
        core: &mut ShardCore,
        task: &dyn Task,
        batches: &mut Option<Batches>,
        wire: WireDtype,
    ) -> Result<()> {
        if let Some(b) = batches.as_mut() {
            self.batch = b.next();
            self.rows = task.batch_rows(&self.batch);
        }
        let (view, version, versions) = pull_view(core, task, wire, &self.rows)?;
        self.view = view;
        self.version = version;
        self.row_versions = versions;
        Ok(())
    }
}

const CHUNK: ChunkId = ChunkId { tensor: 0, chunk: 0 };

fn pull(core: &mut ShardCore, wire: WireDtype) -> Result<(Vec<f32>, u64)> {
    let (reply, _) = core.handle(Frame::new(Message::Pull(Pull { epoch: 1, chunks: vec![CHUNK] })), Duration::ZERO);
    match reply.msg {
        Message::PullReply(r) => {
            let version = r.chunks.first().map_or(0, |c: &ChunkVersion| c.version);
            let mut values = reply.payload;
            gaps_common::dtype::round_trip(wire, &mut values);
            Ok((values, version))
        }
        other => Err(anyhow!("the shard refused a pull: {other:?}")),
    }
}

/// An embedding task's worker view: the dense part pulled, and the rows of `ids` pulled (created) from
/// table 0 into their places; the other rows stay 0 (never read: the batch touches only `ids`). Returns
/// (values of every parameter, dense version, the rows' versions).
fn pull_view(core: &mut ShardCore, task: &dyn Task, wire: WireDtype, ids: &[u64]) -> Result<(Vec<f32>, u64, Vec<u32>)> {
    let rows = task.sparse_rows();
    let (dense, version) = pull(core, wire)?;
    if rows == 0 {
        return Ok((dense, version, Vec::new()));
    }
    let mut view = vec![0.0f32; task.num_params()];
    view[rows..].copy_from_slice(&dense);
    let versions = pull_rows_into(core, wire, ids, &mut view)?;
    Ok((view, version, versions))
}

/// Pulls (creating) the rows of `ids` into their places in `view`; returns their versions.
fn pull_rows_into(core: &mut ShardCore, wire: WireDtype, ids: &[u64], view: &mut [f32]) -> Result<Vec<u32>> {
    let (values, versions) = sparse_pull(core, ids, true, wire)?;
    for (id, v) in ids.iter().zip(values) {
        view[*id as usize] = v;
    }
    Ok(versions)
}

/// Pulls rows of dim 1 of table 0: (values, versions).
fn sparse_pull(core: &mut ShardCore, ids: &[u64], create: bool, wire: WireDtype) -> Result<(Vec<f32>, Vec<u32>)> {
    let mut words = Vec::with_capacity(2 * ids.len());
    gaps_common::wire::ids_to_words(ids, &mut words);
    let req = gaps_common::wire::SparsePull { epoch: 1, table: 0, count: ids.len() as u32, create };
    let (reply, _) = core.handle(Frame { msg: Message::SparsePull(req), payload: words }, Duration::ZERO);
    match reply.msg {
        Message::SparsePullReply(r) if r.dim == 1 && reply.payload.len() == 2 * ids.len() => {
            let versions = reply.payload[..ids.len()].iter().map(|w| w.to_bits()).collect();
            let mut values = reply.payload[ids.len()..].to_vec();
            gaps_common::dtype::round_trip(wire, &mut values);
            Ok((values, versions))
        }
        other => Err(anyhow!("the shard refused a sparse pull: {other:?}")),
    }
}

/// Every parameter at the shard: the rows of an embedding task read without creating them, then the dense
/// part.
fn master_params(core: &mut ShardCore, task: &dyn Task) -> Result<Vec<f32>> {
    let rows = task.sparse_rows();
    let dense = core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?.to_vec();
    if rows == 0 {
        return Ok(dense);
    }
    let ids: Vec<u64> = (0..rows as u64).collect();
    let (mut all, _) = sparse_pull(core, &ids, false, WireDtype::F32)?;
    all.extend_from_slice(&dense);
    Ok(all)
}

/// The rows' part of one step of an embedding task: a sparse push of the gradients of `ids` (the batch's
/// rows, read at `versions`) before the dense push. Returns false when the shard found a non-finite value.
#[allow(clippy::too_many_arguments)]
fn push_rows(
    core: &mut ShardCore,
    worker: u32,
    seq: u64,
    ids: &[u64],
    versions: &[u32],
    grad: &[f32],
    view: &[f32],
    echo: bool,
    wire: WireDtype,
) -> Result<bool> {
    let mut payload = Vec::with_capacity(3 * ids.len() + 2 * ids.len());
    gaps_common::wire::ids_to_words(ids, &mut payload);
    payload.extend(versions.iter().map(|v| f32::from_bits(*v)));
    let mut grads: Vec<f32> = ids.iter().map(|id| grad[*id as usize]).collect();
    gaps_common::dtype::round_trip(wire, &mut grads);
    payload.extend_from_slice(&grads);
    if echo {
        payload.extend(ids.iter().map(|id| view[*id as usize]));
    }
    let req = gaps_common::wire::SparsePush {
        epoch: 1,
        worker,
        seq,
        table: 0,
        count: ids.len() as u32,
        dim: 1,
        echo_read: echo,
    };
    let (reply, _) = core.handle(Frame { msg: Message::SparsePush(req), payload }, Duration::ZERO);
    match reply.msg {
        Message::Ack(_) => Ok(true),
        Message::Error(e) if e.code == gaps_common::ErrorCode::NonFinite => Ok(false),
        other => Err(anyhow!("the shard refused a sparse push: {other:?}")),
    }
}

/// The batches of an embedding task, taken when a worker starts one (it pulls exactly the batch's rows):
/// consecutive slices of a seeded permutation, reshuffled at the end of each pass.
struct Batches {
    order: Vec<u32>,
    used: usize,
    batch: usize,
    rng: Rng,
}

impl Batches {
    fn new(seed: u64, train: usize, batch: usize) -> Self {
        let mut rng = Rng::new(mix(seed, 0x5ba7));
        Batches { order: rng.permutation(train), used: 0, batch, rng }
    }

    fn next(&mut self) -> Vec<u32> {
        if self.used + self.batch > self.order.len() {
            self.order = self.rng.permutation(self.order.len());
            self.used = 0;
        }
        self.used += self.batch;
        self.order[self.used - self.batch..self.used].to_vec()
    }
}

/// How long each batch takes: the Gamma model, or draws from a replayed profile.
struct Durations {
    shape: f64,
    /// Gamma scale before the worker's slowness: batch / shape.
    scale: f64,
    profile: Option<profile::Profile>,
}

impl Durations {
    fn new(args: &SimArgs) -> Result<Self> {
        let profile = args.profile.as_deref().map(profile::Profile::load).transpose()?;
        Ok(Durations { shape: args.shape, scale: f64::from(args.batch) / args.shape, profile })
    }

    /// The next batch time of the worker in `slot` whose speed is divided by `slowness`.
    fn draw(&self, rng: &mut Rng, slot: usize, slowness: f64) -> f64 {
        match &self.profile {
            Some(p) => p.draw(slot, rng) * slowness,
            None => rng.gamma(self.shape, self.scale * slowness),
        }
    }

    /// Milliseconds of a simulated duration as a worker reports it: a replayed profile is in seconds, the
    /// Gamma model's units count as milliseconds.
    fn millis(&self, t: f64) -> f64 {
        if self.profile.is_some() {
            t * 1000.0
        } else {
            t
        }
    }

    /// The shard's clock at simulated time `t` (units as milliseconds, a profile's seconds as seconds).
    fn clock(&self, t: f64) -> Duration {
        Duration::from_secs_f64((self.millis(t) / 1000.0).clamp(0.0, 1e12))
    }

    /// The simulated time at the shard's clock `d` (the inverse of [`Self::clock`]).
    fn time_at_clock(&self, d: Duration) -> f64 {
        if self.profile.is_some() {
            d.as_secs_f64()
        } else {
            d.as_secs_f64() * 1000.0
        }
    }

    fn unit(&self) -> &'static str {
        if self.profile.is_some() {
            "seconds"
        } else {
            "units"
        }
    }
}

/// Evaluates the test metric every `every` gradients (--evals-per-epoch).
struct Evaluator {
    every: u64,
    next: u64,
    batches_per_epoch: u64,
    curve: Vec<CurvePoint>,
}

impl Evaluator {
    fn new(args: &SimArgs, batches_per_epoch: usize) -> Self {
        let every = match args.evals() {
            0 => 0,
            k => (batches_per_epoch as u64 / u64::from(k)).max(1),
        };
        Evaluator { every, next: every, batches_per_epoch: batches_per_epoch.max(1) as u64, curve: Vec::new() }
    }

    /// Called after `gradients` gradients in all, at simulated time `now`.
    fn after(&mut self, gradients: u64, now: f64, task: &dyn Task, core: &mut ShardCore) -> Result<()> {
        if self.every == 0 || gradients < self.next {
            return Ok(());
        }
        let params = master_params(core, task)?;
        let metric = if params.iter().all(|v| v.is_finite()) { task.test_metric(&params) } else { f64::NAN };
        self.curve.push(CurvePoint { epoch: gradients as f64 / self.batches_per_epoch as f64, time: now, metric });
        while self.next <= gradients {
            self.next += self.every;
        }
        Ok(())
    }
}

/// Runs one simulation.
pub fn run(args: &SimArgs) -> Result<SimReport> {
    args.validate()?;
    match args.mode {
        SimMode::Sync => run_sync(args),
        _ => run_async(args),
    }
}

/// The shard and the task of a run, initialised.
fn setup(args: &SimArgs) -> Result<(Box<dyn Task>, ShardCore, Hyper)> {
    let task = args.task();
    let p = task.num_params();
    let hyper = Hyper {
        lr: args.lr,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
        dc_lambda: args.dc_lambda,
        dc_ms_decay: 0.95,
    };
    hyper.validate()?;
    let rows = task.sparse_rows();
    let dense = (p - rows) as u64;
    let tables = if rows > 0 {
        let l = args.rule.layout();
        if l.worker_planes > 0 || l.lookahead || l.worker_momentum {
            bail!(
                "--model {} keeps its embeddings in a sparse table, whose rule keeps no per-worker state and no \
                 look-ahead; {} does (use sgd, momentum, nesterov, staleness-aware, dc-asgd, gap-aware, adagrad or adam)",
                task.name(),
                args.rule
            );
        }
        vec![gaps_common::layout::SparseSpec::new(format!("{}.rows", task.name()), 1)]
    } else {
        Vec::new()
    };
    let layout = Layout::with_tables(vec![TensorSpec::new(task.name(), dense)], dense as u32, tables)?;
    let mut core = ShardCore::new(ShardConfig {
        shard: 0,
        num_shards: 1,
        layout,
        rule: args.rule,
        hyper,
        init: Init { seed: args.seed, std: 0.0 },
        lease: Duration::from_secs(1 << 30),
        advertise: "simulator".into(),
        epoch: 1,
        threads: 1,
        // Embedding rows: the same rule and hyper-parameters as the dense part, initialised as the task's
        // init does (0) and with Adagrad's accumulator starting at 0 (the dense rule's).
        sparse: gaps_shard::core::SparseSettings {
            rule: args.rule,
            hyper,
            init_std: 0.0,
            adagrad_init: 0.0,
            ..gaps_shard::core::SparseSettings::default()
        },
        modes: gaps_shard::modes::ModeConfig {
            mode: match args.mode {
                SimMode::Async => gaps_shard::modes::Mode::Async,
                SimMode::Sync => gaps_shard::modes::Mode::Sync,
                SimMode::Gba => gaps_shard::modes::Mode::Gba,
                SimMode::Ssp => gaps_shard::modes::Mode::Ssp,
                SimMode::Auto => gaps_shard::modes::Mode::Auto,
            },
            gba_threshold: args.gba_threshold,
            gba_hold: args.gba_hold,
            ssp_bound: args.ssp_bound,
            lr_ramp_steps: u64::try_from(args.lr_ramp_steps).ok(),
            ..gaps_shard::modes::ModeConfig::default()
        },
    })
    .map_err(|e| anyhow!("configuring the shard: {e}"))?;
    core.overwrite(CHUNK, &task.init(args.seed)[rows..]).map_err(|e| anyhow!("initialising: {e}"))?;
    Ok((task, core, hyper))
}

fn open_csv(args: &SimArgs) -> Result<Option<std::io::BufWriter<std::fs::File>>> {
    match &args.csv {
        Some(path) => {
            let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
            let mut w = std::io::BufWriter::new(file);
            writeln!(w, "event,epoch,sim_time,worker,staleness,loss,lr,gap")?;
            Ok(Some(w))
        }
        None => Ok(None),
    }
}

/// The training length and the learning-rate schedule's turning points, in gradients.
struct Schedule {
    batches_per_epoch: usize,
    /// Gradients in the whole run.
    total: u64,
    /// Gradients of warm-up.
    warmup: u64,
    /// Gradients after which η is multiplied by 0.1.
    decays: Vec<u64>,
}

impl Schedule {
    fn new(args: &SimArgs, task: &dyn Task) -> Self {
        let batches_per_epoch = task.train_size() / args.batch as usize;
        let total = batches_per_epoch as u64 * u64::from(args.epochs);
        let warmup = (args.warmup_epochs * batches_per_epoch as f64) as u64;
        let decays = if args.no_lr_decay {
            Vec::new()
        } else {
            args.lr_decay_at.iter().map(|f| (f * total as f64) as u64).collect()
        };
        Schedule { batches_per_epoch, total, warmup, decays }
    }
}

/// Learning-rate multiplier of the schedule: warm-up from `start` to 1 over `warmup` steps, ×0.1 at each decay.
fn schedule(step: u64, warmup: u64, start: f64, decays: &[u64]) -> f64 {
    let warm = if step < warmup { start + (1.0 - start) * step as f64 / warmup as f64 } else { 1.0 };
    warm * 0.1f64.powi(decays.iter().filter(|d| step >= **d).count() as i32)
}

/// A worker that must wait (sync step, SSP bound) before starting its next batch.
struct Blocked {
    worker: usize,
    /// The shard's global step to wait for (synchronous modes).
    step: u64,
    clock: u64,
    /// The duration of its next batch, drawn when it was popped (so the draw order never depends on waits).
    duration: f64,
    /// GBA's hold: goes on at this simulated time if the step has not come by then.
    until: Option<f64>,
}

/// Registers one virtual worker with the shard and returns its id.
fn register(core: &mut ShardCore) -> Result<u32> {
    let reg = gaps_common::wire::Register {
        protocol: gaps_common::wire::PROTOCOL_VERSION,
        role: gaps_common::wire::Role::Worker,
        name: "sim".into(),
    };
    match core.handle(Frame::new(Message::Register(reg)), Duration::ZERO).0.msg {
        Message::ClusterMap(map) => map.worker_id.ok_or_else(|| anyhow!("the shard gave no worker id")),
        other => Err(anyhow!("the shard refused a registration: {other:?}")),
    }
}

fn run_async(args: &SimArgs) -> Result<SimReport> {
    let (task, mut core, hyper) = setup(args)?;
    let initial_loss = task.evaluate(&master_params(&mut core, task.as_ref())?).1;
    let p = task.num_params();
    let n = args.workers as usize;
    let mut timing = Rng::new(mix(args.seed, 0x71e));
    let mut order_rng = Rng::new(mix(args.seed, 0x0d3));
    let durations = Durations::new(args)?;
    let rows = task.sparse_rows();
    let mut batches = (rows > 0).then(|| Batches::new(args.seed, task.train_size(), args.batch as usize));
    let (view, version) = pull(&mut core, args.pull_dtype)?;
    let new_worker = |w: usize, timing: &mut Rng, view: &[f32], version: u64| {
        let mut slowness = args.stragglers.iter().filter(|(s, _)| *s as usize == w).map(|(_, f)| *f).product::<f64>();
        if args.heterogeneity > 0.0 {
            let v2 = args.heterogeneity * args.heterogeneity;
            slowness *= timing.gamma(1.0 / v2, v2);
        }
        VirtualWorker {
            view: view.to_vec(),
            version,
            momentum: vec![0.0; p],
            seq: 0,
            slowness,
            duration: 0.0,
            alive: true,
            steps: 0,
            batch: Vec::new(),
            rows: Vec::new(),
            row_versions: Vec::new(),
        }
    };
    let mut workers: Vec<VirtualWorker> = (0..n).map(|w| new_worker(w, &mut timing, &view, version)).collect();
    for _ in 0..n {
        register(&mut core)?;
    }
    if batches.is_some() {
        for vw in &mut workers {
            vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
        }
    }
    let mut heap = BinaryHeap::with_capacity(n);
    for (w, vw) in workers.iter_mut().enumerate() {
        vw.duration = durations.draw(&mut timing, w, vw.slowness);
        heap.push(Due { time: vw.duration, worker: w as u32 });
    }
    let mut kills = args.kill_workers.clone();
    let mut adds = args.add_workers.clone();
    let mut blocked: Vec<Blocked> = Vec::new();
    let scaled = matches!(args.mode, SimMode::Gba | SimMode::Auto) && args.linear_scaling;
    anyhow::ensure!((0.0..=1.0).contains(&args.gba_hold), "--gba-hold must be between 0 and 1");
    let holds = args.mode == SimMode::Gba && args.gba_hold > 0.0;

    let Schedule { batches_per_epoch, total, warmup, decays } = Schedule::new(args, task.as_ref());
    let needs_read = args.rule.layout().needs_read;
    let worker_momentum = args.rule.layout().worker_momentum;
    let mut csv = open_csv(args)?;
    let mut evaluator = Evaluator::new(args, batches_per_epoch);

    let started = Instant::now();
    let mut grad = vec![0.0f32; p];
    let mut order = order_rng.permutation(task.train_size());
    let mut staleness: Vec<u32> = Vec::with_capacity(total as usize);
    let (mut gap_sum, mut now, mut diverged, mut events) = (0.0f64, 0.0f64, false, 0u64);
    for event in 0..total {
        if event % 256 == 0 && started.elapsed() > args.timeout {
            bail!("the simulation ran past --timeout {:?} at event {event} of {total}", args.timeout);
        }
        let epoch = event / batches_per_epoch as u64;
        let in_epoch = (event % batches_per_epoch as u64) as usize;
        if in_epoch == 0 && event > 0 {
            order = order_rng.permutation(task.train_size());
        }
        // Learning-rate multiplier: linear warm-up from 1/N to 1, then ×0.1 at each decay point; the
        // aggregating modes use the synchronous learning rate (linear scaling by N) unless told otherwise.
        let mut lr_scale =
            if event < warmup { (1.0 + (n as f64 - 1.0) * event as f64 / warmup as f64) / n as f64 } else { 1.0 };
        lr_scale *= 0.1f64.powi(decays.iter().filter(|d| event >= **d).count() as i32);
        if scaled {
            lr_scale *= n as f64;
        }
        core.set_lr_scale(lr_scale as f32).map_err(|e| anyhow!("{e}"))?;

        // Injected failures and arrivals happen at their virtual time, before the next batch finishes.
        let next_time = heap.peek().map_or(f64::INFINITY, |d: &Due| d.time);
        while let Some(k) = kills.iter().position(|(_, t)| *t <= next_time) {
            let (w, t) = kills.remove(k);
            if let Some(vw) = workers.get_mut(w as usize) {
                vw.alive = false;
                now = now.max(t);
                blocked.retain(|b| b.worker != w as usize);
                core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker: w })), Duration::ZERO);
            }
        }
        while let Some(a) = adds.iter().position(|t| *t <= next_time) {
            let t = adds.remove(a);
            register(&mut core)?;
            let (view, version) = pull(&mut core, args.pull_dtype)?;
            let w = workers.len();
            let mut vw = new_worker(w, &mut timing, &view, version);
            if batches.is_some() {
                vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            }
            vw.duration = durations.draw(&mut timing, w, vw.slowness);
            heap.push(Due { time: t + vw.duration, worker: w as u32 });
            workers.push(vw);
        }
        release(&mut core, &mut workers, &mut blocked, &mut heap, now, args.pull_dtype, task.as_ref(), &mut batches)?;
        // Held workers whose hold ends before the next gradient arrives go on at its end, on what a pull
        // reads then (nothing changed since the last event).
        while let Some(i) = next_hold_to_end(&blocked, heap.peek().map_or(f64::INFINITY, |d: &Due| d.time)) {
            let b = blocked.swap_remove(i);
            let until = b.until.unwrap_or(now);
            workers[b.worker].refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            heap.push(Due { time: until + b.duration, worker: b.worker as u32 });
        }
        // Entries of killed workers are skipped, so every event is one gradient.
        let due = loop {
            let Some(due) = heap.pop() else {
                bail!("every worker is waiting or gone at event {event} (mode {:?})", args.mode)
            };
            if workers[due.worker as usize].alive {
                break due;
            }
        };
        now = due.time;
        let w = due.worker as usize;
        let compute_ms = durations.millis(workers[w].duration).round().clamp(1.0, f64::from(u32::MAX)) as u32;
        let next = durations.draw(&mut timing, w, workers[w].slowness);
        workers[w].duration = next;

        let vw = &mut workers[w];
        // An embedding task's worker computes the batch it took (and pulled the rows of) when it started;
        // a dense one takes the next batch of the global order.
        let batch = if rows > 0 {
            &vw.batch[..]
        } else {
            &order[in_epoch * args.batch as usize..(in_epoch + 1) * args.batch as usize]
        };
        let loss = task.loss_grad(&vw.view, batch, event, &mut grad);
        if !loss.is_finite() || grad.iter().any(|g| !g.is_finite()) {
            diverged = true;
            break;
        }
        let master = core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?;
        let gap =
            master.iter().zip(&vw.view[rows..]).map(|(a, b)| f64::from((a - b).abs())).sum::<f64>() / (p - rows) as f64;
        gap_sum += gap;
        if worker_momentum {
            gaps_kernels::slim_worker_step(&hyper, &vw.view, &mut vw.momentum, &mut grad);
        }
        // The rows go first, as a real worker sends them: in sync and gba the dense push ends the step.
        if rows > 0 {
            vw.seq += 1;
            let (ids, versions) = (&vw.rows, &vw.row_versions);
            if !push_rows(&mut core, w as u32, vw.seq, ids, versions, &grad, &vw.view, needs_read, args.push_dtype)? {
                diverged = true;
                break;
            }
        }
        vw.seq += 1;
        vw.steps += 1;
        // The gradient travels as --push-dtype; the read echo as the values were pulled (already
        // representable in --pull-dtype, so that encoding is exact).
        let mut payload = grad[rows..].to_vec();
        gaps_common::dtype::round_trip(args.push_dtype, &mut payload);
        if needs_read {
            payload.extend_from_slice(&vw.view[rows..]);
        }
        let push = Push {
            epoch: 1,
            worker: w as u32,
            seq: vw.seq,
            chunks: vec![PushChunk {
                id: CHUNK,
                read_version: vw.version,
                len: (p - rows) as u32,
                echo: needs_read,
                dtype: WireDtype::F32,
            }],
            compute_ms,
            // The sim's single shard is also the coordinator: it knows every decision it made.
            step: vw.steps - 1,
            decisions: Default::default(),
            data: None,
        };
        // The shard's clock is the simulated time (auto's minimum time in a mode counts in it). Under `gba`
        // with a hold the worker sends a push-pull, as the real one does, and may be held for its step.
        let msg = if holds { Message::PushPull(push) } else { Message::Push(push) };
        let (reply, _) = core.handle(Frame { msg, payload }, durations.clock(now));
        let held = if holds { core.take_gba_hold().map(|until| durations.time_at_clock(until)) } else { None };
        let ack = match reply.msg {
            Message::Ack(ack) | Message::PushPullReply(gaps_common::wire::PushPullReply { ack, .. }) => ack,
            Message::Error(e) if e.code == gaps_common::ErrorCode::NonFinite => {
                diverged = true;
                break;
            }
            other => bail!("the shard refused a push: {other:?}"),
        };
        let tau = ack.max_staleness;
        staleness.push(tau.min(u64::from(u32::MAX)) as u32);
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            let b =
                Blocked { worker: w, step: ack.wait_for_step, clock: ack.wait_for_clock, duration: next, until: None };
            blocked.push(b);
        } else if let Some(until) = held {
            let step = core.global_step() + 1;
            blocked.push(Blocked { worker: w, step, clock: 0, duration: next, until: Some(until.max(now)) });
        } else {
            heap.push(Due { time: now + next, worker: w as u32 });
            let vw = &mut workers[w];
            vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            if vw.view.iter().any(|v| !v.is_finite()) {
                diverged = true;
                break;
            }
        }
        events += 1;
        if let Some(out) = csv.as_mut() {
            writeln!(out, "{event},{epoch},{now},{w},{tau},{loss},{},{gap}", core.lr())?;
        }
        evaluator.after(events, now, task.as_ref(), &mut core)?;
    }
    if let Some(mut out) = csv {
        out.flush()?;
    }
    let live = workers.iter().filter(|w| w.alive).count() as u32;
    let outcome = Outcome {
        staleness,
        gap_sum,
        now,
        diverged,
        events,
        started,
        gradients: events,
        evaluator,
        durations,
        initial_loss,
    };
    let mut report = finish(args, task.as_ref(), &mut core, outcome)?;
    report.workers_final = live;
    Ok(report)
}

/// The held worker (GBA's hold) whose hold ends first, if it ends by `next` (the next gradient's arrival).
fn next_hold_to_end(blocked: &[Blocked], next: f64) -> Option<usize> {
    blocked
        .iter()
        .enumerate()
        .filter_map(|(i, b)| b.until.map(|u| (i, u)))
        .filter(|(_, u)| *u <= next)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

/// Lets every waiting worker whose condition now holds start its next batch at `now`, on fresh parameters.
#[allow(clippy::too_many_arguments)]
fn release(
    core: &mut ShardCore,
    workers: &mut [VirtualWorker],
    blocked: &mut Vec<Blocked>,
    heap: &mut BinaryHeap<Due>,
    now: f64,
    wire: WireDtype,
    task: &dyn Task,
    batches: &mut Option<Batches>,
) -> Result<()> {
    if blocked.is_empty() {
        return Ok(());
    }
    let min_clock = core.stats().ssp_min_clock;
    let step = core.global_step();
    let mut still = Vec::new();
    let mut ready = Vec::new();
    for b in blocked.drain(..) {
        if step >= b.step && min_clock >= b.clock {
            ready.push(b);
        } else {
            still.push(b);
        }
    }
    for b in ready {
        workers[b.worker].refresh(core, task, batches, wire)?;
        heap.push(Due { time: now + b.duration, worker: b.worker as u32 });
    }
    *blocked = still;
    Ok(())
}

/// Counters of a finished event loop.
struct Outcome {
    staleness: Vec<u32>,
    gap_sum: f64,
    now: f64,
    diverged: bool,
    events: u64,
    started: Instant,
    /// Gradients computed.
    gradients: u64,
    evaluator: Evaluator,
    durations: Durations,
    /// Training loss at the initial parameters.
    initial_loss: f64,
}

fn finish(args: &SimArgs, task: &dyn Task, core: &mut ShardCore, o: Outcome) -> Result<SimReport> {
    let Outcome {
        staleness,
        gap_sum,
        now,
        mut diverged,
        events,
        started,
        gradients,
        evaluator,
        durations,
        initial_loss,
    } = o;
    let real = started.elapsed().as_secs_f64();
    let params = master_params(core, task)?;
    diverged |= params.iter().any(|v| !v.is_finite());
    let (metric, train_loss) = if diverged { (f64::NAN, f64::NAN) } else { task.evaluate(&params) };
    // Training that ends with a higher (or NaN) loss than it started from has diverged, whatever its
    // numbers stayed finite (a momentum run ending at a loss of 17 against chance's 2.3 did).
    diverged |= train_loss.is_nan() || train_loss > initial_loss;
    let mut curve = evaluator.curve;
    if evaluator.every > 0 && curve.last().is_none_or(|c| c.time < now) {
        curve.push(CurvePoint { epoch: gradients as f64 / evaluator.batches_per_epoch as f64, time: now, metric });
    }
    let time_to_target = args.target.and_then(|t| {
        // Without intermediate evaluations only the end can reach the target.
        let end = [CurvePoint { epoch: 0.0, time: now, metric }];
        time_to_reach(if curve.is_empty() { &end } else { &curve }, t, task.higher_is_better())
    });
    let mut sorted = staleness.clone();
    sorted.sort_unstable();
    let p99 =
        sorted.get(((sorted.len() as f64 * 0.99) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(0);
    Ok(SimReport {
        rule: args.rule.name().into(),
        model: task.name().into(),
        workers: args.workers,
        shape: args.shape,
        seed: args.seed,
        final_test_metric: metric,
        final_train_loss: train_loss,
        initial_train_loss: initial_loss,
        diverged,
        staleness_mean: staleness.iter().map(|t| f64::from(*t)).sum::<f64>() / staleness.len().max(1) as f64,
        staleness_p99: u64::from(p99),
        gap_mean: gap_sum / events.max(1) as f64,
        sim_wall_time: now,
        events,
        events_per_s: events as f64 / real.max(1e-9),
        lookahead: if args.rule.layout().lookahead { Some(pull(core, args.pull_dtype)?.0) } else { None },
        mode_switches: core.stats().mode_switches,
        steps_sync: core.stats().steps_sync,
        steps_gba: core.stats().steps_gba,
        dropped_stale: core.stats().dropped_stale,
        workers_final: args.workers,
        lr_multiplier_final: f64::from(core.stats().lr_multiplier_milli) / 1000.0,
        params,
        curve,
        time_to_target,
        time_unit: durations.unit(),
    })
}

/// Global-batch synchronous SGD (optionally elastic), driven through the shard's own sync mode: every
/// round, each of the N live virtual workers pulls, computes one gradient on the current parameters and
/// pushes it under its own worker id; the shard averages the round and applies it once, with its elastic
/// learning-rate multiplier ([`gaps_shard::modes::LrRamp`]: live / initial workers, ramped when the count
/// grows). Workers join and leave the shard with `Register` and `Leave`, as real ones do. The simulator
/// only sets the schedule's factor (warm-up from η to the scaled η, the decays, and the initial worker count
/// for linear scaling). A round takes as long as its slowest worker. The total number of gradients equals
/// the async run's.
fn run_sync(args: &SimArgs) -> Result<SimReport> {
    let (task, mut core, _hyper) = setup(args)?;
    let initial_loss = task.evaluate(&master_params(&mut core, task.as_ref())?).1;
    let p = task.num_params();
    let rows = task.sparse_rows();
    let mut timing = Rng::new(mix(args.seed, 0x71e));
    let mut order_rng = Rng::new(mix(args.seed, 0x0d3));
    let durations = Durations::new(args)?;
    let Schedule { batches_per_epoch, total, warmup, decays } = Schedule::new(args, task.as_ref());
    let workers_at = |gradients: u64| -> u32 {
        if args.elastic.is_empty() {
            return args.workers;
        }
        let phase = gradients / (batches_per_epoch as u64 * u64::from(args.elastic_every));
        args.elastic[(phase % args.elastic.len() as u64) as usize]
    };
    let needs_read = args.rule.layout().needs_read;
    let mut csv = open_csv(args)?;
    let mut evaluator = Evaluator::new(args, batches_per_epoch);
    let started = Instant::now();
    let mut order = order_rng.permutation(task.train_size());
    let (mut used, mut now, mut diverged, mut rounds) = (0usize, 0.0f64, false, 0u64);
    let mut gradients = 0u64;
    let mut grad = vec![0.0f32; p];
    let mut round_view = vec![0.0f32; if rows > 0 { p } else { 0 }];
    // The live workers' ids (as the shard handed them out) and sequence numbers, in join order; the slot in
    // this list picks a worker's straggler factor.
    let mut live: Vec<(u32, u64)> = Vec::new();
    let initial = workers_at(0);
    while gradients < total {
        if rounds % 64 == 0 && started.elapsed() > args.timeout {
            bail!("the simulation ran past --timeout {:?}", args.timeout);
        }
        // The last round may be short: the workers without data leave, as at the end of a real job.
        let wanted = (u64::from(workers_at(gradients))).min(total - gradients) as usize;
        while live.len() > wanted {
            if let Some((worker, _)) = live.pop() {
                core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker })), Duration::ZERO);
            }
        }
        while live.len() < wanted {
            live.push((register(&mut core)?, 0));
        }
        // The shard scales η by live / initial workers; the schedule's factor supplies the rest: the initial
        // count for linear scaling (so η·N in all), warmed up from η, and the decays. Without linear scaling
        // the factor divides the shard's multiplier back out.
        let warm = if args.linear_scaling {
            f64::from(initial) * schedule(gradients, warmup, 1.0 / f64::from(initial), &decays)
        } else {
            schedule(gradients, warmup, 1.0, &decays) / core.lr_multiplier()
        };
        core.set_lr_scale(warm as f32).map_err(|e| anyhow!("{e}"))?;
        let (params, version) = pull(&mut core, args.pull_dtype)?;
        // An embedding task's view: the dense part, and each worker's rows as it pulls them.
        if rows > 0 {
            round_view[rows..].copy_from_slice(&params);
        }
        let mut slowest = 0.0f64;
        let mut loss_sum = 0.0f32;
        for (slot, (worker, seq)) in live.iter_mut().enumerate() {
            if used + args.batch as usize > task.train_size() {
                order = order_rng.permutation(task.train_size());
                used = 0;
            }
            let batch = &order[used..used + args.batch as usize];
            used += args.batch as usize;
            // An embedding task's worker pulls its batch's rows into the round's view (rows do not change
            // within a round: the shard applies the round's row sums when the step ends).
            let (ids, row_versions) = if rows > 0 {
                let ids = task.batch_rows(batch);
                let versions = pull_rows_into(&mut core, args.pull_dtype, &ids, &mut round_view)?;
                (ids, versions)
            } else {
                (Vec::new(), Vec::new())
            };
            let view = if rows > 0 { &round_view[..] } else { &params[..] };
            let loss = task.loss_grad(view, batch, gradients, &mut grad);
            loss_sum += loss;
            gradients += 1;
            let slowness =
                args.stragglers.iter().filter(|(s, _)| *s as usize == slot).map(|(_, f)| *f).product::<f64>();
            let duration = durations.draw(&mut timing, slot, slowness);
            slowest = slowest.max(duration);
            if !loss.is_finite() || grad.iter().any(|g| !g.is_finite()) {
                diverged = true;
                break;
            }
            if rows > 0 {
                *seq += 1;
                if !push_rows(&mut core, *worker, *seq, &ids, &row_versions, &grad, view, needs_read, args.push_dtype)?
                {
                    diverged = true;
                    break;
                }
            }
            *seq += 1;
            let mut payload = grad[rows..].to_vec();
            gaps_common::dtype::round_trip(args.push_dtype, &mut payload);
            if needs_read {
                payload.extend_from_slice(&params);
            }
            let push = Push {
                epoch: 1,
                worker: *worker,
                seq: *seq,
                chunks: vec![PushChunk {
                    id: CHUNK,
                    read_version: version,
                    len: (p - rows) as u32,
                    echo: needs_read,
                    dtype: WireDtype::F32,
                }],
                compute_ms: durations.millis(duration).round().clamp(1.0, f64::from(u32::MAX)) as u32,
                step: 0,
                decisions: Default::default(),
                data: None,
            };
            let (reply, _) = core.handle(Frame { msg: Message::Push(push), payload }, Duration::ZERO);
            if !matches!(reply.msg, Message::Ack(_)) {
                bail!("the shard refused a push: {:?}", reply.msg);
            }
        }
        if diverged {
            break;
        }
        now += slowest;
        if let Some(out) = csv.as_mut() {
            writeln!(
                out,
                "{rounds},{},{now},{},0,{},{},0",
                gradients / batches_per_epoch as u64,
                live.len(),
                loss_sum / live.len() as f32,
                core.lr()
            )?;
        }
        rounds += 1;
        if core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?.iter().any(|v| !v.is_finite()) {
            diverged = true;
            break;
        }
        evaluator.after(gradients, now, task.as_ref(), &mut core)?;
    }
    if let Some(mut out) = csv {
        out.flush()?;
    }
    let steps = core.stats().steps_sync;
    if !diverged && steps != rounds {
        bail!("the shard completed {steps} synchronous steps for {rounds} rounds");
    }
    let staleness = vec![0u32; rounds as usize];
    let outcome = Outcome {
        staleness,
        gap_sum: 0.0,
        now,
        diverged,
        events: rounds,
        started,
        gradients,
        evaluator,
        durations,
        initial_loss,
    };
    let mut report = finish(args, task.as_ref(), &mut core, outcome)?;
    report.workers_final = live.len() as u32;
    Ok(report)
}
