//! The asynchronous event loop: each worker pushes when its batch is done, the earliest first; GBA holds and
//! `auto`'s switches ride on it (docs/ALGORITHMS.md §1).

use super::*;

pub(super) fn run_async(args: &SimArgs) -> Result<SimReport> {
    let (task, mut core, hyper) = setup(args)?;
    let initial_loss = task.evaluate(&master_params(&mut core, task.as_ref())?).1;
    let p = task.num_params();
    let n = args.workers as usize;
    let mut timing = Rng::new(mix(args.seed, 0x71e));
    let mut order_rng = Rng::new(mix(args.seed, 0x0d3));
    let durations = Durations::new(args)?;
    let rows = task.sparse_rows();
    let mut batches = (rows > 0).then(|| Batches::new(args.seed, task.train_size(), args.batch as usize));
    let (view, version) = pull(&mut core, args.pull_dtype)?;
    let new_worker = |w: usize, timing: &mut Rng, view: &[f32], version: u64| {
        let mut slowness = args.stragglers.iter().filter(|(s, _)| *s as usize == w).map(|(_, f)| *f).product::<f64>();
        if args.heterogeneity > 0.0 {
            let v2 = args.heterogeneity * args.heterogeneity;
            slowness *= timing.gamma(1.0 / v2, v2);
        }
        VirtualWorker {
            view: view.to_vec(),
            version,
            momentum: vec![0.0; p],
            seq: 0,
            slowness,
            duration: 0.0,
            alive: true,
            steps: 0,
            batch: Vec::new(),
            rows: Vec::new(),
            row_versions: Vec::new(),
        }
    };
    let mut workers: Vec<VirtualWorker> = (0..n).map(|w| new_worker(w, &mut timing, &view, version)).collect();
    for _ in 0..n {
        register(&mut core)?;
    }
    if batches.is_some() {
        for vw in &mut workers {
            vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
        }
    }
    let mut heap = BinaryHeap::with_capacity(n);
    for (w, vw) in workers.iter_mut().enumerate() {
        vw.duration = durations.draw(&mut timing, w, vw.slowness);
        heap.push(Due { time: vw.duration, worker: w as u32 });
    }
    let mut kills = args.kill_workers.clone();
    let mut adds = args.add_workers.clone();
    let mut blocked: Vec<Blocked> = Vec::new();
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
    let (mut gap_sum, mut now, mut diverged, mut events) = (0.0f64, 0.0f64, false, 0u64);
    for event in 0..total {
        if event % 256 == 0 && started.elapsed() > args.timeout {
            bail!("the simulation ran past --timeout {:?} at event {event} of {total}", args.timeout);
        }
        let epoch = event / batches_per_epoch as u64;
        let in_epoch = (event % batches_per_epoch as u64) as usize;
        if in_epoch == 0 && event > 0 {
            order = order_rng.permutation(task.train_size());
        }
        // Learning-rate multiplier: linear warm-up from 1/N to 1, then ×0.1 at each decay point; the
        // aggregating modes use the synchronous learning rate (linear scaling by N) unless told otherwise.
        let mut lr_scale =
            if event < warmup { (1.0 + (n as f64 - 1.0) * event as f64 / warmup as f64) / n as f64 } else { 1.0 };
        lr_scale *= 0.1f64.powi(decays.iter().filter(|d| event >= **d).count() as i32);
        if scaled {
            lr_scale *= n as f64;
        }
        core.set_lr_scale(lr_scale as f32).map_err(|e| anyhow!("{e}"))?;

        // Injected failures and arrivals happen at their virtual time, before the next batch finishes.
        let next_time = heap.peek().map_or(f64::INFINITY, |d: &Due| d.time);
        while let Some(k) = kills.iter().position(|(_, t)| *t <= next_time) {
            let (w, t) = kills.remove(k);
            if let Some(vw) = workers.get_mut(w as usize) {
                vw.alive = false;
                now = now.max(t);
                blocked.retain(|b| b.worker != w as usize);
                core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker: w })), Duration::ZERO);
            }
        }
        while let Some(a) = adds.iter().position(|t| *t <= next_time) {
            let t = adds.remove(a);
            register(&mut core)?;
            let (view, version) = pull(&mut core, args.pull_dtype)?;
            let w = workers.len();
            let mut vw = new_worker(w, &mut timing, &view, version);
            if batches.is_some() {
                vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            }
            vw.duration = durations.draw(&mut timing, w, vw.slowness);
            heap.push(Due { time: t + vw.duration, worker: w as u32 });
            workers.push(vw);
        }
        release(&mut core, &mut workers, &mut blocked, &mut heap, now, args.pull_dtype, task.as_ref(), &mut batches)?;
        // Held workers whose hold ends before the next gradient arrives go on at its end, on what a pull
        // reads then (nothing changed since the last event).
        while let Some(i) = next_hold_to_end(&blocked, heap.peek().map_or(f64::INFINITY, |d: &Due| d.time)) {
            let b = blocked.swap_remove(i);
            let until = b.until.unwrap_or(now);
            workers[b.worker].refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            heap.push(Due { time: until + b.duration, worker: b.worker as u32 });
        }
        // Entries of killed workers are skipped, so every event is one gradient.
        let due = loop {
            let Some(due) = heap.pop() else {
                bail!("every worker is waiting or gone at event {event} (mode {:?})", args.mode)
            };
            if workers[due.worker as usize].alive {
                break due;
            }
        };
        now = due.time;
        let w = due.worker as usize;
        let compute_ms = durations.millis(workers[w].duration).round().clamp(1.0, f64::from(u32::MAX)) as u32;
        let next = durations.draw(&mut timing, w, workers[w].slowness);
        workers[w].duration = next;

        let vw = &mut workers[w];
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
        let master = core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?;
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
            if !push_rows(&mut core, w as u32, vw.seq, ids, versions, &grad, &vw.view, needs_read, args.push_dtype)? {
                diverged = true;
                break;
            }
        }
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
            chunks: vec![PushChunk {
                id: CHUNK,
                read_version: vw.version,
                len: (p - rows) as u32,
                echo: needs_read,
                dtype: WireDtype::F32,
            }],
            compute_ms,
            // The sim's single shard is also the coordinator: it knows every decision it made.
            step: vw.steps - 1,
            decisions: Default::default(),
            data: None,
        };
        // The shard's clock is the simulated time (auto's minimum time in a mode counts in it). Under `gba`
        // with a hold the worker sends a push-pull, as the real one does, and may be held for its step.
        let msg = if holds { Message::PushPull(push) } else { Message::Push(push) };
        let (reply, _) = core.handle(Frame { msg, payload }, durations.clock(now));
        let held = if holds { core.take_gba_hold().map(|until| durations.time_at_clock(until)) } else { None };
        let ack = match reply.msg {
            Message::Ack(ack) | Message::PushPullReply(gaps_common::wire::PushPullReply { ack, .. }) => ack,
            Message::Error(e) if e.code == gaps_common::ErrorCode::NonFinite => {
                diverged = true;
                break;
            }
            other => bail!("the shard refused a push: {other:?}"),
        };
        let tau = ack.max_staleness;
        staleness.push(tau.min(u64::from(u32::MAX)) as u32);
        if ack.wait_for_step > 0 || ack.wait_for_clock > 0 {
            let b =
                Blocked { worker: w, step: ack.wait_for_step, clock: ack.wait_for_clock, duration: next, until: None };
            blocked.push(b);
        } else if let Some(until) = held {
            let step = core.global_step() + 1;
            blocked.push(Blocked { worker: w, step, clock: 0, duration: next, until: Some(until.max(now)) });
        } else {
            heap.push(Due { time: now + next, worker: w as u32 });
            let vw = &mut workers[w];
            vw.refresh(&mut core, task.as_ref(), &mut batches, args.pull_dtype)?;
            if vw.view.iter().any(|v| !v.is_finite()) {
                diverged = true;
                break;
            }
        }
        events += 1;
        if let Some(out) = csv.as_mut() {
            writeln!(out, "{event},{epoch},{now},{w},{tau},{loss},{},{gap}", core.lr())?;
        }
        evaluator.after(events, now, task.as_ref(), &mut core)?;
    }
    if let Some(mut out) = csv {
        out.flush()?;
    }
    let live = workers.iter().filter(|w| w.alive).count() as u32;
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
