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

use crate::auth::{Credentials, LogLimiter};
use crate::checkpoint::CheckpointStore;
use crate::metrics::ShardMetrics;
use crate::replication::{Backups, Log};
use anyhow::{anyhow, bail, Context, Result};
use dashmap::DashMap;
use gaps_common::wire::Role as WireRole;
use gaps_common::wire::{
    CheckpointAt, CheckpointDone, CheckpointRequest, ErrorCode, Frame, Limits, Message, PullReply, PushPullReply,
    Rollback, RollbackReply, RollbackStage, ShardCheckpoint, Stats, WireError,
};
use gaps_shard::stripes::Assembler;
use gaps_shard::{CoreEvent, Readiness, ShardConfig, ShardCore};
use gaps_transport::identity::{PeerIdentity, Role};
use gaps_transport::net::{self, Admission as _, RpcError};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tracing::{debug, error, info, warn, Instrument};

mod actor;
mod checkpoints;
mod rpc;
use actor::*;
use checkpoints::*;
use rpc::*;

/// Largest number of sparse rows one pull or push may carry.
pub const MAX_SPARSE_ROWS_PER_RPC: u64 = 1 << 20;

/// Per-worker plane stripes a GPU-resident shard holds by default (16 workers and the synchronous step).
pub const DEFAULT_DEVICE_WORKER_SLOTS: u32 = 17;

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
    /// With the state on a GPU: workers whose per-worker optimizer planes the device holds at once (one
    /// more is set aside for synchronous steps).
    pub device_worker_slots: u32,
    /// Requests waiting for the core at most (the actor's queue).
    pub queue_depth: usize,
    /// Bytes of request payloads and expected replies held by in-flight RPCs at most.
    pub inflight_bytes: u64,
    /// Connections served at once at most; more are refused.
    pub max_connections: usize,
    /// Connections from one IP address at most (so one host cannot take every connection slot).
    pub max_connections_per_ip: u32,
    /// Live workers one certificate may have registered at once (so one certificate cannot fill the
    /// coordinator's tables with workers).
    pub max_workers_per_certificate: u32,
    /// How long a request's header, and then its payload, may take to arrive, and its reply to be taken by
    /// the peer; a slower sender or reader is cut off.
    pub request_timeout: Duration,
    /// A request of which no byte arrived for this long is cut off (its sender stalled, or holds the stream
    /// open on purpose).
    pub stall_timeout: Duration,
    /// How long a request waits for room in the in-flight budget before it is refused as busy (the client
    /// sends it again).
    pub budget_wait: Duration,
    /// A connection that opens no request for this long is closed (workers heartbeat far more often; a
    /// client whose connection was closed opens a new one).
    pub idle_timeout: Duration,
    /// Where checkpoints go and how often (None: no checkpoints).
    pub checkpoint: Option<CheckpointConfig>,
    /// Whether to start from a checkpoint.
    pub restore: Restore,
    /// Where `/healthz` and `/readyz` read the shard's state (None: no health endpoints).
    pub health: Option<Arc<crate::metrics::Health>>,
    /// The coordinator deals the training data in splits (dynamic data sharding; None: workers read their
    /// own fixed share).
    pub data: Option<gaps_shard::dealer::DealerConfig>,
    /// Copies of each shard's state, on as many shard processes (1: none; see [`crate::replication`]).
    pub replicas: u32,
    /// How long a primary waits for a backup's answer before it goes on without it.
    pub replica_ack_timeout: Duration,
    /// A backup whose primary sent nothing for this long asks the coordinator to take the shard over.
    pub failover_after: Duration,
    /// Record every request that changes a served shard's state in this folder (tests of replication:
    /// [`crate::record`]).
    pub record: Option<std::path::PathBuf>,
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
            device_worker_slots: DEFAULT_DEVICE_WORKER_SLOTS,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            inflight_bytes: DEFAULT_INFLIGHT_BYTES,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_ip: DEFAULT_MAX_CONNECTIONS_PER_IP,
            max_workers_per_certificate: DEFAULT_MAX_WORKERS_PER_CERTIFICATE,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            budget_wait: DEFAULT_BUDGET_WAIT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            checkpoint: None,
            restore: Restore::Never,
            health: None,
            data: None,
            replicas: 1,
            replica_ack_timeout: crate::replication::DEFAULT_ACK_TIMEOUT,
            failover_after: crate::replication::DEFAULT_FAILOVER_AFTER,
            record: None,
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
/// Default of [`ServiceConfig::max_workers_per_certificate`].
pub const DEFAULT_MAX_WORKERS_PER_CERTIFICATE: u32 = 4096;
/// Default of [`ServiceConfig::max_connections_per_ip`].
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: u32 = 512;
/// Default of [`ServiceConfig::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a shard gives memory kept for reuse back to the kernel (`buffers::release_idle`).
const RELEASE_IDLE_EVERY: Duration = Duration::from_secs(5);
/// Default of [`ServiceConfig::stall_timeout`].
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`ServiceConfig::budget_wait`].
pub const DEFAULT_BUDGET_WAIT: Duration = Duration::from_secs(2);
/// Default of [`ServiceConfig::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// One connection's requests together hold at most this fraction of the in-flight budget (1/4), so that no
/// peer can take all of it; a single request larger than that share is admitted at the share.
const CONNECTION_SHARE_DIVISOR: u32 = 4;
/// The in-flight budget is counted in units of this many bytes (the semaphore counts permits in u32).
const BUDGET_UNIT: u64 = 1024;

