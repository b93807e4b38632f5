//! Flags of `gaps-server` (and of `gaps server`) and the process entry point.

use crate::service::{self, ServiceConfig};
use anyhow::{Context, Result};
use gaps_common::config::parse_duration;
use gaps_flags::{HyperArgs, ModeArgs, TableArgs};
use gaps_kernels::Rule;
use gaps_shard::{Init, ShardConfig};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::info;

/// Flags of one shard. Every flag also reads a `GAPS_*` environment variable, so the binary runs under any
/// cluster manager.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// This shard's index (0 is the coordinator).
    #[arg(long, env = "GAPS_SHARD_INDEX", default_value_t = 0)]
    pub shard_index: u32,
    /// Number of shards in the cluster.
    #[arg(long, env = "GAPS_NUM_SHARDS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub num_shards: u32,
    /// UDP address to listen on.
    #[arg(long, env = "GAPS_LISTEN", default_value = "0.0.0.0:7070")]
    pub listen: SocketAddr,
    /// Address clients should use to reach this shard (default: the listen address; required with 0.0.0.0).
    #[arg(long, env = "GAPS_ADVERTISE")]
    pub advertise: Option<String>,
    /// Address of the coordinator, shard 0 (required for every other shard). With --replicas 2 or more on
    /// 3 or more shards, a process started again asks it where the coordinator is now (after a takeover,
    /// any live shard process will do; given to shard 0, it only says whom to ask).
    #[arg(long, env = "GAPS_COORDINATOR")]
    pub coordinator: Option<String>,
    /// The cluster CA certificate (PEM).
    #[arg(long, env = "GAPS_CA")]
    pub ca: PathBuf,
    /// This server's certificate (PEM), signed by the cluster CA.
    #[arg(long, env = "GAPS_CERT")]
    pub cert: PathBuf,
    /// This server's private key (PEM).
    #[arg(long, env = "GAPS_KEY")]
    pub key: PathBuf,
    /// The model this cluster serves: a layout file (TOML, or JSON when it ends in `.json`) listing the dense
    /// tensors (name, shape, optional rule and hyper-parameters) and the sparse tables (name, dim, optional
    /// rule). `gaps layout --model NAME` prints the built-in models' layouts. Every shard gets the same file.
    #[arg(long, env = "GAPS_LAYOUT")]
    pub layout: PathBuf,
    /// How dense gradients and parameters travel for tensors whose layout entry has no `wire_dtype`: f32,
    /// bf16 or f16 (half the bytes; the shard keeps f32 state and accepts any format on pushes).
    #[arg(long, env = "GAPS_WIRE_DTYPE", default_value = "f32")]
    pub wire_dtype: gaps_common::dtype::WireDtype,
    /// Update rule of the dense tensors (a tensor's `rule` in the layout file takes precedence).
    #[arg(long, env = "GAPS_RULE", default_value = "momentum")]
    pub rule: Rule,
    /// Learning rate η of the dense tensors.
    #[arg(long, env = "GAPS_LR", default_value_t = 0.1)]
    pub lr: f32,
    #[command(flatten)]
    pub hyper: HyperArgs,
    #[command(flatten)]
    pub tables: TableArgs,
    #[command(flatten)]
    pub modes: ModeArgs,
    /// Where updates run: cpu, cuda (fails when no GPU can be used) or auto (the GPU when present).
    #[arg(long, env = "GAPS_DEVICE", default_value = "cpu")]
    pub device: gaps_kernels::cuda::DeviceChoice,
    /// With --device cuda: workers whose per-worker optimizer planes (multi-momentum, dc-asgd-adaptive, the
    /// DANA rules) the GPU holds at once, plus one for synchronous steps; a push from one worker more is
    /// refused with a clear error. Each costs one copy of the shard's parameters in GPU memory.
    #[arg(long, env = "GAPS_DEVICE_WORKER_SLOTS", default_value_t = crate::service::DEFAULT_DEVICE_WORKER_SLOTS, value_parser = clap::value_parser!(u32).range(2..=4096))]
    pub device_worker_slots: u32,
    /// Threads a large push may use (0: one per core).
    #[arg(long, env = "GAPS_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Threads of the runtime that serves the network (0: one per 4 cores, at least one). A request's
    /// hand-offs between tasks stay on one thread when there is one (fewer wake-ups); more pay where many
    /// workers' traffic fills a core. A small request is applied on the thread that read it when the core
    /// is idle; others on the core's thread and large pushes over `--threads`.
    #[arg(long, env = "GAPS_SERVER_IO_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub io_threads: u32,
    /// Seed of the parameter initializer.
    #[arg(long, env = "GAPS_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Standard deviation of the normal initializer (0: zeros).
    #[arg(long, env = "GAPS_INIT_STD", default_value_t = 0.0)]
    pub init_std: f32,
    /// A worker that sends no heartbeat for this long is dropped from the live set.
    #[arg(long, env = "GAPS_LEASE", default_value = "10s", value_parser = parse_duration)]
    pub lease: Duration,
    /// How long a shard ≥ 1 keeps trying to reach the coordinator at start-up.
    #[arg(long, env = "GAPS_JOIN_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub join_timeout: Duration,
    /// Requests queued for the shard's core thread at most; further requests wait on their connection.
    #[arg(long, env = "GAPS_QUEUE_DEPTH", default_value_t = crate::service::DEFAULT_QUEUE_DEPTH as u32, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub queue_depth: u32,
    /// Bytes that in-flight requests (payloads and expected replies) may hold at once, e.g. 512MiB; a
    /// request over the budget waits, unread, until earlier ones finish.
    #[arg(long, env = "GAPS_INFLIGHT_MEMORY", default_value = "512MiB", value_parser = parse_bytes)]
    pub inflight_memory: u64,
    /// Connections served at once at most; more are refused (and counted).
    #[arg(long, env = "GAPS_MAX_CONNECTIONS", default_value_t = crate::service::DEFAULT_MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Connections from one IP address served at once at most.
    #[arg(long, env = "GAPS_MAX_CONNECTIONS_PER_IP", default_value_t = crate::service::DEFAULT_MAX_CONNECTIONS_PER_IP, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_ip: u32,
    /// Live workers one certificate may have registered at once; further registrations are refused.
    #[arg(long, env = "GAPS_MAX_WORKERS_PER_CERTIFICATE", default_value_t = crate::service::DEFAULT_MAX_WORKERS_PER_CERTIFICATE, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_workers_per_certificate: u32,
    /// Copies of each shard's state, each on another shard process: shard i's backups are processes i+1 …
    /// i+R−1 (mod the shard count), and a push is answered once every live copy applied it (1: no copies).
    /// Every shard process takes the same value.
    #[arg(long, env = "GAPS_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub replicas: u32,
    /// How long a primary waits for a backup's answer before it goes on without that backup (and copies it a
    /// new snapshot).
    #[arg(long, env = "GAPS_REPLICA_ACK_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub replica_ack_timeout: Duration,
    /// A backup whose primary sent nothing for this long (a live primary logs a tick every 250 ms) asks the
    /// coordinator to take the shard over; the coordinator agrees only if the primary does not answer it
    /// either and the backup holds every request the primary acknowledged.
    #[arg(long, env = "GAPS_FAILOVER_AFTER", default_value = "1s", value_parser = parse_duration)]
    pub failover_after: Duration,
    /// Tests of replication: record every request that changes a served shard's state in this folder
    /// (`gaps_server::record`).
    #[arg(long, hide = true)]
    pub record_requests: Option<PathBuf>,
    /// Tests of replication: serve nothing; replay these request records of this shard (the first serving
    /// process's, then each that took it over) and check the result against --replay-checkpoint.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub replay_records: Vec<PathBuf>,
    /// The checkpoint the replay must end equal to (with --replay-records).
    #[arg(long, hide = true, requires = "replay_records")]
    pub replay_checkpoint: Option<PathBuf>,
    /// How long a request's header, and then its payload, may take to arrive; a slower or stalled sender is
    /// cut off (and counted).
    #[arg(long, env = "GAPS_REQUEST_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// A request of which no byte arrives for this long is cut off (and counted).
    #[arg(long, env = "GAPS_STALL_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub stall_timeout: Duration,
    /// How long a request waits for room in the in-flight memory before it is refused as busy (the client
    /// sends it again after a pause).
    #[arg(long, env = "GAPS_BUDGET_WAIT", default_value = "2s", value_parser = parse_duration)]
    pub budget_wait: Duration,
    /// A connection that opens no request for this long, with none in flight, is closed (clients reconnect
    /// when they need to).
    #[arg(long, env = "GAPS_IDLE_TIMEOUT", default_value = "300s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Keep checkpoints under this directory (each shard in `shard-<i>/`); a shard started with a directory
    /// that holds a complete checkpoint restores it (see --restore) and rejoins the cluster.
    #[arg(long, env = "GAPS_CHECKPOINT_DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Take a checkpoint this often (also on SIGTERM); without it, only on SIGTERM.
    #[arg(long, env = "GAPS_CHECKPOINT_EVERY", value_parser = parse_duration, requires = "checkpoint_dir")]
    pub checkpoint_every: Option<Duration>,
    /// Checkpoints kept per shard (older ones are deleted).
    #[arg(long, env = "GAPS_KEEP_CHECKPOINTS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub keep_checkpoints: u32,
    /// Where a starting shard takes its state from: `auto` (the newest intact checkpoint in
    /// --checkpoint-dir, if any), `never`, or the path of a checkpoint's .bin or .json file.
    #[arg(long, env = "GAPS_RESTORE", default_value = "auto")]
    pub restore: crate::service::Restore,
    /// The coordinator deals this training data to the workers in splits, each to whichever worker asks next
    /// (dynamic data sharding): `synthetic`, or Criteo-layout files separated by commas (dealt in order;
    /// every worker must read the same files, in the same order, under its own `--data`). Only shard 0
    /// deals (other shards ignore it); not given, workers read a fixed share (`gaps-worker --data-shard`).
    #[arg(long, env = "GAPS_DATA")]
    pub data: Option<crate::data::DataSource>,
    /// Lines of a file (or synthetic samples) per dealt split.
    #[arg(long, env = "GAPS_SPLIT_LINES", default_value_t = crate::data::DEFAULT_SPLIT_LINES, value_parser = clap::value_parser!(u64).range(1..=(1u64 << 32)))]
    pub split_lines: u64,
    /// Passes over the data files to deal (0: no end, for runs bounded by the workers' --steps). Synthetic
    /// data has no passes: it is dealt without end.
    #[arg(long, env = "GAPS_DATA_EPOCHS", default_value_t = 1)]
    pub data_epochs: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics.
    #[arg(long, env = "GAPS_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

