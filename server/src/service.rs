//! The QUIC service around [`ShardCore`]: accepts mutually authenticated connections, serves one RPC per
//! bidirectional stream, joins the coordinator (shards ≥ 1), expires leases on a timer, exports metrics, and
//! shuts down gracefully (refuse new connections, finish in-flight RPCs, close).
//!
//! Architecture invariant: the service holds no training state of its own; everything lives in the core,
//! which is locked only around `handle`/`tick` (never across an `.await`).

use crate::metrics::ShardMetrics;
use anyhow::{anyhow, bail, Context, Result};
use gaps_common::wire::{ErrorCode, Frame, Limits, Message, WireError};
use gaps_shard::{CoreEvent, ShardConfig, ShardCore};
use gaps_transport::net::{self, RpcError};
use gaps_transport::tls::TlsMaterial;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
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
}

struct Shared {
    core: Mutex<ShardCore>,
    metrics: ShardMetrics,
    limits: Limits,
    started: Instant,
    shard: u32,
}

impl Shared {
    fn now(&self) -> Duration {
        self.started.elapsed()
    }
}

/// A running shard.
#[derive(Debug)]
pub struct RunningServer {
    /// The bound UDP address.
    pub addr: SocketAddr,
    /// The address given to clients.
    pub advertise: String,
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
    /// Runs `f` with the core locked (never across an await).
    pub fn with_core<T>(&self, f: impl FnOnce(&ShardCore) -> T) -> Result<T> {
        let core = self.shared.core.lock().map_err(|_| anyhow!("shard core lock poisoned"))?;
        Ok(f(&core))
    }

    /// Stops accepting, lets in-flight RPCs finish (up to a few seconds), closes the endpoint.
    pub async fn shutdown(self) -> Result<()> {
        let _ = self.shutdown.send(true);
        self.task.await.context("joining the server task")
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
    let mut core = ShardCore::new(cfg.core.clone()).map_err(|e| anyhow!("configuring shard {shard}: {e}"))?;
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
    let shared = Arc::new(Shared {
        core: Mutex::new(core),
        metrics: ShardMetrics::register(shard),
        limits,
        started: Instant::now(),
        shard,
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let task = tokio::spawn(
        serve(endpoint, shared.clone(), shutdown_rx, cfg.tick_interval).instrument(tracing::info_span!("shard", shard)),
    );
    info!(shard, %addr, %advertise, "serving");
    Ok(RunningServer { addr, advertise, shutdown: shutdown_tx, task, shared })
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
                let (events, stats) = {
                    let Ok(mut core) = shared.core.lock() else { return };
                    let events = core.tick(shared.now());
                    (events, core.stats())
                };
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
    let request = match net::read_frame(&mut recv, &shared.limits).await {
        Ok(frame) => net::expect_end(&mut recv).await.map(|()| frame),
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
            let handled = shared.core.lock().map(|mut core| core.handle(frame, shared.now()));
            let Ok((reply, events)) = handled else {
                let _ = send.reset(1u32.into());
                return;
            };
            log_events(&events);
            record(&shared.metrics, kind, &reply.msg);
            (reply, histogram)
        }
    };
    match net::write_frame(&mut send, &reply.msg, &[&reply.payload]).await {
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
