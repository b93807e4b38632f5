//! `gaps bench e2e`: end-to-end training throughput of the DLRM-style model through `gaps local` (real
//! shard and worker processes on loopback, mutual TLS) for several cluster shapes, each as a ratio to a
//! single-process baseline measured in the same run: the workers' own DLRM code (batches, id dedup,
//! forward/backward) and the shards' own update rules and embedding table, called directly in one thread
//! with no parameter server.

use crate::local::{run_with, LocalArgs};
use anyhow::{Context, Result};
use clap::Parser;
use std::path::Path;

#[derive(Debug, Parser)]
struct Wrapper {
    #[command(flatten)]
    args: LocalArgs,
}

/// One measured cluster shape.
#[derive(Debug, Clone, PartialEq)]
pub struct E2eResult {
    /// Shards.
    pub servers: u32,
    /// Workers.
    pub workers: u32,
    /// Copies of each shard (`--replicas`; 1: none).
    pub replicas: u32,
    /// Training samples per second over all workers.
    pub samples_per_s: f64,
    /// Held-out AUC at the end.
    pub auc: f64,
    /// Samples per second as a ratio to the single-process baseline of the same run.
    pub ratio: f64,
    /// Samples per second as a ratio to each single-process PyTorch run of the same sitting (`--torch`):
    /// (threads, ratio).
    pub torch_ratios: Vec<(u32, f64)>,
}

impl E2eResult {
    /// The shape's name: `dlrm_SxW`, with `_rR` for R copies of each shard.
    pub fn name(&self) -> String {
        match self.replicas {
            1 => format!("dlrm_{}x{}", self.servers, self.workers),
            r => format!("dlrm_{}x{}_r{r}", self.servers, self.workers),
        }
    }

    /// The JSON line.
    pub fn to_json(&self) -> String {
        /// One cluster shape's JSON line (rounded as printed).
        #[derive(serde::Serialize)]
        struct Line {
            case: String,
            servers: u32,
            workers: u32,
            replicas: u32,
            samples_per_s: f64,
            auc: f64,
            ratio: f64,
            /// Threads of the PyTorch run ("1t", "2t") → this shape's samples/s ÷ PyTorch's.
            #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
            ratio_torch: std::collections::BTreeMap<String, f64>,
        }
        crate::reports::line(&Line {
            ratio_torch: self
                .torch_ratios
                .iter()
                .map(|(threads, r)| (format!("{threads}t"), (r * 1000.0).round() / 1000.0))
                .collect(),
            case: self.name(),
            servers: self.servers,
            workers: self.workers,
            replicas: self.replicas,
            samples_per_s: self.samples_per_s.round(),
            auc: (self.auc * 10_000.0).round() / 10_000.0,
            ratio: (self.ratio * 1000.0).round() / 1000.0,
        })
    }
}

/// The single-process baseline's result.
#[derive(Debug, Clone, PartialEq)]
pub struct BaselineResult {
    /// Samples trained.
    pub samples: u64,
    /// Training samples per second (the training loop only; evaluation excluded).
    pub samples_per_s: f64,
    /// Held-out AUC at the end (the same held-out samples as the clusters').
    pub auc: f64,
    /// Held-out log-loss at the end.
    pub logloss: f64,
}

impl BaselineResult {
    /// The JSON line.
    pub fn to_json(&self) -> String {
        /// The baseline's JSON line (rounded as printed).
        #[derive(serde::Serialize)]
        struct Line {
            case: &'static str,
            samples: u64,
            samples_per_s: f64,
            auc: f64,
            logloss: f64,
        }
        crate::reports::line(&Line {
            case: "dlrm_single_process",
            samples: self.samples,
            samples_per_s: self.samples_per_s.round(),
            auc: (self.auc * 10_000.0).round() / 10_000.0,
            logloss: (self.logloss * 10_000.0).round() / 10_000.0,
        })
    }
}

/// A single-process PyTorch DLRM of the same shape, data and optimizers (python/benches/torch_baseline.py),
/// as its JSON line says.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TorchResult {
    /// `torch_dlrm_<threads>t`.
    pub case: String,
    /// torch's intra-op threads.
    pub threads: u32,
    /// Steps trained.
    pub steps: u64,
    /// Samples trained.
    pub samples: u64,
    /// Training samples per second (the training loop only).
    pub samples_per_s: f64,
    /// Held-out AUC and log-loss at the end (the clusters' held-out samples).
    pub auc: f64,
    /// Held-out log-loss.
    pub logloss: f64,
    /// torch's version.
    pub torch: String,
}

/// Where to find PyTorch for `gaps bench e2e --torch`: an interpreter that imports `torch` and `gaps`,
/// and the baseline script.
#[derive(Debug, Clone)]
pub struct TorchBaseline {
    /// The Python interpreter.
    pub python: std::path::PathBuf,
    /// python/benches/torch_baseline.py.
    pub script: std::path::PathBuf,
    /// The thread counts to run it at.
    pub threads: Vec<u32>,
}

