//! `gaps`: the front door — run a local cluster, make certificates, run benches, or act as one server or
//! worker process.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// gaps: a sharded, asynchronous parameter server with staleness-correcting updates, over QUIC with
/// mutual TLS.
#[derive(Debug, Parser)]
#[command(name = "gaps", version, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    config: gaps_setup::ConfigArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole cluster of real server and worker processes on 127.0.0.1 with throwaway certificates,
    /// train the built-in model, report, and stop everything.
    Local(gaps_cli::local::LocalArgs),
    /// Start shards for a layout file on this machine and keep them running (for a Python training script):
    /// prints the coordinator's address and a worker's credentials.
    Cluster(gaps_cli::cluster::ClusterArgs),
    /// Simulate asynchronous training with N virtual workers and virtual time, deterministically.
    Sim(SimCommand),
    /// Make a cluster CA plus server and worker certificates in a folder.
    Certs(CertsArgs),
    /// Print a built-in model's layout file, for `gaps-server --layout` (and as a start for your own).
    Layout(LayoutArgs),
    /// Write synthetic Criteo-layout training data (TSV) with a planted logistic teacher, e.g. a file of
    /// realistic cardinality: `--lines 500000 --max-vocab 2000000`.
    SynthData(SynthDataArgs),
    /// Ask every shard of a running cluster to write a checkpoint now (shards need --checkpoint-dir).
    Checkpoint(CheckpointArgs),
    /// Measure performance.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run one server shard (the same as the `gaps-server` binary).
    Server(gaps_server::cli::ServerArgs),
    /// Run one worker (the same as the `gaps-worker` binary).
    Worker(gaps_worker::train::WorkerArgs),
    /// Print every command's flags as Markdown (docs/reference/flags.md), or one command's as JSON.
    #[command(hide = true)]
    Reference(ReferenceArgs),
}

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct SimCommand {
    #[command(subcommand)]
    experiments: Option<SimSub>,
    #[command(flatten)]
    args: gaps_sim::SimArgs,
}

#[derive(Debug, Subcommand)]
enum SimSub {
    /// Run the reproductions E1–E6 of docs/ALGORITHMS.md §7 and write docs/results/.
    Experiments {
        /// The reduced grid (η 0.05, 3 seeds): about a minute on 2 cores.
        #[arg(long, env = "GAPS_SIM_QUICK")]
        quick: bool,
        /// Where to write experiments.md and e1.svg.
        #[arg(long, env = "GAPS_SIM_OUT", default_value = "docs/results")]
        out: PathBuf,
    },
    /// How many workers are worth having: simulated time to a target metric for each worker count and
    /// mode, beside the stability bound π/(2·η·h_max) of the delay analysis.
    Sweep(gaps_sim::sweep::SweepArgs),
}

#[derive(Debug, clap::Args)]
struct CertsArgs {
    /// Folder to write the certificates into: ca.pem/ca.key, shard-<i>.pem/.key, <worker>.pem/.key. When it
    /// already holds ca.pem and ca.key, that CA issues the new certificates (to add shards or workers).
    #[arg(long, env = "GAPS_CERTS_OUT", default_value = "gaps-certs")]
    out: PathBuf,
    /// The cluster's name, written into every certificate: clusters that share a CA cannot talk. Default:
    /// the name in the folder's shard-0.pem when it has one, else `gaps`.
    #[arg(long, env = "GAPS_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// Shard certificates to issue (shard-0 … shard-<N-1>); each lets its holder be only that shard.
    #[arg(long, env = "GAPS_CERTS_SHARDS", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    shards: u32,
    /// Worker certificates to issue, by name (repeatable; `worker` by default).
    #[arg(long = "worker", env = "GAPS_CERTS_WORKERS", value_delimiter = ',', default_value = "worker")]
    workers: Vec<String>,
    /// Extra DNS names or IP addresses for the shard certificates (repeatable). Every shard certificate
    /// already carries `gaps-server`, `localhost` and `127.0.0.1`.
    #[arg(long = "san", env = "GAPS_CERTS_SAN", value_delimiter = ',')]
    sans: Vec<String>,
    /// How long the shard and worker certificates are valid.
    #[arg(long, env = "GAPS_CERTS_VALIDITY", default_value = "365d", value_parser = gaps_common::config::parse_duration)]
    validity: std::time::Duration,
    /// How long a new CA is valid.
    #[arg(long, env = "GAPS_CERTS_CA_VALIDITY", default_value = "3650d", value_parser = gaps_common::config::parse_duration)]
    ca_validity: std::time::Duration,
}

