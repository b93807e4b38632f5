//! A shard process started again that served shards besides its own when it stopped (replicated shards,
//! docs/replication.md, "Starting again"): shard 0, settled by a majority of the shard processes, and other
//! shards it took over, which the coordinator grants back — each served from this process's newest
//! checkpoint of it, at a new address, once no backup in sync may hold more of it.

use super::*;

/// How long one shard process is given to say which copies it holds.
const ASK_WAIT: Duration = Duration::from_millis(1500);

/// The process that served shard 0 when it stopped, as its acceptor knows, starting again.
pub(super) struct ServedShard0<'a> {
    pub(super) cfg: &'a ServiceConfig,
    pub(super) own: &'a PeerIdentity,
    pub(super) quorum: &'a Arc<crate::quorum::Quorum>,
    /// This process's own address.
    pub(super) advertise: &'a str,
    /// The process `--coordinator` named, where it answered.
    pub(super) asked: Option<(u32, String)>,
}

impl ServedShard0<'_> {
    /// Settles who serves shard 0 ([`settle_coordinator_restart`]). Process 0 serves it on its own endpoint
    /// (`listed`: the processes its core, restored from its checkpoint, lists); another process serves it on
    /// an endpoint of its own from its folder's newest checkpoint of shard 0, which this starts (returned).
    /// None where process 0 is to serve it, or where another process does now.
    pub(super) async fn settle(
        &self,
        endpoint: &quinn::Endpoint,
        listed: Vec<(u32, String)>,
    ) -> Result<Option<RunningServer>> {
        let process = self.quorum.process();
        let with_asked = |mut peers: Vec<(u32, String)>| {
            peers.extend(self.asked.clone().filter(|(p, _)| !peers.iter().any(|(q, _)| q == p)));
            peers
        };
        if process == 0 {
            let peers = with_asked(listed);
            settle_coordinator_restart(endpoint, self, peers, self.advertise, None).await?;
            return Ok(None);
        }
        // Shard 0 as this process last checkpointed it, and where its tables say the processes listen.
        let c0 = self.shard0_config();
        let store = match &self.cfg.checkpoint {
            Some(c) => Some(CheckpointStore::open(&c.dir, 0, c.keep)?),
            None => None,
        };
        // Reading a checkpoint takes seconds: not on the runtime's thread, which may be the only one.
        let found = match gaps_transport::runtime::compute(|| initial_core(&c0, 0, store.as_ref()))? {
            (core, Some(info)) => Some((core, info)),
            (_, None) => None,
        };
        let peers = with_asked(found.as_ref().map_or_else(Vec::new, |(core, _)| core.process_addrs()));
        let cannot = found.is_none().then(|| match &self.cfg.checkpoint {
            Some(c) => format!(
                "this process served shard 0 when it stopped but {} holds no checkpoint of it: copy the folder \
                 shard-0 of the process that served it before (or its own) there",
                c.dir.display()
            ),
            None => "this process served shard 0 when it stopped but was started without --checkpoint-dir".into(),
        });
        let (bound, addr) = endpoint_beside(self.advertise, self.cfg)?;
        if !settle_coordinator_restart(endpoint, self, peers, &addr, cannot.as_deref()).await? {
            return Ok(None);
        }
        let (mut core, info) = found.context("checked before proposing")?;
        let epoch = core.serve_coordinator_copy(process, &addr).map_err(|e| anyhow!("{e}"))?;
        let mut c = c0;
        c.advertise = Some(addr.clone());
        let takeover = Takeover {
            core,
            restored: Some(info),
            process,
            key: None,
            clock: Duration::ZERO,
            epoch,
            applied: 0,
            quorum: Some(self.quorum.clone()),
            endpoint: bound,
        };
        let server = start_serving(c, Some(takeover)).await?;
        warn!(%addr, epoch, "serving shard 0 again from this process's checkpoint, as a majority chose");
        Ok(Some(server))
    }

    /// This process's configuration for serving shard 0.
    fn shard0_config(&self) -> ServiceConfig {
        let mut c = self.cfg.clone();
        c.core = ShardConfig { shard: 0, ..self.cfg.core.clone() };
        c.coordinator = None;
        c.health = None;
        c.restore = Restore::Auto;
        c
    }
}

