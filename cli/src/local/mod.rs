//! `gaps local`: a whole cluster of real OS processes on 127.0.0.1 with throwaway certificates.
//!
//! Starts shard 0 (the coordinator), then the other shards, evaluates the initial model as an observer,
//! starts the workers, shows progress, evaluates the final model, stops the shards with SIGTERM and
//! reports. Every child process is this same executable run as `gaps server …` / `gaps worker …` (so the
//! command works straight from `cargo run`), unless `--server-bin` / `--worker-bin` name installed binaries.

use anyhow::{anyhow, bail, Context, Result};
use gaps_common::config::parse_duration;
use gaps_common::layout_file;
use gaps_common::wire::Role;
use gaps_kernels::Rule;
use gaps_models::criteo::{held_out, DataSpec};
use gaps_models::data::{SyntheticLogreg, EVAL_BASE};
use gaps_models::model::{logreg_loss, ModelKind, ModelSize};
use gaps_models::recsys::CtrShape;
use gaps_setup::certs::ClusterCerts;
use gaps_worker::client::{Client, ClientOptions};
use gaps_worker::train::evaluate_ctr as evaluate;
use gaps_worker::train::{DataSharding, PushLedger, WorkerSummary};
use serde::{Deserialize, Serialize};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

mod procs;
mod report;
mod run;
pub(crate) use procs::*;
pub use report::*;
use run::*;