#[derive(Debug, clap::Args)]
struct CheckpointArgs {
    /// The coordinator's (shard 0's) address.
    #[arg(long, env = "GAPS_COORDINATOR")]
    coordinator: String,
    /// The cluster CA certificate (PEM).
    #[arg(long, env = "GAPS_CA")]
    ca: PathBuf,
    /// A client certificate (PEM) signed by the cluster CA.
    #[arg(long, env = "GAPS_CERT")]
    cert: PathBuf,
    /// Its private key (PEM).
    #[arg(long, env = "GAPS_KEY")]
    key: PathBuf,
}

#[derive(Debug, clap::Args)]
struct SynthDataArgs {
    /// Lines to write (every 10th is the held-out split when the file is trained on).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 36)))]
    lines: u64,
    /// Values of the largest categorical field (fields grow geometrically from 8).
    #[arg(long, default_value_t = gaps_models::criteo::SYNTHETIC_MAX_VOCAB, value_parser = clap::value_parser!(u32).range(8..=i64::from(gaps_models::criteo::SYNTHETIC_VOCAB_LIMIT)))]
    max_vocab: u32,
    /// Exponent of the Zipf law of each field's values (1.01 to 3; nearer 1: a longer tail of rare ids).
    #[arg(long, default_value_t = gaps_models::criteo::SYNTHETIC_ZIPF)]
    zipf: f64,
    /// Seed of the dataset (its vocabularies and teacher).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write (refuses to overwrite an existing file).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct LayoutArgs {
    /// The built-in model.
    #[arg(long, env = "GAPS_MODEL", default_value = "logreg")]
    model: gaps_models::model::ModelKind,
    /// Feature dimension of logreg.
    #[arg(long, env = "GAPS_DIM", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 34)))]
    dim: u64,
    /// Embedding dimension of the CTR models (lr, fm, dlrm).
    #[arg(long, env = "GAPS_EMBEDDING_DIM", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    embedding_dim: u32,
    /// Hidden units of dlrm.
    #[arg(long, env = "GAPS_HIDDEN", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    hidden: u32,
    /// Elements per chunk (the unit of partitioning over shards).
    #[arg(long, env = "GAPS_CHUNK_ELEMS", default_value_t = gaps_common::layout_file::DEFAULT_CHUNK_ELEMS, value_parser = clap::value_parser!(u32).range(1..))]
    chunk_elems: u32,
    /// Print JSON instead of TOML.
    #[arg(long, env = "GAPS_JSON")]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// DLRM training samples per second through local clusters of 1×1, 1×4, 2×2 and 2×4 shards × workers.
    E2e(E2eArgs),
    /// Sync, gba, async and auto on the same data under three straggler profiles (none, one worker 4×
    /// slower, one that stalls): wall time, speed-up over sync beside the simulator's prediction, time to a
    /// target AUC, final AUC and log-loss, gradients dropped.
    Stragglers(gaps_cli::stragglers::StragglerBenchArgs),
    /// Checkpoint of one shard: snapshot pause, file write, read and restore times.
    Checkpoint {
        /// Parameters of the shard (with momentum state: 8 bytes each); suffixes Ki and Mi allowed.
        #[arg(long, env = "GAPS_BENCH_PARAMS", default_value = "256Mi", value_parser = parse_count)]
        params: usize,
        /// Where to write (default: a temporary folder, removed afterwards).
        #[arg(long, env = "GAPS_BENCH_DIR")]
        dir: Option<PathBuf>,
    },
    /// Sparse-table insert and lookup rates and bytes per row; lookups and pushes again once the table is on huge pages.
    Tables {
        /// Rows to insert.
        #[arg(long, env = "GAPS_BENCH_ROWS", default_value = "10Mi", value_parser = parse_count)]
        rows: usize,
        /// Floats per row.
        #[arg(long, env = "GAPS_BENCH_DIM", default_value_t = 16)]
        dim: u32,
    },
    /// Parameters per second of every update rule against a streaming loop over the same bytes.
    Kernels(KernelsArgs),
    /// Push+pull payload throughput against one and two shards, with a plain quinn baseline.
    Transport(TransportArgs),
}

