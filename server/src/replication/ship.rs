//! Shipping the log: one task per backup copies it a snapshot, then the entries in order, and reports
//! which backups count to the coordinator (or, for shard 0, to a majority of the shard processes).

use super::*;

pub use crate::link::CoordinatorLink;

/// A snapshot of the core for a backup: the log index it holds and its bytes, or why none was taken.
pub type SnapshotReply = tokio::sync::oneshot::Receiver<Result<(u64, Vec<u8>), String>>;

/// What a shipping task needs from the service.
#[allow(missing_debug_implementations)]
pub struct ShipContext {
    /// This shard's index.
    pub shard: u32,
    /// The coordinator, whose map names the backups and which hears which backups count.
    pub link: CoordinatorLink,
    pub ack_timeout: Duration,
    /// This process's index (the sender of reports) and the replica epoch it serves the shard under.
    pub process: u32,
    /// Where this shard is served (shard 0's configurations name it).
    pub advertise: String,
    pub epoch: u64,
    /// Reports to the coordinator go one at a time, so that they arrive in the order the set changed.
    pub reporting: tokio::sync::Mutex<()>,
    /// Shard 0 in a cluster that chooses its configuration by majority: its backups in sync are reported
    /// there (see [`crate::quorum`]).
    pub quorum: Option<Arc<crate::quorum::Quorum>>,
    /// Asks the core for a snapshot for `backup` (its bytes and the log index it holds).
    pub snapshot: Arc<dyn Fn(u32) -> SnapshotReply + Send + Sync>,
}

/// Keeps backup process `backup` a copy of this shard until `stop` turns true.
pub async fn ship(ctx: Arc<ShipContext>, log: Arc<Log>, backup: u32, mut stop: watch::Receiver<bool>) {
    let mut said = false;
    // Failures in a row (a backup process that stays dead is tried every second: said once a minute).
    let mut failures = 0u32;
    loop {
        let began = std::time::Instant::now();
        let outcome = tokio::select! {
            _ = stop.changed() => return,
            r = ship_once(&ctx, &log, backup, &mut said) => r,
        };
        if began.elapsed() > Duration::from_secs(10) {
            failures = 0;
        }
        if let Err(e) = &outcome {
            failures += 1;
            if failures == 1 || failures % 60 == 0 {
                warn!(
                    shard = ctx.shard,
                    backup,
                    failures,
                    error = format!("{e:#}"),
                    "replication to a backup stopped; trying again"
                );
            } else {
                tracing::debug!(
                    shard = ctx.shard,
                    backup,
                    error = format!("{e:#}"),
                    "replication to a backup failed again"
                );
            }
        }
        // A backup the coordinator counts in sync stops counting only once the coordinator knows: it must
        // never promote a copy that lacks an acknowledged request. Replies wait meanwhile.
        let released = tokio::select! {
            _ = stop.changed() => return,
            r = release(&ctx, &log, backup) => r,
        };
        if !released {
            return;
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(RETRY_AFTER) => {}
        }
    }
}