/// Flags of `gaps local`. Every flag also reads a `GAPS_*` environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct LocalArgs {
    /// Number of server shards.
    #[arg(long, env = "GAPS_SERVERS", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub servers: u32,
    /// Number of workers.
    #[arg(long, env = "GAPS_WORKERS", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub workers: u32,
    /// Model to train.
    #[arg(long, env = "GAPS_MODEL", default_value = "logreg")]
    pub model: ModelKind,
    /// Feature dimension.
    #[arg(long, env = "GAPS_DIM", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 28)))]
    pub dim: u64,
    /// Elements per chunk (default: 64 for logreg, so every shard holds part of it; 4096 for the CTR models).
    #[arg(long, env = "GAPS_CHUNK_ELEMS", value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_elems: Option<u32>,
    /// Steps per worker (default: 150 for logreg, 300 for the CTR models on synthetic data; with a data
    /// file, as many as `--epochs` take).
    #[arg(long, env = "GAPS_STEPS", value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: Option<u64>,
    /// Passes of each worker over its share of a data file (default: 1 unless `--steps` is given).
    #[arg(long, env = "GAPS_EPOCHS", value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: Option<u64>,
    /// Samples per step and worker (default: 64 for logreg, 256 for the CTR models).
    #[arg(long, env = "GAPS_BATCH", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub batch: Option<u32>,
    /// Update rule of the dense tensors (default: momentum for logreg, adagrad for the CTR models).
    #[arg(long, env = "GAPS_RULE")]
    pub rule: Option<Rule>,
    /// Learning rate of the dense tensors (default: 0.1 for logreg, 0.02 for the CTR models).
    #[arg(long, env = "GAPS_LR")]
    pub lr: Option<f32>,
    /// Training data of the CTR models: `synthetic` or Criteo-layout TSV files (comma-separated).
    #[arg(long, env = "GAPS_DATA", default_value = "synthetic")]
    pub data: String,
    /// How the CTR models' workers get their data: `dynamic` (the coordinator deals splits of
    /// `--split-lines` to whichever worker asks, so fast workers train more of it) or `static` (worker W of N
    /// reads the lines numbered W modulo N; every mode is as slow as the slowest worker's share).
    #[arg(long, env = "GAPS_DATA_SHARDING", default_value = "dynamic")]
    pub data_sharding: gaps_worker::train::DataSharding,
    /// Lines (or synthetic samples) per dealt split under `--data-sharding dynamic`.
    #[arg(long, env = "GAPS_SPLIT_LINES", default_value_t = gaps_server::data::DEFAULT_SPLIT_LINES, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 32)))]
    pub split_lines: u64,
    /// Embedding dimension of the CTR models.
    #[arg(long, env = "GAPS_EMBEDDING_DIM", default_value_t = 8)]
    pub embedding_dim: u32,
    /// Hidden units of dlrm.
    #[arg(long, env = "GAPS_HIDDEN", default_value_t = 32)]
    pub hidden: u32,
    /// Where the shards apply updates: cpu, cuda or auto.
    #[arg(long, env = "GAPS_DEVICE", default_value = "cpu")]
    pub device: String,
    /// How dense gradients and parameters travel: f32, bf16 or f16 (the shards keep f32 state).
    #[arg(long, env = "GAPS_WIRE_DTYPE", default_value = "f32")]
    pub wire_dtype: gaps_common::dtype::WireDtype,
    #[command(flatten)]
    pub hyper: gaps_flags::HyperArgs,
    #[command(flatten)]
    pub tables: gaps_flags::TableArgs,
    #[command(flatten)]
    pub modes: gaps_flags::ModeArgs,
    /// A straggler: `W:F` makes worker W F times slower by injected delay; `W:F:T` only for the first T.
    #[arg(long = "straggler", env = "GAPS_STRAGGLERS", value_delimiter = ',', value_parser = parse_straggler)]
    pub stragglers: Vec<Straggler>,
    /// Kill worker W T after training starts: `W@T`, e.g. `2@30s` (repeatable).
    #[arg(long = "kill-worker", env = "GAPS_KILL_WORKERS", value_delimiter = ',', value_parser = parse_kill)]
    pub kill_workers: Vec<Kill>,
    /// Start one more worker T after training starts, e.g. `40s` (repeatable).
    #[arg(long = "add-worker", env = "GAPS_ADD_WORKERS", value_delimiter = ',', value_parser = parse_duration)]
    pub add_workers: Vec<Duration>,
    /// Run this `gaps-server` binary for the shards instead of `gaps server` from this executable.
    #[arg(long, env = "GAPS_SERVER_BIN")]
    pub server_bin: Option<PathBuf>,
    /// Run this `gaps-worker` binary for the workers instead of `gaps worker` from this executable.
    #[arg(long, env = "GAPS_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// Worker lease of the shards: a silent worker is dropped after this long.
    #[arg(long, env = "GAPS_LEASE", default_value = "5s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Emulated compute time per step on every worker (default: 10ms when stragglers are injected, else 0).
    #[arg(long, env = "GAPS_COMPUTE_DELAY", value_parser = parse_duration)]
    pub compute_delay: Option<Duration>,
    /// Seed of the data and of the initializer.
    #[arg(long, env = "GAPS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Samples in the held-out evaluation set.
    #[arg(long, env = "GAPS_EVAL_SAMPLES", default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub eval_samples: u32,
    /// CTR models: every worker evaluates the cluster's model on the held-out set every this many of its
    /// steps (0: only at the end); the curve is in the JSON (`heldout_curve`, worker 0's).
    #[arg(long, env = "GAPS_EVAL_EVERY", default_value_t = 0)]
    pub eval_every: u64,
    /// With --eval-every: a worker stops once the held-out log-loss has not improved for this many
    /// evaluations in a row (0: never stop early).
    #[arg(long, env = "GAPS_PATIENCE", default_value_t = 3)]
    pub patience: u32,
    /// Kill shard I with SIGKILL T after training starts: `I@T`, e.g. `1@3s` (repeatable). With
    /// --replicas, the first kill waits until every shard's backups count (for at most a minute of
    /// training), and a restart of that shard keeps its distance from the kill.
    #[arg(long = "kill-shard", env = "GAPS_KILL_SHARDS", value_delimiter = ',', value_parser = parse_kill)]
    pub kill_shards: Vec<Kill>,
    /// Start shard I again T after training starts, on the same address, from its newest checkpoint:
    /// `I@T` (repeatable).
    #[arg(long = "restart-shard", env = "GAPS_RESTART_SHARDS", value_delimiter = ',', value_parser = parse_kill)]
    pub restart_shards: Vec<Kill>,
    /// How long workers wait for an unreachable shard before they give up.
    #[arg(long, env = "GAPS_SHARD_DOWN_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub shard_down_timeout: Duration,
    /// Connections from each worker to each shard that large pushes and pulls are striped over (see
    /// `gaps-worker --lanes`).
    #[arg(long, env = "GAPS_LANES", default_value_t = gaps_worker::client::DEFAULT_LANES as u32, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub lanes: u32,
    /// Copies of each shard's state, each on another shard process (`gaps-server --replicas`; at most
    /// `--servers`). 1: none.
    #[arg(long, env = "GAPS_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub replicas: u32,
    /// Where the shards keep checkpoints (default: the run's folder, when checkpoints are asked for).
    #[arg(long, env = "GAPS_CHECKPOINT_DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Shards take a checkpoint this often.
    #[arg(long, env = "GAPS_CHECKPOINT_EVERY", value_parser = parse_duration)]
    pub checkpoint_every: Option<Duration>,
    /// Give up (and stop every process) after this long.
    #[arg(long, env = "GAPS_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Keep the folder with certificates and logs (it is always kept after a failure).
    #[arg(long, env = "GAPS_KEEP_DIR")]
    pub keep_dir: bool,
    /// Write every worker's time per step to this file (`worker,seconds` lines, the format `gaps sim
    /// --profile` replays; see `gaps-worker --step-log`).
    #[arg(long, env = "GAPS_STEP_LOG")]
    pub step_log: Option<PathBuf>,
    /// With dynamic data sharding: write every shard's samples per grant and the dealer's finished and
    /// given-back grants to this JSON file at the end (to check that every line was trained once a pass).
    #[arg(long, env = "GAPS_DATA_STATUS_OUT")]
    pub data_status_out: Option<PathBuf>,
    /// CTR models: the observer (not a worker, so no worker is slowed) evaluates the cluster's model on the
    /// held-out set this often while training runs; the points are the JSON's `timeline` (seconds since
    /// training started, AUC, log-loss), from which `gaps bench stragglers` reads the time to a target AUC.
    #[arg(long, env = "GAPS_EVAL_INTERVAL", value_parser = parse_duration)]
    pub eval_interval: Option<Duration>,
    /// End with one JSON line on stdout.
    #[arg(long, env = "GAPS_JSON")]
    pub json: bool,
}

