//! The pieces [`start_serving_now`](super::startup::start_serving_now) puts together, in the order it
//! takes them: checks, the address, the core to serve, who serves shard 0, joining the cluster, the copies
//! kept, the core's thread, the shared state and the tasks around it.

use super::*;

/// What a takeover hands the start (all empty for a plain start).
pub(super) struct Given {
    pub(super) taken: Option<(ShardCore, Option<gaps_shard::core::CheckpointInfo>)>,
    pub(super) key: Option<gaps_common::wire::Token>,
    pub(super) clock: Option<Duration>,
    pub(super) bound: Option<(quinn::Endpoint, net::PathTuning)>,
    pub(super) epoch: u64,
    pub(super) applied: u64,
    pub(super) quorum: Option<Option<Arc<crate::quorum::Quorum>>>,
}

impl Given {
    pub(super) fn of(takeover: Option<Takeover>) -> Given {
        match takeover {
            Some(t) => Given {
                taken: Some((t.core, t.restored)),
                key: t.key,
                clock: Some(t.clock),
                bound: Some(t.endpoint),
                epoch: t.epoch,
                applied: t.applied,
                quorum: Some(t.quorum),
            },
            None => Given { taken: None, key: None, clock: None, bound: None, epoch: 0, applied: 0, quorum: None },
        }
    }
}

/// The settings a start must refuse, and this process's identity from its certificate.
pub(super) fn check_start(cfg: &ServiceConfig, process: u32) -> Result<PeerIdentity> {
    crate::replication::check_replicas(cfg.replicas, cfg.core.num_shards)?;
    if cfg.replicas > 1 && cfg.device != gaps_kernels::cuda::DeviceChoice::Cpu {
        bail!(
            "--replicas {} runs every copy's updates on the CPU, so that copies stay equal bit for bit: pass --device cpu",
            cfg.replicas
        );
    }
    let own = cfg.tls.own_identity().context("reading this shard's certificate")?;
    if own.role != Role::Shard(process) {
        bail!(
            "this is shard {} but its certificate is {own}: pass the shard-{}.pem made by `gaps certs`",
            cfg.core.shard,
            cfg.core.shard
        );
    }
    Ok(own)
}

/// The bound address and the one given to clients.
pub(super) fn advertised(endpoint: &quinn::Endpoint, cfg: &ServiceConfig) -> Result<(SocketAddr, String)> {
    let addr = endpoint.local_addr().context("reading the bound address")?;
    let advertise = match &cfg.advertise {
        Some(a) => a.clone(),
        None if addr.ip().is_unspecified() => {
            bail!("listening on {addr}: pass --advertise HOST:PORT so clients know where to reach this shard")
        }
        None => addr.to_string(),
    };
    Ok((addr, advertise))
}

/// Tells the health endpoint what the start is doing.
pub(super) fn report(health: &Option<Arc<crate::metrics::Health>>, what: &str) {
    if let Some(h) = health {
        h.starting(what);
    }
}

/// The core to serve (a copy taken over, restored from this shard's checkpoints, or fresh), with its dealer
/// and device set up; the checkpoint it came from; the dealer's journal.
pub(super) fn core_to_serve(
    cfg: &ServiceConfig,
    process: u32,
    taken: Option<(ShardCore, Option<gaps_shard::core::CheckpointInfo>)>,
    store: Option<&CheckpointStore>,
) -> Result<(ShardCore, Option<gaps_shard::core::CheckpointInfo>, Option<std::fs::File>)> {
    let shard = cfg.core.shard;
    let (mut core, restored) = match taken {
        Some(taken) => taken,
        None => initial_core(cfg, shard, store)?,
    };
    // The coordinator's tables restored by a process that started again: its copies are gone.
    if shard == 0 && restored.is_some() {
        core.serving_restored(process);
    }
    let journal = set_up_dealer(&mut core, cfg, shard, store, restored.is_some())?;
    // Pull replies go out as the core packs them (16-bit values converted straight from the parameters).
    core.set_packed_replies(true);
    // f32 replies share the parameters rather than copying them on the core's thread.
    core.set_shared_replies(true);
    set_up_device(&mut core, cfg, shard)?;
    Ok((core, restored, journal))
}

/// Where this process is and who it is, as the steps of joining need them.
pub(super) struct Place<'a> {
    pub(super) endpoint: &'a quinn::Endpoint,
    pub(super) own: &'a PeerIdentity,
    pub(super) advertise: &'a str,
    pub(super) process: u32,
    /// The start serves a shard taken over (no joining, no settling).
    pub(super) takes_over: bool,
    pub(super) health: &'a Option<Arc<crate::metrics::Health>>,
}