struct Shared {
    queue: mpsc::Sender<Command>,
    /// The UDP path tuning the endpoint was made with (kept for certificate reloads).
    path: net::PathTuning,
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
    stall_timeout: Duration,
    budget_wait: Duration,
    idle_timeout: Duration,
    /// Budget units one connection's requests may hold together.
    connection_units: u32,
    /// Requests refused as busy, and connections closed for idling.
    busy: AtomicU64,
    idle_closed: AtomicU64,
    /// Requests cut off for taking too long, and connections refused (also exported as metrics).
    timed_out: AtomicU64,
    refused: AtomicU64,
    /// The checkpoint files, the next id, and a lock so that two checkpoints are never written at once.
    store: Option<CheckpointStore>,
    next_checkpoint: AtomicU64,
    /// Held while a checkpoint is taken; keeps the last snapshot's buffer for the next one (one more copy
    /// of the shard's state in memory, so that the core's pause is a warm copy).
    checkpoint_lock: tokio::sync::Mutex<Vec<u8>>,
    /// Held by the coordinator while it takes a cluster checkpoint or rolls the cluster back, so the two
    /// never interleave.
    cluster_lock: tokio::sync::Mutex<()>,
    /// Where updates run, for a core rebuilt by a rollback.
    device: gaps_kernels::cuda::DeviceChoice,
    device_worker_slots: u32,
    /// The coordinator's address (shards ≥ 1), which a restored shard asks for a cluster rollback.
    coordinator: Option<String>,
    /// Rollbacks this shard went through, and the checkpoint and step of the last.
    rollbacks: AtomicU64,
    last_rollback: std::sync::Mutex<Option<(u64, u64)>>,
    checkpoints_written: AtomicU64,
    /// When this shard last wrote a checkpoint (milliseconds since `started`).
    last_checkpoint_ms: AtomicU64,
    /// Wakes checkpoints that wait for a step when the shard shuts down.
    stopping: tokio::sync::Notify,
    /// The shard's endpoint, also used to reach the other shards (the coordinator's cluster checkpoints).
    endpoint: quinn::Endpoint,
    started: Instant,
    /// The client configuration after a certificate rotation (None: the endpoint's own), for connections to
    /// other shards.
    rotated: Arc<std::sync::Mutex<Option<quinn::ClientConfig>>>,
    /// This shard's own identity (its cluster is the only one it serves).
    own: PeerIdentity,
    /// Makes and checks workers' credentials.
    credentials: Credentials,
    /// Connection (quinn's stable id) → the worker it is authenticated as.
    bindings: DashMap<usize, u32>,
    /// Connections open per peer IP address, and the most allowed.
    per_ip: DashMap<std::net::IpAddr, u32>,
    max_per_ip: u32,
    /// Live registered workers: who registered each, how many each certificate holds, and the most.
    registrants: DashMap<u32, PeerIdentity>,
    per_certificate: DashMap<PeerIdentity, u32>,
    max_per_certificate: u32,
    /// Requests and connections refused for authorization.
    unauthorized: AtomicU64,
    /// Rate limits of the warnings for refused requests, malformed requests and refused connections.
    log_unauthorized: LogLimiter,
    log_malformed: LogLimiter,
    log_connections: LogLimiter,
    /// The model's chunk size and widest table, to bound a pull's reply before it is made.
    chunk_elems: u64,
    widest_table: u64,
    shard: u32,
    /// The replica log of this shard (with `--replicas` ≥ 2), and the copies of other shards kept here.
    log: Option<Arc<Log>>,
    backups: Option<Arc<Backups>>,
    /// This process's part in choosing shard 0's configuration (with `--replicas` ≥ 2 and ≥ 3 processes).
    quorum: Option<Arc<crate::quorum::Quorum>>,
    /// The address clients reach this shard at.
    advertise: String,
    /// Copies of each shard the cluster keeps (told to clients with the map).
    replicas: u32,
    /// The shards this process took over from their silent primaries, each served on an endpoint of its own.
    taken_over: std::sync::Mutex<Vec<RunningServer>>,
}

impl Shared {
    /// Sends `command` to the core, waiting while its queue is full.
    async fn send(&self, command: Command) -> Result<()> {
        self.queue.send(command).await.map_err(|_| anyhow!("shard {} core thread stopped", self.shard))
    }

    /// Bytes the largest reply to `msg` can hold (admitted once the request is whole, before it is handled).
    fn reply_bytes(&self, msg: &Message) -> u64 {
        match msg {
            Message::Pull(p) => p.chunks.len() as u64 * self.chunk_elems * 4,
            Message::PushPull(p) => p.chunks.len() as u64 * self.chunk_elems * 4,
            Message::SparsePull(p) => u64::from(p.count) * (1 + self.widest_table) * 4,
            _ => 0,
        }
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
    health: Option<Arc<crate::metrics::Health>>,
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
        Ok(take_checkpoint(&self.shared, None, CheckpointAt::Now).await?.path)
    }

