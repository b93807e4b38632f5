//! The worker's client library: registers with the coordinator, keeps one connection per shard, routes
//! chunks by the cluster map, and runs pulls and pushes against all shards concurrently. A push that meets a
//! broken connection is sent again, on a new connection, with the same sequence number, so the shard applies
//! it exactly once.

use crate::net::{self, RpcError};
use gaps_common::dtype::WireDtype;
use gaps_common::layout::sparse_owner;
use gaps_common::layout::{ChunkId, Layout};
use gaps_common::wire::{
    ids_to_words, Authenticate, CheckpointAt, CheckpointDone, CheckpointRequest, ClusterMap, ErrorCode, Frame,
    Heartbeat, Leave, Limits, Message, ModeDecisions, Pull, Push, PushChunk, PushPart, PushPullReply, Register, Role,
    SparsePull, SparsePush, Stats, StatsRequest, StepReply, MAX_PUSH_PARTS, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

mod dense;
mod join;
mod membership;
mod routes;
mod sparse;
mod step;
pub use membership::Heartbeats;
pub use step::StepOutcome;

/// How to reach and talk to a cluster.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The coordinator's (shard 0's) `host:port`.
    pub coordinator: String,
    /// CA and this client's certificate.
    pub tls: TlsMaterial,
    /// Worker (gets an id and a lease) or observer.
    pub role: Role,
    /// Name for logs.
    pub name: String,
    /// How long to wait for the coordinator and for a complete cluster before giving up.
    pub connect_timeout: Duration,
    /// How long one RPC may take.
    pub rpc_timeout: Duration,
    /// How long a shard may stay unreachable (dead, restarting) before a request to it fails: until then the
    /// client sends the request again on new connections, logging which shard it waits for.
    pub shard_down_timeout: Duration,
    /// Frame limits for replies.
    pub limits: Limits,
    /// Connections to each shard that one large push or pull is striped over, by chunk (1: no striping).
    /// One QUIC connection's packets are encrypted and decrypted by one task, so a bulk transfer on one
    /// connection runs at what one core does; parts on several connections spread that work. Only transfers
    /// of at least [`STRIPE_MIN_BYTES`] per part use more than the first connection (small models never open
    /// another); at most [`MAX_PUSH_PARTS`] lanes.
    pub lanes: usize,
}

/// Default of [`ClientOptions::lanes`]: one. On loopback with 2 cores for both ends, a bare quinn echo of
/// 4 MiB each way moved 1.4 GB/s over one connection and 2.0–2.3 over two to four, but only because the
/// echoes of different connections overlapped the two directions; a gaps push must be applied before the
/// pull that follows it, and striping measured slower there (`gaps bench transport --lanes 4`: 1 Mi floats
/// 1.42 against 1.54 GB/s, 16 Mi 0.93 against 1.27), the parts' reassembly costing a copy. Striping is for
/// hosts where one connection's packet work saturates a core while others idle.
pub const DEFAULT_LANES: usize = 1;

/// The least payload a striped part carries: smaller transfers go on fewer connections.
pub const STRIPE_MIN_BYTES: u64 = 512 << 10;

impl ClientOptions {
    /// Options with the defaults used by the binaries.
    pub fn new(coordinator: impl Into<String>, tls: TlsMaterial, role: Role, name: impl Into<String>) -> Self {
        ClientOptions {
            coordinator: coordinator.into(),
            tls,
            role,
            name: name.into(),
            connect_timeout: Duration::from_secs(30),
            rpc_timeout: Duration::from_secs(30),
            shard_down_timeout: Duration::from_secs(600),
            limits: Limits::default(),
            lanes: DEFAULT_LANES,
        }
    }
}