impl ServerArgs {
    /// The threads of the shard's runtime: `--io-threads`, or one per 4 cores (at least one).
    pub fn runtime_threads(&self) -> usize {
        gaps_transport::runtime::io_threads(self.io_threads as usize, gaps_transport::runtime::IoRole::Shard)
    }

    /// The service configuration these flags describe.
    pub fn service_config(&self) -> Result<ServiceConfig> {
        let tls = TlsMaterial::load(&self.ca, &self.cert, &self.key).context("loading the server's TLS material")?;
        let mut layout = load_layout(&self.layout)?;
        layout.resolve_wire_dtype(self.wire_dtype);
        let hyper = self.hyper.hyper(self.lr)?;
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            ^ u64::from(std::process::id());
        Ok(ServiceConfig {
            listen: self.listen,
            advertise: self.advertise.clone(),
            coordinator: self.coordinator.clone(),
            tls,
            core: ShardConfig {
                shard: self.shard_index,
                num_shards: self.num_shards,
                layout,
                rule: self.rule,
                hyper,
                init: Init { seed: self.seed, std: self.init_std },
                lease: self.lease,
                advertise: String::new(),
                epoch: epoch.max(1),
                threads: self.threads,
                modes: self.modes.config(),
                sparse: self.tables.settings(&hyper)?,
            },
            join_timeout: self.join_timeout,
            tick_interval: Duration::from_millis(250),
            device: self.device,
            device_worker_slots: self.device_worker_slots,
            queue_depth: self.queue_depth as usize,
            inflight_bytes: self.inflight_memory,
            max_connections: self.max_connections as usize,
            max_connections_per_ip: self.max_connections_per_ip,
            max_workers_per_certificate: self.max_workers_per_certificate,
            request_timeout: self.request_timeout,
            stall_timeout: self.stall_timeout,
            budget_wait: self.budget_wait,
            idle_timeout: self.idle_timeout,
            checkpoint: self.checkpoint_dir.as_ref().map(|dir| crate::service::CheckpointConfig {
                dir: dir.clone(),
                every: self.checkpoint_every,
                keep: self.keep_checkpoints as usize,
            }),
            restore: self.restore.clone(),
            health: None,
            data: self.dealer_config()?,
            replicas: self.replicas,
            replica_ack_timeout: self.replica_ack_timeout,
            failover_after: self.failover_after,
            record: self.record_requests.clone(),
        })
    }
}