    /// On the coordinator: takes a cluster checkpoint (every shard at the same synchronous step, or at its
    /// next quiescent point) and returns each shard's file. Fails when any shard could not write it.
    pub async fn cluster_checkpoint(&self) -> Result<CheckpointDone> {
        cluster_checkpoint(&self.shared).await
    }

    /// Checkpoints written since start.
    pub fn checkpoints_written(&self) -> u64 {
        self.shared.checkpoints_written.load(Ordering::Relaxed)
    }

    /// Requests cut off because their header or payload took longer than the request timeout.
    pub fn requests_timed_out(&self) -> u64 {
        self.shared.timed_out.load(Ordering::Relaxed)
    }

    /// Rollbacks this shard went through, and the checkpoint id and step of the last one.
    pub fn rollbacks(&self) -> (u64, Option<(u64, u64)>) {
        let last = self.shared.last_rollback.lock().ok().and_then(|l| *l);
        (self.shared.rollbacks.load(Ordering::Relaxed), last)
    }

    /// Requests refused as busy: the in-flight budget had no room for them within the budget wait.
    pub fn requests_busy(&self) -> u64 {
        self.shared.busy.load(Ordering::Relaxed)
    }

    /// Connections closed because they opened no request for the idle timeout.
    pub fn connections_idle_closed(&self) -> u64 {
        self.shared.idle_closed.load(Ordering::Relaxed)
    }

    /// Connections refused because the shard already served its maximum.
    pub fn connections_refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Replaces the TLS material (certificate rotation): new connections, in and out, use `tls`; open ones
    /// keep theirs. The new certificate must name the same shard of the same cluster.
    pub fn reload_tls(&self, tls: &TlsMaterial) -> Result<()> {
        let id = tls.own_identity().context("reading the new certificate")?;
        if id != self.shared.own {
            bail!("the new certificate is {id}, this shard is {}", self.shared.own);
        }
        if *self.shutdown.borrow() {
            bail!("the shard is shutting down");
        }
        self.shared.endpoint.set_server_config(Some(net::server_config(tls, &self.shared.path)?));
        let client = net::client_config(tls, &self.shared.path)?;
        *self.shared.rotated.lock().map_err(|_| anyhow!("the TLS lock is poisoned"))? = Some(client);
        Ok(())
    }

    /// This shard's state as a checkpoint's bytes, with the last entry of its replica log it holds (0 without
    /// `--replicas`); the backups' copies are compared with it (tests, reports).
    pub async fn snapshot(&self) -> Result<(u64, Vec<u8>)> {
        snapshot_of(&self.shared).await
    }

    /// [`RunningServer::snapshot`] of shard `shard`, which this process took over; and how many backups its
    /// replies wait for (None: this process did not take it over).
    pub async fn taken_over(&self, shard: u32) -> Option<(Result<(u64, Vec<u8>)>, usize)> {
        let shared = self.shared.taken_over.lock().ok()?.iter().find(|s| s.shared.shard == shard)?.shared.clone();
        let live = shared.log.as_ref().map_or(0, |l| l.live_backups());
        Some((snapshot_of(&shared).await, live))
    }

    /// The copy of shard `shard` this process keeps (`--replicas`): the last entry applied and the copy as a
    /// checkpoint's bytes (None: no copy of it here, or no snapshot yet).
    pub fn replica_copy(&self, shard: u32) -> Option<(u64, Vec<u8>)> {
        let backups = self.shared.backups.as_ref()?;
        backups.inspect(shard, |applied, core| {
            core.and_then(|c| c.checkpoint_into(0, Vec::new()).ok()).map(|b| (applied, b))
        })?
    }

    /// The backups replies of this shard wait for now (0 without `--replicas`).
    pub fn live_backups(&self) -> usize {
        self.shared.log.as_ref().map_or(0, |l| l.live_backups())
    }

    /// The last configuration of shard 0 this process knows chosen by a majority (None: the cluster does not
    /// choose it so, [`crate::quorum::enabled`]).
    pub fn shard0_config(&self) -> Option<gaps_common::quorum::CoordinatorConfig> {
        self.shared.quorum.as_ref().map(|q| q.chosen())
    }

    /// Requests and connections refused because the certificate or credential did not allow them.
    pub fn unauthorized(&self) -> u64 {
        self.shared.unauthorized.load(Ordering::Relaxed)
    }

    /// The most bytes of request payloads and expected replies that in-flight RPCs held at once.
    pub fn peak_inflight_bytes(&self) -> u64 {
        self.shared.peak_held_bytes.load(Ordering::Relaxed)
    }

    /// Stops accepting, lets in-flight RPCs finish (up to a few seconds), closes the endpoint, and — when
    /// the shard keeps checkpoints — writes a final one.
    pub async fn shutdown(self) -> Result<()> {
        if let Some(h) = &self.health {
            h.stopping();
        }
        for server in self.take_taken_over() {
            Box::pin(server.shutdown()).await?;
        }
        let _ = self.shutdown.send(true);
        self.task.await.context("joining the server task")?;
        if self.shared.store.is_some() {
            // A checkpoint waiting for a step that will not come now gives up; the final one is taken as is.
            self.shared.stopping.notify_waiters();
            let w =
                take_checkpoint(&self.shared, None, CheckpointAt::Now).await.context("writing the final checkpoint")?;
            info!(shard = self.shared.shard, path = %w.path.display(), "final checkpoint written");
        }
        Ok(())
    }