/// Cuts `chunks` (each with its payload bytes) into at most `lanes` groups of consecutive chunks with about
/// equal bytes, none under [`STRIPE_MIN_BYTES`] unless there is only one: the index ranges of the groups.
fn stripe_groups(bytes: &[u64], lanes: usize) -> Vec<std::ops::Range<usize>> {
    let total: u64 = bytes.iter().sum();
    let by_size = usize::try_from(total / STRIPE_MIN_BYTES).unwrap_or(usize::MAX);
    let groups = lanes.min(usize::from(MAX_PUSH_PARTS)).min(bytes.len()).min(by_size).max(1);
    let mut out = Vec::with_capacity(groups);
    let (mut start, mut sum) = (0usize, 0u64);
    for (i, b) in bytes.iter().enumerate() {
        sum += b;
        // Close group g once it reaches its share of the total (leaving a chunk for each group still to come).
        let g = out.len() as u64 + 1;
        let left = bytes.len() - (i + 1);
        let remaining_groups = groups - out.len() - 1;
        if out.len() + 1 < groups && (sum * groups as u64 >= total * g || left == remaining_groups) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out.push(start..bytes.len());
    out
}

/// A client-side failure, with what was being done.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The cluster could not be joined in time; the message names what is missing.
    #[error("could not join the cluster via {coordinator} within {waited:?}: {last}")]
    JoinTimeout {
        /// Coordinator address.
        coordinator: String,
        /// Time waited.
        waited: Duration,
        /// The last reason.
        last: String,
    },
    /// The cluster map is inconsistent.
    #[error("invalid cluster map: {0}")]
    BadMap(String),
    /// An RPC failed (after retries where retrying is safe).
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// The caller passed tensors that do not match the layout.
    #[error("{0}")]
    Shape(String),
    /// A gradient holds NaN or ±Inf (checked before anything is sent, so no shard applies part of it).
    #[error("{0}")]
    NonFinite(String),
}

/// The first non-finite value of `values`, as an error naming `what` and its position.
fn check_finite(what: &str, values: &[f32]) -> Result<(), ClientError> {
    match gaps_common::dtype::first_non_finite(values) {
        Some(i) => Err(ClientError::NonFinite(format!("{what} holds {} at element {i}", values[i]))),
        None => Ok(()),
    }
}

/// Where one shard's pull reply goes: its chunks' slices of the snapshot, in request order. Also takes the
/// reply to a [`Message::PushPull`], which carries the same values or none (`filled` says which).
struct PullInto<'a> {
    expected: Vec<(gaps_common::layout::ChunkId, u32)>,
    slices: Vec<&'a mut [f32]>,
    versions: Vec<u64>,
    filled: bool,
}

impl<'a> PullInto<'a> {
    fn new(expected: Vec<(gaps_common::layout::ChunkId, u32)>, slices: Vec<&'a mut [f32]>) -> Self {
        PullInto { expected, slices, versions: Vec::new(), filled: false }
    }
}

impl net::ReplySink for PullInto<'_> {
    /// A call sent again after its reply was cut off in its values may be answered with a refusal (a
    /// restored shard refusing a gradient computed before its restore), which has no destination: the
    /// cut-off reply's values are not there, and the caller must pull them.
    fn begin(&mut self) {
        self.filled = false;
        self.versions.clear();
    }

    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        let chunks = match msg {
            Message::PullReply(reply) => &reply.chunks,
            // A push-pull whose ack asks the worker to wait carries no values. A shard that owns no chunk of
            // the model answers with none and is done (it was pushed to only to end the worker's step).
            Message::PushPullReply(reply) if reply.chunks.is_empty() && !self.expected.is_empty() => return Ok(None),
            Message::PushPullReply(reply) => &reply.chunks,
            other => return Err(format!("a {} message answered a pull", net::kind_name(other))),
        };
        self.accept(chunks)?;
        Ok(Some(self.slices.iter_mut().map(|s| &mut **s).collect()))
    }
}

impl PullInto<'_> {
    /// Checks that a reply's `chunks` are those asked for, and takes their versions: the slices will be filled.
    fn accept(&mut self, chunks: &[gaps_common::wire::ChunkVersion]) -> Result<(), String> {
        if chunks.len() != self.expected.len() {
            return Err(format!("{} chunks returned, {} asked for", chunks.len(), self.expected.len()));
        }
        for (meta, (id, len)) in chunks.iter().zip(&self.expected) {
            if meta.id != *id || meta.len != *len {
                return Err(format!("chunk {:?} of {} values answered for {id:?} of {len}", meta.id, meta.len));
            }
        }
        self.versions = chunks.iter().map(|c| c.version).collect();
        self.filled = true;
        Ok(())
    }
}

