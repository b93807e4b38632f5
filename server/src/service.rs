//! The QUIC service around [`ShardCore`]: accepts mutually authenticated connections, serves one RPC per
//! bidirectional stream, joins the coordinator (shards ≥ 1), expires leases on a timer, exports metrics, and
//! shuts down gracefully (refuse new connections, finish in-flight RPCs, close).
//!
//! The core is an actor: it lives on its own OS thread and is fed by a **bounded** queue of commands, each
//! with a reply channel. The QUIC tasks never lock it and never run an update on the async runtime. Before
//! a stream's payload is read, its task reserves the payload's (and the expected reply's) bytes from a
//! fixed in-flight budget; when the budget or the queue is full the task waits, QUIC flow control stops
//! the sender, and memory stays bounded however many requests arrive.
//!
//! Architecture invariant: the service holds no training state of its own; everything lives in the core.

use crate::checkpoint::CheckpointStore;
use crate::metrics::ShardMetrics;
use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{ErrorCode, Frame, Limits, Message, Stats, WireError};
use gaps_shard::{CoreEvent, ShardConfig, ShardCore};
use gaps_transport::net::{self, RpcError};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tracing::{debug, info, warn, Instrument};

/// Largest number of sparse rows one pull or push may carry.
pub const MAX_SPARSE_ROWS_PER_RPC: u64 = 1 << 20;

/// Everything a shard process needs.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// UDP address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Address clients should use; defaults to the bound address (required when listening on 0.0.0.0).
    pub advertise: Option<String>,
    /// The coordinator's address (required for shards ≥ 1).
    pub coordinator: Option<String>,
    /// CA and the server's certificate.
    pub tls: TlsMaterial,
    /// The core's configuration (its `advertise` is filled in here).
    pub core: ShardConfig,
    /// How long a shard ≥ 1 keeps trying to reach the coordinator.
    pub join_timeout: Duration,
    /// How often leases are checked.
    pub tick_interval: Duration,
    /// Where updates run.
    pub device: gaps_kernels::cuda::DeviceChoice,
    /// Requests waiting for the core at most (the actor's queue).
    pub queue_depth: usize,
    /// Bytes of request payloads and expected replies held by in-flight RPCs at most.
    pub inflight_bytes: u64,
    /// Connections served at once at most; more are refused.
    pub max_connections: usize,
    /// How long a request's header, and then its payload, may take to arrive; a slower or stalled sender
    /// is cut off.
    pub request_timeout: Duration,
    /// Where checkpoints go and how often (None: no checkpoints).
    pub checkpoint: Option<CheckpointConfig>,
    /// Whether to start from a checkpoint.
    pub restore: Restore,
}

impl ServiceConfig {
    /// A shard on `listen` serving `core` with `tls`, every other setting at its default (no coordinator to
    /// join, CPU updates, default queue, budget, limits and timeouts, no checkpoints).
    pub fn new(listen: SocketAddr, tls: TlsMaterial, core: ShardConfig) -> Self {
        ServiceConfig {
            listen,
            advertise: None,
            coordinator: None,
            tls,
            core,
            join_timeout: Duration::from_secs(60),
            tick_interval: Duration::from_millis(250),
            device: gaps_kernels::cuda::DeviceChoice::Cpu,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            inflight_bytes: DEFAULT_INFLIGHT_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            checkpoint: None,
            restore: Restore::Never,
        }
    }
}

/// Checkpointing of one shard.
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    /// The root directory (each shard writes under `shard-<i>/`).
    pub dir: std::path::PathBuf,
    /// Take one this often (None: only on shutdown and on demand).
    pub every: Option<Duration>,
    /// Checkpoints kept.
    pub keep: usize,
}

/// Where a starting shard takes its state from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// The newest complete, intact checkpoint in the checkpoint directory, if there is one.
    Auto,
    /// Start fresh.
    Never,
    /// This checkpoint (its `.bin` or `.json`); failing to load it is an error.
    Path(std::path::PathBuf),
}

