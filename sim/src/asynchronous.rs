//! The asynchronous event loop: each worker pushes when its batch is done, the earliest first; GBA holds and
//! `auto`'s switches ride on it (docs/ALGORITHMS.md §1).

use super::*;

pub(super) fn run_async(args: &SimArgs) -> Result<SimReport> {
    let (task, mut core, hyper) = setup(args)?;
    let initial_loss = task.evaluate(&master_params(&mut core, task.as_ref())?).1;
    let n = args.workers as usize;
    let mut order_rng = Rng::new(mix(args.seed, 0x0d3));
    let mut sim = AsyncSim::start(args, task.as_ref(), core)?;
    let (p, rows) = (sim.p, task.sparse_rows());
    let mut kills = args.kill_workers.clone();
    let mut adds = args.add_workers.clone();
    let scaled = matches!(args.mode, SimMode::Gba | SimMode::Auto) && args.linear_scaling;
    anyhow::ensure!((0.0..=1.0).contains(&args.gba_hold), "--gba-hold must be between 0 and 1");
    let holds = args.mode == SimMode::Gba && args.gba_hold > 0.0;

    let Schedule { batches_per_epoch, total, warmup, decays } = Schedule::new(args, task.as_ref());
    let needs_read = args.rule.layout().needs_read;
    let worker_momentum = args.rule.layout().worker_momentum;
    let mut csv = open_csv(args)?;
    let mut evaluator = Evaluator::new(args, batches_per_epoch);

    let started = Instant::now();
    let mut grad = vec![0.0f32; p];
    let mut order = order_rng.permutation(task.train_size());
    let mut staleness: Vec<u32> = Vec::with_capacity(total as usize);
    let (mut gap_sum, mut diverged, mut events) = (0.0f64, false, 0u64);
    for event in 0..total {
        if event % 256 == 0 && started.elapsed() > args.timeout {
            bail!("the simulation ran past --timeout {:?} at event {event} of {total}", args.timeout);
        }
        let epoch = event / batches_per_epoch as u64;
        let in_epoch = (event % batches_per_epoch as u64) as usize;
        if in_epoch == 0 && event > 0 {
            order = order_rng.permutation(task.train_size());
        }
        sim.core.set_lr_scale(lr_scale_at(event, warmup, n, &decays, scaled) as f32).map_err(|e| anyhow!("{e}"))?;
        sim.depart_and_arrive(&mut kills, &mut adds)?;
        sim.release_held()?;
        let due = sim.next_due(event)?;
        let now = sim.now;
        let w = due.worker as usize;
        let compute_ms = sim.durations.millis(sim.workers[w].duration).round().clamp(1.0, f64::from(u32::MAX)) as u32;
        let next = sim.durations.draw(&mut sim.timing, w, sim.workers[w].slowness);
        sim.workers[w].duration = next;

        let vw = &mut sim.workers[w];
        // An embedding task's worker computes the batch it took (and pulled the rows of) when it started;
        // a dense one takes the next batch of the global order.
        let batch = if rows > 0 {
            &vw.batch[..]
        } else {
            &order[in_epoch * args.batch as usize..(in_epoch + 1) * args.batch as usize]
        };
        let loss = task.loss_grad(&vw.view, batch, event, &mut grad);
        if !loss.is_finite() || grad.iter().any(|g| !g.is_finite()) {
            diverged = true;
            break;
        }
        let master = sim.core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?;
        let gap =
            master.iter().zip(&vw.view[rows..]).map(|(a, b)| f64::from((a - b).abs())).sum::<f64>() / (p - rows) as f64;
        gap_sum += gap;
        if worker_momentum {
            gaps_kernels::slim_worker_step(&hyper, &vw.view, &mut vw.momentum, &mut grad);
        }
        // The rows go first, as a real worker sends them: in sync and gba the dense push ends the step.
        if rows > 0 {
            vw.seq += 1;
            let (ids, versions) = (&vw.rows, &vw.row_versions);
            if !push_rows(&mut sim.core, w as u32, vw.seq, ids, versions, &grad, &vw.view, needs_read, args.push_dtype)?
            {
                diverged = true;
                break;
            }
        }
        let Some((tau, finite)) = sim.push_dense(w, &grad, compute_ms, (needs_read, holds), next)? else {
            diverged = true;
            break;
        };
        staleness.push(tau.min(u64::from(u32::MAX)) as u32);
        if !finite {
            diverged = true;
            break;
        }
        events += 1;
        if let Some(out) = csv.as_mut() {
            writeln!(out, "{event},{epoch},{now},{w},{tau},{loss},{},{gap}", sim.core.lr())?;
        }
        evaluator.after(events, now, task.as_ref(), &mut sim.core)?;
    }
    if let Some(mut out) = csv {
        out.flush()?;
    }
    let live = sim.workers.iter().filter(|w| w.alive).count() as u32;
    let AsyncSim { mut core, durations, now, .. } = sim;
    let outcome = Outcome {
        staleness,
        gap_sum,
        now,
        diverged,
        events,
        started,
        gradients: events,
        evaluator,
        durations,
        initial_loss,
    };
    let mut report = finish(args, task.as_ref(), &mut core, outcome)?;
    report.workers_final = live;
    Ok(report)
}