impl ServerArgs {
    /// The dealer of `--data` (shard 0, and the processes that keep a copy of it): the files cut into splits
    /// here, at start.
    pub fn dealer_config(&self) -> Result<Option<gaps_shard::dealer::DealerConfig>> {
        let Some(source) = &self.data else { return Ok(None) };
        let copies_coordinator =
            crate::replication::backed_up_by(self.shard_index, self.num_shards, self.replicas).contains(&0);
        if self.shard_index != 0 && !copies_coordinator {
            // One setting for every shard (a StatefulSet's environment) is fine: only shard 0 deals (and the
            // processes keeping a copy of it, with --replicas).
            info!(shard = self.shard_index, "--data is the coordinator's (shard 0) to deal; this shard ignores it");
            return Ok(None);
        }
        let started = std::time::Instant::now();
        let table = crate::data::cut(source, self.split_lines)?;
        info!(splits = table.per_epoch(), took_ms = started.elapsed().as_millis() as u64, "cut the training data");
        // Grants of this process are numbered from its start second (high 32 bits), so a restarted
        // coordinator never deals a number its previous life dealt.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs());
        let epochs = match source {
            crate::data::DataSource::Synthetic => None,
            crate::data::DataSource::Files(_) => (self.data_epochs > 0).then_some(self.data_epochs),
        };
        Ok(Some(gaps_shard::dealer::DealerConfig { table, epochs, grant_floor: (secs & 0xffff_ffff) << 32 }))
    }
}