/// An injected straggler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggler {
    /// Worker index.
    pub worker: u32,
    /// Slow-down factor.
    pub factor: f64,
    /// Only for this long after the start.
    pub until: Option<Duration>,
}

/// An injected worker failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kill {
    /// Index of the worker (`--kill-worker`) or shard (`--kill-shard`, `--restart-shard`).
    pub index: u32,
    /// When, after training starts.
    pub at: Duration,
}

fn parse_straggler(text: &str) -> Result<Straggler, String> {
    let (worker, factor, until) = gaps_common::config::parse_straggler(text)?;
    Ok(Straggler { worker, factor, until: until.map(parse_duration).transpose()? })
}

fn parse_kill(text: &str) -> Result<Kill, String> {
    let (i, t) = text.split_once('@').ok_or_else(|| format!("{text:?}: expected I@T, e.g. 2@30s"))?;
    Ok(Kill {
        index: i.trim().parse().map_err(|_| format!("{text:?}: {i:?} is not an index"))?,
        at: parse_duration(t)?,
    })
}

impl LocalArgs {
    fn compute_delay(&self) -> Duration {
        self.compute_delay.unwrap_or(if self.stragglers.is_empty() {
            Duration::ZERO
        } else {
            Duration::from_millis(10)
        })
    }