/// `gaps bench e2e`.
#[derive(Debug, clap::Args)]
struct E2eArgs {
    /// Steps per worker.
    #[arg(long, env = "GAPS_BENCH_STEPS", default_value_t = 1200)]
    steps: u64,
    /// Also train a single-process PyTorch DLRM of the same shape, data and optimizers with this Python
    /// (it must import torch and gaps; PyTorch reads its batches through gaps, so build that for this Python
    /// with `maturin develop --release -m python/Cargo.toml`), at 1 and 2 threads, and report every shape ÷
    /// each.
    #[arg(long, env = "GAPS_BENCH_TORCH", value_name = "PYTHON")]
    torch: Option<PathBuf>,
    /// The PyTorch baseline script.
    #[arg(long, env = "GAPS_BENCH_TORCH_SCRIPT", default_value = "python/benches/torch_baseline.py")]
    torch_script: PathBuf,
}

/// `gaps bench e2e`.
async fn bench_e2e(args: E2eArgs) -> Result<()> {
    let E2eArgs { steps, torch, torch_script } = args;
    let exe = std::env::current_exe().context("locating the gaps executable")?;
    let torch = match torch {
        Some(python) => {
            anyhow::ensure!(
                torch_script.is_file(),
                "the PyTorch baseline script {} is not there (run from the repository root, or give \
                 --torch-script)",
                torch_script.display()
            );
            Some(gaps_cli::e2e::TorchBaseline { python, script: torch_script, threads: vec![1, 2] })
        }
        None => None,
    };
    let run = gaps_cli::e2e::run(&exe, gaps_cli::e2e::SHAPES, steps, torch.as_ref()).await?;
    let torch_heads: String = run.torch.iter().map(|t| format!(" {:>10}", format!("÷ torch {}t", t.threads))).collect();
    eprintln!("{:<16} {:>12} {:>8} {:>14}{torch_heads}", "cluster", "samples/s", "AUC", "÷ 1 process");
    let base = &run.baseline;
    eprintln!("{:<16} {:>12.0} {:>8.4} {:>14}", "single process", base.samples_per_s, base.auc, "1.00");
    println!("{}", base.to_json());
    for t in &run.torch {
        eprintln!(
            "{:<16} {:>12.0} {:>8.4} {:>14.2}",
            format!("torch {}t", t.threads),
            t.samples_per_s,
            t.auc,
            t.samples_per_s / base.samples_per_s.max(1e-9)
        );
        println!("{}", gaps_cli::reports::line(t));
    }
    for r in &run.shapes {
        let name = r.name().trim_start_matches("dlrm_").to_string();
        let vs_torch: String = r.torch_ratios.iter().map(|(_, x)| format!(" {x:>10.2}")).collect();
        eprintln!("{name:<16} {:>12.0} {:>8.4} {:>14.2}{vs_torch}", r.samples_per_s, r.auc, r.ratio);
        println!("{}", r.to_json());
    }
    Ok(())
}

/// `gaps bench kernels`.
#[derive(Debug, clap::Args)]
struct KernelsArgs {
    /// Print one JSON line per case on stdout.
    #[arg(long, env = "GAPS_JSON")]
    json: bool,
    /// Where to run: cpu, cuda, or auto (cuda when a GPU is present).
    #[arg(long, env = "GAPS_DEVICE", default_value = "cpu")]
    device: String,
    /// Parameter counts to measure (suffixes Ki and Mi allowed).
    #[arg(long, env = "GAPS_BENCH_SIZES", value_delimiter = ',', default_value = "1Mi,16Mi,64Mi", value_parser = parse_count)]
    sizes: Vec<usize>,
    /// Threads for the CPU path (0: one per core).
    #[arg(long, env = "GAPS_THREADS", default_value_t = 0)]
    threads: usize,
    /// Seconds to time each case.
    #[arg(long, env = "GAPS_BENCH_SECONDS", default_value_t = 0.5)]
    seconds: f64,
    /// `update`: each rule's loop on resident buffers against a streaming loop over the same bytes.
    /// `server`: a push and a pull through the shard's device-resident state (host gradient in, update,
    /// parameters out): on the CPU against the per-chunk CPU path, on a GPU against the pinned-copy
    /// bound of the bytes that cross.
    #[arg(long, default_value = "update", value_parser = ["update", "server"])]
    path: String,
}