/// One pull request: (shard, lane, the chunks it reads with their global indices).
type PullRequest<'t> = (usize, usize, &'t [(ChunkId, u64)]);

/// One stripe of a shard's push: its range of the shard's chunks and its payload parts.
type Stripe = (std::ops::Range<usize>, Vec<net::Bytes>);

/// Runs `futures` concurrently on the current task and returns their outputs in order.
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut pending: Vec<Option<std::pin::Pin<Box<F>>>> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut done: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (slot, out) in pending.iter_mut().zip(done.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    done.into_iter().flatten().collect()
}

/// Runs `exchange` — a client call's requests to its shards and the wait for every reply — as one task on
/// the runtime's threads when the caller is not itself a task (a thread in `block_on`: `gaps-worker`'s
/// training loop, the Python package's calls), and returns its result. The replies are then taken on the
/// threads that receive them and the caller is woken once for the whole exchange, where awaiting the
/// requests on the caller's thread woke it for every reply (a 2-shard 1,000-float push-pull: 8 context
/// switches a round instead of 13.4, 1.08–1.18× faster; docs/results.md). A caller that is a task, is
/// outside any runtime, or drives a current-thread runtime (whose one thread would run the task anyway)
/// runs `exchange` itself. Dropping the returned future aborts the task, as dropping
/// the requests themselves would have cancelled them — though the task stops at its next await, so a
/// request being written as the caller drops it may still go out (a push is still applied at most once:
/// its sequence number was taken before). `what` names the call in the error of a task the runtime
/// cancelled (it is shutting down).
async fn on_runtime<T: Send + 'static>(
    what: &str,
    exchange: impl std::future::Future<Output = Result<T, ClientError>> + Send + 'static,
) -> Result<T, ClientError> {
    let runtime = match tokio::runtime::Handle::try_current() {
        Ok(runtime)
            if tokio::task::try_id().is_none()
                && runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread =>
        {
            runtime
        }
        _ => return exchange.await,
    };
    /// Aborts the task when the caller stops waiting for it.
    struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);
    impl<T> Drop for AbortOnDrop<T> {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let mut task = AbortOnDrop(runtime.spawn(exchange));
    match (&mut task.0).await {
        Ok(out) => out,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(ClientError::Rpc(RpcError::Connection {
            addr: "the client's runtime".into(),
            message: format!("{what}: the runtime shut down with the request in flight ({e})"),
        })),
    }
}

/// One range of one tensor of a shared set, as the bytes of a payload part.
struct TensorSlice {
    tensors: Arc<Vec<Vec<f32>>>,
    tensor: usize,
    range: std::ops::Range<usize>,
}

impl AsRef<[f32]> for TensorSlice {
    fn as_ref(&self) -> &[f32] {
        self.tensors.get(self.tensor).and_then(|t| t.get(self.range.clone())).unwrap_or(&[])
    }
}

/// A model snapshot as pulled: one vector per tensor plus the version of every chunk (global order).
/// For the DANA rules the values are the look-ahead the shards sent, which is where gradients are computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Tensor values, layout order (shared, so a push can echo them without a copy).
    pub tensors: Arc<Vec<Vec<f32>>>,
    /// Version of each chunk, indexed by global chunk index.
    pub versions: Vec<u64>,
}

impl Snapshot {
    /// Hands this snapshot's tensor buffers to the process's recycler of very large buffers (see
    /// `gaps_common::buffers`) when no one else holds them, so the next pull reuses their memory instead of
    /// faulting in fresh pages. Call it on a snapshot you are done with; dropping it is also correct.
    pub fn recycle(self) {
        if let Ok(tensors) = Arc::try_unwrap(self.tensors) {
            tensors.into_iter().for_each(gaps_common::buffers::give);
        }
    }
}

/// Rows of one sparse table as pulled, in the order of the ids asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseRows {
    /// The ids, as asked.
    pub ids: Vec<u64>,
    /// `ids.len() × dim` values.
    pub values: Vec<f32>,
    /// The version of each row.
    pub versions: Vec<u32>,
    /// Floats per row.
    pub dim: usize,
}

