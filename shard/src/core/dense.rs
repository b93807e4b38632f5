//! Dense pull and push: validation of a whole push before any change, staleness per chunk, per-tensor
//! rules, and the update fan-out over the rayon pool.

use super::resident::STEP_WORKER;
use super::*;

/// One validated chunk update of a push.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    pub(super) slot: usize,
    pub(super) tensor: u32,
    /// Offset of the chunk's gradient in the gradient section.
    pub(super) offset: usize,
    /// Offset of the chunk's read echo in the read section (only for chunks whose rule needs it).
    pub(super) read_offset: Option<usize>,
    pub(super) staleness: u64,
}

/// The mutable pieces of one chunk update, borrowed disjointly from the slots, with the scalars of its
/// tensor's rule.
pub(super) struct Work<'a> {
    pub(super) params: &'a mut [f32],
    pub(super) shared: &'a mut [f32],
    pub(super) worker: &'a mut [f32],
    pub(super) grad: &'a [f32],
    pub(super) read: &'a [f32],
    pub(super) rule: Rule,
    pub(super) hyper: Hyper,
    pub(super) scalars: PushScalars,
}

/// How pull replies are made (set by the service): one part of [`ShardCore`]'s state.
#[derive(Debug, Default)]
pub(super) struct ReplyOptions {
    /// Pull replies with 16-bit sections carry their values packed for the wire
    /// ([`ShardCore::set_packed_replies`]).
    pub(super) packed_replies: bool,
    /// f32 pull replies share the parameters instead of copying them ([`ShardCore::set_shared_replies`]).
    pub(super) shared_replies: bool,
    /// The parameters the last reply shares, in payload order ([`ShardCore::take_reply_views`]).
    pub(super) reply_views: Vec<Arc<Vec<f32>>>,
}

impl Work<'_> {
    fn apply(self, threads: usize) -> Result<(), gaps_kernels::KernelError> {
        let bufs = Bufs::from_planes(self.params, self.shared, self.worker, self.grad, self.read);
        gaps_kernels::apply_par(self.rule, &self.hyper, &self.scalars, bufs, threads)
    }
}