/// `gaps bench kernels`.
fn bench_kernels(args: KernelsArgs) -> Result<()> {
    let KernelsArgs { json, device, sizes, threads, seconds, path } = args;
    anyhow::ensure!(seconds.is_finite() && seconds > 0.0, "--seconds must be positive");
    let min_time = std::time::Duration::from_secs_f64(seconds);
    let threads =
        if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let choice: gaps_kernels::cuda::DeviceChoice = device.parse()?;
    let server = path == "server";
    let results = match (gaps_kernels::cuda::CudaDevice::for_choice(choice)?, server) {
        (Some(gpu), false) => {
            eprintln!("[gaps bench] GPU: {}", gpu.name());
            gaps_benches::kernels::run_cuda(&gpu, &sizes, false)?
        }
        (Some(gpu), true) => {
            eprintln!("[gaps bench] GPU: {}", gpu.name());
            drop(gpu);
            // The CPU path of the same pushes in the same run: the GPU's push must beat it.
            let mut rows = gaps_benches::kernels::run_server_cuda(&sizes, false)?;
            rows.extend(gaps_benches::kernels::run_server_host(&sizes, threads, min_time, false)?);
            rows
        }
        (None, false) => gaps_benches::kernels::run_cpu(&sizes, threads, min_time, false)?,
        (None, true) => gaps_benches::kernels::run_server_host(&sizes, threads, min_time, false)?,
    };
    gaps_benches::kernels::print(&results, json);
    Ok(())
}

/// `gaps bench transport`.
#[derive(Debug, clap::Args)]
struct TransportArgs {
    /// Print one JSON line per case on stdout.
    #[arg(long, env = "GAPS_JSON")]
    json: bool,
    /// Seconds to time each case.
    #[arg(long, env = "GAPS_BENCH_SECONDS", default_value_t = 3.0)]
    seconds: f64,
    /// One small round per case (a smoke test).
    #[arg(long, env = "GAPS_BENCH_QUICK")]
    quick: bool,
    /// Run only the cases whose name contains this (e.g. `1shard_1Mi`, `sparse`), or only the case named exactly this.
    #[arg(long)]
    only: Option<String>,
    /// Rows in the sparse cases' table.
    #[arg(long, default_value_t = 10_000_000)]
    sparse_rows: u64,
    /// Measurements per case, alternating gaps and its baselines (medians are reported).
    #[arg(long, default_value_t = 3)]
    repeats: u32,
    /// Time gaps alone, without the baselines (for profiling one case with perf; ratios print as 0).
    #[arg(long)]
    gaps_only: bool,
    /// Connections per shard the gaps client stripes large pushes and pulls over.
    #[arg(long, default_value_t = gaps_worker::client::DEFAULT_LANES)]
    lanes: usize,
    /// Dense rounds as a push then a pull, two requests per shard (`Client::push`, `Client::pull`),
    /// instead of one push-pull request (`Client::push_pull`, what `gaps-worker` uses).
    #[arg(long)]
    separate: bool,
    /// Dense sizes in floats, comma-separated (suffixes Ki and Mi allowed); sizes of 64Ki and more also
    /// run with bfloat16 on the wire. Default 1000,1Mi,16Mi.
    #[arg(long, value_delimiter = ',', value_parser = parse_count)]
    floats: Vec<usize>,
    /// Busy processes to run beside every case, gaps and baselines alike (the cases on a machine other
    /// programs load; JSON lines carry `hog`). 0: none.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=256))]
    hog: u32,
    /// Run gaps' shards as `gaps server` processes, as a deployment does, rather than in the bench's own
    /// process (whose runtime then serves the client and the shards alike, one thread a core); their CPU is
    /// counted too, and the bench's process stands for a worker: its runtime has a worker's threads
    /// (`--client-io-threads`). The cases with copies (`_r2`) are left out. JSON lines carry
    /// `"processes": true`.
    #[arg(long)]
    processes: bool,
    /// With --processes: the threads of the bench's own runtime, which runs the client (0: a worker's — none
    /// with one lane, the client's thread driving its connections itself, and one a lane with more).
    #[arg(long, default_value_t = 0, requires = "processes", value_parser = clap::value_parser!(u32).range(0..=1024))]
    client_io_threads: u32,
    /// With --processes: the shard processes' `--io-threads` (0: a shard's, one per 4 cores).
    #[arg(long, default_value_t = 0, requires = "processes", value_parser = clap::value_parser!(u32).range(0..=1024))]
    shard_io_threads: u32,
}

