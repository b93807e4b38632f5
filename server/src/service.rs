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

/// What the QUIC tasks ask of the core's thread.
enum Command {
    /// Handle one request frame (`finite`: its payload holds no NaN or ±∞, checked as it was read).
    Handle { frame: Box<Frame>, finite: bool, reply: oneshot::Sender<Answer> },
    /// Expire leases and idle rows; report the counters.
    Tick { reply: oneshot::Sender<(Vec<CoreEvent>, Stats)> },
    /// Read the core (tests, reports).
    Inspect(Box<dyn FnOnce(&ShardCore) + Send>),
    /// Change the core between two requests (a rollback replaces it); a checkpoint waiting for a point is
    /// given up, since the core it waited on is gone.
    Replace(Box<dyn FnOnce(&mut ShardCore) + Send>),
    /// Snapshot the core as checkpoint `id` into `buf` once it reaches `at`; the reply carries the snapshot,
    /// or the step the core had already passed. Dropping the reply's receiver gives it up.
    Checkpoint(PendingSnapshot),
    /// Snapshot the core for backup process `backup` (replicated shards): the log index it holds, and its
    /// bytes. The backup follows the log from that index on.
    ReplicaSnapshot { backup: u32, reply: oneshot::Sender<Result<(u64, Vec<u8>), String>> },
    /// A held request's time may be up (sent by a timer set when it was held).
    Wake,
}

/// The core's answer to one request: the reply, what changed, the parameter buffers the reply shares
/// instead of a payload (`ShardCore::set_shared_replies`), and the request's entry in the replica log (0:
/// none; the reply goes once every live backup applied it).
type Answer = (Frame, Vec<CoreEvent>, Vec<Arc<Vec<f32>>>, u64);

/// Parameters a reply shares with the core, as the bytes of one payload part.
struct SharedParams(Arc<Vec<f32>>);

impl AsRef<[f32]> for SharedParams {
    fn as_ref(&self) -> &[f32] {
        &self.0
    }
}

/// A checkpoint the core takes when it reaches the point asked for.
struct PendingSnapshot {
    id: u64,
    at: CheckpointAt,
    buf: Vec<u8>,
    reply: oneshot::Sender<Result<Snapshot, NoSnapshot>>,
}

/// The core's state, copied for a checkpoint.
struct Snapshot {
    bytes: Vec<u8>,
    /// How long the core paused to copy it.
    pause: Duration,
    /// Synchronous/GBA steps applied when it was copied.
    step: u64,
}

/// Why the core took no snapshot.
#[derive(Debug)]
enum NoSnapshot {
    /// It is past the step asked for (it has applied this many).
    TooLate(u64),
    /// The device holding the dense state could not be read.
    Failed(String),
}

/// Takes `p` if the core is at its point; keeps it for later if not yet; answers it if never.
fn try_snapshot(
    core: &ShardCore,
    p: PendingSnapshot,
    record: &mut Option<crate::record::Recorder>,
) -> Option<PendingSnapshot> {
    if p.reply.is_closed() {
        return None;
    }
    match core.checkpoint_readiness(p.at) {
        Readiness::Later => Some(p),
        Readiness::Never(step) => {
            let _ = p.reply.send(Err(NoSnapshot::TooLate(step)));
            None
        }
        Readiness::Ready => {
            let started = Instant::now();
            let taken = match core.checkpoint_into(p.id, p.buf) {
                Ok(bytes) => {
                    if let Some(r) = record {
                        r.item(&crate::record::Item::Checkpoint { id: p.id });
                    }
                    Ok(Snapshot { bytes, pause: started.elapsed(), step: core.global_step() })
                }
                Err(e) => Err(NoSnapshot::Failed(e.to_string())),
            };
            let _ = p.reply.send(taken);
            None
        }
    }
}

/// Where the core's thread writes what it handled besides its replies.
struct Sinks {
    /// The dealer's journal (the coordinator, async).
    journal: Option<std::fs::File>,
    /// The replica log its backups follow.
    log: Option<Arc<Log>>,
    /// The request record (`--record-requests`).
    record: Option<crate::record::Recorder>,
}

