//! The synchronous rounds: every live worker computes on the same parameters, the round ends with the
//! slowest, and the shard applies the round's aggregate.

use super::*;

/// Global-batch synchronous SGD (optionally elastic), driven through the shard's own sync mode: every
/// round, each of the N live virtual workers pulls, computes one gradient on the current parameters and
/// pushes it under its own worker id; the shard averages the round and applies it once, with its elastic
/// learning-rate multiplier ([`gaps_shard::modes::LrRamp`]: live / initial workers, ramped when the count
/// grows). Workers join and leave the shard with `Register` and `Leave`, as real ones do. The simulator
/// only sets the schedule's factor (warm-up from η to the scaled η, the decays, and the initial worker count
/// for linear scaling). A round takes as long as its slowest worker. The total number of gradients equals
/// the async run's.
pub(super) fn run_sync(args: &SimArgs) -> Result<SimReport> {
    let (task, mut core, _hyper) = setup(args)?;
    let initial_loss = task.evaluate(&master_params(&mut core, task.as_ref())?).1;
    let p = task.num_params();
    let rows = task.sparse_rows();
    let mut timing = Rng::new(mix(args.seed, 0x71e));
    let mut order_rng = Rng::new(mix(args.seed, 0x0d3));
    let durations = Durations::new(args)?;
    let Schedule { batches_per_epoch, total, warmup, decays } = Schedule::new(args, task.as_ref());
    let workers_at = |gradients: u64| elastic_workers(args, batches_per_epoch, gradients);
    let needs_read = args.rule.layout().needs_read;
    let mut csv = open_csv(args)?;
    let mut evaluator = Evaluator::new(args, batches_per_epoch);
    let started = Instant::now();
    let mut order = order_rng.permutation(task.train_size());
    let (mut used, mut now, mut diverged, mut rounds) = (0usize, 0.0f64, false, 0u64);
    let mut gradients = 0u64;
    let mut grad = vec![0.0f32; p];
    let mut round_view = vec![0.0f32; if rows > 0 { p } else { 0 }];
    // The live workers' ids (as the shard handed them out) and sequence numbers, in join order; the slot in
    // this list picks a worker's straggler factor.
    let mut live: Vec<(u32, u64)> = Vec::new();
    let initial = workers_at(0);
    while gradients < total {
        if rounds % 64 == 0 && started.elapsed() > args.timeout {
            bail!("the simulation ran past --timeout {:?}", args.timeout);
        }
        // The last round may be short: the workers without data leave, as at the end of a real job.
        let wanted = (u64::from(workers_at(gradients))).min(total - gradients) as usize;
        resize(&mut core, &mut live, wanted)?;
        // The shard scales η by live / initial workers; the schedule's factor supplies the rest: the initial
        // count for linear scaling (so η·N in all), warmed up from η, and the decays. Without linear scaling
        // the factor divides the shard's multiplier back out.
        let warm = if args.linear_scaling {
            f64::from(initial) * schedule(gradients, warmup, 1.0 / f64::from(initial), &decays)
        } else {
            schedule(gradients, warmup, 1.0, &decays) / core.lr_multiplier()
        };
        core.set_lr_scale(warm as f32).map_err(|e| anyhow!("{e}"))?;
        let (params, version) = pull(&mut core, args.pull_dtype)?;
        // An embedding task's view: the dense part, and each worker's rows as it pulls them.
        if rows > 0 {
            round_view[rows..].copy_from_slice(&params);
        }
        let (mut slowest, mut loss_sum) = (0.0f64, 0.0f32);
        for (slot, (worker, seq)) in live.iter_mut().enumerate() {
            let (from, to) = next_batch(&mut order, &mut used, &mut order_rng, args.batch as usize);
            let batch = &order[from..to];
            // An embedding task's worker pulls its batch's rows into the round's view (rows do not change
            // within a round: the shard applies the round's row sums when the step ends).
            let (ids, row_versions) = if rows > 0 {
                let ids = task.batch_rows(batch);
                let versions = pull_rows_into(&mut core, args.pull_dtype, &ids, &mut round_view)?;
                (ids, versions)
            } else {
                (Vec::new(), Vec::new())
            };
            let view = if rows > 0 { &round_view[..] } else { &params[..] };
            let loss = task.loss_grad(view, batch, gradients, &mut grad);
            loss_sum += loss;
            gradients += 1;
            let slowness =
                args.stragglers.iter().filter(|(s, _)| *s as usize == slot).map(|(_, f)| *f).product::<f64>();
            let duration = durations.draw(&mut timing, slot, slowness);
            slowest = slowest.max(duration);
            if !loss.is_finite() || grad.iter().any(|g| !g.is_finite()) {
                diverged = true;
                break;
            }
            if rows > 0 {
                *seq += 1;
                if !push_rows(&mut core, *worker, *seq, &ids, &row_versions, &grad, view, needs_read, args.push_dtype)?
                {
                    diverged = true;
                    break;
                }
            }
            *seq += 1;
            let compute_ms = durations.millis(duration).round().clamp(1.0, f64::from(u32::MAX)) as u32;
            push_dense(&mut core, (*worker, *seq), &grad[rows..], (&params, version), needs_read, args, compute_ms)?;
        }
        if diverged {
            break;
        }
        now += slowest;
        if let Some(out) = csv.as_mut() {
            let (epoch, loss) = (gradients / batches_per_epoch as u64, loss_sum / live.len() as f32);
            writeln!(out, "{rounds},{epoch},{now},{},0,{loss},{},0", live.len(), core.lr())?;
        }
        rounds += 1;
        if core.chunk_values(CHUNK).map_err(|e| anyhow!("{e}"))?.iter().any(|v| !v.is_finite()) {
            diverged = true;
            break;
        }
        evaluator.after(gradients, now, task.as_ref(), &mut core)?;
    }
    if let Some(mut out) = csv {
        out.flush()?;
    }
    let steps = core.stats().steps_sync;
    if !diverged && steps != rounds {
        bail!("the shard completed {steps} synchronous steps for {rounds} rounds");
    }
    let staleness = vec![0u32; rounds as usize];
    let outcome = Outcome {
        staleness,
        gap_sum: 0.0,
        now,
        diverged,
        events: rounds,
        started,
        gradients,
        evaluator,
        durations,
        initial_loss,
    };
    let mut report = finish(args, task.as_ref(), &mut core, outcome)?;
    report.workers_final = live.len() as u32;
    Ok(report)
}