/// `gaps bench transport`.
async fn bench_transport(args: TransportArgs) -> Result<()> {
    let TransportArgs {
        json,
        seconds,
        quick,
        only,
        sparse_rows,
        repeats,
        gaps_only,
        lanes,
        separate,
        floats,
        hog,
        processes,
        client_io_threads: _,
        shard_io_threads,
    } = args;
    anyhow::ensure!(seconds.is_finite() && seconds > 0.0, "--seconds must be positive");
    anyhow::ensure!(sparse_rows >= 2 * gaps_benches::transport::SPARSE_ROWS, "--sparse-rows must be at least 8192");
    let mut opts = gaps_benches::transport::TransportOptions::new(quick, std::time::Duration::from_secs_f64(seconds));
    opts.only = only;
    opts.gaps_only = gaps_only;
    anyhow::ensure!((1..=64).contains(&lanes), "--lanes must be 1 to 64");
    opts.lanes = lanes;
    opts.separate = separate;
    opts.hog = hog as usize;
    opts.processes = processes;
    opts.shard_io_threads = shard_io_threads;
    if hog > 0 {
        eprintln!("[gaps bench] {hog} busy process(es) run beside every case");
    }
    anyhow::ensure!(floats.iter().all(|n| (1..=1 << 26).contains(n)), "--floats: each size must be 1 to 64Mi floats");
    if !floats.is_empty() {
        // Each size once (a case is named by its size), smallest first.
        let mut sizes: Vec<u64> = floats.iter().map(|n| *n as u64).collect();
        sizes.sort_unstable();
        sizes.dedup();
        opts.floats = Some(sizes);
    }
    if !quick {
        opts.sparse_rows = sparse_rows;
        opts.repeats = repeats.clamp(1, 50);
    }
    let results = gaps_benches::transport::run(&opts).await?;
    gaps_benches::transport::print(&results, json);
    Ok(())
}

use gaps_common::config::parse_count;

fn main() -> Result<()> {
    gaps_common::buffers::tune_allocator();
    let cli: Cli = gaps_setup::parse();
    // A shard or worker process runs on a runtime of its `--io-threads`; so does the transport bench with
    // shard processes, whose own process then stands for a worker (`--client-io-threads`).
    use gaps_transport::runtime::{io_threads, IoRole};
    let threads = match &cli.command {
        Command::Server(args) => args.runtime_threads(),
        Command::Worker(args) => args.runtime_threads(),
        Command::Bench(BenchCommand::Transport(args)) if args.processes => {
            io_threads(args.client_io_threads as usize, IoRole::Worker { lanes: args.lanes })
        }
        // tokio's default: one thread a core, or TOKIO_WORKER_THREADS.
        _ => return tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(cli)),
    };
    gaps_transport::runtime::build(threads)?.block_on(run(cli))
}

