//! The dense model: pulls, pushes and push-pulls of the dense chunks, their acknowledgements and
//! synchronous waits, and a model's own initial values.

use super::*;

impl Client {
    /// Pulls the whole model from the shards that hold it, concurrently (a shard that owns no chunk of the
    /// model is not asked). Each shard's reply is read straight into the snapshot's tensors (no
    /// intermediate buffer, no zero-fill).
    pub async fn pull(&self) -> Result<Snapshot, ClientError> {
        let client = self.clone();
        on_runtime("pull", async move { client.pull_here().await }).await
    }

    /// [`Self::pull`] on the calling task.
    async fn pull_here(&self) -> Result<Snapshot, ClientError> {
        let mut tensors = self.snapshot_buffers();
        let (mut sinks, requests_of) = self.pull_sinks(&mut tensors, None)?;
        // A shard that owns no chunk of the model has nothing to read: it is not asked.
        let requests = sinks.iter_mut().zip(&requests_of).filter(|(_, (_, _, chunks))| !chunks.is_empty()).map(
            |(sink, (s, lane, chunks))| {
                let msg = Message::Pull(Pull {
                    epoch: self.inner.map.epoch,
                    chunks: chunks.iter().map(|(id, _)| *id).collect(),
                });
                async move { (*s, self.request_on(*s, *lane, &msg, &[], sink).await) }
            },
        );
        for (s, outcome) in join_all(requests.collect()).await {
            outcome.map_err(|e| match e {
                RpcError::BadReply { message, .. } => ClientError::BadMap(format!("shard {s}: {message}")),
                other => other.into(),
            })?;
        }
        let versions = self.pulled_versions(&sinks, &requests_of);
        drop(sinks);
        Ok(self.pulled_snapshot(tensors, versions))
    }

    /// The snapshot a pull (or a push-pull's answer) filled: `tensors` with their chunks' `versions`. The
    /// time is remembered: the next push's compute time counts from it.
    pub(super) fn pulled_snapshot(&self, tensors: Vec<Vec<f32>>, versions: Vec<u64>) -> Snapshot {
        if let Ok(mut last) = self.inner.last_pull.lock() {
            *last = Some(Instant::now());
        }
        Snapshot { tensors: Arc::new(tensors), versions }
    }

    /// A snapshot's tensor buffers. Every element is written by exactly one shard's reply before the
    /// snapshot is returned (every chunk is owned, checked by [`Self::pull_sinks`]), so recycled buffers
    /// are used as they are, without a memset.
    pub(super) fn snapshot_buffers(&self) -> Vec<Vec<f32>> {
        self.inner.map.layout.tensors.iter().map(|t| gaps_common::buffers::take_filled(t.len as usize)).collect()
    }