/// Workers leave (the newest first) or register until `wanted` are live.
fn resize(core: &mut ShardCore, live: &mut Vec<(u32, u64)>, wanted: usize) -> Result<()> {
    while live.len() > wanted {
        if let Some((worker, _)) = live.pop() {
            core.handle(Frame::new(Message::Leave(gaps_common::wire::Leave { worker })), Duration::ZERO);
        }
    }
    while live.len() < wanted {
        live.push((register(core)?, 0));
    }
    Ok(())
}

/// Where the next batch of `batch` samples lies in `order` (`from..to`), drawing a new order when the epoch's
/// is used up.
fn next_batch(order: &mut Vec<u32>, used: &mut usize, order_rng: &mut Rng, batch: usize) -> (usize, usize) {
    if *used + batch > order.len() {
        *order = order_rng.permutation(order.len());
        *used = 0;
    }
    *used += batch;
    (*used - batch, *used)
}

/// Pushes a worker's dense gradient `grad` (with the parameters it read echoed where the rule needs them)
/// as `(worker, seq)`, computed on `read` (the values and their version) in `compute_ms`.
fn push_dense(
    core: &mut ShardCore,
    (worker, seq): (u32, u64),
    grad: &[f32],
    read: (&[f32], u64),
    needs_read: bool,
    args: &SimArgs,
    compute_ms: u32,
) -> Result<()> {
    let (params, version) = read;
    let mut payload = grad.to_vec();
    gaps_common::dtype::round_trip(args.push_dtype, &mut payload);
    if needs_read {
        payload.extend_from_slice(params);
    }
    let chunk =
        PushChunk { id: CHUNK, read_version: version, len: grad.len() as u32, echo: needs_read, dtype: WireDtype::F32 };
    let push = Push { compute_ms, ..Push::new(1, worker, seq, vec![chunk]) };
    let (reply, _) = core.handle(Frame { msg: Message::Push(push), payload }, Duration::ZERO);
    if !matches!(reply.msg, Message::Ack(_)) {
        bail!("the shard refused a push: {:?}", reply.msg);
    }
    Ok(())
}

/// How many workers are live after `gradients` (`--elastic`: the list's counts in turn, `--elastic-every`
/// epochs each; else `--workers`).
fn elastic_workers(args: &SimArgs, batches_per_epoch: usize, gradients: u64) -> u32 {
    if args.elastic.is_empty() {
        return args.workers;
    }
    let phase = gradients / (batches_per_epoch as u64 * u64::from(args.elastic_every));
    args.elastic[(phase % args.elastic.len() as u64) as usize]
}