async fn run(cli: Cli) -> Result<()> {
    // The front door's own commands report through their progress lines; their libraries log warnings only.
    let quiet = matches!(
        cli.command,
        Command::Local(_)
            | Command::Cluster(_)
            | Command::Bench(_)
            | Command::Certs(_)
            | Command::Sim(_)
            | Command::Layout(_)
            | Command::SynthData(_)
            | Command::Checkpoint(_)
            | Command::Reference(_)
    );
    gaps_setup::init_logging(if quiet { "warn" } else { "info" });
    match cli.command {
        Command::Cluster(args) => gaps_cli::cluster::run(&args).await,
        Command::Local(args) => local(args).await,
        Command::Sim(cmd) => sim(cmd),
        Command::Checkpoint(args) => checkpoint(args).await,
        Command::SynthData(args) => synth_data(args),
        Command::Layout(args) => layout(args),
        Command::Certs(args) => certs(args),
        Command::Bench(cmd) => bench(cmd).await,
        Command::Server(args) => gaps_server::cli::run(&args).await,
        Command::Worker(args) => worker(args).await,
        Command::Reference(args) => reference(&args),
    }
}

#[derive(Debug, clap::Args)]
struct ReferenceArgs {
    /// Print the flags of this command (`--json server`: those of `gaps server`) as a JSON list, one object
    /// a flag: long, short, value, env, default, possible, required, help.
    #[arg(long, num_args = 0.., value_name = "COMMAND")]
    json: Option<Vec<String>>,
}

/// `gaps reference`.
fn reference(args: &ReferenceArgs) -> Result<()> {
    let cli = <Cli as clap::CommandFactory>::command();
    match &args.json {
        None => print!("{}", gaps_cli::reference::flags_markdown(&cli)),
        Some(path) => {
            let flags = gaps_cli::reference::flags_of(&cli, path)
                .with_context(|| format!("no command `gaps {}`", path.join(" ")))?;
            println!("{}", serde_json::to_string(&flags)?);
        }
    }
    Ok(())
}

/// `gaps local`.
async fn local(args: gaps_cli::local::LocalArgs) -> Result<()> {
    let report = gaps_cli::local::run(&args).await?;
    let c = &report.counters;
    eprintln!(
        "[gaps local] done in {:.1}s: {} steps, {}/{} shard pushes applied, held-out loss {:.4} -> {:.4}",
        c.wall_s, c.steps, c.pushes_applied, c.pushes_sent, c.initial_loss, c.final_loss
    );
    if let Some(c) = &report.ctr {
        eprintln!(
            "[gaps local] held-out AUC {:.4}{}, log-loss {:.4}, {:.0} samples/s, {} embedding rows ({:.1} MiB), {} bad lines",
            c.auc,
            c.teacher_auc.map(|t| format!(" (teacher {t:.4})")).unwrap_or_default(),
            c.logloss,
            c.samples_per_s,
            c.table_rows,
            c.table_bytes as f64 / (1 << 20) as f64,
            c.bad_lines
        );
    }
    if args.json {
        println!("{}", report.to_json(&args));
    }
    Ok(())
}

/// `gaps sim`, `gaps sim experiments` and `gaps sim sweep`.
fn sim(cmd: SimCommand) -> Result<()> {
    match cmd {
        SimCommand { experiments: Some(SimSub::Experiments { quick, out }), .. } => {
            let grid = if quick { gaps_sim::experiments::Grid::quick() } else { gaps_sim::experiments::Grid::full() };
            let command = if quick { "gaps sim experiments --quick" } else { "gaps sim experiments" };
            let md = gaps_sim::experiments::run_experiments(&grid, &out, command)?;
            println!("{md}");
        }
        SimCommand { experiments: Some(SimSub::Sweep(args)), .. } => {
            let sweep = gaps_sim::sweep::run(&args)?;
            println!("{}", sweep.markdown(&args));
            if let Some(path) = &args.svg {
                std::fs::write(path, sweep.svg()).with_context(|| format!("writing {}", path.display()))?;
            }
            if args.json {
                println!("{}", sweep.to_json());
            }
        }
        SimCommand { experiments: None, args } => {
            let report = gaps_sim::run(&args)?;
            eprintln!(
                "[gaps sim] {} {} N={} {}: metric {:.3}, train loss {:.4}{}, staleness mean {:.2} p99 {}, {} events in {:.1} simulated {} ({:.0} events/s)",
                report.model, report.rule, report.workers, if args.profile.is_some() { "profile".to_string() } else { format!("shape {}", report.shape) }, report.final_test_metric, report.final_train_loss,
                if report.diverged { " (diverged)" } else { "" }, report.staleness_mean, report.staleness_p99, report.events, report.sim_wall_time, report.time_unit, report.events_per_s
            );
            if let Some(target) = args.target {
                match report.time_to_target {
                    Some(t) => eprintln!("[gaps sim] reached {target} at simulated time {t:.1} ({})", report.time_unit),
                    None => eprintln!("[gaps sim] never reached {target}"),
                }
            }
            if args.json {
                println!("{}", report.to_json());
            }
        }
    }
    Ok(())
}

