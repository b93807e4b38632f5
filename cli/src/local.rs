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
use gaps_transport::tls::ClusterCerts;
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
    pub hyper: gaps_server::cli::HyperArgs,
    #[command(flatten)]
    pub tables: gaps_server::cli::TableArgs,
    #[command(flatten)]
    pub modes: gaps_server::cli::ModeArgs,
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

/// The final report of a local run.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReport {
    /// Flags as given.
    pub servers: u32,
    /// Flags as given.
    pub workers: u32,
    /// Worker steps in total.
    pub steps: u64,
    /// Shard pushes sent by all workers (each once).
    pub pushes_sent: u64,
    /// Shard pushes applied by all shards.
    pub pushes_applied: u64,
    /// Retried pushes acknowledged as duplicates.
    pub pushes_duplicate: u64,
    /// Requests workers resent after transport failures.
    pub retries: u64,
    /// Held-out log-loss of the initial model.
    pub initial_loss: f32,
    /// Held-out log-loss of the final model.
    pub final_loss: f32,
    /// Mean staleness of applied chunk updates.
    pub staleness_mean: f64,
    /// Largest staleness.
    pub staleness_max: u64,
    /// Wall-clock seconds, first process started to last process stopped.
    pub wall_s: f64,
    /// The CTR figures (CTR models only).
    pub ctr: Option<CtrReport>,
    /// Mode switches (shard 0).
    pub mode_switches: u64,
    /// The cluster's mode switches as the coordinator decided them, with their reasons.
    pub switches: Vec<gaps_common::wire::ModeSwitchRecord>,
    /// Every shard carried out the same switches at the same worker steps (as far as each remembers;
    /// a restarted shard only those since its restart).
    pub switches_agree: bool,
    /// Synchronous steps (shard 0).
    pub steps_sync: u64,
    /// GBA steps (shard 0).
    pub steps_gba: u64,
    /// Workers that finished their training (started + added − killed).
    pub workers_final: u32,
    /// Gradients dropped as too stale, all shards.
    pub dropped_stale: u64,
    /// The learning-rate multiplier at the end (shard 0).
    pub lr_multiplier_final: f64,
    /// Shards restarted (from their checkpoints).
    pub shard_restarts: u32,
    /// Checkpoints the shards wrote (counted from the files as they appear).
    pub checkpoints_written: u64,
    /// The largest tensor version a restarted shard came back at (0 without restarts).
    pub restored_version: u64,
    /// Shard pushes the workers saw acknowledged.
    pub pushes_acknowledged: u64,
    /// Acknowledged pushes a crash lost (applied by a shard after the checkpoint it returned to): per worker
    /// and shard, the pushes the worker saw acknowledged beyond those the shard's state holds of it (the
    /// shard's own per-worker ledger, [`gaps_common::wire::Stats::applied_by_worker`]).
    pub pushes_lost: u64,
    /// Pushes a shard applied although its ledger held them already (0 unless exactly-once failed).
    pub pushes_applied_twice: u64,
    /// Gradients a restored shard refused because they were computed before its restore.
    pub stale_after_restore: u64,
    /// Pushes a killed worker may have sent in the step it was killed in, without seeing them acknowledged
    /// (at most one step's pushes per killed worker; each was applied once or not at all). The books:
    /// `pushes_acknowledged ≤ pushes_applied + pushes_lost ≤ pushes_acknowledged + pushes_unconfirmed`,
    /// with equality on the left when no worker was killed.
    pub pushes_unconfirmed: u64,
    /// The longest time any worker took between two of its steps, seconds (a step's own time, or a stall:
    /// a dead shard, a fail-over, a straggler held for).
    pub longest_step_s: f64,
    /// Dynamic data sharding: the dealer's account at the end (None: static shares).
    pub data: Option<DataReport>,
    /// Gradients dropped at mode switches (computed in the mode before, too stale for the new), all shards.
    pub pushes_dropped_at_switch: u64,
    /// Replicated shards (`--replicas` ≥ 2): the coordinator's replica sets at the end.
    pub replication: Option<ReplicationReport>,
}

/// Seconds from now until the coordinator's map shows `shard` at a replica epoch above `before` (a backup
/// took it over), asked every 100 ms; None if that did not happen within a minute.
async fn watch_failover(observer: Client, shard: u32, before: u64) -> Option<f64> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Ok(map) = observer.current_map().await {
            if map.shards.get(shard as usize).is_some_and(|s| s.epoch > before) {
                return Some(start.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Who held each shard at the end of a replicated run, as the coordinator's map says.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReplicationReport {
    /// Take-overs of a shard by a backup, all shards (the sum of the shards' replica epochs).
    pub failovers: u64,
    /// Per shard, the process serving it (its own index unless a backup took it over).
    pub serving: Vec<u32>,
    /// Per shard, the processes whose copy is in sync (replies wait for them) as the coordinator knows them:
    /// a process killed and restarted empty appears here again once it caught up. For shard 0, those of the
    /// configuration a majority chose last; null where no majority chooses it (fewer than 3 processes: its
    /// copies are not reported to the coordinator, its log says when they catch up).
    pub backups_in_sync: Vec<Option<Vec<u32>>>,
    /// Processes that serve no shard (theirs was taken over while they were down) and keep copies.
    pub spare_processes: Vec<u32>,
    /// Per shard killed (`--kill-shard`, in kill order; shard 0 where a majority chooses who serves it):
    /// seconds from the SIGKILL until the coordinator's map showed a backup serving it (null: not within a
    /// minute).
    pub failover_s: Vec<Option<f64>>,
    /// Per shard, as its serving process reports it at the end: the most log entries its slowest in-sync
    /// backup (one replies wait for) was behind, since that process started serving ([`Stats::replica_lag_peak`]).
    ///
    /// [`Stats::replica_lag_peak`]: gaps_common::wire::Stats::replica_lag_peak
    pub replica_lag_peak: Vec<u64>,
    /// Per shard, as its serving process reports it at the end: how it copied the shard to each backup since
    /// it started serving it (re-replication: snapshots, bytes, the longest pause of the core to take one,
    /// the longest until the backup caught up; [`Stats::replica_copies`]).
    ///
    /// [`Stats::replica_copies`]: gaps_common::wire::Stats::replica_copies
    pub rereplication: Vec<Vec<CopyReport>>,
}

/// One backup's copies of a shard (see [`ReplicationReport::rereplication`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CopyReport {
    /// The backup's shard process.
    pub backup: u32,
    /// Snapshots taken for it, and their bytes sent.
    pub snapshots: u64,
    pub bytes: u64,
    /// Whether replies waited for it at the end (it had caught up).
    pub live: bool,
    /// Bytes of a snapshot still being sent at the end (0: none).
    pub bytes_left: u64,
    /// The longest pause of the shard's core to take a snapshot for it, and the longest from a snapshot to
    /// the backup counting, in seconds.
    pub pause_peak_s: f64,
    pub catch_up_peak_s: f64,
}

impl CopyReport {
    fn of(c: &gaps_common::wire::ReplicaCopy) -> Self {
        CopyReport {
            backup: c.backup,
            snapshots: c.snapshots,
            bytes: c.bytes_sent,
            live: c.live,
            bytes_left: c.copying_total.saturating_sub(c.copying_sent),
            pause_peak_s: c.pause_peak_us as f64 / 1e6,
            catch_up_peak_s: c.catch_up_peak_ms as f64 / 1e3,
        }
    }
}

impl ReplicationReport {
    /// The report of a cluster map.
    pub fn from_map(map: &gaps_common::wire::ClusterMap) -> Self {
        ReplicationReport {
            failovers: map.shards.iter().map(|s| s.epoch).sum(),
            serving: map.shards.iter().map(|s| s.process).collect(),
            // Shard 0's are listed where a majority of 3 or more processes chooses them.
            backups_in_sync: map
                .shards
                .iter()
                .map(|s| (s.index != 0 || (map.replicas >= 2 && map.num_shards >= 3)).then(|| s.backups.clone()))
                .collect(),
            spare_processes: map.spare.iter().map(|s| s.index).collect(),
            failover_s: Vec::new(),
            replica_lag_peak: Vec::new(),
            rereplication: Vec::new(),
        }
    }
}

/// What the coordinator's dealer did (dynamic data sharding); in [`LocalSummary`] as it is, `finished`
/// named `data_finished`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DataReport {
    /// Splits finished, all epochs together.
    pub splits_done: u64,
    /// Splits in one pass over the data (0: synthetic data).
    pub splits_per_epoch: u64,
    /// Splits given back unfinished (dead, departed or rolled-back holders) and dealt again.
    pub splits_returned: u64,
    /// Splits still waiting to be dealt again when the run ended.
    pub splits_pending: u64,
    /// Samples trained under grants that did not finish (trained again in the split's next deal).
    pub samples_replayed: u64,
    /// Every pass dealt and finished.
    #[serde(rename = "data_finished")]
    pub finished: bool,
}

