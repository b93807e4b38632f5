//! Membership and the cluster: requests to every shard or to the coordinator, checkpoints, the data
//! dealer's splits, stats, heartbeats, leaving and closing.

use super::*;

impl Client {
    /// Sends `msg` to every shard in turn and takes what `reply` extracts from each answer, index order; an
    /// answer of another kind is an error naming the shard.
    pub(super) async fn ask_each<T>(
        &self,
        msg: &Message,
        reply: impl Fn(Message) -> Option<T>,
    ) -> Result<Vec<T>, ClientError> {
        let mut out = Vec::with_capacity(self.inner.shards.len());
        for s in 0..self.inner.shards.len() {
            out.push(self.ask(s, msg, &reply).await?);
        }
        Ok(out)
    }

    /// Sends `msg` to shard `s` and takes what `reply` extracts from the answer; an answer of another kind is
    /// an error naming the shard.
    pub(super) async fn ask<T>(
        &self,
        s: usize,
        msg: &Message,
        reply: impl FnOnce(Message) -> Option<T>,
    ) -> Result<T, ClientError> {
        self.ask_with(s, msg, &[], reply).await
    }

    /// One load of `payload` to shard `s`: an `Initialize` answered with the chunks taken and kept, or a
    /// `TableLoad` answered with the rows created and kept.
    pub(super) async fn load(&self, s: usize, msg: &Message, payload: Vec<f32>) -> Result<(u32, u32), ClientError> {
        let initialize = matches!(msg, Message::Initialize(_));
        self.ask_with(s, msg, &[net::f32_bytes(payload)], |reply| match reply {
            Message::Initialized(done) if initialize => Some((done.taken, done.kept)),
            Message::TableLoaded(done) if !initialize => Some((done.created, done.kept)),
            _ => None,
        })
        .await
    }

    /// [`Self::ask`] for a request that carries a payload.
    pub(super) async fn ask_with<T>(
        &self,
        s: usize,
        msg: &Message,
        payload: &[net::Bytes],
        reply: impl FnOnce(Message) -> Option<T>,
    ) -> Result<T, ClientError> {
        let (frame, _) = self.request(s, msg, payload).await?;
        let kind = net::kind_name(&frame.msg);
        Ok(reply(frame.msg)
            .ok_or_else(|| RpcError::Unexpected { addr: self.inner.shards[s].addr().to_string(), kind: kind.into() })?)
    }

    /// This client's worker id; an observer cannot `what`.
    pub(super) fn worker_for(&self, what: &str) -> Result<u32, ClientError> {
        self.inner.map.worker_id.ok_or_else(|| ClientError::Shape(format!("observers cannot {what}")))
    }

    /// Asks the coordinator for a cluster checkpoint (every shard at the same synchronous step, or at its
    /// next quiescent point); returns its id and each shard's (shard, path, step), index order.
    pub async fn checkpoint(&self) -> Result<CheckpointDone, ClientError> {
        let request = Message::CheckpointRequest(CheckpointRequest { id: 0, at: CheckpointAt::Quiescent });
        self.ask(0, &request, |m| match m {
            Message::CheckpointDone(done) => Some(done),
            _ => None,
        })
        .await
    }

    /// Time this client spent after its pushes waiting for a synchronous step to complete (or for the
    /// slowest worker, under bounded staleness), in all.
    pub fn waited(&self) -> Duration {
        Duration::from_micros(self.inner.waited_us.load(Ordering::Relaxed))
    }

    /// Tags the next dense pushes with the dealt split their samples came from (None: untagged). Every
    /// shard counts the samples per grant ([`Client::data_status`]).
    pub fn set_data_tag(&self, tag: Option<gaps_common::wire::DataTag>) {
        if let Ok(mut t) = self.inner.data_tag.lock() {
            *t = tag;
        }
    }