impl std::str::FromStr for Restore {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "auto" => Restore::Auto,
            "never" => Restore::Never,
            "" => return Err("give auto, never or the path of a checkpoint".into()),
            path => Restore::Path(path.into()),
        })
    }
}

/// Default of [`ServiceConfig::queue_depth`].
pub const DEFAULT_QUEUE_DEPTH: usize = 256;
/// Default of [`ServiceConfig::inflight_bytes`] (512 MiB).
pub const DEFAULT_INFLIGHT_BYTES: u64 = 512 << 20;
/// Default of [`ServiceConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Default of [`ServiceConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The in-flight budget is counted in units of this many bytes (the semaphore counts permits in u32).
const BUDGET_UNIT: u64 = 1024;

/// What the QUIC tasks ask of the core's thread.
enum Command {
    /// Handle one request frame.
    Handle { frame: Frame, reply: oneshot::Sender<(Frame, Vec<CoreEvent>)> },
    /// Expire leases and idle rows; report the counters.
    Tick { reply: oneshot::Sender<(Vec<CoreEvent>, Stats)> },
    /// Read the core (tests, reports).
    Inspect(Box<dyn FnOnce(&ShardCore) + Send>),
    /// Snapshot the core as checkpoint `id` into `buf`; the reply carries the bytes and how long the core
    /// paused.
    Checkpoint { id: u64, buf: Vec<u8>, reply: oneshot::Sender<(Vec<u8>, Duration)> },
}

/// Runs the core on the calling thread until every sender of `queue` is gone.
fn run_actor(mut core: ShardCore, mut queue: mpsc::Receiver<Command>, started: Instant) {
    while let Some(command) = queue.blocking_recv() {
        match command {
            Command::Handle { frame, reply } => {
                let _ = reply.send(core.handle(frame, started.elapsed()));
            }
            Command::Tick { reply } => {
                let events = core.tick(started.elapsed());
                let _ = reply.send((events, core.stats()));
            }
            Command::Inspect(f) => f(&core),
            Command::Checkpoint { id, buf, reply } => {
                let started = Instant::now();
                let bytes = core.checkpoint_into(id, buf);
                let _ = reply.send((bytes, started.elapsed()));
            }
        }
    }
}

struct Shared {
    queue: mpsc::Sender<Command>,
    /// In-flight bytes, in units of [`BUDGET_UNIT`].
    budget: Semaphore,
    budget_units: u32,
    /// Bytes of request payloads and replies that in-flight RPCs hold now, counted from the buffers
    /// themselves, and the most ever held (reported for tests and benches).
    held_bytes: AtomicU64,
    peak_held_bytes: AtomicU64,
    metrics: ShardMetrics,
    limits: Limits,
    /// Connections served now, at most the configured maximum.
    connections: Arc<Semaphore>,
    request_timeout: Duration,
    /// Requests cut off for taking too long, and connections refused (also exported as metrics).
    timed_out: AtomicU64,
    refused: AtomicU64,
    /// The checkpoint files, the next id, and a lock so that two checkpoints are never written at once.
    store: Option<CheckpointStore>,
    next_checkpoint: AtomicU64,
    /// Held while a checkpoint is taken; keeps the last snapshot's buffer for the next one (one more copy
    /// of the shard's state in memory, so that the core's pause is a warm copy).
    checkpoint_lock: tokio::sync::Mutex<Vec<u8>>,
    checkpoints_written: AtomicU64,
    /// The model's chunk size and widest table, to bound a pull's reply before it is made.
    chunk_elems: u64,
    widest_table: u64,
    shard: u32,
}

impl Shared {
    /// Sends `command` to the core, waiting while its queue is full.
    async fn send(&self, command: Command) -> Result<()> {
        self.queue.send(command).await.map_err(|_| anyhow!("shard {} core thread stopped", self.shard))
    }

