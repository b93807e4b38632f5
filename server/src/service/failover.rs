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
pub(super) async fn take_over(
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