/// Runs the core on the calling thread until every sender of `queue` is gone. A checkpoint waiting for its
/// step is checked after every command, so it is taken right after the request that completed the step,
/// before any other is handled.
///
/// The parts of a push striped over several connections are held here until the push is whole, then handled
/// as one request and every part answered with its reply; incomplete pushes are given up after `part_wait`.
fn run_actor(
    mut core: ShardCore,
    mut queue: mpsc::Receiver<Command>,
    started: Instant,
    part_wait: Duration,
    sinks: Sinks,
    mut wake: Alarm,
) {
    let Sinks { mut journal, log, mut record } = sinks;
    // A request that cannot be logged for the backups is refused, unhandled.
    let log_request = |now: Duration, frame: &Frame| {
        log.as_ref()
            .map_or(Ok(0), |l| l.request(now, frame))
            .map_err(|(code, msg)| Box::new(Frame::new(Message::error(code, msg))))
    };
    // A part's reply and whether its payload was found finite as it was read.
    type Reply = (oneshot::Sender<Answer>, bool);
    let mut pending: Option<PendingSnapshot> = None;
    let mut parts: Assembler<Reply> = Assembler::default();
    let mut parked: Vec<ParkedWait> = Vec::new();
    while let Some(command) = queue.blocking_recv() {
        match command {
            Command::Handle { frame, finite, reply } => match frame.msg {
                Message::PushPart(part) if !core.push_applied(part.push.worker, part.push.seq) => {
                    let offered = parts.offer(part, frame.payload, (reply, finite), started.elapsed());
                    for ((reply, _), frame) in offered.answer_now {
                        let _ = reply.send((frame, Vec::new(), Vec::new(), 0));
                    }
                    if let Some((whole, replies)) = offered.whole {
                        let finite = replies.iter().all(|(_, f)| *f);
                        let now = started.elapsed();
                        let index = match log_request(now, &whole) {
                            Ok(index) => index,
                            Err(refusal) => {
                                for (reply, _) in replies {
                                    let _ = reply.send((*refusal.clone(), Vec::new(), Vec::new(), 0));
                                }
                                continue;
                            }
                        };
                        if let Some(r) = &mut record {
                            r.request(index, now, &whole);
                        }
                        let (answer, mut events) = core.handle_checked(whole, now, finite);
                        for (reply, _) in replies {
                            let _ = reply.send((answer.clone(), std::mem::take(&mut events), Vec::new(), index));
                        }
                    }
                }
                // A wait for a step not reached yet is held here (not in the core, which never blocks) until the
                // step comes or its time is up, instead of the worker polling.
                Message::WaitStep(wait)
                    if wait.max_wait_ms > 0 && !core.wait_satisfied(&wait) && parked.len() < MAX_PARKED_WAITS =>
                {
                    let ms = wait.max_wait_ms.min(gaps_common::wire::MAX_WAIT_STEP_MS);
                    parked.push((
                        HeldRequest::Wait(wait),
                        started.elapsed() + Duration::from_millis(u64::from(ms)),
                        reply,
                    ));
                }
                // A part of a push applied before is answered by the core, as a duplicate.
                msg => {
                    let pull = match &msg {
                        Message::PushPull(p) => Some(gaps_common::wire::Pull {
                            epoch: p.epoch,
                            chunks: p.chunks.iter().map(|c| c.id).collect(),
                        }),
                        _ => None,
                    };
                    let frame = Frame { msg, payload: frame.payload };
                    let now = started.elapsed();
                    let index = match log_request(now, &frame) {
                        Ok(index) => index,
                        Err(refusal) => {
                            let _ = reply.send((*refusal, Vec::new(), Vec::new(), 0));
                            continue;
                        }
                    };
                    if let Some(r) = &mut record {
                        r.request(index, now, &frame);
                    }
                    let (mut answer, events) = core.handle_checked(frame, now, finite);
                    // The replica log's lag is the process's, not the core's (a backup's core knows none).
                    if let (Some(log), Message::Stats(stats)) = (&log, &mut answer.msg) {
                        (stats.replica_lag_entries, stats.replica_lag_peak) = log.lag();
                    }
                    // A split dealt or reported finished is journaled before the worker hears of it.
                    journal_changes(&mut core, &mut journal);
                    let gba_hold = pull.as_ref().and(core.take_gba_hold());
                    match (pull, &answer.msg) {
                        // A GBA push-pull held for its step (see `gaps_shard`'s `hold`): answered with the
                        // values once the step is applied or the hold's short time is up, whichever is first.
                        (Some(pull), Message::PushPullReply(PushPullReply { ack, chunks }))
                            if chunks.is_empty() && gba_hold.is_some() && parked.len() < MAX_PARKED_WAITS =>
                        {
                            let until = gba_hold.unwrap_or(now);
                            let ack = gaps_common::wire::Ack { wait_for_step: core.global_step() + 1, ..*ack };
                            let held = HeldRequest::PushPull { ack, pull, events, index, soft: true };
                            parked.push((held, until, reply));
                        }
                        // A push-pull whose ack asks the worker to wait for the step: held until the step is
                        // applied, then answered with the new values (no wait request, no pull after it).
                        (Some(pull), Message::PushPullReply(PushPullReply { ack, chunks }))
                            if chunks.is_empty()
                                && (ack.wait_for_step > 0 || ack.wait_for_clock > 0)
                                && parked.len() < MAX_PARKED_WAITS =>
                        {
                            let held = HeldRequest::PushPull { ack: *ack, pull, events, index, soft: false };
                            parked.push((held, started.elapsed() + HOLD_PUSH_PULL, reply));
                        }
                        _ => {
                            let _ = reply.send((answer, events, core.take_reply_views(), index));
                        }
                    }
                }
            },
            Command::Wake => wake.rang(started.elapsed()),
            Command::Tick { reply } => {
                for ((reply, _), frame) in parts.expire(started.elapsed(), part_wait) {
                    let _ = reply.send((frame, Vec::new(), Vec::new(), 0));
                }
                let now = started.elapsed();
                let index = log.as_ref().map_or(0, |log| log.tick(now));
                if let Some(r) = &mut record {
                    r.tick(index, now);
                }
                let events = core.tick(now);
                let _ = reply.send((events, core.stats()));
            }
            Command::Inspect(f) => f(&core),
            Command::Replace(f) => {
                f(&mut core);
                pending = None;
                if let Some(r) = &mut record {
                    r.item(&crate::record::Item::Replaced);
                }
                // The backups' copies do not continue the replaced core: each copies a new snapshot.
                if let Some(log) = &log {
                    log.reset();
                }
            }
            Command::Checkpoint(p) => pending = Some(p),
            Command::ReplicaSnapshot { backup, reply } => {
                let taken = match &log {
                    Some(log) => core.copy_state().map(|bytes| (log.follow(backup), bytes)).map_err(|e| e.to_string()),
                    None => Err("this shard keeps no replica log".into()),
                };
                if let (Some(r), Ok((index, _))) = (&mut record, &taken) {
                    r.item(&crate::record::Item::Followed { backup, index: *index });
                }
                let _ = reply.send(taken);
            }
        }
        // The dealer's changes are journaled before a checkpoint can be taken after them.
        journal_changes(&mut core, &mut journal);
        if let Some(p) = pending.take() {
            pending = try_snapshot(&core, p, &mut record);
        }
        if !parked.is_empty() {
            release_waits(&mut core, &mut parked, started.elapsed());
            wake.arm(&parked, started.elapsed());
        }
    }
}

/// Wakes the core's thread at the earliest deadline of the held GBA push-pulls (the thread blocks on its
/// queue between requests; ticks come every 250 ms, a hold lasts milliseconds). One timer is armed at a
/// time, for the earliest deadline; a later hold arms nothing while an earlier timer is pending.
struct Alarm {
    runtime: tokio::runtime::Handle,
    queue: mpsc::WeakSender<Command>,
    /// When the armed timer rings, if one is.
    armed: Option<Duration>,
}

impl Alarm {
    /// Arms the timer for the earliest deadline of the soft holds in `parked`, unless one rings by then.
    fn arm(&mut self, parked: &[ParkedWait], now: Duration) {
        let earliest = parked
            .iter()
            .filter(|(held, _, _)| matches!(held, HeldRequest::PushPull { soft: true, .. }))
            .map(|(_, until, _)| *until)
            .min();
        let Some(at) = earliest else { return };
        if self.armed.is_some_and(|armed| armed <= at) {
            return;
        }
        self.armed = Some(at);
        let (queue, after) = (self.queue.clone(), at.saturating_sub(now));
        self.runtime.spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(queue) = queue.upgrade() {
                let _ = queue.send(Command::Wake).await;
            }
        });
    }

    /// A [`Command::Wake`] came at `now`: the timer armed for then or before has rung.
    fn rang(&mut self, now: Duration) {
        if self.armed.is_some_and(|armed| armed <= now + Duration::from_millis(1)) {
            self.armed = None;
        }
    }
}

/// Appends the dealer's changes since the last call to the coordinator's journal (async); a journal that
/// cannot be written is given up, said once.
fn journal_changes(core: &mut ShardCore, journal: &mut Option<std::fs::File>) {
    let Some(file) = journal.as_mut() else { return };
    let changes = core.take_dealer_journal();
    if changes.is_empty() {
        return;
    }
    if let Err(e) = crate::journal::append(file, &changes) {
        error!(%e, "writing the dealer journal failed; a restore will deal again the splits finished since its checkpoint");
        core.stop_dealer_journal();
        *journal = None;
    }
}

/// Most [`Message::WaitStep`] requests a shard holds at once (one per worker is the norm); more are
/// answered at once.
const MAX_PARKED_WAITS: usize = 8192;

/// How long a push-pull whose step is not complete is held for the step's values before it is answered
/// with its ack alone (the worker then waits with [`Message::WaitStep`] and pulls).
const HOLD_PUSH_PULL: Duration = Duration::from_secs(1);

/// What a held request waits for.
enum HeldRequest {
    /// A [`Message::WaitStep`]: answered with the shard's stats.
    Wait(gaps_common::wire::WaitStep),
    /// A push-pull applied into a step not yet complete: answered with `ack` and the values `pull` reads once
    /// the step is applied (with the events of the push). `soft` (GBA's hold): when the time is up first,
    /// answered with the values read then, and the worker goes on; otherwise with the ack alone, and the
    /// worker waits for the step itself.
    PushPull {
        ack: gaps_common::wire::Ack,
        pull: gaps_common::wire::Pull,
        events: Vec<CoreEvent>,
        index: u64,
        soft: bool,
    },
}

/// A held request: what it waits for, until when, and where its answer goes.
type ParkedWait = (HeldRequest, Duration, oneshot::Sender<Answer>);