    /// The servers of the shards this process took over, handed to the caller (to stop them).
    fn take_taken_over(&self) -> Vec<RunningServer> {
        self.shared.taken_over.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default()
    }

    /// Test hook: while `hold`, this shard ships nothing to its backups (its replies to state-changing requests
    /// wait), as a slow network to them would.
    #[doc(hidden)]
    pub fn hold_replication(&self, hold: bool) {
        if let Some(log) = &self.shared.log {
            log.hold(hold);
        }
    }

    /// Stops at once, as a killed process would (tests): the endpoint closes without a word, no request is
    /// answered, nothing more is sent to backups or checkpointed. The shards this process took over stop too.
    pub fn crash(self) {
        for server in self.take_taken_over() {
            server.crash();
        }
        self.shared.endpoint.close(0u32.into(), b"");
        let _ = self.shutdown.send(true);
        self.task.abort();
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
pub async fn start(cfg: ServiceConfig) -> Result<RunningServer> {
    start_serving(cfg, None).await
}

/// A backup's copy of a shard that this process takes over (replicated shards): served with the process's
/// own certificate on an endpoint of its own, bound before the coordinator was told its address.
struct Takeover {
    core: ShardCore,
    /// This process's index.
    process: u32,
    /// The cluster's credential key (the workers' tokens stay valid).
    key: gaps_common::wire::Token,
    /// The primary's clock at the copy's last entry: the copy's clock goes on from there.
    clock: Duration,
    /// The replica epoch the coordinator granted.
    epoch: u64,
    /// The last entry of the primary's log the copy applied.
    applied: u64,
    /// The process's part in choosing shard 0's configuration.
    quorum: Option<Arc<crate::quorum::Quorum>>,
    endpoint: (quinn::Endpoint, net::PathTuning),
}

/// A server starting (boxed: a process that takes a shard over starts a server from within one).
type Starting = std::pin::Pin<Box<dyn std::future::Future<Output = Result<RunningServer>> + Send>>;

fn start_serving(cfg: ServiceConfig, takeover: Option<Takeover>) -> Starting {
    Box::pin(start_serving_now(cfg, takeover))
}

async fn start_serving_now(mut cfg: ServiceConfig, takeover: Option<Takeover>) -> Result<RunningServer> {
    crate::replication::check_replicas(cfg.replicas, cfg.core.num_shards)?;
    if cfg.replicas > 1 && cfg.device != gaps_kernels::cuda::DeviceChoice::Cpu {
        bail!(
            "--replicas {} runs every copy's updates on the CPU, so that copies stay equal bit for bit: pass --device cpu",
            cfg.replicas
        );
    }
    let own = cfg.tls.own_identity().context("reading this shard's certificate")?;
    let process = takeover.as_ref().map_or(cfg.core.shard, |t| t.process);
    if own.role != Role::Shard(process) {
        bail!(
            "this is shard {} but its certificate is {own}: pass the shard-{}.pem made by `gaps certs`",
            cfg.core.shard,
            cfg.core.shard
        );
    }
    let (taken_core, taken_key, taken_clock, bound, replica_epoch, taken_index, taken_quorum) = match takeover {
        Some(t) => (Some(t.core), Some(t.key), Some(t.clock), Some(t.endpoint), t.epoch, t.applied, Some(t.quorum)),
        None => (None, None, None, None, 0, 0, None),
    };
    let taken_core_given = taken_core.is_some();
    let (endpoint, path) = match bound {
        Some(bound) => bound,
        None => net::server_endpoint(cfg.listen, &cfg.tls)?,
    };
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
    let health = cfg.health.clone();
    let report = |what: &str| {
        if let Some(h) = &health {
            h.starting(what);
        }
    };
    report("restoring");
    let store = match &cfg.checkpoint {
        Some(c) => Some(CheckpointStore::open(&c.dir, shard, c.keep)?),
        None => None,
    };
    let snapshot = match (&cfg.restore, &store) {
        (Restore::Never, _) | (Restore::Auto, None) => None,
        (Restore::Auto, Some(store)) => store.latest()?.map(|found| (found.path, found.bytes)),
        (Restore::Path(path), _) => Some((path.clone(), crate::checkpoint::load_path(path)?)),
    };
    let (mut core, restored) = match (taken_core, snapshot) {
        (Some(core), _) => (core, None),
        (None, Some((path, bytes))) => {
            let (core, info) = ShardCore::checkpoint_info(&bytes)
                .and_then(|info| ShardCore::restore(cfg.core.clone(), &bytes).map(|core| (core, info)))
                .map_err(|e| anyhow!("restoring shard {shard} from {}: {e}", path.display()))?;
            info!(shard, checkpoint = info.id, path = %path.display(), versions = ?info.tensor_versions, "restored");
            (core, Some(info))
        }
        (None, None) => {
            (ShardCore::new(cfg.core.clone()).map_err(|e| anyhow!("configuring shard {shard}: {e}"))?, None)
        }
    };
    let mut journal = None;
    // Other shards keep `--data` only for their copy of the coordinator.
    if let Some(data) = cfg.data.clone().filter(|_| shard == 0) {
        match (&store, cfg.core.modes.mode == gaps_shard::Mode::Async && shard == 0) {
            // Async: the dealer's changes go to a journal beside the checkpoints, and a restored dealer makes
            // again those made after its checkpoint (the other shards kept what was trained since).
            (Some(store), true) => {
                let fingerprint = data.table.fingerprint();
                let past = match restored {
                    Some(_) => crate::journal::read(store.dir(), fingerprint).unwrap_or_else(|why| {
                        warn!(%why, "the dealer journal is not used: splits finished since the checkpoint are dealt again");
                        Vec::new()
                    }),
                    None => Vec::new(),
                };
                let replayed = core
                    .set_dealer_replaying(data, Some(&past))
                    .map_err(|e| anyhow!("shard {shard}: dealing data: {e}"))?;
                let mut kept = match replayed {
                    Ok(changes) => {
                        if restored.is_some() {
                            info!(
                                changes = changes.len(),
                                "the dealer made again the changes journaled after its checkpoint"
                            );
                        }
                        changes
                    }
                    Err(why) => {
                        warn!(%why, "the dealer journal does not continue the checkpoint: splits finished since are dealt again");
                        Vec::new()
                    }
                };
                kept.extend(core.take_dealer_journal());
                journal = match crate::journal::rewrite(store.dir(), fingerprint, &kept) {
                    Ok(file) => Some(file),
                    Err(e) => {
                        let path = crate::journal::path(store.dir());
                        warn!(%e, path = %path.display(), "no dealer journal: a restore will deal again the splits finished since its checkpoint");
                        core.stop_dealer_journal();
                        None
                    }
                };
            }
            (store, _) => {
                core.set_dealer(data).map_err(|e| anyhow!("shard {shard}: dealing data: {e}"))?;
                // A journal of an async life does not continue this one's checkpoints.
                if let Some(store) = store.as_ref().filter(|_| shard == 0) {
                    let _ = std::fs::remove_file(crate::journal::path(store.dir()));
                }
            }
        }
        if let Some(d) = core.dealer() {
            info!(
                shard,
                data_epoch = d.epoch(),
                splits_done = d.splits_done(),
                splits_per_epoch = d.config().table.per_epoch(),
                "dealing the training data in splits"
            );
        }
    }
    // Pull replies go out as the core packs them (16-bit values converted straight from the parameters).
    core.set_packed_replies(true);
    // f32 replies share the parameters rather than copying them on the core's thread.
    core.set_shared_replies(true);
    match gaps_kernels::cuda::CudaArenas::for_choice(cfg.device).context("--device")? {
        Some(gpu) => {
            use gaps_kernels::resident::Device;
            let name = gpu.name();
            core.make_resident(gpu, cfg.device_worker_slots)
                .map_err(|e| anyhow!("moving shard {shard}'s dense state to {name}: {e}"))?;
            info!(shard, gpu = %name, floats = core.owned_elems(), "dense state resident on the GPU; updates run there");
        }
        None if cfg.device == gaps_kernels::cuda::DeviceChoice::Auto => {
            info!(shard, "no usable GPU; updates run on the CPU")
        }
        None => {}
    }
    // A process whose shard was taken over while it was down comes back as a spare: it serves no shard
    // (its own answers `Moved`) and keeps copies of others, its old shard's among them.
    let mut spare = false;
    let auth_key = if let Some(key) = taken_key {
        key
    } else if shard != 0 {
        report("joining the coordinator");
        let coordinator =
            cfg.coordinator.clone().context("shards other than 0 need --coordinator (shard 0's address)")?;
        let (key, served_elsewhere) =
            join_coordinator(&endpoint, &coordinator, &own.cluster, &mut core, cfg.join_timeout).await?;
        if served_elsewhere && cfg.replicas < 2 {
            bail!("shard {shard} was taken over by another shard process while this one was down; start it with --replicas as the cluster's to keep copies");
        }
        spare = served_elsewhere;
        key
    } else {
        // The coordinator's key outlives a restart with its checkpoints (the tokens it gave stay valid).
        match &store {
            Some(store) => crate::auth::load_or_create_key(store.dir())?,
            None => crate::auth::random_key()?,
        }
    };
    let credentials = Credentials::new(auth_key, core.epoch());
    let widest = core.config().layout.tables.iter().map(|t| u64::from(t.dim)).max();
    let read_echo = core.needs_read();
    let mut max_payload_bytes = payload_limit(&core.config().layout, core.owned_elems() as u64, read_echo);
    let backups = match cfg.replicas {
        _ if taken_core_given => None,
        0 | 1 => None,
        r => {
            let mut shards = crate::replication::backed_up_by(shard, cfg.core.num_shards, r);
            if spare {
                shards.push(shard);
            }
            // A copy's shard has this one's layout and rules; only what it owns differs.
            let limit = |c: &ShardConfig| {
                let owned = c
                    .layout
                    .chunks_of_shard(c.shard, c.num_shards)
                    .into_iter()
                    .map(|id| c.layout.chunk_len(id).unwrap_or(0) as u64)
                    .sum();
                payload_limit(&c.layout, owned, read_echo)
            };
            let backups = Backups::new(&shards, &cfg.core, r, cfg.data.as_ref(), limit);
            max_payload_bytes = max_payload_bytes.max(backups.largest_request());
            info!(shard, copies_of = ?shards, "keeping copies of other shards (--replicas {r})");
            Some(Arc::new(backups))
        }
    };
    let log = (cfg.replicas > 1).then(|| Arc::new(Log::new(shard, cfg.inflight_bytes)));
    // One acceptor per process: a shard taken over here shares the process's.
    let quorum = match taken_quorum {
        Some(q) => q,
        None if crate::quorum::enabled(cfg.replicas, cfg.core.num_shards) => {
            let coordinator = cfg.coordinator.clone().unwrap_or_else(|| advertise.clone());
            let dir = cfg.checkpoint.as_ref().map(|c| c.dir.as_path());
            if dir.is_none() {
                warn!(
                    process,
                    "no --checkpoint-dir: this process's part in choosing shard 0's configuration lives in memory \
                     only (restarted during a choice, it could answer twice)"
                );
            }
            Some(Arc::new(crate::quorum::Quorum::open(process, cfg.core.num_shards, &coordinator, dir)?))
        }
        None => None,
    };
    if let (true, Some(log)) = (spare, &log) {
        warn!(
            shard,
            "this shard was taken over by another shard process while this one was down: serving none, keeping copies"
        );
        log.fence();
    }
    let limits = Limits { max_payload_bytes, ..Limits::default() };
    let chunk_elems = u64::from(core.config().layout.chunk_elems);
    let (queue, receiver) = mpsc::channel(cfg.queue_depth.max(1));
    // A copy taken over goes on from its primary's clock (leases and waits are deadlines on it).
    let started = taken_clock.and_then(|c| Instant::now().checked_sub(c)).unwrap_or_else(Instant::now);
    // A striped push whose parts did not all come within a request's time limit is given up.
    let part_wait = cfg.request_timeout;
    let wake = Alarm { runtime: tokio::runtime::Handle::current(), queue: queue.downgrade(), armed: None };
    let record = match &cfg.record {
        Some(dir) => {
            let rec = crate::record::Recorder::create(dir, shard, process, taken_index, &core)?;
            info!(shard, path = %rec.path().display(), "recording every request that changes this shard's state");
            Some(rec)
        }
        None => None,
    };
    std::thread::Builder::new()
        .name(format!("gaps-shard-{shard}"))
        .spawn({
            let sinks = Sinks { journal, log: log.clone(), record };
            move || run_actor(core, receiver, started, part_wait, sinks, wake)
        })
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
        stall_timeout: cfg.stall_timeout,
        budget_wait: cfg.budget_wait,
        idle_timeout: cfg.idle_timeout,
        connection_units: (budget_units / CONNECTION_SHARE_DIVISOR).max(1),
        busy: AtomicU64::new(0),
        idle_closed: AtomicU64::new(0),
        timed_out: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        endpoint: endpoint.clone(),
        path,
        started,
        own,
        rotated: Arc::new(std::sync::Mutex::new(None)),
        credentials,
        bindings: DashMap::new(),
        per_ip: DashMap::new(),
        max_per_ip: cfg.max_connections_per_ip.max(1),
        registrants: DashMap::new(),
        per_certificate: DashMap::new(),
        max_per_certificate: cfg.max_workers_per_certificate.max(1),
        unauthorized: AtomicU64::new(0),
        log_unauthorized: LogLimiter::new(Duration::from_secs(1)),
        log_malformed: LogLimiter::new(Duration::from_secs(1)),
        log_connections: LogLimiter::new(Duration::from_secs(1)),
        last_checkpoint_ms: AtomicU64::new(0),
        stopping: tokio::sync::Notify::new(),
        next_checkpoint: AtomicU64::new(match &store {
            Some(s) => s.next_id()?.max(restored.as_ref().map_or(0, |r| r.id + 1)),
            None => 1,
        }),
        store,
        checkpoint_lock: tokio::sync::Mutex::new(Vec::new()),
        cluster_lock: tokio::sync::Mutex::new(()),
        device: cfg.device,
        device_worker_slots: cfg.device_worker_slots,
        coordinator: cfg.coordinator.clone(),
        rollbacks: AtomicU64::new(0),
        last_rollback: std::sync::Mutex::new(None),
        checkpoints_written: AtomicU64::new(0),
        chunk_elems,
        widest_table: widest.unwrap_or(0),
        shard,
        log: log.clone(),
        backups,
        quorum: quorum.clone(),
        advertise: advertise.clone(),
        replicas: cfg.replicas,
        taken_over: std::sync::Mutex::new(Vec::new()),
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    if let Some(every) = cfg.checkpoint.as_ref().and_then(|c| c.every) {
        let shared = shared.clone();
        let mut stop = shutdown_rx.clone();
        if shard != 0 {
            info!(shard, "checkpoints follow the coordinator's schedule (this shard takes its own only if none comes)");
        }
        tokio::spawn(async move {
            let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = interval.tick() => {}
                }
                if shared.shard == 0 {
                    if let Err(e) = cluster_checkpoint(&shared).await {
                        warn!(error = format!("{e:#}"), "the cluster checkpoint is incomplete");
                    }
                    continue;
                }
                // Shards ≥ 1 checkpoint when the coordinator asks; on their own only when it has not asked for
                // twice the interval (it is down, or has no schedule of its own).
                let since =
                    shared.started.elapsed().as_millis() as u64 - shared.last_checkpoint_ms.load(Ordering::Relaxed);
                if Duration::from_millis(since) >= 2 * every {
                    match take_checkpoint(&shared, None, CheckpointAt::Quiescent).await {
                        Ok(w) => warn!(
                            shard = shared.shard,
                            id = w.id,
                            "no cluster checkpoint came from the coordinator; took one on this shard's own schedule"
                        ),
                        Err(e) => warn!(shard = shared.shard, error = %e, "writing a checkpoint failed"),
                    }
                }
            }
        });
    }
    if let (Some(info), true, false) = (&restored, cfg.core.modes.mode != gaps_shard::Mode::Async, spare) {
        // Consistent recovery: every shard goes back to one cluster checkpoint (async keeps the cheaper
        // per-shard restore, see docs/manual.md, "Failures and recovery").
        tokio::spawn(roll_back_cluster_after_restore(shared.clone(), info.id, shutdown_rx.clone()));
    }
    let link = crate::replication::CoordinatorLink {
        coordinator: cfg.coordinator.clone().unwrap_or_else(|| advertise.clone()),
        cluster: shared.own.cluster.clone(),
        endpoint: endpoint.clone(),
        rotated: shared.rotated.clone(),
    };
    if let Some(log) = &log {
        let queue = shared.queue.clone();
        let ctx = Arc::new(crate::replication::ShipContext {
            shard,
            link: link.clone(),
            ack_timeout: cfg.replica_ack_timeout,
            process,
            epoch: replica_epoch,
            reporting: tokio::sync::Mutex::new(()),
            quorum: quorum.clone().filter(|_| shard == 0),
            snapshot: Arc::new(move |backup| {
                let (tx, rx) = oneshot::channel();
                if let Err(mpsc::error::TrySendError::Full(Command::ReplicaSnapshot { reply, .. })) =
                    queue.try_send(Command::ReplicaSnapshot { backup, reply: tx })
                {
                    let _ = reply.send(Err("the core's queue is full; trying again".into()));
                }
                rx
            }),
        });
        let backups = if spare {
            Vec::new()
        } else {
            crate::replication::backups_of(shard, process, cfg.core.num_shards, cfg.replicas)
        };
        for backup in backups {
            let span = tracing::info_span!("replication", shard, backup);
            tokio::spawn(
                crate::replication::ship(ctx.clone(), log.clone(), backup, shutdown_rx.clone()).instrument(span),
            );
        }
    }
    if shared.backups.is_some() {
        let watch = watch_primaries(shared.clone(), cfg.clone(), link, shutdown_rx.clone());
        tokio::spawn(watch.instrument(tracing::info_span!("takeover", process)));
    }
    let task = tokio::spawn(
        serve(endpoint, shared.clone(), shutdown_rx, cfg.tick_interval).instrument(tracing::info_span!("shard", shard)),
    );
    if let Some(h) = &health {
        let shared = shared.clone();
        h.serving(Arc::new(move || {
            let shared = shared.clone();
            Box::pin(async move {
                let (tx, rx) = oneshot::channel();
                shared
                    .send(Command::Inspect(Box::new(move |_| {
                        let _ = tx.send(());
                    })))
                    .await
                    .is_ok()
                    && rx.await.is_ok()
            })
        }));
    }
    info!(shard, %addr, %advertise, "serving");
    Ok(RunningServer { addr, advertise, restored, shutdown: shutdown_tx, task, shared, health })
}

