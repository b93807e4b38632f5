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
    SparsePull, SparsePush, Stats, StatsRequest, MAX_PUSH_PARTS, PROTOCOL_VERSION,
};
use gaps_kernels::{Hyper, Rule};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

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
    fn destination<'s>(&'s mut self, msg: &Message) -> Result<Option<Vec<&'s mut [f32]>>, String> {
        self.filled = false;
        let chunks = match msg {
            Message::PullReply(reply) => &reply.chunks,
            // A push-pull whose ack asks the worker to wait carries no values.
            Message::PushPullReply(reply) if reply.chunks.is_empty() => return Ok(None),
            Message::PushPullReply(reply) => &reply.chunks,
            other => return Err(format!("a {} message answered a pull", net::kind_name(other))),
        };
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
        Ok(Some(self.slices.iter_mut().map(|s| &mut **s).collect()))
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
    /// The client configuration after a certificate rotation (None: the endpoint's own).
    rotated: Mutex<Option<quinn::ClientConfig>>,
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
}

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
        let register =
            Message::Register(Register { protocol: PROTOCOL_VERSION, role: opts.role, name: opts.name.clone() });
        let (mut tries, mut redirects) = (0u32, 0u32);
        // Where the registration goes: the address given, or where the process there says the coordinator is
        // now (a majority moved it: the process given answers `Moved`, or that it is not the coordinator).
        let mut coordinator = coordinator;
        let map = loop {
            // `connect_timeout` bounds the whole wait: every attempt gets at most the time that is left, and at
            // most a quarter of it (but 2 s at least), so that a handshake lost on a loaded machine is tried
            // again rather than waited for until the end.
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let per_call = opts.rpc_timeout.min(left).min((left / 4).max(Duration::from_secs(2)));
            let attempt = async {
                let conn = net::connect(&endpoint, coordinator, per_call).await?;
                // Any shard process's certificate: the coordinator moves where a majority chooses who serves
                // shard 0; the map must then name the process that answered as serving it.
                let process = net::expect_any_shard(&conn, &cluster)?;
                let reply = net::call(&conn, &register, &[], &opts.limits, per_call).await;
                conn.close(0u32.into(), b"registered");
                match reply {
                    Ok(Frame { msg: Message::ClusterMap(map), .. })
                        if map.shards.first().is_none_or(|s| s.process != process) =>
                    {
                        Err(RpcError::Identity {
                            addr: coordinator.to_string(),
                            message: format!(
                                "shard process {process} answered, but its map says another serves shard 0"
                            ),
                        })
                    }
                    other => other,
                }
            };
            let attempt = async {
                match tokio::time::timeout(left, attempt).await {
                    Ok(result) => result,
                    Err(_) => Err(RpcError::Timeout { addr: coordinator.to_string(), timeout: left }),
                }
            };
            let last = match attempt.await {
                Ok(Frame { msg: Message::ClusterMap(map), .. }) => break map,
                Ok(other) => {
                    return Err(RpcError::Unexpected {
                        addr: coordinator.to_string(),
                        kind: net::kind_name(&other.msg).into(),
                    }
                    .into())
                }
                Err(RpcError::Remote { code: ErrorCode::ClusterIncomplete | ErrorCode::Busy, message, .. }) => message,
                Err(e) if e.is_retryable() => e.to_string(),
                Err(e @ RpcError::Remote { code: ErrorCode::Moved | ErrorCode::Misconfigured, .. })
                    if redirects < 3 =>
                {
                    match coordinator_named_by(&endpoint, coordinator, &cluster, per_call).await {
                        Some(now) if now != coordinator => {
                            debug!(from = %coordinator, to = %now, "the coordinator moved: registering there");
                            (redirects, coordinator) = (redirects + 1, now);
                            continue;
                        }
                        _ => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            };
            // Exponential backoff with jitter: hundreds of workers started at once do not come back at once.
            tries += 1;
            let base = (100u64 << tries.min(4)).min(1_600);
            let pause = Duration::from_millis(base / 2 + jitter_ms(base / 2));
            // Give up when no further attempt fits (a pause and at least as long again for the attempt): the
            // error reports what the last complete attempt said.
            if Instant::now() + 2 * pause >= deadline {
                return Err(ClientError::JoinTimeout {
                    coordinator: opts.coordinator.clone(),
                    waited: started.elapsed(),
                    last,
                });
            }
            debug!(%last, "cluster not ready, retrying");
            tokio::time::sleep(pause).await;
        };
        map.layout.validate().map_err(|e| ClientError::BadMap(e.to_string()))?;
        let rule: Rule =
            map.rule.name.parse().map_err(|e: gaps_kernels::KernelError| ClientError::BadMap(e.to_string()))?;
        let hyper = Hyper { momentum: map.rule.momentum, weight_decay: map.rule.weight_decay, ..Hyper::default() };
        let sparse_rule: Rule =
            map.rule.sparse.parse().map_err(|e: gaps_kernels::KernelError| ClientError::BadMap(e.to_string()))?;
        let tensor_rules = map
            .layout
            .tensors
            .iter()
            .map(|t| hyper.resolve(rule, &t.rule))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ClientError::BadMap(e.to_string()))?;
        let table_rules = map
            .layout
            .tables
            .iter()
            .map(|t| hyper.resolve(sparse_rule, &t.rule).map(|(r, _)| r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ClientError::BadMap(e.to_string()))?;
        if map.shards.len() != map.num_shards as usize
            || map.shards.iter().enumerate().any(|(i, s)| s.index as usize != i)
        {
            return Err(ClientError::BadMap(format!("expected {} shards in index order", map.num_shards)));
        }
        let mut owned: Vec<Vec<(ChunkId, u64)>> = vec![Vec::new(); map.num_shards as usize];
        for (g, id) in map.layout.chunks().enumerate() {
            owned[g % map.num_shards as usize].push((id, g as u64));
        }
        let mut shards = Vec::with_capacity(map.shards.len());
        for (s, chunks) in map.shards.iter().zip(owned) {
            let addr = net::resolve(&s.addr).await?;
            shards.push(ShardLink {
                index: s.index,
                route: Mutex::new(Route { name: s.addr.clone(), addr, process: s.process, epoch: s.epoch }),
                conns: (0..opts.lanes.clamp(1, usize::from(MAX_PUSH_PARTS))).map(|_| Mutex::new(None)).collect(),
                next_seq: AtomicU64::new(1),
                acknowledged: AtomicU64::new(0),
                chunks,
                sparse_in_flight: AtomicUsize::new(0),
                sparse_answered: tokio::sync::Notify::new(),
            });
        }
        let processes = map.process_addrs();
        let client = Client {
            inner: Arc::new(Inner {
                opts,
                cluster,
                rotated: Mutex::new(None),
                endpoint,
                path,
                map,
                shards,
                drop_after_send: AtomicU32::new(0),
                pushes_sent: AtomicU64::new(0),
                pushes_acknowledged: AtomicU64::new(0),
                stale_after_restore: AtomicU64::new(0),
                rollbacks_seen: AtomicU64::new(0),
                retries: AtomicU64::new(0),
                rule,
                tensor_rules,
                slim_momentum: Mutex::new(Vec::new()),
                table_rules,
                last_pull: Mutex::new(None),
                data_tag: Mutex::new(None),
                waited_us: AtomicU64::new(0),
                steps: AtomicU64::new(0),
                processes: Mutex::new(processes),
                located: Mutex::new(None),
                map_asked: Mutex::new(None),
                decisions: Mutex::new(None),
            }),
        };
        // Connect to every shard now, so a missing or unreachable shard fails by name — tried again with a
        // jittered backoff until the connect timeout, since a handshake can be lost on a loaded machine.
        for s in 0..client.inner.shards.len() {
            let mut tries = 0u32;
            loop {
                let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
                let bound = remaining.min((remaining / 4).max(Duration::from_secs(2)));
                match client.connection(s, 0, bound).await {
                    Ok(_) => break,
                    Err(e) if Instant::now() + Duration::from_millis(200) < deadline => {
                        tries += 1;
                        let base = (100u64 << tries.min(4)).min(1_600);
                        debug!(shard = s, error = %e, "connecting to a shard, trying again");
                        tokio::time::sleep(Duration::from_millis(base / 2 + jitter_ms(base / 2))).await;
                    }
                    Err(e) => {
                        return Err(ClientError::JoinTimeout {
                            coordinator: client.inner.opts.coordinator.clone(),
                            waited: started.elapsed(),
                            last: format!("shard {} at {} is unreachable: {e}", s, client.inner.shards[s].addr()),
                        })
                    }
                }
            }
        }
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

    async fn connection(&self, shard: usize, lane: usize, timeout: Duration) -> Result<quinn::Connection, RpcError> {
        let link = &self.inner.shards[shard];
        let slot = link.conns.get(lane).ok_or_else(|| RpcError::Setup(format!("no lane {lane}")))?;
        let existing = slot.lock().map_err(|_| RpcError::Setup("connection lock poisoned".into()))?.clone();
        if let Some(conn) = existing {
            if conn.close_reason().is_none() {
                return Ok(conn);
            }
        }
        // Resolved again: a restarted shard may be back at another address under the same name.
        let route = link.route();
        let addr = match tokio::time::timeout(timeout, net::resolve(&route.name)).await {
            Ok(Ok(addr)) => addr,
            _ => route.addr,
        };
        let rotated = self.inner.rotated.lock().map_err(|_| RpcError::Setup("TLS lock poisoned".into()))?.clone();
        let conn = net::connect_with(&self.inner.endpoint, rotated, addr, timeout).await?;
        // The server must hold this shard's certificate of our cluster; then this connection is bound to our
        // worker id with the coordinator's credential (observers have none and only read).
        net::expect_shard(&conn, &self.inner.cluster, route.process)?;
        if let (Some(worker), Some(token)) = (self.inner.map.worker_id, self.inner.map.token) {
            let auth = Message::Authenticate(Authenticate { worker, token });
            match net::call(&conn, &auth, &[], &self.inner.opts.limits, timeout).await? {
                Frame { msg: Message::Authenticated(_), .. } => {}
                other => {
                    return Err(RpcError::Unexpected {
                        addr: conn.remote_address().to_string(),
                        kind: net::kind_name(&other.msg).into(),
                    })
                }
            }
        }
        *slot.lock().map_err(|_| RpcError::Setup("connection lock poisoned".into()))? = Some(conn.clone());
        Ok(conn)
    }

    /// One request to one shard, sent again on a new connection after a transport failure until the shard
    /// has been unreachable for `shard_down_timeout`. Callers only use it for idempotent requests (pushes are
    /// made idempotent by their sequence number).
    async fn request(&self, shard: usize, msg: &Message, payload: &[net::Bytes]) -> Result<(Frame, u32), RpcError> {
        self.request_with(shard, msg, payload, &mut net::InFrame).await
    }

    /// [`Self::request`] with the reply's payload read where `sink` says.
    async fn request_with<S: net::ReplySink + Send + ?Sized>(
        &self,
        shard: usize,
        msg: &Message,
        payload: &[net::Bytes],
        sink: &mut S,
    ) -> Result<(Frame, u32), RpcError> {
        self.request_on(shard, 0, msg, payload, sink).await
    }

    /// [`Self::request_with`] on one of the shard's lanes (its connections for striped transfers).
    async fn request_on<S: net::ReplySink + Send + ?Sized>(
        &self,
        shard: usize,
        lane: usize,
        msg: &Message,
        payload: &[net::Bytes],
        sink: &mut S,
    ) -> Result<(Frame, u32), RpcError> {
        let opts = &self.inner.opts;
        let mut attempt = 0u32;
        let mut down_since: Option<Instant> = None;
        let mut busy_since: Option<Instant> = None;
        loop {
            // With copies of the shards, a request (or its connection) that waits long may wait for a dead
            // primary, whose connection only times out after seconds: the coordinator's map tells whether a
            // backup took the shard over, and the request goes there instead.
            let route_epoch = self.inner.shards[shard].epoch();
            let moved = async {
                if self.inner.map.replicas < 2 || (shard == 0 && !self.coordinator_moves()) {
                    return std::future::pending().await;
                }
                // Another request may find the move first: the route is looked at every 50 ms (a lock), the
                // coordinator asked once the request waited MOVED_CHECK_AFTER.
                let began = Instant::now();
                loop {
                    if self.inner.shards[shard].epoch() != route_epoch {
                        return;
                    }
                    if began.elapsed() < MOVED_CHECK_AFTER {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    self.follow_map(shard).await;
                    if self.inner.shards[shard].epoch() != route_epoch {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            };
            let attempt_once = async {
                // A handshake with a live shard takes milliseconds; a short bound lets a restarted shard be
                // found again soon after it is back, and never outlasts the shard-down timeout.
                let left =
                    down_since.map_or(opts.shard_down_timeout, |t| opts.shard_down_timeout.saturating_sub(t.elapsed()));
                let bound = opts.rpc_timeout.min(Duration::from_secs(5)).min(left.max(Duration::from_millis(100)));
                let conn = self.connection(shard, lane, bound).await?;
                if self.take_injected_drop() {
                    let (mut send, _recv) = conn.open_bi().await.map_err(|e| RpcError::Connection {
                        addr: conn.remote_address().to_string(),
                        message: e.to_string(),
                    })?;
                    let _ = net::write_frame(&mut send, msg, payload).await;
                    let _ = send.finish();
                    // Give the request time to reach the shard, then cut the connection before the reply.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    conn.close(1u32.into(), b"injected failure");
                    return Err(RpcError::Connection {
                        addr: conn.remote_address().to_string(),
                        message: "injected connection drop".into(),
                    });
                }
                net::call_with(&conn, msg, payload, &opts.limits, opts.rpc_timeout, &mut *sink).await
            };
            let result = tokio::select! {
                reply = attempt_once => Some(reply),
                () = moved => None,
            };
            // Another process serves the shard now (its route says where): the request goes there at once,
            // with the same sequence number.
            let Some(result) = result else {
                attempt += 1;
                self.inner.retries.fetch_add(1, Ordering::Relaxed);
                tracing::info!(shard, addr = %self.inner.shards[shard].addr(), "the shard moved to its backup; sending there");
                continue;
            };
            match result {
                Ok(frame) => return Ok((frame, attempt)),
                // The shard had no memory free for the request in time: nothing was applied; the same request
                // goes again on the same connection after a short, jittered pause.
                Err(RpcError::Remote { code: ErrorCode::Busy, message, .. })
                    if busy_since.get_or_insert_with(Instant::now).elapsed() < opts.rpc_timeout =>
                {
                    attempt += 1;
                    self.inner.retries.fetch_add(1, Ordering::Relaxed);
                    if attempt == 1 || attempt % 20 == 0 {
                        warn!(shard, attempt, %message, "shard busy, sending the request again");
                    }
                    let pause = (10 * u64::from(attempt)).min(200);
                    tokio::time::sleep(Duration::from_millis(pause + jitter_ms(pause))).await;
                }
                Err(e)
                    if (e.is_retryable() || matches!(e, RpcError::Remote { code: ErrorCode::Moved, .. }))
                        && down_since.is_none_or(|t| t.elapsed() < opts.shard_down_timeout) =>
                {
                    let since = *down_since.get_or_insert_with(Instant::now);
                    attempt += 1;
                    self.inner.retries.fetch_add(1, Ordering::Relaxed);
                    // A backup may have taken the shard over: the coordinator's map says where it is now.
                    if self.follow_map(shard).await {
                        tracing::info!(shard, addr = %self.inner.shards[shard].addr(), "the shard moved to its backup; sending there");
                        continue;
                    }
                    let addr = self.inner.shards[shard].addr();
                    if attempt == 1 || attempt % 20 == 0 {
                        warn!(
                            shard,
                            %addr,
                            attempt,
                            down_for = ?since.elapsed(),
                            wait_up_to = ?opts.shard_down_timeout,
                            error = %e,
                            "shard unreachable, retrying on a new connection"
                        );
                    }
                    if let Some(Ok(mut guard)) = self.inner.shards[shard].conns.get(lane).map(|c| c.lock()) {
                        *guard = None;
                    }
                    tokio::time::sleep(Duration::from_millis((50 * u64::from(attempt)).min(500))).await;
                }
                Err(e) if e.is_retryable() => {
                    let addr = self.inner.shards[shard].addr();
                    return Err(RpcError::Connection {
                        addr: addr.to_string(),
                        message: format!(
                            "shard {shard} stayed unreachable for {:?} ({attempt} retries): {e}",
                            down_since.map_or(Duration::ZERO, |t| t.elapsed())
                        ),
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Asks the coordinator where the shards are served now and follows each that a backup took over (a
    /// newer replica epoch); true when shard `shard` moved. At most one question per 300 ms. Shard 0 — the
    /// coordinator itself — moves only where a majority of the shard processes chooses who serves it
    /// ([`Client::coordinator_moves`]): for it, the processes are asked where the coordinator is first.
    async fn follow_map(&self, shard: usize) -> bool {
        if shard == 0 && !self.coordinator_moves() {
            return false;
        }
        {
            let Ok(mut last) = self.inner.map_asked.lock() else { return false };
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(300)) {
                return false;
            }
            *last = Some(Instant::now());
        }
        let Ok(map) = self.ask_map(shard == 0).await else { return false };
        let mut moved = false;
        for s in &map.shards {
            let Some(link) = self.inner.shards.get(s.index as usize) else { continue };
            if s.epoch <= link.epoch() {
                continue;
            }
            let Ok(addr) = net::resolve(&s.addr).await else { continue };
            match link.route.lock() {
                // Another task may have followed a newer map meanwhile: a route never goes back.
                Ok(mut route) if route.epoch < s.epoch => {
                    *route = Route { name: s.addr.clone(), addr, process: s.process, epoch: s.epoch };
                }
                _ => continue,
            }
            for conn in &link.conns {
                if let Ok(mut c) = conn.lock() {
                    *c = None;
                }
            }
            moved |= s.index as usize == shard;
        }
        moved
    }

    /// Whether the coordinator (shard 0) can move: replicated shards on 3 processes or more, where a
    /// majority of them chooses who serves it.
    pub fn coordinator_moves(&self) -> bool {
        self.inner.map.replicas >= 2 && self.inner.map.num_shards >= 3
    }

    /// The coordinator's current cluster map: asked where shard 0 is served as this client knows it, and —
    /// where the coordinator can move — of the process the shard processes say serves it when that one does
    /// not answer, or first when `locate` (shard 0's own requests went wrong: the process this client knows
    /// may be an old coordinator cut off from the others). Each question: 2 s to connect, 2 s for the answer.
    async fn ask_map(&self, locate: bool) -> Result<ClusterMap, ClientError> {
        let map = self.coordinator_map(locate).await?;
        let known = map.process_addrs();
        if let (Ok(mut p), false) = (self.inner.processes.lock(), known.is_empty()) {
            *p = known;
        }
        Ok(map)
    }

    /// [`Client::ask_map`] before the processes it lists are remembered.
    async fn coordinator_map(&self, locate: bool) -> Result<ClusterMap, ClientError> {
        let route = self.inner.shards[0].route();
        let moves = self.coordinator_moves();
        let mut asked = None;
        if !locate || !moves {
            let first = self.map_from(&route.name, route.process).await;
            if first.is_ok() || !moves {
                return first;
            }
            asked = Some(first);
        }
        // The processes are asked at most once a second (each question is a handshake with every one).
        {
            let Ok(mut last) = self.inner.located.lock() else {
                return Err(ClientError::BadMap("lock poisoned".into()));
            };
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return asked.unwrap_or_else(|| {
                    Err(ClientError::BadMap("the shard processes were asked where the coordinator is just now".into()))
                });
            }
            *last = Some(Instant::now());
        }
        match (self.locate_coordinator().await, asked) {
            (Some(c), _) if (c.serving, c.addr.as_str()) != (route.process, route.name.as_str()) => {
                self.map_from(&c.addr, c.serving).await
            }
            (_, Some(first)) => first,
            // Nobody knows of another coordinator than the one shard 0's requests already go to: it did not
            // move (asking it again could wait seconds on a dead process).
            (Some(_), None) => Err(ClientError::BadMap("shard 0 is served where it was; nothing moved".into())),
            (None, None) => self.map_from(&route.name, route.process).await,
        }
    }

    /// The cluster map shard process `process` at `addr` hands an observer.
    async fn map_from(&self, addr: &str, process: u32) -> Result<ClusterMap, ClientError> {
        let opts = &self.inner.opts;
        let register =
            Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: opts.name.clone() });
        let addr = net::resolve(addr).await?;
        let rotated = self.inner.rotated.lock().map_err(|_| RpcError::Setup("TLS lock poisoned".into()))?.clone();
        let conn = net::connect_with(&self.inner.endpoint, rotated, addr, Duration::from_secs(2)).await?;
        net::expect_shard(&conn, &self.inner.cluster, process)?;
        let reply = net::call(&conn, &register, &[], &opts.limits, Duration::from_secs(2)).await;
        conn.close(0u32.into(), b"map");
        match reply?.msg {
            Message::ClusterMap(map) => Ok(map),
            other => Err(ClientError::BadMap(format!("the coordinator answered a map request with {other:?}"))),
        }
    }

    /// The newest configuration of shard 0 that the shard processes this client knows say was chosen: all are
    /// asked at once (each within 1.5 s), and the answer is in once a majority of the cluster's processes
    /// answered (a dead one is not waited for) or none is left to; None when none answered.
    async fn locate_coordinator(&self) -> Option<gaps_common::quorum::CoordinatorConfig> {
        let processes = self.inner.processes.lock().map(|p| p.clone()).unwrap_or_default();
        let rotated = self.inner.rotated.lock().ok()?.clone();
        let majority = self.inner.map.num_shards as usize / 2 + 1;
        let wait = Duration::from_millis(1500);
        net::newest_coordinator(&self.inner.endpoint, rotated, &self.inner.cluster, &processes, (majority, wait)).await
    }

    /// The coordinator's cluster map as it is now: who serves each shard under which replica epoch, the
    /// backups in sync, the spare processes (the map of [`Client::map`] is the one received at
    /// registration).
    pub async fn current_map(&self) -> Result<ClusterMap, ClientError> {
        self.ask_map(false).await
    }

    fn take_injected_drop(&self) -> bool {
        self.inner.drop_after_send.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }

    /// Pulls the whole model from all shards concurrently. Each shard's reply is read straight into the
    /// snapshot's tensors (no intermediate buffer, no zero-fill).
    pub async fn pull(&self) -> Result<Snapshot, ClientError> {
        let mut tensors = self.snapshot_buffers();
        let (mut sinks, requests_of) = self.pull_sinks(&mut tensors, None)?;
        let requests = sinks.iter_mut().zip(&requests_of).map(|(sink, (s, lane, chunks))| {
            let msg =
                Message::Pull(Pull { epoch: self.inner.map.epoch, chunks: chunks.iter().map(|(id, _)| *id).collect() });
            async move { self.request_on(*s, *lane, &msg, &[], sink).await }
        });
        for ((s, _, _), outcome) in requests_of.iter().zip(join_all(requests.collect()).await) {
            outcome.map_err(|e| match e {
                RpcError::BadReply { message, .. } => ClientError::BadMap(format!("shard {s}: {message}")),
                other => other.into(),
            })?;
        }
        let versions = self.pulled_versions(&sinks, &requests_of);
        drop(sinks);
        Ok(self.pulled_snapshot(tensors, versions))
    }

    /// The snapshot a pull (or a push-pull's answer) filled: `tensors` with their chunks' `versions`. The
    /// time is remembered: the next push's compute time counts from it.
    fn pulled_snapshot(&self, tensors: Vec<Vec<f32>>, versions: Vec<u64>) -> Snapshot {
        if let Ok(mut last) = self.inner.last_pull.lock() {
            *last = Some(Instant::now());
        }
        Snapshot { tensors: Arc::new(tensors), versions }
    }

    /// A snapshot's tensor buffers. Every element is written by exactly one shard's reply before the
    /// snapshot is returned (every chunk is owned, checked by [`Self::pull_sinks`]), so recycled buffers
    /// are used as they are, without a memset.
    fn snapshot_buffers(&self) -> Vec<Vec<f32>> {
        self.inner.map.layout.tensors.iter().map(|t| gaps_common::buffers::take_filled(t.len as usize)).collect()
    }

    /// Where the shards' pull replies go: one request per shard, or per stripe of a shard's chunks on its own
    /// connection for a large model (see `ClientOptions::lanes`; `lanes` overrides it), as (shard, lane, that
    /// request's chunks) with the sink that reads its reply into `tensors`.
    fn pull_sinks<'t>(
        &'t self,
        tensors: &'t mut [Vec<f32>],
        lanes: Option<usize>,
    ) -> Result<(Vec<PullInto<'t>>, Vec<PullRequest<'t>>), ClientError> {
        let layout = &self.inner.map.layout;
        let chunk_elems = layout.chunk_elems.max(1) as usize;
        // Chunk slices of every tensor, in chunk order, handed to the shard that owns each chunk.
        let mut slots: Vec<Vec<Option<&mut [f32]>>> =
            tensors.iter_mut().map(|t| t.chunks_mut(chunk_elems).map(Some).collect()).collect();
        let mut sinks = Vec::with_capacity(self.inner.shards.len());
        let mut requests_of = Vec::with_capacity(self.inner.shards.len());
        for (s, link) in self.inner.shards.iter().enumerate() {
            let bytes: Vec<u64> = link
                .chunks
                .iter()
                .map(|(id, _)| (layout.chunk_len(*id).unwrap_or(0) * layout.wire_dtype(id.tensor).bytes()) as u64)
                .collect();
            let lanes = lanes.unwrap_or(link.conns.len());
            for (lane, range) in stripe_groups(&bytes, lanes).into_iter().enumerate() {
                let chunks = &link.chunks[range];
                let mut slices = Vec::with_capacity(chunks.len());
                for (id, _) in chunks {
                    let slot = slots.get_mut(id.tensor as usize).and_then(|t| t.get_mut(id.chunk as usize));
                    match slot.and_then(Option::take) {
                        Some(slice) => slices.push(slice),
                        None => {
                            return Err(ClientError::BadMap(format!(
                                "chunk {id:?} is not in the layout or owned twice"
                            )))
                        }
                    }
                }
                let expected = chunks.iter().map(|(id, _)| (*id, layout.chunk_len(*id).unwrap_or(0) as u32)).collect();
                sinks.push(PullInto::new(expected, slices));
                requests_of.push((s, lane, chunks));
            }
        }
        if slots.iter().flatten().any(Option::is_some) {
            return Err(ClientError::BadMap("the shard map leaves a chunk of the layout unowned".into()));
        }
        Ok((sinks, requests_of))
    }

    /// Every chunk's version (global order) from the sinks of a pull.
    fn pulled_versions(&self, sinks: &[PullInto<'_>], requests_of: &[PullRequest<'_>]) -> Vec<u64> {
        let mut versions = vec![0u64; self.inner.map.layout.total_chunks() as usize];
        for (sink, (_, _, chunks)) in sinks.iter().zip(requests_of) {
            for (v, (_, global)) in sink.versions.iter().zip(chunks.iter()) {
                versions[*global as usize] = *v;
            }
        }
        versions
    }

    /// The payload of a push of `chunks`: every chunk's gradient, then the read parameters of the chunks whose
    /// rule measures drift, as views of the shared tensors handed to the transport without a copy (f32) or
    /// converted to the tensor's 16-bit wire format. A 16-bit gradient is checked for NaN and ±∞ as it is
    /// converted (f32 gradients are checked before).
    fn push_payload(
        &self,
        chunks: &[(ChunkId, u64)],
        grads: &Arc<Vec<Vec<f32>>>,
        read: &Arc<Vec<Vec<f32>>>,
    ) -> Result<Vec<net::Bytes>, ClientError> {
        let layout = &self.inner.map.layout;
        let mut out = Vec::with_capacity(chunks.len());
        for (id, _) in chunks {
            let range = layout.chunk_range(*id).map_err(|e| ClientError::Shape(e.to_string()))?;
            let dtype = layout.wire_dtype(id.tensor);
            if dtype == WireDtype::F32 {
                out.push(net::f32_bytes(TensorSlice { tensors: grads.clone(), tensor: id.tensor as usize, range }));
                continue;
            }
            let values = &grads[id.tensor as usize][range];
            let (bytes, finite) = net::encode_slice_finite(dtype, values);
            if !finite {
                let name = layout.tensors.get(id.tensor as usize).map_or("?", |t| t.name.as_str());
                check_finite(&format!("the gradient of {name}"), &grads[id.tensor as usize])?;
            }
            out.push(bytes);
        }
        for (id, _) in chunks.iter().filter(|(id, _)| self.inner.echoes(id)) {
            let range = layout.chunk_range(*id).map_err(|e| ClientError::Shape(e.to_string()))?;
            let slice = TensorSlice { tensors: read.clone(), tensor: id.tensor as usize, range };
            out.push(net::dtype_bytes(layout.wire_dtype(id.tensor), slice));
        }
        Ok(out)
    }

    /// The shards' default update rule (a tensor's own rule in the layout takes precedence).
    pub fn rule(&self) -> Rule {
        self.inner.rule
    }

    /// The rule tensor `tensor` is updated with.
    pub fn tensor_rule(&self, tensor: u32) -> Option<Rule> {
        self.inner.tensor_rules.get(tensor as usize).map(|(r, _)| *r)
    }

    /// Pushes a gradient (one vector per tensor) computed on `snapshot` to all shards concurrently. Each
    /// shard push gets the next sequence number of that shard and is retried with the same number after a
    /// transport failure. Where the rule needs it, the push also carries the snapshot's values (the
    /// parameters the gradient was computed on); under DANA-Slim the worker's momentum turns the gradient
    /// into its Nesterov step here.
    pub async fn push(&self, grads: Vec<Vec<f32>>, snapshot: &Snapshot) -> Result<PushSummary, ClientError> {
        Ok(self.push_then(Arc::new(grads), snapshot, false).await?.0)
    }

    /// [`Self::push`] of a gradient the caller keeps: the transport sends straight from the shared buffers
    /// (no copy), so the same buffers can be pushed again or refilled once the push returned. (A rule
    /// with worker momentum writes its step into a copy.)
    pub async fn push_shared(
        &self,
        grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
    ) -> Result<PushSummary, ClientError> {
        Ok(self.push_then(grads, snapshot, false).await?.0)
    }

    /// [`Self::push`], then what a [`Self::pull`] right after it returns, in one request per shard
    /// ([`Message::PushPull`]: each shard answers the push with the pushed chunks' values read right after
    /// applying it, so the pull costs no request of its own). A shard whose ack asks the worker to wait (a
    /// synchronous step, bounded staleness) or that refused the gradient as computed before its restore
    /// answers without values, and a push striped over several lanes is answered with an ack only; the
    /// pull is then made on its own, after the waits, as `push` then `pull` would.
    pub async fn push_pull(
        &self,
        grads: Vec<Vec<f32>>,
        snapshot: &Snapshot,
    ) -> Result<(PushSummary, Snapshot), ClientError> {
        self.push_pull_shared(Arc::new(grads), snapshot).await
    }

    /// [`Self::push_pull`] of a gradient the caller keeps (see [`Self::push_shared`]).
    pub async fn push_pull_shared(
        &self,
        grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
    ) -> Result<(PushSummary, Snapshot), ClientError> {
        let (summary, next) = self.push_then(grads, snapshot, true).await?;
        let next = match next {
            Some(next) => next,
            None => self.pull().await?,
        };
        Ok((summary, next))
    }

    /// A push, and with `pull` the new values where every shard could send them with its ack.
    async fn push_then(
        &self,
        mut grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
        pull: bool,
    ) -> Result<(PushSummary, Option<Snapshot>), ClientError> {
        let worker = self.worker_for("push")?;
        let layout = &self.inner.map.layout;
        let matches = |t: &[Vec<f32>]| {
            t.len() == layout.tensors.len() && t.iter().zip(&layout.tensors).all(|(g, s)| g.len() as u64 == s.len)
        };
        if !matches(&grads) || !matches(&snapshot.tensors) {
            return Err(ClientError::Shape("gradient or snapshot tensors do not match the model layout".into()));
        }
        // Tensors that travel in a 16-bit format are checked as they are converted (below, before anything is
        // sent); the others here.
        for (t, (g, spec)) in grads.iter().zip(&layout.tensors).enumerate() {
            if layout.wire_dtype(t as u32) == WireDtype::F32 {
                check_finite(&format!("the gradient of {}", spec.name), g)?;
            }
        }
        let read_versions = &snapshot.versions;
        if read_versions.len() as u64 != layout.total_chunks() {
            return Err(ClientError::Shape("read versions do not match the model layout".into()));
        }
        let rules = &self.inner.tensor_rules;
        if rules.iter().any(|(r, _)| r.layout().worker_momentum) {
            let mut momentum =
                self.inner.slim_momentum.lock().map_err(|_| ClientError::Shape("momentum lock poisoned".into()))?;
            if momentum.is_empty() {
                *momentum = grads.iter().map(|g| vec![0.0; g.len()]).collect();
            }
            let tensors =
                Arc::make_mut(&mut grads).iter_mut().zip(momentum.iter_mut()).zip(snapshot.tensors.iter()).zip(rules);
            for (((g, v), pulled), (rule, hyper)) in tensors {
                if rule.layout().worker_momentum {
                    gaps_kernels::slim_worker_step(hyper, pulled, v, g);
                }
            }
        }
        // Every shard's payload, cut into its stripes, made before any is sent: a bad value found while a
        // gradient is converted stops the push on every shard.
        let mut payloads = Vec::with_capacity(self.inner.shards.len());
        for link in &self.inner.shards {
            let bytes: Vec<u64> = link
                .chunks
                .iter()
                .map(|(id, _)| {
                    let width = layout.wire_dtype(id.tensor).bytes() as u64;
                    layout.chunk_len(*id).unwrap_or(0) as u64 * width * (1 + u64::from(self.inner.echoes(id)))
                })
                .collect();
            let mut stripes = Vec::new();
            for range in stripe_groups(&bytes, link.conns.len()) {
                let payload = self.push_payload(&link.chunks[range.clone()], &grads, &snapshot.tensors)?;
                stripes.push((range, payload));
            }
            payloads.push(stripes);
        }
        let compute_ms = self
            .inner
            .last_pull
            .lock()
            .ok()
            .and_then(|last| last.map(|t| t.elapsed().as_millis().clamp(1, u128::from(u32::MAX)) as u32))
            .unwrap_or(0);
        let step = self.inner.steps.fetch_add(1, Ordering::SeqCst);
        let decisions = self.inner.decisions().unwrap_or_default();
        let data = self.inner.data_tag.lock().ok().and_then(|t| *t);
        let after_rows = self.inner.synchronous();
        let mut pushes = Vec::with_capacity(payloads.len());
        // Every shard gets a push every step, with no chunks where it owns none: the push ends the worker's
        // step there (synchronous steps, the rows summed for it, the coordinator's view of every worker).
        for (s, stripes) in payloads.into_iter().enumerate() {
            let link = &self.inner.shards[s];
            let seq = link.next_seq.fetch_add(1, Ordering::SeqCst);
            let chunks: Vec<PushChunk> = link
                .chunks
                .iter()
                .map(|(id, g)| PushChunk {
                    id: *id,
                    read_version: read_versions[*g as usize],
                    len: layout.chunk_len(*id).unwrap_or(0) as u32,
                    echo: self.inner.echoes(id),
                    dtype: layout.wire_dtype(id.tensor),
                })
                .collect();
            // A slow link costs the step its round trips just as slow compute does: two (the pull and this
            // push), from quinn's smoothed RTT estimate of the connection to this shard.
            let rtt = link.conns[0].lock().ok().and_then(|c| c.as_ref().map(quinn::Connection::rtt));
            let network_ms = rtt.map_or(0, |r| (2 * r.as_micros() / 1000).min(u128::from(u32::MAX / 2)) as u32);
            let compute_ms = if compute_ms > 0 { compute_ms.saturating_add(network_ms) } else { 0 };
            let push = Push { epoch: self.inner.map.epoch, worker, seq, chunks, compute_ms, step, decisions, data };
            self.inner.pushes_sent.fetch_add(1, Ordering::Relaxed);
            pushes.push((s, push, stripes));
        }
        let mut summary = PushSummary::default();
        let mut waits = Vec::new();
        let mut next = None;
        if pull && pushes.iter().all(|(_, _, stripes)| stripes.len() < 2) {
            let mut tensors = self.snapshot_buffers();
            // One request per shard, in shard order, as the pushes are.
            let (mut sinks, requests_of) = self.pull_sinks(&mut tensors, Some(1))?;
            let requests = sinks.iter_mut().zip(pushes).map(|(sink, (s, push, stripes))| {
                let payload = stripes.into_iter().flat_map(|(_, p)| p).collect::<Vec<_>>();
                async move {
                    if after_rows {
                        self.inner.shards[s].sparse_settled().await;
                    }
                    (s, self.request_with(s, &Message::PushPull(push), &payload, sink).await)
                }
            });
            for (s, outcome) in join_all(requests.collect()).await {
                self.take_ack(s, outcome, &mut summary, &mut waits)?;
            }
            if waits.is_empty() && sinks.iter().all(|sink| sink.filled) {
                let versions = self.pulled_versions(&sinks, &requests_of);
                drop(sinks);
                next = Some(self.pulled_snapshot(tensors, versions));
            } else {
                drop(sinks);
                tensors.into_iter().for_each(gaps_common::buffers::give);
            }
        } else {
            self.push_spawned(pushes, after_rows, &mut summary, &mut waits).await?;
        }

        // Very large gradient buffers are recycled (for the next pull's tensors) once the transport let go.
        if let Ok(grads) = Arc::try_unwrap(grads) {
            grads.into_iter().for_each(gaps_common::buffers::give);
        }
        let waiting = Instant::now();
        for (s, version, clock) in waits {
            self.wait_for(s, version, clock).await?;
        }
        let waited = waiting.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        self.inner.waited_us.fetch_add(waited, Ordering::Relaxed);
        Ok((summary, next))
    }

    /// Sends every shard's push from its own task (a push striped over lanes from one task per part) and
    /// takes the acks.
    async fn push_spawned(
        &self,
        pushes: Vec<(usize, Push, Vec<Stripe>)>,
        after_rows: bool,
        summary: &mut PushSummary,
        waits: &mut Vec<(usize, u64, u64)>,
    ) -> Result<(), ClientError> {
        let mut tasks = tokio::task::JoinSet::new();
        for (s, push, stripes) in pushes {
            let client = self.clone();
            tasks.spawn(async move {
                let link = &client.inner.shards[s];
                if after_rows {
                    link.sparse_settled().await;
                }
                if stripes.len() < 2 {
                    let payload = stripes.into_iter().flat_map(|(_, p)| p).collect::<Vec<_>>();
                    return (s, client.request(s, &Message::Push(push), &payload).await);
                }
                // A large push is cut by chunk into parts, each on its own connection; the shard applies it
                // once all parts are there and answers every part with the same reply.
                let mut sent = tokio::task::JoinSet::new();
                let count = stripes.len() as u16;
                for (lane, (range, payload)) in stripes.into_iter().enumerate() {
                    let part = PushPart {
                        part: lane as u16,
                        parts: count,
                        push: Push { chunks: push.chunks[range].to_vec(), ..push.clone() },
                    };
                    let client = client.clone();
                    sent.spawn(async move {
                        client.request_on(s, lane, &Message::PushPart(part), &payload, &mut net::InFrame).await
                    });
                }
                let mut outcome: Option<Result<(Frame, u32), RpcError>> = None;
                while let Some(joined) = sent.join_next().await {
                    let part = joined.unwrap_or_else(|e| Err(RpcError::Setup(format!("push part task failed: {e}"))));
                    outcome = Some(match (outcome, part) {
                        (None, p) => p,
                        (Some(Err(e)), _) | (Some(Ok(_)), Err(e)) => Err(e),
                        (Some(Ok((frame, r1))), Ok((_, r2))) => Ok((frame, r1 + r2)),
                    });
                }
                (s, outcome.unwrap_or_else(|| Err(RpcError::Setup("a push of no parts".into()))))
            });
        }
        while let Some(joined) = tasks.join_next().await {
            let (s, outcome) = joined.map_err(|e| ClientError::Shape(format!("push task failed: {e}")))?;
            self.take_ack(s, outcome, summary, waits)?;
        }
        Ok(())
    }

    /// Counts one shard's answer to a push into `summary`, and what it asks the worker to wait for into
    /// `waits`; the error where it refused the push (a gradient computed before a shard's restore is
    /// counted and dropped, not an error).
    fn take_ack(
        &self,
        s: usize,
        outcome: Result<(Frame, u32), RpcError>,
        summary: &mut PushSummary,
        waits: &mut Vec<(usize, u64, u64)>,
    ) -> Result<(), ClientError> {
        let (frame, retries) = match outcome {
            Err(RpcError::Remote { code: ErrorCode::ReadAhead, message, .. }) => {
                warn!(shard = s, %message, "a restored shard refused a gradient computed before its restore");
                summary.stale_after_restore += 1;
                self.inner.stale_after_restore.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            other => other?,
        };
        summary.retries += retries;
        let ack = match frame.msg {
            Message::Ack(ack) | Message::PushPullReply(PushPullReply { ack, .. }) => ack,
            other => {
                return Err(RpcError::Unexpected { addr: "shard".into(), kind: net::kind_name(&other).into() }.into())
            }
        };
        self.inner.count_acknowledged(s);
        self.inner.learn(&ack.decisions);
        if ack.duplicate {
            summary.duplicates += 1;
        } else {
            summary.applied += 1;
        }
        summary.max_staleness = summary.max_staleness.max(ack.max_staleness);
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            waits.push((s, ack.wait_for_step, ack.wait_for_clock));
        }
        Ok(())
    }

    /// Waits until shard `s` has completed the synchronous step (its global step reaches `step`) and the
    /// slowest worker's clock reached `clock` (bounded staleness). Gives up after three leases: a step can
    /// only be held that long by a dead worker, whose lease the shard drops.
    async fn wait_for(&self, s: usize, step: u64, clock: u64) -> Result<(), ClientError> {
        let limit = Duration::from_millis(3 * u64::from(self.inner.map.lease_ms)).max(Duration::from_secs(5));
        let started = Instant::now();
        // The shard holds the request until the step comes (or a quarter second passes): no polling.
        let wait = Message::WaitStep(gaps_common::wire::WaitStep { step, clock, max_wait_ms: 250 });
        loop {
            let asked = Instant::now();
            let (frame, _) = self.request(s, &wait, &[]).await?;
            if let Message::Stats(st) = &frame.msg {
                self.inner.learn(&st.decisions);
                if st.global_step >= step && st.ssp_min_clock >= clock {
                    return Ok(());
                }
                // The wait was for the step after the one the shard was at; a shard now further back than
                // that rolled back to a cluster checkpoint, and the step waited for will not come as it was:
                // go on (the next pull reads the restored parameters).
                if st.global_step.saturating_add(1) < step {
                    warn!(
                        shard = s,
                        waited_for = step,
                        now_at = st.global_step,
                        "the shard went back a step: rolled back"
                    );
                    self.inner.rollbacks_seen.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
            }
            if started.elapsed() > limit {
                return Err(ClientError::Shape(format!(
                    "shard {s} did not finish the step (step {step}, clock {clock}) within {limit:?}"
                )));
            }
            // Answered at once without the step (a shard holding too many waits): do not spin.
            if asked.elapsed() < Duration::from_millis(1) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    fn table_dim(&self, table: u32) -> Result<usize, ClientError> {
        self.inner
            .map
            .layout
            .tables
            .get(table as usize)
            .map(|t| t.dim as usize)
            .ok_or_else(|| ClientError::Shape(format!("the model has no sparse table {table}")))
    }

    /// Groups positions of `ids` by owning shard.
    fn by_shard(&self, table: u32, ids: &[u64]) -> Vec<Vec<usize>> {
        let n = self.inner.map.num_shards;
        let mut groups = vec![Vec::new(); n as usize];
        for (k, id) in ids.iter().enumerate() {
            groups[sparse_owner(table, *id, n) as usize].push(k);
        }
        groups
    }

    /// Pulls rows of a sparse table from their shards concurrently. `create` makes missing rows (training);
    /// without it missing rows read their initial values and nothing is stored (evaluation).
    pub async fn pull_sparse(&self, table: u32, ids: &[u64], create: bool) -> Result<SparseRows, ClientError> {
        let dim = self.table_dim(table)?;
        let groups = self.by_shard(table, ids);
        let mut tasks = tokio::task::JoinSet::new();
        for (s, positions) in groups.iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let mut words = Vec::with_capacity(2 * positions.len());
            ids_to_words(&positions.iter().map(|k| ids[*k]).collect::<Vec<_>>(), &mut words);
            let msg = Message::SparsePull(SparsePull {
                epoch: self.inner.map.epoch,
                table,
                count: positions.len() as u32,
                create,
            });
            let client = self.clone();
            let words = [net::f32_bytes(words)];
            tasks.spawn(async move { client.request(s, &msg, &words).await.map(|(frame, _)| (s, frame)) });
        }
        let mut values = vec![0.0f32; ids.len() * dim];
        let mut versions = vec![0u32; ids.len()];
        while let Some(joined) = tasks.join_next().await {
            let (s, frame) = joined.map_err(|e| ClientError::Shape(format!("sparse pull task failed: {e}")))??;
            let positions = &groups[s];
            let ok = matches!(&frame.msg, Message::SparsePullReply(r) if r.count as usize == positions.len() && r.dim as usize == dim);
            if !ok || frame.payload.len() != positions.len() * (1 + dim) {
                return Err(ClientError::BadMap(format!(
                    "shard {s} answered a sparse pull with {:?}",
                    net::kind_name(&frame.msg)
                )));
            }
            let (vers, rows) = frame.payload.split_at(positions.len());
            for (i, k) in positions.iter().enumerate() {
                versions[*k] = vers[i].to_bits();
                values[k * dim..(k + 1) * dim].copy_from_slice(&rows[i * dim..(i + 1) * dim]);
            }
        }
        Ok(SparseRows { ids: ids.to_vec(), values, versions, dim })
    }

    /// Pushes gradients of distinct rows (`grads` is `rows.ids.len() × dim`, computed on `rows`) to their
    /// shards concurrently, exactly once per shard like dense pushes.
    pub async fn push_sparse(&self, table: u32, rows: &SparseRows, grads: &[f32]) -> Result<PushSummary, ClientError> {
        let worker = self.worker_for("push")?;
        let dim = self.table_dim(table)?;
        let name = self.inner.map.layout.tables.get(table as usize).map_or("?", |t| t.name.as_str());
        check_finite(&format!("the row gradients of table {name:?} ({table})"), grads)?;
        if rows.dim != dim || grads.len() != rows.ids.len() * dim || rows.values.len() != grads.len() {
            return Err(ClientError::Shape("sparse gradients do not match the pulled rows".into()));
        }
        let echo = self.inner.table_rules.get(table as usize).is_some_and(|r| r.layout().needs_read);
        let groups = self.by_shard(table, &rows.ids);
        let mut tasks = tokio::task::JoinSet::new();
        for (s, positions) in groups.iter().enumerate() {
            if positions.is_empty() {
                continue;
            }
            let mut payload = Vec::with_capacity(positions.len() * (3 + dim * 2));
            ids_to_words(&positions.iter().map(|k| rows.ids[*k]).collect::<Vec<_>>(), &mut payload);
            payload.extend(positions.iter().map(|k| f32::from_bits(rows.versions[*k])));
            for k in positions {
                payload.extend_from_slice(&grads[k * dim..(k + 1) * dim]);
            }
            if echo {
                for k in positions {
                    payload.extend_from_slice(&rows.values[k * dim..(k + 1) * dim]);
                }
            }
            let seq = self.inner.shards[s].next_seq.fetch_add(1, Ordering::SeqCst);
            let msg = Message::SparsePush(SparsePush {
                epoch: self.inner.map.epoch,
                worker,
                seq,
                table,
                count: positions.len() as u32,
                dim: dim as u32,
                echo_read: echo,
            });
            self.inner.pushes_sent.fetch_add(1, Ordering::Relaxed);
            let client = self.clone();
            let payload = [net::f32_bytes(payload)];
            self.inner.shards[s].sparse_in_flight.fetch_add(1, Ordering::SeqCst);
            tasks.spawn(async move {
                let _in_flight = InFlight(&client.inner.shards[s]);
                client.request(s, &msg, &payload).await.map(|answer| (s, answer))
            });
        }
        let mut summary = PushSummary::default();
        while let Some(joined) = tasks.join_next().await {
            let (s, (frame, retries)) =
                joined.map_err(|e| ClientError::Shape(format!("sparse push task failed: {e}")))??;
            summary.retries += retries;
            match frame.msg {
                Message::Ack(ack) if ack.duplicate => {
                    self.inner.learn(&ack.decisions);
                    self.inner.count_acknowledged(s);
                    summary.duplicates += 1;
                }
                Message::Ack(ack) => {
                    self.inner.learn(&ack.decisions);
                    self.inner.count_acknowledged(s);
                    summary.applied += 1;
                    summary.max_staleness = summary.max_staleness.max(ack.max_staleness);
                }
                other => {
                    return Err(
                        RpcError::Unexpected { addr: "shard".into(), kind: net::kind_name(&other).into() }.into()
                    )
                }
            }
        }
        Ok(summary)
    }

    /// Sends `msg` to every shard in turn and takes what `reply` extracts from each answer, index order; an
    /// answer of another kind is an error naming the shard.
    async fn ask_each<T>(&self, msg: &Message, reply: impl Fn(Message) -> Option<T>) -> Result<Vec<T>, ClientError> {
        let mut out = Vec::with_capacity(self.inner.shards.len());
        for s in 0..self.inner.shards.len() {
            out.push(self.ask(s, msg, &reply).await?);
        }
        Ok(out)
    }

    /// Sends `msg` to shard `s` and takes what `reply` extracts from the answer; an answer of another kind is
    /// an error naming the shard.
    async fn ask<T>(
        &self,
        s: usize,
        msg: &Message,
        reply: impl FnOnce(Message) -> Option<T>,
    ) -> Result<T, ClientError> {
        self.ask_with(s, msg, &[], reply).await
    }

    /// [`Self::ask`] for a request that carries a payload.
    async fn ask_with<T>(
        &self,
        s: usize,
        msg: &Message,
        payload: &[net::Bytes],
        reply: impl FnOnce(Message) -> Option<T>,
    ) -> Result<T, ClientError> {
        let (frame, _) = self.request(s, msg, payload).await?;
        let kind = net::kind_name(&frame.msg);
        Ok(reply(frame.msg)
            .ok_or_else(|| RpcError::Unexpected { addr: self.inner.shards[s].addr().to_string(), kind: kind.into() })?)
    }

    /// This client's worker id; an observer cannot `what`.
    fn worker_for(&self, what: &str) -> Result<u32, ClientError> {
        self.inner.map.worker_id.ok_or_else(|| ClientError::Shape(format!("observers cannot {what}")))
    }

    /// Uploads a model's own initial values, one vector per dense tensor (layout order): every chunk that
    /// no update and no earlier upload touched takes them, the others keep theirs (the first writer wins).
    /// Returns (chunks taken, chunks kept); pull afterwards to train on what won.
    pub async fn initialize(&self, values: &[Vec<f32>]) -> Result<(u32, u32), ClientError> {
        let worker = self.worker_for("initialize")?;
        let layout = &self.inner.map.layout;
        if values.len() != layout.tensors.len() {
            return Err(ClientError::Shape(format!(
                "expected {} tensors of initial values, got {}",
                layout.tensors.len(),
                values.len()
            )));
        }
        for (v, spec) in values.iter().zip(&layout.tensors) {
            if v.len() != spec.len as usize {
                return Err(ClientError::Shape(format!(
                    "initial values of {}: expected {} elements, got {}",
                    spec.name,
                    spec.len,
                    v.len()
                )));
            }
            check_finite(&format!("the initial values of {}", spec.name), v)?;
        }
        let (mut taken, mut kept) = (0, 0);
        for (s, link) in self.inner.shards.iter().enumerate() {
            let mut chunks = Vec::with_capacity(link.chunks.len());
            let mut payload = Vec::new();
            for (id, _) in &link.chunks {
                let range = layout.chunk_range(*id).map_err(|e| ClientError::BadMap(e.to_string()))?;
                chunks.push(gaps_common::wire::InitChunk { id: *id, len: range.len() as u32 });
                payload.extend_from_slice(&values[id.tensor as usize][range]);
            }
            if chunks.is_empty() {
                continue;
            }
            let msg =
                Message::Initialize(gaps_common::wire::Initialize { epoch: self.inner.map.epoch, worker, chunks });
            let done = self
                .ask_with(s, &msg, &[net::f32_bytes(payload)], |m| match m {
                    Message::Initialized(done) => Some(done),
                    _ => None,
                })
                .await?;
            taken += done.taken;
            kept += done.kept;
        }
        Ok((taken, kept))
    }

    /// One page of `table`'s rows as shard `s` stores them, from `cursor` (0 first): (ids, `ids × dim`
    /// values, the next page's cursor or None after the last). An export walks every shard's pages.
    pub async fn table_page(
        &self,
        s: usize,
        table: u32,
        cursor: u64,
        max_rows: u32,
    ) -> Result<(Vec<u64>, Vec<f32>, Option<u64>), ClientError> {
        let dim = self.table_dim(table)?;
        if s >= self.inner.shards.len() {
            return Err(ClientError::Shape(format!("no shard {s} ({} shards)", self.inner.shards.len())));
        }
        let msg =
            Message::TableScan(gaps_common::wire::TableScan { epoch: self.inner.map.epoch, table, cursor, max_rows });
        let (frame, _) = self.request(s, &msg, &[]).await?;
        let addr = self.inner.shards[s].addr().to_string();
        let Message::TableRows(rows) = frame.msg else {
            return Err(RpcError::Unexpected { addr, kind: net::kind_name(&frame.msg).into() }.into());
        };
        let n = rows.count as usize;
        if rows.dim as usize != dim || frame.payload.len() != n * (2 + dim) {
            return Err(RpcError::BadReply {
                addr,
                message: format!("a page of {n} rows of {dim} floats was expected"),
            }
            .into());
        }
        let ids = gaps_common::wire::words_to_ids(&frame.payload[..2 * n]);
        Ok((ids, frame.payload[2 * n..].to_vec(), rows.next))
    }

    /// Loads rows into `table` (an import): `values` holds `ids × dim` floats; each id goes to the shard that
    /// owns it, in pages. A row a shard holds already keeps its values. Returns (rows created, rows kept).
    pub async fn load_rows(&self, table: u32, ids: &[u64], values: &[f32]) -> Result<(u32, u32), ClientError> {
        let worker = self.worker_for("load rows")?;
        let dim = self.table_dim(table)?;
        if values.len() != ids.len() * dim {
            return Err(ClientError::Shape(format!(
                "{} ids need {} values, got {}",
                ids.len(),
                ids.len() * dim,
                values.len()
            )));
        }
        check_finite("the rows loaded", values)?;
        let mut distinct = std::collections::HashSet::with_capacity(ids.len());
        if let Some(id) = ids.iter().find(|id| !distinct.insert(**id)) {
            return Err(ClientError::Shape(format!("id {id} appears twice in the rows loaded")));
        }
        let (mut created, mut kept) = (0, 0);
        for (s, positions) in self.by_shard(table, ids).iter().enumerate() {
            for page in positions.chunks(gaps_common::wire::MAX_TABLE_PAGE as usize) {
                let mut payload = Vec::with_capacity(page.len() * (2 + dim));
                ids_to_words(&page.iter().map(|k| ids[*k]).collect::<Vec<_>>(), &mut payload);
                for k in page {
                    payload.extend_from_slice(&values[k * dim..(k + 1) * dim]);
                }
                let msg = Message::TableLoad(gaps_common::wire::TableLoad {
                    epoch: self.inner.map.epoch,
                    worker,
                    table,
                    count: page.len() as u32,
                    dim: dim as u32,
                });
                let done = self
                    .ask_with(s, &msg, &[net::f32_bytes(payload)], |m| match m {
                        Message::TableLoaded(done) => Some(done),
                        _ => None,
                    })
                    .await?;
                created += done.created;
                kept += done.kept;
            }
        }
        Ok((created, kept))
    }

    /// Asks the coordinator for a cluster checkpoint (every shard at the same synchronous step, or at its
    /// next quiescent point); returns its id and each shard's (shard, path, step), index order.
    pub async fn checkpoint(&self) -> Result<CheckpointDone, ClientError> {
        let request = Message::CheckpointRequest(CheckpointRequest { id: 0, at: CheckpointAt::Quiescent });
        self.ask(0, &request, |m| match m {
            Message::CheckpointDone(done) => Some(done),
            _ => None,
        })
        .await
    }

    /// Time this client spent after its pushes waiting for a synchronous step to complete (or for the
    /// slowest worker, under bounded staleness), in all.
    pub fn waited(&self) -> Duration {
        Duration::from_micros(self.inner.waited_us.load(Ordering::Relaxed))
    }

    /// Tags the next dense pushes with the dealt split their samples came from (None: untagged). Every
    /// shard counts the samples per grant ([`Client::data_status`]).
    pub fn set_data_tag(&self, tag: Option<gaps_common::wire::DataTag>) {
        if let Ok(mut t) = self.inner.data_tag.lock() {
            *t = tag;
        }
    }

    /// Asks the coordinator's dealer for this worker's next split of the training data, reporting the grant
    /// `finished` (every batch of it pushed and acknowledged). A split it holds otherwise is given back.
    pub async fn next_split(&self, finished: Option<u64>) -> Result<gaps_common::wire::SplitGrant, ClientError> {
        let worker = self.inner.map.worker_id.ok_or_else(|| {
            ClientError::BadMap("this client has no worker id (an observer); only a worker is dealt data".into())
        })?;
        let request =
            Message::SplitRequest(gaps_common::wire::SplitRequest { epoch: self.inner.map.epoch, worker, finished });
        self.ask(0, &request, |m| match m {
            Message::SplitGrant(grant) => Some(grant),
            _ => None,
        })
        .await
    }

    /// [`Self::next_split`], but while nothing is left to deal and splits are still on loan to others, in
    /// async (where a worker that pushes nothing holds nobody up, and counts in no step) it asks again —
    /// after 100 ms, then backing off to 1 s — rather than answering "done": a split given back when its
    /// holder dies (its lease expires) is then trained by someone. It gives up, done, once nothing changed
    /// at the dealer (splits finished, loans) for three leases: a holder that keeps its lease but never
    /// finishes cannot keep everyone waiting. In sync, gba and ssp waiting would hold the others' steps or
    /// count in them: the worker is done at once, and such a split stays undealt (`splits_pending`).
    pub async fn next_split_waiting(
        &self,
        finished: Option<u64>,
    ) -> Result<gaps_common::wire::SplitGrant, ClientError> {
        let mut grant = self.next_split(finished).await?;
        let mut accepted = grant.finished_accepted;
        let patience = Duration::from_millis(3 * u64::from(self.inner.map.lease_ms));
        let (mut pause, mut seen, mut since) = (Duration::from_millis(100), None, Instant::now());
        while grant.split.is_none() && self.idle_holds_nobody() {
            let Some(dealer) = self.dealer_unfinished().await? else { break };
            let now = Some((dealer.splits_done, dealer.leased.iter().map(|l| l.grant).collect::<Vec<_>>()));
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() > patience {
                warn!("nothing changed at the dealer for three leases while others hold splits: done");
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            grant = self.next_split(None).await?;
            accepted |= grant.finished_accepted;
        }
        Ok(gaps_common::wire::SplitGrant { finished_accepted: accepted, ..grant })
    }

    /// True while the cluster runs async (mode code 0): a worker that pushes nothing for a while holds
    /// nobody up and counts in no step.
    pub fn idle_holds_nobody(&self) -> bool {
        self.inner.decisions().is_some_and(|d| d.latest.mode == 0)
    }

    /// The coordinator's dealer when it has splits left to finish (on loan to a worker, or to deal again
    /// should its holder die) though it dealt this worker none; None when every split is finished.
    pub async fn dealer_unfinished(&self) -> Result<Option<gaps_common::wire::DealerStatus>, ClientError> {
        // No grant is above u64::MAX: the page holds the dealer's state alone.
        let request = Message::DataStatusRequest(gaps_common::wire::DataStatusRequest { after_grant: u64::MAX });
        let page = self
            .ask(0, &request, |m| match m {
                Message::DataStatus(page) => Some(page),
                _ => None,
            })
            .await?;
        Ok(page.dealer.filter(|d| !d.finished))
    }

    /// Every shard's per-grant sample counts and the coordinator's dealer state (every page), index order.
    pub async fn data_status(&self) -> Result<Vec<gaps_common::wire::DataStatus>, ClientError> {
        let mut out = Vec::with_capacity(self.inner.shards.len());
        for s in 0..self.inner.shards.len() {
            let mut after = 0;
            let mut whole: Option<gaps_common::wire::DataStatus> = None;
            loop {
                let request = Message::DataStatusRequest(gaps_common::wire::DataStatusRequest { after_grant: after });
                let page = self
                    .ask(s, &request, |m| match m {
                        Message::DataStatus(page) => Some(page),
                        _ => None,
                    })
                    .await?;
                let next = page.next_after;
                match whole.as_mut() {
                    None => whole = Some(page),
                    Some(w) => {
                        w.counts.extend(page.counts);
                        if let (Some(d), Some(p)) = (w.dealer.as_mut(), page.dealer) {
                            d.completed.extend(p.completed);
                            d.abandoned.extend(p.abandoned);
                        }
                    }
                }
                match next {
                    Some(n) if n > after => after = n,
                    _ => break,
                }
            }
            out.extend(whole);
        }
        Ok(out)
    }

    /// Counters of every shard, index order.
    pub async fn stats(&self) -> Result<Vec<Stats>, ClientError> {
        self.ask_each(&Message::StatsRequest(StatsRequest), |m| match m {
            Message::Stats(st) => Some(st),
            _ => None,
        })
        .await
    }

    /// Renews this worker's lease with every shard (each keeps its own view of who is live).
    pub async fn heartbeat(&self) -> Result<(), ClientError> {
        let Some(worker) = self.inner.map.worker_id else { return Ok(()) };
        for s in 0..self.inner.shards.len() {
            self.request(s, &Message::Heartbeat(Heartbeat { worker }), &[]).await?;
        }
        Ok(())
    }

    /// Sends heartbeats every `interval` until the returned handle is aborted or dropped with the runtime.
    pub fn spawn_heartbeats(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let client = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                if let Err(e) = client.heartbeat().await {
                    warn!(error = %e, "heartbeat failed");
                }
            }
        })
    }

    /// Leaves the job (every shard drops the lease at once) and closes every connection.
    pub async fn leave(&self) -> Result<(), ClientError> {
        if let Some(worker) = self.inner.map.worker_id {
            for s in 0..self.inner.shards.len() {
                self.request(s, &Message::Leave(Leave { worker }), &[]).await?;
            }
        }
        self.close().await;
        Ok(())
    }

    /// Closes every connection and waits (briefly) for the peers to learn of it.
    pub async fn close(&self) {
        for slot in self.inner.shards.iter().flat_map(|link| &link.conns) {
            if let Ok(mut guard) = slot.lock() {
                if let Some(conn) = guard.take() {
                    conn.close(0u32.into(), b"done");
                }
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.inner.endpoint.wait_idle()).await;
    }

    /// Index of each shard, for logs.
    pub fn shard_addrs(&self) -> Vec<(u32, SocketAddr)> {
        self.inner.shards.iter().map(|s| (s.index, s.addr())).collect()
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
}