/// Stops following `backup`: at once when it did not count, after the coordinator took it out of the shard's
/// in-sync set when it did. False when the coordinator answered that another process serves the shard now
/// (this one is fenced).
async fn release(ctx: &ShipContext, log: &Log, backup: u32) -> bool {
    // Shard 0 where a majority chooses who serves it: a backup that stopped answering may have taken it over
    // (its copy refuses this process's log from then on); if the processes know so, this one is fenced.
    if let (0, Some(quorum)) = (ctx.shard, &ctx.quorum) {
        ctx.link.locate().await;
        if quorum.chosen().serving != ctx.process {
            log.fence();
            return false;
        }
    }
    // Without a majority to choose shard 0's configuration, nobody can take it over: its backups need no
    // leave.
    if (ctx.shard == 0 && ctx.quorum.is_none()) || !log.is_live(backup) {
        log.unfollow(backup);
        return true;
    }
    let mut said = false;
    loop {
        match report(ctx, log, Some(backup)).await {
            Ok(()) => return true,
            Err(Reported::Moved) => {
                log.fence();
                return false;
            }
            Err(Reported::Failed(e)) => {
                if !said {
                    warn!(
                        shard = ctx.shard,
                        backup,
                        error = format!("{e:#}"),
                        "the coordinator must hear that a backup stopped before replies go on without it; trying again"
                    );
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Why a report to the coordinator did not go through.
enum Reported {
    /// Another process serves the shard now.
    Moved,
    Failed(anyhow::Error),
}

/// Tells the coordinator which backups count now (all but `except`); on its yes, `except` stops counting
/// here before any other report can go (so a report never names a backup that no longer counts).
async fn report(ctx: &ShipContext, log: &Log, except: Option<u32>) -> Result<(), Reported> {
    let _one = ctx.reporting.lock().await;
    if let Some(quorum) = &ctx.quorum {
        let _changing = quorum.changing().await;
        let in_sync = log.live_set(except);
        return report_to_quorum(ctx, quorum, log, in_sync, except).await;
    }
    let in_sync = log.live_set(except);
    let msg =
        Message::ReplicaReport(ReplicaReport { shard: ctx.shard, process: ctx.process, epoch: ctx.epoch, in_sync });
    match ctx.link.call(&msg).await {
        Ok(Frame { msg: Message::ReplicaEpoch(_), .. }) => {
            if let Some(backup) = except {
                log.unfollow(backup);
            }
            Ok(())
        }
        Err(RpcError::Remote { code: ErrorCode::Moved, .. }) => Err(Reported::Moved),
        Ok(other) => Err(Reported::Failed(anyhow!("the coordinator answered with {}", net::kind_name(&other.msg)))),
        Err(e) => Err(Reported::Failed(anyhow!("the coordinator ({}): {e}", ctx.link.coordinator().0))),
    }
}

/// [`report`] for shard 0 when a majority of the shard processes chooses its configuration: a configuration
/// with these backups in sync, chosen; another process chosen to serve shard 0 means this one is fenced.
async fn report_to_quorum(
    ctx: &ShipContext,
    quorum: &Arc<crate::quorum::Quorum>,
    log: &Log,
    in_sync: Vec<u32>,
    except: Option<u32>,
) -> Result<(), Reported> {
    use crate::quorum::InSync;
    let peers = process_addresses(ctx).await.map_err(Reported::Failed)?;
    let addr = ctx.advertise.clone();
    match quorum.propose_in_sync(in_sync, addr, except.is_none(), &peers, &ctx.link).await {
        Ok(InSync::Chosen) => {
            if let Some(backup) = except {
                log.unfollow(backup);
            }
            Ok(())
        }
        Ok(InSync::Moved(_)) => Err(Reported::Moved),
        Ok(InSync::Other(c)) => Err(Reported::Failed(anyhow!(
            "shard 0's configuration {} was chosen with backups {:?} in sync; telling again",
            c.version,
            c.in_sync
        ))),
        Err(e) => Err(Reported::Failed(e)),
    }
}

/// Every other shard process and where it listens, from the coordinator's map (a process whose shard was
/// taken over and that is not back is left out).
async fn process_addresses(ctx: &ShipContext) -> Result<Vec<(u32, String)>> {
    let map = ctx.link.map(&format!("shard-{} quorum", ctx.shard)).await.map_err(|e| anyhow!("the map: {e}"))?;
    Ok(map.process_addrs().into_iter().filter(|(p, _)| *p != ctx.process).collect())
}

async fn ship_once(ctx: &ShipContext, log: &Log, backup: u32, said: &mut bool) -> Result<()> {
    let addr = backup_address(ctx, backup).await?;
    let conn = ctx.link.connect(&addr, backup).await.map_err(|e| anyhow!("backup {backup} at {addr}: {e}"))?;
    let (index, bytes) = (ctx.snapshot)(backup)
        .await
        .map_err(|_| anyhow!("the core stopped"))?
        .map_err(|e| anyhow!("taking a snapshot for backup {backup}: {e}"))?;
    let total = bytes.len() as u64;
    let bytes = Bytes::from(bytes);
    let mut offset = 0usize;
    loop {
        let end = (offset + SNAPSHOT_PIECE).min(bytes.len());
        let piece = bytes.slice(offset..end);
        let msg = Message::ReplicaSnapshot(ReplicaSnapshot {
            shard: ctx.shard,
            index,
            offset: offset as u64,
            total,
            bytes: piece.len() as u32,
        });
        let parts = padded(vec![piece]);
        let applied = call(ctx, &conn, &msg, &parts, ctx.ack_timeout.max(Duration::from_secs(30))).await?;
        log.snapshot_progress(backup, end as u64, total, (end - offset) as u64);
        offset = end;
        if offset >= bytes.len() {
            if applied != index {
                bail!("backup {backup} restored the snapshot at {applied}, not {index}");
            }
            break;
        }
    }
    if !*said {
        info!(shard = ctx.shard, backup, %addr, index, bytes = total, "backup holds a snapshot; shipping the log");
        *said = true;
    }
    if !log.acknowledged(backup, index) {
        bail!("the log was reset while the snapshot was copied");
    }
    let mut applied = index;
    let mut logged = log.logged.subscribe();
    // Once the backup counts, the coordinator hears of it (until then it may not promote the copy).
    let (mut reported, mut said_failure) = (ctx.shard == 0 && ctx.quorum.is_none(), false);
    loop {
        if !reported && log.is_live(backup) {
            match report(ctx, log, None).await {
                Ok(()) => reported = true,
                Err(Reported::Moved) => {
                    log.fence();
                    bail!("another process serves this shard now");
                }
                Err(Reported::Failed(e)) if !said_failure => {
                    said_failure = true;
                    warn!(
                        shard = ctx.shard,
                        backup,
                        error = format!("{e:#}"),
                        "telling the coordinator that a backup counts; trying again after each batch"
                    )
                }
                Err(Reported::Failed(_)) => {}
            }
        }
        let batch = log.batch(backup, applied).map_err(|()| anyhow!("dropped from the live set"))?;
        if batch.is_empty() {
            let _ = tokio::time::timeout(IDLE_CHECK, logged.wait_for(|l| *l > applied)).await;
            continue;
        }
        let first = batch[0].0;
        let last = batch[batch.len() - 1].0;
        if first != applied + 1 {
            bail!("the log no longer holds entry {} for backup {backup}", applied + 1);
        }
        let lens = batch.iter().map(|(_, b)| b.len() as u32).collect();
        let msg = Message::ReplicaAppend(ReplicaAppend { shard: ctx.shard, first, lens });
        let parts = padded(batch.into_iter().map(|(_, b)| b).collect());
        let mut suspected = log.suspects.subscribe();
        let got = tokio::select! {
            got = call(ctx, &conn, &msg, &parts, ctx.ack_timeout) => got?,
            _ = suspected.wait_for(|s| s.contains(&backup)) => bail!("backup {backup} did not answer a probe"),
        };
        if got != last {
            bail!("backup {backup} applied up to {got}, not {last}");
        }
        applied = last;
        if !log.acknowledged(backup, applied) {
            bail!("dropped from the live set");
        }
    }
}

/// Pads `parts` with zeros to a whole number of payload words.
fn padded(mut parts: Vec<Bytes>) -> Vec<Bytes> {
    let len: usize = parts.iter().map(Bytes::len).sum();
    let pad = len.next_multiple_of(4) - len;
    if pad > 0 {
        parts.push(Bytes::from(vec![0u8; pad]));
    }
    parts
}

async fn call(
    ctx: &ShipContext,
    conn: &quinn::Connection,
    msg: &Message,
    parts: &[Bytes],
    wait: Duration,
) -> Result<u64> {
    match net::call(conn, msg, parts, &Limits::default(), wait).await {
        Ok(Frame { msg: Message::ReplicaAck(a), .. }) if a.shard == ctx.shard => Ok(a.applied),
        Ok(other) => bail!("the backup answered with {}", net::kind_name(&other.msg)),
        Err(e) => Err(anyhow!("{e}")),
    }
}

/// Backup process `backup`'s address, from the coordinator's map (waits until every shard joined).
async fn backup_address(ctx: &ShipContext, backup: u32) -> Result<String> {
    loop {
        match map_address(ctx, backup).await {
            Err(Incomplete) => tokio::time::sleep(Duration::from_millis(200)).await,
            Ok(found) => return found,
        }
    }
}

/// The coordinator's map is not complete yet.
struct Incomplete;

async fn map_address(ctx: &ShipContext, backup: u32) -> Result<Result<String>, Incomplete> {
    Ok(match ctx.link.map(&format!("shard-{} replication", ctx.shard)).await {
        Ok(map) => map
            .process_addrs()
            .into_iter()
            .find(|(p, _)| *p == backup)
            .map(|(_, addr)| addr)
            .with_context(|| {
                format!("shard process {backup} is not in the coordinator's map (its shard was taken over and it is not back)")
            }),
        Err(RpcError::Remote { code: ErrorCode::ClusterIncomplete, .. }) => return Err(Incomplete),
        Err(e) => Err(anyhow!("the coordinator's map ({}): {e}", ctx.link.coordinator().0)),
    })
}
