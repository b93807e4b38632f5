//! The QUIC side: connections and their limits, a request's admission against the in-flight budget, its
//! authorization, and the reply (shared parameter buffers sent as they are).

use super::*;

pub(super) async fn serve(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
    tick: Duration,
) {
    // Each in-flight RPC holds a clone of this token; shutdown waits until only the original is left.
    let inflight = Arc::new(());
    let ticker = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick);
            let mut last_release = Instant::now();
            loop {
                interval.tick().await;
                // Memory kept for reuse (recycled buffers, the allocator's free heap) goes back to the
                // kernel every few seconds, so that the shard's resident memory follows what it holds.
                if last_release.elapsed() >= RELEASE_IDLE_EVERY {
                    last_release = Instant::now();
                    tokio::task::spawn_blocking(gaps_common::buffers::release_idle);
                }
                let (tx, rx) = oneshot::channel();
                if shared.send(Command::Tick { reply: tx }).await.is_err() {
                    return;
                }
                let Ok((events, stats)) = rx.await else { return };
                shared.metrics.observe(&stats);
                log_events(&events);
                after_events(&shared, &events);
            }
        })
    };
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                let Ok(slot) = shared.connections.clone().try_acquire_owned() else {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    shared.metrics.connections_refused.increment(1);
                    warn!(peer = %incoming.remote_address(), "refused a connection: the shard serves its maximum");
                    incoming.refuse();
                    continue;
                };
                let ip = incoming.remote_address().ip();
                let Some(ip_slot) = IpSlot::take(&shared, ip) else {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                    shared.metrics.connections_refused.increment(1);
                    if let Some(suppressed) = shared.log_connections.allow() {
                        warn!(%ip, suppressed, "refused a connection: this address holds its maximum");
                    }
                    incoming.refuse();
                    continue;
                };
                let shared = shared.clone();
                let inflight = inflight.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    let conn = match incoming.await {
                        Ok(c) => c,
                        Err(e) => {
                            // A client without a certificate from the cluster CA ends here.
                            if let Some(suppressed) = shared.log_connections.allow() {
                                warn!(%ip, suppressed, error = net::describe_connection_error(&e), "refused a connection");
                            }
                            return;
                        }
                    };
                    match net::peer_identity(&conn) {
                        Ok(id) if id.cluster == shared.own.cluster => {
                            serve_connection(conn, id, shared.clone(), inflight, shutdown).await
                        }
                        other => {
                            let reason = match other {
                                Ok(id) => format!("the certificate {id} is of another cluster than {:?}", shared.own.cluster),
                                Err(e) => e,
                            };
                            shared.unauthorized.fetch_add(1, Ordering::Relaxed);
                            shared.metrics.unauthorized.increment(1);
                            if let Some(suppressed) = shared.log_connections.allow() {
                                warn!(%ip, suppressed, %reason, "refused a connection");
                            }
                            conn.close(3u32.into(), format!("refused by shard {}: {reason}", shared.shard).as_bytes());
                        }
                    }
                    drop(ip_slot);
                    drop(slot);
                });
            }
        }
    }
    ticker.abort();
    endpoint.set_server_config(None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&inflight) > 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    endpoint.close(0u32.into(), b"shutdown");
    let _ = tokio::time::timeout(Duration::from_secs(3), endpoint.wait_idle()).await;
    info!(shard = shared.shard, "stopped");
}

/// Counts one connection against its IP address's share while it lives.
pub(super) struct IpSlot {
    pub(super) shared: Arc<Shared>,
    pub(super) ip: std::net::IpAddr,
}

impl IpSlot {
    pub(super) fn take(shared: &Arc<Shared>, ip: std::net::IpAddr) -> Option<IpSlot> {
        let mut count = shared.per_ip.entry(ip).or_insert(0);
        if *count >= shared.max_per_ip {
            return None;
        }
        *count += 1;
        Some(IpSlot { shared: shared.clone(), ip })
    }
}