/// Answers the held requests whose step came, and those whose time is up at `now`.
fn release_waits(core: &mut ShardCore, parked: &mut Vec<ParkedWait>, now: Duration) {
    let satisfied = |core: &ShardCore, held: &HeldRequest| match held {
        HeldRequest::Wait(wait) => core.wait_satisfied(wait),
        HeldRequest::PushPull { ack, .. } => core.wait_satisfied(&gaps_common::wire::WaitStep {
            step: ack.wait_for_step,
            clock: ack.wait_for_clock,
            max_wait_ms: 0,
        }),
    };
    if !parked.iter().any(|(held, until, _)| satisfied(core, held) || now >= *until) {
        return;
    }
    let mut stats = None;
    for (held, until, reply) in std::mem::take(parked) {
        let ready = satisfied(core, &held);
        if !(ready || now >= until) {
            parked.push((held, until, reply));
            continue;
        }
        let answer = match held {
            HeldRequest::Wait(_) => {
                let stats = stats.get_or_insert_with(|| Frame::new(Message::Stats(core.stats())));
                (stats.clone(), Vec::new(), Vec::new(), 0)
            }
            HeldRequest::PushPull { ack, pull, events, index, soft } => {
                let go_on = gaps_common::wire::Ack { wait_for_step: 0, wait_for_clock: 0, ..ack };
                // A hold's ack asks for no wait: the worker goes on with what it reads.
                let ack = if soft { go_on } else { ack };
                let alone = Frame::new(Message::PushPullReply(PushPullReply { ack, chunks: Vec::new() }));
                if !(ready || soft) {
                    (alone, events, Vec::new(), index)
                } else {
                    match core.handle(Frame::new(Message::Pull(pull)), now).0 {
                        Frame { msg: Message::PullReply(PullReply { chunks }), payload } => {
                            let msg = Message::PushPullReply(PushPullReply { ack: go_on, chunks });
                            (Frame { msg, payload }, events, core.take_reply_views(), index)
                        }
                        // The read failed: the ack alone, and the worker pulls on its own.
                        _ => (alone, events, Vec::new(), index),
                    }
                }
            }
        };
        let _ = reply.send(answer);
    }
}

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

/// How long a checkpoint may wait for the step it was asked for.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(20);

/// Why a shard wrote no checkpoint.
#[derive(Debug, thiserror::Error)]
enum CheckpointFailure {
    /// It had already applied this many steps, past the one asked for (or no live worker could reach it).
    #[error("this shard had applied {0} steps and cannot take a checkpoint at the step asked for")]
    TooLate(u64),
    /// Anything else.
    #[error("{0:#}")]
    Other(#[from] anyhow::Error),
}

/// A checkpoint this shard wrote.
#[derive(Debug)]
struct Written {
    id: u64,
    path: std::path::PathBuf,
    step: u64,
}

/// A fresh checkpoint id: the time in milliseconds since the Unix epoch, made strictly increasing. Ids from
/// different shards (a shard's own final checkpoint, the coordinator's cluster ones) sort by time.
fn next_id(shared: &Shared) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    shared.next_checkpoint.fetch_max(now, Ordering::Relaxed);
    shared.next_checkpoint.fetch_add(1, Ordering::Relaxed)
}

/// Answers a checkpoint request: on the coordinator with id 0 a cluster checkpoint, otherwise this shard's.
async fn checkpoint_reply(shared: &Shared, req: CheckpointRequest) -> Frame {
    let done = if req.id == 0 && shared.shard == 0 {
        cluster_checkpoint(shared).await.map_err(CheckpointFailure::Other)
    } else {
        take_checkpoint(shared, (req.id != 0).then_some(req.id), req.at).await.map(|w| CheckpointDone {
            id: w.id,
            shards: vec![ShardCheckpoint { shard: shared.shard, path: w.path.display().to_string(), step: w.step }],
        })
    };
    Frame::new(match done {
        Ok(done) => Message::CheckpointDone(done),
        Err(e @ CheckpointFailure::TooLate(_)) => Message::error(ErrorCode::TooLate, e.to_string()),
        Err(e) => Message::error(ErrorCode::Misconfigured, e.to_string()),
    })
}