/// Learning-rate multiplier at `event`: linear warm-up from 1/N to 1, then ×0.1 at each decay point; the
/// aggregating modes use the synchronous learning rate (linear scaling by N) unless told otherwise.
fn lr_scale_at(event: u64, warmup: u64, n: usize, decays: &[u64], scaled: bool) -> f64 {
    let mut lr_scale =
        if event < warmup { (1.0 + (n as f64 - 1.0) * event as f64 / warmup as f64) / n as f64 } else { 1.0 };
    lr_scale *= 0.1f64.powi(decays.iter().filter(|d| event >= **d).count() as i32);
    if scaled {
        lr_scale *= n as f64;
    }
    lr_scale
}

/// The simulated cluster the asynchronous loop steps: the shard core, the workers, who finishes next (a
/// min-heap of due times) and who is held, on the simulated clock `now`.
struct AsyncSim<'a> {
    args: &'a SimArgs,
    task: &'a dyn Task,
    core: ShardCore,
    /// Parameters of the model.
    p: usize,
    timing: Rng,
    durations: Durations,
    batches: Option<Batches>,
    workers: Vec<VirtualWorker>,
    heap: BinaryHeap<Due>,
    blocked: Vec<Blocked>,
    now: f64,
}

impl<'a> AsyncSim<'a> {
    /// Every worker registered, holding the initial parameters (and its first batch's rows), its first batch
    /// due.
    fn start(args: &'a SimArgs, task: &'a dyn Task, mut core: ShardCore) -> Result<AsyncSim<'a>> {
        let n = args.workers as usize;
        let timing = Rng::new(mix(args.seed, 0x71e));
        let durations = Durations::new(args)?;
        let rows = task.sparse_rows();
        let batches = (rows > 0).then(|| Batches::new(args.seed, task.train_size(), args.batch as usize));
        let (view, version) = pull(&mut core, args.pull_dtype)?;
        let mut sim = AsyncSim {
            args,
            task,
            core,
            p: task.num_params(),
            timing,
            durations,
            batches,
            workers: Vec::new(),
            heap: BinaryHeap::with_capacity(n),
            blocked: Vec::new(),
            now: 0.0,
        };
        sim.workers = (0..n).map(|w| sim.new_worker(w, &view, version)).collect();
        for _ in 0..n {
            register(&mut sim.core)?;
        }
        if sim.batches.is_some() {
            for vw in &mut sim.workers {
                vw.refresh(&mut sim.core, task, &mut sim.batches, args.pull_dtype)?;
            }
        }
        for (w, vw) in sim.workers.iter_mut().enumerate() {
            vw.duration = sim.durations.draw(&mut sim.timing, w, vw.slowness);
            sim.heap.push(Due { time: vw.duration, worker: w as u32 });
        }
        Ok(sim)
    }

    /// Worker `w` with the parameters `view` at `version`, slowed by its straggler factors (and drawn
    /// heterogeneity).
    fn new_worker(&mut self, w: usize, view: &[f32], version: u64) -> VirtualWorker {
        let args = self.args;
        let mut slowness = args.stragglers.iter().filter(|(s, _)| *s as usize == w).map(|(_, f)| *f).product::<f64>();
        if args.heterogeneity > 0.0 {
            let v2 = args.heterogeneity * args.heterogeneity;
            slowness *= self.timing.gamma(1.0 / v2, v2);
        }
        VirtualWorker {
            view: view.to_vec(),
            version,
            momentum: vec![0.0; self.p],
            seq: 0,
            slowness,
            duration: 0.0,
            alive: true,
            steps: 0,
            batch: Vec::new(),
            rows: Vec::new(),
            row_versions: Vec::new(),
        }
    }

    /// Injected failures and arrivals happen at their virtual time, before the next batch finishes.
    fn depart_and_arrive(&mut self, kills: &mut Vec<(u32, f64)>, adds: &mut Vec<f64>) -> Result<()> {
        let next_time = self.heap.peek().map_or(f64::INFINITY, |d: &Due| d.time);
        while let Some(k) = kills.iter().position(|(_, t)| *t <= next_time) {
            let (w, t) = kills.remove(k);
            if let Some(vw) = self.workers.get_mut(w as usize) {
                vw.alive = false;
                self.now = self.now.max(t);
                self.blocked.retain(|b| b.worker != w as usize);
                self.core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker: w })), Duration::ZERO);
            }
        }
        while let Some(a) = adds.iter().position(|t| *t <= next_time) {
            let t = adds.remove(a);
            register(&mut self.core)?;
            let (view, version) = pull(&mut self.core, self.args.pull_dtype)?;
            let w = self.workers.len();
            let mut vw = self.new_worker(w, &view, version);
            if self.batches.is_some() {
                vw.refresh(&mut self.core, self.task, &mut self.batches, self.args.pull_dtype)?;
            }
            vw.duration = self.durations.draw(&mut self.timing, w, vw.slowness);
            self.heap.push(Due { time: t + vw.duration, worker: w as u32 });
            self.workers.push(vw);
        }
        Ok(())
    }

    /// Lets the waiting workers whose condition holds go on; held workers whose hold ends before the next
    /// gradient arrives go on at its end, on what a pull reads then (nothing changed since the last event).
    fn release_held(&mut self) -> Result<()> {
        let wire = self.args.pull_dtype;
        release(
            &mut self.core,
            &mut self.workers,
            &mut self.blocked,
            &mut self.heap,
            self.now,
            wire,
            self.task,
            &mut self.batches,
        )?;
        while let Some(i) = next_hold_to_end(&self.blocked, self.heap.peek().map_or(f64::INFINITY, |d: &Due| d.time)) {
            let b = self.blocked.swap_remove(i);
            let until = b.until.unwrap_or(self.now);
            self.workers[b.worker].refresh(&mut self.core, self.task, &mut self.batches, wire)?;
            self.heap.push(Due { time: until + b.duration, worker: b.worker as u32 });
        }
        Ok(())
    }

    /// The next gradient to arrive (entries of killed workers are skipped, so every event is one gradient);
    /// the clock moves to it.
    fn next_due(&mut self, event: u64) -> Result<Due> {
        let due = loop {
            let Some(due) = self.heap.pop() else {
                bail!("every worker is waiting or gone at event {event} (mode {:?})", self.args.mode)
            };
            if self.workers[due.worker as usize].alive {
                break due;
            }
        };
        self.now = due.time;
        Ok(due)
    }

    /// Worker `w`'s dense push (with its read echo where the rule needs one; under `gba` with a hold, a
    /// push-pull, as the real worker sends), then what the acknowledgement says: wait for a step or a clock,
    /// be held, or go on with its `next` batch on fresh parameters. Returns the push's staleness and whether
    /// the parameters the worker pulled after it are finite; None when the shard refused a non-finite push.
    fn push_dense(
        &mut self,
        w: usize,
        grad: &[f32],
        compute_ms: u32,
        (needs_read, holds): (bool, bool),
        next: f64,
    ) -> Result<Option<(u64, bool)>> {
        let (args, now) = (self.args, self.now);
        let rows = self.task.sparse_rows();
        let p = self.p;
        let vw = &mut self.workers[w];
        vw.seq += 1;
        vw.steps += 1;
        // The gradient travels as --push-dtype; the read echo as the values were pulled (already
        // representable in --pull-dtype, so that encoding is exact).
        let mut payload = grad[rows..].to_vec();
        gaps_common::dtype::round_trip(args.push_dtype, &mut payload);
        if needs_read {
            payload.extend_from_slice(&vw.view[rows..]);
        }
        let push = Push {
            epoch: 1,
            worker: w as u32,
            seq: vw.seq,
            chunks: vec![PushChunk { echo: needs_read, ..PushChunk::f32(CHUNK, vw.version, (p - rows) as u32) }],
            compute_ms,
            // The sim's single shard is also the coordinator: it knows every decision it made.
            step: vw.steps - 1,
            decisions: Default::default(),
            data: None,
        };
        // The shard's clock is the simulated time (auto's minimum time in a mode counts in it). Under `gba`
        // with a hold the worker sends a push-pull, as the real one does, and may be held for its step.
        let msg = if holds { Message::PushPull(push) } else { Message::Push(push) };
        let (reply, _) = self.core.handle(Frame { msg, payload }, self.durations.clock(now));
        let held =
            if holds { self.core.take_gba_hold().map(|until| self.durations.time_at_clock(until)) } else { None };
        let ack = match reply.msg {
            Message::Ack(ack) | Message::PushPullReply(gaps_common::wire::PushPullReply { ack, .. }) => ack,
            Message::Error(e) if e.code == gaps_common::ErrorCode::NonFinite => return Ok(None),
            other => bail!("the shard refused a push: {other:?}"),
        };
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            let b =
                Blocked { worker: w, step: ack.wait_for_step, clock: ack.wait_for_clock, duration: next, until: None };
            self.blocked.push(b);
        } else if let Some(until) = held {
            let step = self.core.global_step() + 1;
            self.blocked.push(Blocked { worker: w, step, clock: 0, duration: next, until: Some(until.max(now)) });
        } else {
            self.heap.push(Due { time: now + next, worker: w as u32 });
            let vw = &mut self.workers[w];
            vw.refresh(&mut self.core, self.task, &mut self.batches, args.pull_dtype)?;
            if vw.view.iter().any(|v| !v.is_finite()) {
                return Ok(Some((ack.max_staleness, false)));
            }
        }
        Ok(Some((ack.max_staleness, true)))
    }
}