/// Where a majority chooses shard 0's configuration: the process that served shard 0 when it stopped (process
/// 0, or one that took it over) serves it again only once a majority chose so, else it comes back without it.
/// The coordinator is where the last configuration this process knows put it (the address given at start
/// until a takeover) or, newer, the one the process at `--coordinator` knows. `listed`: the processes this
/// process's core lists (process 0's, restored from its checkpoint). Returns shard 0 served on an endpoint of
/// its own, where this process is not process 0.
pub(super) async fn shard0_here(
    cfg: &ServiceConfig,
    place: &Place<'_>,
    quorum: &Arc<crate::quorum::Quorum>,
    restored: bool,
    listed: Vec<(u32, String)>,
) -> Result<Option<RunningServer>> {
    let mut asked = None;
    if let Some(ask) = &cfg.coordinator {
        asked = learn_where_the_coordinator_is(place.endpoint, ask, &place.own.cluster, quorum).await;
    }
    let last = quorum.chosen();
    if last.serving == place.process && (last.version > 0 || (cfg.core.shard == 0 && restored)) {
        report(place.health, "asking the shard processes who serves shard 0");
        let start = ServedShard0 { cfg, own: place.own, quorum, advertise: place.advertise, asked };
        return start.settle(place.endpoint, listed).await;
    }
    Ok(None)
}

/// What joining the cluster gave this process.
pub(super) struct Joined {
    /// The cluster's credential key.
    pub(super) auth_key: gaps_common::wire::Token,
    /// The process serves no shard: its own was taken over while it was down (or a backup in sync holds more).
    pub(super) spare: bool,
    /// Shards this process served when it stopped, to serve again from its checkpoints: (shard, epoch).
    pub(super) resume: Vec<(u32, u64)>,
}

/// Joins the coordinator (shards ≥ 1, and process 0 where another process serves shard 0) and learns the
/// cluster's credential key; the coordinator itself keeps its key in its folder. A process whose shard was
/// taken over while it was down comes back as a spare: it serves no shard (its own answers `Moved`) and keeps
/// copies of others, its old shard's among them.
pub(super) async fn join_cluster(
    cfg: &ServiceConfig,
    place: &Place<'_>,
    chosen: Option<&gaps_common::quorum::CoordinatorConfig>,
    core: &mut ShardCore,
    quorum: Option<&Arc<crate::quorum::Quorum>>,
    store: Option<&CheckpointStore>,
) -> Result<Joined> {
    let (shard, process) = (cfg.core.shard, place.process);
    let join_at = match (chosen, shard, place.takes_over) {
        (_, _, true) => None,
        // Process 0 joins another serving shard 0 as a spare.
        (Some(c), 0, false) => (c.serving != 0).then(|| (c.addr.clone(), c.serving)),
        (None, 0, false) => None,
        (Some(c), _, false) => Some((c.addr.clone(), c.serving)),
        (None, _, false) => {
            Some((cfg.coordinator.clone().context("shards other than 0 need --coordinator (shard 0's address)")?, 0))
        }
    };
    let Some((coordinator, serving)) = join_at else {
        // The coordinator's key outlives a restart with its checkpoints (the tokens it gave stay valid).
        let auth_key = match store {
            Some(store) => crate::auth::load_or_create_key(store.dir())?,
            None => crate::auth::random_key()?,
        };
        return Ok(Joined { auth_key, spare: false, resume: Vec::new() });
    };
    report(place.health, "joining the coordinator");
    // Whom to ask where the coordinator is while it is silent: the process `--coordinator` names, and the
    // processes a restored coordinator's tables list (process 0's).
    let asks: Vec<String> = cfg
        .coordinator
        .iter()
        .cloned()
        .chain(core.process_addrs().into_iter().map(|(_, a)| a))
        .filter(|a| *a != place.advertise)
        .collect();
    let ask = (asks.as_slice(), quorum);
    let map =
        join_coordinator(place.endpoint, (&coordinator, serving), &place.own.cluster, core, (cfg.join_timeout, ask))
            .await?;
    let auth_key = map.auth_key.context("the coordinator sent no credential key")?;
    let served_elsewhere = map.shards.iter().any(|s| s.index == shard && s.process != shard);
    if served_elsewhere && cfg.replicas < 2 {
        bail!("shard {shard} was taken over by another shard process while this one was down; start it with --replicas as the cluster's to keep copies");
    }
    // Listed as a spare while its shard is still its own: a backup in sync holds more (it waits for it to
    // take the shard over, or has it granted back where that backup started again too).
    let waits = !served_elsewhere && map.spare.iter().any(|s| s.index == shard);
    // Shards this process served when it stopped (shard 0's is settled before): served again from its
    // checkpoints once the coordinator grants it.
    let resume = map
        .shards
        .iter()
        .filter(|s| s.process == process && (s.index != shard || waits) && s.index != 0)
        .map(|s| (s.index, s.epoch))
        .collect();
    Ok(Joined { auth_key, spare: served_elsewhere || waits, resume })
}