/// Snapshots the core when it reaches `at` (it pauses for the copy only) and writes the checkpoint on a
/// blocking thread. `id` None picks a fresh one.
async fn take_checkpoint(shared: &Shared, id: Option<u64>, at: CheckpointAt) -> Result<Written, CheckpointFailure> {
    let Some(store) = shared.store.clone() else { return Err(anyhow!("this shard has no --checkpoint-dir").into()) };
    // An id given by the coordinator names the same checkpoint on every shard (a cluster checkpoint).
    let chosen_by_coordinator = id.is_some();
    let id = match id {
        Some(id) => {
            shared.next_checkpoint.fetch_max(id + 1, Ordering::Relaxed);
            id
        }
        None => next_id(shared),
    };
    let (tx, rx) = oneshot::channel();
    // The lock is held only to take the spare buffer and, below, while writing: waiting for the step (up to
    // CHECKPOINT_WAIT) holds nothing that the next scheduled checkpoint needs.
    let buf = match shared.checkpoint_lock.try_lock() {
        Ok(mut spare) => std::mem::take(&mut *spare),
        Err(_) => Vec::new(),
    };
    shared.send(Command::Checkpoint(PendingSnapshot { id, at, buf, reply: tx })).await?;
    let snapshot = tokio::select! {
        got = tokio::time::timeout(CHECKPOINT_WAIT, rx) => match got {
            Err(_) => return Err(anyhow!("checkpoint {id}: this shard did not reach {at:?} within {CHECKPOINT_WAIT:?}").into()),
            Ok(Err(_)) => return Err(anyhow!("shard core thread stopped").into()),
            Ok(Ok(Err(NoSnapshot::TooLate(step)))) => return Err(CheckpointFailure::TooLate(step)),
            Ok(Ok(Err(NoSnapshot::Failed(why)))) => return Err(anyhow!("checkpoint {id}: reading the state: {why}").into()),
            Ok(Ok(Ok(snapshot))) => snapshot,
        },
        _ = shared.stopping.notified() => return Err(anyhow!("checkpoint {id}: the shard is shutting down").into()),
    };
    let Snapshot { bytes, pause, step } = snapshot;
    let at_step = match at {
        CheckpointAt::Step(n) => Some(n),
        _ => None,
    };
    let info = ShardCore::checkpoint_info(&bytes).map_err(|e| anyhow!("reading back checkpoint {id}: {e}"))?;
    let mut spare = shared.checkpoint_lock.lock().await;
    let started = Instant::now();
    let size = bytes.len();
    let cluster = chosen_by_coordinator;
    let (written, bytes) =
        tokio::task::spawn_blocking(move || (store.write(&info, step, at_step, cluster, &bytes), bytes))
            .await
            .context("writing a checkpoint")?;
    *spare = bytes;
    let path = written?;
    shared.checkpoints_written.fetch_add(1, Ordering::Relaxed);
    shared.last_checkpoint_ms.store(shared.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    info!(
        shard = shared.shard,
        checkpoint = id,
        step,
        bytes = size,
        pause_ms = pause.as_secs_f64() * 1e3,
        write_ms = started.elapsed().as_secs_f64() * 1e3,
        "checkpoint written"
    );
    Ok(Written { id, path, step })
}

/// Asks shard `peer` for checkpoint `id` at `at`.
async fn peer_checkpoint(
    endpoint: quinn::Endpoint,
    config: Option<quinn::ClientConfig>,
    cluster: String,
    peer: gaps_shard::PeerShard,
    id: u64,
    at: CheckpointAt,
) -> Result<ShardCheckpoint, CheckpointFailure> {
    let (index, addr) = (peer.index, peer.addr.as_str());
    let fail = |e: RpcError| CheckpointFailure::Other(anyhow!("shard {index} at {addr}: {e}"));
    let conn = net::connect_with(&endpoint, config, net::resolve(addr).await.map_err(fail)?, Duration::from_secs(5))
        .await
        .map_err(fail)?;
    net::expect_shard(&conn, &cluster, peer.process).map_err(fail)?;
    let request = Message::CheckpointRequest(CheckpointRequest { id, at });
    let reply = net::call(&conn, &request, &[], &Limits::default(), CHECKPOINT_WAIT + Duration::from_secs(10)).await;
    conn.close(0u32.into(), b"checkpoint");
    match reply {
        Ok(Frame { msg: Message::CheckpointDone(mut done), .. }) if done.shards.len() == 1 => Ok(done.shards.remove(0)),
        Ok(other) => Err(anyhow!("shard {index} answered with {}", net::kind_name(&other.msg)).into()),
        Err(RpcError::Remote { code: ErrorCode::TooLate, .. }) => Err(CheckpointFailure::TooLate(0)),
        Err(e) => Err(fail(e)),
    }
}

/// Answers a [`Rollback`]: lists this shard's checkpoints, restores one in place, or (on the coordinator,
/// from a shard that restarted) returns the whole cluster to one checkpoint.
async fn rollback_reply(shared: &Shared, req: Rollback) -> Frame {
    let answer = match req.stage {
        RollbackStage::List => {
            own_checkpoints(shared, req.id).map(|held| RollbackReply { shard: shared.shard, held, step: 0 })
        }
        RollbackStage::Apply => apply_rollback(shared, req.id).await.map(|step| RollbackReply {
            shard: shared.shard,
            held: vec![req.id],
            step,
        }),
        RollbackStage::Restored if shared.shard == 0 => cluster_rollback(shared, req.id)
            .await
            .map(|(id, step)| RollbackReply { shard: shared.shard, held: vec![id], step }),
        RollbackStage::Restored => Err(anyhow!("only the coordinator (shard 0) rolls the cluster back")),
    };
    Frame::new(match answer {
        Ok(reply) => Message::RollbackReply(reply),
        Err(e) => Message::error(ErrorCode::Misconfigured, format!("{e:#}")),
    })
}

/// The intact checkpoints this shard holds, no newer than `max`, newest first.
fn own_checkpoints(shared: &Shared, max: u64) -> Result<Vec<u64>> {
    let store = shared.store.as_ref().context("this shard has no --checkpoint-dir")?;
    store.intact_ids(max, gaps_common::wire::MAX_ROLLBACK_IDS)
}

/// Restores checkpoint `id` of this shard in place: the training state goes back to it, the live workers
/// stay (`ShardCore::rolled_back`); the new core is made GPU-resident again where the shard runs on one.
/// Returns the step the shard is at afterwards.
async fn apply_rollback(shared: &Shared, id: u64) -> Result<u64> {
    let store = shared.store.clone().context("this shard has no --checkpoint-dir")?;
    let found = tokio::task::spawn_blocking(move || store.load(id)).await.context("reading a checkpoint")??;
    let gpu = gaps_kernels::cuda::CudaArenas::for_choice(shared.device).context("--device")?;
    let slots = shared.device_worker_slots;
    // The copies of shard 0 do not continue the state it goes back to: a majority must first choose a
    // configuration without them (its backups copy a snapshot afterwards and are proposed in again).
    if let (0, Some(quorum)) = (shared.shard, &shared.quorum) {
        let (tx, rx) = oneshot::channel();
        shared.send(Command::Inspect(Box::new(move |core| drop(tx.send(core.process_addrs()))))).await?;
        let peers: Vec<(u32, String)> =
            rx.await.context("the core stopped")?.into_iter().filter(|(p, _)| *p != quorum.process()).collect();
        let link = crate::replication::CoordinatorLink {
            coordinator: shared.advertise.clone(),
            cluster: shared.own.cluster.clone(),
            endpoint: shared.endpoint.clone(),
            rotated: shared.rotated.clone(),
        };
        match quorum.propose_in_sync(Vec::new(), shared.advertise.clone(), false, &peers, &link).await? {
            crate::quorum::InSync::Chosen => {}
            other => bail!("shard 0's backups could not be dropped before its rollback: {other:?}"),
        }
    }
    let (tx, rx) = oneshot::channel();
    shared
        .send(Command::Replace(Box::new(move |core: &mut ShardCore| {
            let result = core.rolled_back(&found.bytes).map_err(|e| anyhow!("{e}")).and_then(|mut back| {
                if let Some(gpu) = gpu {
                    back.make_resident(gpu, slots)
                        .map_err(|e| anyhow!("moving the rolled-back state to the GPU: {e}"))?;
                }
                let step = back.global_step();
                *core = back;
                Ok(step)
            });
            let _ = tx.send(result);
        })))
        .await?;
    let step = rx.await.map_err(|_| anyhow!("shard core thread stopped"))??;
    shared.rollbacks.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut last) = shared.last_rollback.lock() {
        *last = Some((id, step));
    }
    warn!(shard = shared.shard, checkpoint = id, step, "rolled back to a cluster checkpoint");
    Ok(step)
}

/// Asks shard `peer` (the coordinator's request) for one rollback stage.
async fn peer_rollback(shared: &Shared, peer: &gaps_shard::PeerShard, req: Rollback) -> Result<RollbackReply> {
    let (index, addr) = (peer.index, peer.addr.as_str());
    let config = shared.rotated.lock().ok().and_then(|c| c.clone());
    let target = net::resolve(addr).await.map_err(|e| anyhow!("shard {index} at {addr}: {e}"))?;
    let conn = net::connect_with(&shared.endpoint, config, target, Duration::from_secs(5))
        .await
        .map_err(|e| anyhow!("shard {index} at {addr}: {e}"))?;
    net::expect_shard(&conn, &shared.own.cluster, peer.process).map_err(|e| anyhow!("shard {index} at {addr}: {e}"))?;
    let reply = net::call(&conn, &Message::Rollback(req), &[], &Limits::default(), CHECKPOINT_WAIT).await;
    conn.close(0u32.into(), b"rollback");
    match reply {
        Ok(Frame { msg: Message::RollbackReply(r), .. }) => Ok(r),
        Ok(other) => bail!("shard {index} answered a rollback with {}", net::kind_name(&other.msg)),
        Err(e) => bail!("shard {index} at {addr}: {e}"),
    }
}

/// The coordinator returns the whole cluster to one checkpoint after shard restarts from `restored`: the
/// newest checkpoint no newer than it that every shard holds intact (a cluster checkpoint: the same id
/// everywhere). Every shard restores it in place, so all shards agree on the step and the parameters
/// again; what was applied after it anywhere is lost, and workers notice (a push read on newer versions
/// is refused as read-ahead; a wait for a step the shard went back from ends) and pull again.
async fn cluster_rollback(shared: &Shared, restored: u64) -> Result<(u64, u64)> {
    let _cluster = shared.cluster_lock.lock().await;
    let (tx, rx) = oneshot::channel();
    shared
        .send(Command::Inspect(Box::new(move |core| {
            let _ = tx.send((core.peer_shards(), core.config().num_shards));
        })))
        .await?;
    let (peers, num_shards) = rx.await.map_err(|_| anyhow!("shard core thread stopped"))?;
    if peers.len() + 1 < num_shards as usize {
        bail!("only {} of {num_shards} shards have joined: no cluster rollback yet", peers.len() + 1);
    }
    let ask = Rollback { id: restored, stage: RollbackStage::List };
    let mut common: std::collections::BTreeSet<u64> = own_checkpoints(shared, restored)?.into_iter().collect();
    for peer in &peers {
        let held = peer_rollback(shared, peer, ask).await?.held;
        common.retain(|id| held.contains(id));
    }
    let Some(&id) = common.last() else {
        bail!("no checkpoint no newer than {restored} is held by every shard: the cluster cannot go back to one")
    };
    let apply = Rollback { id, stage: RollbackStage::Apply };
    let mut steps = vec![(shared.shard, apply_rollback(shared, id).await?)];
    for peer in &peers {
        steps.push((peer.index, peer_rollback(shared, peer, apply).await?.step));
    }
    let step = steps[0].1;
    if steps.iter().any(|(_, s)| *s != step) {
        warn!(
            checkpoint = id,
            ?steps,
            "the shards' steps differ after the rollback (a checkpoint not taken at one step)"
        );
    }
    warn!(checkpoint = id, restored, step, shards = steps.len(), "the cluster rolled back to one checkpoint");
    Ok((id, step))
}

