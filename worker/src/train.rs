//! The training loop of one worker: pull, compute the gradient on the next batch, push, repeat (after the
//! first step the pull comes with the push's answer: `Client::push_pull`).

use crate::client::{Client, ClientOptions};
use crate::data::SyntheticLogreg;
use crate::model::{logreg_loss_and_grad, ModelKind};
use anyhow::{Context, Result};
use gaps_common::config::parse_duration;
use gaps_common::wire::Role;
use gaps_transport::tls::TlsMaterial;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod ctr;
pub use ctr::evaluate_ctr;
use ctr::run_ctr;
use tracing::info;

/// Flags of `gaps-worker` (and of `gaps worker`). Every flag also reads a `GAPS_*` environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Address (`host:port`) of the coordinator, shard 0.
    #[arg(long, env = "GAPS_COORDINATOR")]
    pub coordinator: String,
    /// The cluster CA certificate (PEM).
    #[arg(long, env = "GAPS_CA")]
    pub ca: PathBuf,
    /// This worker's certificate (PEM), signed by the cluster CA.
    #[arg(long, env = "GAPS_CERT")]
    pub cert: PathBuf,
    /// This worker's private key (PEM).
    #[arg(long, env = "GAPS_KEY")]
    pub key: PathBuf,
    /// The model to train; must match what the servers hold.
    #[arg(long, env = "GAPS_MODEL", default_value = "logreg")]
    pub model: ModelKind,
    /// Training steps (one pull, one gradient, one push each). Default: 200 on synthetic data; with a data
    /// file, as many as `--epochs` take.
    #[arg(long, env = "GAPS_STEPS")]
    pub steps: Option<u64>,
    /// Passes over this worker's share of a data file (default: 1 unless `--steps` is given, which then
    /// starts over at the end of the file as often as it takes). Synthetic data has no passes.
    #[arg(long, env = "GAPS_EPOCHS", value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: Option<u64>,
    /// Samples per step.
    #[arg(long, env = "GAPS_BATCH", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub batch: u32,
    /// Training data of the CTR models: `synthetic` or the path of a Criteo-layout TSV file.
    #[arg(long, env = "GAPS_DATA", default_value = "synthetic")]
    pub data: crate::criteo::DataSpec,
    /// How this worker gets its training data. `dynamic`: it asks the coordinator for one split at a time
    /// (a range of lines, or of synthetic samples) and asks again when it has pushed it, so a fast worker
    /// trains on more of the data than a slow one; a coordinator started without `--data` deals nothing, and
    /// the worker then reads its fixed share (with a warning). `static`: it reads its fixed share,
    /// `--data-shard`, whatever the coordinator deals (every mode is then as slow as the slowest worker's
    /// share).
    #[arg(long, env = "GAPS_DATA_SHARDING", default_value = "dynamic")]
    pub data_sharding: DataSharding,
    /// This worker's share of a data file under `--data-sharding static`, `I/N`: lines whose number is I
    /// modulo N.
    #[arg(long, env = "GAPS_DATA_SHARD", default_value = "0/1", value_parser = parse_shard)]
    pub data_shard: (u64, u64),
    /// Seed of the synthetic dataset (same on every worker and the servers' evaluator).
    #[arg(long, env = "GAPS_DATA_SEED", default_value_t = 1)]
    pub data_seed: u64,
    /// Emulated compute time added to every step (for demos and tests of straggler handling).
    #[arg(long, env = "GAPS_COMPUTE_DELAY", default_value = "0ms", value_parser = parse_duration)]
    pub compute_delay: Duration,
    /// Make this worker a straggler: every step's compute takes this many times as long.
    #[arg(long, env = "GAPS_SLOWDOWN", default_value_t = 1.0)]
    pub slowdown: f64,
    /// Straggle only for this long after training starts (default: the whole run).
    #[arg(long, env = "GAPS_SLOWDOWN_FOR", value_parser = parse_duration)]
    pub slowdown_for: Option<Duration>,
    /// How long to wait for the coordinator and a complete cluster.
    #[arg(long, env = "GAPS_CONNECT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// How long a shard may stay unreachable (restarting, say) before this worker gives up and exits with
    /// an error naming it; until then it retries and logs which shard it waits for.
    #[arg(long, env = "GAPS_SHARD_DOWN_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub shard_down_timeout: Duration,
    /// Connections to each shard that a large push or pull is striped over by chunk (1 to 64; stripes are
    /// at least 512 KiB). For hosts where one connection's packet work fills a core while others idle; on
    /// loopback with 2 cores, 1 measured fastest.
    #[arg(long, env = "GAPS_LANES", default_value_t = crate::client::DEFAULT_LANES as u32, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub lanes: u32,
    /// Threads of the runtime that carries this worker's traffic, beside the training loop on the
    /// program's main thread (0: one per lane with `--lanes` above 1; with one lane none: the training
    /// thread drives its connections itself while it awaits a step, and heartbeats go from a thread of
    /// their own). More pay for a large model spread over many shards, whose packet work fills a core.
    #[arg(long, env = "GAPS_WORKER_IO_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub io_threads: u32,
    /// Name in logs.
    #[arg(long, env = "GAPS_NAME", default_value = "worker")]
    pub name: String,
    /// Evaluate the cluster's model on the held-out samples every this many steps (0: never). CTR models
    /// only; the curve is in the `--json` summary.
    #[arg(long, env = "GAPS_EVAL_EVERY", default_value_t = 0)]
    pub eval_every: u64,
    /// Held-out samples of those evaluations: every 10th line of a data file, or the synthetic
    /// generator's evaluation range.
    #[arg(long, env = "GAPS_EVAL_SAMPLES", default_value_t = 5_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub eval_samples: u32,
    /// Early stopping: stop once the held-out log-loss has not improved on its best for this many
    /// evaluations in a row (0: evaluate without stopping).
    #[arg(long, env = "GAPS_PATIENCE", default_value_t = 3)]
    pub patience: u32,
    /// Print a one-line JSON summary on stdout at the end.
    #[arg(long, env = "GAPS_JSON")]
    pub json: bool,
    /// Also print a JSON line with the push counters after every step (`{"event":"pushes",…}`), so that a
    /// supervisor can account for the pushes of a worker that is killed before its summary (`gaps local`).
    #[arg(long, env = "GAPS_LEDGER")]
    pub ledger: bool,
    /// Write this worker's time per step to this file (created or truncated): a `worker,seconds` header, then
    /// one line per step with the cluster's id of this worker and its seconds per step. CTR models: from the
    /// step's pulls to its pushes' acknowledgements, computing (emulated delays included) and the round
    /// trips, not the waits for a synchronous step; logreg: from the pulled parameters to the pushed
    /// gradient. `gaps sim --profile` replays such a file.
    #[arg(long, env = "GAPS_STEP_LOG")]
    pub step_log: Option<PathBuf>,
}