/// The held worker (GBA's hold) whose hold ends first, if it ends by `next` (the next gradient's arrival).
pub(super) fn next_hold_to_end(blocked: &[Blocked], next: f64) -> Option<usize> {
    blocked
        .iter()
        .enumerate()
        .filter_map(|(i, b)| b.until.map(|u| (i, u)))
        .filter(|(_, u)| *u <= next)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
}

/// Lets every waiting worker whose condition now holds start its next batch at `now`, on fresh parameters.
#[allow(clippy::too_many_arguments)]
pub(super) fn release(
    core: &mut ShardCore,
    workers: &mut [VirtualWorker],
    blocked: &mut Vec<Blocked>,
    heap: &mut BinaryHeap<Due>,
    now: f64,
    wire: WireDtype,
    task: &dyn Task,
    batches: &mut Option<Batches>,
) -> Result<()> {
    if blocked.is_empty() {
        return Ok(());
    }
    let min_clock = core.stats().ssp_min_clock;
    let step = core.global_step();
    let mut still = Vec::new();
    let mut ready = Vec::new();
    for b in blocked.drain(..) {
        if step >= b.step && min_clock >= b.clock {
            ready.push(b);
        } else {
            still.push(b);
        }
    }
    for b in ready {
        workers[b.worker].refresh(core, task, batches, wire)?;
        heap.push(Due { time: now + b.duration, worker: b.worker as u32 });
    }
    *blocked = still;
    Ok(())
}