impl Drop for IpSlot {
    fn drop(&mut self) {
        self.shared.per_ip.remove_if_mut(&self.ip, |_, count| {
            *count -= 1;
            *count == 0
        });
    }
}

/// One connection's peer: its identity and quinn's id of the connection (the key of its binding).
pub(super) struct ConnPeer {
    pub(super) identity: PeerIdentity,
    pub(super) conn_id: usize,
}

pub(super) async fn serve_connection(
    conn: quinn::Connection,
    identity: PeerIdentity,
    shared: Arc<Shared>,
    inflight: Arc<()>,
    mut shutdown: watch::Receiver<bool>,
) {
    let peer = conn.remote_address();
    let conn_peer = Arc::new(ConnPeer { identity, conn_id: conn.stable_id() });
    debug!(%peer, identity = %conn_peer.identity, "connection");
    let _unbind = Unbind { shared: shared.clone(), conn_id: conn_peer.conn_id };
    // This connection's share of the in-flight budget, which its requests together cannot exceed.
    let share = Arc::new(Semaphore::new(shared.connection_units as usize));
    let mut streams = Streams::default();
    loop {
        let busy = !streams.is_empty();
        let stream = tokio::select! {
            _ = shutdown.changed() => {
                // No new request; those in flight are finished (the service's shutdown bounds the wait).
                if busy {
                    streams.drive().await;
                }
                return;
            }
            // Every request in flight is driven here; this branch ends once none is left.
            () = streams.drive(), if busy => continue,
            s = tokio::time::timeout(shared.idle_timeout, conn.accept_bi()) => match s {
                Ok(s) => s,
                // A connection with a request in flight is not idle.
                Err(_) if busy => continue,
                Err(_) => {
                    shared.idle_closed.fetch_add(1, Ordering::Relaxed);
                    debug!(%peer, idle = ?shared.idle_timeout, "closing an idle connection");
                    conn.close(4u32.into(), b"idle: no request within the idle timeout");
                    return;
                }
            },
        };
        match stream {
            Ok((send, recv)) => {
                let shared = shared.clone();
                let token = inflight.clone();
                let conn_peer = conn_peer.clone();
                let share = share.clone();
                streams.add(async move {
                    serve_stream(&shared, &conn_peer, &share, send, recv).await;
                    drop(token);
                });
            }
            Err(e) => {
                debug!(%peer, error = %e, "connection ended");
                // What its requests started is finished (a cluster rollback goes on to every shard); those
                // whose replies can no longer go out end at their first write.
                streams.drive().await;
                return;
            }
        }
    }
}

/// Forgets a connection's worker binding when the connection ends.
pub(super) struct Unbind {
    pub(super) shared: Arc<Shared>,
    pub(super) conn_id: usize,
}

impl Drop for Unbind {
    fn drop(&mut self) {
        self.shared.bindings.remove(&self.conn_id);
    }
}

