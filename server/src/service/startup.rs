//! Starting a shard: its core (fresh, restored or a copy taken over), the dealer, the GPU, joining the
//! coordinator, the core's thread and the tasks around it.

use super::*;

/// Binds, joins the cluster (shards ≥ 1) and starts serving.
pub async fn start(cfg: ServiceConfig) -> Result<RunningServer> {
    start_serving(cfg, None).await
}

/// A shard this process serves beside its own on an endpoint of its own, bound before the coordinator (or a
/// majority, for shard 0) was told its address: a backup's copy it takes over, or — the process served the
/// shard when it stopped — the shard's newest checkpoint in this process's folder.
pub(super) struct Takeover {
    /// The copy taken over, or the shard restored from this process's checkpoint (`restored` says which).
    pub(super) core: ShardCore,
    /// The checkpoint `core` was restored from (None: a copy).
    pub(super) restored: Option<gaps_shard::core::CheckpointInfo>,
    /// This process's index.
    pub(super) process: u32,
    /// The cluster's credential key (the workers' tokens stay valid; None: shard 0's own key file).
    pub(super) key: Option<gaps_common::wire::Token>,
    /// The primary's clock at the copy's last entry: the copy's clock goes on from there.
    pub(super) clock: Duration,
    /// The replica epoch the coordinator granted.
    pub(super) epoch: u64,
    /// The last entry of the primary's log the copy applied.
    pub(super) applied: u64,
    /// The process's part in choosing shard 0's configuration.
    pub(super) quorum: Option<Arc<crate::quorum::Quorum>>,
    pub(super) endpoint: (quinn::Endpoint, net::PathTuning),
}

/// A server starting (boxed: a process that takes a shard over starts a server from within one).
pub(super) type Starting = std::pin::Pin<Box<dyn std::future::Future<Output = Result<RunningServer>> + Send>>;

pub(super) fn start_serving(cfg: ServiceConfig, takeover: Option<Takeover>) -> Starting {
    Box::pin(start_serving_now(cfg, takeover))
}