/// The shards' data status (`--data-status-out`): `{"shards":[{"shard","counts":[[grant,split,samples]…],
/// "counts_evicted","dealer":{…,"completed":[[grant,split]…],"abandoned":[grant…],"leased":[[grant,split,
/// worker]…]}}…]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataStatusFile {
    /// One entry per shard.
    pub shards: Vec<ShardDataStatus>,
}

/// One shard's data status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardDataStatus {
    pub shard: u32,
    /// Samples trained per (grant, split).
    pub counts: Vec<[u64; 3]>,
    pub counts_evicted: u64,
    /// The coordinator's dealer (shard 0 only).
    pub dealer: Option<DealerStatus>,
}

/// The dealer's state in [`ShardDataStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DealerStatus {
    pub data_epoch: u64,
    pub splits_per_epoch: u64,
    pub splits_done: u64,
    pub splits_returned: u64,
    pub splits_pending: u64,
    pub samples_replayed: u64,
    pub finished: bool,
    /// (grant, split) of every finished split.
    pub completed: Vec<[u64; 2]>,
    /// Grants given up.
    pub abandoned: Vec<u64>,
    /// (grant, split, worker) of every lease.
    pub leased: Vec<[u64; 3]>,
}

/// Writes the shards' data status as JSON: [`DataStatusFile`].
fn write_data_status(path: &std::path::Path, status: &[gaps_common::wire::DataStatus]) -> Result<()> {
    let shards = status
        .iter()
        .map(|s| ShardDataStatus {
            shard: s.shard,
            counts: s.counts.iter().map(|c| [c.grant, c.split, c.samples]).collect(),
            counts_evicted: s.counts_evicted,
            dealer: s.dealer.as_ref().map(|d| DealerStatus {
                data_epoch: d.data_epoch,
                splits_per_epoch: d.splits_per_epoch,
                splits_done: d.splits_done,
                splits_returned: d.splits_returned,
                splits_pending: d.splits_pending,
                samples_replayed: d.samples_replayed,
                finished: d.finished,
                completed: d.completed.iter().map(|(g, k)| [*g, *k]).collect(),
                abandoned: d.abandoned.clone(),
                leased: d.leased.iter().map(|l| [l.grant, l.split, u64::from(l.worker)]).collect(),
            }),
        })
        .collect();
    let text = serde_json::to_string(&DataStatusFile { shards }).context("encoding the data status")?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
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
    /// was given (docs/manual.md, "Real-data defaults").
    pub fn tables(&self) -> gaps_server::cli::TableArgs {
        let mut tables = self.tables.clone();
        let repeats = self.data != "synthetic" && (self.epochs.is_some_and(|e| e > 1) || self.steps.is_some());
        if repeats && tables.sparse_adagrad_init.is_none() {
            tables.sparse_adagrad_init = Some(gaps_server::cli::REPEATED_PASSES_ADAGRAD_INIT);
        }
        // The shards share this machine: each gets its share of the default budget.
        if tables.table_memory.is_none() {
            tables.table_memory = Some(gaps_server::cli::default_table_memory() / u64::from(self.servers.max(1)));
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

/// What the CTR models add to the report.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CtrReport {
    /// Held-out AUC.
    pub auc: f64,
    /// AUC of the planted teacher on the same samples (synthetic data only).
    pub teacher_auc: Option<f64>,
    /// Held-out log-loss.
    pub logloss: f64,
    /// Training samples per second over all workers.
    pub samples_per_s: f64,
    /// Bad lines in the data file.
    pub bad_lines: u64,
    /// Embedding rows held by all shards.
    pub table_rows: u64,
    /// Bytes held by all shards' tables.
    pub table_bytes: u64,
    /// Passes over the data file (the furthest worker; 0 for synthetic data).
    pub epochs: f64,
    /// The held-out log-loss of the best constant predictor (the held-out click rate).
    pub constant_logloss: f64,
    /// Embedding-row gradients dropped as too stale in sync or gba, all shards.
    pub rows_dropped_stale: u64,
    /// Worker 0's held-out evaluations (`--eval-every`): (step, epochs, log-loss, AUC).
    pub heldout_curve: Vec<(u64, f64, f64, f64)>,
    /// Workers that stopped early (`--patience`).
    pub stopped_early: u32,
    /// The observer's evaluations during training (`--eval-interval`) and the final one: (seconds since
    /// training started, AUC, log-loss).
    pub timeline: Vec<(f64, f64, f64)>,
}

/// `gaps local --json`'s summary line: the run's [`LocalReport`] with the flags that shaped it. The data
/// dealer's fields are present with dynamic data sharding, the CTR fields with the CTR models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalSummary {
    /// Shards.
    pub servers: u32,
    /// Workers at the start.
    pub workers: u32,
    /// `--model`.
    pub model: String,
    /// The dense rule.
    pub rule: String,
    /// See [`LocalReport`] for this and the other counters.
    pub steps: u64,
    pub pushes_sent: u64,
    pub pushes_applied: u64,
    pub pushes_duplicate: u64,
    pub retries: u64,
    /// Held-out log-loss of the initial and final model (null if not a number).
    pub initial_loss: Option<f32>,
    pub final_loss: Option<f32>,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub staleness_mean: f64,
    pub staleness_max: u64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub wall_s: f64,
    /// `--mode`.
    pub mode: String,
    /// `--wire-dtype`.
    pub wire_dtype: String,
    pub mode_switches: u64,
    /// The coordinator's mode switches.
    pub switches: Vec<SwitchSummary>,
    pub switches_agree: bool,
    pub steps_sync: u64,
    pub steps_gba: u64,
    pub workers_final: u32,
    pub dropped_stale: u64,
    pub pushes_dropped_at_switch: u64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub lr_multiplier_final: f64,
    pub shard_restarts: u32,
    pub checkpoints_written: u64,
    pub restored_version: u64,
    pub pushes_acknowledged: u64,
    pub pushes_lost: u64,
    pub pushes_applied_twice: u64,
    pub pushes_unconfirmed: u64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub longest_step_s: f64,
    pub stale_after_restore: u64,
    /// `dynamic` or `static`.
    pub data_sharding: String,
    /// The dealer's account (dynamic data sharding).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub dealer: Option<DataReport>,
    /// The CTR figures.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub ctr: Option<CtrSummary>,
    /// Replicated shards (`--replicas` ≥ 2): `failovers`, `serving`, `backups_in_sync`, `spare_processes`,
    /// `failover_s`.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub replication: Option<ReplicationReport>,
}

/// One mode switch in [`LocalSummary`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchSummary {
    /// The decision's number.
    pub decision: u64,
    /// Mode before and after.
    pub from: String,
    pub to: String,
    /// First worker step run in the new mode.
    pub from_step: u64,
    /// Why the coordinator decided it.
    pub reason: String,
}