    /// Bytes a request may hold while in flight: its payload plus the largest reply it can get.
    fn request_bytes(&self, msg: &Message) -> u64 {
        let payload = msg.payload_elems() * 4;
        let reply = match msg {
            Message::Pull(p) => p.chunks.len() as u64 * self.chunk_elems * 4,
            Message::SparsePull(p) => u64::from(p.count) * (1 + self.widest_table) * 4,
            _ => 0,
        };
        payload + reply
    }
}

/// A running shard.
#[derive(Debug)]
pub struct RunningServer {
    /// The bound UDP address.
    pub addr: SocketAddr,
    /// The address given to clients.
    pub advertise: String,
    /// The checkpoint this shard started from, if any.
    pub restored: Option<gaps_shard::core::CheckpointInfo>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("shard", &self.shard).finish_non_exhaustive()
    }
}

impl RunningServer {
    /// Runs `f` on the core's thread, between two requests, and returns its result.
    pub async fn with_core<T: Send + 'static>(&self, f: impl FnOnce(&ShardCore) -> T + Send + 'static) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.shared.send(Command::Inspect(Box::new(move |core| drop(tx.send(f(core)))))).await?;
        rx.await.map_err(|_| anyhow!("shard core thread stopped"))
    }

    /// Takes a checkpoint now (the core pauses while it is copied; the file is written in the background of
    /// the core's work) and returns its path. Fails when the shard has no checkpoint directory.
    pub async fn checkpoint_now(&self) -> Result<std::path::PathBuf> {
        take_checkpoint(&self.shared).await.map(|(_, path)| path)
    }

    /// Checkpoints written since start.
    pub fn checkpoints_written(&self) -> u64 {
        self.shared.checkpoints_written.load(Ordering::Relaxed)
    }

    /// Requests cut off because their header or payload took longer than the request timeout.
    pub fn requests_timed_out(&self) -> u64 {
        self.shared.timed_out.load(Ordering::Relaxed)
    }

    /// Connections refused because the shard already served its maximum.
    pub fn connections_refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// The most bytes of request payloads and expected replies that in-flight RPCs held at once.
    pub fn peak_inflight_bytes(&self) -> u64 {
        self.shared.peak_held_bytes.load(Ordering::Relaxed)
    }

    /// Stops accepting, lets in-flight RPCs finish (up to a few seconds), closes the endpoint, and — when
    /// the shard keeps checkpoints — writes a final one.
    pub async fn shutdown(self) -> Result<()> {
        let _ = self.shutdown.send(true);
        self.task.await.context("joining the server task")?;
        if self.shared.store.is_some() {
            let (_, path) = take_checkpoint(&self.shared).await.context("writing the final checkpoint")?;
            info!(shard = self.shared.shard, path = %path.display(), "final checkpoint written");
        }
        Ok(())
    }

    /// Waits until the server stops (after [`RunningServer::shutdown`] from elsewhere or a fatal error).
    pub async fn wait(&mut self) -> Result<()> {
        (&mut self.task).await.context("joining the server task")
    }
}

fn wire_error_code(e: &WireError) -> ErrorCode {
    match e {
        WireError::HeaderTooLarge { .. } | WireError::PayloadTooLarge { .. } => ErrorCode::TooLarge,
        WireError::UnknownKind(_) => ErrorCode::UnknownKind,
        _ => ErrorCode::Malformed,
    }
}

