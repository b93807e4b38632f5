//! Connection management: each shard's connections and route, a request's retries and re-routing, and
//! following the coordinator's map when a shard moved (replicated shards).

use super::*;

impl Client {
    pub(super) async fn connection(
        &self,
        shard: usize,
        lane: usize,
        timeout: Duration,
    ) -> Result<quinn::Connection, RpcError> {
        let link = &self.inner.shards[shard];
        let slot = link.conns.get(lane).ok_or_else(|| RpcError::Setup(format!("no lane {lane}")))?;
        let existing = slot.lock().map_err(|_| RpcError::Setup("connection lock poisoned".into()))?.clone();
        if let Some(conn) = existing {
            if conn.close_reason().is_none() {
                if !self.undriven_too_long(shard, lane) {
                    return Ok(conn);
                }
                // Its caller computed past the limit: the peer may have dropped it, so it is closed (the
                // shard is told, if it still listens) and replaced before a request meets it.
                conn.close(0u32.into(), b"left undriven");
            }
        }
        // Resolved again: a restarted shard may be back at another address under the same name.
        let route = link.route();
        let addr = match tokio::time::timeout(timeout, net::resolve(&route.name)).await {
            Ok(Ok(addr)) => addr,
            _ => route.addr,
        };
        let rotated = self.inner.rotated.lock().map_err(|_| RpcError::Setup("TLS lock poisoned".into()))?.clone();
        let conn = net::connect_with(&self.inner.endpoint, rotated, addr, timeout).await?;
        // The server must hold this shard's certificate of our cluster; then this connection is bound to our
        // worker id with the coordinator's credential (observers have none and only read).
        net::expect_shard(&conn, &self.inner.cluster, route.process)?;
        if let (Some(worker), Some(token)) = (self.inner.map.worker_id, self.inner.map.token) {
            let auth = Message::Authenticate(Authenticate { worker, token });
            match net::call(&conn, &auth, &[], &self.inner.opts.limits, timeout).await? {
                Frame { msg: Message::Authenticated(_), .. } => {}
                other => {
                    return Err(RpcError::Unexpected {
                        addr: conn.remote_address().to_string(),
                        kind: net::kind_name(&other.msg).into(),
                    })
                }
            }
        }
        *slot.lock().map_err(|_| RpcError::Setup("connection lock poisoned".into()))? = Some(conn.clone());
        self.used(shard, lane);
        Ok(conn)
    }