impl TorchBaseline {
    /// Runs the script at `threads` threads for `steps` steps and reads its JSON line.
    pub fn run(&self, threads: u32, steps: u64) -> Result<TorchResult> {
        let out = std::process::Command::new(&self.python)
            .arg(&self.script)
            .args(["--steps", &steps.to_string(), "--threads", &threads.to_string()])
            .arg(format!("--eval-samples={EVAL_SAMPLES}"))
            .output()
            .with_context(|| format!("running {} {}", self.python.display(), self.script.display()))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        // The last 2,000 bytes or so, cut at a character boundary.
        let cut = (stderr.len().saturating_sub(2000)..=stderr.len()).find(|i| stderr.is_char_boundary(*i)).unwrap_or(0);
        let tail = &stderr[cut..];
        anyhow::ensure!(out.status.success(), "the PyTorch baseline failed ({}):\n{tail}", out.status);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.trim_start().starts_with('{'))
            .with_context(|| format!("the PyTorch baseline printed no JSON line:\n{stdout}\n{tail}"))?;
        serde_json::from_str(line).with_context(|| format!("reading the PyTorch baseline's line {line:?}"))
    }
}

/// The flags `gaps local` gets for the DLRM runs of this bench.
fn local_args(servers: u32, workers: u32, replicas: u32, steps: u64) -> Result<LocalArgs> {
    let argv = ["local", "--model", "dlrm", "--data", "synthetic"]
        .iter()
        .map(|s| s.to_string())
        .chain([
            format!("--servers={servers}"),
            format!("--workers={workers}"),
            format!("--replicas={replicas}"),
            format!("--steps={steps}"),
            format!("--eval-samples={EVAL_SAMPLES}"),
        ])
        .collect::<Vec<_>>();
    Ok(Wrapper::try_parse_from(&argv).context("building the local-cluster flags")?.args)
}

/// The cluster shapes (shards, workers, copies of each shard) `gaps bench e2e` measures. On one machine each
/// shard adds a round trip per pull and per push to every step, so with few cores one shard serving several
/// workers trains fastest (1×4 measured 1.19× the single process on 2 cores, 2×4 1.00–1.03×). 2×4 with
/// `--replicas 2` right after 2×4 without gives the copies' cost in the same run.
pub const SHAPES: &[(u32, u32, u32)] = &[(1, 1, 1), (1, 4, 1), (2, 2, 1), (2, 4, 1), (2, 4, 2)];

/// Held-out samples of every run.
const EVAL_SAMPLES: u32 = 4096;