pub(super) async fn serve_stream(
    shared: &Shared,
    peer: &ConnPeer,
    share: &Semaphore,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let started = Instant::now();
    // Memory is admitted as the request's bytes arrive (header, then payload), and the reply's only once
    // the request is whole: a stream that declares much and sends little holds next to nothing.
    let mut reservation = Reservation { shared, share, units: 0 };
    let read = async {
        let header = net::read_request_header(&mut recv, &shared.limits, shared.stall_timeout, &mut reservation).await;
        let msg = match header {
            Ok(msg) => msg,
            Err(net::RequestReadError::Wire(e)) => return Ok(Err(e)),
            Err(e) => return Err(e),
        };
        let already = reservation.units as u64 * BUDGET_UNIT;
        let payload = net::read_request_payload(&mut recv, &msg, shared.stall_timeout, already, &mut reservation);
        let (payload, all_finite) = match payload.await {
            Ok(read) => read,
            Err(net::RequestReadError::Wire(e)) => return Ok(Err(e)),
            Err(e) => return Err(e),
        };
        if let Err(e) = net::expect_end(&mut recv).await {
            return Ok(Err(e));
        }
        let whole = reservation.units as u64 * BUDGET_UNIT + shared.reply_bytes(&msg);
        reservation.grow_to(whole).await.map_err(net::RequestReadError::Busy)?;
        Ok(Ok((Frame { msg, payload }, all_finite)))
    };
    let request = match tokio::time::timeout(shared.request_timeout, read).await {
        Err(_) => return cut_off(shared, &mut send, &mut recv, "request"),
        Ok(Err(net::RequestReadError::Stalled)) => return cut_off(shared, &mut send, &mut recv, "stalled request"),
        Ok(Err(net::RequestReadError::Busy(reason))) => {
            return refuse_busy(shared, peer, &mut send, &mut recv, &reason).await
        }
        Ok(Err(net::RequestReadError::Wire(e))) | Ok(Ok(Err(e))) => Err(e),
        Ok(Ok(Ok(request))) => Ok(request),
    };
    let mut held = Held { shared, bytes: 0 };
    serve_request(&mut held, peer, &mut send, &mut recv, request, started).await;
    drop(reservation);
}

/// A request's share of the in-flight budget (in [`BUDGET_UNIT`]s), taken from the shard's budget and from
/// its connection's share as the request's bytes arrive, and given back to both when the request ends.
pub(super) struct Reservation<'a> {
    pub(super) shared: &'a Shared,
    pub(super) share: &'a Semaphore,
    pub(super) units: u32,
}

impl net::Admission for Reservation<'_> {
    async fn grow_to(&mut self, bytes: u64) -> Result<(), String> {
        // A request larger than a connection's share is admitted at the share (the largest model pushes are
        // bounded by the payload limit instead).
        let want = bytes.div_ceil(BUDGET_UNIT).min(u64::from(self.shared.connection_units)) as u32;
        if want <= self.units {
            return Ok(());
        }
        // What is held goes back and the whole amount is taken at once (first the connection's share, then
        // the shard's budget, always in that order): a request never holds part of the budget while it
        // waits for more, so requests that wait on one another cannot deadlock.
        self.release();
        let wait = self.shared.budget_wait;
        let take = async {
            let own = self.share.acquire_many(want).await.map_err(|_| "the shard is stopping".to_string())?;
            let all = self.shared.budget.acquire_many(want).await.map_err(|_| "the shard is stopping".to_string())?;
            own.forget();
            all.forget();
            Ok::<(), String>(())
        };
        match tokio::time::timeout(wait, take).await {
            Ok(Ok(())) => {
                self.units = want;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!(
                "no room for {want} KiB of this request within {wait:?} (in-flight budget {} KiB, {} KiB per connection)",
                self.shared.budget_units, self.shared.connection_units
            )),
        }
    }
}