/// How a worker gets its training data (`--data-sharding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSharding {
    /// Splits dealt by the coordinator to whoever asks.
    Dynamic,
    /// A fixed share per worker (line number modulo the worker count).
    Static,
}

impl std::str::FromStr for DataSharding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "dynamic" => Ok(DataSharding::Dynamic),
            "static" => Ok(DataSharding::Static),
            other => Err(format!("unknown data sharding {other:?}; use dynamic or static")),
        }
    }
}

impl std::fmt::Display for DataSharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataSharding::Dynamic => "dynamic",
            DataSharding::Static => "static",
        })
    }
}

/// The `--step-log` writer. A write error stops the log with a warning (training goes on).
#[derive(Debug)]
pub struct StepLog {
    out: Option<std::io::BufWriter<std::fs::File>>,
    worker: u32,
    path: PathBuf,
}

impl StepLog {
    /// Opens the log of `path` for `worker` (None: no log).
    pub fn open(path: Option<&Path>, worker: u32) -> Result<Self> {
        let out = match path {
            Some(p) => {
                let file =
                    std::fs::File::create(p).with_context(|| format!("creating the step log {}", p.display()))?;
                let mut out = std::io::BufWriter::new(file);
                writeln!(out, "worker,seconds").with_context(|| format!("writing the step log {}", p.display()))?;
                Some(out)
            }
            None => None,
        };
        Ok(StepLog { out, worker, path: path.map(Path::to_path_buf).unwrap_or_default() })
    }

