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

mod asynchronous;
mod synchronous;
mod world;
use asynchronous::run_async;
use synchronous::run_sync;
use world::*;

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::config::parse_duration;
use gaps_common::dtype::WireDtype;
use gaps_common::layout::{ChunkId, Layout, TensorSpec};
use gaps_common::rng::{mix, Rng};
use gaps_common::wire::{ChunkVersion, Frame, Message, Pull, Push, PushChunk};
use gaps_flags::HyperArgs;
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

/// How the simulated cluster trains (in JSON by its `--mode` name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
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

/// Flags of `gaps sim`. Every flag also reads an environment variable: `GAPS_SIM_*`, but the rule's
/// hyper-parameters ([`HyperArgs`]) the `GAPS_*` variables of `gaps-server`.
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
    /// The rule's other hyper-parameters: `gaps-server`'s flags (and `GAPS_*` variables), its defaults.
    #[command(flatten)]
    pub hyper: HyperArgs,
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
            hyper: HyperArgs::default(),
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

/// Runs one simulation.
pub fn run(args: &SimArgs) -> Result<SimReport> {
    args.validate()?;
    match args.mode {
        SimMode::Sync => run_sync(args),
        _ => run_async(args),
    }
}