/// The process that served shard 0 when it stopped, started again: it must not serve shard 0 on its own say-so
/// — a backup in sync may hold what it acknowledged since its checkpoint, or may have taken shard 0 over
/// while it was down. It asks the shard processes `processes` for the newest configuration until one names
/// another process serving shard 0 (false: it joins that one), or every backup the newest lists in sync says
/// it holds no copy of shard 0 (it started since, as in a whole cluster started again): then it has a
/// configuration that has it serve at `addr` chosen (true; what was acknowledged since its checkpoint is
/// then held by nobody and lost, as without copies). While a backup in sync may hold a copy (it says so, or
/// does not answer) it waits for it to take shard 0 over. `cannot`: why this process could not serve it
/// (it then fails rather than propose). Fails after the join timeout.
async fn settle_coordinator_restart(
    endpoint: &quinn::Endpoint,
    start: &ServedShard0<'_>,
    processes: Vec<(u32, String)>,
    addr: &str,
    cannot: Option<&str>,
) -> Result<bool> {
    let (quorum, cluster, timeout) = (start.quorum, start.own.cluster.as_str(), start.cfg.join_timeout);
    let me = quorum.process();
    let peers: Vec<(u32, String)> = processes.into_iter().filter(|(p, _)| *p != me).collect();
    if quorum.chosen().serving != me {
        return Ok(false);
    }
    if peers.is_empty() {
        bail!(
            "shard 0's configuration moved on from the start (version {}) but this process knows no other shard \
             process to ask who serves shard 0 now (no checkpoint with the coordinator's tables): start it with \
             --coordinator naming any shard process",
            quorum.chosen().version
        );
    }
    let rotated = Arc::new(std::sync::Mutex::new(None));
    let link = crate::link::CoordinatorLink::new(
        addr.to_string(),
        cluster.to_string(),
        endpoint.clone(),
        rotated,
        Some(quorum.clone()),
    );
    link.remember(peers.clone());
    let deadline = Instant::now() + timeout;
    let mut said = Vec::new();
    loop {
        link.locate().await;
        let base = quorum.chosen();
        if base.serving != me {
            info!(version = base.version, serving = base.serving, "another shard process serves shard 0 now");
            return Ok(false);
        }
        let holding = may_hold_shard0(endpoint, cluster, &base.in_sync, &peers).await;
        if holding.is_empty() {
            if let Some(why) = cannot {
                bail!("{why}");
            }
            match quorum.propose_serving(addr, &peers, &link).await {
                Ok((c, true)) => {
                    info!(version = c.version, %addr, "serving shard 0 again, a majority of the shard processes chose so");
                    return Ok(true);
                }
                Ok(_) => continue,
                Err(e) => {
                    warn!(error = format!("{e:#}"), "could not have this process chosen to serve shard 0; trying again")
                }
            }
        } else if said != holding {
            info!(
                version = base.version,
                may_hold = ?holding,
                "shard 0's backups in sync may hold what it acknowledged (they hold a copy, or do not answer): \
                 waiting for one of them to take it over"
            );
            said = holding.clone();
        }
        if Instant::now() >= deadline {
            bail!(
                "within {timeout:?}, shard 0 was neither taken over nor could this process serve it again: \
                 configuration {} lists backups {:?} in sync, and {holding:?} may hold a copy (they say so, or do not \
                 answer); start those processes (a process started again holds no copy)",
                base.version,
                base.in_sync
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Which of `backups` may hold a copy of shard 0: each is asked where the coordinator is, and one that does
/// not answer in time, whose address is unknown, or that lists shard 0 among its copies may.
async fn may_hold_shard0(
    endpoint: &quinn::Endpoint,
    cluster: &str,
    backups: &[u32],
    peers: &[(u32, String)],
) -> Vec<u32> {
    let mut asks = tokio::task::JoinSet::new();
    let mut may = Vec::new();
    for &backup in backups {
        let Some((_, addr)) = peers.iter().find(|(p, _)| *p == backup).cloned() else {
            may.push(backup);
            continue;
        };
        let (endpoint, cluster) = (endpoint.clone(), cluster.to_string());
        asks.spawn(async move {
            let answer = net::coordinator_where(&endpoint, None, &addr, (&cluster, Some(backup)), ASK_WAIT).await;
            (backup, answer.map_or(true, |(_, at)| at.copies.contains(&0)))
        });
    }
    while let Some(joined) = asks.join_next().await {
        if let Ok((backup, true)) = joined {
            may.push(backup);
        }
    }
    may.sort_unstable();
    may
}

/// A new endpoint on this process's IP (a free port) for a shard it serves beside its own, and the address
/// it is advertised at (this process's host, `advertise`'s).
pub(super) fn endpoint_beside(
    advertise: &str,
    cfg: &ServiceConfig,
) -> Result<((quinn::Endpoint, net::PathTuning), String)> {
    let (endpoint, path) = net::server_endpoint(SocketAddr::new(cfg.listen.ip(), 0), &cfg.tls)?;
    let port = endpoint.local_addr().context("reading the bound address")?.port();
    let addr = match advertise.rsplit_once(':') {
        Some((host, _)) => format!("{host}:{port}"),
        None => bail!("this shard's address {advertise} has no port"),
    };
    Ok(((endpoint, path), addr))
}

/// Serves again the shards other than shard 0 that this process served when it stopped (`shards`: index and
/// replica epoch, from the coordinator's map: ones it took over in an earlier life, and its own where it
/// joined as a spare to wait for a backup in sync), each from its newest checkpoint in this process's folder,
/// once the coordinator grants it — which it does when no backup of the shard is in sync any more (backups
/// that started since hold no copy). A shard a backup took over meanwhile is left to it; each shard is asked
/// for on its own, again and again (at most every 10 s) until it is served here or elsewhere.
pub(super) async fn resume_shards(
    shared: Arc<Shared>,
    cfg: ServiceConfig,
    link: crate::link::CoordinatorLink,
    shards: Vec<(u32, u64)>,
    stop: watch::Receiver<bool>,
) {
    let mut each = tokio::task::JoinSet::new();
    for (shard, epoch) in shards {
        let (shared, cfg, link, mut stop) = (shared.clone(), cfg.clone(), link.clone(), stop.clone());
        each.spawn(async move {
            tokio::select! {
                _ = stop.changed() => {}
                r = resume_shard(&shared, &cfg, &link, shard, epoch) => match r {
                    Ok(true) => {}
                    Ok(false) => info!(shard, "another shard process serves it now: not served again here"),
                    Err(e) => error!(
                        shard,
                        error = format!("{e:#}"),
                        "could not serve again a shard this process served when it stopped: it stays unserved"
                    ),
                },
            }
        });
    }
    while each.join_next().await.is_some() {}
}

/// [`resume_shards`] for one shard: true once served here, false when another process serves it.
async fn resume_shard(
    shared: &Arc<Shared>,
    cfg: &ServiceConfig,
    link: &crate::link::CoordinatorLink,
    shard: u32,
    epoch: u64,
) -> Result<bool> {
    let mut c = cfg.clone();
    c.core = ShardConfig { shard, ..cfg.core.clone() };
    c.restore = Restore::Auto;
    let store = match &cfg.checkpoint {
        Some(ck) => Some(CheckpointStore::open(&ck.dir, shard, ck.keep)?),
        None => None,
    };
    // Reading a checkpoint takes seconds: not on the runtime's thread, which may be the only one serving.
    let (core, info) = match gaps_transport::runtime::compute(|| initial_core(&c, shard, store.as_ref()))? {
        // Its own shard starts fresh without a checkpoint, as it would have had it not waited.
        (core, info) if info.is_some() || shard == shared.shard => (core, info),
        _ => match &store {
            Some(store) => {
                bail!(
                    "this process served shard {shard} when it stopped but {} holds no checkpoint of it",
                    store.dir().display()
                )
            }
            None => bail!("this process served shard {shard} when it stopped but was started without --checkpoint-dir"),
        },
    };
    let (endpoint, addr) = endpoint_beside(&shared.advertise, cfg)?;
    let mut pause = Duration::from_secs(1);
    let promote =
        Message::Promote(gaps_common::wire::Promote { shard, process: shared.shard, epoch, addr: addr.clone() });
    let granted = loop {
        let why = match link.call(&promote).await {
            Ok(Frame { msg: Message::ReplicaEpoch(e), .. }) => break e.epoch,
            Ok(other) => format!("the coordinator answered with {}", net::kind_name(&other.msg)),
            // Refused for now: a backup may still be in sync.
            Err(e @ RpcError::Remote { .. }) if !crate::link::is_moved(&e) => e.to_string(),
            // The answer may have been lost (then the map shows the grant), or `Moved`: the shard went to
            // another process or epoch — or only the coordinator moved (a takeover of shard 0 under way).
            Err(e) => {
                let map = link.map(&format!("shard-{} resume", shared.shard)).await;
                let entry = map.as_ref().ok().and_then(|m| m.shards.iter().find(|s| s.index == shard).cloned());
                match entry {
                    Some(s) if s.process == shared.shard && s.addr == addr => break s.epoch,
                    Some(s) if crate::link::is_moved(&e) && (s.process != shared.shard || s.epoch != epoch) => {
                        return Ok(false)
                    }
                    _ => e.to_string(),
                }
            }
        };
        debug!(shard, %why, "not granted yet");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(10));
    };
    let coordinator = Some(link.coordinator().0);
    let from = (Duration::ZERO, 0, info);
    serve_copy(shared, cfg, coordinator, core, from, endpoint, addr.clone(), granted).await?;
    warn!(shard, %addr, epoch = granted, "serving again a shard this process served when it stopped, from its checkpoint");
    Ok(true)
}