/// The copies of other shards this process keeps (`--replicas r`), its own shard's too where it is a spare.
pub(super) fn copies_kept(cfg: &ServiceConfig, r: u32, spare: bool, read_echo: bool) -> Arc<Backups> {
    let shard = cfg.core.shard;
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
    info!(shard, copies_of = ?shards, "keeping copies of other shards (--replicas {r})");
    Arc::new(backups)
}

/// The log this shard's backups follow (`--replicas` ≥ 2), fenced where the process serves no shard.
pub(super) fn replica_log(cfg: &ServiceConfig, spare: bool, resume: &[(u32, u64)]) -> Option<Arc<Log>> {
    let shard = cfg.core.shard;
    let log = (cfg.replicas > 1).then(|| Arc::new(Log::new(shard, cfg.inflight_bytes)));
    if let (true, Some(log)) = (spare, &log) {
        match resume.iter().any(|(s, _)| *s == shard) {
            true => warn!(
                shard,
                "a backup in sync holds more of this shard than its checkpoint: serving none here, until it takes \
                 the shard over (or the shard is granted back to this process, should that backup hold nothing)"
            ),
            false => warn!(
                shard,
                "this shard was taken over by another shard process while this one was down: serving none, keeping copies"
            ),
        }
        log.fence();
    }
    log
}

/// Starts the core's own thread; returns its queue and the clock it runs on (a copy taken over goes on from
/// its primary's: leases and waits are deadlines on it). `(process, applied, clock)`: this process, the last
/// entry of the primary's log a copy applied, and the primary's clock at it.
pub(super) fn start_core_thread(
    cfg: &ServiceConfig,
    core: ShardCore,
    (process, applied, clock): (u32, u64, Option<Duration>),
    journal: Option<std::fs::File>,
    log: Option<Arc<Log>>,
) -> Result<(CoreQueue, Instant)> {
    let shard = cfg.core.shard;
    let (queue, receiver) = mpsc::channel(cfg.queue_depth.max(1));
    let started = clock.and_then(|c| Instant::now().checked_sub(c)).unwrap_or_else(Instant::now);
    // A striped push whose parts did not all come within a request's time limit is given up.
    let part_wait = cfg.request_timeout;
    let wake = Alarm { runtime: tokio::runtime::Handle::current(), queue: queue.downgrade(), armed: None };
    let record = match &cfg.record {
        Some(dir) => {
            let rec = crate::record::Recorder::create(dir, shard, process, applied, &core)?;
            info!(shard, path = %rec.path().display(), "recording every request that changes this shard's state");
            Some(rec)
        }
        None => None,
    };
    let seat = seat(core, started, part_wait, Sinks { journal, log, record }, wake);
    std::thread::Builder::new()
        .name(format!("gaps-shard-{shard}"))
        .spawn({
            let seat = seat.clone();
            move || run_actor(seat, receiver)
        })
        .context("starting the shard's core thread")?;
    Ok((CoreQueue { sender: queue, seat }, started))
}

/// What the shared state is made of besides the configuration.
pub(super) struct SharedParts {
    pub(super) queue: CoreQueue,
    pub(super) endpoint: quinn::Endpoint,
    pub(super) path: net::PathTuning,
    pub(super) started: Instant,
    pub(super) own: PeerIdentity,
    pub(super) coordinator_addr: String,
    pub(super) quorum: Option<Arc<crate::quorum::Quorum>>,
    pub(super) credentials: Credentials,
    pub(super) store: Option<CheckpointStore>,
    /// The checkpoint the shard was restored from.
    pub(super) restored_id: Option<u64>,
    pub(super) max_payload_bytes: u64,
    pub(super) chunk_elems: u64,
    pub(super) widest_table: u64,
    pub(super) log: Option<Arc<Log>>,
    pub(super) backups: Option<Arc<Backups>>,
    pub(super) advertise: String,
    /// Shard 0 served here on an endpoint of its own.
    pub(super) coordinator_here: Option<RunningServer>,
}