/// Binds, joins the cluster (shards ≥ 1) and starts serving.
pub async fn start(mut cfg: ServiceConfig) -> Result<RunningServer> {
    let endpoint = net::server_endpoint(cfg.listen, &cfg.tls)?;
    let addr = endpoint.local_addr().context("reading the bound address")?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None if addr.ip().is_unspecified() => {
            bail!("listening on {addr}: pass --advertise HOST:PORT so clients know where to reach this shard")
        }
        None => addr.to_string(),
    };
    cfg.core.advertise = advertise.clone();
    let shard = cfg.core.shard;
    let store = match &cfg.checkpoint {
        Some(c) => Some(CheckpointStore::open(&c.dir, shard, c.keep)?),
        None => None,
    };
    let snapshot = match (&cfg.restore, &store) {
        (Restore::Never, _) | (Restore::Auto, None) => None,
        (Restore::Auto, Some(store)) => store.latest()?.map(|found| (found.path, found.bytes)),
        (Restore::Path(path), _) => Some((path.clone(), crate::checkpoint::load_path(path)?)),
    };
    let (mut core, restored) = match snapshot {
        Some((path, bytes)) => {
            let (core, info) = ShardCore::checkpoint_info(&bytes)
                .and_then(|info| ShardCore::restore(cfg.core.clone(), &bytes).map(|core| (core, info)))
                .map_err(|e| anyhow!("restoring shard {shard} from {}: {e}", path.display()))?;
            info!(shard, checkpoint = info.id, path = %path.display(), versions = ?info.tensor_versions, "restored");
            (core, Some(info))
        }
        None => (ShardCore::new(cfg.core.clone()).map_err(|e| anyhow!("configuring shard {shard}: {e}"))?, None),
    };
    match gaps_kernels::cuda::CudaDevice::for_choice(cfg.device).context("--device")? {
        Some(gpu) => {
            info!(shard, gpu = gpu.name(), "updates run on the GPU");
            core.set_device(Some(Arc::new(gpu)));
        }
        None if cfg.device == gaps_kernels::cuda::DeviceChoice::Auto => {
            info!(shard, "no usable GPU; updates run on the CPU")
        }
        None => {}
    }
    if shard != 0 {
        let coordinator =
            cfg.coordinator.clone().context("shards other than 0 need --coordinator (shard 0's address)")?;
        join_coordinator(&endpoint, &coordinator, &mut core, cfg.join_timeout).await?;
    }
    // A push can never carry more than this shard owns (twice that with the read echo); refuse bigger frames
    // before allocating them.
    let owned_bytes = core.owned_elems() as u64 * 4;
    let echo = 1 + u64::from(core.needs_read());
    // Sparse requests are bounded by rows per RPC: ids, versions, gradients and read rows of the widest table.
    let widest = core.config().layout.tables.iter().map(|t| u64::from(t.dim)).max();
    let sparse_bytes = widest.map_or(0, |dim| MAX_SPARSE_ROWS_PER_RPC * (3 + 2 * dim) * 4);
    let max_payload_bytes =
        (owned_bytes * echo).max(sparse_bytes).clamp(4, gaps_common::wire::DEFAULT_MAX_PAYLOAD_BYTES);
    let limits = Limits { max_payload_bytes, ..Limits::default() };
    let chunk_elems = u64::from(core.config().layout.chunk_elems);
    let (queue, receiver) = mpsc::channel(cfg.queue_depth.max(1));
    let started = Instant::now();
    std::thread::Builder::new()
        .name(format!("gaps-shard-{shard}"))
        .spawn(move || run_actor(core, receiver, started))
        .context("starting the shard's core thread")?;
    let budget_units = (cfg.inflight_bytes / BUDGET_UNIT).clamp(1, u64::from(u32::MAX >> 3)) as u32;
    let shared = Arc::new(Shared {
        queue,
        budget: Semaphore::new(budget_units as usize),
        budget_units,
        held_bytes: AtomicU64::new(0),
        peak_held_bytes: AtomicU64::new(0),
        metrics: ShardMetrics::register(shard),
        limits,
        connections: Arc::new(Semaphore::new(cfg.max_connections.max(1))),
        request_timeout: cfg.request_timeout,
        timed_out: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        next_checkpoint: AtomicU64::new(match &store {
            Some(s) => s.next_id()?.max(restored.as_ref().map_or(0, |r| r.id + 1)),
            None => 1,
        }),
        store,
        checkpoint_lock: tokio::sync::Mutex::new(Vec::new()),
        checkpoints_written: AtomicU64::new(0),
        chunk_elems,
        widest_table: widest.unwrap_or(0),
        shard,
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    if let Some(every) = cfg.checkpoint.as_ref().and_then(|c| c.every) {
        let shared = shared.clone();
        let mut stop = shutdown_rx.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = interval.tick() => {}
                }
                if let Err(e) = take_checkpoint(&shared).await {
                    warn!(shard = shared.shard, error = format!("{e:#}"), "writing a checkpoint failed");
                }
            }
        });
    }
    let task = tokio::spawn(
        serve(endpoint, shared.clone(), shutdown_rx, cfg.tick_interval).instrument(tracing::info_span!("shard", shard)),
    );
    info!(shard, %addr, %advertise, "serving");
    Ok(RunningServer { addr, advertise, restored, shutdown: shutdown_tx, task, shared })
}