/// `gaps checkpoint`.
async fn checkpoint(args: CheckpointArgs) -> Result<()> {
    let tls =
        gaps_transport::tls::TlsMaterial::load(&args.ca, &args.cert, &args.key).context("loading the TLS material")?;
    let opts =
        gaps_worker::ClientOptions::new(&args.coordinator, tls, gaps_common::wire::Role::Observer, "gaps-checkpoint");
    let client = gaps_worker::Client::connect(opts).await.context("connecting to the cluster")?;
    let written = client.checkpoint().await.context("asking the shards for a checkpoint")?;
    client.close().await;
    for s in written.shards {
        let line = gaps_cli::reports::CheckpointWritten {
            event: "checkpoint".into(),
            id: written.id,
            shard: s.shard,
            path: s.path,
            step: s.step,
        };
        println!("{}", gaps_cli::reports::line(&line));
    }
    Ok(())
}

/// `gaps synth-data`.
fn synth_data(args: SynthDataArgs) -> Result<()> {
    use std::io::Write;
    if !(1.01..=3.0).contains(&args.zipf) {
        anyhow::bail!("--zipf must be between 1.01 and 3, got {}", args.zipf);
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let data = gaps_models::criteo::SyntheticCriteo::with_vocab(args.seed, args.max_vocab, args.zipf);
    let mut ids = std::collections::HashSet::new();
    for i in 0..args.lines {
        let (sample, _) = data.sample(i);
        ids.extend((0..26).filter_map(|f| sample.feature_id(f)));
        writeln!(out, "{}", gaps_models::criteo::SyntheticCriteo::to_line(&sample))
            .with_context(|| format!("writing {}", args.out.display()))?;
    }
    out.flush().with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "[gaps synth-data] {} lines, {} distinct feature ids, largest field {} values, Zipf {}: {}",
        args.lines,
        ids.len(),
        args.max_vocab,
        args.zipf,
        args.out.display()
    );
    Ok(())
}

/// `gaps layout`.
fn layout(args: LayoutArgs) -> Result<()> {
    let size = gaps_models::model::ModelSize { dim: args.dim, embedding_dim: args.embedding_dim, hidden: args.hidden };
    let layout = args.model.layout(&size, args.chunk_elems).context("building the model layout")?;
    let format =
        if args.json { gaps_common::layout_file::Format::Json } else { gaps_common::layout_file::Format::Toml };
    print!("{}", gaps_common::layout_file::write(&layout, format));
    Ok(())
}

/// `gaps certs`.
fn certs(args: CertsArgs) -> Result<()> {
    use gaps_setup::certs::{CertOptions, CertificateAuthority, ClusterCerts, PemPair};
    let existing = gaps_transport::tls::TlsMaterial::load(
        &args.out.join("ca.pem"),
        &args.out.join("shard-0.pem"),
        &args.out.join("shard-0.key"),
    )
    .ok()
    .and_then(|m| m.own_identity().ok())
    .map(|id| id.cluster);
    let cluster =
        args.cluster_name.clone().or(existing).unwrap_or_else(|| gaps_setup::certs::DEFAULT_CLUSTER.to_string());
    let opts = CertOptions {
        cluster,
        shards: args.shards,
        workers: args.workers.clone(),
        sans: args.sans.clone(),
        validity: args.validity,
        ca_validity: args.ca_validity,
    };
    let (ca_pem, ca_key) = (args.out.join("ca.pem"), args.out.join("ca.key"));
    let ca = if ca_pem.exists() && ca_key.exists() {
        let read = |p: &std::path::Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
        let pem = PemPair { cert: read(&ca_pem)?, key: read(&ca_key)? };
        eprintln!("issuing under the existing CA in {}", args.out.display());
        Some(CertificateAuthority::load(pem).context("loading the existing CA (ca.pem, ca.key)")?)
    } else {
        None
    };
    let certs = ClusterCerts::make(&opts, ca.as_ref()).context("making certificates")?;
    certs.write_to(&args.out)?;
    let names: Vec<String> = certs.file_names().into_iter().flat_map(|(c, k)| [c, k]).collect();
    println!("wrote {} to {} (cluster {:?})", names.join(", "), args.out.display(), certs.cluster);
    Ok(())
}