    /// Records one step's computing time.
    pub fn record(&mut self, took: Duration) {
        if let Some(out) = self.out.as_mut() {
            if let Err(e) = writeln!(out, "{},{:.6}", self.worker, took.as_secs_f64()) {
                tracing::warn!(path = %self.path.display(), %e, "the step log failed; no more steps are logged");
                self.out = None;
            }
        }
    }

    /// Flushes the log to its file.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(out) = self.out.as_mut() {
            out.flush().with_context(|| format!("writing the step log {}", self.path.display()))?;
        }
        Ok(())
    }
}

/// Prints the push ledger line of `--ledger` (stdout is line-buffered: each line is out before the next
/// step starts).
fn ledger_line(args: &WorkerArgs, client: &crate::Client, step: u64) {
    if args.ledger {
        let line = PushLedger {
            step,
            pushes_sent: client.pushes_sent(),
            pushes_acknowledged: client.pushes_acknowledged(),
            acknowledged_by_shard: client.pushes_acknowledged_by_shard(),
            worker: client.worker_id(),
            stale_after_restore: client.stale_after_restore(),
        };
        if let Ok(text) = serde_json::to_string(&line) {
            println!("{text}");
        }
    }
}

/// The `--ledger` line a worker prints after every step (`{"event":"pushes",…}`): what a run that kills
/// it reads back as its last word.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "event", rename = "pushes")]
pub struct PushLedger {
    /// Steps completed.
    pub step: u64,
    /// Shard pushes sent.
    pub pushes_sent: u64,
    /// Shard pushes acknowledged.
    pub pushes_acknowledged: u64,
    /// The same per shard, in shard order.
    pub acknowledged_by_shard: Vec<u64>,
    /// The worker id (None before it registered).
    pub worker: Option<u32>,
    /// Shard pushes a restored shard refused.
    pub stale_after_restore: u64,
}

/// Floats that may be NaN (a loss before any step, an evaluation that diverged): JSON has no NaN, so they
/// are written as null and read back as NaN.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// [`nan_as_null`] for f32.
mod nan_as_null_f32 {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        super::nan_as_null::serialize(&f64::from(*v), s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        Ok(super::nan_as_null::deserialize(d)? as f32)
    }
}

/// Sleeps the emulated compute time of a step that really took `took`, scaled by the injected slowdown while
/// it lasts.
async fn emulate_compute(args: &WorkerArgs, started: Instant, took: Duration) {
    let slow =
        args.slowdown > 1.0 && args.slowdown.is_finite() && args.slowdown_for.is_none_or(|d| started.elapsed() < d);
    let base = args.compute_delay + took;
    let total = if slow { base.mul_f64(args.slowdown) } else { base };
    let extra = total.saturating_sub(took);
    if !extra.is_zero() {
        tokio::time::sleep(extra).await;
    }
}

fn parse_shard(text: &str) -> Result<(u64, u64), String> {
    let (i, n) = text.split_once('/').ok_or_else(|| format!("{text:?}: expected I/N, e.g. 0/4"))?;
    let (i, n): (u64, u64) = (
        i.trim().parse().map_err(|_| format!("{text:?}: bad I"))?,
        n.trim().parse().map_err(|_| format!("{text:?}: bad N"))?,
    );
    if n == 0 || i >= n {
        return Err(format!("{text:?}: need 0 ≤ I < N"));
    }
    Ok((i, n))
}

/// What a worker did, printed as one JSON line with `--json` (`{"event":"worker_done",…}`); readers
/// deserialize it, so a field missing or renamed is an error, not a silent 0.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "event", rename = "worker_done")]
pub struct WorkerSummary {
    /// Worker id given by the coordinator.
    pub worker: u32,
    /// Steps completed.
    pub steps: u64,
    /// Shard pushes sent (each once, retries not counted).
    pub pushes_sent: u64,
    /// Shard pushes acknowledged by their shard.
    pub pushes_acknowledged: u64,
    /// The same per shard, in shard order.
    pub acknowledged_by_shard: Vec<u64>,
    /// Shard pushes a restored shard refused (computed before its restore; dropped, not lost silently).
    pub stale_after_restore: u64,
    /// Requests resent after transport failures.
    pub retries: u64,
    /// Mean training loss of the first step.
    #[serde(with = "nan_as_null_f32")]
    pub first_loss: f32,
    /// Mean training loss over the last (up to) 10 steps.
    #[serde(with = "nan_as_null_f32")]
    pub last_loss: f32,
    /// Wall-clock seconds from connecting to leaving.
    pub wall_s: f64,
    /// Training samples processed.
    pub samples: u64,
    /// Bad lines in the data file (first pass; 0 for synthetic data).
    pub bad_lines: u64,
    /// Passes over the data file (complete ones plus the share of the current one; 0 for synthetic data).
    pub epochs: f64,
    /// The held-out evaluations of `--eval-every`, in order.
    pub heldout_curve: Vec<HeldOutPoint>,
    /// Training ended because the held-out log-loss stopped improving (`--patience`).
    pub stopped_early: bool,
    /// How the worker got its data (dynamic falls back to static where the coordinator deals nothing).
    pub data_sharding: DataSharding,
    /// Splits dealt to this worker (dynamic sharding).
    pub splits: u64,
}