/// What one push did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PushSummary {
    /// Shard pushes acknowledged as newly applied.
    pub applied: u32,
    /// Shard pushes acknowledged as duplicates of an earlier delivery.
    pub duplicates: u32,
    /// Times a shard push was sent again after a transport failure.
    pub retries: u32,
    /// Largest staleness reported by any shard.
    pub max_staleness: u64,
    /// Shard pushes refused because they were computed on versions the shard has not reached: it was
    /// restored from a checkpoint taken before them. The gradient is dropped for that shard (the next pull
    /// reads the restored state).
    pub stale_after_restore: u32,
}

/// Where a shard is served: the address as the cluster map gives it (a name is resolved again for every new
/// connection, so a shard restarted elsewhere under the same DNS name is found), that address when the client
/// learned it, the shard process whose certificate the server must hold (the shard's own, or the backup that
/// took it over), and the shard's replica epoch.
#[derive(Debug, Clone)]
struct Route {
    name: String,
    addr: SocketAddr,
    process: u32,
    epoch: u64,
}

#[derive(Debug)]
struct ShardLink {
    index: u32,
    /// Where it is served (changes when a backup takes it over).
    route: Mutex<Route>,
    /// One connection per lane (lane 0 carries everything that is not striped).
    conns: Vec<Mutex<Option<quinn::Connection>>>,
    /// When a request on each lane last finished, milliseconds after the client was made, and how many are
    /// on their way on it (kept by caller-driven clients only: [`Inner::caller_driven`]).
    used_ms: Vec<(AtomicU64, AtomicU32)>,
    /// Next push sequence number for this shard (starts at 1).
    next_seq: AtomicU64,
    /// Pushes this shard acknowledged (applied now or before).
    acknowledged: AtomicU64,
    /// Chunks this shard owns, global order, with their global indices.
    chunks: Vec<(ChunkId, u64)>,
    /// Sparse pushes to this shard not answered yet, and the signal that one was: in sync and gba the
    /// dense push, which ends the worker's step on the shard, goes only after them, so that the rows are
    /// summed into the same step.
    sparse_in_flight: AtomicUsize,
    sparse_answered: tokio::sync::Notify,
}

/// Decrements a shard's count of sparse pushes in flight when dropped (also when the task is cancelled).
struct InFlight<'a>(&'a ShardLink);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.sparse_in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.sparse_answered.notify_waiters();
    }
}

impl ShardLink {
    /// The shard's address as last learned.
    fn addr(&self) -> SocketAddr {
        self.route.lock().map_or_else(|p| p.into_inner().addr, |r| r.addr)
    }

    fn route(&self) -> Route {
        self.route.lock().map_or_else(|p| p.into_inner().clone(), |r| r.clone())
    }

    /// The replica epoch of the route (read without copying the route: requests look at it while they wait).
    fn epoch(&self) -> u64 {
        self.route.lock().map_or_else(|p| p.into_inner().epoch, |r| r.epoch)
    }

    /// Waits until no sparse push to this shard is in flight.
    async fn sparse_settled(&self) {
        loop {
            let answered = self.sparse_answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if self.sparse_in_flight.load(Ordering::SeqCst) == 0 {
                return;
            }
            answered.await;
        }
    }
}

