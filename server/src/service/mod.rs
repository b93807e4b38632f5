//! The QUIC service around [`ShardCore`]: accepts mutually authenticated connections, serves one RPC per
//! bidirectional stream, joins the coordinator (shards ≥ 1), expires leases on a timer, exports metrics, and
//! shuts down gracefully (refuse new connections, finish in-flight RPCs, close).
//!
//! The core is an actor: it lives on its own OS thread and is fed by a **bounded** queue of commands, each
//! with a reply channel. One exception saves the two thread hand-offs a small request costs: when the core is
//! idle (nothing queued, nobody running a command, no request held), a QUIC task runs a small training
//! request (at most 128 Ki elements carried or answered and 8 Ki embedding rows, none that could make a
//! table grow: 1-2 ms of work at most; a push only in asynchronous training, where it never completes a
//! synchronous step) itself, under the core's lock ([`actor::CoreQueue::try_inline`]); a task never waits
//! for that lock, and nothing larger runs on the async runtime. Before
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
    Rollback, RollbackReply, RollbackStage, ShardCheckpoint, Stats, StepReply, WireError,
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
mod assemble;
mod checkpoints;
mod failover;
mod restart;
mod rpc;
mod starting;
mod startup;
use actor::*;
use assemble::*;
use checkpoints::*;
use failover::*;
use restart::*;
use rpc::*;
pub use startup::start;
use startup::*;

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
    queue: CoreQueue,
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
    /// Rollbacks this shard went through, and the checkpoint and step of the last.
    rollbacks: AtomicU64,
    last_rollback: std::sync::Mutex<Option<(u64, u64)>>,
    checkpoints_written: AtomicU64,
    /// When this shard last wrote a checkpoint (milliseconds since `started`).
    last_checkpoint_ms: AtomicU64,
    /// Wakes checkpoints that wait for a step when the shard shuts down.
    stopping: tokio::sync::Notify,
    /// On the coordinator: who serves which shard changed (a promotion, a shard joining), which a checkpoint
    /// of its own makes durable at once ([`spawn_table_checkpoints`]).
    tables_changed: tokio::sync::Notify,
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
    /// How this process reaches the coordinator (wherever a majority moved it).
    link: crate::link::CoordinatorLink,
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
        self.queue.sender.send(command).await.map_err(|_| anyhow!("shard {} core thread stopped", self.shard))
    }

    /// Bytes the largest reply to `msg` can hold (admitted once the request is whole, before it is handled).
    fn reply_bytes(&self, msg: &Message) -> u64 {
        match msg {
            Message::Pull(p) => p.chunks.len() as u64 * self.chunk_elems * 4,
            Message::PushPull(p) => p.chunks.len() as u64 * self.chunk_elems * 4,
            Message::SparsePull(p) => u64::from(p.count) * (1 + self.widest_table) * 4,
            Message::Step(s) => {
                let rows = s.next_rows.as_ref().map_or(0, |p| u64::from(p.count) * (1 + self.widest_table));
                (s.push.chunks.len() as u64 * self.chunk_elems + rows) * 4
            }
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