/// Applies every chunk update, spread over `threads` tasks of the rayon pool when the push is large.
pub(super) fn apply_work(work: Vec<Work<'_>>, threads: usize) -> Result<(), gaps_kernels::KernelError> {
    let total: usize = work.iter().map(|w| w.params.len()).sum();
    if threads <= 1 || total < gaps_kernels::PAR_MIN_PARAMS || work.len() < threads {
        // Few chunks: each large chunk is split over the threads instead.
        return work.into_iter().try_for_each(|w| w.apply(threads));
    }
    // Many chunks: deal them out to the threads, largest first, each thread taking the lightest load.
    let mut groups: Vec<(usize, Vec<Work<'_>>)> = (0..threads).map(|_| (0, Vec::new())).collect();
    let mut work = work;
    work.sort_by_key(|w| std::cmp::Reverse(w.params.len()));
    for w in work {
        if let Some(g) = groups.iter_mut().min_by_key(|g| g.0) {
            g.0 += w.params.len();
            g.1.push(w);
        }
    }
    let mut results: Vec<Result<(), gaps_kernels::KernelError>> = Vec::new();
    results.resize_with(groups.len(), || Ok(()));
    rayon::scope(|scope| {
        for ((_, group), result) in groups.into_iter().zip(results.iter_mut()) {
            scope.spawn(move |_| *result = group.into_iter().try_for_each(|w| w.apply(1)));
        }
    });
    results.into_iter().collect()
}

impl ShardCore {
    pub(super) fn pull(&mut self, req: &Pull) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        let mut metas = Vec::with_capacity(req.chunks.len());
        let mut picked = Vec::with_capacity(req.chunks.len());
        let mut total = 0usize;
        for id in &req.chunks {
            let index = self.slot_index(*id)?;
            let slot = &self.slots[index];
            total += slot.len;
            metas.push(ChunkVersion {
                id: *id,
                version: slot.version,
                len: slot.len as u32,
                dtype: self.cfg.layout.wire_dtype(id.tensor),
            });
            picked.push(index);
        }
        // A pull may name a chunk several times; keep the reply within four copies of what the shard owns.
        let owned_elems = self.owned_elems;
        if total > owned_elems.max(1) * 4 {
            return Err(ShardError::WrongShape(format!(
                "pull asks for {total} elements, more than four copies of this shard's {owned_elems}"
            )));
        }
        if self.gba_reads_ahead() && picked.iter().any(|i| self.step.accum_counts[*i] > 0) {
            return self.pull_step_ahead(metas, &picked);
        }
        if self.replies.shared_replies
            && metas.iter().all(|m| m.dtype == gaps_common::dtype::WireDtype::F32)
            && picked.iter().all(|i| self.reads_params_in_place(*i))
        {
            // The reply shares the parameters (`set_shared_replies`): no copy on the core's thread.
            self.replies.reply_views = picked.iter().map(|i| self.slots[*i].params.clone()).collect();
            self.stats.pulls += 1;
            return Ok(Frame::new(Message::PullReply(PullReply { chunks: metas })));
        }
        let mut payload = gaps_common::buffers::take(total);
        if self.replies.packed_replies && metas.iter().any(|m| m.dtype != gaps_common::dtype::WireDtype::F32) {
            // Straight from the planes into their wire format: no f32 copy of the reply first.
            let mut packer = gaps_common::dtype::Packer::new(payload);
            // The chunks not read in place (a look-ahead, or state on a device), read in one go.
            let copied: Vec<usize> = picked.iter().copied().filter(|i| !self.reads_params_in_place(*i)).collect();
            let mut scratch = Vec::new();
            self.pull_many_into(&copied, &mut scratch)?;
            let mut at = 0;
            for (index, meta) in picked.into_iter().zip(&metas) {
                if self.reads_params_in_place(index) {
                    packer.push(meta.dtype, &self.slots[index].params[..]);
                } else {
                    let n = self.slots[index].len;
                    let values = scratch.get(at..at + n).ok_or_else(|| {
                        ShardError::Device(format!("a pull read {} values, fewer than its chunks hold", scratch.len()))
                    })?;
                    packer.push(meta.dtype, values);
                    at += n;
                }
            }
            payload = packer.finish();
        } else if let Err(e) = self.pull_many_into(&picked, &mut payload) {
            gaps_common::buffers::give(payload);
            return Err(e);
        }
        self.stats.pulls += 1;
        Ok(Frame { msg: Message::PullReply(PullReply { chunks: metas }), payload })
    }

    /// A push answered with what a pull of its chunks reads right after it (see [`PushPullReply`]): the same
    /// push, applied (or found a duplicate) as [`Self::push`] does, then the same read as [`Self::pull`], so
    /// the worker needs no second request. Where the ack asks the worker to wait, the reply holds no values
    /// (the worker pulls once it may); a refused push is refused as a plain push is.
    pub(super) fn push_pull(
        &mut self,
        req: &Push,
        payload: &[f32],
        checked_finite: bool,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        let step = self.step.global_step;
        let pushed = self.push(req, payload, checked_finite, now, events)?;
        let Message::Ack(ack) = pushed.msg else {
            return Err(ShardError::Misconfigured("a push was answered with something other than an ack".into()));
        };
        let alone = Frame::new(Message::PushPullReply(PushPullReply { ack, chunks: Vec::new() }));
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            return Ok(alone);
        }
        // gba: a gradient that went into a step still short of others expected soon waits for the step (the
        // caller holds the request; see `hold`), and reads the values then. Only under `--mode gba`, not
        // `auto`, whose GBA runs only while a worker straggles, for speed (its accuracy comes from running sync
        // otherwise); the mode in force is checked too (a checkpoint restored may carry another).
        if self.mode.active == Mode::Gba
            && self.cfg.modes.mode == Mode::Gba
            && !ack.duplicate
            && self.step.global_step == step
            && self.step.accum_pushes > 0
            && self
                .step
                .gba_hold
                .decide(
                    req.worker,
                    self.gba_k().saturating_sub(self.step.accum_pushes as usize),
                    self.members.leases.keys().copied(),
                    self.cfg.modes.gba_hold,
                    now,
                )
                .is_some()
        {
            return Ok(alone);
        }
        let read = Pull { epoch: req.epoch, chunks: req.chunks.iter().map(|c| c.id).collect() };
        // The push is applied whatever the read gives: a read that fails leaves the values out, and the
        // worker's own pull then meets the error.
        match self.pull(&read) {
            Ok(Frame { msg: Message::PullReply(PullReply { chunks }), payload }) => {
                Ok(Frame { msg: Message::PushPullReply(PushPullReply { ack, chunks }), payload })
            }
            Ok(_) | Err(_) => Ok(alone),
        }
    }

    /// A push's payload is every chunk's gradient in the order of `chunks`, then the parameters read for the
    /// chunks marked `echo` (exactly those whose tensor's rule measures drift), in the same order.
    pub(super) fn push(
        &mut self,
        req: &Push,
        payload: &[f32],
        checked_finite: bool,
        now: Duration,
        events: &mut Vec<CoreEvent>,
    ) -> Result<Frame, ShardError> {
        if let Some(mut duplicate) = self.check_push(req.epoch, req.worker, req.seq)? {
            if let Message::Ack(ack) = &mut duplicate.msg {
                self.duplicate_waits(req.worker, ack);
            }
            return Ok(duplicate);
        }
        let (plan, grad_total) = self.plan_push(req, payload, checked_finite)?;
        let (grads, reads) = payload.split_at(grad_total);
        self.observe_push(req.worker, req.compute_ms, now, events);
        self.step.gba_hold.observe(req.worker, now);
        self.count_samples(req.data);
        self.follow_decisions(req.step, &req.decisions, events);
        self.lr.ramp.fix_reference();
        let tau = plan.iter().map(|p| p.staleness).max().unwrap_or(0);
        let mut ack = Ack { seq: req.seq, max_staleness: tau, ..Ack::default() };
        match self.mode.active {
            Mode::Sync | Mode::Gba => self.sum_into_step(req, &plan, grads, tau, now, &mut ack)?,
            _ => {
                self.apply_now(&plan, req.worker, grads, reads)?;
                if self.mode.active == Mode::Ssp {
                    let clock = self.members.clocks.entry(req.worker).or_insert(0);
                    *clock += 1;
                    let mine = *clock;
                    if mine > self.min_clock() + self.cfg.modes.ssp_bound {
                        ack.wait_for_clock = mine - self.cfg.modes.ssp_bound;
                    }
                }
            }
        }
        self.record_applied(req.worker, req.seq);
        ack.decisions = self.mode.decisions;
        Ok(Frame::new(Message::Ack(ack)))
    }

    /// Checks a push against the shard's chunks before anything changes (a refused push changes nothing):
    /// every chunk once, of its length, read at a version the shard has reached, echoing the read parameters
    /// exactly when its rule needs them, room for the worker's planes, a payload of the declared length and,
    /// unless `checked_finite`, finite. Returns the plan (each chunk's slot and place in the payload) and how
    /// many of the payload's values are gradients.
    pub(super) fn plan_push(
        &self,
        req: &Push,
        payload: &[f32],
        checked_finite: bool,
    ) -> Result<(Vec<Planned>, usize), ShardError> {
        // Validate everything before touching any state, so a refused push changes nothing.
        let mut plan = Vec::with_capacity(req.chunks.len());
        let mut seen = BTreeSet::new();
        let (mut grad_total, mut read_total) = (0usize, 0usize);
        for c in &req.chunks {
            let slot = self.slot_index(c.id)?;
            if !seen.insert(slot) {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} appears twice in one push",
                    c.id.tensor, c.id.chunk
                )));
            }
            let expected = self.slots[slot].len;
            if c.len as usize != expected {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} has {expected} elements, the push carries {}",
                    c.id.tensor, c.id.chunk, c.len
                )));
            }
            let version = self.slots[slot].version;
            if c.read_version > version {
                return Err(ShardError::ReadAhead {
                    tensor: c.id.tensor,
                    chunk: c.id.chunk,
                    read: c.read_version,
                    current: version,
                });
            }
            let (rule, _) = self.tensor_rules[c.id.tensor as usize];
            if c.echo != rule.layout().needs_read {
                return Err(ShardError::WrongShape(if c.echo {
                    format!("chunk {}/{}: rule {rule} takes no echo of the read parameters", c.id.tensor, c.id.chunk)
                } else {
                    format!(
                        "chunk {}/{}: rule {rule} needs the parameters the gradient was computed on (echo)",
                        c.id.tensor, c.id.chunk
                    )
                }));
            }
            let read_offset = c.echo.then_some(read_total);
            plan.push(Planned {
                slot,
                tensor: c.id.tensor,
                offset: grad_total,
                read_offset,
                staleness: version - c.read_version,
            });
            grad_total += expected;
            read_total += read_offset.map_or(0, |_| expected);
        }
        // Applied now, a push needs the worker's stripe for per-worker planes; summed into a synchronous
        // step it does not (the step is applied with the step's own stripe).
        if self.resident.is_some()
            && !matches!(self.mode.active, Mode::Sync | Mode::Gba)
            && !self.stripes.can_take(req.worker)
            && plan.iter().any(|p| self.tensor_rules[p.tensor as usize].0.layout().worker_planes > 0)
        {
            return Err(resident::exhausted(self.stripes.held()));
        }
        if payload.len() != grad_total + read_total {
            return Err(ShardError::WrongShape(format!(
                "push declares {} elements but carries {}",
                grad_total + read_total,
                payload.len()
            )));
        }
        let (grads, reads) = payload.split_at(grad_total);
        let unchecked = if checked_finite { &[][..] } else { &plan[..] };
        for (c, p) in req.chunks.iter().zip(unchecked) {
            let n = c.len as usize;
            let sections =
                std::iter::once(&grads[p.offset..p.offset + n]).chain(p.read_offset.map(|r| &reads[r..r + n]));
            for values in sections {
                if let Some(index) = gaps_common::dtype::first_non_finite(values) {
                    return Err(ShardError::NonFinite {
                        tensor: c.id.tensor,
                        chunk: c.id.chunk,
                        index,
                        value: values[index].to_string(),
                    });
                }
            }
        }
        Ok((plan, grad_total))
    }

    /// What the acknowledgement of a push applied before asks the worker to wait for, as the first one did:
    /// in sync, the step it went into while that step is still open; under bounded staleness, the slowest
    /// worker's clock while this worker is too far ahead. A worker whose first ack was lost (a reply lost on
    /// the way, a connection cut) sends the push again and must not skip the step's barrier because of it:
    /// its next gradient would go into the same step.
    pub(super) fn duplicate_waits(&self, worker: u32, ack: &mut Ack) {
        match self.mode.active {
            // The first ack waited when the step held a gradient (a stale one dropped into an empty step
            // did not wait).
            Mode::Sync if self.step.contributors.contains(&worker) && self.step.accum_pushes > 0 => {
                ack.wait_for_step = self.step.global_step + 1
            }
            Mode::Ssp => {
                let mine = self.members.clocks.get(&worker).copied().unwrap_or(0);
                if mine > self.min_clock() + self.cfg.modes.ssp_bound {
                    ack.wait_for_clock = mine - self.cfg.modes.ssp_bound;
                }
            }
            _ => {}
        }
    }

    /// Sums a push's gradients into the synchronous step (sync or gba), or drops them when too stale for the
    /// mode, and completes the step once it is ready; sets what the ack asks the worker to wait for.
    fn sum_into_step(
        &mut self,
        req: &Push,
        plan: &[Planned],
        grads: &[f32],
        tau: u64,
        now: Duration,
        ack: &mut Ack,
    ) -> Result<(), ShardError> {
        // A gradient computed before the cluster's last switch (in flight when it happened) was
        // computed in the mode before: in sync it is summed into the step as GBA would have taken it
        // (within GBA's threshold), so a switch drops no gradient it need not.
        let before_switch = self.mode.switches.back().is_some_and(|sw| req.step < sw.from_step);
        let threshold = self.cfg.modes.gba_threshold;
        let too_stale = match self.mode.active {
            Mode::Sync => tau > 0 && !(before_switch && tau <= threshold),
            _ => tau > threshold,
        };
        if too_stale {
            self.stats.dropped_stale += 1;
            if before_switch {
                self.stats.pushes_dropped_at_switch += 1;
            }
            if self.mode.active == Mode::Sync {
                // The worker's place in this step is filled by the dropped gradient: it waits for the
                // step like everyone else. Left out, it would pull and compute again while the others
                // wait for it here — and, with two shards that dropped different workers' gradients
                // (their versions move at different moments around a mode switch), each shard would
                // wait for a worker that waits on the other.
                self.step.contributors.insert(req.worker);
                self.clock = self.clock.max(now);
                self.step.step_started.get_or_insert(now);
                if self.step_ready() {
                    self.complete_step()?;
                } else if self.step.accum_pushes > 0 {
                    ack.wait_for_step = self.step.global_step + 1;
                } else if self.members.leases.keys().all(|w| self.step.contributors.contains(w)) {
                    // Every live worker sent only stale gradients: nothing to apply, a fresh step.
                    self.step.contributors.clear();
                    self.step.step_started = None;
                }
            }
        } else {
            self.stats.staleness_sum += tau;
            self.stats.staleness_count += 1;
            self.stats.staleness_max = self.stats.staleness_max.max(tau);
            for p in plan {
                let n = self.slots[p.slot].len;
                let acc = &mut self.step.accum[p.slot];
                if acc.is_empty() {
                    acc.resize(n, 0.0);
                }
                acc.iter_mut().zip(&grads[p.offset..p.offset + n]).for_each(|(a, g)| *a += g);
                self.step.accum_counts[p.slot] += 1;
                self.step.ahead_values.remove(&p.slot);
            }
            self.step.accum_pushes += 1;
            self.step.contributors.insert(req.worker);
            self.clock = self.clock.max(now);
            self.step.step_started.get_or_insert(now);
            if self.step_ready() {
                self.complete_step()?;
            } else if self.mode.active == Mode::Sync {
                ack.wait_for_step = self.step.global_step + 1;
            }
        }
        Ok(())
    }

    /// Applies gradients to the planned chunks now, one update each (`grads` and `reads` indexed by the
    /// plan's offsets), each with its tensor's rule, and records versions and staleness.
    pub(super) fn apply_now(
        &mut self,
        plan: &[Planned],
        worker: u32,
        grads: &[f32],
        reads: &[f32],
    ) -> Result<(), ShardError> {
        self.lr.last_multiplier = self.lr_multiplier();
        let lrs: Vec<f32> = (0..self.tensor_rules.len() as u32).map(|t| self.tensor_lr(t)).collect();
        for (max, lr) in self.lr.max.iter_mut().zip(&lrs) {
            *max = max.max(*lr);
        }
        let worker_count = self.worker_count();
        if self.resident.is_some() {
            self.apply_resident(plan, worker, grads, reads, &lrs, worker_count)?;
            self.count_applied(plan);
            return Ok(());
        }
        let wanted: HashMap<usize, Planned> = plan.iter().map(|p| (p.slot, *p)).collect();
        let mut work = Vec::with_capacity(plan.len());
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(p) = wanted.get(&index) else { continue };
            let t = p.tensor as usize;
            let (rule, hyper) = self.tensor_rules[t];
            let planes = rule.layout().worker_planes;
            let ChunkSlot { params, shared, workers, version, .. } = slot;
            // Copied first only where a reply still sends these values.
            let params = &mut Arc::make_mut(params)[..];
            let n = params.len();
            let worker: &mut [f32] =
                if planes == 0 { &mut [] } else { workers.entry(worker).or_insert_with(|| vec![0.0; planes * n]) };
            let scalars = PushScalars {
                lr: lrs[t],
                lr_max: self.lr.max[t],
                staleness: p.staleness,
                t: *version + 1,
                workers: worker_count,
            };
            let read = p.read_offset.map_or(&[][..], |r| &reads[r..r + n]);
            let grad = &grads[p.offset..p.offset + n];
            work.push(Work { params, shared, worker, grad, read, rule, hyper, scalars });
        }
        apply_work(work, self.threads).map_err(|e| ShardError::Device(e.to_string()))?;
        self.count_applied(plan);
        Ok(())
    }

    /// A pull while the gba step in progress has gradients for some of the chunks: those chunks are read as
    /// the step would leave them were it applied now with the gradients it has ([`Self::step_ahead`]),
    /// the others as they are. Versions stay the applied ones.
    fn pull_step_ahead(&mut self, metas: Vec<ChunkVersion>, picked: &[usize]) -> Result<Frame, ShardError> {
        let mut views = Vec::with_capacity(picked.len());
        for &index in picked {
            views.push(if self.step.accum_counts[index] > 0 {
                self.step_ahead(index)?
            } else if self.reads_params_in_place(index) {
                self.slots[index].params.clone()
            } else {
                let mut values = Vec::with_capacity(self.slots[index].len);
                self.pull_into(index, &mut values)?;
                Arc::new(values)
            });
        }
        self.stats.pulls += 1;
        let all_f32 = metas.iter().all(|m| m.dtype == gaps_common::dtype::WireDtype::F32);
        if self.replies.shared_replies && all_f32 {
            self.replies.reply_views = views;
            return Ok(Frame::new(Message::PullReply(PullReply { chunks: metas })));
        }
        let total = views.iter().map(|v| v.len()).sum();
        let mut payload = gaps_common::buffers::take(total);
        if self.replies.packed_replies && !all_f32 {
            let mut packer = gaps_common::dtype::Packer::new(payload);
            for (view, meta) in views.iter().zip(&metas) {
                packer.push(meta.dtype, view);
            }
            payload = packer.finish();
        } else {
            views.iter().for_each(|v| payload.extend_from_slice(v));
        }
        Ok(Frame { msg: Message::PullReply(PullReply { chunks: metas }), payload })
    }

    /// gba: what a pull of slot `index` reads were the step in progress applied now with the gradients it
    /// has, their sum over the step's K gradients (the step's 1/K share of each), by the tensor's rule on
    /// copies of its state. A worker whose push did not complete the step then computes its next gradient
    /// on values that already hold its own and the others' gradients of the step (GBA's staleness without
    /// it costs 0.01 to 0.02 held-out AUC on short runs). Kept until the slot's next gradient or the step's
    /// end; the applied step is exactly the synchronous one whatever was read.
    fn step_ahead(&mut self, index: usize) -> Result<Arc<Vec<f32>>, ShardError> {
        if let Some(values) = self.step.ahead_values.get(&index) {
            return Ok(values.clone());
        }
        let slot = &self.slots[index];
        let t = slot.tensor as usize;
        let (rule, hyper) = self.tensor_rules[t];
        let layout = rule.layout();
        // For the rules whose step grows with the gradient (SGD, momentum, DANA, …) the preview is the step
        // with the gradients in hand (sum ÷ K, the momentum term whole). For the rules that normalise their
        // step (Adagrad, Adam) that would be a whole step in the direction of the first gradient (early in
        // training, a step of η per parameter whatever the gradient's size; at 4× the default η it tipped
        // one run in three over), so there the step is estimated from the gradients' mean and the preview
        // moves j/K of the way to it.
        let k = self.gba_k() as f32;
        let j = self.step.accum_counts[index].max(1) as f32;
        let (share, divisor) = if rule.normalises_step() { ((j / k).min(1.0), j) } else { (1.0, k) };
        let grad: Vec<f32> = self.step.accum[index].iter().map(|g| g / divisor).collect();
        let lr = self.tensor_lr(t as u32);
        let workers = self.worker_count();
        // What a pull of these values reads (the look-ahead rules' θ − η·c·S).
        let view = |params: &[f32], shared: &[f32]| {
            let mut out = Vec::with_capacity(params.len());
            gaps_kernels::pull_values(rule, &hyper, lr, workers, params, shared, &mut out);
            out
        };
        // Copies of the state, from the host or from the device holding it (one copy back per chunk and
        // gradient of the step: the preview is kept until the chunk's next gradient).
        let (mut params, mut shared) = match self.resident {
            None => ((*slot.params).clone(), slot.shared.clone()),
            Some(_) => {
                let (mut params, mut shared) = (Vec::with_capacity(slot.len), Vec::new());
                self.resident_planes(index, &mut params, &mut shared)?;
                (params, shared)
            }
        };
        // What a pull reads now, to interpolate from (only when the preview moves part of the way).
        let now = (share < 1.0).then(|| view(&params, &shared));
        let n = params.len();
        // The step is applied with the synchronous stripe's planes (`apply_now` with worker u32::MAX).
        let mut worker = match (layout.worker_planes, slot.workers.get(&STEP_WORKER)) {
            (0, _) => Vec::new(),
            (planes, None) => vec![0.0; planes * n],
            (_, Some(plane)) if self.resident.is_none() => plane.clone(),
            (_, Some(_)) => {
                let mut plane = Vec::new();
                self.resident_worker_plane(index, STEP_WORKER, &mut plane)?;
                plane
            }
        };
        let read = if layout.needs_read { params.clone() } else { Vec::new() };
        let scalars = PushScalars { lr, lr_max: self.lr.max[t].max(lr), staleness: 0, t: slot.version + 1, workers };
        let work = Work {
            params: &mut params,
            shared: &mut shared,
            worker: &mut worker,
            grad: &grad,
            read: &read,
            rule,
            hyper,
            scalars,
        };
        work.apply(self.threads).map_err(|e| ShardError::Device(e.to_string()))?;
        let full = if layout.lookahead { view(&params, &shared) } else { params };
        let values = match now {
            Some(now) => now.iter().zip(&full).map(|(a, b)| a + share * (b - a)).collect(),
            None => full,
        };
        let values = Arc::new(values);
        self.step.ahead_values.insert(index, values.clone());
        Ok(values)
    }

    /// Versions and staleness counters after `plan` was applied.
    fn count_applied(&mut self, plan: &[Planned]) {
        let mut max_staleness = 0;
        let mut touched = BTreeSet::new();
        for p in plan {
            self.slots[p.slot].version += 1;
            touched.insert(p.tensor);
            max_staleness = max_staleness.max(p.staleness);
            self.stats.staleness_sum += p.staleness;
            self.stats.staleness_count += 1;
        }
        for t in touched {
            self.tensor_versions[t as usize] += 1;
        }
        self.stats.staleness_max = self.stats.staleness_max.max(max_staleness);
    }
}

