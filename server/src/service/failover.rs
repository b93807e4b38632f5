//! A backup process taking over a shard whose primary went silent (replicated shards).

use super::*;

/// Takes over the shards whose copies here heard nothing from their primary for `--failover-after`.
pub(super) async fn watch_primaries(
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
            let takeover = TakeoverMeans { shared: &shared, cfg: &cfg, link: &link, backups: &backups };
            let taken = match shard {
                0 => takeover.coordinator().await,
                _ => takeover.shard(shard).await,
            };
            match taken {
                Ok(()) => {}
                Err(e) => {
                    backups.abandon_takeover(shard);
                    warn!(shard, error = format!("{e:#}"), "did not take over a shard whose primary went silent");
                }
            }
        }
    }
}

/// What a takeover works with: this process's shared state and configuration, its link to the coordinator
/// and the copies it keeps.
#[derive(Clone, Copy)]
struct TakeoverMeans<'a> {
    shared: &'a Arc<Shared>,
    cfg: &'a ServiceConfig,
    link: &'a crate::link::CoordinatorLink,
    backups: &'a Backups,
}

impl TakeoverMeans<'_> {
    /// Shard 0 taken over: [`take_over_coordinator`].
    async fn coordinator(&self) -> Result<()> {
        take_over_coordinator(self).await
    }

    /// Another shard taken over: [`take_over`].
    async fn shard(&self, shard: u32) -> Result<()> {
        take_over(self, shard).await
    }
}

/// A new endpoint on this process's IP (a free port) for a shard it takes over, and the address it is
/// advertised at.
fn takeover_endpoint(shared: &Shared, cfg: &ServiceConfig) -> Result<((quinn::Endpoint, net::PathTuning), String)> {
    endpoint_beside(&shared.advertise, cfg)
}

/// Serves the copy of `shard` taken from `backups` (its core given as `core`, going on from the primary's
/// `clock` and log index `applied`) — or the shard restored from this process's checkpoint `restored` — on
/// `endpoint` at `addr` under replica epoch `epoch`, beside this process's own shard.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_copy(
    shared: &Arc<Shared>,
    cfg: &ServiceConfig,
    coordinator: Option<String>,
    core: ShardCore,
    (clock, applied, restored): (Duration, u64, Option<gaps_shard::core::CheckpointInfo>),
    endpoint: (quinn::Endpoint, net::PathTuning),
    addr: String,
    epoch: u64,
) -> Result<()> {
    let shard = core.config().shard;
    let mut c = cfg.clone();
    c.core = ShardConfig { shard, ..cfg.core.clone() };
    c.advertise = Some(addr);
    c.coordinator = coordinator;
    c.restore = Restore::Never;
    c.data = None;
    c.health = None;
    let takeover = Takeover {
        core,
        restored,
        process: shared.shard,
        key: Some(shared.credentials.raw()),
        clock,
        epoch,
        applied,
        quorum: shared.quorum.clone(),
        endpoint,
    };
    let server = start_serving(c, Some(takeover)).await?;
    shared.taken_over.lock().map_err(|_| anyhow!("lock poisoned"))?.push(server);
    Ok(())
}

/// Takes shard 0 — the coordinator — over where a majority of the shard processes chooses its configuration
/// (docs/replication.md, step 4): once the coordinator also fails to answer a probe, this process proposes
/// itself as the one serving shard 0 at a new endpoint, and serves its copy only if exactly that is chosen.
/// The proposal is valid only from a backup in the last configuration's in-sync set (every reply of the old
/// coordinator waited for it), or from this process itself where an earlier takeover of its own was chosen
/// but never served; the old coordinator learns of it at its next proposal and answers `Moved` from then on.
async fn take_over_coordinator(t: &TakeoverMeans<'_>) -> Result<()> {
    let TakeoverMeans { shared, cfg, link, backups } = *t;
    let silent_since = Instant::now() - cfg.failover_after;
    let quorum =
        shared.quorum.clone().context("shard 0 is taken over only where a majority chooses its configuration")?;
    let me = quorum.process();
    // Where the shard processes listen, from the copy's own coordinator tables; the newest configuration
    // any of them knows.
    if let Some(processes) = backups.inspect(0, |_, core| core.map(ShardCore::process_addrs)).flatten() {
        link.remember(processes);
    }
    link.locate().await;
    let base = quorum.chosen();
    if base.serving != me && !base.in_sync.contains(&me) {
        bail!(
            "this process is not among shard 0's backups in sync (configuration {}: {:?})",
            base.version,
            base.in_sync
        );
    }
    if base.serving != me && link.answers(&base.addr, base.serving, PROBE_WAIT).await {
        bail!("the coordinator at {} answers: it is not taken over", base.addr);
    }
    let (endpoint, addr) = takeover_endpoint(shared, cfg)?;
    let peers: Vec<(u32, String)> = link.processes().into_iter().filter(|(p, _)| *p != me).collect();
    let (chosen, mine) = quorum.propose_serving(&addr, &peers, link).await?;
    if !mine {
        bail!(
            "shard 0's configuration {} was chosen otherwise: served by process {} at {}",
            chosen.version,
            chosen.serving,
            chosen.addr
        );
    }
    let (mut core, clock, applied) = backups.take(0).context("the copy is gone")?;
    let epoch = core.serve_coordinator_copy(me, &addr).map_err(|e| anyhow!("{e}"))?;
    serve_copy(shared, cfg, None, core, (clock, applied, None), endpoint, addr.clone(), epoch).await?;
    warn!(
        %addr,
        version = chosen.version,
        took_ms = silent_since.elapsed().as_millis() as u64,
        "took over shard 0 (the coordinator), a majority of the shard processes chose so: serving its copy"
    );
    Ok(())
}

/// Asks the coordinator to let this process serve its copy of `shard` and serves it on an endpoint of its own.
async fn take_over(t: &TakeoverMeans<'_>, shard: u32) -> Result<()> {
    let TakeoverMeans { shared, cfg, link, backups } = *t;
    let silent_since = Instant::now() - cfg.failover_after;
    let (endpoint, addr) = takeover_endpoint(shared, cfg)?;
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
    let coordinator = Some(link.coordinator().0);
    serve_copy(shared, cfg, coordinator, core, (clock, applied, None), endpoint, addr.clone(), granted_epoch).await?;
    warn!(
        shard,
        %addr,
        took_ms = silent_since.elapsed().as_millis() as u64,
        "took over a shard whose primary went silent: serving its copy"
    );
    Ok(())
}

/// A shard's state as a checkpoint's bytes, with the last entry of its replica log it holds.
pub(super) async fn snapshot_of(shared: &Shared) -> Result<(u64, Vec<u8>)> {
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