/// Takes over the shards whose copies here heard nothing from their primary for `--failover-after`.
async fn watch_primaries(
    shared: Arc<Shared>,
    cfg: ServiceConfig,
    link: crate::replication::CoordinatorLink,
    mut stop: watch::Receiver<bool>,
) {
    let Some(backups) = shared.backups.clone() else { return };
    let mut interval = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = interval.tick() => {}
        }
        for shard in backups.silent(cfg.failover_after) {
            if !backups.begin_takeover(shard) {
                continue;
            }
            match take_over(&shared, &cfg, &link, &backups, shard).await {
                Ok(()) => {}
                Err(e) => {
                    backups.abandon_takeover(shard);
                    warn!(shard, error = format!("{e:#}"), "did not take over a shard whose primary went silent");
                }
            }
        }
    }
}

/// Asks the coordinator to let this process serve its copy of `shard` and serves it on an endpoint of its own.
async fn take_over(
    shared: &Arc<Shared>,
    cfg: &ServiceConfig,
    link: &crate::replication::CoordinatorLink,
    backups: &Backups,
    shard: u32,
) -> Result<()> {
    let silent_since = Instant::now() - cfg.failover_after;
    let (endpoint, path) = net::server_endpoint(SocketAddr::new(cfg.listen.ip(), 0), &cfg.tls)?;
    let port = endpoint.local_addr().context("reading the bound address")?.port();
    let addr = match shared.advertise.rsplit_once(':') {
        Some((host, _)) => format!("{host}:{port}"),
        None => bail!("this shard's address {} has no port", shared.advertise),
    };
    let map = link.map(&format!("shard-{} takeover", shared.shard)).await.context("the coordinator's map")?;
    let epoch = map.shards.iter().find(|s| s.index == shard).map(|s| s.epoch).context("no such shard in the map")?;
    let promote =
        Message::Promote(gaps_common::wire::Promote { shard, process: shared.shard, epoch, addr: addr.clone() });
    let granted_epoch = match link.call(&promote).await {
        Ok(Frame { msg: Message::ReplicaEpoch(e), .. }) => e.epoch,
        Ok(other) => bail!("the coordinator answered with {}", net::kind_name(&other.msg)),
        Err(e @ RpcError::Remote { .. }) => bail!("the coordinator refused: {e}"),
        // The answer was lost: the map says whether the coordinator granted it (then this process must serve).
        Err(e) => {
            let map = link.map(&format!("shard-{} takeover", shared.shard)).await.context("the coordinator's map")?;
            match map.shards.iter().find(|s| s.index == shard && s.process == shared.shard && s.addr == addr) {
                Some(s) => s.epoch,
                None => bail!("asking the coordinator: {e}"),
            }
        }
    };
    let (core, clock, applied) = backups.take(shard).context("the copy is gone")?;
    let mut c = cfg.clone();
    c.core = ShardConfig { shard, ..cfg.core.clone() };
    c.advertise = Some(addr.clone());
    c.coordinator = Some(link.coordinator.clone());
    c.restore = Restore::Never;
    c.data = None;
    c.health = None;
    let takeover = Takeover {
        core,
        process: shared.shard,
        key: shared.credentials.raw(),
        clock,
        epoch: granted_epoch,
        applied,
        quorum: shared.quorum.clone(),
        endpoint: (endpoint, path),
    };
    let server = start_serving(c, Some(takeover)).await?;
    warn!(
        shard,
        %addr,
        took_ms = silent_since.elapsed().as_millis() as u64,
        "took over a shard whose primary went silent: serving its copy"
    );
    shared.taken_over.lock().map_err(|_| anyhow!("lock poisoned"))?.push(server);
    Ok(())
}

