//! Starting a shard: its core (fresh, restored or a copy taken over), the dealer, the GPU, joining the
//! coordinator, the core's thread and the tasks around it.

use super::*;
use gaps_shard::schedule::{CheckpointSchedule, Due};

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
    let process = takeover.as_ref().map_or(cfg.core.shard, |t| t.process);
    let own = check_start(&cfg, process)?;
    let takes_over = takeover.is_some();
    let given = Given::of(takeover);
    let (endpoint, path) = match given.bound {
        Some(bound) => bound,
        None => net::server_endpoint(cfg.listen, &cfg.tls)?,
    };
    let (addr, advertise) = advertised(&endpoint, &cfg)?;
    cfg.core.advertise = advertise.clone();
    let shard = cfg.core.shard;
    // The coordinator's address as this process was given it (its own on shard 0: a `--coordinator` given to
    // process 0 only says which shard process to ask where the coordinator is now).
    let coordinator_addr = match &cfg.coordinator {
        Some(given) if shard != 0 => given.clone(),
        _ => advertise.clone(),
    };
    let health = cfg.health.clone();
    report(&health, "restoring");
    let store = match &cfg.checkpoint {
        Some(c) => Some(CheckpointStore::open(&c.dir, shard, c.keep)?),
        None => None,
    };
    let (mut core, restored, journal) = core_to_serve(&cfg, process, given.taken, store.as_ref())?;
    // One acceptor per process: a shard taken over here shares the process's.
    let quorum = match given.quorum {
        Some(q) => q,
        None => open_quorum(&cfg, process, &coordinator_addr)?,
    };
    // While it starts, the process answers the others where it knows the coordinator to be (holding no copy)
    // and takes part in choosing shard 0's configuration (a whole cluster starting again chooses so).
    let answering = match (&quorum, takes_over) {
        (Some(q), false) => Some(super::starting::Answering::start(endpoint.clone(), q.clone(), own.cluster.clone())),
        _ => None,
    };
    let place = Place { endpoint: &endpoint, own: &own, advertise: &advertise, process, takes_over, health: &health };
    let coordinator_here = match (&quorum, takes_over) {
        (Some(q), false) => shard0_here(&cfg, &place, q, restored.is_some(), core.process_addrs()).await?,
        _ => None,
    };
    let chosen = quorum.as_ref().map(|q| q.chosen()).filter(|c| c.version > 0);
    let joined = match given.key {
        Some(key) => Joined { auth_key: key, spare: false, resume: Vec::new() },
        None => join_cluster(&cfg, &place, chosen.as_ref(), &mut core, quorum.as_ref(), store.as_ref()).await?,
    };
    let Joined { auth_key, spare, resume } = joined;
    // A shard taken over or served again keeps the cluster's key in its folder (shard 0's, restored later).
    if let (true, Some(store)) = (takes_over && shard == 0, &store) {
        crate::auth::keep_key(store.dir(), &auth_key)?;
    }
    let credentials = Credentials::new(auth_key, core.epoch());
    let read_echo = core.needs_read();
    let mut max_payload_bytes = payload_limit(&core.config().layout, core.owned_elems() as u64, read_echo);
    let backups = match cfg.replicas {
        _ if takes_over => None,
        0 | 1 => None,
        r => Some(copies_kept(&cfg, r, spare, read_echo)),
    };
    if let Some(b) = &backups {
        max_payload_bytes = max_payload_bytes.max(b.largest_request());
    }
    let log = replica_log(&cfg, spare, &resume);
    let chunk_elems = u64::from(core.config().layout.chunk_elems);
    let widest_table = core.config().layout.tables.iter().map(|t| u64::from(t.dim)).max().unwrap_or(0);
    let (queue, started) = start_core_thread(&cfg, core, (process, given.applied, given.clock), journal, log.clone())?;
    let parts = SharedParts {
        queue,
        endpoint: endpoint.clone(),
        path,
        started,
        own,
        coordinator_addr,
        quorum: quorum.clone(),
        credentials,
        store,
        restored_id: restored.as_ref().map(|r| r.id),
        max_payload_bytes,
        chunk_elems,
        widest_table,
        log: log.clone(),
        backups,
        advertise: advertise.clone(),
        coordinator_here,
    };
    let shared = Arc::new(shared_state(&cfg, parts)?);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let background = Background { restored: restored.as_ref(), spare, takes_over, process, epoch: given.epoch };
    spawn_background(&shared, &cfg, background, log, resume, &shutdown_rx);
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
            let (mut core, info) = ShardCore::checkpoint_info(&bytes)
                .and_then(|info| ShardCore::restore(cfg.core.clone(), &bytes).map(|core| (core, info)))
                .map_err(|e| anyhow!("restoring shard {shard} from {}: {e}", path.display()))?;
            core.restarted();
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
        // The schedule is the shard crate's (the test network runs the same one on its virtual clock).
        let mut schedule = CheckpointSchedule::new(shared.shard, every, shared.started.elapsed());
        loop {
            let deadline = tokio::time::Instant::from_std(shared.started + schedule.next_deadline());
            tokio::select! {
                _ = stop.changed() => return,
                _ = tokio::time::sleep_until(deadline) => {}
            }
            let last = Duration::from_millis(shared.last_checkpoint_ms.load(Ordering::Relaxed));
            let due = schedule.poll(shared.started.elapsed(), last);
            // A process that no longer serves this shard (another took it over) keeps no checkpoints of it.
            if shared.log.as_ref().is_some_and(|l| l.fenced()) {
                continue;
            }
            match due {
                Some(Due::Cluster) => {
                    if let Err(e) = cluster_checkpoint(&shared).await {
                        warn!(error = format!("{e:#}"), "the cluster checkpoint is incomplete");
                    }
                }
                // Shards ≥ 1 checkpoint when the coordinator asks; on their own only when it has not asked
                // for twice the interval (it is down, or has no schedule of its own).
                Some(Due::Own) => match take_checkpoint(&shared, None, CheckpointAt::Quiescent).await {
                    Ok(w) => warn!(
                        shard = shared.shard,
                        id = w.id,
                        "no cluster checkpoint came from the coordinator; took one on this shard's own schedule"
                    ),
                    Err(e) => warn!(shard = shared.shard, error = %e, "writing a checkpoint failed"),
                },
                None => {}
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