/// Reads and validates a layout file.
pub fn load_layout(path: &std::path::Path) -> Result<gaps_common::Layout> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the layout file {}", path.display()))?;
    gaps_common::layout_file::parse(&text, gaps_common::layout_file::Format::of_path(path))
        .with_context(|| format!("loading the layout file {}", path.display()))
}

/// Parses a byte count (binary `MiB`/`Gi`, decimal `MB`/`G`): [`gaps_common::config::parse_bytes`].
pub use gaps_common::config::parse_bytes;

/// The line a shard prints on stdout once it serves (`{"event":"listening",…}`), which launchers read for
/// its address.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Listening {
    /// Always `listening`.
    pub event: String,
    /// The shard's index.
    pub shard: u32,
    /// The address it serves on (as advertised to the cluster).
    pub addr: String,
    /// Where its Prometheus metrics are served, if they are.
    pub metrics_addr: Option<String>,
    /// The newest tensor version of the checkpoint it restored, if it restored one.
    pub restored_version: Option<u64>,
}

impl Listening {
    /// The `event` of the line.
    pub const EVENT: &'static str = "listening";
}

/// Runs one shard until SIGINT or SIGTERM. Prints one JSON line on stdout once it serves: [`Listening`].
pub async fn run(args: &ServerArgs) -> Result<()> {
    if args.shard_index >= args.num_shards {
        anyhow::bail!("--shard-index {} must be below --num-shards {}", args.shard_index, args.num_shards);
    }
    let mut cfg = args.service_config()?;
    if !args.replay_records.is_empty() {
        let replayed = crate::record::replay(&cfg.core, &args.replay_records, args.replay_checkpoint.as_deref())?;
        println!("{}", serde_json::to_string(&replayed).context("encoding the replay's report")?);
        return Ok(());
    }
    if let Some(budget) = cfg.core.sparse.memory_budget.filter(|_| !cfg.core.layout.tables.is_empty()) {
        let how = if args.tables.table_memory.is_some() {
            "--table-memory".to_string()
        } else {
            let usable = gaps_common::buffers::usable_memory().map_or("unknown".into(), |m| format!("{} MiB", m >> 20));
            format!("a quarter of the {usable} this process may use; --table-memory to change it")
        };
        tracing::info!(budget_mib = budget >> 20, "embedding tables: memory budget {} MiB ({how})", budget >> 20);
    }
    let metrics_addr = match args.metrics_addr {
        Some(addr) => {
            let handle = crate::metrics::install_recorder().context("installing the metrics recorder")?;
            let health = Arc::new(crate::metrics::Health::default());
            cfg.health = Some(health.clone());
            let (bound, _task) = crate::metrics::serve(addr, handle, health)
                .await
                .with_context(|| format!("serving metrics on {addr}"))?;
            Some(bound.to_string())
        }
        None => None,
    };
    let server = service::start(cfg).await?;
    let restored_version = server.restored.as_ref().map(|r| r.tensor_versions.iter().copied().max().unwrap_or(0));
    let listening = Listening {
        event: Listening::EVENT.into(),
        shard: args.shard_index,
        addr: server.advertise.clone(),
        metrics_addr,
        restored_version,
    };
    println!("{}", serde_json::to_string(&listening).context("encoding the listening line")?);
    // SIGHUP reloads the CA, certificate and key from their files: new connections use them, open ones
    // keep theirs (certificate rotation without a restart).
    let reload = async {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            if let Ok(mut hup) = signal(SignalKind::hangup()) {
                while hup.recv().await.is_some() {
                    let loaded = TlsMaterial::load(&args.ca, &args.cert, &args.key)
                        .map_err(anyhow::Error::from)
                        .and_then(|tls| server.reload_tls(&tls));
                    match loaded {
                        Ok(()) => info!(cert = %args.cert.display(), "reloaded the TLS material"),
                        Err(e) => tracing::warn!(error = format!("{e:#}"), "kept the old TLS material"),
                    }
                }
            }
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = shutdown_signal() => {}
        _ = reload => {}
    }
    info!("shutting down");
    server.shutdown().await
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