/// A shard's state as a checkpoint's bytes, with the last entry of its replica log it holds.
async fn snapshot_of(shared: &Shared) -> Result<(u64, Vec<u8>)> {
    let (tx, rx) = oneshot::channel();
    let log = shared.log.clone();
    shared
        .send(Command::Inspect(Box::new(move |core| {
            let index = log.as_ref().map_or(0, |l| l.last_index());
            let _ = tx.send(core.checkpoint_into(0, Vec::new()).map(|b| (index, b)));
        })))
        .await?;
    rx.await.context("the core stopped")?.map_err(|e| anyhow!("{e}"))
}

/// The largest request payload a shard of `layout` owning `owned` floats takes: a push never carries more than
/// the shard owns (twice that with the read echo), sparse requests are bounded by rows per RPC (ids,
/// versions, gradients and read rows of the widest table); bigger frames are refused before they are
/// allocated.
fn payload_limit(layout: &gaps_common::Layout, owned: u64, read_echo: bool) -> u64 {
    let owned_bytes = owned * 4;
    let echo = 1 + u64::from(read_echo);
    let widest = layout.tables.iter().map(|t| u64::from(t.dim)).max();
    let sparse_bytes = widest.map_or(0, |dim| MAX_SPARSE_ROWS_PER_RPC * (3 + 2 * dim) * 4);
    (owned_bytes * echo).max(sparse_bytes).clamp(4, gaps_common::wire::DEFAULT_MAX_PAYLOAD_BYTES)
}