#[derive(Debug)]
struct Inner {
    opts: ClientOptions,
    /// The cluster named in this client's certificate: every shard must hold a certificate of it.
    cluster: String,
    /// The client configuration after a certificate rotation (None: the endpoint's own); shared with the
    /// client's companions ([`Client::companion`]).
    rotated: Arc<Mutex<Option<quinn::ClientConfig>>>,
    endpoint: quinn::Endpoint,
    /// The UDP path tuning of the endpoint (from the route to the coordinator).
    path: net::PathTuning,
    map: ClusterMap,
    shards: Vec<ShardLink>,
    /// Test and chaos hook: close the connection after this many requests were written, before their reply.
    drop_after_send: AtomicU32,
    pushes_sent: AtomicU64,
    /// Shard pushes acknowledged (applied now or before, as a duplicate).
    pushes_acknowledged: AtomicU64,
    /// Shard pushes a restored shard refused (computed before its restore).
    stale_after_restore: AtomicU64,
    /// Waits for a step that ended because the shard had gone back (a cluster rollback).
    rollbacks_seen: AtomicU64,
    retries: AtomicU64,
    /// The shards' default update rule.
    rule: Rule,
    /// Each tensor's rule and hyper-parameters as far as the worker needs them (the layout's overrides on
    /// the shards' defaults).
    tensor_rules: Vec<(Rule, Hyper)>,
    /// DANA-Slim: this worker's momentum, one vector per tensor (created on the first push).
    slim_momentum: Mutex<Vec<Vec<f32>>>,
    /// Each table's rule.
    table_rules: Vec<Rule>,
    /// When the last dense pull finished: the next push reports the time since as its compute time.
    last_pull: Mutex<Option<Instant>>,
    /// Time spent waiting for synchronous steps or bounded staleness after pushes, microseconds.
    waited_us: AtomicU64,
    /// Where the next dense push's samples came from (dynamic data sharding; [`Client::set_data_tag`]).
    data_tag: Mutex<Option<gaps_common::wire::DataTag>>,
    /// Dense pushes made (the step number the next push carries).
    steps: AtomicU64,
    /// When the coordinator was last asked where the shards are (after a shard stopped answering).
    map_asked: Mutex<Option<Instant>>,
    /// Every shard process and where it listens, from the last map (asked where the coordinator is should it
    /// move: replicated shards with a majority choosing shard 0's configuration).
    processes: Mutex<Vec<(u32, String)>>,
    /// When they were last asked where the coordinator is.
    located: Mutex<Option<Instant>>,
    /// The newest two mode decisions any shard answered with (None before the first answer); passed on
    /// with every push.
    decisions: Mutex<Option<ModeDecisions>>,
    /// When this client was made (the clock of [`ShardLink::used_ms`]).
    born: Instant,
    /// Whether this client's connections move only while its caller awaits: it was made on a current-thread
    /// runtime (a `gaps-worker` of one lane), whose thread computes between its calls. No keep-alive goes
    /// out meanwhile, so a connection left that way for half the transport's idle timeout is replaced
    /// before the next request rather than found dead by it ([`UNDRIVEN_LIMIT`]).
    caller_driven: bool,
}

/// How long a caller-driven client's connection may have gone without a request before the next one
/// opens a new connection: half the idle timeout after which the peer drops a connection that sent
/// nothing (no keep-alive goes out while the caller computes).
const UNDRIVEN_LIMIT: Duration = Duration::from_millis(net::IDLE_TIMEOUT.as_millis() as u64 / 2);