/// Answers a checkpoint request: the checkpoint's id and path, or why none was written.
async fn checkpoint_reply(shared: &Shared) -> Frame {
    match take_checkpoint(shared).await {
        Ok((id, path)) => Frame::new(Message::CheckpointDone(gaps_common::wire::CheckpointDone {
            shard: shared.shard,
            id,
            path: path.display().to_string(),
        })),
        Err(e) => Frame::new(Message::error(ErrorCode::Misconfigured, format!("{e:#}"))),
    }
}

/// Snapshots the core (it pauses for the copy only) and writes the checkpoint on a blocking thread; returns
/// its id and path.
async fn take_checkpoint(shared: &Shared) -> Result<(u64, std::path::PathBuf)> {
    let Some(store) = shared.store.clone() else { bail!("this shard has no --checkpoint-dir") };
    let mut spare = shared.checkpoint_lock.lock().await;
    let id = shared.next_checkpoint.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    shared.send(Command::Checkpoint { id, buf: std::mem::take(&mut *spare), reply: tx }).await?;
    let (bytes, pause) = rx.await.map_err(|_| anyhow!("shard core thread stopped"))?;
    let info = ShardCore::checkpoint_info(&bytes).map_err(|e| anyhow!("reading back checkpoint {id}: {e}"))?;
    let started = Instant::now();
    let size = bytes.len();
    let (written, bytes) = tokio::task::spawn_blocking(move || (store.write(&info, &bytes), bytes))
        .await
        .context("writing a checkpoint")?;
    *spare = bytes;
    let path = written?;
    shared.checkpoints_written.fetch_add(1, Ordering::Relaxed);
    info!(
        shard = shared.shard,
        checkpoint = id,
        bytes = size,
        pause_ms = pause.as_secs_f64() * 1e3,
        write_ms = started.elapsed().as_secs_f64() * 1e3,
        "checkpoint written"
    );
    Ok((id, path))
}

async fn join_coordinator(
    endpoint: &quinn::Endpoint,
    coordinator: &str,
    core: &mut ShardCore,
    timeout: Duration,
) -> Result<()> {
    let started = Instant::now();
    let request = core.join_request();
    let limits = Limits::default();
    loop {
        let attempt = async {
            let addr = net::resolve(coordinator).await?;
            let conn = net::connect(endpoint, addr, Duration::from_secs(5)).await?;
            let reply = net::call(&conn, &request, &[], &limits, Duration::from_secs(10)).await;
            conn.close(0u32.into(), b"joined");
            reply
        };
        let last = match attempt.await {
            Ok(Frame { msg: Message::ClusterMap(map), .. }) => {
                core.joined(&map).map_err(|e| anyhow!("joining the coordinator at {coordinator}: {e}"))?;
                info!(shard = core.config().shard, epoch = map.epoch, "joined the coordinator");
                return Ok(());
            }
            Ok(other) => bail!("the coordinator at {coordinator} answered with {}", net::kind_name(&other.msg)),
            Err(e @ RpcError::Remote { .. }) => bail!("the coordinator refused this shard: {e}"),
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= timeout {
            bail!("could not reach the coordinator at {coordinator} within {timeout:?}: {last}");
        }
        debug!(%last, "coordinator not reachable yet");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>, tick: Duration) {
    // Each in-flight RPC holds a clone of this token; shutdown waits until only the original is left.
    let inflight = Arc::new(());
    let ticker = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            loop {
                interval.tick().await;
                let (tx, rx) = oneshot::channel();
                if shared.send(Command::Tick { reply: tx }).await.is_err() {
                    return;
                }
                let Ok((events, stats)) = rx.await else { return };
                shared.metrics.observe(&stats);
                log_events(&events);
            }
        })
    };
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                let Ok(slot) = shared.connections.clone().try_acquire_owned() else {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    shared.metrics.connections_refused.increment(1);
                    warn!(peer = %incoming.remote_address(), "refused a connection: the shard serves its maximum");
                    incoming.refuse();
                    continue;
                };
                let shared = shared.clone();
                let inflight = inflight.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    let conn = match incoming.await {
                        Ok(c) => c,
                        Err(e) => {
                            // A client without a certificate from the cluster CA ends here.
                            warn!(error = %e, "refused a connection");
                            return;
                        }
                    };
                    serve_connection(conn, shared, inflight, shutdown).await;
                    drop(slot);
                });
            }
        }
    }
    ticker.abort();
    endpoint.set_server_config(None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&inflight) > 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    endpoint.close(0u32.into(), b"shutdown");
    let _ = tokio::time::timeout(Duration::from_secs(3), endpoint.wait_idle()).await;
    info!(shard = shared.shard, "stopped");
}