/// The CTR fields of [`LocalSummary`] (see [`CtrReport`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CtrSummary {
    /// `--sparse-rule`.
    pub sparse_rule: String,
    /// `--sparse-adagrad-init` in effect (0: none).
    pub sparse_adagrad_init: f32,
    /// `--data`.
    pub data: String,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
    pub teacher_auc: Option<f64>,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
    /// Rounded to a whole sample.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub samples_per_s: f64,
    pub bad_lines: u64,
    pub table_rows: u64,
    pub table_bytes: u64,
    /// Rounded to 3 decimals.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub epochs: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub constant_logloss: f64,
    pub rows_dropped_stale: u64,
    /// Worker 0's held-out evaluations.
    pub heldout_curve: Vec<HeldoutPoint>,
    pub stopped_early: u32,
    /// The observer's evaluations.
    pub timeline: Vec<TimelinePoint>,
}

/// One of worker 0's held-out evaluations (`--eval-every`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeldoutPoint {
    pub step: u64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub epochs: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
}

/// One of the observer's evaluations (`--eval-interval`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelinePoint {
    /// Seconds since training started.
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub t_s: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub auc: f64,
    #[serde(deserialize_with = "crate::reports::nan_if_null")]
    pub logloss: f64,
}

impl LocalReport {
    /// The summary with the flags that shaped the run.
    pub fn summary(&self, args: &LocalArgs) -> LocalSummary {
        let finite = |x: f32| x.is_finite().then_some(x);
        LocalSummary {
            servers: self.servers,
            workers: self.workers,
            model: args.model.name().into(),
            rule: args.rule().name().into(),
            steps: self.steps,
            pushes_sent: self.pushes_sent,
            pushes_applied: self.pushes_applied,
            pushes_duplicate: self.pushes_duplicate,
            retries: self.retries,
            initial_loss: finite(self.initial_loss),
            final_loss: finite(self.final_loss),
            staleness_mean: self.staleness_mean,
            staleness_max: self.staleness_max,
            wall_s: self.wall_s,
            mode: args.modes.mode.name().into(),
            wire_dtype: args.wire_dtype.name().into(),
            mode_switches: self.mode_switches,
            switches: self
                .switches
                .iter()
                .map(|s| SwitchSummary {
                    decision: s.number,
                    from: mode_name(s.from).into(),
                    to: mode_name(s.to).into(),
                    from_step: s.from_step,
                    reason: s.reason.clone(),
                })
                .collect(),
            switches_agree: self.switches_agree,
            steps_sync: self.steps_sync,
            steps_gba: self.steps_gba,
            workers_final: self.workers_final,
            dropped_stale: self.dropped_stale,
            pushes_dropped_at_switch: self.pushes_dropped_at_switch,
            lr_multiplier_final: self.lr_multiplier_final,
            shard_restarts: self.shard_restarts,
            checkpoints_written: self.checkpoints_written,
            restored_version: self.restored_version,
            pushes_acknowledged: self.pushes_acknowledged,
            pushes_lost: self.pushes_lost,
            pushes_applied_twice: self.pushes_applied_twice,
            pushes_unconfirmed: self.pushes_unconfirmed,
            longest_step_s: self.longest_step_s,
            stale_after_restore: self.stale_after_restore,
            data_sharding: if self.data.is_some() { "dynamic" } else { "static" }.into(),
            dealer: self.data.clone(),
            ctr: self.ctr.as_ref().map(|c| CtrSummary {
                sparse_rule: args.tables.sparse_rule.name().into(),
                sparse_adagrad_init: args.tables().sparse_adagrad_init.unwrap_or(0.0),
                data: args.data.clone(),
                auc: c.auc,
                teacher_auc: c.teacher_auc,
                logloss: c.logloss,
                samples_per_s: c.samples_per_s.round(),
                bad_lines: c.bad_lines,
                table_rows: c.table_rows,
                table_bytes: c.table_bytes,
                epochs: (c.epochs * 1000.0).round() / 1000.0,
                constant_logloss: c.constant_logloss,
                rows_dropped_stale: c.rows_dropped_stale,
                heldout_curve: c
                    .heldout_curve
                    .iter()
                    .map(|&(step, epochs, logloss, auc)| HeldoutPoint { step, epochs, logloss, auc })
                    .collect(),
                stopped_early: c.stopped_early,
                timeline: c.timeline.iter().map(|&(t_s, auc, logloss)| TimelinePoint { t_s, auc, logloss }).collect(),
            }),
            replication: self.replication.clone(),
        }
    }

    /// The JSON line: [`LocalSummary`].
    pub fn to_json(&self, args: &LocalArgs) -> String {
        crate::reports::line(&self.summary(args))
    }
}

pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    log: PathBuf,
}

impl Proc {
    pub(crate) fn log_tail(&self) -> String {
        Self::tail_of(&self.log)
    }