impl Reservation<'_> {
    pub(super) fn release(&mut self) {
        self.share.add_permits(self.units as usize);
        self.shared.budget.add_permits(self.units as usize);
        self.units = 0;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Refuses a request the in-flight budget had no room for in time: answered [`ErrorCode::Busy`] (nothing of
/// it was applied, the client sends it again), then the rest of it is not read.
pub(super) async fn refuse_busy(
    shared: &Shared,
    peer: &ConnPeer,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    reason: &str,
) {
    shared.busy.fetch_add(1, Ordering::Relaxed);
    shared.metrics.requests_busy.increment(1);
    if let Some(suppressed) = shared.log_malformed.allow() {
        warn!(identity = %peer.identity, %reason, suppressed, "refused a request: no room in the in-flight budget");
    }
    let refusal = Message::error(ErrorCode::Busy, format!("shard {} is busy: {reason}", shared.shard));
    let _ = recv.stop(0u32.into());
    match tokio::time::timeout(shared.stall_timeout, net::write_frame(send, &refusal, &[])).await {
        Ok(Ok(_)) => {
            let _ = send.finish();
        }
        _ => {
            let _ = send.reset(2u32.into());
        }
    }
}

/// Ends a stream whose sender is too slow or stalled: resets both directions and counts it.
pub(super) fn cut_off(shared: &Shared, send: &mut quinn::SendStream, recv: &mut quinn::RecvStream, part: &str) {
    shared.timed_out.fetch_add(1, Ordering::Relaxed);
    shared.metrics.requests_timed_out.increment(1);
    if let Some(suppressed) = shared.log_malformed.allow() {
        warn!(part, request_timeout = ?shared.request_timeout, stall_timeout = ?shared.stall_timeout, suppressed,
            "cut off a request that did not arrive in time");
    }
    let _ = recv.stop(2u32.into());
    let _ = send.reset(2u32.into());
}

/// The buffer bytes one RPC holds, released from the shared count when the RPC ends however it ends.
pub(super) struct Held<'a> {
    pub(super) shared: &'a Shared,
    pub(super) bytes: u64,
}

impl Held<'_> {
    pub(super) fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        let now = self.shared.held_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.shared.peak_held_bytes.fetch_max(now, Ordering::Relaxed);
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.shared.held_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

pub(super) async fn serve_request(
    held: &mut Held<'_>,
    peer: &ConnPeer,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    request: Result<(Frame, bool), WireError>,
    started: Instant,
) {
    let shared = held.shared;
    let mut finite = false;
    let request = request.map(|(frame, all_finite)| {
        held.add(frame.payload.len() as u64 * 4);
        finite = all_finite;
        frame
    });
    let (reply, views, histogram) = match request {
        Err(WireError::Io(message)) => {
            debug!(%message, "stream broke before the request was complete");
            return;
        }
        Err(e) => {
            if let Some(suppressed) = shared.log_malformed.allow() {
                warn!(error = %e, identity = %peer.identity, suppressed, "refused a malformed request");
            }
            let refusal = Frame::new(Message::error(wire_error_code(&e), e.to_string()));
            (refusal, Vec::new(), &shared.metrics.rpc_other_seconds)
        }
        Ok(frame) => {
            shared.metrics.bytes_in.increment(frame.msg.payload_bytes());
            let kind = RpcKind::of(&frame.msg);
            let histogram = match kind {
                RpcKind::Push | RpcKind::PushPull | RpcKind::Step(_) => &shared.metrics.rpc_push_seconds,
                RpcKind::Pull => &shared.metrics.rpc_pull_seconds,
                RpcKind::Other => &shared.metrics.rpc_other_seconds,
            };
            let handled = answer(shared, peer, frame, finite).await;
            let Some((reply, events, views)) = handled else {
                let _ = send.reset(1u32.into());
                return;
            };
            log_events(&events);
            after_events(shared, &events);
            record(&shared.metrics, kind, &reply.msg);
            (reply, views, histogram)
        }
    };
    let Frame { msg, payload } = reply;
    let parts = match reply_parts(&msg, payload, views) {
        Ok(parts) => parts,
        Err(e) => {
            warn!(error = %e, "a reply's payload does not match its header");
            let _ = send.reset(1u32.into());
            return;
        }
    };
    held.add(parts.iter().map(|p| p.len() as u64).sum());
    // A peer that does not take its reply is cut off at the request's time limit, which frees the reply.
    match tokio::time::timeout(shared.request_timeout, net::write_frame(send, &msg, &parts)).await {
        Ok(Ok(bytes)) => shared.metrics.bytes_out.increment(bytes),
        Ok(Err(e)) => debug!(error = %e, "writing the reply"),
        Err(_) => return cut_off(shared, send, recv, "reply"),
    }
    let _ = send.finish();
    histogram.record(started.elapsed().as_secs_f64());
}

/// What a request that read whole is answered with: refused (unauthorized, fenced, over its certificate's
/// worker limit), answered here (where the coordinator is, choosing shard 0's configuration, checkpoint and
/// rollback orders, copies for a backup), or handled by the core; None when the shard is going away.
async fn answer(
    shared: &Shared,
    peer: &ConnPeer,
    frame: Frame,
    finite: bool,
) -> Option<(Frame, Vec<CoreEvent>, Vec<Arc<Vec<f32>>>)> {
    let bound = shared.bindings.get(&peer.conn_id).map(|w| *w);
    let fenced = shared.log.as_ref().is_some_and(|l| l.fenced());
    let coordinator = || shared.link.coordinator().1;
    let mut allowed = crate::auth::authorize(&frame.msg, &peer.identity, bound, &coordinator);
    // The coordinator's order from a shard process this one does not know as the coordinator: it may
    // have missed a configuration chosen since (the news goes out once); it asks, then judges again.
    let order = matches!(frame.msg, Message::CheckpointRequest(_) | Message::Rollback(_));
    if allowed.is_err() && order && shared.quorum.is_some() && matches!(peer.identity.role, Role::Shard(_)) {
        shared.link.locate_rarely().await;
        allowed = crate::auth::authorize(&frame.msg, &peer.identity, bound, &coordinator);
    }
    if let Err(reason) = allowed {
        Some((refuse_unauthorized(shared, peer, &reason), Vec::new(), Vec::new()))
    } else if let Message::CoordinatorWhere(_) = frame.msg {
        let copies = shared.backups.as_ref().map_or_else(Vec::new, |b| b.held());
        let at = gaps_common::wire::CoordinatorAt { config: coordinator_where(shared), copies, starting: false };
        Some((Frame::new(Message::CoordinatorAt(at)), Vec::new(), Vec::new()))
    } else if crate::quorum::is_quorum_message(&frame.msg) {
        // A fenced process still takes part in choosing shard 0's configuration.
        let reply = match (&shared.quorum, &peer.identity.role) {
            (Some(q), Role::Shard(sender)) => q.handle_async(*sender, &frame.msg).await,
            _ => Frame::new(Message::error(
                ErrorCode::Misconfigured,
                "this cluster does not choose shard 0's configuration by majority (it takes --replicas 2 \
                 or more and at least 3 shard processes)",
            )),
        };
        Some((reply, Vec::new(), Vec::new()))
    } else if fenced && !matches!(frame.msg, Message::ReplicaSnapshot(_) | Message::ReplicaAppend(_)) {
        Some((moved(shared), Vec::new(), Vec::new()))
    } else if let Some(refusal) = promote_refusal(shared, &frame.msg).await {
        Some((refusal, Vec::new(), Vec::new()))
    } else if let Message::Authenticate(a) = frame.msg {
        Some((authenticate(shared, peer, a), Vec::new(), Vec::new()))
    } else if let Message::CheckpointRequest(req) = frame.msg {
        Some((checkpoint_reply(shared, req).await, Vec::new(), Vec::new()))
    } else if let Message::Rollback(req) = frame.msg {
        Some((rollback_reply(shared, req).await, Vec::new(), Vec::new()))
    } else if matches!(frame.msg, Message::ReplicaSnapshot(_) | Message::ReplicaAppend(_)) {
        let sender = match peer.identity.role {
            Role::Shard(p) => p,
            _ => u32::MAX,
        };
        let reply = match &shared.backups {
            Some(backups) => backups.handle(sender, frame).await,
            None => Frame::new(Message::error(
                ErrorCode::Misconfigured,
                format!("shard {} keeps no copies of other shards (--replicas 1)", shared.shard),
            )),
        };
        Some((reply, Vec::new(), Vec::new()))
    } else if matches!(&frame.msg, Message::Register(r) if r.role == WireRole::Worker)
        && shared.per_certificate.get(&peer.identity).is_some_and(|n| *n >= shared.max_per_certificate)
    {
        let reason = format!(
            "this certificate already holds {} live workers, the most one may register \
             (--max-workers-per-certificate)",
            shared.max_per_certificate
        );
        Some((refuse_unauthorized(shared, peer, &reason), Vec::new(), Vec::new()))
    } else {
        through_the_core(shared, peer, frame, finite).await
    }
}

/// A request for the core: sent to the actor; answered once every live backup applied what it changed (a
/// worker's map once the backups hold all the map shows); the credentials added to a map.
async fn through_the_core(
    shared: &Shared,
    peer: &ConnPeer,
    frame: Frame,
    finite: bool,
) -> Option<(Frame, Vec<CoreEvent>, Vec<Arc<Vec<f32>>>)> {
    let registers_worker = matches!(&frame.msg, Message::Register(r) if r.role == WireRole::Worker);
    let registers_shard = matches!(frame.msg, Message::RegisterShard(_));
    // Run here when the core is idle and the request small; handed to the core's thread otherwise.
    let reply = match shared.queue.try_inline(Box::new(frame), finite) {
        Ok(rx) => rx.await.ok(),
        Err(frame) => {
            let (tx, rx) = oneshot::channel();
            match shared.send(Command::Handle { frame, finite, reply: tx }).await {
                Ok(()) => rx.await.ok(),
                Err(_) => None,
            }
        }
    };
    // A request that changed the shard is answered once every live backup applied it. A backup
    // that does not answer stops counting within its ack timeout once the coordinator heard of
    // it; should the wait outlast a request's time limit (the coordinator unreachable) the reply
    // says to send the request again, and a fenced shard (another process serves it now)
    // acknowledges nothing.
    let reply = match (&shared.log, reply) {
        (Some(log), Some(answer)) => {
            // The coordinator's map goes out to a worker or observer only once the backups hold
            // everything it shows (a read index): a coordinator cut off from a majority cannot
            // send workers after a change (a promotion) its backups never got. Shard processes are
            // answered at once: choosing a configuration without a silent backup asks for maps.
            let worker_map =
                matches!(answer.0.msg, Message::ClusterMap(_)) && matches!(peer.identity.role, Role::Worker(_));
            let index = if worker_map { answer.3.max(log.last_index()) } else { answer.3 };
            match tokio::time::timeout(shared.request_timeout, log.wait(index)).await {
                Ok(true) => Some(answer),
                Ok(false) => Some((moved(shared), Vec::new(), Vec::new(), 0)),
                Err(_) => {
                    let msg = "the shard's backups did not acknowledge the request in time; send it again";
                    Some((Frame::new(Message::error(ErrorCode::Busy, msg)), Vec::new(), Vec::new(), 0))
                }
            }
        }
        (_, reply) => reply,
    };
    // Credentials go out with the map: a worker's token to its registrant, the key to a shard.
    reply.map(|(mut reply, events, views, _)| {
        if let Message::ClusterMap(map) = &mut reply.msg {
            map.replicas = shared.replicas;
            // Shard 0's backups in sync are the configuration a majority chose last.
            if let (0, Some(q)) = (shared.shard, &shared.quorum) {
                let chosen = q.chosen();
                if let Some(s0) = map.shards.first_mut().filter(|s| s.process == chosen.serving) {
                    s0.backups = chosen.in_sync;
                }
            }
            if let (true, Some(w)) = (registers_worker, map.worker_id) {
                map.token = Some(shared.credentials.token(w, &peer.identity));
                shared.registrants.insert(w, peer.identity.clone());
                *shared.per_certificate.entry(peer.identity.clone()).or_insert(0) += 1;
            }
            if registers_shard {
                map.auth_key = Some(shared.credentials.raw());
            }
        }
        (reply, events, views)
    })
}

/// The payload parts of reply `msg`: the parameter buffers it shares with the core
/// (`ShardCore::set_shared_replies`), each handed to quinn as it is and held until the peer acknowledged
/// it; values the core packed for the wire (`ShardCore::set_packed_replies`); or f32 values.
pub(super) fn reply_parts(
    msg: &Message,
    payload: Vec<f32>,
    views: Vec<Arc<Vec<f32>>>,
) -> Result<Vec<net::Bytes>, WireError> {
    if !views.is_empty() {
        let elems: u64 = views.iter().map(|v| v.len() as u64).sum();
        if elems != msg.payload_elems() || !payload.is_empty() {
            return Err(WireError::ElementCountMismatch { expected: msg.payload_elems(), got: elems });
        }
        return Ok(views.into_iter().map(|v| net::f32_bytes(SharedParams(v))).collect());
    }
    let packed = match msg {
        Message::PullReply(PullReply { chunks })
        | Message::PushPullReply(PushPullReply { chunks, .. })
        | Message::StepReply(gaps_common::wire::StepReply { push: PushPullReply { chunks, .. }, .. }) => {
            chunks.iter().any(|c| c.dtype != gaps_common::dtype::WireDtype::F32)
        }
        _ => false,
    };
    if packed {
        net::packed_parts(msg, payload)
    } else {
        net::payload_parts(msg, payload)
    }
}

/// Where this process knows the coordinator to be ([`Message::CoordinatorWhere`]): the configuration of
/// shard 0 last chosen by a majority, or, where none chooses it, process 0 at the address this process was
/// given (its own, on shard 0).
pub(super) fn coordinator_where(shared: &Shared) -> gaps_common::quorum::CoordinatorConfig {
    match &shared.quorum {
        Some(q) => q.chosen(),
        None => gaps_common::quorum::CoordinatorConfig {
            version: 0,
            serving: 0,
            addr: shared.link.given.clone(),
            in_sync: Vec::new(),
        },
    }
}

/// The answer of a shard process that no longer serves its shard (a backup took it over).
pub(super) fn moved(shared: &Shared) -> Frame {
    let msg = format!("shard {} is served by another shard process now: fetch the cluster map again", shared.shard);
    Frame::new(Message::error(ErrorCode::Moved, msg))
}

/// On the coordinator, the refusal of a [`Message::Promote`] whose shard's primary still answers (None:
/// the core decides). The primary is asked for its stats on a new connection, within [`PROBE_WAIT`]. One
/// that does not answer is dead to the coordinator's own log too: its copy of shard 0 stops counting at once
/// (shard 0 needs no leave), so the promotion's own reply does not wait for that dead backup.
pub(super) async fn promote_refusal(shared: &Shared, msg: &Message) -> Option<Frame> {
    let Message::Promote(p) = msg else { return None };
    let (tx, rx) = oneshot::channel();
    let shard = p.shard;
    let ask = Command::Inspect(Box::new(move |core| {
        let _ = tx.send(core.serving(shard));
    }));
    let (addr, process, _) = match shared.send(ask).await {
        Ok(()) => rx.await.ok().flatten()?,
        Err(_) => return None,
    };
    // The process serving it asks for it itself: it started again (its life that served the shard ended), and
    // the core grants it only where no backup is in sync. (A spare, or a process still starting, at the old
    // address answers the probe `Moved` or `Busy`: not serving.)
    if process == p.process {
        return None;
    }
    match shared.link.answers(&addr, process, PROBE_WAIT).await {
        true => Some(Frame::new(Message::error(
            ErrorCode::Misconfigured,
            format!("shard {shard}'s primary at {addr} answers: it is not taken over"),
        ))),
        false => {
            // Where a majority chooses shard 0's backups, a probe that got no answer does not prove the
            // process dead: its shipping task stops waiting for it and proposes a configuration without it
            // at once (rather than after its ack timeout), and replies stop waiting once that is chosen.
            match (&shared.log, &shared.quorum) {
                (Some(log), None) => log.unfollow(process),
                (Some(log), Some(_)) => log.suspect(process),
                _ => {}
            }
            None
        }
    }
}

/// How long the coordinator waits for a primary's answer before it lets a backup take the shard over.
pub(super) const PROBE_WAIT: Duration = Duration::from_millis(500);

/// Refuses a request its peer may not send: counted, logged at a bounded rate, and answered with a reason
/// that names the certificate and the request, nothing of the model.
pub(super) fn refuse_unauthorized(shared: &Shared, peer: &ConnPeer, reason: &str) -> Frame {
    shared.unauthorized.fetch_add(1, Ordering::Relaxed);
    shared.metrics.unauthorized.increment(1);
    if let Some(suppressed) = shared.log_unauthorized.allow() {
        warn!(identity = %peer.identity, %reason, suppressed, "refused an unauthorized request");
    }
    Frame::new(Message::error(ErrorCode::Unauthorized, format!("not authorized: {reason}")))
}

/// Binds the connection to a worker whose credential it presents.
pub(super) fn authenticate(shared: &Shared, peer: &ConnPeer, a: gaps_common::wire::Authenticate) -> Frame {
    if !matches!(peer.identity.role, Role::Worker(_)) {
        return refuse_unauthorized(shared, peer, "only worker certificates authenticate as workers");
    }
    if !shared.credentials.verify(a.worker, &peer.identity, &a.token) {
        return refuse_unauthorized(
            shared,
            peer,
            &format!("the credential is not worker {}'s for this certificate and cluster epoch", a.worker),
        );
    }
    shared.bindings.insert(peer.conn_id, a.worker);
    Frame::new(Message::Authenticated(gaps_common::wire::Authenticated { worker: a.worker }))
}

/// A worker that left or whose lease expired no longer counts against its registrant's certificate; a
/// change of who serves which shard, or a backup newly in sync, is checkpointed on the coordinator
/// ([`Shared::tables_changed`]).
pub(super) fn after_events(shared: &Shared, events: &[CoreEvent]) {
    let tables = |e: &CoreEvent| {
        matches!(e, CoreEvent::ShardPromoted { .. } | CoreEvent::ShardJoined(_) | CoreEvent::InSyncGrew { .. })
    };
    if events.iter().any(tables) {
        shared.tables_changed.notify_one();
    }
    for e in events {
        if let CoreEvent::WorkerLeft(w) | CoreEvent::WorkerExpired(w) = e {
            if let Some((_, identity)) = shared.registrants.remove(w) {
                shared.per_certificate.remove_if_mut(&identity, |_, n| {
                    *n = n.saturating_sub(1);
                    *n == 0
                });
            }
        }
    }
}

pub(super) fn log_events(events: &[CoreEvent]) {
    for e in events {
        match e {
            CoreEvent::WorkerJoined(w) => info!(worker = w, "worker registered"),
            CoreEvent::WorkerLeft(w) => info!(worker = w, "worker left"),
            CoreEvent::WorkerExpired(w) => warn!(worker = w, "worker lease expired"),
            CoreEvent::ShardJoined(s) => info!(joined = s, "shard joined"),
            CoreEvent::ShardPromoted { shard, process, epoch } => {
                warn!(shard, process, epoch, "a backup took over a shard whose primary went silent")
            }
            CoreEvent::InSyncGrew { shard, in_sync } => debug!(shard, ?in_sync, "a shard's backups in sync grew"),
            CoreEvent::DeviceFault(what) => error!(%what, "device fault"),
            CoreEvent::ModeDecided { number, to, from_step, reason } => {
                warn!(number, %to, from_step, %reason, "cluster mode decided (every shard switches at that worker step)")
            }
            CoreEvent::ModeSwitch { from, to, reason } => warn!(%from, %to, %reason, "training mode switched"),
            CoreEvent::LrRamp { workers, target } => {
                info!(workers, target, "learning-rate multiplier ramps to the new worker count")
            }
        }
    }
}

mod counted;
mod streams;
pub(super) use counted::{record, RpcKind};
use streams::Streams;

#[cfg(test)]
mod tests;
