//! Checkpoints and rollbacks: a shard's own, the coordinator's cluster-wide ones (one id everywhere, one
//! step in the synchronous modes), and a cluster going back to a checkpoint every shard holds.

use super::*;

/// How long a checkpoint may wait for the step it was asked for.
pub(super) const CHECKPOINT_WAIT: Duration = Duration::from_secs(20);

/// Why a shard wrote no checkpoint.
#[derive(Debug, thiserror::Error)]
pub(super) enum CheckpointFailure {
    /// It had already applied this many steps, past the one asked for (or no live worker could reach it).
    #[error("this shard had applied {0} steps and cannot take a checkpoint at the step asked for")]
    TooLate(u64),
    /// Anything else.
    #[error("{0:#}")]
    Other(#[from] anyhow::Error),
}

/// A checkpoint this shard wrote.
#[derive(Debug)]
pub(super) struct Written {
    pub(super) id: u64,
    pub(super) path: std::path::PathBuf,
    pub(super) step: u64,
}

/// A fresh checkpoint id: the time in milliseconds since the Unix epoch, made strictly increasing. Ids from
/// different shards (a shard's own final checkpoint, the coordinator's cluster ones) sort by time.
pub(super) fn next_id(shared: &Shared) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    shared.next_checkpoint.fetch_max(now, Ordering::Relaxed);
    shared.next_checkpoint.fetch_add(1, Ordering::Relaxed)
}

/// Answers a checkpoint request: on the coordinator with id 0 a cluster checkpoint, otherwise this shard's.
pub(super) async fn checkpoint_reply(shared: &Shared, req: CheckpointRequest) -> Frame {
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
pub(super) async fn take_checkpoint(
    shared: &Shared,
    id: Option<u64>,
    at: CheckpointAt,
) -> Result<Written, CheckpointFailure> {
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

/// How long the coordinator's checkpoint round waits to reach a shard: with copies, 2 s (a dead shard holds up
/// the rounds, and with them the coordinator's tables, no longer); without, 5 s.
fn peer_connect_wait(replicas: u32) -> Duration {
    Duration::from_secs(if replicas > 1 { 2 } else { 5 })
}

/// Asks shard `peer` for checkpoint `id` at `at`.
pub(super) async fn peer_checkpoint(
    (endpoint, connect_wait): (quinn::Endpoint, Duration),
    config: Option<quinn::ClientConfig>,
    cluster: String,
    peer: gaps_shard::PeerShard,
    id: u64,
    at: CheckpointAt,
) -> Result<ShardCheckpoint, CheckpointFailure> {
    let (index, addr) = (peer.index, peer.addr.as_str());
    let fail = |e: RpcError| CheckpointFailure::Other(anyhow!("shard {index} at {addr}: {e}"));
    let conn = net::connect_with(&endpoint, config, net::resolve(addr).await.map_err(fail)?, connect_wait)
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
pub(super) async fn rollback_reply(shared: &Shared, req: Rollback) -> Frame {
    let answer = match req.stage {
        RollbackStage::List => {
            own_checkpoints(shared, req.id).await.map(|held| RollbackReply { shard: shared.shard, held, step: 0 })
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

/// The intact checkpoints this shard holds, no newer than `max`, newest first. Each is read whole and its
/// checksum checked (gigabytes, seconds), on a blocking thread: not on the runtime's, which may be the
/// process's only one serving the network.
pub(super) async fn own_checkpoints(shared: &Shared, max: u64) -> Result<Vec<u64>> {
    let store = shared.store.clone().context("this shard has no --checkpoint-dir")?;
    tokio::task::spawn_blocking(move || store.intact_ids(max, gaps_common::wire::MAX_ROLLBACK_IDS))
        .await
        .context("listing checkpoints")?
}

/// Restores checkpoint `id` of this shard in place: the training state goes back to it, the live workers
/// stay (`ShardCore::rolled_back`); the new core is made GPU-resident again where the shard runs on one.
/// Returns the step the shard is at afterwards.
pub(super) async fn apply_rollback(shared: &Shared, id: u64) -> Result<u64> {
    let store = shared.store.clone().context("this shard has no --checkpoint-dir")?;
    // Reading the checkpoint and setting up the GPU (a context, the kernels compiled: a second or more) on
    // a blocking thread, not on the runtime's, which may be the one serving every connection.
    let device = shared.device;
    let (found, gpu) = tokio::task::spawn_blocking(move || {
        let found = store.load(id)?;
        let gpu = gaps_kernels::cuda::CudaArenas::for_choice(device).context("--device")?;
        Ok::<_, anyhow::Error>((found, gpu))
    })
    .await
    .context("reading a checkpoint")??;
    let slots = shared.device_worker_slots;
    // The copies of shard 0 do not continue the state it goes back to: a majority must first choose a
    // configuration without them (its backups copy a snapshot afterwards and are proposed in again), and no
    // backup is proposed in again before the core is replaced.
    let _changing = match &shared.quorum {
        Some(quorum) if shared.shard == 0 => Some(quorum.changing().await),
        _ => None,
    };
    if let (0, Some(quorum)) = (shared.shard, &shared.quorum) {
        let (tx, rx) = oneshot::channel();
        shared.send(Command::Inspect(Box::new(move |core| drop(tx.send(core.process_addrs()))))).await?;
        let peers: Vec<(u32, String)> =
            rx.await.context("the core stopped")?.into_iter().filter(|(p, _)| *p != quorum.process()).collect();
        // The address shard 0's configurations name: where this process serves it.
        let addr = shared.advertise.clone();
        match quorum.propose_in_sync(Vec::new(), addr, false, &peers, &shared.link).await? {
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
pub(super) async fn peer_rollback(
    shared: &Shared,
    peer: &gaps_shard::PeerShard,
    req: Rollback,
) -> Result<RollbackReply> {
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
pub(super) async fn cluster_rollback(shared: &Shared, restored: u64) -> Result<(u64, u64)> {
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
    let mut common: std::collections::BTreeSet<u64> = own_checkpoints(shared, restored).await?.into_iter().collect();
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
pub(super) async fn roll_back_cluster_after_restore(shared: Arc<Shared>, id: u64, mut stop: watch::Receiver<bool>) {
    for attempt in 1u32.. {
        let result = if shared.shard == 0 {
            cluster_rollback(&shared, id).await
        } else {
            let (addr, process) = shared.link.coordinator();
            let coordinator = gaps_shard::PeerShard { index: 0, addr, process };
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
pub(super) async fn cluster_checkpoint(shared: &Shared) -> Result<CheckpointDone> {
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
            let reach = (endpoint, peer_connect_wait(shared.replicas));
            tasks.spawn(async move { (peer.index, peer_checkpoint(reach, config, cluster, peer, id, at).await) });
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