/// Trains DLRM as a `gaps local` run with `args` would, on `steps` batches of worker 0's data stream, in
/// this thread: the model starts from the shards' initial values, dense tensors are updated with the
/// cluster's dense rule and η, embedding rows live in the shards' table type with the sparse rule, η and
/// initializer. Nothing crosses a socket, nothing is serialized, nothing waits.
pub fn single_process(args: &LocalArgs, steps: u64) -> Result<BaselineResult> {
    use gaps_kernels::{Bufs, PushScalars};
    use gaps_models::criteo::{held_out, DataSpec, TrainingStream};
    use gaps_models::recsys::{forward, index_batch, sigmoid, CtrShape};
    use gaps_shard::sparse::{Eviction, SparseTable, TableConfig};

    let model = args.model.ctr().context("the baseline trains a CTR model")?;
    let shape = CtrShape { model, embedding_dim: args.embedding_dim, hidden: args.hidden };
    let layout = shape.layout(args.chunk_elems())?;
    let init = gaps_shard::core::Init { seed: args.seed, std: args.init_std() };
    let mut dense = init.tensors(&layout)?;
    let (rule, hyper) = (args.rule(), args.hyper.hyper(args.lr())?);
    let planes = rule.layout();
    anyhow::ensure!(
        planes.worker_planes == 0 && !planes.needs_read && !planes.lookahead && !planes.worker_momentum,
        "the single-process baseline runs rules without per-worker state or read echo, not {rule}"
    );
    let mut state: Vec<Vec<f32>> = dense.iter().map(|t| vec![0.0; t.len() * planes.shared_planes]).collect();
    let sparse = args.tables.settings(&hyper)?;
    let mut table = SparseTable::new(TableConfig {
        table: 0,
        dim: shape.row_dim() as u32,
        rule: sparse.rule,
        init_std: sparse.init_std,
        adagrad_init: sparse.adagrad_init,
        seed: args.seed,
        admit_after: sparse.admit_after,
        memory_budget: None,
        eviction: Eviction::Lru,
    })?;
    let sparse_needs_read = sparse.rule.layout().needs_read;
    let spec = DataSpec::Synthetic { seed: args.seed };
    let mut stream = TrainingStream::new(&spec, 0, 1).map_err(anyhow::Error::msg)?;
    let batch = args.batch() as usize;
    let (mut values, mut versions, mut logits) = (Vec::new(), Vec::new(), Vec::new());
    let mut grads: Vec<Vec<f32>> = dense.iter().map(|t| vec![0.0; t.len()]).collect();
    let mut row_grads = Vec::new();
    let started = std::time::Instant::now();
    let mut samples_done = 0u64;
    for step in 0..steps {
        let samples = stream.next_batch(batch).map_err(anyhow::Error::msg)?;
        let indexed = index_batch(&samples);
        values.clear();
        versions.clear();
        table.pull(&indexed.ids, 0, &mut values, &mut versions);
        grads.iter_mut().for_each(|g| g.iter_mut().for_each(|v| *v = 0.0));
        row_grads.clear();
        row_grads.resize(values.len(), 0.0);
        forward(&shape, &dense, &values, &indexed, &samples, &mut logits, Some((&mut grads, &mut row_grads)));
        for ((params, st), grad) in dense.iter_mut().zip(&mut state).zip(&grads) {
            let n = params.len();
            let (s0, s1) = st.split_at_mut(if planes.shared_planes >= 1 { n } else { 0 });
            let bufs = Bufs { params, s0, s1, w0: &mut [], grad, read: &[] };
            let scalars = PushScalars::fresh(hyper.lr, step + 1);
            gaps_kernels::apply(rule, &hyper, &scalars, bufs)?;
        }
        let reads: &[f32] = if sparse_needs_read { &values } else { &[] };
        table.push(
            &indexed.ids,
            &versions,
            &row_grads,
            reads,
            &sparse.hyper,
            PushScalars::fresh(sparse.hyper.lr, 1),
            0,
        )?;
        samples_done += samples.len() as u64;
    }
    let samples_per_s = samples_done as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let held = held_out(&spec, args.eval_samples as usize).map_err(anyhow::Error::msg)?;
    let (mut scores, mut loss) = (Vec::with_capacity(held.samples.len()), 0.0f64);
    for part in held.samples.chunks(4096) {
        let indexed = index_batch(part);
        values.clear();
        versions.clear();
        table.peek(&indexed.ids, &mut values, &mut versions);
        loss += f64::from(forward(&shape, &dense, &values, &indexed, part, &mut logits, None));
        scores.extend(logits.iter().map(|z| sigmoid(*z)));
    }
    let labels: Vec<u8> = held.samples.iter().map(|s| s.label).collect();
    Ok(BaselineResult {
        samples: samples_done,
        samples_per_s,
        auc: gaps_models::criteo::auc(&scores, &labels),
        logloss: loss / held.samples.len().max(1) as f64,
    })
}

/// What `gaps bench e2e` measured: the single-process baseline, the PyTorch runs (with `--torch`) and the
/// cluster shapes.
#[derive(Debug)]
pub struct E2eRun {
    /// gaps' own single-process baseline.
    pub baseline: BaselineResult,
    /// The single-process PyTorch runs, one per thread count.
    pub torch: Vec<TorchResult>,
    /// The cluster shapes.
    pub shapes: Vec<E2eResult>,
}

/// Runs the single-process baseline (`steps` batches) and, with `torch`, the PyTorch one at each thread
/// count, then DLRM on synthetic data for each (servers, workers) shape with `steps` steps per worker, each
/// reported as a ratio to the baselines.
pub async fn run(exe: &Path, shapes: &[(u32, u32, u32)], steps: u64, torch: Option<&TorchBaseline>) -> Result<E2eRun> {
    let base_args = local_args(1, 1, 1, steps)?;
    let baseline = tokio::task::spawn_blocking(move || single_process(&base_args, steps))
        .await
        .context("the single-process baseline panicked")??;
    let mut torch_runs = Vec::new();
    for (torch, &threads) in torch.iter().flat_map(|t| t.threads.iter().map(move |n| (*t, n))) {
        let torch = torch.clone();
        torch_runs.push(
            tokio::task::spawn_blocking(move || torch.run(threads, steps))
                .await
                .context("the PyTorch run panicked")??,
        );
    }
    let mut out = Vec::new();
    for &(servers, workers, replicas) in shapes {
        let args = local_args(servers, workers, replicas, steps)?;
        let report = run_with(&args, exe).await?;
        let ctr = report.ctr.context("a CTR run reports samples per second")?;
        out.push(E2eResult {
            servers,
            workers,
            replicas,
            samples_per_s: ctr.samples_per_s,
            auc: ctr.auc,
            ratio: ctr.samples_per_s / baseline.samples_per_s.max(1e-9),
            torch_ratios: torch_runs
                .iter()
                .map(|t| (t.threads, ctr.samples_per_s / t.samples_per_s.max(1e-9)))
                .collect(),
        });
    }
    Ok(E2eRun { baseline, torch: torch_runs, shapes: out })
}