/// One held-out evaluation during training.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HeldOutPoint {
    /// Steps this worker had completed.
    pub step: u64,
    /// Passes over the data file by then (three decimals).
    pub epochs: f64,
    /// Held-out log-loss of the cluster's model.
    #[serde(with = "nan_as_null")]
    pub logloss: f64,
    /// Held-out AUC.
    #[serde(with = "nan_as_null")]
    pub auc: f64,
}

/// Early stopping on a held-out curve: the best log-loss so far, and how many evaluations in a row failed
/// to improve on it by more than 1e-4 (relative).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EarlyStop {
    patience: u32,
    best: f64,
    since_best: u32,
}

impl EarlyStop {
    /// Stops after `patience` evaluations without improvement (0: never).
    pub fn new(patience: u32) -> Self {
        EarlyStop { patience, best: f64::INFINITY, since_best: 0 }
    }

    /// Records one evaluation; true when training should stop. A NaN loss counts as no improvement.
    pub fn record(&mut self, logloss: f64) -> bool {
        if logloss < self.best * (1.0 - 1e-4) {
            self.best = logloss;
            self.since_best = 0;
        } else {
            self.since_best += 1;
        }
        self.patience > 0 && self.since_best >= self.patience
    }

    /// The best log-loss seen.
    pub fn best(&self) -> f64 {
        self.best
    }
}

impl WorkerArgs {
    /// The step limit and the pass limit of this run: synthetic data runs `--steps` (200); a file runs
    /// `--epochs` passes (1 when neither is given), or `--steps`, whichever ends first.
    pub fn limits(&self) -> (Option<u64>, Option<u64>) {
        match (&self.data, self.steps, self.epochs) {
            (crate::criteo::DataSpec::Synthetic { .. }, steps, epochs) => (Some(steps.unwrap_or(200)), epochs),
            (_, None, None) => (None, Some(1)),
            (_, steps, epochs) => (steps, epochs),
        }
    }
}

impl WorkerSummary {
    /// The summary of a finished run: losses per step (the first, and the mean of the last 10).
    fn new(client: &crate::Client, worker: u32, losses: &[f32], started: Instant, samples: u64) -> Self {
        let tail = &losses[losses.len().saturating_sub(10)..];
        WorkerSummary {
            worker,
            steps: losses.len() as u64,
            pushes_sent: client.pushes_sent(),
            pushes_acknowledged: client.pushes_acknowledged(),
            acknowledged_by_shard: client.pushes_acknowledged_by_shard(),
            stale_after_restore: client.stale_after_restore(),
            retries: client.retries(),
            first_loss: losses.first().copied().unwrap_or(f32::NAN),
            last_loss: tail.iter().sum::<f32>() / tail.len().max(1) as f32,
            wall_s: started.elapsed().as_secs_f64(),
            samples,
            bad_lines: 0,
            epochs: 0.0,
            heldout_curve: Vec::new(),
            stopped_early: false,
            data_sharding: DataSharding::Static,
            splits: 0,
        }
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"event\":\"error\",\"message\":\"{e}\"}}"))
    }
}