    /// Notes that a request on `shard`'s `lane` finished (or its connection was opened) now; only a
    /// caller-driven client keeps the time.
    fn used(&self, shard: usize, lane: usize) {
        if !self.inner.caller_driven {
            return;
        }
        let now = u64::try_from(self.inner.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Some((used, _)) = self.inner.shards[shard].used_ms.get(lane) {
            used.store(now, Ordering::Relaxed);
        }
    }

    /// True when this client's connections move only while its caller awaits, and `shard`'s `lane` has no
    /// request on its way and saw none finish for [`UNDRIVEN_LIMIT`]: its caller may have computed that long
    /// without a keep-alive going out.
    fn undriven_too_long(&self, shard: usize, lane: usize) -> bool {
        let Some((used, on_way)) = self.inner.shards[shard].used_ms.get(lane) else { return false };
        if !self.inner.caller_driven || on_way.load(Ordering::Relaxed) > 0 {
            return false;
        }
        let since = self.inner.born.elapsed().saturating_sub(Duration::from_millis(used.load(Ordering::Relaxed)));
        since > UNDRIVEN_LIMIT
    }

    /// One request to one shard, sent again on a new connection after a transport failure until the shard
    /// has been unreachable for `shard_down_timeout`. Callers only use it for idempotent requests (pushes are
    /// made idempotent by their sequence number).
    pub(super) async fn request(
        &self,
        shard: usize,
        msg: &Message,
        payload: &[net::Bytes],
    ) -> Result<(Frame, u32), RpcError> {
        self.request_with(shard, msg, payload, &mut net::InFrame).await
    }

    /// [`Self::request`] with the reply's payload read where `sink` says.
    pub(super) async fn request_with<S: net::ReplySink + Send + ?Sized>(
        &self,
        shard: usize,
        msg: &Message,
        payload: &[net::Bytes],
        sink: &mut S,
    ) -> Result<(Frame, u32), RpcError> {
        self.request_on(shard, 0, msg, payload, sink).await
    }

    /// Returns once shard `shard`'s route moved past `route_epoch` (a backup took it over), looking at the
    /// route every 50 ms and asking the coordinator's map every 300 ms once a request waited
    /// MOVED_CHECK_AFTER; never without copies of the shards (or for shard 0 when the coordinator cannot move).
    async fn moved_away(&self, shard: usize, route_epoch: u64) {
        if self.inner.map.replicas < 2 || (shard == 0 && !self.coordinator_moves()) {
            return std::future::pending().await;
        }
        // Another request may find the move first: the route is looked at every 50 ms (a lock), the
        // coordinator asked once the request waited MOVED_CHECK_AFTER.
        let began = Instant::now();
        loop {
            if self.inner.shards[shard].epoch() != route_epoch {
                return;
            }
            if began.elapsed() < MOVED_CHECK_AFTER {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            self.follow_map(shard).await;
            if self.inner.shards[shard].epoch() != route_epoch {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// [`Self::request_with`] on one of the shard's lanes (its connections for striped transfers).
    pub(super) async fn request_on<S: net::ReplySink + Send + ?Sized>(
        &self,
        shard: usize,
        lane: usize,
        msg: &Message,
        payload: &[net::Bytes],
        sink: &mut S,
    ) -> Result<(Frame, u32), RpcError> {
        let opts = &self.inner.opts;
        let mut attempt = 0u32;
        let mut down_since: Option<Instant> = None;
        let mut busy_since: Option<Instant> = None;
        loop {
            // With copies of the shards, a request (or its connection) that waits long may wait for a dead
            // primary, whose connection only times out after seconds: the coordinator's map tells whether a
            // backup took the shard over, and the request goes there instead.
            let route_epoch = self.inner.shards[shard].epoch();
            let moved = self.moved_away(shard, route_epoch);
            let attempt_once = async {
                // A handshake with a live shard takes milliseconds; a short bound lets a restarted shard be
                // found again soon after it is back, and never outlasts the shard-down timeout.
                let left =
                    down_since.map_or(opts.shard_down_timeout, |t| opts.shard_down_timeout.saturating_sub(t.elapsed()));
                let bound = opts.rpc_timeout.min(Duration::from_secs(5)).min(left.max(Duration::from_millis(100)));
                let conn = self.connection(shard, lane, bound).await?;
                if self.take_injected_drop() {
                    return Err(send_then_drop(&conn, msg, payload).await);
                }
                let lane_use = self.inner.shards[shard].used_ms.get(lane).filter(|_| self.inner.caller_driven);
                let _on_way = OnWay::count(lane_use.map(|(_, n)| n));
                net::call_with(&conn, msg, payload, &opts.limits, opts.rpc_timeout, &mut *sink).await
            };
            let result = tokio::select! {
                reply = attempt_once => Some(reply),
                () = moved => None,
            };
            self.used(shard, lane);
            // Another process serves the shard now (its route says where): the request goes there at once,
            // with the same sequence number.
            let Some(result) = result else {
                attempt += 1;
                self.inner.retries.fetch_add(1, Ordering::Relaxed);
                tracing::info!(shard, addr = %self.inner.shards[shard].addr(), "the shard moved to its backup; sending there");
                continue;
            };
            match result {
                Ok(frame) => return Ok((frame, attempt)),
                // The shard had no memory free for the request in time: nothing was applied; the same request
                // goes again on the same connection after a short, jittered pause.
                Err(RpcError::Remote { code: ErrorCode::Busy, message, .. })
                    if busy_since.get_or_insert_with(Instant::now).elapsed() < opts.rpc_timeout =>
                {
                    attempt += 1;
                    self.inner.retries.fetch_add(1, Ordering::Relaxed);
                    if attempt == 1 || attempt % 20 == 0 {
                        warn!(shard, attempt, %message, "shard busy, sending the request again");
                    }
                    let pause = (10 * u64::from(attempt)).min(200);
                    tokio::time::sleep(Duration::from_millis(pause + jitter_ms(pause))).await;
                }
                Err(e)
                    if (e.is_retryable() || matches!(e, RpcError::Remote { code: ErrorCode::Moved, .. }))
                        && down_since.is_none_or(|t| t.elapsed() < opts.shard_down_timeout) =>
                {
                    let since = *down_since.get_or_insert_with(Instant::now);
                    attempt += 1;
                    self.inner.retries.fetch_add(1, Ordering::Relaxed);
                    // A backup may have taken the shard over: the coordinator's map says where it is now.
                    if self.follow_map(shard).await {
                        tracing::info!(shard, addr = %self.inner.shards[shard].addr(), "the shard moved to its backup; sending there");
                        continue;
                    }
                    let addr = self.inner.shards[shard].addr();
                    if attempt == 1 || attempt % 20 == 0 {
                        warn!(
                            shard,
                            %addr,
                            attempt,
                            down_for = ?since.elapsed(),
                            wait_up_to = ?opts.shard_down_timeout,
                            error = %e,
                            "shard unreachable, retrying on a new connection"
                        );
                    }
                    if let Some(Ok(mut guard)) = self.inner.shards[shard].conns.get(lane).map(|c| c.lock()) {
                        *guard = None;
                    }
                    tokio::time::sleep(Duration::from_millis((50 * u64::from(attempt)).min(500))).await;
                }
                Err(e) if e.is_retryable() => {
                    let addr = self.inner.shards[shard].addr();
                    return Err(RpcError::Connection {
                        addr: addr.to_string(),
                        message: format!(
                            "shard {shard} stayed unreachable for {:?} ({attempt} retries): {e}",
                            down_since.map_or(Duration::ZERO, |t| t.elapsed())
                        ),
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Asks the coordinator where the shards are served now and follows each that a backup took over (a
    /// newer replica epoch); true when shard `shard` moved. At most one question per 300 ms. Shard 0 — the
    /// coordinator itself — moves only where a majority of the shard processes chooses who serves it
    /// ([`Client::coordinator_moves`]): for it, the processes are asked where the coordinator is first.
    pub(super) async fn follow_map(&self, shard: usize) -> bool {
        if shard == 0 && !self.coordinator_moves() {
            return false;
        }
        {
            let Ok(mut last) = self.inner.map_asked.lock() else { return false };
            if last.is_some_and(|t| t.elapsed() < Duration::from_millis(300)) {
                return false;
            }
            *last = Some(Instant::now());
        }
        let Ok(map) = self.ask_map(shard == 0).await else { return false };
        let mut moved = false;
        for s in &map.shards {
            let Some(link) = self.inner.shards.get(s.index as usize) else { continue };
            if s.epoch <= link.epoch() {
                continue;
            }
            let Ok(addr) = net::resolve(&s.addr).await else { continue };
            match link.route.lock() {
                // Another task may have followed a newer map meanwhile: a route never goes back.
                Ok(mut route) if route.epoch < s.epoch => {
                    *route = Route { name: s.addr.clone(), addr, process: s.process, epoch: s.epoch };
                }
                _ => continue,
            }
            for conn in &link.conns {
                if let Ok(mut c) = conn.lock() {
                    *c = None;
                }
            }
            moved |= s.index as usize == shard;
        }
        moved
    }

    /// Whether the coordinator (shard 0) can move: replicated shards on 3 processes or more, where a
    /// majority of them chooses who serves it.
    pub fn coordinator_moves(&self) -> bool {
        self.inner.map.replicas >= 2 && self.inner.map.num_shards >= 3
    }

    /// The coordinator's current cluster map: asked where shard 0 is served as this client knows it, and —
    /// where the coordinator can move — of the process the shard processes say serves it when that one does
    /// not answer, or first when `locate` (shard 0's own requests went wrong: the process this client knows
    /// may be an old coordinator cut off from the others). Each question: 2 s to connect, 2 s for the answer.
    pub(super) async fn ask_map(&self, locate: bool) -> Result<ClusterMap, ClientError> {
        let map = self.coordinator_map(locate).await?;
        let known = map.process_addrs();
        if let (Ok(mut p), false) = (self.inner.processes.lock(), known.is_empty()) {
            *p = known;
        }
        Ok(map)
    }

    /// [`Client::ask_map`] before the processes it lists are remembered.
    pub(super) async fn coordinator_map(&self, locate: bool) -> Result<ClusterMap, ClientError> {
        let route = self.inner.shards[0].route();
        let moves = self.coordinator_moves();
        let mut asked = None;
        if !locate || !moves {
            let first = self.map_from(&route.name, route.process).await;
            if first.is_ok() || !moves {
                return first;
            }
            asked = Some(first);
        }
        // The processes are asked at most once a second (each question is a handshake with every one).
        {
            let Ok(mut last) = self.inner.located.lock() else {
                return Err(ClientError::BadMap("lock poisoned".into()));
            };
            if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                return asked.unwrap_or_else(|| {
                    Err(ClientError::BadMap("the shard processes were asked where the coordinator is just now".into()))
                });
            }
            *last = Some(Instant::now());
        }
        match (self.locate_coordinator().await, asked) {
            (Some(c), _) if (c.serving, c.addr.as_str()) != (route.process, route.name.as_str()) => {
                self.map_from(&c.addr, c.serving).await
            }
            (_, Some(first)) => first,
            // Nobody knows of another coordinator than the one shard 0's requests already go to: it did not
            // move (asking it again could wait seconds on a dead process).
            (Some(_), None) => Err(ClientError::BadMap("shard 0 is served where it was; nothing moved".into())),
            (None, None) => self.map_from(&route.name, route.process).await,
        }
    }

    /// The cluster map shard process `process` at `addr` hands an observer.
    pub(super) async fn map_from(&self, addr: &str, process: u32) -> Result<ClusterMap, ClientError> {
        let opts = &self.inner.opts;
        let register =
            Message::Register(Register { protocol: PROTOCOL_VERSION, role: Role::Observer, name: opts.name.clone() });
        let addr = net::resolve(addr).await?;
        let rotated = self.inner.rotated.lock().map_err(|_| RpcError::Setup("TLS lock poisoned".into()))?.clone();
        let conn = net::connect_with(&self.inner.endpoint, rotated, addr, Duration::from_secs(2)).await?;
        net::expect_shard(&conn, &self.inner.cluster, process)?;
        let reply = net::call(&conn, &register, &[], &opts.limits, Duration::from_secs(2)).await;
        conn.close(0u32.into(), b"map");
        match reply?.msg {
            Message::ClusterMap(map) => Ok(map),
            other => Err(ClientError::BadMap(format!("the coordinator answered a map request with {other:?}"))),
        }
    }

    /// The newest configuration of shard 0 that the shard processes this client knows say was chosen: all are
    /// asked at once (each within 1.5 s), and the answer is in once a majority of the cluster's processes
    /// answered (a dead one is not waited for) or none is left to; None when none answered.
    pub(super) async fn locate_coordinator(&self) -> Option<gaps_common::quorum::CoordinatorConfig> {
        let processes = self.inner.processes.lock().map(|p| p.clone()).unwrap_or_default();
        let rotated = self.inner.rotated.lock().ok()?.clone();
        let majority = self.inner.map.num_shards as usize / 2 + 1;
        let wait = Duration::from_millis(1500);
        net::newest_coordinator(&self.inner.endpoint, rotated, &self.inner.cluster, &processes, (majority, wait)).await
    }

    /// The coordinator's cluster map as it is now: who serves each shard under which replica epoch, the
    /// backups in sync, the spare processes (the map of [`Client::map`] is the one received at
    /// registration).
    pub async fn current_map(&self) -> Result<ClusterMap, ClientError> {
        self.ask_map(false).await
    }

    pub(super) fn take_injected_drop(&self) -> bool {
        self.inner.drop_after_send.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

/// An injected failure (tests): the request is sent, then the connection cut before the reply comes.
async fn send_then_drop(conn: &quinn::Connection, msg: &Message, payload: &[net::Bytes]) -> RpcError {
    let addr = conn.remote_address().to_string();
    // The receiving side stays open until the connection is cut, as for a request that waits for its reply.
    let (mut send, _recv) = match conn.open_bi().await {
        Ok(streams) => streams,
        Err(e) => return RpcError::Connection { addr, message: e.to_string() },
    };
    let _ = net::write_frame(&mut send, msg, payload).await;
    let _ = send.finish();
    // Give the request time to reach the shard, then cut the connection before the reply.
    tokio::time::sleep(Duration::from_millis(50)).await;
    conn.close(1u32.into(), b"injected failure");
    RpcError::Connection { addr, message: "injected connection drop".into() }
}

/// Counts a request on its way on a lane while it lives ([`Client::undriven_too_long`]).
struct OnWay<'a>(Option<&'a AtomicU32>);

impl<'a> OnWay<'a> {
    fn count(counter: Option<&'a AtomicU32>) -> Self {
        if let Some(n) = counter {
            n.fetch_add(1, Ordering::Relaxed);
        }
        OnWay(counter)
    }
}

impl Drop for OnWay<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.0 {
            n.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