/// The state every connection and task of the shard shares.
pub(super) fn shared_state(cfg: &ServiceConfig, p: SharedParts) -> Result<Shared> {
    let shard = cfg.core.shard;
    let budget_units = (cfg.inflight_bytes / BUDGET_UNIT).clamp(1, u64::from(u32::MAX >> 3)) as u32;
    let rotated = Arc::new(std::sync::Mutex::new(None));
    let link = crate::link::CoordinatorLink::new(
        p.coordinator_addr,
        p.own.cluster.clone(),
        p.endpoint.clone(),
        rotated.clone(),
        p.quorum.clone(),
    );
    let next_checkpoint = match &p.store {
        Some(s) => s.next_id()?.max(p.restored_id.map_or(0, |id| id + 1)),
        None => 1,
    };
    Ok(Shared {
        queue: p.queue,
        budget: Semaphore::new(budget_units as usize),
        budget_units,
        held_bytes: AtomicU64::new(0),
        peak_held_bytes: AtomicU64::new(0),
        metrics: ShardMetrics::register(shard),
        limits: Limits { max_payload_bytes: p.max_payload_bytes, ..Limits::default() },
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
        endpoint: p.endpoint,
        path: p.path,
        started: p.started,
        own: p.own,
        rotated,
        link,
        credentials: p.credentials,
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
        tables_changed: tokio::sync::Notify::new(),
        next_checkpoint: AtomicU64::new(next_checkpoint),
        store: p.store,
        checkpoint_lock: tokio::sync::Mutex::new(Vec::new()),
        cluster_lock: tokio::sync::Mutex::new(()),
        device: cfg.device,
        device_worker_slots: cfg.device_worker_slots,
        rollbacks: AtomicU64::new(0),
        last_rollback: std::sync::Mutex::new(None),
        checkpoints_written: AtomicU64::new(0),
        chunk_elems: p.chunk_elems,
        widest_table: p.widest_table,
        shard,
        log: p.log,
        backups: p.backups,
        quorum: p.quorum,
        advertise: p.advertise,
        replicas: cfg.replicas,
        taken_over: std::sync::Mutex::new(p.coordinator_here.into_iter().collect()),
    })
}

/// How the shard came to serve, as its background tasks need it.
pub(super) struct Background<'a> {
    pub(super) restored: Option<&'a gaps_shard::core::CheckpointInfo>,
    pub(super) spare: bool,
    pub(super) takes_over: bool,
    pub(super) process: u32,
    /// The replica epoch the coordinator granted (a copy taken over).
    pub(super) epoch: u64,
}

/// The tasks around the core: checkpoints on a schedule and when the coordinator's tables change, the
/// cluster's rollback after a restore, shipping the log to the backups, serving again the shards this process
/// served, and watching the primaries this process keeps copies of.
pub(super) fn spawn_background(
    shared: &Arc<Shared>,
    cfg: &ServiceConfig,
    b: Background<'_>,
    log: Option<Arc<Log>>,
    resume: Vec<(u32, u64)>,
    shutdown_rx: &watch::Receiver<bool>,
) {
    let (shard, process) = (cfg.core.shard, b.process);
    if let Some(every) = cfg.checkpoint.as_ref().and_then(|c| c.every) {
        spawn_checkpoint_schedule(shared.clone(), every, shutdown_rx.clone());
    }
    if shard == 0 && cfg.replicas > 1 && shared.store.is_some() {
        spawn_table_checkpoints(shared.clone(), shutdown_rx.clone());
        // Shard 0 served by another process than before (a copy taken over, or served again from a
        // checkpoint): its folder holds a checkpoint of it at once.
        if b.takes_over {
            shared.tables_changed.notify_one();
        }
    }
    if let (Some(info), true, false) = (b.restored, cfg.core.modes.mode != gaps_shard::Mode::Async, b.spare) {
        // Consistent recovery: every shard goes back to one cluster checkpoint (async keeps the cheaper
        // per-shard restore, see docs/guide/recovery.md).
        tokio::spawn(roll_back_cluster_after_restore(shared.clone(), info.id, shutdown_rx.clone()));
    }
    if let Some(log) = &log {
        let queue = shared.queue.sender.clone();
        let ctx = Arc::new(crate::replication::ShipContext {
            shard,
            link: shared.link.clone(),
            ack_timeout: cfg.replica_ack_timeout,
            process,
            advertise: shared.advertise.clone(),
            epoch: b.epoch,
            reporting: tokio::sync::Mutex::new(()),
            quorum: shared.quorum.clone().filter(|_| shard == 0),
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
        let backups = if b.spare {
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
    if !resume.is_empty() {
        let resuming = resume_shards(shared.clone(), cfg.clone(), shared.link.clone(), resume, shutdown_rx.clone());
        tokio::spawn(resuming.instrument(tracing::info_span!("resume", process)));
    }
    if shared.backups.is_some() {
        let watch = watch_primaries(shared.clone(), cfg.clone(), shared.link.clone(), shutdown_rx.clone());
        tokio::spawn(watch.instrument(tracing::info_span!("takeover", process)));
    }
}