/// On SIGHUP, reloads the CA, certificate and key from their files (certificate rotation): new
/// connections use them.
fn spawn_tls_reload(args: &WorkerArgs, client: &Client) {
    #[cfg(unix)]
    {
        let (client, ca, cert, key) = (client.clone(), args.ca.clone(), args.cert.clone(), args.key.clone());
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut hup) = signal(SignalKind::hangup()) else { return };
            while hup.recv().await.is_some() {
                let loaded = TlsMaterial::load(&ca, &cert, &key)
                    .map_err(anyhow::Error::from)
                    .and_then(|tls| client.reload_tls(&tls).map_err(anyhow::Error::from));
                match loaded {
                    Ok(()) => info!(cert = %cert.display(), "reloaded the TLS material"),
                    Err(e) => tracing::warn!(error = format!("{e:#}"), "kept the old TLS material"),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (args, client);
}

impl WorkerArgs {
    /// The threads of the worker's runtime: `--io-threads`, or one per lane (`--lanes`) when there are
    /// several, none for one (the default: a current-thread runtime, `gaps_transport::runtime::build`).
    pub fn runtime_threads(&self) -> usize {
        let role = gaps_transport::runtime::IoRole::Worker { lanes: self.lanes as usize };
        gaps_transport::runtime::io_threads(self.io_threads as usize, role)
    }
}

/// Runs one worker to completion.
pub async fn run(args: &WorkerArgs) -> Result<WorkerSummary> {
    if args.epochs.is_some() && args.model.ctr().is_none() {
        anyhow::bail!("--epochs counts passes over a data file; --model logreg trains on synthetic data (use --steps)");
    }
    if args.eval_every > 0 && args.model.ctr().is_none() {
        anyhow::bail!("--eval-every evaluates the CTR models (lr, fm, dlrm) on held-out samples; logreg has none");
    }
    let tls = TlsMaterial::load(&args.ca, &args.cert, &args.key).context("loading the worker's TLS material")?;
    let mut opts = ClientOptions::new(&args.coordinator, tls, Role::Worker, &args.name);
    opts.connect_timeout = args.connect_timeout;
    opts.shard_down_timeout = args.shard_down_timeout;
    opts.lanes = args.lanes as usize;
    let client = Client::connect(opts).await.context("joining the cluster")?;
    spawn_tls_reload(args, &client);
    let worker = client.worker_id().context("the coordinator gave no worker id")?;
    if let Some(model) = args.model.ctr() {
        return run_ctr(args, client, worker, model).await;
    }
    let dim = args.model.dim_from_layout(client.layout()).map_err(anyhow::Error::msg)?;
    info!(worker, dim, shards = client.map().num_shards, "joined the cluster");
    let data = SyntheticLogreg::new(dim as usize, args.data_seed);
    let lease = Duration::from_millis(u64::from(client.map().lease_ms));
    let heartbeats = client.start_heartbeats((lease / 3).max(Duration::from_millis(100)))?;
    let steps = args.steps.unwrap_or(200);
    let mut step_log = StepLog::open(args.step_log.as_deref(), worker)?;
    let started = Instant::now();
    let mut losses = Vec::with_capacity(steps as usize);
    let batch = args.batch as usize;
    // The first step pulls; every later one reads the values its previous push was answered with
    // (`Client::push_pull`: one request per shard and step).
    let mut pulled = None;
    for step in 0..steps {
        let snapshot = match pulled.take() {
            Some(snapshot) => snapshot,
            None => client.pull().await.with_context(|| format!("pulling parameters at step {step}"))?,
        };
        let first = (u64::from(worker) << 40) + step * batch as u64;
        let compute = Instant::now();
        let (xs, ys) = data.batch(first, batch);
        let (loss, grads) = logreg_loss_and_grad(&snapshot.tensors, &xs, &ys);
        losses.push(loss);
        emulate_compute(args, started, compute.elapsed()).await;
        step_log.record(compute.elapsed());
        let pushed = if step + 1 < steps {
            client.push_pull(grads, &snapshot).await.map(|(_, next)| pulled = Some(next))
        } else {
            client.push(grads, &snapshot).await.map(drop)
        };
        pushed.with_context(|| format!("pushing the gradient of step {step}"))?;
        snapshot.recycle();
        ledger_line(args, &client, step + 1);
        if steps >= 10 && (step + 1) % (steps / 10) == 0 {
            info!(worker, step = step + 1, loss, "progress");
        }
    }
    heartbeats.stop().await;
    step_log.finish()?;
    client.leave().await.context("leaving the cluster")?;
    Ok(WorkerSummary::new(&client, worker, &losses, started, steps * batch as u64))
}

#[cfg(test)]
mod tests {
    use super::{DataSharding, EarlyStop, HeldOutPoint, PushLedger, WorkerArgs, WorkerSummary};

    #[test]
    fn a_workers_runtime_has_a_thread_a_lane_unless_told_and_none_for_one_lane() {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: WorkerArgs,
        }
        let threads = |flags: &[&str]| {
            let base = ["w", "--coordinator=127.0.0.1:1", "--ca=ca", "--cert=c", "--key=k"];
            let all: Vec<&str> = base.iter().chain(flags).copied().collect();
            <Wrap as clap::Parser>::try_parse_from(all).map(|w| w.args.runtime_threads()).map_err(|e| e.to_string())
        };
        assert_eq!(threads(&[]), Ok(0), "one lane: the training thread drives the connections");
        assert_eq!(threads(&["--io-threads=1"]), Ok(1));
        assert_eq!(threads(&["--lanes=4"]), Ok(4));
        assert_eq!(threads(&["--lanes=4", "--io-threads=2"]), Ok(2));
        assert_eq!(threads(&["--io-threads=3"]), Ok(3));
        assert!(threads(&["--io-threads=5000"]).is_err(), "more than 1024 threads is refused");
    }

    #[test]
    fn the_summary_and_the_ledger_read_back_as_written_and_a_missing_field_is_an_error() {
        let w = WorkerSummary {
            worker: 3,
            steps: 10,
            pushes_sent: 20,
            pushes_acknowledged: 19,
            acknowledged_by_shard: vec![10, 9],
            stale_after_restore: 1,
            retries: 2,
            first_loss: f32::NAN,
            last_loss: 0.25,
            wall_s: 1.5,
            samples: 2560,
            bad_lines: 4,
            epochs: 1.25,
            heldout_curve: vec![HeldOutPoint { step: 5, epochs: 0.5, logloss: 0.5, auc: f64::NAN }],
            stopped_early: false,
            data_sharding: DataSharding::Dynamic,
            splits: 7,
        };
        let line = w.to_json();
        assert!(line.starts_with("{\"event\":\"worker_done\""), "{line}");
        assert!(line.contains("\"data_sharding\":\"dynamic\"") && line.contains("\"first_loss\":null"), "{line}");
        let back: WorkerSummary = serde_json::from_str(&line).expect("reads back");
        assert!(back.first_loss.is_nan() && back.heldout_curve[0].auc.is_nan());
        assert_eq!((back.worker, back.acknowledged_by_shard.clone(), back.splits), (3, vec![10, 9], 7));
        // A renamed or missing field fails loudly instead of reading as 0.
        let renamed = line.replace("\"pushes_acknowledged\"", "\"pushes_acked\"");
        let err = serde_json::from_str::<WorkerSummary>(&renamed).expect_err("missing field");
        assert!(err.to_string().contains("pushes_acknowledged"), "{err}");
        // Another event is not a summary.
        let ledger = PushLedger {
            step: 4,
            pushes_sent: 8,
            pushes_acknowledged: 8,
            acknowledged_by_shard: vec![4, 4],
            worker: Some(3),
            stale_after_restore: 0,
        };
        let text = serde_json::to_string(&ledger).expect("json");
        assert!(text.starts_with("{\"event\":\"pushes\""), "{text}");
        assert_eq!(serde_json::from_str::<PushLedger>(&text).expect("back"), ledger);
        assert!(serde_json::from_str::<WorkerSummary>(&text).is_err());
        assert!(serde_json::from_str::<PushLedger>(&text[..text.len() - 3]).is_err(), "a line cut short");
    }

    #[test]
    fn early_stop_waits_patience_evaluations_after_the_best() {
        let mut e = EarlyStop::new(2);
        assert!(!e.record(0.60));
        assert!(!e.record(0.50));
        assert!(!e.record(0.49995), "a gain under 1e-4 relative is no improvement");
        assert!(e.record(0.52), "second evaluation without improvement");
        assert_eq!(e.best(), 0.50);
        let mut never = EarlyStop::new(0);
        assert!((0..10).all(|i| !never.record(f64::from(i))));
        let mut nan = EarlyStop::new(1);
        assert!(!nan.record(0.7));
        assert!(nan.record(f64::NAN), "NaN is no improvement");
    }
}