/// Joins the coordinator; returns the cluster's credential key it hands to shards.
async fn join_coordinator(
    endpoint: &quinn::Endpoint,
    coordinator: &str,
    cluster: &str,
    core: &mut ShardCore,
    timeout: Duration,
) -> Result<(gaps_common::wire::Token, bool)> {
    let started = Instant::now();
    let request = core.join_request();
    let limits = Limits::default();
    loop {
        let attempt = async {
            let addr = net::resolve(coordinator).await?;
            let conn = net::connect(endpoint, addr, Duration::from_secs(5)).await?;
            net::expect_shard(&conn, cluster, 0)?;
            let reply = net::call(&conn, &request, &[], &limits, Duration::from_secs(10)).await;
            conn.close(0u32.into(), b"joined");
            reply
        };
        let last = match attempt.await {
            Ok(Frame { msg: Message::ClusterMap(map), .. }) => {
                core.joined(&map).map_err(|e| anyhow!("joining the coordinator at {coordinator}: {e}"))?;
                let key = map.auth_key.context("the coordinator sent no credential key")?;
                info!(shard = core.config().shard, epoch = map.epoch, "joined the coordinator");
                let own = core.config().shard;
                let served_elsewhere = map.shards.iter().any(|s| s.index == own && s.process != own);
                return Ok((key, served_elsewhere));
            }
            Ok(other) => bail!("the coordinator at {coordinator} answered with {}", net::kind_name(&other.msg)),
            Err(e @ (RpcError::Remote { .. } | RpcError::Identity { .. })) => {
                bail!("the coordinator refused this shard: {e}")
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= timeout {
            bail!("could not reach the coordinator at {coordinator} within {timeout:?}: {last}");
        }
        debug!(%last, "coordinator not reachable yet");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