    fn ctr(&self) -> bool {
        self.model.ctr().is_some()
    }
    /// Elements per chunk (the CTR models default to 4096).
    pub fn chunk_elems(&self) -> u32 {
        self.chunk_elems.unwrap_or(if self.ctr() { 4096 } else { 64 })
    }
    /// Steps per worker, when a number of steps bounds the run (not for a data file run by passes).
    pub fn steps(&self) -> Option<u64> {
        match (self.steps, self.data != "synthetic") {
            (Some(n), _) => Some(n),
            (None, true) => None,
            (None, false) => Some(if self.ctr() { 300 } else { 150 }),
        }
    }
    /// Whether the coordinator deals the data (dynamic sharding of a CTR model's data).
    pub fn deals_data(&self) -> bool {
        self.ctr() && self.data_sharding == gaps_worker::train::DataSharding::Dynamic
    }
    /// Passes over a data file the coordinator deals: `--epochs`, 1 by default, no end (0) when `--steps`
    /// bounds the run instead.
    pub fn data_epochs(&self) -> u64 {
        match (self.epochs, self.steps) {
            (Some(e), _) => e,
            (None, Some(_)) => 0,
            (None, None) => 1,
        }
    }
    /// The table flags for the servers: as given, except that a run passing over a data file more than
    /// once (`--epochs` above 1, or `--steps`) starts Adagrad rows at 0.1 unless `--sparse-adagrad-init`
    /// was given (docs/guide/models.md, "Real-data defaults").
    pub fn tables(&self) -> gaps_flags::TableArgs {
        let mut tables = self.tables.clone();
        let repeats = self.data != "synthetic" && (self.epochs.is_some_and(|e| e > 1) || self.steps.is_some());
        if repeats && tables.sparse_adagrad_init.is_none() {
            tables.sparse_adagrad_init = Some(gaps_flags::REPEATED_PASSES_ADAGRAD_INIT);
        }
        // The shards share this machine: each gets its share of the default budget.
        if tables.table_memory.is_none() {
            tables.table_memory = Some(gaps_flags::default_table_memory() / u64::from(self.servers.max(1)));
        }
        tables
    }
    /// Samples per step and worker.
    pub fn batch(&self) -> u32 {
        self.batch.unwrap_or(if self.ctr() { 256 } else { 64 })
    }
    /// The dense rule.
    pub fn rule(&self) -> Rule {
        self.rule.unwrap_or(if self.ctr() { Rule::Adagrad } else { Rule::Momentum })
    }
    /// The dense learning rate.
    pub fn lr(&self) -> f32 {
        self.lr.unwrap_or(if self.ctr() { 0.02 } else { 0.1 })
    }
    /// Standard deviation of the dense initializer (zeros for logreg).
    pub fn init_std(&self) -> f32 {
        if self.ctr() {
            0.05
        } else {
            0.0
        }
    }
}

/// Runs the whole local cluster and returns its report (children are this executable).
pub async fn run(args: &LocalArgs) -> Result<LocalReport> {
    let exe = std::env::current_exe().context("locating the gaps executable")?;
    run_with(args, &exe).await
}

/// Runs the whole local cluster with `exe` (the `gaps` binary) as every child process.
pub async fn run_with(args: &LocalArgs, exe: &Path) -> Result<LocalReport> {
    if let Some(st) = args.stragglers.iter().find(|st| st.worker >= args.workers) {
        bail!("--straggler names worker {}, but only {} workers start", st.worker, args.workers);
    }
    if let Some(k) = args.kill_workers.iter().find(|k| k.index >= args.workers) {
        bail!("--kill-worker names worker {}, but only {} workers start", k.index, args.workers);
    }
    if args.replicas > args.servers {
        bail!("--replicas {} needs at least as many shards; --servers is {}", args.replicas, args.servers);
    }
    if args.replicas > 1 && args.device != "cpu" {
        bail!("--replicas keeps every copy's updates on the CPU: pass --device cpu");
    }
    let mut shard_events = args
        .kill_shards
        .iter()
        .map(|k| ("--kill-shard", k))
        .chain(args.restart_shards.iter().map(|k| ("--restart-shard", k)));
    if let Some((flag, k)) = shard_events.find(|(_, k)| k.index >= args.servers) {
        bail!("{flag} names shard {}, but only {} shards start", k.index, args.servers);
    }
    let started = Instant::now();
    let deadline = started + args.timeout;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("gaps-local-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = run_in(args, exe, &dir, started, deadline).await;
    match &result {
        Ok(_) if !args.keep_dir => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        _ => eprintln!("[gaps local] certificates and logs are in {}", dir.display()),
    }
    result
}