impl Inner {
    /// Counts one push acknowledged by shard `s` (applied now or before).
    fn count_acknowledged(&self, s: usize) {
        self.pushes_acknowledged.fetch_add(1, Ordering::Relaxed);
        if let Some(link) = self.shards.get(s) {
            link.acknowledged.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Keeps the newest two of the known decisions and a shard's.
    fn learn(&self, decisions: &ModeDecisions) {
        if let Ok(mut known) = self.decisions.lock() {
            match known.as_mut() {
                Some(k) => k.merge(decisions),
                None => *known = Some(*decisions),
            }
        }
    }

    /// The decisions known now.
    fn decisions(&self) -> Option<ModeDecisions> {
        self.decisions.lock().ok().and_then(|d| *d)
    }

    /// True while the cluster runs a synchronous mode (sync or gba, also under auto; mode codes 1 and 2),
    /// or before any shard said which: a step's rows must then reach each shard before the dense push that
    /// ends the step.
    fn synchronous(&self) -> bool {
        self.decisions().is_none_or(|d| matches!(d.latest.mode, 1 | 2))
    }

    /// True when a push carries the read parameters of chunk `id` (its tensor's rule measures drift).
    fn echoes(&self, id: &ChunkId) -> bool {
        self.tensor_rules[id.tensor as usize].0.layout().needs_read
    }
}

/// Where the shard process at `addr` says the coordinator is (the configuration of shard 0 it knows chosen
/// last), resolved; None when it does not say within `wait`.
async fn coordinator_named_by(
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
    cluster: &str,
    wait: Duration,
) -> Option<std::net::SocketAddr> {
    let (_, at) = net::coordinator_where(endpoint, None, &addr.to_string(), (cluster, None), wait).await.ok()?;
    let c = at.config;
    net::resolve(&c.addr).await.ok()
}

/// A connected client. Cheap to clone; clones share connections and counters.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Registers with the coordinator (waiting, up to `connect_timeout`, for it to come up and for every
    /// shard to join) and connects to every shard.
    pub async fn connect(opts: ClientOptions) -> Result<Client, ClientError> {
        let started = Instant::now();
        let deadline = started + opts.connect_timeout;
        let cluster =
            opts.tls.own_identity().map_err(|e| RpcError::Setup(format!("this client's certificate: {e}")))?.cluster;
        let coordinator = net::resolve(&opts.coordinator).await?;
        let (endpoint, path) = net::client_endpoint_tuned(&opts.tls, coordinator)?;
        let map = join::register(&opts, &endpoint, &cluster, coordinator, started, deadline).await?;
        let rules = join::rules_of(&map)?;
        let shards = join::links(&map, opts.lanes).await?;
        let mut inner = Inner::fresh(opts, cluster, Arc::default(), (endpoint, path), map, shards, rules);
        inner.caller_driven = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
        let client = Client { inner: Arc::new(inner) };
        join::reach_every_shard(&client, started, deadline).await?;
        Ok(client)
    }

    /// The cluster map received at registration.
    pub fn map(&self) -> &ClusterMap {
        &self.inner.map
    }

    /// The model layout.
    pub fn layout(&self) -> &Layout {
        &self.inner.map.layout
    }

    /// This worker's id (None for observers).
    pub fn worker_id(&self) -> Option<u32> {
        self.inner.map.worker_id
    }

    /// Replaces the TLS material (certificate rotation): new connections use `tls`, open ones keep theirs.
    /// The new certificate must name the same identity (the worker's credential is bound to it).
    pub fn reload_tls(&self, tls: &TlsMaterial) -> Result<(), ClientError> {
        let setup = |m: String| ClientError::from(RpcError::Setup(m));
        let new = tls.own_identity().map_err(|e| setup(format!("the new certificate: {e}")))?;
        let old = self.inner.opts.tls.own_identity().map_err(|e| setup(format!("the old certificate: {e}")))?;
        if new != old {
            return Err(setup(format!("the new certificate is {new}, this client is {old}")));
        }
        let config = net::client_config(tls, &self.inner.path)?;
        *self.inner.rotated.lock().map_err(|_| setup("the TLS lock is poisoned".into()))? = Some(config);
        Ok(())
    }

    /// Makes the next push report `compute` as the time its gradient took (instead of the time since the
    /// last pull), for callers that measure it themselves.
    pub fn report_compute_time(&self, compute: Duration) {
        if let Ok(mut last) = self.inner.last_pull.lock() {
            *last = Instant::now().checked_sub(compute).or(Some(Instant::now()));
        }
    }

    /// This worker's id and the credential the coordinator gave it (None for observers).
    pub fn credential(&self) -> Option<(u32, gaps_common::wire::Token)> {
        self.inner.map.worker_id.zip(self.inner.map.token)
    }

    /// Shard pushes sent (each `(shard, seq)` once, however often it was retried).
    pub fn pushes_sent(&self) -> u64 {
        self.inner.pushes_sent.load(Ordering::Relaxed)
    }

    /// Requests sent again after a transport failure.
    pub fn retries(&self) -> u64 {
        self.inner.retries.load(Ordering::Relaxed)
    }

    /// True while the cluster trains in a synchronous mode (sync or gba, also under auto), or before any
    /// shard said which: a step's rows must then reach each shard before its dense push.
    pub fn synchronous(&self) -> bool {
        self.inner.synchronous()
    }

    /// Shard pushes acknowledged since connecting (each applied exactly once by its shard).
    pub fn pushes_acknowledged(&self) -> u64 {
        self.inner.pushes_acknowledged.load(Ordering::Relaxed)
    }

    /// [`Client::pushes_acknowledged`] per shard, in shard order (to hold against each shard's
    /// [`Stats::applied_by_worker`]).
    pub fn pushes_acknowledged_by_shard(&self) -> Vec<u64> {
        self.inner.shards.iter().map(|l| l.acknowledged.load(Ordering::Relaxed)).collect()
    }

    /// Shard pushes a restored shard refused because they were computed before its restore.
    pub fn stale_after_restore(&self) -> u64 {
        self.inner.stale_after_restore.load(Ordering::Relaxed)
    }

    /// Waits for a synchronous step that ended because the shard had rolled back to a cluster checkpoint.
    pub fn rollbacks_seen(&self) -> u64 {
        self.inner.rollbacks_seen.load(Ordering::Relaxed)
    }

    /// Test and chaos hook: the next `n` requests are written completely and then their connection is
    /// closed before the reply is read, as if the network failed at the worst moment.
    pub fn inject_connection_drops(&self, n: u32) {
        self.inner.drop_after_send.store(n, Ordering::SeqCst);
    }
}

/// How long a request to a replicated shard waits before the client asks whether the shard moved.
const MOVED_CHECK_AFTER: Duration = Duration::from_millis(700);

/// A pseudo-random pause of 0..=`max_ms` milliseconds (the clock's nanoseconds, mixed), so that clients
/// that were refused together do not come back together.
pub(crate) fn jitter_ms(max_ms: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mixed = u64::from(nanos).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17;
    mixed % (max_ms + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gaps_common::wire::{ChunkVersion, PullReply};
    use net::ReplySink;

    #[test]
    fn a_pull_sink_forgets_at_each_call_what_an_earlier_reply_promised() {
        let id = ChunkId { tensor: 0, chunk: 0 };
        let mut values = [0.0f32; 4];
        let mut sink = PullInto::new(vec![(id, 4)], vec![&mut values[..]]);
        let chunk = ChunkVersion { id, version: 3, len: 4, dtype: gaps_common::dtype::WireDtype::F32 };
        let reply = Message::PullReply(PullReply { chunks: vec![chunk] });
        assert_eq!(sink.destination(&reply).expect("the chunk asked for").map(|d| d.len()), Some(1));
        assert!(sink.filled, "the reply's values have their destination");
        assert_eq!(sink.versions, vec![3]);
        sink.begin();
        assert!(!sink.filled, "a new call: nothing of the last reply is counted on");
        assert!(sink.versions.is_empty());
    }

    #[test]
    fn stripes_are_consecutive_balanced_and_never_below_the_minimum() {
        let mib = 1u64 << 20;
        let check = |bytes: &[u64], lanes: usize| {
            let groups = stripe_groups(bytes, lanes);
            // Consecutive, covering every chunk once, none empty.
            assert_eq!(groups.first().map(|g| g.start), Some(0));
            assert_eq!(groups.last().map(|g| g.end), Some(bytes.len()));
            assert!(groups.windows(2).all(|w| w[0].end == w[1].start));
            assert!(groups.iter().all(|g| !g.is_empty()) || bytes.is_empty());
            groups
        };
        // Small transfers stay whole: a stripe carries at least STRIPE_MIN_BYTES.
        assert_eq!(check(&[1000; 8], 4).len(), 1);
        assert_eq!(check(&[STRIPE_MIN_BYTES; 3], 8).len(), 3);
        assert_eq!(check(&[mib; 4], 1).len(), 1, "one lane: no striping");
        // Four equal chunks over four lanes; sixteen over four: four each.
        assert_eq!(check(&[mib; 4], 4), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(check(&[mib; 16], 4), vec![0..4, 4..8, 8..12, 12..16]);
        // Fewer chunks than lanes: one chunk a stripe.
        assert_eq!(check(&[4 * mib, 4 * mib], 8).len(), 2);
        // Unequal chunks: no stripe holds more than its share plus one chunk.
        let bytes = [3 * mib, mib, mib, mib, 2 * mib, mib, mib, 2 * mib];
        let groups = check(&bytes, 4);
        assert_eq!(groups.len(), 4);
        let total: u64 = bytes.iter().sum();
        for g in &groups {
            let sum: u64 = bytes[g.clone()].iter().sum();
            assert!(sum <= total / 4 + 3 * mib, "{g:?}: {sum}");
        }
        // Never more stripes than a push may have parts.
        assert_eq!(check(&vec![mib; 200], 500).len(), usize::from(MAX_PUSH_PARTS));
        assert_eq!(check(&[], 4), vec![0..0]);
    }

    /// A multi-thread runtime like `gaps-worker`'s and the Python package's: two worker threads, the caller
    /// in `block_on`.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
    }

    #[test]
    fn an_exchange_from_a_block_on_thread_runs_as_a_task_and_a_tasks_own_runs_in_place() {
        let rt = runtime();
        rt.block_on(async {
            assert!(tokio::task::try_id().is_none(), "block_on's future is not a task");
            // Called from the block_on thread: the exchange runs as a task of its own, on another thread.
            let caller = std::thread::current().id();
            let (id, thread) = on_runtime("test", async { Ok((tokio::task::try_id(), std::thread::current().id())) })
                .await
                .expect("ran");
            assert!(id.is_some(), "the exchange ran on the caller's thread, not as a task");
            assert_ne!(thread, caller);
            // Called from a task: run by that task itself.
            let spawned = tokio::spawn(async {
                let outer = tokio::task::try_id();
                let inner = on_runtime("test", async { Ok(tokio::task::try_id()) }).await.expect("ran");
                (outer, inner)
            });
            let (outer, inner) = spawned.await.expect("the task ran");
            assert!(outer.is_some());
            assert_eq!(inner, outer, "a task's exchange was spawned instead of run in place");
            // Errors come back as they were.
            let failed: Result<(), _> = on_runtime("test", async { Err(ClientError::Shape("no".into())) }).await;
            assert!(matches!(failed, Err(ClientError::Shape(m)) if m == "no"));
        });
    }

    #[test]
    fn an_exchange_outside_any_runtime_runs_in_place() {
        let mut exchange =
            std::pin::pin!(on_runtime("test", async { Ok(tokio::runtime::Handle::try_current().is_err()) }));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::future::Future::poll(exchange.as_mut(), &mut cx) {
            std::task::Poll::Ready(outside) => assert!(outside.expect("ran"), "it ran inside a runtime"),
            std::task::Poll::Pending => panic!("a ready exchange outside a runtime did not finish in place"),
        }
    }

    #[test]
    fn dropping_an_exchange_cancels_its_task() {
        let rt = runtime();
        rt.block_on(async {
            // The exchange holds a guard and never finishes; dropping the caller's future must drop it.
            struct Dropped(Option<tokio::sync::oneshot::Sender<()>>);
            impl Drop for Dropped {
                fn drop(&mut self) {
                    if let Some(tx) = self.0.take() {
                        let _ = tx.send(());
                    }
                }
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (started_tx, started_rx) = tokio::sync::oneshot::channel();
            let guard = Dropped(Some(tx));
            let exchange = on_runtime("test", async move {
                let _guard = guard;
                let _ = started_tx.send(());
                std::future::pending::<Result<(), ClientError>>().await
            });
            // Poll the exchange until its task has started, then stop waiting for it.
            tokio::select! {
                _ = exchange => unreachable!("a pending exchange finished"),
                _ = started_rx => {}
            }
            // A bound, not a measurement: an abandoned exchange left running would hold the guard forever.
            let dropped = tokio::time::timeout(Duration::from_secs(60), rx).await;
            assert!(matches!(dropped, Ok(Ok(()))), "the exchange's task was left running after its caller went away");
        });
    }

    #[test]
    fn a_panic_in_an_exchange_reaches_its_caller() {
        let rt = runtime();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(on_runtime::<()>("test", async { panic!("exchange failed on purpose") }))
        }));
        let payload = caught.expect_err("the panic was swallowed");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"exchange failed on purpose"));
    }
}