impl ShardCore {
    /// A model's own initial values ([`gaps_common::wire::Initialize`]): each listed chunk that no update
    /// touched yet (version 0) takes the values carried and counts as updated once (version 1), so a
    /// gradient computed on the values before is seen as one step stale, and a later `Initialize` — another
    /// worker's, or one after a restore — keeps them: the first writer wins. Checked whole before anything
    /// is written (epoch, worker, ownership, lengths, finite values).
    pub(super) fn initialize(
        &mut self,
        req: &gaps_common::wire::Initialize,
        payload: &[f32],
    ) -> Result<Frame, ShardError> {
        self.check_epoch(req.epoch)?;
        if self.resident.is_some() {
            return Err(ShardError::Misconfigured(
                "initial values cannot be uploaded to GPU-resident state: start the shards with --init-std".into(),
            ));
        }
        let mut plan = Vec::with_capacity(req.chunks.len());
        let mut seen = vec![false; self.slots.len()];
        let mut offset = 0usize;
        for c in &req.chunks {
            let slot = self.slot_index(c.id)?;
            let len = self.slots[slot].len;
            if c.len as usize != len {
                return Err(ShardError::WrongShape(format!(
                    "chunk {}/{} holds {len} elements, the upload {}",
                    c.id.tensor, c.id.chunk, c.len
                )));
            }
            if std::mem::replace(&mut seen[slot], true) {
                return Err(ShardError::WrongShape(format!("chunk {}/{} is listed twice", c.id.tensor, c.id.chunk)));
            }
            plan.push((slot, offset));
            offset += len;
        }
        if payload.len() != offset {
            return Err(ShardError::WrongShape(format!(
                "the upload declares {offset} elements but carries {}",
                payload.len()
            )));
        }
        if let Some(index) = gaps_common::dtype::first_non_finite(payload) {
            let (slot, start) = plan.iter().rev().find(|(_, start)| *start <= index).copied().unwrap_or((0, 0));
            let c = &req.chunks[plan.iter().position(|(s, _)| *s == slot).unwrap_or(0)];
            return Err(ShardError::NonFinite {
                tensor: c.id.tensor,
                chunk: c.id.chunk,
                index: index - start,
                value: payload[index].to_string(),
            });
        }
        let (mut taken, mut kept) = (0u32, 0u32);
        for (slot, start) in plan {
            let s = &mut self.slots[slot];
            if s.version != 0 {
                kept += 1;
                continue;
            }
            Arc::make_mut(&mut s.params).copy_from_slice(&payload[start..start + s.len]);
            s.version = 1;
            self.step.ahead_values.remove(&slot);
            taken += 1;
        }
        Ok(Frame::new(Message::Initialized(gaps_common::wire::Initialized { taken, kept })))
    }
}