/// `gaps bench …`.
async fn bench(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Checkpoint { params, dir } => {
            let temporary = dir.is_none();
            let dir = dir
                .unwrap_or_else(|| std::env::temp_dir().join(format!("gaps-bench-checkpoint-{}", std::process::id())));
            let result = gaps_benches::checkpoint::run(params as u64, &dir);
            if temporary {
                let _ = std::fs::remove_dir_all(&dir);
            }
            println!("{}", result?.to_json());
        }
        BenchCommand::Kernels(args) => bench_kernels(args)?,
        BenchCommand::E2e(args) => bench_e2e(args).await?,
        BenchCommand::Stragglers(args) => {
            let exe = std::env::current_exe().context("locating the gaps executable")?;
            let runs = gaps_cli::stragglers::run(&args, &exe).await?;
            eprint!("{}", gaps_cli::stragglers::table(&runs, args.target_auc));
            if let Some(path) = &args.svg {
                std::fs::write(path, gaps_cli::stragglers::svg(&runs))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if args.json {
                for r in &runs {
                    println!("{}", r.to_json());
                }
            }
        }
        BenchCommand::Tables { rows, dim } => {
            let r = gaps_benches::tables::run(rows as u64, dim)?;
            eprintln!(
                "[gaps bench] {} rows of dim {dim}: {:.2} M inserts/s, {:.2} M lookups/s, {:.2} M read+pushed/s ({:.0} ns a row), {:.0} B/row data, {:.1} B/row overhead",
                r.rows,
                r.inserts_per_s / 1e6,
                r.lookups_per_s / 1e6,
                r.pushes_per_s / 1e6,
                1e9 / r.pushes_per_s,
                r.row_data_bytes,
                r.overhead_bytes_per_row
            );
            match r.settled {
                Some(s) => eprintln!(
                    "[gaps bench] on huge pages (as minutes after it grew; merged in {:.1} s): {:.2} M lookups/s, {:.2} M read+pushed/s ({:.0} ns a row)",
                    s.merge_s,
                    s.lookups_per_s / 1e6,
                    s.pushes_per_s / 1e6,
                    1e9 / s.pushes_per_s
                ),
                None => eprintln!(
                    "[gaps bench] not measured on huge pages: the kernel could not merge the table's pages (MADV_COLLAPSE), or it holds none"
                ),
            }
            println!("{}", r.to_json());
        }
        BenchCommand::Transport(args) => bench_transport(args).await?,
    }
    Ok(())
}

/// `gaps worker`.
async fn worker(args: gaps_worker::train::WorkerArgs) -> Result<()> {
    let summary = gaps_worker::train::run(&args).await?;
    if args.json {
        println!("{}", summary.to_json());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own consistency checks over every subcommand (`gaps server` and `gaps worker` included): no
    /// two flags share a name, defaults parse, flattened argument groups do not collide.
    #[test]
    fn every_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let parsed =
            Cli::try_parse_from(["gaps", "local", "--mode", "sync", "--table-memory", "64MiB", "--lease", "1h 30m"]);
        let Ok(Cli { command: Command::Local(args), .. }) = parsed else {
            panic!("gaps local flags parse: {parsed:?}")
        };
        assert_eq!(args.tables.table_memory, Some(64 << 20));
        assert_eq!(args.lease, std::time::Duration::from_secs(5400));
        assert!(Cli::try_parse_from(["gaps", "local", "--table-memory", "lots"]).is_err());
    }
}