pub(super) async fn start_serving_now(mut cfg: ServiceConfig, takeover: Option<Takeover>) -> Result<RunningServer> {
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
    let takes_over = takeover.is_some();
    let (taken, taken_key, taken_clock, bound, replica_epoch, taken_index, taken_quorum) = match takeover {
        Some(t) => {
            (Some((t.core, t.restored)), t.key, Some(t.clock), Some(t.endpoint), t.epoch, t.applied, Some(t.quorum))
        }
        None => (None, None, None, None, 0, 0, None),
    };
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
    // The coordinator's address as this process was given it (its own on shard 0: a `--coordinator` given to
    // process 0 only says which shard process to ask where the coordinator is now).
    let coordinator_addr = match &cfg.coordinator {
        Some(given) if shard != 0 => given.clone(),
        _ => advertise.clone(),
    };
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
    let (mut core, restored) = match taken {
        Some(taken) => taken,
        None => initial_core(&cfg, shard, store.as_ref())?,
    };
    // The coordinator's tables restored by a process that started again: its copies are gone.
    if shard == 0 && restored.is_some() {
        core.serving_restored(process);
    }
    let journal = set_up_dealer(&mut core, &cfg, shard, store.as_ref(), restored.is_some())?;
    // Pull replies go out as the core packs them (16-bit values converted straight from the parameters).
    core.set_packed_replies(true);
    // f32 replies share the parameters rather than copying them on the core's thread.
    core.set_shared_replies(true);
    set_up_device(&mut core, &cfg, shard)?;
    // One acceptor per process: a shard taken over here shares the process's.
    let quorum = match taken_quorum {
        Some(q) => q,
        None => open_quorum(&cfg, process, &coordinator_addr)?,
    };
    // While it starts, the process answers the others where it knows the coordinator to be (holding no copy)
    // and takes part in choosing shard 0's configuration (a whole cluster starting again chooses so).
    let answering = match (&quorum, takes_over) {
        (Some(q), false) => Some(super::starting::Answering::start(endpoint.clone(), q.clone(), own.cluster.clone())),
        _ => None,
    };
    // Where a majority chooses shard 0's configuration, the coordinator is where the last one this process
    // knows put it (the address given at start until a takeover) or, newer, the one the process at
    // `--coordinator` knows.
    let mut asked = None;
    if let (Some(q), Some(ask), false) = (&quorum, &cfg.coordinator, takes_over) {
        asked = learn_where_the_coordinator_is(&endpoint, ask, &own.cluster, q).await;
    }
    // The process that served shard 0 when it stopped (process 0, or one that took it over) serves it again
    // only once a majority chose so; else it comes back without it.
    let mut coordinator_here = None;
    if let (Some(q), false) = (&quorum, takes_over) {
        let last = q.chosen();
        if last.serving == process && (last.version > 0 || (shard == 0 && restored.is_some())) {
            report("asking the shard processes who serves shard 0");
            let start = ServedShard0 { cfg: &cfg, own: &own, quorum: q, advertise: &advertise, asked: asked.clone() };
            coordinator_here = start.settle(&endpoint, core.process_addrs()).await?;
        }
    }
    let chosen = quorum.as_ref().map(|q| q.chosen()).filter(|c| c.version > 0);
    // A process whose shard was taken over while it was down comes back as a spare: it serves no shard
    // (its own answers `Moved`) and keeps copies of others, its old shard's among them.
    let mut spare = false;
    let mut resume = Vec::new();
    let join_at = match (&chosen, shard, takes_over) {
        (_, _, true) => None,
        // Process 0 joins another serving shard 0 as a spare.
        (Some(c), 0, false) => (c.serving != 0).then(|| (c.addr.clone(), c.serving)),
        (None, 0, false) => None,
        (Some(c), _, false) => Some((c.addr.clone(), c.serving)),
        (None, _, false) => {
            Some((cfg.coordinator.clone().context("shards other than 0 need --coordinator (shard 0's address)")?, 0))
        }
    };
    let auth_key = if let Some(key) = taken_key {
        key
    } else if let Some((coordinator, serving)) = join_at {
        report("joining the coordinator");
        // Whom to ask where the coordinator is while it is silent: the process `--coordinator` names, and the
        // processes a restored coordinator's tables list (process 0's).
        let asks: Vec<String> = cfg
            .coordinator
            .iter()
            .cloned()
            .chain(core.process_addrs().into_iter().map(|(_, a)| a))
            .filter(|a| *a != advertise)
            .collect();
        let ask = (asks.as_slice(), quorum.as_ref());
        let map =
            join_coordinator(&endpoint, (&coordinator, serving), &own.cluster, &mut core, (cfg.join_timeout, ask))
                .await?;
        let key = map.auth_key.context("the coordinator sent no credential key")?;
        let served_elsewhere = map.shards.iter().any(|s| s.index == shard && s.process != shard);
        if served_elsewhere && cfg.replicas < 2 {
            bail!("shard {shard} was taken over by another shard process while this one was down; start it with --replicas as the cluster's to keep copies");
        }
        // Listed as a spare while its shard is still its own: a backup in sync holds more (it waits for it to
        // take the shard over, or has it granted back where that backup started again too).
        let waits = !served_elsewhere && map.spare.iter().any(|s| s.index == shard);
        spare = served_elsewhere || waits;
        // Shards this process served when it stopped (shard 0's is settled above): served again from its
        // checkpoints once the coordinator grants it.
        resume = map
            .shards
            .iter()
            .filter(|s| s.process == process && (s.index != shard || waits) && s.index != 0)
            .map(|s| (s.index, s.epoch))
            .collect();
        key
    } else {
        // The coordinator's key outlives a restart with its checkpoints (the tokens it gave stay valid).
        match &store {
            Some(store) => crate::auth::load_or_create_key(store.dir())?,
            None => crate::auth::random_key()?,
        }
    };
    // A shard taken over or served again keeps the cluster's key in its folder (shard 0's, restored later).
    if let (true, Some(store)) = (takes_over && shard == 0, &store) {
        crate::auth::keep_key(store.dir(), &auth_key)?;
    }
    let credentials = Credentials::new(auth_key, core.epoch());
    let widest = core.config().layout.tables.iter().map(|t| u64::from(t.dim)).max();
    let read_echo = core.needs_read();
    let mut max_payload_bytes = payload_limit(&core.config().layout, core.owned_elems() as u64, read_echo);
    let backups = match cfg.replicas {
        _ if takes_over => None,
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
    let rotated = Arc::new(std::sync::Mutex::new(None));
    let link = crate::link::CoordinatorLink::new(
        coordinator_addr.clone(),
        own.cluster.clone(),
        endpoint.clone(),
        rotated.clone(),
        quorum.clone(),
    );
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
        rotated,
        link: link.clone(),
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
        tables_changed: tokio::sync::Notify::new(),
        next_checkpoint: AtomicU64::new(match &store {
            Some(s) => s.next_id()?.max(restored.as_ref().map_or(0, |r| r.id + 1)),
            None => 1,
        }),
        store,
        checkpoint_lock: tokio::sync::Mutex::new(Vec::new()),
        cluster_lock: tokio::sync::Mutex::new(()),
        device: cfg.device,
        device_worker_slots: cfg.device_worker_slots,
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
        taken_over: std::sync::Mutex::new(coordinator_here.into_iter().collect()),
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    if let Some(every) = cfg.checkpoint.as_ref().and_then(|c| c.every) {
        spawn_checkpoint_schedule(shared.clone(), every, shutdown_rx.clone());
    }
    if shard == 0 && cfg.replicas > 1 && shared.store.is_some() {
        spawn_table_checkpoints(shared.clone(), shutdown_rx.clone());
        // Shard 0 served by another process than before (a copy taken over, or served again from a
        // checkpoint): its folder holds a checkpoint of it at once.
        if takes_over {
            shared.tables_changed.notify_one();
        }
    }
    if let (Some(info), true, false) = (&restored, cfg.core.modes.mode != gaps_shard::Mode::Async, spare) {
        // Consistent recovery: every shard goes back to one cluster checkpoint (async keeps the cheaper
        // per-shard restore, see docs/guide/recovery.md).
        tokio::spawn(roll_back_cluster_after_restore(shared.clone(), info.id, shutdown_rx.clone()));
    }
    if let Some(log) = &log {
        let queue = shared.queue.clone();
        let ctx = Arc::new(crate::replication::ShipContext {
            shard,
            link: link.clone(),
            ack_timeout: cfg.replica_ack_timeout,
            process,
            advertise: advertise.clone(),
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
    if !resume.is_empty() {
        let resuming = resume_shards(shared.clone(), cfg.clone(), link.clone(), resume, shutdown_rx.clone());
        tokio::spawn(resuming.instrument(tracing::info_span!("resume", process)));
    }
    if shared.backups.is_some() {
        let watch = watch_primaries(shared.clone(), cfg.clone(), link, shutdown_rx.clone());
        tokio::spawn(watch.instrument(tracing::info_span!("takeover", process)));
    }
    if let Some(answering) = answering {
        answering.stop().await;
    }
    let task = tokio::spawn(
        serve(endpoint, shared.clone(), shutdown_rx, cfg.tick_interval).instrument(tracing::info_span!("shard", shard)),
    );
    if let Some(h) = &health {
        report_serving(h, shared.clone());
    }
    info!(shard, %addr, %advertise, "serving");
    Ok(RunningServer { addr, advertise, restored, shutdown: shutdown_tx, task, shared, health })
}

/// The largest request payload a shard of `layout` owning `owned` floats takes: a push never carries more than
/// the shard owns (twice that with the read echo), sparse requests are bounded by rows per RPC (ids,
/// versions, gradients and read rows of the widest table); bigger frames are refused before they are
/// allocated.
pub(super) fn payload_limit(layout: &gaps_common::Layout, owned: u64, read_echo: bool) -> u64 {
    let owned_bytes = owned * 4;
    let echo = 1 + u64::from(read_echo);
    let widest = layout.tables.iter().map(|t| u64::from(t.dim)).max();
    let sparse_bytes = widest.map_or(0, |dim| MAX_SPARSE_ROWS_PER_RPC * (3 + 2 * dim) * 4);
    (owned_bytes * echo).max(sparse_bytes).clamp(4, gaps_common::wire::DEFAULT_MAX_PAYLOAD_BYTES)
}

/// Asks the shard process at `addr` where the coordinator is and adopts its answer if it is newer than what
/// `quorum` knows (a process that restarts after shard 0 was taken over learns so; within 5 s, else it goes
/// on with what it knows). Returns the process that answered, with `addr`.
pub(super) async fn learn_where_the_coordinator_is(
    endpoint: &quinn::Endpoint,
    addr: &str,
    cluster: &str,
    quorum: &Arc<crate::quorum::Quorum>,
) -> Option<(u32, String)> {
    match net::coordinator_where(endpoint, None, addr, (cluster, None), Duration::from_secs(5)).await {
        Ok((process, at)) => {
            let c = at.config;
            if c.version > quorum.chosen().version {
                info!(version = c.version, serving = c.serving, addr = %c.addr, "learned where the coordinator is now");
            }
            quorum.learn(&c).await;
            Some((process, addr.to_string()))
        }
        Err(e) => {
            warn!(%addr, error = %e, "could not ask where the coordinator is; going on with what this process knows");
            None
        }
    }
}

/// Joins the coordinator at `coordinator` (served by shard process `serving`); returns its map (with the
/// cluster's credential key). Where a majority moves the coordinator (`quorum`), a process that answers
/// `Moved` (it no longer serves shard 0) is asked where the coordinator is now, and the join goes there;
/// while the coordinator does not answer (a whole cluster starting again: a process serving shard 0 before
/// may serve it at a new address), the processes at `asks` are asked where it is, one a second in turn. A
/// process still starting answers `Busy`: the join tries again until `timeout`.
pub(super) async fn join_coordinator(
    endpoint: &quinn::Endpoint,
    (coordinator, serving): (&str, u32),
    cluster: &str,
    core: &mut ShardCore,
    (timeout, (asks, quorum)): (Duration, (&[String], Option<&Arc<crate::quorum::Quorum>>)),
) -> Result<gaps_common::wire::ClusterMap> {
    let started = Instant::now();
    let request = core.join_request();
    let limits = Limits::default();
    let (mut coordinator, mut serving, mut redirects) = (coordinator.to_string(), serving, 0);
    let (mut asked_at, mut turn): (Option<Instant>, usize) = (None, 0);
    loop {
        // A configuration chosen meanwhile (every process is told) moves the coordinator.
        if let Some(now) = quorum.map(|q| q.chosen()).filter(|c| c.version > 0) {
            if (now.addr.as_str(), now.serving) != (coordinator.as_str(), serving) {
                info!(from = %coordinator, to = %now.addr, serving = now.serving, "the coordinator is elsewhere now: joining there");
                (coordinator, serving) = (now.addr, now.serving);
            }
        }
        let attempt = async {
            let addr = net::resolve(&coordinator).await?;
            // Where the coordinator can move, a dead address is given up sooner (asked anew, above).
            let connect_wait = Duration::from_secs(if quorum.is_some() { 2 } else { 5 });
            let conn = net::connect(endpoint, addr, connect_wait).await?;
            net::expect_shard(&conn, cluster, serving)?;
            let reply = net::call(&conn, &request, &[], &limits, Duration::from_secs(10)).await;
            conn.close(0u32.into(), b"joined");
            reply
        };
        let last = match attempt.await {
            Ok(Frame { msg: Message::ClusterMap(map), .. }) => {
                core.joined(&map).map_err(|e| anyhow!("joining the coordinator at {coordinator}: {e}"))?;
                info!(shard = core.config().shard, epoch = map.epoch, "joined the coordinator");
                return Ok(map);
            }
            Ok(other) => bail!("the coordinator at {coordinator} answered with {}", net::kind_name(&other.msg)),
            Err(RpcError::Remote { code: ErrorCode::Moved, .. }) if quorum.is_some() && redirects < 3 => {
                let q = quorum.expect("checked above");
                learn_where_the_coordinator_is(endpoint, &coordinator, cluster, q).await;
                let now = q.chosen();
                if (now.addr.as_str(), now.serving) != (coordinator.as_str(), serving) {
                    info!(from = %coordinator, to = %now.addr, serving = now.serving, "the coordinator moved: joining there");
                    (coordinator, serving, redirects) = (now.addr, now.serving, redirects + 1);
                    continue;
                }
                // A takeover under way: nothing newer is known yet; tried again until the join timeout.
                format!("the coordinator at {coordinator} no longer serves shard 0 and says nothing newer yet")
            }
            // A shard process that is starting answers nothing else yet.
            Err(RpcError::Remote { code: ErrorCode::Busy, message, .. }) => message,
            Err(e @ (RpcError::Remote { .. } | RpcError::Identity { .. })) => {
                bail!("the coordinator refused this shard: {e}")
            }
            Err(e) => {
                if let (Some(q), false) = (quorum, asks.is_empty()) {
                    if asked_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                        asked_at = Some(Instant::now());
                        learn_where_the_coordinator_is(endpoint, &asks[turn % asks.len()], cluster, q).await;
                        turn += 1;
                    }
                }
                e.to_string()
            }
        };
        if started.elapsed() >= timeout {
            bail!("could not reach the coordinator at {coordinator} within {timeout:?}: {last}");
        }
        debug!(%last, "coordinator not reachable yet");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// This process's part in choosing shard 0's configuration, where a majority chooses it: its acceptor as its
/// folder kept it, or one that knows the start (process 0 serving shard 0 at `coordinator`).
fn open_quorum(cfg: &ServiceConfig, process: u32, coordinator: &str) -> Result<Option<Arc<crate::quorum::Quorum>>> {
    if !crate::quorum::enabled(cfg.replicas, cfg.core.num_shards) {
        return Ok(None);
    }
    let dir = cfg.checkpoint.as_ref().map(|c| c.dir.as_path());
    if dir.is_none() {
        warn!(
            process,
            "no --checkpoint-dir: this process's part in choosing shard 0's configuration lives in memory only \
             (restarted during a choice, it could answer twice)"
        );
    }
    Ok(Some(Arc::new(crate::quorum::Quorum::open(process, cfg.core.num_shards, coordinator, dir)?)))
}

/// The core a shard starts with: the checkpoint `--restore` names (or the newest in the store), or a fresh
/// one.
pub(super) fn initial_core(
    cfg: &ServiceConfig,
    shard: u32,
    store: Option<&CheckpointStore>,
) -> Result<(ShardCore, Option<gaps_shard::core::CheckpointInfo>)> {
    let snapshot = match (&cfg.restore, store) {
        (Restore::Never, _) | (Restore::Auto, None) => None,
        (Restore::Auto, Some(store)) => store.latest()?.map(|found| (found.path, found.bytes)),
        (Restore::Path(path), _) => Some((path.clone(), crate::checkpoint::load_path(path)?)),
    };
    Ok(match snapshot {
        Some((path, bytes)) => {
            let (core, info) = ShardCore::checkpoint_info(&bytes)
                .and_then(|info| ShardCore::restore(cfg.core.clone(), &bytes).map(|core| (core, info)))
                .map_err(|e| anyhow!("restoring shard {shard} from {}: {e}", path.display()))?;
            info!(shard, checkpoint = info.id, path = %path.display(), versions = ?info.tensor_versions, "restored");
            (core, Some(info))
        }
        None => (ShardCore::new(cfg.core.clone()).map_err(|e| anyhow!("configuring shard {shard}: {e}"))?, None),
    })
}

/// The coordinator's dealer of `--data` (other shards keep it only for their copy of the coordinator): in
/// async with checkpoints, its journal, which a restored dealer (`restored`) replays.
pub(super) fn set_up_dealer(
    core: &mut ShardCore,
    cfg: &ServiceConfig,
    shard: u32,
    store: Option<&CheckpointStore>,
    restored: bool,
) -> Result<Option<std::fs::File>> {
    let mut journal = None;
    // Other shards keep `--data` only for their copy of the coordinator.
    if let Some(data) = cfg.data.clone().filter(|_| shard == 0) {
        match (store, cfg.core.modes.mode == gaps_shard::Mode::Async && shard == 0) {
            // Async: the dealer's changes go to a journal beside the checkpoints, and a restored dealer makes
            // again those made after its checkpoint (the other shards kept what was trained since).
            (Some(store), true) => {
                let fingerprint = data.table.fingerprint();
                let past = match restored {
                    true => crate::journal::read(store.dir(), fingerprint).unwrap_or_else(|why| {
                        warn!(%why, "the dealer journal is not used: splits finished since the checkpoint are dealt again");
                        Vec::new()
                    }),
                    false => Vec::new(),
                };
                let replayed = core
                    .set_dealer_replaying(data, Some(&past))
                    .map_err(|e| anyhow!("shard {shard}: dealing data: {e}"))?;
                let mut kept = match replayed {
                    Ok(changes) => {
                        if restored {
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
                if let Some(store) = store.filter(|_| shard == 0) {
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
    Ok(journal)
}

/// Moves the dense state onto the GPU `--device` picks, if any.
pub(super) fn set_up_device(core: &mut ShardCore, cfg: &ServiceConfig, shard: u32) -> Result<()> {
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
    Ok(())
}

/// Checkpoints every `every`: the coordinator's cluster ones; another shard's own only when none came from
/// the coordinator for twice that.
pub(super) fn spawn_checkpoint_schedule(shared: Arc<Shared>, every: Duration, mut stop: watch::Receiver<bool>) {
    if shared.shard != 0 {
        info!(
            shard = shared.shard,
            "checkpoints follow the coordinator's schedule (this shard takes its own only if none comes)"
        );
    }
    tokio::spawn(async move {
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = interval.tick() => {}
            }
            // A process that no longer serves this shard (another took it over) keeps no checkpoints of it.
            if shared.log.as_ref().is_some_and(|l| l.fenced()) {
                continue;
            }
            if shared.shard == 0 {
                if let Err(e) = cluster_checkpoint(&shared).await {
                    warn!(error = format!("{e:#}"), "the cluster checkpoint is incomplete");
                }
                continue;
            }
            // Shards ≥ 1 checkpoint when the coordinator asks; on their own only when it has not asked for
            // twice the interval (it is down, or has no schedule of its own).
            let since = shared.started.elapsed().as_millis() as u64 - shared.last_checkpoint_ms.load(Ordering::Relaxed);
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

/// On the coordinator of replicated shards: a checkpoint of its own as soon as who serves which shard
/// changed (a promotion, a shard joining, a backup newly in sync, shard 0 served by this process), so that a coordinator restored from its checkpoints — the whole
/// cluster started again — knows every takeover (the cluster's scheduled checkpoints wait for every shard,
/// a dead one too). Changes that come together share one checkpoint.
pub(super) fn spawn_table_checkpoints(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = shared.tables_changed.notified() => {}
            }
            if shared.log.as_ref().is_some_and(|l| l.fenced()) {
                continue;
            }
            if let Err(e) = take_checkpoint(&shared, None, CheckpointAt::Quiescent).await {
                warn!(error = %e, "could not checkpoint the coordinator's tables after a change");
            }
        }
    });
}

/// Tells the health endpoint that the shard serves, with a probe that its core's thread answers.
pub(super) fn report_serving(h: &crate::metrics::Health, shared: Arc<Shared>) {
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