/// After this shard started from checkpoint `id`: in every mode but async, the cluster goes back to one
/// checkpoint that every shard holds. The coordinator runs it; another shard asks the coordinator. Tried
/// until it succeeds or the shard stops (the other shards may still be joining).
async fn roll_back_cluster_after_restore(shared: Arc<Shared>, id: u64, mut stop: watch::Receiver<bool>) {
    for attempt in 1u32.. {
        let result = if shared.shard == 0 {
            cluster_rollback(&shared, id).await
        } else {
            let coordinator =
                gaps_shard::PeerShard { index: 0, addr: shared.coordinator.clone().unwrap_or_default(), process: 0 };
            peer_rollback(&shared, &coordinator, Rollback { id, stage: RollbackStage::Restored })
                .await
                .and_then(|r| Ok((r.held.first().copied().context("an empty rollback reply")?, r.step)))
        };
        match result {
            Ok((back_to, step)) => {
                info!(shard = shared.shard, restored = id, checkpoint = back_to, step, "cluster rollback done");
                return;
            }
            Err(e) if attempt % 10 == 1 => {
                warn!(shard = shared.shard, attempt, error = format!("{e:#}"), "cluster rollback failed; trying again")
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// The coordinator's cluster checkpoint: one id, every shard at the same step (in `sync` and `gba`, the
/// step after next; a shard that is already past it makes the coordinator try again further ahead) or at
/// its next quiescent point (async modes, no live worker). Returns every shard's file; fails, naming
/// the shards, when one could not write it (the others' files stay: each is a complete checkpoint of its
/// shard).
async fn cluster_checkpoint(shared: &Shared) -> Result<CheckpointDone> {
    let _cluster = shared.cluster_lock.lock().await;
    let mut margin = 2;
    for _attempt in 0..4 {
        let (tx, rx) = oneshot::channel();
        shared
            .send(Command::Inspect(Box::new(move |core| {
                // GBA's steps are counted per shard, but every shard sums the same workers' gradients, so
                // each reaches step N: a checkpoint at one step there too makes a rollback agree on it.
                let stepped = matches!(core.active_mode(), gaps_shard::Mode::Sync | gaps_shard::Mode::Gba)
                    && core.live_workers() > 0;
                let _ = tx.send((stepped, core.global_step(), core.peer_shards(), core.config().num_shards));
            })))
            .await?;
        let (stepped, step, peers, num_shards) = rx.await.map_err(|_| anyhow!("shard core thread stopped"))?;
        if peers.len() + 1 < num_shards as usize {
            warn!(joined = peers.len() + 1, num_shards, "not every shard has joined: the checkpoint leaves them out");
        }
        let at = if stepped { CheckpointAt::Step(step + margin) } else { CheckpointAt::Quiescent };
        let id = next_id(shared);
        let mut tasks = tokio::task::JoinSet::new();
        for peer in peers.iter().cloned() {
            let (endpoint, cluster) = (shared.endpoint.clone(), shared.own.cluster.clone());
            let config = shared.rotated.lock().ok().and_then(|c| c.clone());
            tasks.spawn(async move { (peer.index, peer_checkpoint(endpoint, config, cluster, peer, id, at).await) });
        }
        let own = take_checkpoint(shared, Some(id), at).await.map(|w| ShardCheckpoint {
            shard: shared.shard,
            path: w.path.display().to_string(),
            step: w.step,
        });
        let mut results = vec![(shared.shard, own)];
        while let Some(joined) = tasks.join_next().await {
            results.push(joined.context("a checkpoint request task failed")?);
        }
        results.sort_by_key(|(index, _)| *index);
        let late: Vec<u32> =
            results.iter().filter(|(_, r)| matches!(r, Err(CheckpointFailure::TooLate(_)))).map(|(i, _)| *i).collect();
        let failed: Vec<String> = results
            .iter()
            .filter_map(|(i, r)| match r {
                Err(CheckpointFailure::Other(e)) => Some(format!("shard {i}: {e:#}")),
                _ => None,
            })
            .collect();
        if late.is_empty() && failed.is_empty() {
            let shards = results.into_iter().filter_map(|(_, r)| r.ok()).collect();
            info!(checkpoint = id, ?at, "cluster checkpoint written by every shard");
            return Ok(CheckpointDone { id, shards });
        }
        if !failed.is_empty() {
            bail!("checkpoint {id} ({at:?}) was not written everywhere: {}", failed.join("; "));
        }
        // Some shard was past the step already (or its workers left): aim further ahead, or take it at the
        // quiescent point if no worker is left. The files already written under this id stay, incomplete.
        warn!(checkpoint = id, ?at, ?late, "shards could not take the checkpoint at its step; trying again");
        margin *= 4;
    }
    bail!("no step could be agreed on for a cluster checkpoint: shards kept passing it")
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

async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>, tick: Duration) {
    // Each in-flight RPC holds a clone of this token; shutdown waits until only the original is left.
    let inflight = Arc::new(());
    let ticker = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            let mut last_release = Instant::now();
            loop {
                interval.tick().await;
                // Memory kept for reuse (recycled buffers, the allocator's free heap) goes back to the
                // kernel every few seconds, so that the shard's resident memory follows what it holds.
                if last_release.elapsed() >= RELEASE_IDLE_EVERY {
                    last_release = Instant::now();
                    tokio::task::spawn_blocking(gaps_common::buffers::release_idle);
                }
                let (tx, rx) = oneshot::channel();
                if shared.send(Command::Tick { reply: tx }).await.is_err() {
                    return;
                }
                let Ok((events, stats)) = rx.await else { return };
                shared.metrics.observe(&stats);
                log_events(&events);
                forget_registrations(&shared, &events);
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
                let ip = incoming.remote_address().ip();
                let Some(ip_slot) = IpSlot::take(&shared, ip) else {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    shared.metrics.connections_refused.increment(1);
                    if let Some(suppressed) = shared.log_connections.allow() {
                        warn!(%ip, suppressed, "refused a connection: this address holds its maximum");
                    }
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
                            if let Some(suppressed) = shared.log_connections.allow() {
                                warn!(%ip, suppressed, error = net::describe_connection_error(&e), "refused a connection");
                            }
                            return;
                        }
                    };
                    match net::peer_identity(&conn) {
                        Ok(id) if id.cluster == shared.own.cluster => {
                            serve_connection(conn, id, shared.clone(), inflight, shutdown).await
                        }
                        other => {
                            let reason = match other {
                                Ok(id) => format!("the certificate {id} is of another cluster than {:?}", shared.own.cluster),
                                Err(e) => e,
                            };
                            shared.unauthorized.fetch_add(1, Ordering::Relaxed);
                            shared.metrics.unauthorized.increment(1);
                            if let Some(suppressed) = shared.log_connections.allow() {
                                warn!(%ip, suppressed, %reason, "refused a connection");
                            }
                            conn.close(3u32.into(), format!("refused by shard {}: {reason}", shared.shard).as_bytes());
                        }
                    }
                    drop(ip_slot);
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

/// Counts one connection against its IP address's share while it lives.
struct IpSlot {
    shared: Arc<Shared>,
    ip: std::net::IpAddr,
}

impl IpSlot {
    fn take(shared: &Arc<Shared>, ip: std::net::IpAddr) -> Option<IpSlot> {
        let mut count = shared.per_ip.entry(ip).or_insert(0);
        if *count >= shared.max_per_ip {
            return None;
        }
        *count += 1;
        Some(IpSlot { shared: shared.clone(), ip })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        self.shared.per_ip.remove_if_mut(&self.ip, |_, count| {
            *count -= 1;
            *count == 0
        });
    }
}

/// One connection's peer: its identity and quinn's id of the connection (the key of its binding).
struct ConnPeer {
    identity: PeerIdentity,
    conn_id: usize,
}

async fn serve_connection(
    conn: quinn::Connection,
    identity: PeerIdentity,
    shared: Arc<Shared>,
    inflight: Arc<()>,
    mut shutdown: watch::Receiver<bool>,
) {
    let peer = conn.remote_address();
    let conn_peer = Arc::new(ConnPeer { identity, conn_id: conn.stable_id() });
    debug!(%peer, identity = %conn_peer.identity, "connection");
    let _unbind = Unbind { shared: shared.clone(), conn_id: conn_peer.conn_id };
    // This connection's share of the in-flight budget, which its requests together cannot exceed.
    let share = Arc::new(Semaphore::new(shared.connection_units as usize));
    loop {
        let stream = tokio::select! {
            _ = shutdown.changed() => return,
            s = tokio::time::timeout(shared.idle_timeout, conn.accept_bi()) => match s {
                Ok(s) => s,
                Err(_) => {
                    shared.idle_closed.fetch_add(1, Ordering::Relaxed);
                    debug!(%peer, idle = ?shared.idle_timeout, "closing an idle connection");
                    conn.close(4u32.into(), b"idle: no request within the idle timeout");
                    return;
                }
            },
        };
        match stream {
            Ok((send, recv)) => {
                let shared = shared.clone();
                let token = inflight.clone();
                let conn_peer = conn_peer.clone();
                let share = share.clone();
                tokio::spawn(async move {
                    serve_stream(&shared, &conn_peer, &share, send, recv).await;
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

/// Forgets a connection's worker binding when the connection ends.
struct Unbind {
    shared: Arc<Shared>,
    conn_id: usize,
}

impl Drop for Unbind {
    fn drop(&mut self) {
        self.shared.bindings.remove(&self.conn_id);
    }
}

async fn serve_stream(
    shared: &Shared,
    peer: &ConnPeer,
    share: &Semaphore,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let started = Instant::now();
    // Memory is admitted as the request's bytes arrive (header, then payload), and the reply's only once
    // the request is whole: a stream that declares much and sends little holds next to nothing.
    let mut reservation = Reservation { shared, share, units: 0 };
    let read = async {
        let header = net::read_request_header(&mut recv, &shared.limits, shared.stall_timeout, &mut reservation).await;
        let msg = match header {
            Ok(msg) => msg,
            Err(net::RequestReadError::Wire(e)) => return Ok(Err(e)),
            Err(e) => return Err(e),
        };
        let already = reservation.units as u64 * BUDGET_UNIT;
        let payload = net::read_request_payload(&mut recv, &msg, shared.stall_timeout, already, &mut reservation);
        let (payload, all_finite) = match payload.await {
            Ok(read) => read,
            Err(net::RequestReadError::Wire(e)) => return Ok(Err(e)),
            Err(e) => return Err(e),
        };
        if let Err(e) = net::expect_end(&mut recv).await {
            return Ok(Err(e));
        }
        let whole = reservation.units as u64 * BUDGET_UNIT + shared.reply_bytes(&msg);
        reservation.grow_to(whole).await.map_err(net::RequestReadError::Busy)?;
        Ok(Ok((Frame { msg, payload }, all_finite)))
    };
    let request = match tokio::time::timeout(shared.request_timeout, read).await {
        Err(_) => return cut_off(shared, &mut send, &mut recv, "request"),
        Ok(Err(net::RequestReadError::Stalled)) => return cut_off(shared, &mut send, &mut recv, "stalled request"),
        Ok(Err(net::RequestReadError::Busy(reason))) => {
            return refuse_busy(shared, peer, &mut send, &mut recv, &reason).await
        }
        Ok(Err(net::RequestReadError::Wire(e))) | Ok(Ok(Err(e))) => Err(e),
        Ok(Ok(Ok(request))) => Ok(request),
    };
    let mut held = Held { shared, bytes: 0 };
    serve_request(&mut held, peer, &mut send, &mut recv, request, started).await;
    drop(reservation);
}

/// A request's share of the in-flight budget (in [`BUDGET_UNIT`]s), taken from the shard's budget and from
/// its connection's share as the request's bytes arrive, and given back to both when the request ends.
struct Reservation<'a> {
    shared: &'a Shared,
    share: &'a Semaphore,
    units: u32,
}

impl net::Admission for Reservation<'_> {
    async fn grow_to(&mut self, bytes: u64) -> Result<(), String> {
        // A request larger than a connection's share is admitted at the share (the largest model pushes are
        // bounded by the payload limit instead).
        let want = bytes.div_ceil(BUDGET_UNIT).min(u64::from(self.shared.connection_units)) as u32;
        if want <= self.units {
            return Ok(());
        }
        // What is held goes back and the whole amount is taken at once (first the connection's share, then
        // the shard's budget, always in that order): a request never holds part of the budget while it
        // waits for more, so requests that wait on one another cannot deadlock.
        self.release();
        let wait = self.shared.budget_wait;
        let take = async {
            let own = self.share.acquire_many(want).await.map_err(|_| "the shard is stopping".to_string())?;
            let all = self.shared.budget.acquire_many(want).await.map_err(|_| "the shard is stopping".to_string())?;
            own.forget();
            all.forget();
            Ok::<(), String>(())
        };
        match tokio::time::timeout(wait, take).await {
            Ok(Ok(())) => {
                self.units = want;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!(
                "no room for {want} KiB of this request within {wait:?} (in-flight budget {} KiB, {} KiB per connection)",
                self.shared.budget_units, self.shared.connection_units
            )),
        }
    }
}

impl Reservation<'_> {
    fn release(&mut self) {
        self.share.add_permits(self.units as usize);
        self.shared.budget.add_permits(self.units as usize);
        self.units = 0;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Refuses a request the in-flight budget had no room for in time: answered [`ErrorCode::Busy`] (nothing of
/// it was applied, the client sends it again), then the rest of it is not read.
async fn refuse_busy(
    shared: &Shared,
    peer: &ConnPeer,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    reason: &str,
) {
    shared.busy.fetch_add(1, Ordering::Relaxed);
    shared.metrics.requests_busy.increment(1);
    if let Some(suppressed) = shared.log_malformed.allow() {
        warn!(identity = %peer.identity, %reason, suppressed, "refused a request: no room in the in-flight budget");
    }
    let refusal = Message::error(ErrorCode::Busy, format!("shard {} is busy: {reason}", shared.shard));
    let _ = recv.stop(0u32.into());
    match tokio::time::timeout(shared.stall_timeout, net::write_frame(send, &refusal, &[])).await {
        Ok(Ok(_)) => {
            let _ = send.finish();
        }
        _ => {
            let _ = send.reset(2u32.into());
        }
    }
}

/// Ends a stream whose sender is too slow or stalled: resets both directions and counts it.
fn cut_off(shared: &Shared, send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, part: &str) {
    shared.timed_out.fetch_add(1, Ordering::Relaxed);
    shared.metrics.requests_timed_out.increment(1);
    if let Some(suppressed) = shared.log_malformed.allow() {
        warn!(part, request_timeout = ?shared.request_timeout, stall_timeout = ?shared.stall_timeout, suppressed,
            "cut off a request that did not arrive in time");
    }
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
    peer: &ConnPeer,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    request: Result<(Frame, bool), WireError>,
    started: Instant,
) {
    let shared = held.shared;
    let mut finite = false;
    let request = request.map(|(frame, all_finite)| {
        held.add(frame.payload.len() as u64 * 4);
        finite = all_finite;
        frame
    });
    let (reply, views, histogram) = match request {
        Err(WireError::Io(message)) => {
            debug!(%message, "stream broke before the request was complete");
            return;
        }
        Err(e) => {
            if let Some(suppressed) = shared.log_malformed.allow() {
                warn!(error = %e, identity = %peer.identity, suppressed, "refused a malformed request");
            }
            let refusal = Frame::new(Message::error(wire_error_code(&e), e.to_string()));
            (refusal, Vec::new(), &shared.metrics.rpc_other_seconds)
        }
        Ok(frame) => {
            shared.metrics.bytes_in.increment(frame.msg.payload_bytes());
            let kind = RpcKind::of(&frame.msg);
            let histogram = match kind {
                RpcKind::Push | RpcKind::PushPull => &shared.metrics.rpc_push_seconds,
                RpcKind::Pull => &shared.metrics.rpc_pull_seconds,
                RpcKind::Other => &shared.metrics.rpc_other_seconds,
            };
            let bound = shared.bindings.get(&peer.conn_id).map(|w| *w);
            let fenced = shared.log.as_ref().is_some_and(|l| l.fenced());
            let handled = if let Err(reason) = crate::auth::authorize(&frame.msg, &peer.identity, bound) {
                Some((refuse_unauthorized(shared, peer, &reason), Vec::new(), Vec::new()))
            } else if crate::quorum::is_quorum_message(&frame.msg) {
                // A fenced process still takes part in choosing shard 0's configuration.
                let reply = match (&shared.quorum, &peer.identity.role) {
                    (Some(q), Role::Shard(sender)) => q.handle_async(*sender, &frame.msg).await,
                    _ => Frame::new(Message::error(
                        ErrorCode::Misconfigured,
                        "this cluster does not choose shard 0's configuration by majority (it takes --replicas 2 \
                         or more and at least 3 shard processes)",
                    )),
                };
                Some((reply, Vec::new(), Vec::new()))
            } else if fenced && !matches!(frame.msg, Message::ReplicaSnapshot(_) | Message::ReplicaAppend(_)) {
                Some((moved(shared), Vec::new(), Vec::new()))
            } else if let Some(refusal) = promote_refusal(shared, &frame.msg).await {
                Some((refusal, Vec::new(), Vec::new()))
            } else if let Message::Authenticate(a) = frame.msg {
                Some((authenticate(shared, peer, a), Vec::new(), Vec::new()))
            } else if let Message::CheckpointRequest(req) = frame.msg {
                Some((checkpoint_reply(shared, req).await, Vec::new(), Vec::new()))
            } else if let Message::Rollback(req) = frame.msg {
                Some((rollback_reply(shared, req).await, Vec::new(), Vec::new()))
            } else if matches!(frame.msg, Message::ReplicaSnapshot(_) | Message::ReplicaAppend(_)) {
                let sender = match peer.identity.role {
                    Role::Shard(p) => p,
                    _ => u32::MAX,
                };
                let reply = match &shared.backups {
                    Some(backups) => backups.handle(sender, frame).await,
                    None => Frame::new(Message::error(
                        ErrorCode::Misconfigured,
                        format!("shard {} keeps no copies of other shards (--replicas 1)", shared.shard),
                    )),
                };
                Some((reply, Vec::new(), Vec::new()))
            } else if matches!(&frame.msg, Message::Register(r) if r.role == WireRole::Worker)
                && shared.per_certificate.get(&peer.identity).is_some_and(|n| *n >= shared.max_per_certificate)
            {
                let reason = format!(
                    "this certificate already holds {} live workers, the most one may register \
                     (--max-workers-per-certificate)",
                    shared.max_per_certificate
                );
                Some((refuse_unauthorized(shared, peer, &reason), Vec::new(), Vec::new()))
            } else {
                let registers_worker = matches!(&frame.msg, Message::Register(r) if r.role == WireRole::Worker);
                let registers_shard = matches!(frame.msg, Message::RegisterShard(_));
                let (tx, rx) = oneshot::channel();
                let reply = match shared.send(Command::Handle { frame: Box::new(frame), finite, reply: tx }).await {
                    Ok(()) => rx.await.ok(),
                    Err(_) => None,
                };
                // A request that changed the shard is answered once every live backup applied it. A backup
                // that does not answer stops counting within its ack timeout once the coordinator heard of
                // it; should the wait outlast a request's time limit (the coordinator unreachable) the reply
                // says to send the request again, and a fenced shard (another process serves it now)
                // acknowledges nothing.
                let reply = match (&shared.log, reply) {
                    (Some(log), Some(answer)) => {
                        match tokio::time::timeout(shared.request_timeout, log.wait(answer.3)).await {
                            Ok(true) => Some(answer),
                            Ok(false) => Some((moved(shared), Vec::new(), Vec::new(), 0)),
                            Err(_) => {
                                let msg = "the shard's backups did not acknowledge the request in time; send it again";
                                Some((Frame::new(Message::error(ErrorCode::Busy, msg)), Vec::new(), Vec::new(), 0))
                            }
                        }
                    }
                    (_, reply) => reply,
                };
                // Credentials go out with the map: a worker's token to its registrant, the key to a shard.
                reply.map(|(mut reply, events, views, _)| {
                    if let Message::ClusterMap(map) = &mut reply.msg {
                        map.replicas = shared.replicas;
                        if let (true, Some(w)) = (registers_worker, map.worker_id) {
                            map.token = Some(shared.credentials.token(w, &peer.identity));
                            shared.registrants.insert(w, peer.identity.clone());
                            *shared.per_certificate.entry(peer.identity.clone()).or_insert(0) += 1;
                        }
                        if registers_shard {
                            map.auth_key = Some(shared.credentials.raw());
                        }
                    }
                    (reply, events, views)
                })
            };
            let Some((reply, events, views)) = handled else {
                let _ = send.reset(1u32.into());
                return;
            };
            log_events(&events);
            forget_registrations(shared, &events);
            record(&shared.metrics, kind, &reply.msg);
            (reply, views, histogram)
        }
    };
    let Frame { msg, payload } = reply;
    let parts = match reply_parts(&msg, payload, views) {
        Ok(parts) => parts,
        Err(e) => {
            warn!(error = %e, "a reply's payload does not match its header");
            let _ = send.reset(1u32.into());
            return;
        }
    };
    held.add(parts.iter().map(|p| p.len() as u64).sum());
    // A peer that does not take its reply is cut off at the request's time limit, which frees the reply.
    match tokio::time::timeout(shared.request_timeout, net::write_frame(send, &msg, &parts)).await {
        Ok(Ok(bytes)) => shared.metrics.bytes_out.increment(bytes),
        Ok(Err(e)) => debug!(error = %e, "writing the reply"),
        Err(_) => return cut_off(shared, send, recv, "reply"),
    }
    let _ = send.finish();
    histogram.record(started.elapsed().as_secs_f64());
}

/// The payload parts of reply `msg`: the parameter buffers it shares with the core
/// (`ShardCore::set_shared_replies`), each handed to quinn as it is and held until the peer acknowledged
/// it; values the core packed for the wire (`ShardCore::set_packed_replies`); or f32 values.
fn reply_parts(msg: &Message, payload: Vec<f32>, views: Vec<Arc<Vec<f32>>>) -> Result<Vec<net::Bytes>, WireError> {
    if !views.is_empty() {
        let elems: u64 = views.iter().map(|v| v.len() as u64).sum();
        if elems != msg.payload_elems() || !payload.is_empty() {
            return Err(WireError::ElementCountMismatch { expected: msg.payload_elems(), got: elems });
        }
        return Ok(views.into_iter().map(|v| net::f32_bytes(SharedParams(v))).collect());
    }
    let packed = match msg {
        Message::PullReply(PullReply { chunks }) | Message::PushPullReply(PushPullReply { chunks, .. }) => {
            chunks.iter().any(|c| c.dtype != gaps_common::dtype::WireDtype::F32)
        }
        _ => false,
    };
    if packed {
        net::packed_parts(msg, payload)
    } else {
        net::payload_parts(msg, payload)
    }
}

/// Refuses a request its peer may not send: counted, logged at a bounded rate, and answered with a reason
/// that names the certificate and the request, nothing of the model.
/// The answer of a shard process that no longer serves its shard (a backup took it over).
fn moved(shared: &Shared) -> Frame {
    let msg = format!("shard {} is served by another shard process now: fetch the cluster map again", shared.shard);
    Frame::new(Message::error(ErrorCode::Moved, msg))
}

/// On the coordinator, the refusal of a [`Message::Promote`] whose shard's primary still answers (None:
/// the core decides). The primary is asked for its stats on a new connection, within [`PROBE_WAIT`]. One
/// that does not answer is dead to the coordinator's own log too: its copy of shard 0 stops counting at once
/// (shard 0 needs no leave), so the promotion's own reply does not wait for that dead backup.
async fn promote_refusal(shared: &Shared, msg: &Message) -> Option<Frame> {
    let Message::Promote(p) = msg else { return None };
    let (tx, rx) = oneshot::channel();
    let shard = p.shard;
    let ask = Command::Inspect(Box::new(move |core| {
        let _ = tx.send(core.serving(shard));
    }));
    let (addr, process, _) = match shared.send(ask).await {
        Ok(()) => rx.await.ok().flatten()?,
        Err(_) => return None,
    };
    let link = crate::replication::CoordinatorLink {
        coordinator: addr.clone(),
        cluster: shared.own.cluster.clone(),
        endpoint: shared.endpoint.clone(),
        rotated: shared.rotated.clone(),
    };
    let probe = async {
        let conn = link.connect(&addr, process).await?;
        let stats = Message::StatsRequest(gaps_common::wire::StatsRequest);
        let reply = net::call(&conn, &stats, &[], &Limits::default(), PROBE_WAIT).await;
        conn.close(0u32.into(), b"probe");
        reply
    };
    match tokio::time::timeout(PROBE_WAIT, probe).await {
        Ok(Ok(_)) => Some(Frame::new(Message::error(
            ErrorCode::Misconfigured,
            format!("shard {shard}'s primary at {addr} answers: it is not taken over"),
        ))),
        _ => {
            // Not when a majority chooses shard 0's backups: a probe that got no answer does not prove the
            // process dead, and only a configuration chosen without it lets replies stop waiting for it
            // (its shipping task proposes one once its ack timeout passes).
            if let (Some(log), None) = (&shared.log, &shared.quorum) {
                log.unfollow(process);
            }
            None
        }
    }
}

/// How long the coordinator waits for a primary's answer before it lets a backup take the shard over.
const PROBE_WAIT: Duration = Duration::from_millis(500);

fn refuse_unauthorized(shared: &Shared, peer: &ConnPeer, reason: &str) -> Frame {
    shared.unauthorized.fetch_add(1, Ordering::Relaxed);
    shared.metrics.unauthorized.increment(1);
    if let Some(suppressed) = shared.log_unauthorized.allow() {
        warn!(identity = %peer.identity, %reason, suppressed, "refused an unauthorized request");
    }
    Frame::new(Message::error(ErrorCode::Unauthorized, format!("not authorized: {reason}")))
}

/// Binds the connection to a worker whose credential it presents.
fn authenticate(shared: &Shared, peer: &ConnPeer, a: gaps_common::wire::Authenticate) -> Frame {
    if !matches!(peer.identity.role, Role::Worker(_)) {
        return refuse_unauthorized(shared, peer, "only worker certificates authenticate as workers");
    }
    if !shared.credentials.verify(a.worker, &peer.identity, &a.token) {
        return refuse_unauthorized(
            shared,
            peer,
            &format!("the credential is not worker {}'s for this certificate and cluster epoch", a.worker),
        );
    }
    shared.bindings.insert(peer.conn_id, a.worker);
    Frame::new(Message::Authenticated(gaps_common::wire::Authenticated { worker: a.worker }))
}

/// What a request counts as in the metrics: dense and sparse pushes are pushes, dense and sparse pulls are
/// pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RpcKind {
    Push,
    Pull,
    /// A push answered with the pushed chunks' values: counted as a push and, when it carries them, a pull.
    PushPull,
    Other,
}

impl RpcKind {
    fn of(msg: &Message) -> Self {
        match msg {
            Message::Push(_) | Message::PushPart(_) | Message::SparsePush(_) => RpcKind::Push,
            Message::PushPull(_) => RpcKind::PushPull,
            Message::Pull(_) | Message::SparsePull(_) => RpcKind::Pull,
            _ => RpcKind::Other,
        }
    }
}

fn record(m: &ShardMetrics, request: RpcKind, reply: &Message) {
    if let (RpcKind::PushPull, Message::PushPullReply(r)) = (request, reply) {
        record(m, RpcKind::Push, &Message::Ack(r.ack));
        if !r.chunks.is_empty() {
            m.pulls.increment(1);
        }
        return;
    }
    match (request, reply) {
        (RpcKind::Push, Message::Ack(ack)) if ack.duplicate => m.push_duplicates.increment(1),
        (RpcKind::Push, Message::Ack(ack)) => {
            m.pushes.increment(1);
            m.staleness.record(ack.max_staleness as f64);
        }
        (RpcKind::Push | RpcKind::PushPull, _) => m.push_rejected.increment(1),
        (RpcKind::Pull, Message::PullReply(_) | Message::SparsePullReply(_)) => m.pulls.increment(1),
        _ => {}
    }
}

/// A worker that left or whose lease expired no longer counts against its registrant's certificate.
fn forget_registrations(shared: &Shared, events: &[CoreEvent]) {
    for e in events {
        if let CoreEvent::WorkerLeft(w) | CoreEvent::WorkerExpired(w) = e {
            if let Some((_, identity)) = shared.registrants.remove(w) {
                shared.per_certificate.remove_if_mut(&identity, |_, n| {
                    *n = n.saturating_sub(1);
                    *n == 0
                });
            }
        }
    }
}

fn log_events(events: &[CoreEvent]) {
    for e in events {
        match e {
            CoreEvent::WorkerJoined(w) => info!(worker = w, "worker registered"),
            CoreEvent::WorkerLeft(w) => info!(worker = w, "worker left"),
            CoreEvent::WorkerExpired(w) => warn!(worker = w, "worker lease expired"),
            CoreEvent::ShardJoined(s) => info!(joined = s, "shard joined"),
            CoreEvent::ShardPromoted { shard, process, epoch } => {
                warn!(shard, process, epoch, "a backup took over a shard whose primary went silent")
            }
            CoreEvent::DeviceFault(what) => error!(%what, "device fault"),
            CoreEvent::ModeDecided { number, to, from_step, reason } => {
                warn!(number, %to, from_step, %reason, "cluster mode decided (every shard switches at that worker step)")
            }
            CoreEvent::ModeSwitch { from, to, reason } => warn!(%from, %to, %reason, "training mode switched"),
            CoreEvent::LrRamp { workers, target } => {
                info!(workers, target, "learning-rate multiplier ramps to the new worker count")
            }
        }
    }
}