    /// Asks the coordinator's dealer for this worker's next split of the training data, reporting the grant
    /// `finished` (every batch of it pushed and acknowledged). A split it holds otherwise is given back.
    pub async fn next_split(&self, finished: Option<u64>) -> Result<gaps_common::wire::SplitGrant, ClientError> {
        let worker = self.inner.map.worker_id.ok_or_else(|| {
            ClientError::BadMap("this client has no worker id (an observer); only a worker is dealt data".into())
        })?;
        let request =
            Message::SplitRequest(gaps_common::wire::SplitRequest { epoch: self.inner.map.epoch, worker, finished });
        self.ask(0, &request, |m| match m {
            Message::SplitGrant(grant) => Some(grant),
            _ => None,
        })
        .await
    }

    /// [`Self::next_split`], but while nothing is left to deal and splits are still on loan to others, in
    /// async (where a worker that pushes nothing holds nobody up, and counts in no step) it asks again —
    /// after 100 ms, then backing off to 1 s — rather than answering "done": a split given back when its
    /// holder dies (its lease expires) is then trained by someone. It gives up, done, once nothing changed
    /// at the dealer (splits finished, loans) for three leases: a holder that keeps its lease but never
    /// finishes cannot keep everyone waiting. In sync, gba and ssp waiting would hold the others' steps or
    /// count in them: the worker is done at once, and such a split stays undealt (`splits_pending`).
    pub async fn next_split_waiting(
        &self,
        finished: Option<u64>,
    ) -> Result<gaps_common::wire::SplitGrant, ClientError> {
        let mut grant = self.next_split(finished).await?;
        let mut accepted = grant.finished_accepted;
        let patience = Duration::from_millis(3 * u64::from(self.inner.map.lease_ms));
        let (mut pause, mut seen, mut since) = (Duration::from_millis(100), None, Instant::now());
        while grant.split.is_none() && self.idle_holds_nobody() {
            let Some(dealer) = self.dealer_unfinished().await? else { break };
            let now = Some((dealer.splits_done, dealer.leased.iter().map(|l| l.grant).collect::<Vec<_>>()));
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() > patience {
                warn!("nothing changed at the dealer for three leases while others hold splits: done");
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
            grant = self.next_split(None).await?;
            accepted |= grant.finished_accepted;
        }
        Ok(gaps_common::wire::SplitGrant { finished_accepted: accepted, ..grant })
    }

    /// True while the cluster runs async (mode code 0): a worker that pushes nothing for a while holds
    /// nobody up and counts in no step.
    pub fn idle_holds_nobody(&self) -> bool {
        self.inner.decisions().is_some_and(|d| d.latest.mode == 0)
    }

    /// The coordinator's dealer when it has splits left to finish (on loan to a worker, or to deal again
    /// should its holder die) though it dealt this worker none; None when every split is finished.
    pub async fn dealer_unfinished(&self) -> Result<Option<gaps_common::wire::DealerStatus>, ClientError> {
        // No grant is above u64::MAX: the page holds the dealer's state alone.
        let request = Message::DataStatusRequest(gaps_common::wire::DataStatusRequest { after_grant: u64::MAX });
        let page = self
            .ask(0, &request, |m| match m {
                Message::DataStatus(page) => Some(page),
                _ => None,
            })
            .await?;
        Ok(page.dealer.filter(|d| !d.finished))
    }

    /// Every shard's per-grant sample counts and the coordinator's dealer state (every page), index order.
    pub async fn data_status(&self) -> Result<Vec<gaps_common::wire::DataStatus>, ClientError> {
        let mut out = Vec::with_capacity(self.inner.shards.len());
        for s in 0..self.inner.shards.len() {
            let mut after = 0;
            let mut whole: Option<gaps_common::wire::DataStatus> = None;
            loop {
                let request = Message::DataStatusRequest(gaps_common::wire::DataStatusRequest { after_grant: after });
                let page = self
                    .ask(s, &request, |m| match m {
                        Message::DataStatus(page) => Some(page),
                        _ => None,
                    })
                    .await?;
                let next = page.next_after;
                match whole.as_mut() {
                    None => whole = Some(page),
                    Some(w) => {
                        w.counts.extend(page.counts);
                        if let (Some(d), Some(p)) = (w.dealer.as_mut(), page.dealer) {
                            d.completed.extend(p.completed);
                            d.abandoned.extend(p.abandoned);
                        }
                    }
                }
                match next {
                    Some(n) if n > after => after = n,
                    _ => break,
                }
            }
            out.extend(whole);
        }
        Ok(out)
    }

    /// Counters of every shard, index order.
    pub async fn stats(&self) -> Result<Vec<Stats>, ClientError> {
        self.ask_each(&Message::StatsRequest(StatsRequest), |m| match m {
            Message::Stats(st) => Some(st),
            _ => None,
        })
        .await
    }

    /// Renews this worker's lease with every shard at once (each keeps its own view of who is live); the
    /// first failure, once every shard answered or gave up.
    pub async fn heartbeat(&self) -> Result<(), ClientError> {
        let Some(worker) = self.inner.map.worker_id else { return Ok(()) };
        let beat = Message::Heartbeat(Heartbeat { worker });
        let beats = (0..self.inner.shards.len()).map(|s| self.request(s, &beat, &[]));
        join_all(beats.collect()).await.into_iter().try_for_each(|beat| beat.map(drop))?;
        Ok(())
    }

    /// Heartbeats to every shard every `interval`, each shard in a loop of its own — one that does not
    /// answer (restarting, moved, retried until `shard_down_timeout`) holds up no other's lease — counting
    /// those acknowledged in `acknowledged`; a shard that refuses this worker as not registered (it left)
    /// gets no more. Returns at once for an observer (it has no lease).
    async fn heartbeat_loops(&self, interval: Duration, acknowledged: &AtomicU64) {
        let Some(worker) = self.inner.map.worker_id else { return };
        let beat = Message::Heartbeat(Heartbeat { worker });
        let loops = (0..self.inner.shards.len()).map(|s| {
            let beat = &beat;
            async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    match self.request(s, beat, &[]).await {
                        Ok(_) => {
                            acknowledged.fetch_add(1, Ordering::Relaxed);
                        }
                        // The shard does not take this worker back (it left): no lease to renew there.
                        Err(e @ RpcError::Remote { code: ErrorCode::NotRegistered, .. }) => {
                            warn!(shard = s, error = %e, "heartbeats to this shard stop");
                            return;
                        }
                        Err(e) => warn!(shard = s, error = %e, "heartbeat failed"),
                    }
                }
            }
        });
        join_all(loops.collect()).await;
    }

    /// Sends heartbeats every `interval` (each shard on its own) until the returned handle is aborted or
    /// dropped with the runtime.
    pub fn spawn_heartbeats(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let client = self.clone();
        tokio::spawn(async move { client.heartbeat_loops(interval, &AtomicU64::new(0)).await })
    }

    /// Starts this worker's heartbeats, every `interval`, where they go on whatever the calling thread
    /// does: on a current-thread runtime — whose connections only move while the thread that called
    /// `block_on` awaits, as `gaps-worker`'s training thread does between its computations — they go from a
    /// thread of their own over connections of their own ([`Client::companion`]); on a multi-thread
    /// runtime, as a task ([`Client::spawn_heartbeats`]). Each shard's go on their own: one that does not
    /// answer holds up no other's. Stop them with [`Heartbeats::stop`] before [`Client::leave`] (a shard
    /// refuses a heartbeat that arrives after the worker's `Leave`). Fails outside a runtime, or when the
    /// thread or its endpoint cannot be set up.
    pub fn start_heartbeats(&self, interval: Duration) -> Result<Heartbeats, ClientError> {
        let setup = |m: String| ClientError::from(RpcError::Setup(m));
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| setup(format!("heartbeats are sent from a tokio runtime: {e}")))?;
        if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            return Ok(Heartbeats::Task(self.spawn_heartbeats(interval)));
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let acknowledged = Arc::new(AtomicU64::new(0));
        let (client, count) = (self.clone(), acknowledged.clone());
        std::thread::Builder::new()
            .name("gaps-heartbeat".into())
            .spawn(move || heartbeat_thread(client, interval, count, (ready_tx, stop_rx, done_tx)))
            .map_err(|e| setup(format!("starting the heartbeat thread: {e}")))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Heartbeats::Thread { stop, done, acknowledged }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(setup("the heartbeat thread ended before it was ready".into())),
        }
    }

    /// Leaves the job (every shard drops the lease at once) and closes every connection.
    pub async fn leave(&self) -> Result<(), ClientError> {
        if let Some(worker) = self.inner.map.worker_id {
            for s in 0..self.inner.shards.len() {
                self.request(s, &Message::Leave(Leave { worker }), &[]).await?;
            }
        }
        self.close().await;
        Ok(())
    }

    /// Closes every connection and waits (briefly) for the peers to learn of it.
    pub async fn close(&self) {
        for slot in self.inner.shards.iter().flat_map(|link| &link.conns) {
            if let Ok(mut guard) = slot.lock() {
                if let Some(conn) = guard.take() {
                    conn.close(0u32.into(), b"done");
                }
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.inner.endpoint.wait_idle()).await;
    }

    /// Index of each shard, for logs.
    pub fn shard_addrs(&self) -> Vec<(u32, SocketAddr)> {
        self.inner.shards.iter().map(|s| (s.index, s.addr())).collect()
    }
}

