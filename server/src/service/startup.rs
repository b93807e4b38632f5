//! Starting a shard: its core (fresh, restored or a copy taken over), the dealer, the GPU, joining the
//! coordinator, the core's thread and the tasks around it.

use super::*;

/// Binds, joins the cluster (shards ≥ 1) and starts serving.
pub async fn start(cfg: ServiceConfig) -> Result<RunningServer> {
    start_serving(cfg, None).await
}

/// A backup's copy of a shard that this process takes over (replicated shards): served with the process's
/// own certificate on an endpoint of its own, bound before the coordinator was told its address.
pub(super) struct Takeover {
    pub(super) core: ShardCore,
    /// This process's index.
    pub(super) process: u32,
    /// The cluster's credential key (the workers' tokens stay valid).
    pub(super) key: gaps_common::wire::Token,
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
    let (mut core, restored) = initial_core(&cfg, shard, store.as_ref(), taken_core)?;
    let journal = set_up_dealer(&mut core, &cfg, shard, store.as_ref(), restored.is_some())?;
    // Pull replies go out as the core packs them (16-bit values converted straight from the parameters).
    core.set_packed_replies(true);
    // f32 replies share the parameters rather than copying them on the core's thread.
    core.set_shared_replies(true);
    set_up_device(&mut core, &cfg, shard)?;
    // One acceptor per process: a shard taken over here shares the process's.
    let quorum = match taken_quorum {
        Some(q) => q,
        None if crate::quorum::enabled(cfg.replicas, cfg.core.num_shards) => {
            let dir = cfg.checkpoint.as_ref().map(|c| c.dir.as_path());
            if dir.is_none() {
                warn!(
                    process,
                    "no --checkpoint-dir: this process's part in choosing shard 0's configuration lives in memory \
                     only (restarted during a choice, it could answer twice)"
                );
            }
            Some(Arc::new(crate::quorum::Quorum::open(process, cfg.core.num_shards, &coordinator_addr, dir)?))
        }
        None => None,
    };
    // Where a majority chooses shard 0's configuration, the coordinator is where the last one this process
    // knows put it (the address given at start until a takeover) or, newer, the one the process at
    // `--coordinator` knows.
    let mut asked = None;
    if let (Some(q), Some(ask), false) = (&quorum, &cfg.coordinator, taken_core_given) {
        asked = learn_where_the_coordinator_is(&endpoint, ask, &own.cluster, q).await;
    }
    // Process 0 started again (restored, or its acceptor knows configurations chosen since the start) serves
    // shard 0 only once a majority chose so; else it comes back as a spare.
    if let (Some(q), 0, false) = (&quorum, shard, taken_core_given) {
        if restored.is_some() || q.chosen().version > 0 {
            report("asking the shard processes who serves shard 0");
            // The processes the restored tables list, and the one `--coordinator` named.
            let mut peers = core.process_addrs();
            peers.extend(asked.clone().filter(|(p, _)| !peers.iter().any(|(q, _)| q == p)));
            settle_coordinator_restart(
                &endpoint,
                &own.cluster,
                q,
                (peers, asked.is_some()),
                &advertise,
                cfg.join_timeout,
            )
            .await?;
        }
    }
    let moved_coordinator = quorum.as_ref().map(|q| q.chosen()).filter(|c| c.version > 0 && c.serving != process);
    // A process whose shard was taken over while it was down comes back as a spare: it serves no shard
    // (its own answers `Moved`) and keeps copies of others, its old shard's among them.
    let mut spare = false;
    let auth_key = if let Some(key) = taken_key {
        key
    } else if shard != 0 || moved_coordinator.is_some() {
        report("joining the coordinator");
        let (coordinator, serving) = match &moved_coordinator {
            Some(c) => (c.addr.clone(), c.serving),
            None => (cfg.coordinator.clone().context("shards other than 0 need --coordinator (shard 0's address)")?, 0),
        };
        let (key, served_elsewhere) = join_coordinator(
            &endpoint,
            (&coordinator, serving),
            &own.cluster,
            &mut core,
            (cfg.join_timeout, quorum.as_ref()),
        )
        .await?;
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
        taken_over: std::sync::Mutex::new(Vec::new()),
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    if let Some(every) = cfg.checkpoint.as_ref().and_then(|c| c.every) {
        spawn_checkpoint_schedule(shared.clone(), every, shutdown_rx.clone());
    }
    if let (Some(info), true, false) = (&restored, cfg.core.modes.mode != gaps_shard::Mode::Async, spare) {
        // Consistent recovery: every shard goes back to one cluster checkpoint (async keeps the cheaper
        // per-shard restore, see docs/manual.md, "Failures and recovery").
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
    if shared.backups.is_some() {
        let watch = watch_primaries(shared.clone(), cfg.clone(), link, shutdown_rx.clone());
        tokio::spawn(watch.instrument(tracing::info_span!("takeover", process)));
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

/// Process 0 started again where a majority chooses shard 0's configuration: it must not serve shard 0 on
/// its own say-so — a backup in sync may hold what it acknowledged since its checkpoint, or may have taken
/// shard 0 over while it was down. It asks the shard processes its restored tables list (`processes`) for the newest
/// configuration until one names another process serving shard 0 (it then joins that one as a spare), or
/// names this one with no backup in sync — then it has a configuration that has it serve at `advertise`
/// chosen (no backup held more than its checkpoint: what was acknowledged since is lost, as without
/// copies). While backups in sync are listed it waits for one of them to take shard 0 over. Where no other
/// process answers at all for [`RESTART_QUIET`], the whole cluster is starting again (the others wait to
/// join this one): it serves from its own state, as before a majority chose. Fails after `timeout`.
pub(super) async fn settle_coordinator_restart(
    endpoint: &quinn::Endpoint,
    cluster: &str,
    quorum: &Arc<crate::quorum::Quorum>,
    (processes, answered): (Vec<(u32, String)>, bool),
    advertise: &str,
    timeout: Duration,
) -> Result<()> {
    let me = quorum.process();
    let peers: Vec<(u32, String)> = processes.into_iter().filter(|(p, _)| *p != me).collect();
    let started = quorum.chosen();
    if peers.is_empty() {
        if started.serving != me {
            // The caller joins the process serving it.
            return Ok(());
        }
        bail!(
            "shard 0's configuration moved on from the start (version {}) but this process knows no other shard              process to ask who serves shard 0 now (no checkpoint with the coordinator's tables): start it with              --coordinator naming any shard process",
            started.version
        );
    }
    let rotated = Arc::new(std::sync::Mutex::new(None));
    let link = crate::link::CoordinatorLink::new(
        advertise.to_string(),
        cluster.to_string(),
        endpoint.clone(),
        rotated,
        Some(quorum.clone()),
    );
    link.remember(peers.clone());
    let deadline = Instant::now() + timeout;
    let (mut said, began) = (false, Instant::now());
    // The process `--coordinator` named answering counts: the cluster is not starting again as a whole.
    let mut heard_any = answered;
    loop {
        heard_any |= link.locate_heard().await.1;
        // No other shard process answers at all: the cluster is starting again as a whole (they wait to join
        // this one) — or this one is cut off from them. Nobody holds more of shard 0 than this process's
        // checkpoint then, and it serves from it as without a majority (a majority cut off from it that
        // took shard 0 over is the risk this leaves; it is the same as before processes chose).
        if !heard_any && began.elapsed() >= RESTART_QUIET {
            warn!(
                waited = ?RESTART_QUIET,
                "no other shard process answers: serving shard 0 from this process's own state (the cluster is \
                 starting again as a whole)"
            );
            return Ok(());
        }
        let base = quorum.chosen();
        if base.serving != me {
            info!(version = base.version, serving = base.serving, "another shard process serves shard 0 now");
            return Ok(());
        }
        if base.in_sync.is_empty() {
            match quorum.propose_serving(advertise, &peers, &link).await {
                Ok((c, true)) => {
                    info!(version = c.version, "serving shard 0 again, a majority of the shard processes chose so");
                    return Ok(());
                }
                Ok(_) => continue,
                Err(e) => {
                    warn!(error = format!("{e:#}"), "could not have this process chosen to serve shard 0; trying again")
                }
            }
        } else if !said {
            info!(
                in_sync = ?base.in_sync,
                "shard 0's backups in sync hold what it acknowledged: waiting for one of them to take it over"
            );
            said = true;
        }
        if Instant::now() >= deadline {
            bail!(
                "within {timeout:?}, no majority of the shard processes chose who serves shard 0 now (last known:                  configuration {}, process {} with backups {:?} in sync)",
                base.version,
                base.serving,
                base.in_sync
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How long a restarted process 0 waits for any other shard process to answer before it takes the cluster
/// to be starting again as a whole ([`settle_coordinator_restart`]).
const RESTART_QUIET: Duration = Duration::from_secs(10);

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
        Ok((process, c)) => {
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

/// Joins the coordinator; returns the cluster's credential key it hands to shards. Where a majority moves
/// the coordinator (`quorum`), a process that answers `Moved` (it no longer serves shard 0) is asked where
/// the coordinator is now, and the join goes there (three times at most).
pub(super) async fn join_coordinator(
    endpoint: &quinn::Endpoint,
    (coordinator, serving): (&str, u32),
    cluster: &str,
    core: &mut ShardCore,
    (timeout, quorum): (Duration, Option<&Arc<crate::quorum::Quorum>>),
) -> Result<(gaps_common::wire::Token, bool)> {
    let started = Instant::now();
    let request = core.join_request();
    let limits = Limits::default();
    let (mut coordinator, mut serving, mut redirects) = (coordinator.to_string(), serving, 0);
    loop {
        let attempt = async {
            let addr = net::resolve(&coordinator).await?;
            let conn = net::connect(endpoint, addr, Duration::from_secs(5)).await?;
            net::expect_shard(&conn, cluster, serving)?;
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

/// The core a shard starts with: a copy taken over, the checkpoint `--restore` names (or the newest in the
/// store), or a fresh one.
pub(super) fn initial_core(
    cfg: &ServiceConfig,
    shard: u32,
    store: Option<&CheckpointStore>,
    taken_core: Option<ShardCore>,
) -> Result<(ShardCore, Option<gaps_shard::core::CheckpointInfo>)> {
    let snapshot = match (&cfg.restore, store) {
        (Restore::Never, _) | (Restore::Auto, None) => None,
        (Restore::Auto, Some(store)) => store.latest()?.map(|found| (found.path, found.bytes)),
        (Restore::Path(path), _) => Some((path.clone(), crate::checkpoint::load_path(path)?)),
    };
    Ok(match (taken_core, snapshot) {
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