async fn serve_connection(
    conn: quinn::Connection,
    shared: Arc<Shared>,
    inflight: Arc<()>,
    mut shutdown: watch::Receiver<bool>,
) {
    let peer = conn.remote_address();
    debug!(%peer, "connection");
    loop {
        let stream = tokio::select! {
            _ = shutdown.changed() => return,
            s = conn.accept_bi() => s,
        };
        match stream {
            Ok((send, recv)) => {
                let shared = shared.clone();
                let token = inflight.clone();
                tokio::spawn(async move {
                    serve_stream(&shared, send, recv).await;
                    drop(token);
                });
            }
            Err(e) => {
                debug!(%peer, error = %e, "connection ended");
                return;
            }
        }
    }
}

async fn serve_stream(shared: &Shared, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
    let started = Instant::now();
    let header = match tokio::time::timeout(shared.request_timeout, net::read_header(&mut recv, &shared.limits)).await {
        Err(_) => return cut_off(shared, &mut send, &mut recv, "header"),
        Ok(Ok(msg)) => Ok(msg),
        Ok(Err(WireError::Io(message))) => {
            debug!(%message, "stream broke before the request was complete");
            return;
        }
        Ok(Err(e)) => Err(e),
    };
    // Reserve the request's bytes before reading its payload: while the budget is spent this stream is not
    // read, and QUIC flow control holds the sender back.
    let bytes = header.as_ref().map_or(0, |msg| shared.request_bytes(msg));
    let units = bytes.div_ceil(BUDGET_UNIT).clamp(1, u64::from(shared.budget_units)) as u32;
    let Ok(_permit) = shared.budget.acquire_many(units).await else { return };
    let mut held = Held { shared, bytes: 0 };
    serve_request(&mut held, &mut send, &mut recv, header, started).await;
}

/// Ends a stream whose sender is too slow or stalled: resets both directions and counts it.
fn cut_off(shared: &Shared, send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, part: &str) {
    shared.timed_out.fetch_add(1, Ordering::Relaxed);
    shared.metrics.requests_timed_out.increment(1);
    warn!(part, timeout = ?shared.request_timeout, "cut off a request that did not arrive in time");
    let _ = recv.stop(2u32.into());
    let _ = send.reset(2u32.into());
}

/// The buffer bytes one RPC holds, released from the shared count when the RPC ends however it ends.
struct Held<'a> {
    shared: &'a Shared,
    bytes: u64,
}

impl Held<'_> {
    fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        let now = self.shared.held_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.shared.peak_held_bytes.fetch_max(now, Ordering::Relaxed);
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.shared.held_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