    /// Where the shards' pull replies go: one request per shard, or per stripe of a shard's chunks on its own
    /// connection for a large model (see `ClientOptions::lanes`; `lanes` overrides it), as (shard, lane, that
    /// request's chunks) with the sink that reads its reply into `tensors`.
    pub(super) fn pull_sinks<'t>(
        &'t self,
        tensors: &'t mut [Vec<f32>],
        lanes: Option<usize>,
    ) -> Result<(Vec<PullInto<'t>>, Vec<PullRequest<'t>>), ClientError> {
        let layout = &self.inner.map.layout;
        let chunk_elems = layout.chunk_elems.max(1) as usize;
        // Chunk slices of every tensor, in chunk order, handed to the shard that owns each chunk.
        let mut slots: Vec<Vec<Option<&mut [f32]>>> =
            tensors.iter_mut().map(|t| t.chunks_mut(chunk_elems).map(Some).collect()).collect();
        let mut sinks = Vec::with_capacity(self.inner.shards.len());
        let mut requests_of = Vec::with_capacity(self.inner.shards.len());
        for (s, link) in self.inner.shards.iter().enumerate() {
            let bytes: Vec<u64> = link
                .chunks
                .iter()
                .map(|(id, _)| (layout.chunk_len(*id).unwrap_or(0) * layout.wire_dtype(id.tensor).bytes()) as u64)
                .collect();
            let lanes = lanes.unwrap_or(link.conns.len());
            for (lane, range) in stripe_groups(&bytes, lanes).into_iter().enumerate() {
                let chunks = &link.chunks[range];
                let mut slices = Vec::with_capacity(chunks.len());
                for (id, _) in chunks {
                    let slot = slots.get_mut(id.tensor as usize).and_then(|t| t.get_mut(id.chunk as usize));
                    match slot.and_then(Option::take) {
                        Some(slice) => slices.push(slice),
                        None => {
                            return Err(ClientError::BadMap(format!(
                                "chunk {id:?} is not in the layout or owned twice"
                            )))
                        }
                    }
                }
                let expected = chunks.iter().map(|(id, _)| (*id, layout.chunk_len(*id).unwrap_or(0) as u32)).collect();
                sinks.push(PullInto::new(expected, slices));
                requests_of.push((s, lane, chunks));
            }
        }
        if slots.iter().flatten().any(Option::is_some) {
            return Err(ClientError::BadMap("the shard map leaves a chunk of the layout unowned".into()));
        }
        Ok((sinks, requests_of))
    }

    /// Every chunk's version (global order) from the sinks of a pull.
    pub(super) fn pulled_versions<'a, 'b: 'a>(
        &self,
        sinks: impl IntoIterator<Item = &'a PullInto<'b>>,
        requests_of: &[PullRequest<'_>],
    ) -> Vec<u64> {
        let mut versions = vec![0u64; self.inner.map.layout.total_chunks() as usize];
        for (sink, (_, _, chunks)) in sinks.into_iter().zip(requests_of) {
            for (v, (_, global)) in sink.versions.iter().zip(chunks.iter()) {
                versions[*global as usize] = *v;
            }
        }
        versions
    }

    /// The payload of a push of `chunks`: every chunk's gradient, then the read parameters of the chunks whose
    /// rule measures drift, as views of the shared tensors handed to the transport without a copy (f32) or
    /// converted to the tensor's 16-bit wire format. A 16-bit gradient is checked for NaN and ±∞ as it is
    /// converted (f32 gradients are checked before).
    pub(super) fn push_payload(
        &self,
        chunks: &[(ChunkId, u64)],
        grads: &Arc<Vec<Vec<f32>>>,
        read: &Arc<Vec<Vec<f32>>>,
    ) -> Result<Vec<net::Bytes>, ClientError> {
        let layout = &self.inner.map.layout;
        let mut out = Vec::with_capacity(chunks.len());
        for (id, _) in chunks {
            let range = layout.chunk_range(*id).map_err(|e| ClientError::Shape(e.to_string()))?;
            let dtype = layout.wire_dtype(id.tensor);
            if dtype == WireDtype::F32 {
                out.push(net::f32_bytes(TensorSlice { tensors: grads.clone(), tensor: id.tensor as usize, range }));
                continue;
            }
            let values = &grads[id.tensor as usize][range];
            let (bytes, finite) = net::encode_slice_finite(dtype, values);
            if !finite {
                let name = layout.tensors.get(id.tensor as usize).map_or("?", |t| t.name.as_str());
                check_finite(&format!("the gradient of {name}"), &grads[id.tensor as usize])?;
            }
            out.push(bytes);
        }
        for (id, _) in chunks.iter().filter(|(id, _)| self.inner.echoes(id)) {
            let range = layout.chunk_range(*id).map_err(|e| ClientError::Shape(e.to_string()))?;
            let slice = TensorSlice { tensors: read.clone(), tensor: id.tensor as usize, range };
            out.push(net::dtype_bytes(layout.wire_dtype(id.tensor), slice));
        }
        Ok(out)
    }

    /// The shards' default update rule (a tensor's own rule in the layout takes precedence).
    pub fn rule(&self) -> Rule {
        self.inner.rule
    }

    /// The rule tensor `tensor` is updated with.
    pub fn tensor_rule(&self, tensor: u32) -> Option<Rule> {
        self.inner.tensor_rules.get(tensor as usize).map(|(r, _)| *r)
    }

    /// Pushes a gradient (one vector per tensor) computed on `snapshot` to all shards concurrently. Each
    /// shard push gets the next sequence number of that shard and is retried with the same number after a
    /// transport failure. Where the rule needs it, the push also carries the snapshot's values (the
    /// parameters the gradient was computed on); under DANA-Slim the worker's momentum turns the gradient
    /// into its Nesterov step here.
    pub async fn push(&self, grads: Vec<Vec<f32>>, snapshot: &Snapshot) -> Result<PushSummary, ClientError> {
        Ok(self.push_then(Arc::new(grads), snapshot, false).await?.0)
    }

    /// [`Self::push`] of a gradient the caller keeps: the transport sends straight from the shared buffers
    /// (no copy), so the same buffers can be pushed again or refilled once the push returned. (A rule
    /// with worker momentum writes its step into a copy.)
    pub async fn push_shared(
        &self,
        grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
    ) -> Result<PushSummary, ClientError> {
        Ok(self.push_then(grads, snapshot, false).await?.0)
    }

    /// [`Self::push`], then what a [`Self::pull`] right after it returns, in one request per shard
    /// ([`Message::PushPull`]: each shard answers the push with the pushed chunks' values read right after
    /// applying it, so the pull costs no request of its own). A shard whose ack asks the worker to wait (a
    /// synchronous step, bounded staleness) or that refused the gradient as computed before its restore
    /// answers without values, and a push striped over several lanes is answered with an ack only; the
    /// pull is then made on its own, after the waits, as `push` then `pull` would. (A shard that owns no
    /// chunk of the model answers with its ack alone, and owes no values.)
    pub async fn push_pull(
        &self,
        grads: Vec<Vec<f32>>,
        snapshot: &Snapshot,
    ) -> Result<(PushSummary, Snapshot), ClientError> {
        self.push_pull_shared(Arc::new(grads), snapshot).await
    }

    /// [`Self::push_pull`] of a gradient the caller keeps (see [`Self::push_shared`]).
    pub async fn push_pull_shared(
        &self,
        grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
    ) -> Result<(PushSummary, Snapshot), ClientError> {
        let (summary, next) = self.push_then(grads, snapshot, true).await?;
        let next = match next {
            Some(next) => next,
            None => self.pull().await?,
        };
        Ok((summary, next))
    }

    /// Checks a dense push before anything is sent: this client is a worker, the gradients and the snapshot
    /// match the layout, the gradients are finite (those sent in 32 bits; 16-bit ones are checked as they are
    /// converted); and applies the worker side of rules with per-worker momentum. The worker's id.
    fn check_push(&self, grads: &mut Arc<Vec<Vec<f32>>>, snapshot: &Snapshot) -> Result<u32, ClientError> {
        let worker = self.worker_for("push")?;
        let layout = &self.inner.map.layout;
        let matches = |t: &[Vec<f32>]| {
            t.len() == layout.tensors.len() && t.iter().zip(&layout.tensors).all(|(g, s)| g.len() as u64 == s.len)
        };
        if !matches(grads) || !matches(&snapshot.tensors) {
            return Err(ClientError::Shape("gradient or snapshot tensors do not match the model layout".into()));
        }
        // Tensors that travel in a 16-bit format are checked as they are converted (when the payloads are
        // made, before anything is sent); the others here.
        for (t, (g, spec)) in grads.iter().zip(&layout.tensors).enumerate() {
            if layout.wire_dtype(t as u32) == WireDtype::F32 {
                check_finite(&format!("the gradient of {}", spec.name), g)?;
            }
        }
        if snapshot.versions.len() as u64 != layout.total_chunks() {
            return Err(ClientError::Shape("read versions do not match the model layout".into()));
        }
        let rules = &self.inner.tensor_rules;
        if rules.iter().any(|(r, _)| r.layout().worker_momentum) {
            let mut momentum =
                self.inner.slim_momentum.lock().map_err(|_| ClientError::Shape("momentum lock poisoned".into()))?;
            if momentum.is_empty() {
                *momentum = grads.iter().map(|g| vec![0.0; g.len()]).collect();
            }
            let tensors =
                Arc::make_mut(grads).iter_mut().zip(momentum.iter_mut()).zip(snapshot.tensors.iter()).zip(rules);
            for (((g, v), pulled), (rule, hyper)) in tensors {
                if rule.layout().worker_momentum {
                    gaps_kernels::slim_worker_step(hyper, pulled, v, g);
                }
            }
        }
        Ok(worker)
    }

    /// A push, and with `pull` the new values where every shard could send them with its ack.
    pub(super) async fn push_then(
        &self,
        mut grads: Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
        pull: bool,
    ) -> Result<(PushSummary, Option<Snapshot>), ClientError> {
        let pushes = self.dense_pushes(&mut grads, snapshot)?;
        self.send_pushes(pushes, grads, pull).await
    }

    /// Every shard's dense push of `grads` computed on `snapshot` (checked, with the worker side of the rule
    /// applied), each with its sequence number and its payload cut into stripes, made before any is sent: a
    /// bad value found while a gradient is converted stops the push on every shard.
    pub(super) fn dense_pushes(
        &self,
        grads: &mut Arc<Vec<Vec<f32>>>,
        snapshot: &Snapshot,
    ) -> Result<Vec<(usize, Push, Vec<Stripe>)>, ClientError> {
        let worker = self.check_push(grads, snapshot)?;
        let layout = &self.inner.map.layout;
        let read_versions = &snapshot.versions;
        // Every shard's payload, cut into its stripes, made before any is sent: a bad value found while a
        // gradient is converted stops the push on every shard.
        let mut payloads = Vec::with_capacity(self.inner.shards.len());
        for link in &self.inner.shards {
            let bytes: Vec<u64> = link
                .chunks
                .iter()
                .map(|(id, _)| {
                    let width = layout.wire_dtype(id.tensor).bytes() as u64;
                    layout.chunk_len(*id).unwrap_or(0) as u64 * width * (1 + u64::from(self.inner.echoes(id)))
                })
                .collect();
            let mut stripes = Vec::new();
            for range in stripe_groups(&bytes, link.conns.len()) {
                let payload = self.push_payload(&link.chunks[range.clone()], grads, &snapshot.tensors)?;
                stripes.push((range, payload));
            }
            payloads.push(stripes);
        }
        let compute_ms = self
            .inner
            .last_pull
            .lock()
            .ok()
            .and_then(|last| last.map(|t| t.elapsed().as_millis().clamp(1, u128::from(u32::MAX)) as u32))
            .unwrap_or(0);
        let step = self.inner.steps.fetch_add(1, Ordering::SeqCst);
        let decisions = self.inner.decisions().unwrap_or_default();
        let data = self.inner.data_tag.lock().ok().and_then(|t| *t);
        let mut pushes = Vec::with_capacity(payloads.len());
        // Every shard gets a push every step, with no chunks where it owns none: the push ends the worker's
        // step there (synchronous steps, the rows summed for it, the coordinator's view of every worker).
        for (s, stripes) in payloads.into_iter().enumerate() {
            let link = &self.inner.shards[s];
            let seq = link.next_seq.fetch_add(1, Ordering::SeqCst);
            let chunks: Vec<PushChunk> = link
                .chunks
                .iter()
                .map(|(id, g)| PushChunk {
                    id: *id,
                    read_version: read_versions[*g as usize],
                    len: layout.chunk_len(*id).unwrap_or(0) as u32,
                    echo: self.inner.echoes(id),
                    dtype: layout.wire_dtype(id.tensor),
                })
                .collect();
            // A slow link costs the step its round trips just as slow compute does: two (the pull and this
            // push), from quinn's smoothed RTT estimate of the connection to this shard.
            let rtt = link.conns[0].lock().ok().and_then(|c| c.as_ref().map(quinn::Connection::rtt));
            let network_ms = rtt.map_or(0, |r| (2 * r.as_micros() / 1000).min(u128::from(u32::MAX / 2)) as u32);
            let compute_ms = if compute_ms > 0 { compute_ms.saturating_add(network_ms) } else { 0 };
            let push = Push { epoch: self.inner.map.epoch, worker, seq, chunks, compute_ms, step, decisions, data };
            self.inner.pushes_sent.fetch_add(1, Ordering::Relaxed);
            pushes.push((s, push, stripes));
        }
        Ok(pushes)
    }

    /// Sends the shards' `pushes` of `grads` (see [`Self::dense_pushes`]) and takes their acks, with `pull`
    /// the new values where every shard could send them with its ack; waits where an ack asks to.
    pub(super) async fn send_pushes(
        &self,
        pushes: Vec<(usize, Push, Vec<Stripe>)>,
        grads: Arc<Vec<Vec<f32>>>,
        pull: bool,
    ) -> Result<(PushSummary, Option<Snapshot>), ClientError> {
        let client = self.clone();
        on_runtime("push", async move { client.send_pushes_here(pushes, grads, pull).await }).await
    }

    /// [`Self::send_pushes`] on the calling task.
    async fn send_pushes_here(
        &self,
        pushes: Vec<(usize, Push, Vec<Stripe>)>,
        grads: Arc<Vec<Vec<f32>>>,
        pull: bool,
    ) -> Result<(PushSummary, Option<Snapshot>), ClientError> {
        let after_rows = self.inner.synchronous();
        let mut summary = PushSummary::default();
        let mut waits = Vec::new();
        let mut next = None;
        if pull && pushes.iter().all(|(_, _, stripes)| stripes.len() < 2) {
            let mut tensors = self.snapshot_buffers();
            // One request per shard, in shard order, as the pushes are.
            let (mut sinks, requests_of) = self.pull_sinks(&mut tensors, Some(1))?;
            let requests = sinks.iter_mut().zip(pushes).map(|(sink, (s, push, stripes))| {
                let payload = stripes.into_iter().flat_map(|(_, p)| p).collect::<Vec<_>>();
                async move {
                    if after_rows {
                        self.inner.shards[s].sparse_settled().await;
                    }
                    (s, self.request_with(s, &Message::PushPull(push), &payload, sink).await)
                }
            });
            for (s, outcome) in join_all(requests.collect()).await {
                self.take_ack(s, outcome, &mut summary, &mut waits)?;
            }
            if waits.is_empty() && sinks.iter().all(|sink| sink.filled) {
                let versions = self.pulled_versions(&sinks, &requests_of);
                drop(sinks);
                next = Some(self.pulled_snapshot(tensors, versions));
            } else {
                drop(sinks);
                tensors.into_iter().for_each(gaps_common::buffers::give);
            }
        } else {
            self.push_spawned(pushes, after_rows, &mut summary, &mut waits).await?;
        }

        recycle_grads(grads);
        self.wait_all(waits).await?;
        Ok((summary, next))
    }

    /// Waits for every `(shard, step, clock)` an ack asked for, counting the time waited.
    pub(super) async fn wait_all(&self, waits: Vec<(usize, u64, u64)>) -> Result<(), ClientError> {
        let waiting = Instant::now();
        for (s, version, clock) in waits {
            self.wait_for(s, version, clock).await?;
        }
        let waited = waiting.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
        self.inner.waited_us.fetch_add(waited, Ordering::Relaxed);
        Ok(())
    }

    /// Sends every shard's push from its own task (a push striped over lanes from one task per part) and
    /// takes the acks.
    pub(super) async fn push_spawned(
        &self,
        pushes: Vec<(usize, Push, Vec<Stripe>)>,
        after_rows: bool,
        summary: &mut PushSummary,
        waits: &mut Vec<(usize, u64, u64)>,
    ) -> Result<(), ClientError> {
        let mut tasks = tokio::task::JoinSet::new();
        for (s, push, stripes) in pushes {
            let client = self.clone();
            tasks.spawn(async move {
                let link = &client.inner.shards[s];
                if after_rows {
                    link.sparse_settled().await;
                }
                if stripes.len() < 2 {
                    let payload = stripes.into_iter().flat_map(|(_, p)| p).collect::<Vec<_>>();
                    return (s, client.request(s, &Message::Push(push), &payload).await);
                }
                // A large push is cut by chunk into parts, each on its own connection; the shard applies it
                // once all parts are there and answers every part with the same reply.
                let mut sent = tokio::task::JoinSet::new();
                let count = stripes.len() as u16;
                for (lane, (range, payload)) in stripes.into_iter().enumerate() {
                    let part = PushPart {
                        part: lane as u16,
                        parts: count,
                        push: Push { chunks: push.chunks[range].to_vec(), ..push.clone() },
                    };
                    let client = client.clone();
                    sent.spawn(async move {
                        client.request_on(s, lane, &Message::PushPart(part), &payload, &mut net::InFrame).await
                    });
                }
                let mut outcome: Option<Result<(Frame, u32), RpcError>> = None;
                while let Some(joined) = sent.join_next().await {
                    let part = joined.unwrap_or_else(|e| Err(RpcError::Setup(format!("push part task failed: {e}"))));
                    outcome = Some(match (outcome, part) {
                        (None, p) => p,
                        (Some(Err(e)), _) | (Some(Ok(_)), Err(e)) => Err(e),
                        (Some(Ok((frame, r1))), Ok((_, r2))) => Ok((frame, r1 + r2)),
                    });
                }
                (s, outcome.unwrap_or_else(|| Err(RpcError::Setup("a push of no parts".into()))))
            });
        }
        while let Some(joined) = tasks.join_next().await {
            let (s, outcome) = joined.map_err(|e| ClientError::Shape(format!("push task failed: {e}")))?;
            self.take_ack(s, outcome, summary, waits)?;
        }
        Ok(())
    }

    /// Counts one shard's answer to a push into `summary`, and what it asks the worker to wait for into
    /// `waits`; the error where it refused the push (a gradient computed before a shard's restore is
    /// counted and dropped, not an error).
    pub(super) fn take_ack(
        &self,
        s: usize,
        outcome: Result<(Frame, u32), RpcError>,
        summary: &mut PushSummary,
        waits: &mut Vec<(usize, u64, u64)>,
    ) -> Result<(), ClientError> {
        let (frame, retries) = match outcome {
            Err(RpcError::Remote { code: ErrorCode::ReadAhead, message, .. }) => {
                warn!(shard = s, %message, "a restored shard refused a gradient computed before its restore");
                summary.stale_after_restore += 1;
                self.inner.stale_after_restore.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            other => other?,
        };
        summary.retries += retries;
        let ack = match frame.msg {
            Message::Ack(ack)
            | Message::PushPullReply(PushPullReply { ack, .. })
            | Message::StepReply(StepReply { push: PushPullReply { ack, .. }, .. }) => ack,
            other => {
                return Err(RpcError::Unexpected { addr: "shard".into(), kind: net::kind_name(&other).into() }.into())
            }
        };
        self.count_ack(s, &ack, summary);
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            waits.push((s, ack.wait_for_step, ack.wait_for_clock));
        }
        Ok(())
    }

    /// Counts shard `s`'s acknowledgement of a push (dense or rows) into `summary`, and learns its mode
    /// decisions.
    pub(super) fn count_ack(&self, s: usize, ack: &gaps_common::wire::Ack, summary: &mut PushSummary) {
        self.inner.count_acknowledged(s);
        self.inner.learn(&ack.decisions);
        if ack.duplicate {
            summary.duplicates += 1;
        } else {
            summary.applied += 1;
        }
        // A duplicate's staleness is 0.
        summary.max_staleness = summary.max_staleness.max(ack.max_staleness);
    }

    /// Waits until shard `s` has completed the synchronous step (its global step reaches `step`) and the
    /// slowest worker's clock reached `clock` (bounded staleness). Gives up after three leases: a step can
    /// only be held that long by a dead worker, whose lease the shard drops.
    pub(super) async fn wait_for(&self, s: usize, step: u64, clock: u64) -> Result<(), ClientError> {
        let limit = Duration::from_millis(3 * u64::from(self.inner.map.lease_ms)).max(Duration::from_secs(5));
        let started = Instant::now();
        // The shard holds the request until the step comes (or a quarter second passes): no polling.
        let wait = Message::WaitStep(gaps_common::wire::WaitStep { step, clock, max_wait_ms: 250 });
        loop {
            let asked = Instant::now();
            let (frame, _) = self.request(s, &wait, &[]).await?;
            if let Message::Stats(st) = &frame.msg {
                self.inner.learn(&st.decisions);
                if st.global_step >= step && st.ssp_min_clock >= clock {
                    return Ok(());
                }
                // The wait was for the step after the one the shard was at; a shard now further back than
                // that rolled back to a cluster checkpoint, and the step waited for will not come as it was:
                // go on (the next pull reads the restored parameters).
                if st.global_step.saturating_add(1) < step {
                    warn!(
                        shard = s,
                        waited_for = step,
                        now_at = st.global_step,
                        "the shard went back a step: rolled back"
                    );
                    self.inner.rollbacks_seen.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
            }
            if started.elapsed() > limit {
                return Err(ClientError::Shape(format!(
                    "shard {s} did not finish the step (step {step}, clock {clock}) within {limit:?}"
                )));
            }
            // Answered at once without the step (a shard holding too many waits): do not spin.
            if asked.elapsed() < Duration::from_millis(1) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Uploads a model's own initial values, one vector per dense tensor (layout order): every chunk that
    /// no update and no earlier upload touched takes them, the others keep theirs (the first writer wins).
    /// Returns (chunks taken, chunks kept); pull afterwards to train on what won.
    pub async fn initialize(&self, values: &[Vec<f32>]) -> Result<(u32, u32), ClientError> {
        let worker = self.worker_for("initialize")?;
        let layout = &self.inner.map.layout;
        if values.len() != layout.tensors.len() {
            return Err(ClientError::Shape(format!(
                "expected {} tensors of initial values, got {}",
                layout.tensors.len(),
                values.len()
            )));
        }
        for (v, spec) in values.iter().zip(&layout.tensors) {
            if v.len() != spec.len as usize {
                return Err(ClientError::Shape(format!(
                    "initial values of {}: expected {} elements, got {}",
                    spec.name,
                    spec.len,
                    v.len()
                )));
            }
            check_finite(&format!("the initial values of {}", spec.name), v)?;
        }
        let (mut taken, mut kept) = (0, 0);
        for (s, link) in self.inner.shards.iter().enumerate() {
            let mut chunks = Vec::with_capacity(link.chunks.len());
            let mut payload = Vec::new();
            for (id, _) in &link.chunks {
                let range = layout.chunk_range(*id).map_err(|e| ClientError::BadMap(e.to_string()))?;
                chunks.push(gaps_common::wire::InitChunk { id: *id, len: range.len() as u32 });
                payload.extend_from_slice(&values[id.tensor as usize][range]);
            }
            if chunks.is_empty() {
                continue;
            }
            let msg =
                Message::Initialize(gaps_common::wire::Initialize { epoch: self.inner.map.epoch, worker, chunks });
            let (t, k) = self.load(s, &msg, payload).await?;
            (taken, kept) = (taken + t, kept + k);
        }
        Ok((taken, kept))
    }
}

/// Very large gradient buffers are recycled (for the next pull's tensors) once the transport let go.
pub(super) fn recycle_grads(grads: Arc<Vec<Vec<f32>>>) {
    if let Ok(grads) = Arc::try_unwrap(grads) {
        grads.into_iter().for_each(gaps_common::buffers::give);
    }
}