    fn tail_of(log: &Path) -> String {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        // The error and its causes matter here, not a backtrace after them.
        let text = text.split("\nStack backtrace:").next().unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

/// Starts `role` (`server` or `worker`) as `gaps ROLE …` from `exe`, or as the dedicated binary when one
/// was given.
fn spawn_role(exe: &Path, binary: Option<&Path>, name: &str, args: &[String], dir: &Path) -> Result<Proc> {
    match binary {
        Some(bin) => spawn(bin, name, &args[1..], dir),
        None => spawn(exe, name, args, dir),
    }
}

pub(crate) fn spawn(exe: &Path, name: &str, args: &[String], dir: &Path) -> Result<Proc> {
    let log = dir.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(log_file)).kill_on_drop(true);
    // The children get every setting as a flag; stray GAPS_* variables of the caller must not override them.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("GAPS_") && key != "GAPS_LOG" {
            cmd.env_remove(key);
        }
    }
    let child = cmd.spawn().with_context(|| format!("starting {name} ({})", exe.display()))?;
    Ok(Proc { name: name.to_string(), child, log })
}

/// Reads a worker's stdout while it runs, so that its per-step ledger never fills the pipe and stalls it, and
/// keeps only what the report needs: the last ledger line (`"pushes"`) and the summary (`worker_done`), in
/// the order printed. Memory stays bounded however long the run.
///
/// The ledger line comes after every step: the longest time between two of them, of any worker, goes to
/// `longest_step_us`.
fn drain_worker_output(
    p: &mut Proc,
    longest_step_us: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> tokio::task::JoinHandle<std::io::Result<String>> {
    let stdout = p.child.stdout.take();
    tokio::spawn(async move {
        let Some(stdout) = stdout else { return Ok(String::new()) };
        let mut lines = BufReader::new(stdout).lines();
        let (mut ledger, mut done) = (None, None);
        let mut last_step: Option<Instant> = None;
        while let Some(line) = lines.next_line().await? {
            if line.contains("worker_done") {
                done = Some(line);
            } else if line.contains("\"pushes\"") {
                ledger = Some(line);
                if let Some(t) = last_step.replace(Instant::now()) {
                    let us = t.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
                    longest_step_us.fetch_max(us, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        Ok(ledger.into_iter().chain(done).collect::<Vec<_>>().join("\n"))
    })
}

/// Reads a server's `listening` line: its address and the version it restored, if it restored.
pub(crate) async fn listening_addr(p: &mut Proc, timeout: Duration) -> Result<(String, Option<u64>)> {
    listening_reader(p, timeout)?.await.context("the listening line's reader")?
}

/// A server's address and the version it restored, if it restored.
pub(crate) type Listened = (String, Option<u64>);

/// [`listening_addr`] as a task of its own (a server started again may wait for others to start before it
/// serves; nothing else waits for it meanwhile).
pub(crate) fn listening_reader(p: &mut Proc, timeout: Duration) -> Result<tokio::task::JoinHandle<Result<Listened>>> {
    let stdout = p.child.stdout.take().context("server stdout")?;
    let (name, log) = (p.name.clone(), p.log.clone());
    Ok(tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(timeout, lines.next_line())
            .await
            .map_err(|_| anyhow!("{name} did not report its address within {timeout:?}"))?
            .context("reading server output")?;
        let Some(line) = line else {
            let tail = Proc::tail_of(&log);
            bail!("{name} exited before serving; its log ends with:\n{tail}");
        };
        let v: gaps_server::cli::Listening = serde_json::from_str(&line)
            .with_context(|| format!("{name}'s first line is not its listening line: {line:?}"))?;
        if v.event != gaps_server::cli::Listening::EVENT {
            bail!("{name}'s first line is a {:?} event, not its listening line", v.event);
        }
        Ok((v.addr, v.restored_version))
    }))
}

/// Checkpoint manifests present now, as (shard folder, file name).
fn checkpoint_files(dir: &Path) -> Vec<(String, String)> {
    let Ok(shards) = std::fs::read_dir(dir) else { return Vec::new() };
    shards
        .flatten()
        .flat_map(|shard| {
            let folder = shard.file_name().to_string_lossy().to_string();
            std::fs::read_dir(shard.path())
                .into_iter()
                .flatten()
                .flatten()
                .map(|f| f.file_name().to_string_lossy().to_string())
                .filter(|f| f.ends_with(".json"))
                .map(move |f| (folder.clone(), f))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn eval_loss(data: &SyntheticLogreg, tensors: &[Vec<f32>], n: u32) -> f32 {
    let (xs, ys) = data.batch(EVAL_BASE, n as usize);
    logreg_loss(tensors, &xs, &ys)
}

pub(crate) fn terminate(p: &Proc) {
    if let Some(pid) = p.child.id() {
        // SIGTERM lets the shard finish in-flight RPCs and close its endpoint cleanly.
        #[allow(unsafe_code)]
        // SAFETY: kill(2) with a pid we spawned and a valid signal number has no memory-safety effects.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
}

/// Where worker `w` of a run writes its `--step-log`.
fn step_log_part(dir: &Path, w: u32) -> PathBuf {
    dir.join(format!("steps-{w}.csv"))
}

/// Acknowledged pushes that no shard's state holds: for each worker and shard, what the worker saw
/// acknowledged beyond the shard's own count of that worker's pushes applied (a worker whose id is unknown
/// is held against nothing). Independent of the shards' totals, so a push applied twice cannot hide a lost one.
fn pushes_lost(acknowledged: &[(Option<u32>, Vec<u64>)], stats: &[gaps_common::wire::Stats]) -> u64 {
    let mut lost = 0;
    for (worker, per_shard) in acknowledged {
        let Some(worker) = worker else { continue };
        for (shard, acked) in per_shard.iter().enumerate() {
            let Some(st) = stats.iter().find(|s| s.shard as usize == shard) else { continue };
            let applied = match st.applied_by_worker.binary_search_by_key(worker, |a| a.worker) {
                Ok(i) => st.applied_by_worker[i].applied,
                Err(_) => 0,
            };
            lost += acked.saturating_sub(applied);
        }
    }
    lost
}

/// Concatenates the workers' step logs into `out` under one header; returns the steps written. A killed
/// worker's log may end in a partial line, which is left out.
fn merge_step_logs(dir: &Path, workers: u32, out: &Path) -> Result<u64> {
    let mut text = String::from("worker,seconds\n");
    let mut lines = 0;
    for w in 0..workers {
        let Ok(part) = std::fs::read_to_string(step_log_part(dir, w)) else { continue };
        let complete = part.rfind('\n').map_or("", |end| &part[..end]);
        for line in complete.lines().filter(|l| !l.is_empty() && !l.starts_with("worker")) {
            text.push_str(line);
            text.push('\n');
            lines += 1;
        }
    }
    std::fs::write(out, text).with_context(|| format!("writing the step log {}", out.display()))?;
    Ok(lines)
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

async fn run_in(args: &LocalArgs, exe: &Path, dir: &Path, started: Instant, deadline: Instant) -> Result<LocalReport> {
    let opts = gaps_transport::tls::CertOptions { shards: args.servers, ..Default::default() };
    let certs = ClusterCerts::make(&opts, None).context("making throwaway certificates")?;
    certs.write_to(dir)?;
    // The shards serve the built-in model through the same layout file a user would write.
    let size = ModelSize { dim: args.dim, embedding_dim: args.embedding_dim, hidden: args.hidden };
    let layout = args.model.layout(&size, args.chunk_elems()).context("building the model layout")?;
    std::fs::write(dir.join("layout.toml"), layout_file::write(&layout, layout_file::Format::Toml))
        .context("writing the layout file")?;
    let path = |f: &str| dir.join(f).display().to_string();
    let checkpoint_dir = match (&args.checkpoint_dir, args.checkpoint_every, args.restart_shards.is_empty()) {
        (Some(d), _, _) => Some(d.clone()),
        (None, Some(_), _) | (None, None, false) => Some(dir.join("checkpoints")),
        (None, None, true) => None,
    };
    let server_args = |shard: u32, coordinator: Option<&str>, listen: &str| {
        let mut a: Vec<String> = vec![
            "server".into(),
            format!("--shard-index={shard}"),
            format!("--num-shards={}", args.servers),
            format!("--listen={listen}"),
            format!("--ca={}", path("ca.pem")),
            format!("--cert={}", path(&format!("shard-{shard}.pem"))),
            format!("--key={}", path(&format!("shard-{shard}.key"))),
            format!("--layout={}", path("layout.toml")),
            format!("--rule={}", args.rule()),
            format!("--lr={}", args.lr()),
            format!("--init-std={}", args.init_std()),
            format!("--device={}", args.device),
            format!("--wire-dtype={}", args.wire_dtype),
            format!("--seed={}", args.seed),
            format!("--lease={}ms", args.lease.as_millis()),
            // Every worker connects from 127.0.0.1 (one connection per shard, plus a short-lived one to
            // register, the observer and added workers): the per-address limit must not refuse them.
            format!("--max-connections-per-ip={}", (2 * args.workers + 64).max(512)),
        ];
        if let Some(c) = coordinator {
            a.push(format!("--coordinator={c}"));
        }
        if let Some(d) = &checkpoint_dir {
            a.push(format!("--checkpoint-dir={}", d.display()));
        }
        if let Some(every) = args.checkpoint_every {
            a.push(format!("--checkpoint-every={}ms", every.as_millis()));
        }
        if args.replicas > 1 {
            a.push(format!("--replicas={}", args.replicas));
        }
        // The processes keeping a copy of the coordinator need its data cut the same way to copy its dealer.
        let copies_coordinator =
            gaps_server::replication::backed_up_by(shard, args.servers, args.replicas).contains(&0);
        if (shard == 0 || copies_coordinator) && args.deals_data() {
            a.push(format!("--data={}", args.data));
            a.push(format!("--split-lines={}", args.split_lines));
            a.push(format!("--data-epochs={}", args.data_epochs()));
        }
        a.extend(args.hyper.to_flags());
        a.extend(args.tables().to_flags());
        a.extend(args.modes.to_flags());
        a
    };
    let mut servers = Vec::new();
    let mut workers: Vec<Proc> = Vec::new();
    let longest_step_us = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let outcome = async {
        eprintln!("[gaps local] starting {} shard(s) and {} worker(s) on 127.0.0.1", args.servers, args.workers);
        let mut s0 = spawn_role(exe, args.server_bin.as_deref(), "shard-0", &server_args(0, None, "127.0.0.1:0"), dir)?;
        let coordinator = listening_addr(&mut s0, Duration::from_secs(30)).await?.0;
        servers.push(s0);
        let mut addrs = vec![coordinator.clone()];
        for s in 1..args.servers {
            let mut p = spawn_role(
                exe,
                args.server_bin.as_deref(),
                &format!("shard-{s}"),
                &server_args(s, Some(&coordinator), "127.0.0.1:0"),
                dir,
            )?;
            addrs.push(listening_addr(&mut p, Duration::from_secs(30)).await?.0);
            servers.push(p);
        }
        let observer_tls = certs.worker_material()?;
        let mut opts = ClientOptions::new(&coordinator, observer_tls, Role::Observer, "gaps-local");
        opts.connect_timeout = Duration::from_secs(30);
        let observer = Client::connect(opts).await.context("connecting to the cluster as an observer")?;
        let data = SyntheticLogreg::new(args.dim as usize, args.seed);
        let data_spec: DataSpec = match args.data.parse().map_err(anyhow::Error::msg)? {
            DataSpec::Synthetic { .. } => DataSpec::Synthetic { seed: args.seed },
            file => file,
        };
        let ctr = match args.model.ctr() {
            Some(model) => {
                let shape = CtrShape::from_layout(model, observer.layout()).map_err(anyhow::Error::msg)?;
                let held = held_out(&data_spec, args.eval_samples as usize).map_err(anyhow::Error::msg)?;
                Some((shape, held))
            }
            None => None,
        };
        let initial_loss = match &ctr {
            Some((shape, held)) => {
                evaluate(&observer, shape, &held.samples).await.context("evaluating the initial model")?.0 as f32
            }
            None => eval_loss(
                &data,
                &observer.pull().await.context("pulling the initial model")?.tensors,
                args.eval_samples,
            ),
        };
        eprintln!(
            "[gaps local] cluster up in {:.1}s; initial held-out loss {initial_loss:.4}",
            started.elapsed().as_secs_f64()
        );

        let worker_args = |w: u32| {
            let mut a: Vec<String> = vec![
                "worker".into(),
                format!("--coordinator={coordinator}"),
                format!("--ca={}", path("ca.pem")),
                format!("--cert={}", path("worker.pem")),
                format!("--key={}", path("worker.key")),
                format!("--model={}", args.model.name()),
                format!("--batch={}", args.batch()),
                format!("--data-seed={}", args.seed),
                format!("--data={}", args.data),
                format!("--data-shard={}/{}", w % args.workers, args.workers),
                format!("--data-sharding={}", args.data_sharding),
                format!("--name=worker-{w}"),
                // Hundreds of worker processes starting at once on a small machine take a while to join:
                // a fifth of a second each, 30 s at least.
                format!("--connect-timeout={}ms", (200 * u64::from(args.workers)).max(30_000)),
                format!("--compute-delay={}ms", args.compute_delay().as_millis()),
                format!("--shard-down-timeout={}ms", args.shard_down_timeout.as_millis()),
                format!("--lanes={}", args.lanes),
                "--json".into(),
                "--ledger".into(),
            ];
            a.extend(args.steps().map(|n| format!("--steps={n}")));
            a.extend(args.epochs.map(|n| format!("--epochs={n}")));
            if args.eval_every > 0 {
                a.push(format!("--eval-every={}", args.eval_every));
                a.push(format!("--eval-samples={}", args.eval_samples));
                a.push(format!("--patience={}", args.patience));
            }
            if args.step_log.is_some() {
                a.push(format!("--step-log={}", step_log_part(dir, w).display()));
            }
            for st in args.stragglers.iter().filter(|st| st.worker == w) {
                a.push(format!("--slowdown={}", st.factor));
                if let Some(until) = st.until {
                    a.push(format!("--slowdown-for={}ms", until.as_millis()));
                }
            }
            a
        };
        let mut readers = Vec::new();
        for w in 0..args.workers {
            workers.push(spawn_role(exe, args.worker_bin.as_deref(), &format!("worker-{w}"), &worker_args(w), dir)?);
            readers.extend(workers.last_mut().map(|p| drain_worker_output(p, longest_step_us.clone())));
        }
        // A worker's dense push goes to every shard every step (empty where the shard owns none of its
        // chunks); a CTR step also pushes embedding rows to every shard (rows spread over all of them).
        let per_step = u64::from(args.servers) * if args.ctr() { 2 } else { 1 };
        let expected = args.steps().map(|n| u64::from(args.workers + args.add_workers.len() as u32) * n * per_step);
        let training_started = Instant::now();
        let interactive = std::io::stderr().is_terminal();
        let mut last_decile = 0;
        let mut kills: Vec<Kill> = args.kill_workers.clone();
        let mut adds: Vec<Duration> = args.add_workers.clone();
        let mut outputs: Vec<Option<String>> = Vec::new();
        let mut killed = Vec::new();
        let mut shard_kills: Vec<Kill> = args.kill_shards.clone();
        // Replicated shards: whether every shard's backups counted once (kills wait for it).
        let mut copies_ready = false;
        // Per shard, how much later than asked its last kill came (a restart keeps its distance from it).
        let mut kill_delay: std::collections::BTreeMap<u32, Duration> = std::collections::BTreeMap::new();
        // Replicated shards: for each shard killed, a task that measures how long until a backup serves it.
        let mut failover_watches: Vec<tokio::task::JoinHandle<Option<f64>>> = Vec::new();
        let mut shard_restarts_due: Vec<Kill> = args.restart_shards.clone();
        let (mut shard_restarts, mut restored_version) = (0u32, 0u64);
        let mut restarts_of: std::collections::BTreeMap<usize, u32> = std::collections::BTreeMap::new();
        // The listening lines of the servers started again, read as they come.
        let mut restart_reports = Vec::new();
        let mut checkpoints_seen = std::collections::BTreeSet::new();
        let mut timeline: Vec<(f64, f64, f64)> = Vec::new();
        loop {
            let since = training_started.elapsed();
            if let Some(d) = &checkpoint_dir {
                checkpoints_seen.extend(checkpoint_files(d));
            }
            // With copies, kills wait until every shard's backups count (a copy still catching up could not
            // take over: the run would not test a fail-over), at the start and after a restart; bounded by a
            // minute from the start.
            let kills_due = shard_kills.iter().any(|k| k.at <= since);
            if kills_due && args.replicas > 1 && !copies_ready {
                let map = tokio::time::timeout(Duration::from_secs(1), observer.current_map()).await;
                let counted = |m: &gaps_common::wire::ClusterMap| {
                    let shard0_listed = args.replicas >= 2 && args.servers >= 3;
                    m.shards.iter().filter(|s| s.index != 0 || shard0_listed).all(|s| !s.backups.is_empty())
                };
                copies_ready =
                    matches!(&map, Ok(Ok(m)) if counted(m)) || training_started.elapsed() > Duration::from_secs(60);
            }
            let kills_now: Vec<Kill> = if args.replicas > 1 && !copies_ready {
                Vec::new()
            } else {
                shard_kills.iter().filter(|k| k.at <= since).cloned().collect()
            };
            // The shards' replica epochs before the kills (a take-over raises one), asked once for all the
            // kills due now (kills due together come together) and for at most 1 s.
            let watched = |k: &Kill| args.replicas > 1 && (k.index != 0 || (args.replicas >= 2 && args.servers >= 3));
            let epochs_before = if kills_now.iter().any(watched) {
                tokio::time::timeout(Duration::from_secs(1), observer.current_map()).await.ok().and_then(Result::ok)
            } else {
                None
            };
            for k in &kills_now {
                // A server started again that is killed before it reported is not waited for.
                restart_reports.retain(|(i, r): &(usize, tokio::task::JoinHandle<_>)| {
                    let killed = *i == k.index as usize;
                    if killed {
                        r.abort();
                    }
                    !killed
                });
                if let Some(p) = servers.get_mut(k.index as usize) {
                    let watched = watched(k);
                    let before = epochs_before.as_ref().and_then(|m| m.shards.get(k.index as usize).map(|s| s.epoch));
                    eprintln!("[gaps local] killing shard {} (SIGKILL) at {:.1}s", k.index, since.as_secs_f64());
                    let _ = p.child.start_kill();
                    let _ = p.child.wait().await;
                    if watched {
                        // One entry per shard killed, in kill order: unknown when the epoch before was.
                        failover_watches.push(match before {
                            Some(before) => tokio::spawn(watch_failover(observer.clone(), k.index, before)),
                            None => tokio::spawn(async { None }),
                        });
                    }
                }
            }
            for k in &kills_now {
                kill_delay.insert(k.index, since.saturating_sub(k.at));
            }

            shard_kills.retain(|k| !kills_now.contains(k));
            // A shard is started again only once it was killed.
            let restarts_now: Vec<Kill> = shard_restarts_due
                .iter()
                .filter(|k| {
                    let delay = kill_delay.get(&k.index).copied().unwrap_or_default();
                    k.at + delay <= since && !shard_kills.iter().any(|x| x.index == k.index && x.at <= k.at)
                })
                .cloned()
                .collect();
            // Every restart due now starts before any is waited for: a whole cluster started again settles who
            // serves shard 0 among its processes before they serve.
            let mut restarted = Vec::new();
            for k in &restarts_now {
                let i = k.index as usize;
                let addr = addrs[i].clone();
                eprintln!("[gaps local] restarting shard {i} on {addr} at {:.1}s", since.as_secs_f64());
                // Process 0 restarted where a majority moves the coordinator asks process 1 where it is now.
                let moves = args.replicas >= 2 && args.servers >= 3;
                let coordinator_arg = match i {
                    0 if moves => Some(addrs[1].as_str()),
                    0 => None,
                    _ => Some(coordinator.as_str()),
                };
                let p = spawn_role(
                    exe,
                    args.server_bin.as_deref(),
                    // A shard started again more than once keeps each life's log.
                    &match restarts_of.entry(i).and_modify(|n| *n += 1).or_insert(1) {
                        1 => format!("shard-{i}-restart"),
                        n => format!("shard-{i}-restart-{n}"),
                    },
                    &server_args(i as u32, coordinator_arg, &addr),
                    dir,
                )?;
                restarted.push((i, p));
            }
            for (i, mut p) in restarted {
                // A process started again may wait for the others (up to its join timeout, twice: to settle who
                // serves shard 0, then to join) before it serves.
                restart_reports.push((i, listening_reader(&mut p, Duration::from_secs(150))?));
                shard_restarts += 1;
                servers[i] = p;
            }
            // Kills after a restart wait for the copies to count again (the process started again copies).
            copies_ready &= restarts_now.is_empty();
            shard_restarts_due.retain(|k| !restarts_now.contains(k));
            // Injected failures and arrivals.
            for k in kills.iter().filter(|k| k.at <= since) {
                if let Some(p) = workers.get_mut(k.index as usize) {
                    eprintln!("[gaps local] killing worker {} at {:.1}s", k.index, since.as_secs_f64());
                    let _ = p.child.start_kill();
                    killed.push(k.index as usize);
                }
            }
            kills.retain(|k| k.at > since);
            for _ in adds.iter().filter(|t| **t <= since) {
                let w = workers.len() as u32;
                eprintln!("[gaps local] adding worker {w} at {:.1}s", since.as_secs_f64());
                workers.push(spawn_role(
                    exe,
                    args.worker_bin.as_deref(),
                    &format!("worker-{w}"),
                    &worker_args(w),
                    dir,
                )?);
                readers.extend(workers.last_mut().map(|p| drain_worker_output(p, longest_step_us.clone())));
            }
            adds.retain(|t| *t > since);
            outputs.resize(workers.len(), None);
            for (i, p) in workers.iter_mut().enumerate() {
                if outputs[i].is_some() {
                    continue;
                }
                if let Some(status) = p.child.try_wait().with_context(|| format!("waiting for {}", p.name))? {
                    if !status.success() && !killed.contains(&i) {
                        bail!("{} failed ({status}); its log ends with:\n{}", p.name, p.log_tail());
                    }
                    let text = (&mut readers[i]).await.context("worker output reader")?;
                    outputs[i] = Some(text.with_context(|| format!("reading {}'s output", p.name))?);
                }
            }
            // A server started again that does not come up fails the run.
            let mut pending = Vec::new();
            for (i, report) in restart_reports.drain(..) {
                if !report.is_finished() {
                    pending.push((i, report));
                    continue;
                }
                let (_, restored) = report.await.context("the listening line's reader")??;
                restored_version = restored_version.max(restored.unwrap_or(0));
            }
            restart_reports = pending;
            if outputs.iter().all(Option::is_some)
                && kills.is_empty()
                && adds.is_empty()
                && shard_kills.is_empty()
                && shard_restarts_due.is_empty()
                && restart_reports.is_empty()
            {
                break;
            }
            if Instant::now() >= deadline {
                bail!("timed out after {:?} waiting for the workers", started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let (Some(every), Some((shape, held))) = (args.eval_interval, &ctr) {
                let due = every.as_secs_f64() * (timeline.len() + 1) as f64;
                if training_started.elapsed().as_secs_f64() >= due {
                    let at = training_started.elapsed().as_secs_f64();
                    // Best effort, as progress: a shard that is down skips the point.
                    if let Ok(Ok((logloss, auc))) = tokio::time::timeout(
                        every.max(Duration::from_secs(1)),
                        evaluate(&observer, shape, &held.samples),
                    )
                    .await
                    {
                        timeline.push((at, auc, logloss));
                    }
                }
            }
            if since.as_millis() / 500 != training_started.elapsed().as_millis() / 500 {
                // Progress is best effort: a shard that is down must not hold up the schedule.
                let stats = tokio::time::timeout(Duration::from_millis(500), observer.stats()).await;
                let applied: u64 = match stats {
                    Ok(Ok(s)) => s.iter().map(|x| x.pushes_applied).sum(),
                    _ => 0,
                };
                match expected {
                    Some(expected) => {
                        let pct = 100 * applied / expected.max(1);
                        if interactive {
                            eprint!("\r[gaps local] training: {applied}/{expected} shard pushes applied ({pct}%)   ");
                        } else if pct / 10 > last_decile {
                            last_decile = pct / 10;
                            eprintln!("[gaps local] training: {applied}/{expected} shard pushes applied ({pct}%)");
                        }
                    }
                    None if interactive => eprint!("\r[gaps local] training: {applied} shard pushes applied   "),
                    None => {}
                }
            }
        }
        if interactive {
            eprintln!();
        }
        let outputs: Vec<String> = outputs.into_iter().map(Option::unwrap_or_default).collect();
        let training_s = training_started.elapsed().as_secs_f64();
        if let Some(path) = &args.step_log {
            let lines = merge_step_logs(dir, workers.len() as u32, path)?;
            eprintln!("[gaps local] {lines} step times of {} workers written to {}", workers.len(), path.display());
        }
        let mut steps = 0;
        let mut pushes_sent = 0;
        let mut pushes_acknowledged = 0;
        let mut stale_after_restore = 0;
        let mut retries = 0;
        let mut samples = 0;
        let mut bad_lines = 0;
        let mut epochs = 0.0f64;
        let mut heldout_curve = Vec::new();
        let mut stopped_early = 0u32;
        let mut workers_final = 0;
        let mut pushes_unconfirmed = 0;
        let mut acknowledged_by = Vec::new();
        for (i, (p, text)) in workers.iter().zip(&outputs).enumerate() {
            if killed.contains(&i) {
                // Its ledger up to the last step it finished; the step it was in when killed may have sent
                // up to a step's pushes that nobody saw acknowledged (applied or not). A line cut short by
                // the kill is not a ledger line.
                let last = text.lines().rev().find_map(|l| serde_json::from_str::<PushLedger>(l).ok());
                if let Some(l) = last {
                    pushes_sent += l.pushes_sent;
                    pushes_acknowledged += l.pushes_acknowledged;
                    stale_after_restore += l.stale_after_restore;
                    acknowledged_by.push((l.worker, l.acknowledged_by_shard));
                }
                pushes_unconfirmed += per_step;
                continue;
            }
            workers_final += 1;
            let line = text
                .lines()
                .rev()
                .find(|l| l.contains("worker_done"))
                .with_context(|| format!("{} printed no summary", p.name))?;
            let w: WorkerSummary =
                serde_json::from_str(line).with_context(|| format!("{}'s summary {line:?}", p.name))?;
            steps += w.steps;
            pushes_sent += w.pushes_sent;
            pushes_acknowledged += w.pushes_acknowledged;
            acknowledged_by.push((Some(w.worker), w.acknowledged_by_shard));
            stale_after_restore += w.stale_after_restore;
            retries += w.retries;
            samples += w.samples;
            // A fixed share is read from the whole file (every worker meets every bad line); dealt splits are
            // read by one worker each (first pass only).
            bad_lines = match w.data_sharding {
                DataSharding::Dynamic => bad_lines + w.bad_lines,
                DataSharding::Static => bad_lines.max(w.bad_lines),
            };
            epochs = epochs.max(w.epochs);
            stopped_early += u32::from(w.stopped_early);
            if heldout_curve.is_empty() {
                heldout_curve = w.heldout_curve.iter().map(|p| (p.step, p.epochs, p.logloss, p.auc)).collect();
            }
        }
        let stats = observer.stats().await.context("reading shard counters")?;
        // The replica sets are reported as far as the coordinator answers: a run whose training finished is
        // not failed for want of them.
        let map = if args.replicas > 1 {
            match observer.current_map().await {
                Ok(map) => Some(map),
                Err(e) => {
                    eprintln!("[gaps local] could not read the coordinator's replica sets for the summary: {e}");
                    None
                }
            }
        } else {
            None
        };
        let replication = if let Some(map) = map {
            let mut report = ReplicationReport::from_map(&map);
            report.replica_lag_peak = stats.iter().map(|s| s.replica_lag_peak).collect();
            report.rereplication =
                stats.iter().map(|s| s.replica_copies.iter().map(CopyReport::of).collect()).collect();
            // A fail-over still under way when training ended gets 10 s more to finish.
            for mut watch in failover_watches {
                let took = tokio::time::timeout(Duration::from_secs(10), &mut watch).await;
                watch.abort();
                report.failover_s.push(took.ok().and_then(|r| r.ok()).flatten());
            }
            Some(report)
        } else {
            failover_watches.iter().for_each(tokio::task::JoinHandle::abort);
            None
        };
        let data_report = if args.deals_data() {
            let status = observer.data_status().await.context("reading the data dealer's state")?;
            if let Some(out) = &args.data_status_out {
                write_data_status(out, &status)?;
            }
            status.first().and_then(|s| s.dealer.as_ref()).map(|d| DataReport {
                splits_done: d.splits_done,
                splits_per_epoch: d.splits_per_epoch,
                splits_returned: d.splits_returned,
                splits_pending: d.splits_pending,
                samples_replayed: d.samples_replayed,
                finished: d.finished,
            })
        } else {
            None
        };
        let (final_loss, ctr_report) = match &ctr {
            Some((shape, held)) => {
                let (logloss, auc) =
                    evaluate(&observer, shape, &held.samples).await.context("evaluating the final model")?;
                let labels: Vec<u8> = held.samples.iter().map(|s| s.label).collect();
                let (teacher, eval_bad) = (&held.teacher, &held.bad_lines);
                let report = CtrReport {
                    auc,
                    teacher_auc: teacher.as_ref().map(|p| gaps_models::criteo::auc(p, &labels)),
                    logloss,
                    samples_per_s: samples as f64 / training_s.max(1e-9),
                    bad_lines: bad_lines.max(*eval_bad),
                    table_rows: stats.iter().map(|s| s.table_rows).sum(),
                    table_bytes: stats.iter().map(|s| s.table_bytes).sum(),
                    epochs,
                    constant_logloss: constant_logloss(&labels),
                    rows_dropped_stale: stats.iter().map(|s| s.rows_dropped_stale).sum(),
                    heldout_curve,
                    stopped_early,
                    timeline: {
                        let mut t = timeline.clone();
                        t.push((training_s, auc, logloss));
                        t
                    },
                };
                (logloss as f32, Some(report))
            }
            None => {
                let final_model = observer.pull().await.context("pulling the final model")?;
                (eval_loss(&data, &final_model.tensors, args.eval_samples), None)
            }
        };
        observer.close().await;
        if let Some(d) = &checkpoint_dir {
            checkpoints_seen.extend(checkpoint_files(d));
        }
        let count: u64 = stats.iter().map(|s| s.staleness_count).sum();
        let pushes_applied: u64 = stats.iter().map(|s| s.pushes_applied).sum();
        let switches = stats.first().map(|s| s.switches.clone()).unwrap_or_default();
        let key = |s: &gaps_common::wire::ModeSwitchRecord| (s.number, s.from, s.to, s.from_step);
        let switches_agree = stats.iter().all(|st| {
            let theirs: Vec<_> = st.switches.iter().map(key).collect();
            let ours: Vec<_> = switches.iter().map(key).filter(|k| theirs.first().is_none_or(|f| k.0 >= f.0)).collect();
            theirs == ours
        });
        for s in &switches {
            eprintln!(
                "[gaps local] mode switch {}: {} -> {} from worker step {} ({})",
                s.number,
                mode_name(s.from),
                mode_name(s.to),
                s.from_step,
                s.reason
            );
        }
        Ok(LocalReport {
            servers: args.servers,
            workers: args.workers,
            steps,
            pushes_sent,
            pushes_applied,
            pushes_duplicate: stats.iter().map(|s| s.pushes_duplicate).sum(),
            retries,
            initial_loss,
            final_loss,
            staleness_mean: stats.iter().map(|s| s.staleness_sum).sum::<u64>() as f64 / count.max(1) as f64,
            staleness_max: stats.iter().map(|s| s.staleness_max).max().unwrap_or(0),
            wall_s: 0.0,
            ctr: ctr_report,
            mode_switches: stats.first().map_or(0, |s| s.mode_switches),
            switches,
            switches_agree,
            steps_sync: stats.first().map_or(0, |s| s.steps_sync),
            steps_gba: stats.first().map_or(0, |s| s.steps_gba),
            workers_final,
            dropped_stale: stats.iter().map(|s| s.dropped_stale).sum(),
            pushes_dropped_at_switch: stats.iter().map(|s| s.pushes_dropped_at_switch).sum(),
            replication,
            lr_multiplier_final: stats.first().map_or(1.0, |s| f64::from(s.lr_multiplier_milli) / 1000.0),
            shard_restarts,
            checkpoints_written: checkpoints_seen.len() as u64,
            restored_version,
            pushes_acknowledged,
            pushes_lost: pushes_lost(&acknowledged_by, &stats),
            pushes_applied_twice: stats.iter().map(|s| s.pushes_applied_twice).sum(),
            pushes_unconfirmed,
            longest_step_s: Duration::from_micros(longest_step_us.load(std::sync::atomic::Ordering::Relaxed))
                .as_secs_f64(),
            stale_after_restore,
            data: data_report,
        })
    }
    .await;
    // Stop everything, successful or not: workers first (only still running after a failure), then shards.
    for p in workers.iter_mut() {
        let _ = p.child.start_kill();
    }
    for p in &servers {
        terminate(p);
    }
    for p in servers.iter_mut() {
        match tokio::time::timeout(Duration::from_secs(10), p.child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => eprintln!("[gaps local] {} stopped with {status}", p.name),
            _ => {
                eprintln!("[gaps local] {} did not stop within 10 s; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
    let mut report = outcome?;
    report.wall_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The `--mode` name of a mode's wire code.
fn mode_name(code: u8) -> &'static str {
    gaps_shard::modes::Mode::from_code(code).map_or("unknown", |m| m.name())
}

/// The log-loss of the best constant predictor on `labels` (their own click rate): what a model must beat
/// to have learned anything.
fn constant_logloss(labels: &[u8]) -> f64 {
    let n = labels.len().max(1) as f64;
    let p = (labels.iter().map(|l| f64::from(*l)).sum::<f64>() / n).clamp(1e-7, 1.0 - 1e-7);
    -(p * p.ln() + (1.0 - p) * (1.0 - p).ln())
}