async fn serve_request(
    held: &mut Held<'_>,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    header: Result<Message, WireError>,
    started: Instant,
) {
    let shared = held.shared;
    let request = match header {
        Ok(msg) => {
            let read = async {
                let payload = net::read_payload(recv, &msg).await?;
                net::expect_end(recv).await.map(|()| payload)
            };
            match tokio::time::timeout(shared.request_timeout, read).await {
                Err(_) => return cut_off(shared, send, recv, "payload"),
                Ok(Ok(payload)) => {
                    held.add(payload.len() as u64 * 4);
                    Ok(Frame { msg, payload })
                }
                Ok(Err(e)) => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    let (reply, histogram) = match request {
        Err(WireError::Io(message)) => {
            debug!(%message, "stream broke before the request was complete");
            return;
        }
        Err(e) => {
            warn!(error = %e, "refused a malformed request");
            (Frame::new(Message::error(wire_error_code(&e), e.to_string())), &shared.metrics.rpc_other_seconds)
        }
        Ok(frame) => {
            shared.metrics.bytes_in.increment(frame.payload.len() as u64 * 4);
            let kind = RpcKind::of(&frame.msg);
            let histogram = match kind {
                RpcKind::Push => &shared.metrics.rpc_push_seconds,
                RpcKind::Pull => &shared.metrics.rpc_pull_seconds,
                RpcKind::Other => &shared.metrics.rpc_other_seconds,
            };
            let handled = if matches!(frame.msg, Message::CheckpointRequest(_)) {
                Some((checkpoint_reply(shared).await, Vec::new()))
            } else {
                let (tx, rx) = oneshot::channel();
                match shared.send(Command::Handle { frame, reply: tx }).await {
                    Ok(()) => rx.await.ok(),
                    Err(_) => None,
                }
            };
            let Some((reply, events)) = handled else {
                let _ = send.reset(1u32.into());
                return;
            };
            log_events(&events);
            record(&shared.metrics, kind, &reply.msg);
            (reply, histogram)
        }
    };
    held.add(reply.payload.len() as u64 * 4);
    match net::write_frame(send, &reply.msg, &[&reply.payload]).await {
        Ok(bytes) => shared.metrics.bytes_out.increment(bytes),
        Err(e) => debug!(error = %e, "writing the reply"),
    }
    let _ = send.finish();
    histogram.record(started.elapsed().as_secs_f64());
}

/// What a request counts as in the metrics: dense and sparse pushes are pushes, dense and sparse pulls are
/// pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RpcKind {
    Push,
    Pull,
    Other,
}

impl RpcKind {
    fn of(msg: &Message) -> Self {
        match msg {
            Message::Push(_) | Message::SparsePush(_) => RpcKind::Push,
            Message::Pull(_) | Message::SparsePull(_) => RpcKind::Pull,
            _ => RpcKind::Other,
        }
    }
}

fn record(m: &ShardMetrics, request: RpcKind, reply: &Message) {
    match (request, reply) {
        (RpcKind::Push, Message::Ack(ack)) if ack.duplicate => m.push_duplicates.increment(1),
        (RpcKind::Push, Message::Ack(ack)) => {
            m.pushes.increment(1);
            m.staleness.record(ack.max_staleness as f64);
        }
        (RpcKind::Push, _) => m.push_rejected.increment(1),
        (RpcKind::Pull, Message::PullReply(_) | Message::SparsePullReply(_)) => m.pulls.increment(1),
        _ => {}
    }
}

fn log_events(events: &[CoreEvent]) {
    for e in events {
        match e {
            CoreEvent::WorkerJoined(w) => info!(worker = w, "worker registered"),
            CoreEvent::WorkerLeft(w) => info!(worker = w, "worker left"),
            CoreEvent::WorkerExpired(w) => warn!(worker = w, "worker lease expired"),
            CoreEvent::ShardJoined(s) => info!(joined = s, "shard joined"),
            CoreEvent::ModeSwitch { from, to, reason } => warn!(%from, %to, %reason, "training mode switched"),
            CoreEvent::LrRamp { workers, target } => {
                info!(workers, target, "learning-rate multiplier ramps to the new worker count")
            }
        }
    }
}