/// A worker's heartbeats ([`Client::start_heartbeats`]).
#[derive(Debug)]
pub enum Heartbeats {
    /// A task on the client's (multi-thread) runtime.
    Task(tokio::task::JoinHandle<()>),
    /// A thread of their own, over connections of their own; dropping this stops it (without waiting).
    Thread {
        /// Tells the thread to stop (so does dropping it).
        stop: tokio::sync::oneshot::Sender<()>,
        /// Sent once the thread stopped and closed its connections.
        done: tokio::sync::oneshot::Receiver<()>,
        /// Heartbeats acknowledged, every shard's together.
        acknowledged: Arc<AtomicU64>,
    },
}

impl Heartbeats {
    /// Heartbeats acknowledged, every shard's together, when they go from a thread of their own (None for a
    /// task).
    pub fn acknowledged(&self) -> Option<u64> {
        match self {
            Heartbeats::Task(_) => None,
            Heartbeats::Thread { acknowledged, .. } => Some(acknowledged.load(Ordering::Relaxed)),
        }
    }

    /// Stops the heartbeats (a heartbeat on its way is abandoned); from a thread of their own, waits (a few
    /// seconds at most) until their connections are closed.
    pub async fn stop(self) {
        match self {
            Heartbeats::Task(task) => task.abort(),
            Heartbeats::Thread { stop, done, .. } => {
                drop(stop);
                let bound = Duration::from_secs(5);
                if tokio::time::timeout(bound, done).await.is_err() {
                    warn!(waited = ?bound, "the heartbeat thread did not stop in time");
                }
            }
        }
    }
}

/// The body of a heartbeat thread: a current-thread runtime, a companion of `client` made on it (reported
/// on `ready`), and its heartbeats every `interval` until `stop` is sent or dropped; then `done`.
fn heartbeat_thread(
    client: Client,
    interval: Duration,
    acknowledged: Arc<AtomicU64>,
    (ready, stop, done): (
        std::sync::mpsc::Sender<Result<(), ClientError>>,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ),
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = ready.send(Err(RpcError::Setup(format!("the heartbeat thread's runtime: {e}")).into()));
            return;
        }
    };
    runtime.block_on(async move {
        let companion = match client.companion() {
            Ok(companion) => companion,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        drop(client);
        let _ = ready.send(Ok(()));
        let beating = async {
            companion.heartbeat_loops(interval, &acknowledged).await;
            std::future::pending::<()>().await
        };
        tokio::select! {
            _ = stop => {}
            () = beating => {}
        }
        companion.close().await;
        let _ = done.send(());
    });
}
